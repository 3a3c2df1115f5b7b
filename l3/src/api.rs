//! The one trait every L3 store implements: [`crate::EmbeddedStore`] (in-process, the
//! default for the scheduler and simulator) and [`crate::RemoteStore`] (tarpc client).
//!
//! Why synchronous: the scheduler and the simulator are synchronous loops; an embedded store
//! needs no runtime at all, and the remote client hides its own small tokio runtime. Batch
//! calls return `Ok(per-key results)` — the outer error is for the whole call (too many keys,
//! mismatched lengths, transport failure), the inner one for each key, as in Mooncake.
//!
//! Mooncake names → methods: PutStart/PutEnd/PutRevoke → `put_start`/`put_end`/`put_revoke`
//! (+ `batch_*`), GetReplicaList → `get_replica_list`, ExistKey → `exist_key`, BatchQuery →
//! `batch_query`, batch_get_buffer_with_query_results → `batch_get_with_query`, Remove,
//! RemoveAll, MountSegment, UnmountSegment, Ping; client level: put, get, batch_put_from,
//! batch_get_into, is_exist, batch_is_exist, get_size.

use crate::error::{L3Error, L3Result};
use crate::master::{LossCursor, Losses};
use crate::types::{
    ClientId, ClientStatus, ExistOptions, PutHandle, PutOptions, QueryResult, ReplicateConfig,
    SegmentId, StoreStats, Tenant,
};

/// Per-key results of a batch call.
pub type BatchResult<T> = L3Result<Vec<L3Result<T>>>;

/// The result of a one-key batch call; `empty` is the error for a reply that holds none.
pub(crate) fn single<T>(mut results: Vec<L3Result<T>>, empty: fn() -> L3Error) -> L3Result<T> {
    results.pop().unwrap_or_else(|| Err(empty()))
}

/// The error for a one-key batch that returned no result.
fn empty_batch() -> L3Error {
    L3Error::Internal("empty batch result".into())
}

/// Mooncake Store's operations.
pub trait L3Store: Send + Sync {
    // ---- master-level ---------------------------------------------------------------------

