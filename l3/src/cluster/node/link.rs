//! The node's connection to the master.
//!
//! Why: every exchange with the master is a call the node makes (mount, ping, put end,
//! registrations), so one lazily (re)connected client is all the node needs; a failed call
//! drops it and the next call connects again.
//!
//! With an etcd locator the next connection goes to the current leader, and a master of an
//! older epoch than one already seen is refused (`EpochFenced`): orders (frees, settles,
//! remounts) are only ever taken from the newest leader. A new leader does not know the
//! node, so its first ping answers `NeedRemount`, and the node mounts again with its
//! records — that is how the new leader rebuilds its metadata.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{L3Error, L3Result};
use crate::ha::{EpochFence, Locator};
use crate::rpc::client::{ClientOptions, RemoteStore};
use crate::rpc::service::{ClusterReply, ClusterRequest, ServerLimits};

/// The node's own limits (its `NodeOptions`). A split deployment's clients learn the limits
/// from the master's `hello` and send the nodes batches, objects and frames by them, so a
/// node's must be at least its master's: below them, it refused what every client sent
/// (a node of `--max-batch-keys 100` under a master of 65,536 failed every batch put of more
/// than 100 keys, -600 per key). Checked when the node meets a master (at start, and again
/// after a failover to a leader of other limits).
#[derive(Debug, Clone, Copy)]
pub(super) struct NodeLimits {
    pub(super) max_batch_keys: usize,
    pub(super) max_object_bytes: u64,
    pub(super) max_frame_bytes: usize,
}

impl NodeLimits {
    fn check(&self, master: &ServerLimits) -> L3Result<()> {
        for (flag, own, theirs) in [
            (
                "--max-batch-keys",
                self.max_batch_keys as u64,
                master.max_batch_keys,
            ),
            (
                "--max-object-bytes",
                self.max_object_bytes,
                master.max_object_bytes,
            ),
            (
                "--max-frame",
                self.max_frame_bytes as u64,
                master.max_frame_bytes,
            ),
        ] {
            if own < theirs {
                return Err(L3Error::InvalidParams(format!(
                    "this node's {flag} {own} is below its master's {theirs}: clients send \
                     the nodes what the master's limits allow (start the node with {flag} \
                     {theirs} or more)"
                )));
            }
        }
        Ok(())
    }
}

/// The node's connection to the master; reconnects on the next call after a failure.
pub(super) struct MasterLink {
    pub(super) locator: Locator,
    pub(super) token: Option<String>,
    pub(super) timeout: Duration,
    pub(super) fence: EpochFence,
    pub(super) conn: Mutex<Option<Arc<RemoteStore>>>,
    /// What the node takes; at least its master's limits (checked at each connection).
    pub(super) limits: NodeLimits,
    /// The master refused this node's protocol version (-300): every later call would be
    /// refused too, so the node stops (`StoreNode::refused`).
    pub(super) refused: Mutex<Option<L3Error>>,
}

impl MasterLink {
    pub(super) fn call(&self, req: ClusterRequest) -> L3Result<ClusterReply> {
        let r = self.call_once(req);
        if let Err(e @ L3Error::ProtocolMismatch { .. }) = &r {
            self.refused.lock().get_or_insert_with(|| e.clone());
        }
        r
    }

    /// Why the master refuses this node for good, if it does.
    pub(super) fn refused(&self) -> Option<L3Error> {
        self.refused.lock().clone()
    }

    fn call_once(&self, req: ClusterRequest) -> L3Result<ClusterReply> {
        let c = {
            let mut g = self.conn.lock();
            match &*g {
                Some(c) => c.clone(),
                None => {
                    let c = Arc::new(RemoteStore::connect_to(
                        self.locator.clone(),
                        ClientOptions {
                            token: self.token.clone(),
                            rpc_timeout: self.timeout,
                            leader_call_timeout: self.timeout,
                            failover_timeout: self.timeout,
                            use_transfer_channel: false,
                            // Metadata only: no data connections to the nodes.
                            shm: crate::rpc::shm::ShmMode::Off,
                            ..Default::default()
                        },
                    )?);
                    if !c.limits().cluster {
                        return Err(L3Error::InvalidParams(format!(
                            "{} is not a master (start one with `kvtier-l3 --role master`)",
                            c.master_addr()
                        )));
                    }
                    self.fence.admit(c.limits().epoch)?;
                    self.limits.check(&c.limits())?;
                    *g = Some(c.clone());
                    c
                }
            }
        };
        let r = c.cluster(req);
        if let Err(L3Error::RpcFail(_) | L3Error::NotLeader(_) | L3Error::EpochFenced(_)) = &r {
            *self.conn.lock() = None;
        }
        r
    }
}
