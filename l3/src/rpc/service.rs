//! The tarpc service definition: Mooncake's operations as RPCs, bincode 1.3 over TCP.
//!
//! Why one service for all roles: every request names its tenant, and every reply is an
//! [`L3Result`] carrying Mooncake's numeric codes, so a remote caller sees exactly what an
//! embedded caller sees. Payloads are [`Blob`]s (a `serde_bytes` byte string on the wire),
//! which lets the server serialise DRAM replicas without copying them first.
//!
//! Split deployment (`kvtier-l3 --role master` + `--role node`): the master serves the
//! metadata calls of this service and answers data calls with -1010; `hello` tells the
//! client (`ServerLimits::cluster`), which then moves bytes on the nodes named by the replica
//! descriptors. Store nodes talk to the master through the one extra call, `cluster`
//! ([`ClusterRequest`]): mount, ping, put end, SSD registration.
//!
//! A connection must call `hello` first (with the shared-secret token when the server has
//! one); every other call on an unauthenticated connection fails with -601.
//!
//! Versions: `hello` carries the client's [`PROTOCOL_VERSION`] and its reply ([`Hello`]) the
//! server's; either side refuses a peer of another version with
//! [`L3Error::ProtocolMismatch`] (-300) before any other call. `hello`'s request and reply
//! are frozen (the reply carries the limits as opaque bytes, decoded only once the versions
//! agree), so peers of any two versions read each other's `hello` and never misread a later
//! call. Every other type on this wire may change, and then [`PROTOCOL_VERSION`] is bumped:
//! `l3/tests/wire_format.rs` fails when a wire type changes under the same version.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use bincode::Options;

use crate::error::{L3Error, L3Result};
use crate::master::{DiskLoc, LossCursor, Losses, NodeSync, ReplicaEnded, RetainedObject};
use crate::types::{
    Blob, ClientId, ClientStatus, ExistOptions, NodeRef, PutHandle, PutOptions, QueryResult,
    ReplicaDescriptor, ReplicateConfig, SegmentId, StoreStats, Tenant,
};

/// The version of the L3 wire protocol: every type crossing [`L3Rpc`] (and the transfer and
/// shared-memory channels set up after its `hello`). Bumped whenever any of them changes
/// (`l3/tests/wire_format.rs` enforces it): peers refuse each other across versions.
pub const PROTOCOL_VERSION: u32 = 1;

/// Environment variable overriding the protocol version this process announces (clients,
/// servers, store nodes): a test hook that lets a test play a peer of another version. Not
/// for production: a process announcing a version it does not speak misreads its peers.
pub const PROTOCOL_VERSION_OVERRIDE_ENV: &str = "KVTIER_L3_TEST_PROTOCOL_VERSION_OVERRIDE";

/// The version this process announces: [`PROTOCOL_VERSION`], unless the test hook
/// [`PROTOCOL_VERSION_OVERRIDE_ENV`] names another (a value that is not a u32 is ignored,
/// with a warning).
pub fn announced_protocol_version() -> u32 {
    static V: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *V.get_or_init(|| match std::env::var(PROTOCOL_VERSION_OVERRIDE_ENV) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(value = %v, "{PROTOCOL_VERSION_OVERRIDE_ENV} is not a u32: ignored");
            PROTOCOL_VERSION
        }),
        Err(_) => PROTOCOL_VERSION,
    })
}

/// Ok when a client of version `client` and a server of version `server` may talk; else the
/// typed refusal naming both.
pub fn check_protocol(client: u32, server: u32) -> L3Result<()> {
    if client == server {
        Ok(())
    } else {
        Err(L3Error::ProtocolMismatch { client, server })
    }
}

/// `hello`'s reply. Frozen: its layout (and `hello`'s request: the token, then the version)
/// never changes, so a peer of any version reads it and can name the versions it refuses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The server's protocol version.
    pub version: u32,
    /// The server's [`ServerLimits`] in bincode (varint), to be decoded only by a client of
    /// the same version: their layout belongs to the version.
    #[serde(with = "serde_bytes")]
    pub limits: Vec<u8>,
}

impl Hello {
    /// The reply of a server of `version` enforcing `limits`.
    pub fn new(version: u32, limits: &ServerLimits) -> L3Result<Hello> {
        let limits = bincode::DefaultOptions::new()
            .serialize(limits)
            .map_err(|e| L3Error::Internal(format!("encoding the server limits: {e}")))?;
        Ok(Hello { version, limits })
    }

