//! A store node's shared-memory path: clients on the node's host write the bytes of their
//! puts and read replicas through memory both processes map, instead of through the node's
//! TCP data channel.
//!
//! Why: in a split deployment the bytes go between clients and nodes, not the master; the
//! 8 engine processes of a GPU host that runs a node would otherwise copy every object
//! through loopback TCP (see docs/l3-bench.md, *Shared-memory path*).
//!
//! How: the node runs the same listener as a `kvtier-l3` server ([`ShmServer`]: memfd
//! segments per connection, the node's token on `Hello`, every range checked against the
//! connection's own registrations) with the node as its [`ShmHandler`]. `NodePut` and
//! `NodeRead` call the very functions the data channel calls ([`NodeInner::node_put_from`],
//! [`NodeInner::node_read`]), so the epoch fence, the handle checks and the tenant and key
//! check of every read are the same on both paths. The offer (socket path, boot id, nonce)
//! is answered on the node's authenticated data channel (`XferRequest::ShmOffer`): a client
//! asks each node it talks to, whichever master leads, and asks again whenever it reconnects
//! (a restarted node has a new nonce).

use std::sync::Arc;

use crate::rpc::accept::TokenDigest;
use crate::rpc::shm::{SegTable, ShmHandler, ShmMode, ShmReply, ShmRequest, ShmServer};
use crate::rpc::shm::{copy_out, refuse};

use super::NodeInner;

impl ShmHandler for NodeInner {
    fn handle(&self, req: ShmRequest, segs: &SegTable) -> ShmReply {
        match req {
            ShmRequest::NodePut {
                handles,
                ranges,
                end,
            } => ShmReply::Put(segs.sources(&ranges, handles.len()).and_then(|data| {
                self.node_put_from(&handles, &data, end, &|| segs.client_gave_up())
            })),
            ShmRequest::NodeRead {
                tenant,
                keys,
                replicas,
                ranges,
            } => ShmReply::Get(segs.resolve(&ranges, keys.len()).and_then(|dst| {
                let blobs = self.node_read(&tenant, &keys, &replicas, dst.len())?;
                Ok(blobs
                    .into_iter()
                    .zip(dst)
                    .map(|(b, (m, r))| b.and_then(|b| copy_out(&b, m, r, segs)))
                    .collect())
            })),
            other => refuse(
                &other,
                "this is a store node: metadata calls go to the master, data by descriptor",
            ),
        }
    }
}

/// Starts the node's shared-memory listener (None when turned off, or when it cannot
/// start: clients then use the data channel).
pub(super) fn start(inner: &Arc<NodeInner>) -> Option<ShmServer> {
    if inner.opts.shm == ShmMode::Off {
        return None;
    }
    let dir = inner
        .opts
        .shm_dir
        .clone()
        .unwrap_or_else(std::env::temp_dir);
    let token = inner.opts.token.as_deref().map(TokenDigest::of);
    match ShmServer::start(inner.clone(), &dir, token, inner.opts.max_frame_bytes) {
        Ok(s) => {
            let _ = inner.shm_offer.set(s.offer.clone());
            Some(s)
        }
        Err(e) => {
            tracing::warn!(error = %e, "store node: shared-memory path unavailable; TCP only");
            None
        }
    }
}
