//! Errors of the L3 store, carrying Mooncake Store's numeric error codes.
//!
//! Why: a Mooncake user reads `-704` and knows it means "object not found"; keeping the same
//! numbers (from Mooncake's `ErrorCode` enum in `mooncake-store/include/types.h`) means our
//! logs, metrics and wire replies say nothing surprising. Every failure an input can cause is
//! one of these typed variants; nothing on an input-reachable path panics.
//!
//! How: [`ErrorCode`] is the numeric enum, [`L3Error`] the `thiserror` error that carries a code
//! plus context. Both are serde-serialisable so the tarpc service returns them unchanged.

use serde::{Deserialize, Serialize};

/// Mooncake Store's `ErrorCode` (numeric values identical to Mooncake's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(i32)]
pub enum ErrorCode {
    /// Operation successful.
    Ok = 0,
    /// Internal error occurred.
    InternalError = -1,
    /// Insufficient buffer space (caller's buffer too small).
    BufferOverflow = -10,
    /// Shard index is out of bounds.
    ShardIndexOutOfRange = -100,
    /// No such segment.
    SegmentNotFound = -101,
    /// Segment already mounted.
    SegmentAlreadyExists = -102,
    /// Client not found.
    ClientNotFound = -103,
    /// Allocation failed: not enough space (after eviction).
    NoAvailableHandle = -200,
    /// Invalid version.
    InvalidVersion = -300,
    /// Invalid key.
    InvalidKey = -400,
    /// Write failed.
    WriteFail = -500,
    /// Invalid parameters.
    InvalidParams = -600,
    /// Illegal client for this operation (wrong token, wrong put owner).
    IllegalClient = -601,
    /// Invalid write.
    InvalidWrite = -700,
    /// Invalid read.
    InvalidRead = -701,
    /// Invalid replica.
    InvalidReplica = -702,
    /// Replica is not ready (put not ended yet).
    ReplicaIsNotReady = -703,
    /// Object not found.
    ObjectNotFound = -704,
    /// Object already exists.
    ObjectAlreadyExists = -705,
    /// Object has a lease.
    ObjectHasLease = -706,
    /// Lease expired before the data transfer completed.
    LeaseExpired = -707,
    /// Object has ongoing replication task.
    ObjectHasReplicationTask = -708,
    /// Object has no replication task.
    ObjectNoReplicationTask = -709,
    /// Replica not found.
    ReplicaNotFound = -710,
    /// Replica already exists.
    ReplicaAlreadyExists = -711,
    /// Replica existed once, but is gone now.
    ReplicaIsGone = -712,
    /// Transfer failed.
    TransferFail = -800,
    /// RPC failed.
    RpcFail = -900,
    /// Request cannot be served in the current status.
    UnavailableInCurrentStatus = -1010,
    /// Request cannot be served in the current mode.
    UnavailableInCurrentMode = -1011,
    /// File not found.
    FileNotFound = -1100,
    /// Error opening a file.
    FileOpenFail = -1101,
    /// Error reading a file.
    FileReadFail = -1102,
    /// Error writing a file.
    FileWriteFail = -1103,
    /// File buffer is wrong.
    FileInvalidBuffer = -1104,
    /// File lock failed.
    FileLockFail = -1105,
    /// Invalid file handle.
    FileInvalidHandle = -1106,
    /// Bucket not found.
    BucketNotFound = -1200,
    /// Bucket already exists.
    BucketAlreadyExists = -1201,
    /// Keys exceed the bucket limit.
    KeysExceedBucketLimit = -1202,
    /// Keys ultra limit.
    KeysUltraLimit = -1203,
    /// Offload is not enabled.
    UnableOffload = -1300,
    /// Unable to offload now (queue full).
    UnableOffloading = -1301,
    /// Task not found.
    TaskNotFound = -1400,
    /// Too many pending tasks.
    TaskPendingLimitExceeded = -1401,
}

