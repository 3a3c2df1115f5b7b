//! The tarpc service definition: Mooncake's operations as RPCs, bincode 1.3 over TCP.
//!
//! Why one service for all roles: every request names its tenant, and every reply is an
//! [`L3Result`] carrying Mooncake's numeric codes, so a remote caller sees exactly what an
//! embedded caller sees. Payloads are [`Blob`]s (a `serde_bytes` byte string on the wire),
//! which lets the server serialise DRAM replicas without copying them first.
//!
//! A connection must call `hello` first (with the shared-secret token when the server has
//! one); every other call on an unauthenticated connection fails with -601.

use serde::{Deserialize, Serialize};

use crate::error::L3Result;
use crate::types::{
    Blob, ClientId, ClientStatus, ExistOptions, PutHandle, PutOptions, QueryResult, SegmentId,
    StoreStats, Tenant,
};

/// Limits a server enforces, advertised by `hello` so clients can refuse early (typed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerLimits {
    /// Largest frame (request or reply) in bytes.
    pub max_frame_bytes: u64,
    /// Most keys in one batch.
    pub max_batch_keys: u64,
    /// Largest object.
    pub max_object_bytes: u64,
    /// Port of the transfer channel on the same host (0 = none), see [`super::xfer`].
    pub xfer_port: u16,
}

/// Per-key results.
pub type WireBatch<T> = L3Result<Vec<L3Result<T>>>;

/// The L3 RPC service.
#[tarpc::service]
pub trait L3Rpc {
    /// Authenticates the connection; returns the server's limits.
    async fn hello(token: Option<String>) -> L3Result<ServerLimits>;
    /// `PutStart`.
    async fn put_start(tenant: Tenant, key: String, size: u64) -> L3Result<PutHandle>;
    /// Writes a pending put's bytes.
    async fn put_write(handle: PutHandle, data: Blob) -> L3Result<()>;
    /// `PutEnd`.
    async fn put_end(handle: PutHandle, opts: PutOptions) -> L3Result<()>;
    /// `PutRevoke`.
    async fn put_revoke(handle: PutHandle) -> L3Result<()>;
    /// `BatchPutStart`.
    async fn batch_put_start(
        tenant: Tenant,
        keys: Vec<String>,
        sizes: Vec<u64>,
    ) -> WireBatch<PutHandle>;
    /// `BatchPutEnd`.
    async fn batch_put_end(handles: Vec<PutHandle>, opts: PutOptions) -> WireBatch<()>;
    /// `BatchPutRevoke`.
    async fn batch_put_revoke(handles: Vec<PutHandle>) -> WireBatch<()>;
    /// `BatchQuery` / `BatchGetReplicaList`.
    async fn batch_query(tenant: Tenant, keys: Vec<String>) -> WireBatch<QueryResult>;
    /// `BatchExistKey`.
    async fn batch_exist(tenant: Tenant, keys: Vec<String>, opts: ExistOptions) -> WireBatch<bool>;
    /// Batched get reusing query results.
    async fn batch_get_with_query(tenant: Tenant, queries: Vec<QueryResult>) -> WireBatch<Blob>;
    /// `Remove`.
    async fn remove(tenant: Tenant, key: String, force: bool) -> L3Result<()>;
    /// `RemoveAll`.
    async fn remove_all(tenant: Tenant, force: bool) -> L3Result<u64>;
    /// `MountSegment`.
    async fn mount_segment(client: ClientId, segment: SegmentId, capacity: u64) -> L3Result<()>;
    /// `UnmountSegment`.
    async fn unmount_segment(client: ClientId, segment: SegmentId) -> L3Result<()>;
    /// `Ping`.
    async fn ping(client: ClientId) -> L3Result<ClientStatus>;
    /// Client-level batched put.
    async fn batch_put(
        tenant: Tenant,
        keys: Vec<String>,
        data: Vec<Blob>,
        opts: PutOptions,
    ) -> WireBatch<()>;
    /// Client-level batched get.
    async fn batch_get(tenant: Tenant, keys: Vec<String>) -> WireBatch<Blob>;
    /// Object size.
    async fn get_size(tenant: Tenant, key: String) -> L3Result<u64>;
    /// Waits for queued SSD offloads.
    async fn flush() -> L3Result<()>;
    /// Summary numbers.
    async fn stats() -> L3Result<StoreStats>;
}
