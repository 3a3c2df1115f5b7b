//! One tarpc connection's [`L3Rpc`] service over a [`Backend`]: authentication by `hello`,
//! then each call mapped onto the backend's [`L3Store`](crate::L3Store) methods.
//!
//! Why this shape:
//! - Data-moving calls run on the blocking pool so a large memcpy or SSD read never stalls
//!   the reactor; metadata-only calls (exist, query, ping) run inline for latency.
//! - Every call but `hello` is refused until `hello` presented the token (compared in
//!   constant time); the flag is per connection, and with it go the connection's frame
//!   limit and its place among the unauthenticated connections (`limits`).

use std::sync::Arc;

use tarpc::context::Context;

use crate::error::{L3Error, L3Result};
use crate::master::{LossCursor, Losses};
use crate::rpc::accept::{TokenDigest, token_ok};
use crate::rpc::service::{
    ClusterReply, ClusterRequest, Hello, L3Rpc, ServerLimits, WireBatch, check_protocol,
};
use crate::rpc::shm::ShmOffer;
use crate::types::{
    Blob, ClientId, ClientStatus, ExistOptions, PutHandle, PutOptions, QueryResult,
    ReplicaDescriptor, ReplicateConfig, SegmentId, StoreStats, Tenant,
};

use super::Backend;
use super::limits::ConnState;
use super::refusals::EveryLog;

/// Refused `hello`s of another protocol version, warned of at most once per 10 s.
static VERSION_REFUSALS: EveryLog = EveryLog::new(std::time::Duration::from_secs(10));

pub(super) struct Conn<B> {
    pub(super) store: Arc<B>,
    pub(super) token: Option<TokenDigest>,
    pub(super) state: Arc<ConnState>,
    pub(super) limits: ServerLimits,
    /// The protocol version this server speaks (and announces).
    pub(super) version: u32,
    pub(super) shm: Arc<Option<ShmOffer>>,
}

impl<B> Clone for Conn<B> {
    fn clone(&self) -> Self {
        Conn {
            store: self.store.clone(),
            token: self.token,
            state: self.state.clone(),
            limits: self.limits,
            version: self.version,
            shm: self.shm.clone(),
        }
    }
}

impl<B: Backend> Conn<B> {
    fn auth(&self) -> L3Result<()> {
        if self.state.is_authed() {
            self.store.gate()
        } else {
            Err(L3Error::IllegalClient(
                "call hello (with the token) first".into(),
            ))
        }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&B) -> L3Result<T> + Send + 'static,
    ) -> L3Result<T> {
        self.auth()?;
        let s = self.store.clone();
        let r = tokio::task::spawn_blocking(move || f(&s))
            .await
            .map_err(|e| L3Error::Internal(format!("worker failed: {e}")))?;
        // A leader that lost its lease while the call ran does not answer it.
        self.store.gate()?;
        r
    }
}

impl<B: Backend> L3Rpc for Conn<B> {
    async fn hello(self, _: Context, token: Option<String>, version: u32) -> L3Result<Hello> {
        // First, so a peer of another version is told so (whatever its token): nothing else
        // it sends could be read right. The connection stays unauthenticated.
        if let Err(e) = check_protocol(version, self.version) {
            // Rate-limited: a peer left on another release redials for as long as it runs.
            if let Some(more) = VERSION_REFUSALS.note(std::time::Instant::now()) {
                tracing::warn!(
                    error = %e,
                    refused_since_last_warning = more,
                    "refused a client of another protocol version (warned of at most once \
                     per {} s)",
                    VERSION_REFUSALS.every().as_secs()
                );
            }
            return Err(e);
        }
        let ok = token_ok(self.token.as_ref(), token.as_deref());
        if !ok {
            return Err(L3Error::IllegalClient("bad token".into()));
        }
        self.store.gate()?;
        if !self.state.authenticate() {
            return Err(L3Error::IllegalClient(
                "connection closed: too many connections waiting for their hello".into(),
            ));
        }
        Hello::new(self.version, &self.limits)
    }

    async fn put_start(
        self,
        _: Context,
        tenant: Tenant,
        key: String,
        size: u64,
    ) -> L3Result<PutHandle> {
        self.auth()?;
        self.store.put_start(&tenant, &key, size)
    }

    async fn put_write(self, _: Context, handle: PutHandle, data: Blob) -> L3Result<()> {
        self.blocking(move |s| s.put_write(&handle, data.as_slice()))
            .await
    }

    async fn put_end(self, _: Context, handle: PutHandle, opts: PutOptions) -> L3Result<()> {
        self.blocking(move |s| s.put_end(&handle, opts)).await
    }

    async fn put_revoke(self, _: Context, handle: PutHandle) -> L3Result<()> {
        self.auth()?;
        self.store.put_revoke(&handle)
    }

    async fn batch_put_start(
        self,
        _: Context,
        tenant: Tenant,
        keys: Vec<String>,
        sizes: Vec<u64>,
    ) -> WireBatch<PutHandle> {
        self.blocking(move |s| s.batch_put_start(&tenant, &keys, &sizes))
            .await
    }

    async fn batch_put_end(
        self,
        _: Context,
        handles: Vec<PutHandle>,
        opts: PutOptions,
    ) -> WireBatch<()> {
        self.blocking(move |s| s.batch_put_end(&handles, opts))
            .await
    }

    async fn batch_put_revoke(self, _: Context, handles: Vec<PutHandle>) -> WireBatch<()> {
        self.auth()?;
        self.store.batch_put_revoke(&handles)
    }