impl ErrorCode {
    /// The numeric value Mooncake uses.
    pub fn as_i32(self) -> i32 {
        self as i32
    }
}

impl ErrorCode {
    /// Every code, in Mooncake's order: the one table the Python bindings export
    /// (`kvtier.ERROR_CODES`, `kvtier.mooncake_compat.ErrorCode`), so no copy of it drifts.
    pub const ALL: &'static [ErrorCode] = &[
        ErrorCode::Ok,
        ErrorCode::InternalError,
        ErrorCode::BufferOverflow,
        ErrorCode::ShardIndexOutOfRange,
        ErrorCode::SegmentNotFound,
        ErrorCode::SegmentAlreadyExists,
        ErrorCode::ClientNotFound,
        ErrorCode::NoAvailableHandle,
        ErrorCode::InvalidVersion,
        ErrorCode::InvalidKey,
        ErrorCode::WriteFail,
        ErrorCode::InvalidParams,
        ErrorCode::IllegalClient,
        ErrorCode::InvalidWrite,
        ErrorCode::InvalidRead,
        ErrorCode::InvalidReplica,
        ErrorCode::ReplicaIsNotReady,
        ErrorCode::ObjectNotFound,
        ErrorCode::ObjectAlreadyExists,
        ErrorCode::ObjectHasLease,
        ErrorCode::LeaseExpired,
        ErrorCode::ObjectHasReplicationTask,
        ErrorCode::ObjectNoReplicationTask,
        ErrorCode::ReplicaNotFound,
        ErrorCode::ReplicaAlreadyExists,
        ErrorCode::ReplicaIsGone,
        ErrorCode::TransferFail,
        ErrorCode::RpcFail,
        ErrorCode::UnavailableInCurrentStatus,
        ErrorCode::UnavailableInCurrentMode,
        ErrorCode::FileNotFound,
        ErrorCode::FileOpenFail,
        ErrorCode::FileReadFail,
        ErrorCode::FileWriteFail,
        ErrorCode::FileInvalidBuffer,
        ErrorCode::FileLockFail,
        ErrorCode::FileInvalidHandle,
        ErrorCode::BucketNotFound,
        ErrorCode::BucketAlreadyExists,
        ErrorCode::KeysExceedBucketLimit,
        ErrorCode::KeysUltraLimit,
        ErrorCode::UnableOffload,
        ErrorCode::UnableOffloading,
        ErrorCode::TaskNotFound,
        ErrorCode::TaskPendingLimitExceeded,
    ];

    /// Mooncake's name of the code (`OBJECT_NOT_FOUND` for -704), as in its `types.h`.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::Ok => "OK",
            ErrorCode::InternalError => "INTERNAL_ERROR",
            ErrorCode::BufferOverflow => "BUFFER_OVERFLOW",
            ErrorCode::ShardIndexOutOfRange => "SHARD_INDEX_OUT_OF_RANGE",
            ErrorCode::SegmentNotFound => "SEGMENT_NOT_FOUND",
            ErrorCode::SegmentAlreadyExists => "SEGMENT_ALREADY_EXISTS",
            ErrorCode::ClientNotFound => "CLIENT_NOT_FOUND",
            ErrorCode::NoAvailableHandle => "NO_AVAILABLE_HANDLE",
            ErrorCode::InvalidVersion => "INVALID_VERSION",
            ErrorCode::InvalidKey => "INVALID_KEY",
            ErrorCode::WriteFail => "WRITE_FAIL",
            ErrorCode::InvalidParams => "INVALID_PARAMS",
            ErrorCode::IllegalClient => "ILLEGAL_CLIENT",
            ErrorCode::InvalidWrite => "INVALID_WRITE",
            ErrorCode::InvalidRead => "INVALID_READ",
            ErrorCode::InvalidReplica => "INVALID_REPLICA",
            ErrorCode::ReplicaIsNotReady => "REPLICA_IS_NOT_READY",
            ErrorCode::ObjectNotFound => "OBJECT_NOT_FOUND",
            ErrorCode::ObjectAlreadyExists => "OBJECT_ALREADY_EXISTS",
            ErrorCode::ObjectHasLease => "OBJECT_HAS_LEASE",
            ErrorCode::LeaseExpired => "LEASE_EXPIRED",
            ErrorCode::ObjectHasReplicationTask => "OBJECT_HAS_REPLICATION_TASK",
            ErrorCode::ObjectNoReplicationTask => "OBJECT_NO_REPLICATION_TASK",
            ErrorCode::ReplicaNotFound => "REPLICA_NOT_FOUND",
            ErrorCode::ReplicaAlreadyExists => "REPLICA_ALREADY_EXISTS",
            ErrorCode::ReplicaIsGone => "REPLICA_IS_GONE",
            ErrorCode::TransferFail => "TRANSFER_FAIL",
            ErrorCode::RpcFail => "RPC_FAIL",
            ErrorCode::UnavailableInCurrentStatus => "UNAVAILABLE_IN_CURRENT_STATUS",
            ErrorCode::UnavailableInCurrentMode => "UNAVAILABLE_IN_CURRENT_MODE",
            ErrorCode::FileNotFound => "FILE_NOT_FOUND",
            ErrorCode::FileOpenFail => "FILE_OPEN_FAIL",
            ErrorCode::FileReadFail => "FILE_READ_FAIL",
            ErrorCode::FileWriteFail => "FILE_WRITE_FAIL",
            ErrorCode::FileInvalidBuffer => "FILE_INVALID_BUFFER",
            ErrorCode::FileLockFail => "FILE_LOCK_FAIL",
            ErrorCode::FileInvalidHandle => "FILE_INVALID_HANDLE",
            ErrorCode::BucketNotFound => "BUCKET_NOT_FOUND",
            ErrorCode::BucketAlreadyExists => "BUCKET_ALREADY_EXISTS",
            ErrorCode::KeysExceedBucketLimit => "KEYS_EXCEED_BUCKET_LIMIT",
            ErrorCode::KeysUltraLimit => "KEYS_ULTRA_LIMIT",
            ErrorCode::UnableOffload => "UNABLE_OFFLOAD",
            ErrorCode::UnableOffloading => "UNABLE_OFFLOADING",
            ErrorCode::TaskNotFound => "TASK_NOT_FOUND",
            ErrorCode::TaskPendingLimitExceeded => "TASK_PENDING_LIMIT_EXCEEDED",
        }
    }
}

