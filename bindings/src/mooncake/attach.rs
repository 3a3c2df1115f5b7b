//! What a set-up compatible client is attached to, and how it attaches: an embedded store of
//! this process or a `kvtier-l3` server, with the client's global segment mounted in it.
//!
//! Why apart from the Python-facing core: setting up is plain Rust (no GIL, no Python
//! types); the core only turns the outcome into Mooncake's integer.

use std::sync::Arc;

use kvtier_l3::ha::Locator;
use kvtier_l3::{ClientOptions, EmbeddedStore, L3Result, L3Store, RemoteStore, Tenant};

use super::segment::Contribution;
use crate::fork::Owner;
use crate::l3::{shared_embedded, store_config};

/// What a set-up client is attached to.
pub(super) struct Attached {
    pub(super) store: Arc<dyn L3Store>,
    pub(super) embedded: Option<Arc<EmbeddedStore>>,
    /// A server client (its shared-memory path backs a dummy client's pool).
    pub(super) remote: Option<Arc<RemoteStore>>,
    pub(super) tenant: Tenant,
    /// Dropped (unmounted) on close, before the store handle.
    pub(super) segment: Option<Contribution>,
    /// In a child forked after, calls are refused and nothing is torn down (`fork.rs`).
    pub(super) owner: Owner,
}

impl Drop for Attached {
    fn drop(&mut self) {
        if !self.owner.is_here() {
            std::mem::forget((self.segment.take(), self.store.clone()));
            std::mem::forget((self.embedded.clone(), self.remote.clone()));
        }
    }
}

/// A tenant from its name (-600's error for a bad one).
pub(super) fn tenant_of(name: &str) -> L3Result<Tenant> {
    Tenant::new(name)
}

impl Attached {
    /// The embedded store `name` of this process (created with `lease_ttl_ms` if missing),
    /// with a segment of `segment_bytes` named `hostname` mounted (none if 0).
    pub(super) fn embedded(
        name: &str,
        segment_bytes: u64,
        tenant: Tenant,
        hostname: &str,
        lease_ttl_ms: u64,
    ) -> L3Result<Self> {
        let cfg = store_config(0, lease_ttl_ms, 1 << 30, 65_536, None, None);
        let s = shared_embedded(name, cfg)?;
        let store: Arc<dyn L3Store> = s.clone();
        let segment = (segment_bytes > 0)
            .then(|| Contribution::mount(store.clone(), segment_bytes, hostname))
            .transpose()?;
        Ok(Attached {
            store,
            embedded: Some(s),
            remote: None,
            tenant,
            segment,
            owner: Owner::here(),
        })
    }

    /// The store behind a `kvtier.L3Store` handle (no segment of this client's).
    pub(super) fn over(store: Arc<dyn L3Store>, tenant: Tenant) -> Self {
        Attached {
            store,
            embedded: None,
            remote: None,
            tenant,
            segment: None,
            owner: Owner::here(),
        }
    }

    /// A `kvtier-l3` server (or the leader of an HA cluster). With `segment_bytes > 0` the
    /// client mounts a segment of that many bytes named `hostname` in a `--role both`
    /// server (Mooncake's model: puts may land there, a put asking for several replicas
    /// spreads them over distinct clients' segments, the segment's objects go when the
    /// client closes); the server holds its bytes, as it does for a dummy client. A split
    /// deployment's master or an HA cluster gets none (its bytes would live in no store node,
    /// or be lost with a leader).
    pub(super) fn remote(
        at: Locator,
        tenant: Tenant,
        token: Option<String>,
        segment_bytes: u64,
        hostname: &str,
    ) -> L3Result<Self> {
        let opts = ClientOptions {
            token,
            ..ClientOptions::default()
        };
        let s = Arc::new(RemoteStore::connect_to(at, opts)?);
        let store: Arc<dyn L3Store> = s.clone();
        let segment = (segment_bytes > 0 && !s.is_cluster() && !s.follows_leader())
            .then(|| Contribution::mount(store.clone(), segment_bytes, hostname))
            .transpose()?;
        Ok(Attached {
            store,
            embedded: None,
            remote: Some(s),
            tenant,
            segment,
            owner: Owner::here(),
        })
    }
}
