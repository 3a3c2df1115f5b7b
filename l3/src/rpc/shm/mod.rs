//! The shared-memory data path: a client on the same host as its `kvtier-l3` server moves
//! object bytes through memory both processes map, instead of through a socket.
//!
//! Why: on one host, every byte sent over TCP loopback is copied by the kernel twice and
//! framed on both sides; the SGLang backend bench measured the server path 8.6–9.9× slower
//! than the embedded store. Mooncake's answer is a "real client" owning the memory and
//! "dummy clients" reaching it through shared memory; this is kvtier's.
//!
//! How:
//! - **Discovery.** The server announces, through the (authenticated) `shm_offer` RPC, the
//!   path of its Unix socket, its host's boot id and a random nonce. A client whose boot id
//!   matches connects to the path and checks the nonce the socket's `Hello` returns: the
//!   same kernel *and* the same server process, whatever the network or mount namespaces
//!   (an unreachable path or a different server at the same path falls back to TCP).
//! - **Segments.** The client creates memfd segments (its staging pool, and memory it
//!   hands out for registration, e.g. a Mooncake dummy client's `alloc_from_mem_pool`),
//!   seals them against shrinking and passes their descriptors (`SCM_RIGHTS`); the server
//!   maps them and answers a segment id, valid on that connection only.
//! - **Data.** `Put` names, per key, a `(segment, offset, len)` the server reads in place;
//!   `Get` one it writes in place. A caller's buffer inside a registered segment moves
//!   with no copy in the client; any other buffer goes through the staging segment (one
//!   memcpy), which beats the two kernel copies of the socket (see docs/l3-bench.md).
//! - **Checks.** The same token as the TCP path (`Hello`); the store's tenant checks as on
//!   TCP; every range is validated against the connection's own registrations before the
//!   store is touched ([`check_range`]): an unknown segment (another client's, another
//!   tenant's, a forged id) is -601, a range past the segment or overflowing is -600, and
//!   the whole call fails with nothing read or written.
//! - **Cleanup.** A connection's segments are unmapped and their descriptors closed when it
//!   ends, however it ends (a SIGKILLed client's socket closes), so the kernel frees them.
//! - **Store nodes.** A store node of a split deployment serves the same socket for its own
//!   bytes (`NodePut` of puts the master placed on it, `NodeRead` by the master's
//!   descriptors); what a connection serves beyond hello and registration is a
//!   [`ShmHandler`] — the embedded store or the node (`cluster/node/shm.rs`), which runs the
//!   very code of its TCP data channel. A node's offer is asked on its (authenticated) data
//!   channel, so clients reach it whichever master leads.
//! - **In place** (`ShmMode::InPlace`). A buffer outside any segment (a Python `bytes`, a
//!   tensor) is copied by the server itself, with `process_vm_readv` / `process_vm_writev`,
//!   straight between the caller's memory and the store's replica (one copy instead of two
//!   through the staging segment) when the probe at connect allowed it; see `inplace` and
//!   `peer` for the checks, and `inplace` for why it is not the default.
//!
//! Files: `segment` (memfd, mapping, descriptor passing), `server` (listener, per-connection
//! loop, segment tables), `client` ([`ShmClient`]), `inplace` (the in-place protocol), `peer`
//! (the client process and the copies in its memory, with their safety rules).

mod client;
mod inplace;
mod peer;
pub mod segment;
mod server;

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{L3Error, L3Result};
use crate::types::{
    PutHandle, PutOptions, QueryResult, ReplicaDescriptor, ReplicateConfig, Tenant,
};

pub use client::{SharedRegion, ShmClient, ShmOutcome};
pub(crate) use server::gave_up;
pub use server::{MAX_MAPPED_PER_CONN, MAX_SEGMENTS_PER_CONN, SegTable, ShmServer, copy_out};

/// Environment variable that turns the shared-memory path off for clients and servers of
/// this process (`off`, `0`, `false`, `no`), or makes clients ask for in-place copies of
/// plain buffers (`inplace`).
pub const SHM_ENV: &str = "KVTIER_L3_SHM";

/// Whether to use the shared-memory path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ShmMode {
    /// Use it when client and server share a host (the default); plain caller buffers go
    /// through the staging segment (two memcpys, pipelined).
    #[default]
    Auto,
    /// Never (TCP only).
    Off,
    /// As `Auto`, but plain caller buffers are copied in place by the server (one copy,
    /// `process_vm_readv`/`writev`) where the probe at connect allows it, else staged. Pays
    /// on caller memory backed by huge pages; on 4 KiB pages it measured slower than staging
    /// (docs/l3-bench.md, *In-place copies*).
    InPlace,
}

#[cfg(test)]
mod env_tests {
    use super::*;

