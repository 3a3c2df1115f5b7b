//! The tarpc server: an [`EmbeddedStore`] behind the [`L3Rpc`] service, plus the loopback
//! Prometheus endpoint.
//!
//! Why these choices:
//! - Loopback by default: the store has no per-tenant authentication beyond the optional
//!   shared-secret token, so exposure beyond the host is an explicit operator decision.
//! - Frame limit raised to 64 MiB by default (tokio-util's default is 8 MiB, too small for a
//!   batch of 1 MiB objects); clients split batches below it and learn it from `hello`.
//! - Data-moving calls run on the blocking pool so a large memcpy or SSD read never stalls
//!   the reactor; metadata-only calls (exist, query, ping) run inline for latency.
//! - A malformed or oversized frame only closes *that* connection (tarpc/tokio-util reject
//!   it); the listener and other connections keep serving.
//! - Shutdown stops accepting, then flushes the SSD queue, so every put acknowledged as
//!   persisted (and every queued write-through) is on disk before the process exits.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::prelude::*;
use tarpc::context::Context;
use tarpc::server::{self, Channel};
use tarpc::tokio_serde::formats::Bincode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use super::service::{L3Rpc, ServerLimits, WireBatch};
use super::xfer::XferServer;
use crate::api::L3Store;
use crate::error::{L3Error, L3Result};
use crate::store::EmbeddedStore;
use crate::types::{
    Blob, ClientId, ClientStatus, ExistOptions, PutHandle, PutOptions, QueryResult, SegmentId,
    StoreStats, Tenant,
};

/// Default frame limit (above tarpc's 8 MiB default).
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;

/// How to serve.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// RPC listen address (default 127.0.0.1:0, an ephemeral port).
    pub addr: SocketAddr,
    /// Shared-secret token clients must present in `hello` (None = no token).
    pub token: Option<String>,
    /// Largest frame accepted or sent.
    pub max_frame_bytes: usize,
    /// Prometheus endpoint (None = off). Must be a loopback address.
    pub metrics_addr: Option<SocketAddr>,
    /// Also serve the transfer channel (bulk reads, batched probes) on an ephemeral port
    /// of the same address; advertised to clients by `hello`.
    pub transfer_channel: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: None,
            max_frame_bytes: DEFAULT_MAX_FRAME,
            metrics_addr: None,
            transfer_channel: true,
        }
    }
}

#[derive(Clone)]
struct Conn {
    store: Arc<EmbeddedStore>,
    token: Option<Arc<str>>,
    authed: Arc<AtomicBool>,
    limits: ServerLimits,
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Conn {
    fn auth(&self) -> L3Result<()> {
        if self.authed.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(L3Error::IllegalClient(
                "call hello (with the token) first".into(),
            ))
        }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&EmbeddedStore) -> L3Result<T> + Send + 'static,
    ) -> L3Result<T> {
        self.auth()?;
        let s = self.store.clone();
        tokio::task::spawn_blocking(move || f(&s))
            .await
            .map_err(|e| L3Error::Internal(format!("worker failed: {e}")))?
    }
}

impl L3Rpc for Conn {
    async fn hello(self, _: Context, token: Option<String>) -> L3Result<ServerLimits> {
        let ok = match (&self.token, &token) {
            (None, _) => true,
            (Some(want), Some(got)) => ct_eq(want.as_bytes(), got.as_bytes()),
            (Some(_), None) => false,
        };
        if !ok {
            return Err(L3Error::IllegalClient("bad token".into()));
        }
        self.authed.store(true, Ordering::Release);
        Ok(self.limits)
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
        self.blocking(move |s| s.batch_get_with_query_blobs(&tenant, &queries))
            .await
    }

    async fn remove(self, _: Context, tenant: Tenant, key: String, force: bool) -> L3Result<()> {
        self.auth()?;
        self.store.remove(&tenant, &key, force)
    }