/// The error every L3 operation returns.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum L3Error {
    /// -704: the key does not exist for this tenant (also: a corrupted SSD object, which is a miss).
    #[error("object not found (-704)")]
    ObjectNotFound,
    /// -705: first writer wins; the key exists or a put is in progress.
    #[error("object already exists (-705)")]
    ObjectAlreadyExists,
    /// -706: the object is leased by a reader and `force` was not given.
    #[error("object has a lease (-706)")]
    ObjectHasLease,
    /// -707: a query result's lease expired before the data was fetched.
    #[error("lease expired (-707)")]
    LeaseExpired,
    /// -703: the put has not ended yet.
    #[error("replica is not ready (-703)")]
    ReplicaIsNotReady,
    /// -200: no space left, even after eviction.
    #[error("no available handle: need {needed} bytes (-200)")]
    NoAvailableHandle {
        /// Bytes requested.
        needed: u64,
    },
    /// -600: a parameter is invalid.
    #[error("invalid params: {0} (-600)")]
    InvalidParams(String),
    /// -400: the key is invalid (empty, too long, NUL).
    #[error("invalid key: {0} (-400)")]
    InvalidKey(String),
    /// -601: wrong token, or not the owner of a pending put.
    #[error("illegal client: {0} (-601)")]
    IllegalClient(String),
    /// -10: the caller's buffer is too small for the object.
    #[error("buffer overflow: object is {needed} bytes, buffer {have} (-10)")]
    BufferOverflow {
        /// Object size.
        needed: u64,
        /// Buffer size.
        have: u64,
    },
    /// -101: no such segment.
    #[error("segment not found (-101)")]
    SegmentNotFound,
    /// -102: segment id already mounted.
    #[error("segment already exists (-102)")]
    SegmentAlreadyExists,
    /// -103: client unknown to the master.
    #[error("client not found (-103)")]
    ClientNotFound,
    /// -1103: SSD write failed (disk full, unwritable directory, ...).
    #[error("file write failed: {0} (-1103)")]
    FileWriteFail(String),
    /// -1102: SSD read failed.
    #[error("file read failed: {0} (-1102)")]
    FileReadFail(String),
    /// -1101: opening SSD storage failed.
    #[error("file open failed: {0} (-1101)")]
    FileOpenFail(String),
    /// -1300: the SSD tier is not enabled.
    #[error("ssd offload not enabled (-1300)")]
    UnableOffload,
    /// -1301: the offload queue is full.
    #[error("offload queue full (-1301)")]
    UnableOffloading,
    /// -900: transport failure talking to a server.
    #[error("rpc failed: {0} (-900)")]
    RpcFail(String),
    /// -1010: the server is shutting down or not ready.
    #[error("unavailable in current status: {0} (-1010)")]
    Unavailable(String),
    /// -1: a bug or an unexpected OS failure.
    #[error("internal error: {0} (-1)")]
    Internal(String),
    /// -1011: this deployment mode cannot do the call (appended: earlier variants keep
    /// their wire numbers).
    #[error("unavailable in current mode: {0} (-1011)")]
    UnavailableInMode(String),

    /// -712: the object version existed but is gone (dropped before its SSD copy was
    /// registered: evicted, removed or replaced while its write was queued).
    #[error("replica is gone: {0} (-712)")]
    ReplicaIsGone(String),
    /// -1010: this master is not the leader (a standby, or a leader whose etcd lease ran
    /// out): find the leader again (`etcd://` locator) and retry. Appended (wire order).
    #[error("not the leader: {0} (-1010)")]
    NotLeader(String),
    /// -1010: an order or a handle from an older leader epoch, refused: a put whose two
    /// phases straddle a master failover fails with this (put it again). Appended.
    #[error("epoch fenced: {0} (-1010)")]
    EpochFenced(String),
    /// -300: the peer speaks another version of the L3 wire protocol
    /// ([`crate::rpc::service::PROTOCOL_VERSION`]); refused at `hello`, before any other
    /// call. `client` is the connecting side's version (an engine's client, or a store node
    /// joining its master), `server` the serving side's. Appended (wire order): every
    /// version decodes it, as `hello`'s reply is frozen.
    #[error(
        "protocol version mismatch: the client speaks kvtier-l3 wire protocol {client}, the \
         server {server}; peers must share the protocol version: upgrade (or roll back) one \
         side so both run releases of the same version (-300)"
    )]
    ProtocolMismatch {
        /// The connecting side's protocol version.
        client: u32,
        /// The serving side's protocol version.
        server: u32,
    },
}

