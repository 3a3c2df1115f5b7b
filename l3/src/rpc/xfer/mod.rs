//! The transfer channel: a lean framed TCP protocol for the two hot paths, bulk reads
//! (`batch_get_into`, `batch_get_with_query`) and batched existence probes.
//!
//! Why a second channel beside tarpc: Mooncake itself splits control (RPC) from data (its
//! transfer engine). Through tarpc + bincode a 1 MiB object is copied about six times
//! (into a reply vector, into the bincode frame, into the codec buffer, kernel, the
//! client's frame buffer, a deserialised vector, the caller's buffer) and every call hops
//! across several tasks; that caps loopback reads near 1 GB/s and a 1,024-key probe near
//! 300 µs. Here the server writes DRAM replicas straight from their shared buffers to the
//! socket and the client reads them straight into the caller's buffers — two copies, as in
//! iperf3 — and each connection is served by one blocking thread, so a call is one write
//! and one read on each side.
//!
//! The same framing is the data channel of a store node (`kvtier-l3 --role node`): `NodePut`
//! writes (and ends) puts whose allocations the master placed on the node, `NodeRead` reads
//! replicas named by the master's descriptors. What a connection serves is an
//! [`XferHandler`]: the embedded store (bulk reads, probes) or a store node.
//!
//! This file holds the messages ([`XferRequest`] / [`XferReply`]) and the handler trait; the
//! rest:
//! - `frame`: the wire format (frames, packed keys, a `Get` reply's raw bytes),
//! - `server`: the listener, the per-connection loop (hello, limits) and the embedded store's
//!   handler,
//! - `client`: [`XferClient`].

mod client;
mod frame;
mod server;

use std::net::TcpStream;

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::error::{L3Error, L3Result};
use crate::types::{ExistOptions, PutHandle, PutOptions, QueryResult, ReplicaDescriptor, Tenant};

pub use crate::rpc::accept::{HELLO_TIMEOUT, MAX_CONNECTIONS, MAX_PENDING_HELLOS};
pub use client::XferClient;
pub use frame::{FrameError, pack_keys, read_frame, send_blobs, unpack_keys, write_frame};
pub use server::XferServer;

/// Requests.
#[derive(Debug, Serialize, Deserialize)]
pub enum XferRequest {
    /// Authenticate the connection.
    Hello {
        /// Shared-secret token.
        token: Option<String>,
    },
    /// Batched existence probe.
    Exist {
        /// Tenant.
        tenant: Tenant,
        /// Options (promotion).
        opts: ExistOptions,
        /// Packed keys.
        keys: ByteBuf,
    },
    /// Batched read.
    Get {
        /// Tenant.
        tenant: Tenant,
        /// Packed keys.
        keys: ByteBuf,
        /// Size of the caller's buffer for each key.
        caps: Vec<u64>,
    },
    /// Batched read reusing query results (leases checked per key, -707).
    GetWithQuery {
        /// Tenant.
        tenant: Tenant,
        /// Query results from `BatchQuery`.
        queries: Vec<QueryResult>,
        /// Size of the caller's buffer for each key.
        caps: Vec<u64>,
    },
    /// Store node: write the bytes of placed puts (when `data` is not empty, one per handle)
    /// and, with `end`, end them (the node then tells the master and offloads to its SSD).
    NodePut {
        /// Handles from the master's `PutStart`.
        handles: Vec<PutHandle>,
        /// Bytes, one per handle, or none (end only).
        data: Vec<ByteBuf>,
        /// End the puts with these options.
        end: Option<PutOptions>,
    },
    /// Store node: read replicas named by the master's descriptors.
    NodeRead {
        /// Tenant.
        tenant: Tenant,
        /// Keys.
        keys: Vec<String>,
        /// One descriptor per key.
        replicas: Vec<ReplicaDescriptor>,
        /// Size of the caller's buffer for each key.
        caps: Vec<u64>,
    },
    /// Store node: wait until queued SSD writes are durable and registered.
    NodeFlush,
    /// Store node: its shared-memory offer for clients on its host (see
    /// [`crate::rpc::shm`]); asked on this authenticated channel, as a server's is on RPC.
    ShmOffer,
}

/// Replies.
#[derive(Debug, Serialize, Deserialize)]
pub enum XferReply {
    /// Hello accepted or refused.
    Hello(L3Result<()>),
    /// One byte per key: 0 absent, 1 present, 2 invalid key.
    Exist(L3Result<ByteBuf>),
    /// Per-key sizes; raw bytes of the `Ok` ones follow.
    Get(L3Result<Vec<L3Result<u64>>>),
    /// Per-item outcome (`NodePut`, `NodeFlush`).
    Batch(L3Result<Vec<L3Result<()>>>),
    /// `ShmOffer`: the node's offer (None: it serves none, e.g. `--no-shm`).
    ShmOffer(Option<crate::rpc::shm::ShmOffer>),
}

/// What a transfer connection serves once authenticated: one request, written reply.
/// Returns false to close the connection.
pub trait XferHandler: Send + Sync + 'static {
    /// Serves `req` on `sock`.
    fn handle(&self, sock: &mut TcpStream, req: XferRequest) -> bool;
}

/// Replies to a request this handler does not serve with a typed error (-1010) of the
/// reply kind the request expects.
pub fn refuse(sock: &mut TcpStream, req: &XferRequest, why: &str) -> bool {
    let e = L3Error::Unavailable(why.to_string());
    let reply = match req {
        XferRequest::Exist { .. } => XferReply::Exist(Err(e)),
        XferRequest::NodePut { .. } | XferRequest::NodeFlush => XferReply::Batch(Err(e)),
        _ => XferReply::Get(Err(e)),
    };
    write_frame(sock, &reply).is_ok()
}