    /// `PutStart`: reserve a memory replica for `size` bytes. First writer wins (-705).
    fn put_start(&self, tenant: &Tenant, key: &str, size: u64) -> L3Result<PutHandle>;
    /// Write the whole object into the replica reserved by `put_start`.
    fn put_write(&self, handle: &PutHandle, data: &[u8]) -> L3Result<()>;
    /// `PutEnd`: the object becomes visible (and is queued for SSD in write-through mode).
    fn put_end(&self, handle: &PutHandle, opts: PutOptions) -> L3Result<()>;
    /// `PutRevoke`: abandon a pending put.
    fn put_revoke(&self, handle: &PutHandle) -> L3Result<()>;
    /// `PutStart` with a [`ReplicateConfig`]: `replica_num` memory replicas on distinct
    /// nodes in a split deployment (best effort, at least one; see the type). The handle
    /// names them all; `put_write`/`put_end` write and end every one.
    fn put_start_with(
        &self,
        tenant: &Tenant,
        key: &str,
        size: u64,
        cfg: ReplicateConfig,
    ) -> L3Result<PutHandle> {
        cfg.validate()?;
        if cfg.replica_num == 1 {
            return self.put_start(tenant, key, size);
        }
        let v = self.batch_put_start_with(tenant, &[key.to_string()], &[size], cfg)?;
        single(v, empty_batch)
    }
    /// `BatchPutStart` (one replica each).
    fn batch_put_start(
        &self,
        tenant: &Tenant,
        keys: &[String],
        sizes: &[u64],
    ) -> BatchResult<PutHandle> {
        self.batch_put_start_with(tenant, keys, sizes, ReplicateConfig::default())
    }
    /// `BatchPutStart` with a [`ReplicateConfig`] (-600 for the whole call if it is invalid).
    fn batch_put_start_with(
        &self,
        tenant: &Tenant,
        keys: &[String],
        sizes: &[u64],
        cfg: ReplicateConfig,
    ) -> BatchResult<PutHandle>;
    /// `BatchPutEnd`.
    fn batch_put_end(&self, handles: &[PutHandle], opts: PutOptions) -> BatchResult<()>;
    /// `BatchPutRevoke`.
    fn batch_put_revoke(&self, handles: &[PutHandle]) -> BatchResult<()>;
    /// `GetReplicaList`: replica descriptors; takes a read lease.
    fn get_replica_list(&self, tenant: &Tenant, key: &str) -> L3Result<QueryResult>;
    /// `BatchGetReplicaList`: the same as `batch_query`.
    fn batch_get_replica_list(&self, tenant: &Tenant, keys: &[String]) -> BatchResult<QueryResult> {
        self.batch_query(tenant, keys)
    }
    /// `ExistKey`: never takes or renews a lease; may trigger promotion.
    fn exist_key(&self, tenant: &Tenant, key: &str, opts: ExistOptions) -> L3Result<bool> {
        let v = self.batch_exist_key(tenant, &[key.to_string()], opts)?;
        single(v, empty_batch)
    }
    /// `BatchExistKey`.
    fn batch_exist_key(
        &self,
        tenant: &Tenant,
        keys: &[String],
        opts: ExistOptions,
    ) -> BatchResult<bool>;
    /// `BatchQuery`: descriptors plus lease deadline, for a later [`L3Store::batch_get_with_query`].
    fn batch_query(&self, tenant: &Tenant, keys: &[String]) -> BatchResult<QueryResult>;
    /// Reads objects into `bufs` reusing earlier query results while their leases hold;
    /// a key whose lease expired is rejected with -707 (the others are still served).
    fn batch_get_with_query(
        &self,
        tenant: &Tenant,
        queries: &[QueryResult],
        bufs: &mut [&mut [u8]],
    ) -> BatchResult<u64>;
    /// `Remove`: -706 if leased unless `force`.
    fn remove(&self, tenant: &Tenant, key: &str, force: bool) -> L3Result<()>;
    /// `RemoveAll` of the tenant's keys (leased ones stay unless `force`); returns the count.
    fn remove_all(&self, tenant: &Tenant, force: bool) -> L3Result<u64>;
    /// `RemoveByRegex` of the tenant's keys in which `pattern` is found (Mooncake's
    /// ECMAScript `regex_search`, see [`crate::KeyPattern`]); leased or unfinished objects
    /// stay unless `force`. Returns the count; -600 for an invalid pattern, nothing removed.
    fn remove_by_regex(&self, tenant: &Tenant, pattern: &str, force: bool) -> L3Result<u64>;
    /// `CreateCopyTask` for one target: adds a memory replica of the tenant's key in segment
    /// `target` (run to completion before returning). `Ok(false)` when that segment already
    /// holds one. -704 for a missing key, -600 for a segment that is not mounted, -1011
    /// where the bytes live in store nodes (split deployment).
    fn copy_replica(&self, tenant: &Tenant, key: &str, target: SegmentId) -> L3Result<bool>;
    /// `CreateMoveTask`: the key's memory replica in `source` moves to `target` (copy, then
    /// the source replica is freed). -600 when `source == target`, either segment is not
    /// mounted or `source` holds no replica of the key; -704 for a missing key.
    fn move_replica(
        &self,
        tenant: &Tenant,
        key: &str,
        source: SegmentId,
        target: SegmentId,
    ) -> L3Result<()>;
    /// `BatchReplicaClear` with a segment: per key, whether its memory replica in `segment`
    /// was cleared — complete objects whose lease has expired only; the object goes with its
    /// last copy, a replica elsewhere keeps it (see [`crate::master::Cleared`]). -1011 where
    /// the store does not hold the replicas' bytes (a split deployment's master).
    fn batch_replica_clear(
        &self,
        tenant: &Tenant,
        keys: &[String],
        segment: SegmentId,
    ) -> BatchResult<bool> {
        let _ = (tenant, keys, segment);
        Err(L3Error::UnavailableInMode(
            "batch_replica_clear by segment".into(),
        ))
    }
    /// `MountSegment`: a client contributes `capacity` bytes of DRAM.
    fn mount_segment(&self, client: ClientId, segment: SegmentId, capacity: u64) -> L3Result<()>;
    /// `UnmountSegment`: its memory replicas are dropped.
    fn unmount_segment(&self, client: ClientId, segment: SegmentId) -> L3Result<()>;
    /// `Ping`: client liveness.
    fn ping(&self, client: ClientId) -> L3Result<ClientStatus>;