/// Settles the result of a best-effort release (a revoke, an unmount, an etcd lease given
/// back, a stale socket file removed) whose failure the caller can do nothing about: the
/// resource is already gone (a forced remove took the pending put, the client was declared
/// dead) or something else frees it (the put timeout, the lease TTL). The failure is logged,
/// never dropped unseen.
pub fn best_effort<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) {
    if let Err(e) = r {
        tracing::debug!(error = %e, "{what}: not released here (already gone, or freed later)");
    }
}

/// Joins a thread this value owned; a thread that panicked is logged (its panic already
/// printed), never ignored unseen.
pub fn join_logged<T>(what: &str, h: std::thread::JoinHandle<T>) {
    if h.join().is_err() {
        tracing::error!("{what}: the thread panicked");
    }
}

impl L3Error {
    /// Mooncake's error code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            L3Error::ObjectNotFound => ErrorCode::ObjectNotFound,
            L3Error::ObjectAlreadyExists => ErrorCode::ObjectAlreadyExists,
            L3Error::ObjectHasLease => ErrorCode::ObjectHasLease,
            L3Error::LeaseExpired => ErrorCode::LeaseExpired,
            L3Error::ReplicaIsNotReady => ErrorCode::ReplicaIsNotReady,
            L3Error::NoAvailableHandle { .. } => ErrorCode::NoAvailableHandle,
            L3Error::InvalidParams(_) => ErrorCode::InvalidParams,
            L3Error::InvalidKey(_) => ErrorCode::InvalidKey,
            L3Error::IllegalClient(_) => ErrorCode::IllegalClient,
            L3Error::BufferOverflow { .. } => ErrorCode::BufferOverflow,
            L3Error::SegmentNotFound => ErrorCode::SegmentNotFound,
            L3Error::SegmentAlreadyExists => ErrorCode::SegmentAlreadyExists,
            L3Error::ClientNotFound => ErrorCode::ClientNotFound,
            L3Error::FileWriteFail(_) => ErrorCode::FileWriteFail,
            L3Error::FileReadFail(_) => ErrorCode::FileReadFail,
            L3Error::FileOpenFail(_) => ErrorCode::FileOpenFail,
            L3Error::UnableOffload => ErrorCode::UnableOffload,
            L3Error::UnableOffloading => ErrorCode::UnableOffloading,
            L3Error::RpcFail(_) => ErrorCode::RpcFail,
            L3Error::Unavailable(_) => ErrorCode::UnavailableInCurrentStatus,
            L3Error::Internal(_) => ErrorCode::InternalError,
            L3Error::UnavailableInMode(_) => ErrorCode::UnavailableInCurrentMode,
            L3Error::ReplicaIsGone(_) => ErrorCode::ReplicaIsGone,
            L3Error::NotLeader(_) | L3Error::EpochFenced(_) => {
                ErrorCode::UnavailableInCurrentStatus
            }
            L3Error::ProtocolMismatch { .. } => ErrorCode::InvalidVersion,
        }
    }

    /// Mooncake's numeric code (e.g. -704).
    pub fn code_i32(&self) -> i32 {
        self.code().as_i32()
    }
}