    /// The server's limits, for a client of version `client`: -300 when the server speaks
    /// another version (its limits are not decoded then).
    pub fn limits_for(&self, client: u32) -> L3Result<ServerLimits> {
        check_protocol(client, self.version)?;
        bincode::DefaultOptions::new()
            .deserialize(&self.limits)
            .map_err(|e| {
                L3Error::RpcFail(format!(
                    "the server's hello (protocol {}) carries limits this client cannot read: {e}",
                    self.version
                ))
            })
    }
}

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
    /// The server is the master of a split deployment: object bytes live on store nodes,
    /// reached at the addresses in replica descriptors.
    pub cluster: bool,
    /// The master's leader epoch (etcd HA; 0 otherwise): nodes and clients refuse a master
    /// whose epoch is older than one they have seen.
    pub epoch: u64,
}

/// Requests of the `cluster` call: store nodes → master, plus two client queries.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ClusterRequest {
    /// A node joins with an empty memory segment (dropping whatever it had before) and
    /// serves data at `data_addr`.
    Mount {
        /// Node id.
        node: ClientId,
        /// Its segment.
        segment: SegmentId,
        /// Segment capacity in bytes.
        capacity: u64,
        /// Its data-channel address.
        data_addr: SocketAddr,
    },
    /// SSD records found by a node's rescan (or all its records after a remount).
    Rescanned {
        /// Node id.
        node: ClientId,
        /// Records.
        disks: Vec<(Tenant, String, DiskLoc)>,
    },
    /// Liveness; the reply carries frees and settles to apply.
    Ping {
        /// Node id.
        node: ClientId,
        /// Every settle ([`NodeSync::settles`]) up to this sequence number is applied
        /// durably: the master drops them.
        applied: u64,
        /// The bytes of every free ([`NodeSync::freed`]) up to this sequence number are
        /// dropped: the master stops repeating them.
        freed: u64,
    },
    /// `PutEnd` of puts whose bytes the node holds.
    PutEnd {
        /// Node id.
        node: ClientId,
        /// Handles.
        handles: Vec<PutHandle>,
        /// Soft pin.
        soft_pin: bool,
    },
    /// Freshly written SSD copies: (tenant, key, put token, location).
    RegisterDisk {
        /// Node id.
        node: ClientId,
        /// Records.
        items: Vec<(Tenant, String, u64, DiskLoc)>,
    },
    /// SSD eviction of a bucket: allowed only if none of its objects is leased.
    EvictDisk {
        /// Node id.
        node: ClientId,
        /// The bucket's live records.
        recs: Vec<(Tenant, String, DiskLoc)>,
    },
    /// A corrupt SSD copy: drop it.
    DropDisk {
        /// Node id.
        node: ClientId,
        /// Tenant.
        tenant: Tenant,
        /// Key.
        key: String,
        /// Location.
        loc: DiskLoc,
    },
    /// Graceful leave: the node's memory replicas are dropped, its SSD ones stay registered.
    Leave {
        /// Node id.
        node: ClientId,
    },
    /// Client: do these query results still hold (lease, current replica)? Per key.
    CheckQueries {
        /// Tenant.
        tenant: Tenant,
        /// Query results.
        queries: Vec<QueryResult>,
    },
    /// Client: live store nodes.
    Nodes,
    /// `PutEnd` of the replicas a node holds (replicated puts). Each handle names one
    /// replica; the reply says per handle whether the object became visible and whether this
    /// node writes its SSD copy. (Appended after `PutEnd`, which older nodes still send.)
    PutEndReplicas {
        /// Node id.
        node: ClientId,
        /// Handles, one replica each.
        handles: Vec<PutHandle>,
        /// Soft pin.
        soft_pin: bool,
    },
    /// `Mount` naming the node's offload mode: with `offload_on_evict` the master leaves
    /// the bytes of the node's evicted DRAM replicas to be written to its SSD
    /// ([`NodeSync::offload`]). (Appended after `Mount`, which means write-through.)
    MountNode {
        /// Node id.
        node: ClientId,
        /// Its segment.
        segment: SegmentId,
        /// Segment capacity in bytes.
        capacity: u64,
        /// Its data-channel address.
        data_addr: SocketAddr,
        /// The node writes its DRAM evictions to its SSD.
        offload_on_evict: bool,
    },
    /// SSD copies the node read back for promotion: per item, a memory replica in its own
    /// segment (reply `Promoted`: the allocation to keep the bytes under, or why not).
    Promote {
        /// Node id.
        node: ClientId,
        /// (tenant, key, the SSD copy read).
        items: Vec<(Tenant, String, DiskLoc)>,
    },
    /// Offload-on-evict writes that failed or were skipped: (tenant, key, put token). The
    /// staged copies are gone; an object with nothing else goes too.
    Unstage {
        /// Node id.
        node: ClientId,
        /// Items.
        items: Vec<(Tenant, String, u64)>,
    },
    /// DRAM replicas the node kept across a remount (sent after `MountNode`, before its
    /// SSD records): per object, reply `Adopted` with the allocation to keep the bytes
    /// under, or None (the node frees them).
    Retained {
        /// Node id.
        node: ClientId,
        /// The ended replicas it holds.
        objects: Vec<RetainedObject>,
    },
}