    // ---- client-level ---------------------------------------------------------------------

    /// Two-phase put of a whole object.
    fn put(&self, tenant: &Tenant, key: &str, data: &[u8], opts: PutOptions) -> L3Result<()>;
    /// Two-phase put of a whole object with a [`ReplicateConfig`]: succeeds only once every
    /// replica is written and ended (otherwise the put is revoked).
    fn put_with(
        &self,
        tenant: &Tenant,
        key: &str,
        data: &[u8],
        opts: PutOptions,
        cfg: ReplicateConfig,
    ) -> L3Result<()> {
        cfg.validate()?;
        if cfg.replica_num == 1 {
            return self.put(tenant, key, data, opts);
        }
        let v = self.batch_put_from_with(tenant, &[key.to_string()], &[data], opts, cfg)?;
        single(v, empty_batch)
    }
    /// Reads an object into a new vector.
    fn get(&self, tenant: &Tenant, key: &str) -> L3Result<Vec<u8>>;
    /// Reads an object into `buf`; returns its size (-10 if `buf` is too small).
    fn get_into(&self, tenant: &Tenant, key: &str, buf: &mut [u8]) -> L3Result<u64> {
        let v = self.batch_get_into(tenant, &[key.to_string()], &mut [buf])?;
        single(v, empty_batch)
    }
    /// Puts many objects from caller buffers (one replica each).
    fn batch_put_from(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &[&[u8]],
        opts: PutOptions,
    ) -> BatchResult<()> {
        self.batch_put_from_with(tenant, keys, bufs, opts, ReplicateConfig::default())
    }
    /// Puts many objects from caller buffers with a [`ReplicateConfig`] (-600 for the whole
    /// call if it is invalid).
    fn batch_put_from_with(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &[&[u8]],
        opts: PutOptions,
        cfg: ReplicateConfig,
    ) -> BatchResult<()>;
    /// Reads many objects into caller buffers (one copy each).
    fn batch_get_into(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &mut [&mut [u8]],
    ) -> BatchResult<u64>;
    /// `exist_key` without options.
    fn is_exist(&self, tenant: &Tenant, key: &str) -> L3Result<bool> {
        self.exist_key(tenant, key, ExistOptions::default())
    }
    /// `batch_exist_key` without options.
    fn batch_is_exist(&self, tenant: &Tenant, keys: &[String]) -> BatchResult<bool> {
        self.batch_exist_key(tenant, keys, ExistOptions::default())
    }
    /// Size of an object.
    fn get_size(&self, tenant: &Tenant, key: &str) -> L3Result<u64>;

    // ---- housekeeping ----------------------------------------------------------------------

    /// Waits until every queued SSD offload is written and registered.
    fn flush(&self) -> L3Result<()>;
    /// Summary numbers.
    fn stats(&self) -> L3Result<StoreStats>;

    // ---- kvtier additions -----------------------------------------------------------------

    /// The loss journal (`StoreConfig::loss_journal_keys`): tenant's keys that stopped
    /// existing from `cursor` on, and the cursor to read from next; `None` subscribes at
    /// the journal's end. Each reader keeps its own cursor, so readers never take entries
    /// from each other. -1011 when the store keeps no journal. See [`Losses`].
    fn losses_since(&self, tenant: &Tenant, cursor: Option<LossCursor>) -> L3Result<Losses>;
    /// The largest object a put accepts (`StoreConfig::max_object_bytes`; a server's as its
    /// `hello` said; 0 where nothing is accepted, a standby). What a client checks its page
    /// size against at startup: a probe put would tell too, but on a full store it evicts a
    /// real object for every client started.
    fn max_object_bytes(&self) -> u64;
    /// The most keys one batch call takes (`StoreConfig::max_batch_keys`; a server's as its
    /// `hello` said; 0 where nothing is accepted, a standby). A caller whose batches may be
    /// longer (Mooncake's calls take any number of keys) goes this many keys at a time.
    fn batch_keys_limit(&self) -> usize;
}