    async fn remove_all(self, _: Context, tenant: Tenant, force: bool) -> L3Result<u64> {
        self.blocking(move |s| s.remove_all(&tenant, force)).await
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
        self.blocking(move |s| s.batch_get_blobs(&tenant, &keys))
            .await
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
}

/// A running server. Dropping it (or [`ServerHandle::shutdown`]) stops accepting and flushes
/// the store's SSD queue.
pub struct ServerHandle {
    /// Bound RPC address.
    pub addr: SocketAddr,
    /// Bound metrics address.
    pub metrics_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    store: Arc<EmbeddedStore>,
    rt: Option<tokio::runtime::Runtime>,
}

impl ServerHandle {
    /// Stops accepting connections, then flushes queued SSD writes.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let _ = self.stop.send(true);
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(std::time::Duration::from_secs(2));
        }
        let _ = self.store.flush();
    }

    /// The served store.
    pub fn store(&self) -> &Arc<EmbeddedStore> {
        &self.store
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Starts a server on its own runtime (2 worker threads) and returns once it listens.
pub fn spawn_server(store: Arc<EmbeddedStore>, opts: ServerOptions) -> L3Result<ServerHandle> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvtier-l3-server")
        .enable_all()
        .build()
        .map_err(|e| L3Error::Internal(format!("runtime: {e}")))?;
    let (stop, stop_rx) = watch::channel(false);
    let (addr, metrics_addr) = rt.block_on(start(store.clone(), opts, stop_rx))?;
    Ok(ServerHandle {
        addr,
        metrics_addr,
        stop,
        store,
        rt: Some(rt),
    })
}

/// Binds and spawns the RPC listener (and metrics endpoint) on the current runtime; both
/// stop when `stop` turns true. Returns the bound addresses.
pub async fn start(
    store: Arc<EmbeddedStore>,
    opts: ServerOptions,
    stop: watch::Receiver<bool>,
) -> L3Result<(SocketAddr, Option<SocketAddr>)> {
    let mut listener = tarpc::serde_transport::tcp::listen(opts.addr, Bincode::default)
        .await
        .map_err(|e| L3Error::Unavailable(format!("bind {}: {e}", opts.addr)))?;
    listener.config_mut().max_frame_length(opts.max_frame_bytes);
    let addr = listener.local_addr();
    let cfg = store.config();
    let token: Option<Arc<str>> = opts.token.as_deref().map(Arc::from);
    let xfer = if opts.transfer_channel {
        let x = XferServer::start(
            store.clone(),
            SocketAddr::new(addr.ip(), 0),
            token.clone(),
            opts.max_frame_bytes,
        )?;
        Some(x)
    } else {
        None
    };
    let limits = ServerLimits {
        max_frame_bytes: opts.max_frame_bytes as u64,
        max_batch_keys: cfg.max_batch_keys as u64,
        max_object_bytes: cfg.max_object_bytes,
        xfer_port: xfer.as_ref().map(|x| x.addr.port()).unwrap_or(0),
    };
    if let Some(x) = xfer {
        let mut stop_x = stop.clone();
        tokio::spawn(async move {
            let _ = stop_x.wait_for(|s| *s).await;
            let _ = tokio::task::spawn_blocking(move || drop(x)).await;
        });
    }
    let st = store.clone();
    let mut stop_rpc = stop.clone();
    tokio::spawn(async move {
        let serve = listener
            .filter_map(|r| future::ready(r.ok()))
            .for_each(move |transport| {
                let _ = transport.get_ref().set_nodelay(true);
                let conn = Conn {
                    store: st.clone(),
                    token: token.clone(),
                    authed: Arc::new(AtomicBool::new(false)),
                    limits,
                };
                let channel = server::BaseChannel::with_defaults(transport);
                tokio::spawn(channel.execute(conn.serve()).for_each(|fut| async move {
                    tokio::spawn(fut);
                }));
                future::ready(())
            });
        tokio::select! {
            _ = serve => {}
            _ = stop_rpc.wait_for(|s| *s) => {}
        }
    });
    let metrics_addr = match opts.metrics_addr {
        None => None,
        Some(m) => Some(start_metrics(store, m, stop).await?),
    };
    Ok((addr, metrics_addr))
}

async fn start_metrics(
    store: Arc<EmbeddedStore>,
    addr: SocketAddr,
    mut stop: watch::Receiver<bool>,
) -> L3Result<SocketAddr> {
    if !addr.ip().is_loopback() {
        return Err(L3Error::InvalidParams(
            "metrics endpoint must be on loopback".into(),
        ));
    }
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| L3Error::Unavailable(format!("bind metrics {addr}: {e}")))?;
    let bound = l
        .local_addr()
        .map_err(|e| L3Error::Internal(e.to_string()))?;
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = l.accept() => a,
                _ = stop.wait_for(|s| *s) => return,
            };
            let Ok((mut sock, _)) = accepted else {
                continue;
            };
            let store = store.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = sock.read(&mut buf).await;
                let body = store.render_metrics();
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    Ok(bound)
}
