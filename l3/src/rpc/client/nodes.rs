//! A client's data connections to the store nodes of a split deployment: per node address,
//! its data channel (TCP) and, when the node is on this host, a shared-memory connection.
//!
//! Why: in a split deployment the bytes go between clients and nodes; a node on the
//! client's host is reached at memory speed through the node's shared-memory socket (see
//! [`crate::rpc::shm`]), any other over its data channel.
//!
//! How:
//! - The node's offer (socket path, boot id, nonce) is asked on its data channel each time
//!   that channel is (re)opened; a node under another kernel (boot id), or one that offers
//!   none (`--no-shm`), stays on TCP, as does every call while this client's [`ShmMode`] is
//!   `Off`. Nothing here involves the master, so a master failover changes nothing.
//! - A call goes through shared memory when it can, else on the data channel: an object
//!   bigger than half the staging segment, a socket that cannot be reached (tried again
//!   later), an end-only put. A shared-memory connection that breaks (a node restarted or
//!   killed) also drops the data channel: reopened, it brings the restarted node's new offer
//!   (new nonce), and the following calls are on shared memory again.
//! - Idempotent calls (reads) run once more after a transport failure (on a fresh
//!   connection, shared memory or TCP); puts never do, as on TCP.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::RemoteStore;
use super::routing::Retry;
use crate::error::{L3Error, L3Result};
use crate::rpc::service::{ClusterReply, ClusterRequest};
use crate::rpc::shm::{SharedRegion, ShmClient, ShmMode, ShmOutcome, ShmRequest};
use crate::rpc::xfer::XferClient;
use crate::types::{PutHandle, PutOptions, ReplicaDescriptor, Tenant};

/// How a client moves bytes to and from a store node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPath {
    /// Through memory shared with the node (same host).
    SharedMemory,
    /// Over the node's TCP data channel.
    Tcp,
}

/// The shared-memory side of a node's connections.
enum NodeShm {
    /// The node has not been asked for its offer yet.
    Unasked,
    /// No shared-memory path to this node (none offered, another host, turned off).
    Absent,
    /// A client for the node's offer (connected, or tried again on use).
    Ready(Box<ShmClient>),
}

/// One node's connections.
pub(crate) struct NodeSlot {
    xfer: Option<XferClient>,
    shm: NodeShm,
}

impl Default for NodeSlot {
    fn default() -> Self {
        NodeSlot {
            xfer: None,
            shm: NodeShm::Unasked,
        }
    }
}

/// A node's connections, shared by the calls to it (one call at a time).
pub(crate) type NodeConn = Arc<parking_lot::Mutex<NodeSlot>>;

/// Request bytes per key besides its range (key, tenant, descriptor or handle).
fn meta_of<'a>(keys: impl Iterator<Item = &'a str>, extra: usize) -> Vec<usize> {
    keys.map(|k| k.len() + extra).collect()
}

impl RemoteStore {
    fn node_slot(&self, addr: SocketAddr) -> NodeConn {
        self.nodes.lock().entry(addr).or_default().clone()
    }

    /// Asks the node behind `x` for its offer and points `shm` at it (a new nonce: the
    /// node restarted, connect again).
    fn refresh_offer(&self, x: &mut XferClient, shm: &mut NodeShm) {
        if self.opts.shm == ShmMode::Off {
            *shm = NodeShm::Absent;
            return;
        }
        match x.shm_offer() {
            Ok(Some(offer)) => match shm {
                NodeShm::Ready(c) => c.reoffer(offer),
                _ => {
                    *shm = match ShmClient::new(
                        offer,
                        self.opts.token.clone(),
                        self.frame_cap(),
                        self.limits.max_batch_keys as usize,
                        self.opts.shm_staging_bytes,
                        self.opts.rpc_timeout,
                    ) {
                        Some(mut c) => {
                            // Regions handed out before this node was reached: registered
                            // by the connect below.
                            for r in self.live_node_regions() {
                                if let Err(e) = c.adopt(&r) {
                                    tracing::debug!(error = %e, "store node: region");
                                }
                            }
                            if let Err(e) = c.connect() {
                                tracing::info!(error = %e, "store node: shared memory unavailable; TCP");
                            }
                            NodeShm::Ready(Box::new(c))
                        }
                        None => NodeShm::Absent,
                    }
                }
            },
            Ok(None) => *shm = NodeShm::Absent,
            // The connection failed: the call made on it next says so.
            Err(_) => {}
        }
    }