    #[test]
    fn the_switch_knows_its_values_and_refuses_others() {
        for (v, m) in [
            ("off", ShmMode::Off),
            ("OFF", ShmMode::Off),
            (" no\n", ShmMode::Off),
            ("0", ShmMode::Off),
            ("False", ShmMode::Off),
            ("inplace", ShmMode::InPlace),
            ("", ShmMode::Auto),
            ("on", ShmMode::Auto),
            ("auto", ShmMode::Auto),
            ("1", ShmMode::Auto),
            ("yes", ShmMode::Auto),
        ] {
            assert_eq!(ShmMode::parse_env(v).ok(), Some(m), "{v:?}");
        }
        for v in ["of", "offf", "disable", "inplce", "2", "o ff"] {
            assert!(
                matches!(ShmMode::parse_env(v), Err(L3Error::InvalidParams(_))),
                "{v:?}"
            );
        }
    }
}

impl ShmMode {
    /// What [`SHM_ENV`] set to `v` asks for (any case, spaces around ignored): `off`, `0`,
    /// `false`, `no` turn it off; `inplace` asks for in-place copies; empty, `on`, `auto`,
    /// `1`, `true`, `yes` are the default. Anything else is refused: it is the operator's off
    /// switch, and a typo of `off` taken as "on" is the opposite of what was asked.
    pub fn parse_env(v: &str) -> L3Result<Self> {
        match v.trim().to_ascii_lowercase().as_str() {
            "off" | "0" | "false" | "no" => Ok(ShmMode::Off),
            "inplace" => Ok(ShmMode::InPlace),
            "" | "on" | "auto" | "1" | "true" | "yes" => Ok(ShmMode::Auto),
            _ => Err(L3Error::InvalidParams(format!(
                "{SHM_ENV}={v:?}: expected off (or 0, false, no), on (or auto, 1, true, yes, \
                 empty) or inplace"
            ))),
        }
    }

    /// What [`SHM_ENV`] asks for (`Auto` when unset); an error for a value
    /// [`Self::parse_env`] refuses. Clients and servers check it when they start, so a
    /// mistyped switch fails there instead of being ignored.
    pub fn try_from_env() -> L3Result<Self> {
        match std::env::var(SHM_ENV) {
            Ok(v) => Self::parse_env(&v),
            Err(std::env::VarError::NotPresent) => Ok(ShmMode::Auto),
            Err(std::env::VarError::NotUnicode(v)) => Err(L3Error::InvalidParams(format!(
                "{SHM_ENV}={v:?} is not UTF-8"
            ))),
        }
    }

    /// [`Self::try_from_env`] for the options' defaults, `Auto` for a value it refuses (the
    /// client or server built with them refuses to start: [`Self::try_from_env`]).
    pub fn from_env() -> Self {
        Self::try_from_env().unwrap_or(ShmMode::Auto)
    }
}

/// What a server announces to authenticated clients.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmOffer {
    /// Path of the server's Unix socket.
    pub path: String,
    /// The server host's boot id.
    pub boot_id: String,
    /// Random per server process; the socket's `Hello` answers it.
    pub nonce: [u8; 16],
}

/// A client's bytes: `len` bytes at `off` of its registered segment `seg`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmRange {
    /// Segment id the server gave at registration.
    pub seg: u32,
    /// Offset in the segment.
    pub off: u64,
    /// Length.
    pub len: u64,
}

/// A buffer in the client's own address space, for in-place copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteBuf {
    /// Its address in the client.
    pub addr: u64,
    /// Its length (a get's capacity).
    pub len: u64,
}

/// Requests on the Unix socket (frames as on the transfer channel).
#[derive(Debug, Serialize, Deserialize)]
pub enum ShmRequest {
    /// Authenticate (first request).
    Hello {
        /// Shared-secret token.
        token: Option<String>,
    },
    /// Register a segment of `len` bytes; its descriptor follows as one byte with
    /// `SCM_RIGHTS`.
    Register {
        /// Bytes the server maps.
        len: u64,
    },
    /// Forget a segment.
    Unregister {
        /// Its id.
        seg: u32,
    },
    /// Put objects read from the client's segments.
    Put {
        /// Tenant.
        tenant: Tenant,
        /// Keys.
        keys: Vec<String>,
        /// One range per key.
        ranges: Vec<ShmRange>,
        /// Put options.
        opts: PutOptions,
        /// Replication.
        cfg: ReplicateConfig,
    },
    /// Read objects into the client's segments.
    Get {
        /// Tenant.
        tenant: Tenant,
        /// Keys (ignored when `queries` is set).
        keys: Vec<String>,
        /// Query results to read by (leases checked per key).
        queries: Option<Vec<QueryResult>>,
        /// One destination per key; its length is the capacity.
        ranges: Vec<ShmRange>,
    },
    /// Store node: write the bytes of puts the master placed on it (one range per handle)
    /// and, with `end`, end them (as the data channel's `NodePut`).
    NodePut {
        /// Handles from the master's `PutStart`, one per replica on this node.
        handles: Vec<PutHandle>,
        /// One range per handle: the bytes.
        ranges: Vec<ShmRange>,
        /// End the puts with these options.
        end: Option<PutOptions>,
    },
    /// Store node: read replicas named by the master's descriptors into the client's
    /// segments (as the data channel's `NodeRead`).
    NodeRead {
        /// Tenant.
        tenant: Tenant,
        /// Keys.
        keys: Vec<String>,
        /// One descriptor per key.
        replicas: Vec<ReplicaDescriptor>,
        /// One destination per key; its length is the capacity.
        ranges: Vec<ShmRange>,
    },
    /// Asks for in-place copies: the server reads the 16 bytes at `addr` in the client,
    /// expects `nonce` there and writes their complement at `back` (`Done`).
    Probe {
        /// Address of the nonce in the client.
        addr: u64,
        /// The nonce.
        nonce: [u8; 16],
        /// Where the server writes the complement.
        back: u64,
    },
    /// `Put`, the server reading each key's bytes in place from the client (`Put` reply).
    PutAt {
        /// Tenant.
        tenant: Tenant,
        /// Keys.
        keys: Vec<String>,
        /// One source per key.
        bufs: Vec<RemoteBuf>,
        /// Put options.
        opts: PutOptions,
        /// Replication.
        cfg: ReplicateConfig,
    },
    /// `Get`, the server writing each object in place into the client (`Get` reply).
    GetAt {
        /// Tenant.
        tenant: Tenant,
        /// Keys (ignored when `queries` is set).
        keys: Vec<String>,
        /// Query results to read by.
        queries: Option<Vec<QueryResult>>,
        /// One destination per key; its length is the capacity.
        bufs: Vec<RemoteBuf>,
    },
}