/// Replies of the `cluster` call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ClusterReply {
    /// Per record: registered (false: the node tombstones it).
    Accepted(Vec<bool>),
    /// What the node must apply.
    Sync(NodeSync),
    /// Per handle, plus what the node must apply.
    Ended(Vec<L3Result<()>>, NodeSync),
    /// Whether the bucket may be evicted (its records were dropped if so).
    Evictable(bool),
    /// Done.
    Done,
    /// Per query result.
    Checked(Vec<L3Result<()>>),
    /// Live nodes.
    Nodes(Vec<NodeRef>),
    /// Per handle of `PutEndReplicas`, plus what the node must apply.
    EndedReplicas(Vec<L3Result<ReplicaEnded>>, NodeSync),
    /// Per `Promote` item: the allocation holding the promoted replica, and the object's
    /// put token.
    Promoted(Vec<L3Result<(u64, u64)>>),
    /// Per `Retained` object: the allocation it was adopted under, or None.
    Adopted(Vec<Option<u64>>),
}

/// Per-key results.
pub type WireBatch<T> = L3Result<Vec<L3Result<T>>>;

/// The L3 RPC service.
#[tarpc::service]
pub trait L3Rpc {
    /// Authenticates the connection (the token, and the client's [`PROTOCOL_VERSION`]);
    /// returns the server's version and limits. Frozen: first call, these arguments in this
    /// order, this reply, in every version (see [`Hello`]).
    async fn hello(token: Option<String>, version: u32) -> L3Result<Hello>;
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
    /// Split deployment: node ↔ master and client cluster queries (-1010 elsewhere).
    async fn cluster(req: ClusterRequest) -> L3Result<ClusterReply>;
    /// `BatchPutStart` with a [`ReplicateConfig`]: per key the handle (naming the first
    /// replica) and the other replicas. Appended last so the calls above keep their wire
    /// numbers; clients use it only for `replica_num > 1`.
    async fn batch_put_start_replicated(
        tenant: Tenant,
        keys: Vec<String>,
        sizes: Vec<u64>,
        cfg: ReplicateConfig,
    ) -> WireBatch<(PutHandle, Vec<ReplicaDescriptor>)>;
    /// `RemoveByRegex` (see [`crate::KeyPattern`]). Appended after the calls above, which
    /// keep their wire numbers.
    async fn remove_by_regex(tenant: Tenant, pattern: String, force: bool) -> L3Result<u64>;
    /// `CreateCopyTask` for one target segment (appended: earlier calls keep their wire
    /// numbers).
    async fn copy_replica(tenant: Tenant, key: String, target: SegmentId) -> L3Result<bool>;
    /// `CreateMoveTask` (appended after `copy_replica`).
    async fn move_replica(
        tenant: Tenant,
        key: String,
        source: SegmentId,
        target: SegmentId,
    ) -> L3Result<()>;
    /// The loss journal read from a cursor (appended after `move_replica`; see
    /// [`crate::L3Store::losses_since`]).
    async fn losses_since(tenant: Tenant, cursor: Option<LossCursor>) -> L3Result<Losses>;
    /// The server's shared-memory socket for clients on its host (None: it has none).
    /// Appended after `losses_since`; see [`super::shm`].
    async fn shm_offer() -> L3Result<Option<super::shm::ShmOffer>>;
    /// `BatchReplicaClear` with a segment (appended after `shm_offer`; see
    /// [`crate::L3Store::batch_replica_clear`]).
    async fn batch_replica_clear(
        tenant: Tenant,
        keys: Vec<String>,
        segment: SegmentId,
    ) -> WireBatch<bool>;
}