    /// The regions handed out to this split-deployment client that are still alive.
    fn live_node_regions(&self) -> Vec<Arc<SharedRegion>> {
        let mut v = self.node_regions.lock();
        v.retain(|w| w.strong_count() > 0);
        v.iter().filter_map(|w| w.upgrade()).collect()
    }

    /// A region shared with every store node this client reaches through shared memory,
    /// now and later (see [`RemoteStore::shared_region`]).
    pub(super) fn node_region(&self, len: usize) -> L3Result<Arc<SharedRegion>> {
        if self.nodes.lock().is_empty() {
            self.open_nodes();
        }
        let r = SharedRegion::create(len)?;
        self.node_regions.lock().push(Arc::downgrade(&r));
        let slots: Vec<NodeConn> = self.nodes.lock().values().cloned().collect();
        for slot in slots {
            if let NodeShm::Ready(c) = &mut slot.lock().shm
                && let Err(e) = c.adopt(&r)
            {
                // The connection dropped; the next call reconnects and registers it.
                tracing::debug!(error = %e, "store node: region");
            }
        }
        Ok(r)
    }

    /// Runs a data call on the node at `addr` through shared memory when it can
    /// (`via_shm`), else on its data channel (`via_tcp`); `ctx` is what both need mutably
    /// (the caller's buffers).
    fn on_node<C: ?Sized, T>(
        &self,
        addr: SocketAddr,
        retry: Retry,
        ctx: &mut C,
        mut via_shm: impl FnMut(&mut ShmClient, &mut C) -> ShmOutcome<T>,
        mut via_tcp: impl FnMut(&mut XferClient, &mut C) -> L3Result<T>,
    ) -> L3Result<T> {
        let slot = self.node_slot(addr);
        let mut s = slot.lock();
        let NodeSlot { xfer, shm } = &mut *s;
        if xfer.is_none() && matches!(shm, NodeShm::Unasked) {
            // The data channel first: it carries the offer.
            let mut c = XferClient::connect(
                addr,
                self.opts.token.clone(),
                self.frame_cap(),
                self.opts.rpc_timeout,
            )?;
            self.refresh_offer(&mut c, shm);
            *xfer = Some(c);
        }
        if let NodeShm::Ready(c) = shm {
            let tries = match retry {
                Retry::Once => 2,
                Retry::Never => 1,
            };
            for k in 0..tries {
                let was_live = c.is_live();
                let tried = Instant::now();
                let r = via_shm(c, ctx);
                if was_live && !c.is_live() {
                    // Broken under us: the node may have restarted, so its data channel is
                    // stale too; reopened, it brings the new offer.
                    *xfer = None;
                }
                match r {
                    // not tried again, nor over TCP, when the node did not answer in time
                    ShmOutcome::Done(Err(L3Error::RpcFail(_)))
                        if k + 1 < tries && self.may_retry(tried) => {}
                    ShmOutcome::Done(r) => return r,
                    ShmOutcome::UseTcp => break,
                }
            }
        }
        self.on_conn(
            addr,
            xfer,
            retry,
            &mut |x| self.refresh_offer(x, shm),
            |x| via_tcp(x, ctx),
        )
    }

    /// Reads replicas from the node at `addr` into `bufs` (one per key).
    pub(super) fn node_read_at(
        &self,
        addr: SocketAddr,
        tenant: &Tenant,
        keys: &[String],
        replicas: &[ReplicaDescriptor],
        bufs: &mut [&mut [u8]],
    ) -> L3Result<Vec<L3Result<u64>>> {
        let meta = meta_of(keys.iter().map(String::as_str), 160 + tenant.as_str().len());
        self.on_node(
            addr,
            Retry::Once,
            bufs,
            |c, bufs| {
                c.get_by(bufs, &meta, |idx, ranges| ShmRequest::NodeRead {
                    tenant: tenant.clone(),
                    keys: idx.iter().map(|&i| keys[i].clone()).collect(),
                    replicas: idx.iter().map(|&i| replicas[i].clone()).collect(),
                    ranges,
                })
            },
            |x, bufs| x.node_read(tenant, keys, replicas, bufs),
        )
    }