/// What a shared-memory connection serves once authenticated, besides registration: the
/// data requests (`Put`/`Get` for the embedded store, `NodePut`/`NodeRead` for a store
/// node), their ranges resolved through the connection's own [`SegTable`].
pub trait ShmHandler: Send + Sync + 'static {
    /// Serves one data request.
    fn handle(&self, req: ShmRequest, segs: &SegTable) -> ShmReply;
}

/// The typed refusal of a data request a handler does not serve (-1010), in the reply kind
/// the request expects.
pub fn refuse(req: &ShmRequest, why: &str) -> ShmReply {
    let e = L3Error::Unavailable(why.to_string());
    match req {
        ShmRequest::Put { .. } | ShmRequest::PutAt { .. } | ShmRequest::NodePut { .. } => {
            ShmReply::Put(Err(e))
        }
        ShmRequest::Get { .. } | ShmRequest::GetAt { .. } | ShmRequest::NodeRead { .. } => {
            ShmReply::Get(Err(e))
        }
        _ => ShmReply::Done(Err(e)),
    }
}

/// Replies.
#[derive(Debug, Serialize, Deserialize)]
pub enum ShmReply {
    /// Hello: the server's nonce.
    Hello(L3Result<[u8; 16]>),
    /// Register: the segment id.
    Registered(L3Result<u32>),
    /// Unregister.
    Done(L3Result<()>),
    /// Put: per key.
    Put(L3Result<Vec<L3Result<()>>>),
    /// Get: per key, the object's size (its bytes are in the range).
    Get(L3Result<Vec<L3Result<u64>>>),
}

/// The byte range `[off, off + len)` of a segment of `seg_len` bytes, or why not: -600 when
/// it overflows or ends past the segment. The one check between a client's numbers and a
/// server's memory access.
pub fn check_range(seg_len: u64, off: u64, len: u64) -> L3Result<Range<usize>> {
    let end = off
        .checked_add(len)
        .ok_or_else(|| L3Error::InvalidParams(format!("range {off}+{len} overflows")))?;
    if end > seg_len {
        return Err(L3Error::InvalidParams(format!(
            "range {off}..{end} outside the segment of {seg_len} bytes"
        )));
    }
    let s = usize::try_from(off).map_err(|_| L3Error::InvalidParams("offset too big".into()))?;
    let e = usize::try_from(end).map_err(|_| L3Error::InvalidParams("range too big".into()))?;
    Ok(s..e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn ranges_inside_iff_accepted(seg in 0u64..1 << 20, off in any::<u64>(), len in any::<u64>()) {
            let fits = off.checked_add(len).is_some_and(|e| e <= seg);
            match check_range(seg, off, len) {
                Ok(r) => {
                    prop_assert!(fits);
                    prop_assert_eq!(r.start as u64, off);
                    prop_assert_eq!((r.end - r.start) as u64, len);
                    prop_assert!(r.end as u64 <= seg);
                }
                Err(e) => {
                    prop_assert!(!fits);
                    prop_assert!(matches!(e, L3Error::InvalidParams(_)));
                }
            }
        }

        #[test]
        fn small_ranges_near_the_end(seg in 1u64..4096, off in 0u64..8192, len in 0u64..8192) {
            let r = check_range(seg, off, len);
            prop_assert_eq!(r.is_ok(), off + len <= seg);
        }
    }
}