/// Result alias used across the crate.
pub type L3Result<T> = Result<T, L3Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_match_mooncake() {
        assert_eq!(L3Error::ObjectNotFound.code_i32(), -704);
        assert_eq!(L3Error::ObjectAlreadyExists.code_i32(), -705);
        assert_eq!(L3Error::ObjectHasLease.code_i32(), -706);
        assert_eq!(L3Error::LeaseExpired.code_i32(), -707);
        assert_eq!(L3Error::NoAvailableHandle { needed: 1 }.code_i32(), -200);
        assert_eq!(L3Error::InvalidParams(String::new()).code_i32(), -600);
        assert_eq!(ErrorCode::KeysExceedBucketLimit.as_i32(), -1202);
    }

    #[test]
    fn table_is_complete_and_unique() {
        use std::collections::HashSet;
        let codes: HashSet<i32> = ErrorCode::ALL.iter().map(|c| c.as_i32()).collect();
        let names: HashSet<&str> = ErrorCode::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(codes.len(), ErrorCode::ALL.len());
        assert_eq!(names.len(), ErrorCode::ALL.len());
        assert_eq!(ErrorCode::ObjectNotFound.name(), "OBJECT_NOT_FOUND");
        assert_eq!(
            ErrorCode::UnavailableInCurrentStatus.name(),
            "UNAVAILABLE_IN_CURRENT_STATUS"
        );
        // Every variant an L3Error maps to is in the table.
        for e in [
            L3Error::ObjectNotFound,
            L3Error::Unavailable(String::new()),
            L3Error::UnableOffloading,
        ] {
            assert!(ErrorCode::ALL.contains(&e.code()));
        }
    }
}