    /// Writes (`data`: one per handle, or empty) and/or ends (`end`) puts on the node at
    /// `addr`: one shared-memory call (pipelined by its client), or requests within the
    /// frame limit on the data channel. Never retried; when a request on the data channel
    /// fails, the puts of the requests before it keep their results.
    pub(super) fn node_put_at(
        &self,
        addr: SocketAddr,
        handles: &[PutHandle],
        data: &[&[u8]],
        end: Option<PutOptions>,
    ) -> L3Result<Vec<L3Result<()>>> {
        let meta = meta_of(
            handles.iter().map(|h| h.key.as_str()),
            256 + handles.first().map_or(0, |h| h.tenant.as_str().len()),
        );
        let mut done: Vec<L3Result<()>> = Vec::new();
        let r = self.on_node(
            addr,
            Retry::Never,
            &mut done,
            |c, _| {
                if data.is_empty() {
                    return ShmOutcome::UseTcp; // nothing to move: the data channel ends it
                }
                c.put_by(data, &meta, |idx, ranges| ShmRequest::NodePut {
                    handles: idx.iter().map(|&i| handles[i].clone()).collect(),
                    ranges,
                    end,
                })
            },
            |x, done| {
                done.clear();
                let size = |j: usize| data.get(j).map_or(0, |d| d.len()) + handles[j].key.len();
                for r in self.chunks(handles.len(), size) {
                    let ds = if data.is_empty() {
                        &[][..]
                    } else {
                        &data[r.clone()]
                    };
                    let v = x.node_put(&handles[r.clone()], ds, end)?;
                    if v.len() != r.len() {
                        return Err(L3Error::RpcFail("reply length mismatch".into()));
                    }
                    done.extend(v);
                }
                Ok(std::mem::take(done))
            },
        );
        match r {
            Err(e) if !done.is_empty() => {
                done.resize(handles.len(), Err(e));
                Ok(done)
            }
            r => r,
        }
    }

    /// Runs `f` on the data channel to the node at `addr` (calls with no bytes to move).
    pub(super) fn with_node<T>(
        &self,
        addr: SocketAddr,
        retry: Retry,
        f: impl FnMut(&mut XferClient) -> L3Result<T>,
    ) -> L3Result<T> {
        let slot = self.node_slot(addr);
        let mut s = slot.lock();
        let NodeSlot { xfer, shm } = &mut *s;
        self.on_conn(addr, xfer, retry, &mut |x| self.refresh_offer(x, shm), f)
    }

    /// Opens the data connections to every live node now (shared memory where it can), so
    /// that [`RemoteStore::uses_shm`] answers at once. Best effort: a node that cannot be
    /// reached is tried again on use.
    pub(super) fn open_nodes(&self) {
        let Ok(ClusterReply::Nodes(nodes)) = self.cluster(ClusterRequest::Nodes) else {
            return;
        };
        for n in nodes {
            let slot = self.node_slot(n.addr);
            let mut s = slot.lock();
            let NodeSlot { xfer, shm } = &mut *s;
            if xfer.is_none()
                && let Ok(mut c) = XferClient::connect(
                    n.addr,
                    self.opts.token.clone(),
                    self.frame_cap(),
                    self.opts.rpc_timeout,
                )
            {
                self.refresh_offer(&mut c, shm);
                *xfer = Some(c);
            }
        }
    }

    /// The store nodes this client has data connections to, and how it reaches each (a
    /// split deployment; empty otherwise).
    pub fn node_paths(&self) -> Vec<(SocketAddr, DataPath)> {
        let slots: Vec<(SocketAddr, NodeConn)> = self
            .nodes
            .lock()
            .iter()
            .map(|(a, s)| (*a, s.clone()))
            .collect();
        let mut v: Vec<(SocketAddr, DataPath)> = slots
            .into_iter()
            .map(|(a, s)| {
                let p = match &s.lock().shm {
                    NodeShm::Ready(c) if c.is_live() => DataPath::SharedMemory,
                    _ => DataPath::Tcp,
                };
                (a, p)
            })
            .collect();
        v.sort_by_key(|(a, _)| *a);
        v
    }
}