    async fn batch_query(
        self,
        _: Context,
        tenant: Tenant,
        keys: Vec<String>,
    ) -> WireBatch<QueryResult> {
        self.auth()?;
        self.store.batch_query(&tenant, &keys)
    }

    async fn batch_exist(
        self,
        _: Context,
        tenant: Tenant,
        keys: Vec<String>,
        opts: ExistOptions,
    ) -> WireBatch<bool> {
        self.auth()?;
        self.store.batch_exist_key(&tenant, &keys, opts)
    }

    async fn batch_get_with_query(
        self,
        _: Context,
        tenant: Tenant,
        queries: Vec<QueryResult>,
    ) -> WireBatch<Blob> {
        self.blocking(move |s| s.get_with_query_blobs(&tenant, &queries))
            .await
    }

    async fn remove(self, _: Context, tenant: Tenant, key: String, force: bool) -> L3Result<()> {
        // Blocking pool: a remove syncs its SSD tombstone before it is acknowledged.
        self.blocking(move |s| s.remove(&tenant, &key, force)).await
    }

    async fn remove_all(self, _: Context, tenant: Tenant, force: bool) -> L3Result<u64> {
        self.blocking(move |s| s.remove_all(&tenant, force)).await
    }

    async fn remove_by_regex(
        self,
        _: Context,
        tenant: Tenant,
        pattern: String,
        force: bool,
    ) -> L3Result<u64> {
        // Blocking pool: the removes sync their SSD tombstones before the reply.
        self.blocking(move |s| s.remove_by_regex(&tenant, &pattern, force))
            .await
    }

    async fn copy_replica(
        self,
        _: Context,
        tenant: Tenant,
        key: String,
        target: SegmentId,
    ) -> L3Result<bool> {
        self.blocking(move |s| s.copy_replica(&tenant, &key, target))
            .await
    }

    async fn move_replica(
        self,
        _: Context,
        tenant: Tenant,
        key: String,
        source: SegmentId,
        target: SegmentId,
    ) -> L3Result<()> {
        self.blocking(move |s| s.move_replica(&tenant, &key, source, target))
            .await
    }

    async fn batch_replica_clear(
        self,
        _: Context,
        tenant: Tenant,
        keys: Vec<String>,
        segment: SegmentId,
    ) -> WireBatch<bool> {
        // Blocking pool: an object that goes with its last replica syncs its SSD tombstones.
        self.blocking(move |s| s.batch_replica_clear(&tenant, &keys, segment))
            .await
    }

    async fn mount_segment(
        self,
        _: Context,
        client: ClientId,
        segment: SegmentId,
        capacity: u64,
    ) -> L3Result<()> {
        self.auth()?;
        self.store.mount_segment(client, segment, capacity)
    }

    async fn unmount_segment(
        self,
        _: Context,
        client: ClientId,
        segment: SegmentId,
    ) -> L3Result<()> {
        self.auth()?;
        self.store.unmount_segment(client, segment)
    }

    async fn ping(self, _: Context, client: ClientId) -> L3Result<ClientStatus> {
        self.auth()?;
        self.store.ping(client)
    }

    async fn batch_put(
        self,
        _: Context,
        tenant: Tenant,
        keys: Vec<String>,
        data: Vec<Blob>,
        opts: PutOptions,
    ) -> WireBatch<()> {
        self.blocking(move |s| {
            let refs: Vec<&[u8]> = data.iter().map(Blob::as_slice).collect();
            s.batch_put_from(&tenant, &keys, &refs, opts)
        })
        .await
    }

    async fn batch_get(self, _: Context, tenant: Tenant, keys: Vec<String>) -> WireBatch<Blob> {
        self.blocking(move |s| s.get_blobs(&tenant, &keys)).await
    }

    async fn get_size(self, _: Context, tenant: Tenant, key: String) -> L3Result<u64> {
        self.auth()?;
        self.store.get_size(&tenant, &key)
    }

    async fn flush(self, _: Context) -> L3Result<()> {
        self.blocking(|s| s.flush()).await
    }

    async fn stats(self, _: Context) -> L3Result<StoreStats> {
        self.auth()?;
        self.store.stats()
    }

    async fn losses_since(
        self,
        _: Context,
        tenant: Tenant,
        cursor: Option<LossCursor>,
    ) -> L3Result<Losses> {
        self.auth()?;
        self.store.losses_since(&tenant, cursor)
    }

    async fn shm_offer(self, _: Context) -> L3Result<Option<ShmOffer>> {
        self.auth()?;
        Ok((*self.shm).clone())
    }

    async fn cluster(self, _: Context, req: ClusterRequest) -> L3Result<ClusterReply> {
        self.blocking(move |s| s.cluster(req)).await
    }

    async fn batch_put_start_replicated(
        self,
        _: Context,
        tenant: Tenant,
        keys: Vec<String>,
        sizes: Vec<u64>,
        cfg: ReplicateConfig,
    ) -> WireBatch<(PutHandle, Vec<ReplicaDescriptor>)> {
        let v = self
            .blocking(move |s| s.batch_put_start_with(&tenant, &keys, &sizes, cfg))
            .await?;
        Ok(v.into_iter()
            .map(|r| {
                r.map(|mut h| {
                    let extra = std::mem::take(&mut h.extra_replicas);
                    (h, extra)
                })
            })
            .collect())
    }
}
