//! [`StoreNode`]: a store node of a split deployment (`kvtier-l3 --role node`) — Mooncake's
//! client that mounts a segment: it holds the bytes of the memory replicas the master placed
//! in its segment and its own SSD tier, and serves them on its data channel.
//!
//! Why this shape: the master decides placement, leases and eviction; the node only keeps
//! bytes by allocation id and does what the master tells it. Every message the master sends
//! it rides on a reply the node asked for ([`NodeSync`](crate::master::NodeSync) on pings and
//! put ends), so the master never connects to nodes and a dead node costs it nothing but a
//! TTL.
//!
//! Lifecycle: open the SSD tier (rescanning buckets) → bind the data channel (and the
//! shared-memory socket for clients on this host, unless turned off) → `MountNode`
//! with the master (an empty segment, the offload mode) → `Rescanned` with every live SSD
//! record (the master refuses records of objects removed meanwhile; those are tombstoned) →
//! ping every `ping_interval`, acknowledging the settles applied (see `sync`). SIGTERM: stop serving, flush the SSD queue (each record is
//! registered once durable), `Leave`, exit.
//!
//! This file holds the options, the node's state and its start / shutdown; the rest:
//! - `mem`: the bytes held by allocation id (live, staged for the SSD, retired),
//! - `recycle`: freed buffers kept for the next puts of the same size (bounded),
//! - `link`: the connection to the master,
//! - `sync`: mounting, pinging and applying what the master said,
//! - `tier`: the node's SSD tier (offload of evicted replicas, promotion, corrupt records),
//! - `data`: the data channel (puts and reads of bytes),
//! - `shm`: the same puts and reads through shared memory, for clients on the node's host.

mod data;
mod link;
mod mem;
mod recycle;
mod shm;
mod sync;
mod tier;

use crate::ha::{EpochFence, Locator};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::clock::Periodic;
use crate::config::{OffloadMode, SsdConfig, StoreConfig};
use crate::error::{L3Error, L3Result};
use crate::master::DiskLoc;
use crate::rpc::accept::TokenDigest;
use crate::rpc::server::{DEFAULT_MAX_FRAME, DEFAULT_XFER_WRITE_TIMEOUT};
use crate::rpc::service::ClusterRequest;
use crate::rpc::shm::{ShmMode, ShmOffer, ShmServer};
use crate::rpc::xfer::XferServer;
use crate::ssd::SsdTier;
use crate::types::{ClientId, SegmentId, Tenant};

use link::MasterLink;
use mem::Mem;
use recycle::NodeRecycler;
use tier::NodeHooks;

/// Promotion batches waiting for the promoter thread (more are skipped).
const PROMOTE_QUEUE: usize = 64;

/// How to run a store node.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// Node id (its client id at the master; keep it across restarts so its SSD replicas are
    /// recognised). Its segment gets the same number. Must not be 0.
    pub id: ClientId,
    /// The master's RPC address.
    pub master: SocketAddr,
    /// Data-channel listen address (advertised to clients through the master).
    pub listen: SocketAddr,
    /// Shared-secret token (for the master and for this node's data channel).
    pub token: Option<String>,
    /// DRAM segment size.
    pub segment_bytes: u64,
    /// SSD tier (write-through or offload-on-evict).
    pub ssd: Option<SsdConfig>,
    /// Largest frame on the data channel.
    pub max_frame_bytes: usize,
    /// A write on an authenticated data-channel connection that makes no progress for this
    /// long (the peer does not read) drops the connection (as
    /// `ServerOptions::xfer_write_timeout`).
    pub xfer_write_timeout: std::time::Duration,
    /// Most keys per request.
    pub max_batch_keys: usize,
    /// Largest object.
    pub max_object_bytes: u64,
    /// Ping period (keep it well under the master's client TTL).
    pub ping_interval: Duration,
    /// Bytes written but never ended are dropped after this long.
    pub put_timeout: Duration,
    /// Where the master is found (None: at `master`). An etcd locator follows the leader:
    /// after a failover the node mounts again on the new leader (reporting its records),
    /// and refuses any master of an older epoch.
    pub locator: Option<Locator>,
    /// Deadline of one call on the master (a paused master costs this per try).
    pub master_timeout: Duration,
    /// Serve the shared-memory path to clients on this host (see [`crate::rpc::shm`]);
    /// defaults to `KVTIER_L3_SHM` (on unless it says `off`).
    pub shm: ShmMode,
    /// Directory of the shared-memory socket (None: the system's temporary directory).
    pub shm_dir: Option<std::path::PathBuf>,
    /// Freed object buffers kept once the node is idle (the rest are released and free
    /// heap pages returned to the system); while busy, at most half the segment is kept.
    pub recycle_idle_bytes: u64,
    /// The node is idle after this long without a put or a free (checked every ping).
    pub idle_trim_after: Duration,
}

impl NodeOptions {
    /// Defaults: 127.0.0.1:0, 1 GiB segment, no SSD, 64 MiB frames, 1 s pings.
    pub fn new(id: ClientId, master: SocketAddr) -> Self {
        NodeOptions {
            id,
            master,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: None,
            segment_bytes: 1 << 30,
            ssd: None,
            max_frame_bytes: DEFAULT_MAX_FRAME,
            xfer_write_timeout: DEFAULT_XFER_WRITE_TIMEOUT,
            max_batch_keys: 65_536,
            max_object_bytes: 1 << 30,
            ping_interval: Duration::from_secs(1),
            put_timeout: Duration::from_secs(30),
            locator: None,
            master_timeout: Duration::from_secs(10),
            shm: ShmMode::from_env(),
            shm_dir: None,
            recycle_idle_bytes: StoreConfig::default().recycle_idle_bytes,
            idle_trim_after: StoreConfig::default().idle_trim_after,
        }
    }
}

/// A batch of promotions for the promoter thread.
type PromoteBatch = Vec<(Tenant, String, DiskLoc)>;

struct NodeInner {
    opts: NodeOptions,
    segment: SegmentId,
    link: MasterLink,
    mem: Mutex<Mem>,
    /// Held while applying what the master said (frees, remounts) and across a `Promote`
    /// call until its bytes are in `mem`, so a free of a just-promoted allocation can never
    /// be applied before the bytes it frees arrive (order: `gate`, then `mem`).
    gate: Mutex<()>,
    ssd: Option<SsdTier>,
    data_addr: OnceLock<SocketAddr>,
    /// What the data channel's `ShmOffer` answers (unset: no shared-memory path).
    shm_offer: OnceLock<ShmOffer>,
    mounted: AtomicBool,
    /// Every settle (tombstone, write cancel) up to this sequence number is applied
    /// durably; sent on each ping so the master can forget them. Reset at each mount.
    applied: AtomicU64,
    /// The bytes of every free up to this sequence number are dropped; sent on each ping so
    /// the master stops repeating them. Reset at each mount.
    freed: AtomicU64,
    promote_tx: Mutex<Option<SyncSender<PromoteBatch>>>,
}

/// How long a node following an etcd leader waits at start for one to be elected.
const FIRST_LEADER_WAIT: Duration = Duration::from_secs(60);

impl NodeInner {
    /// The first mount. Following an etcd leader, the cluster may be electing one: wait
    /// (up to [`FIRST_LEADER_WAIT`]) instead of failing.
    fn mount_first(&self) -> L3Result<()> {
        let end = std::time::Instant::now() + FIRST_LEADER_WAIT;
        loop {
            match self.mount() {
                Err(
                    L3Error::NotLeader(_)
                    | L3Error::RpcFail(_)
                    | L3Error::Unavailable(_)
                    | L3Error::EpochFenced(_),
                ) if self.link.locator.follows_leader() && std::time::Instant::now() < end => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                r => return r,
            }
        }
    }

    fn data_addr(&self) -> L3Result<SocketAddr> {
        self.data_addr
            .get()
            .copied()
            .ok_or_else(|| L3Error::Internal("data channel not bound".into()))
    }

    fn offload_on_evict(&self) -> bool {
        self.ssd
            .as_ref()
            .is_some_and(|s| s.config().mode == OffloadMode::OnEvict)
    }
}

/// A running store node. Dropping it (or [`StoreNode::shutdown`]) stops serving, flushes the
/// SSD queue and leaves the master.
pub struct StoreNode {
    inner: Arc<NodeInner>,
    xfer: Mutex<Option<XferServer>>,
    shm: Mutex<Option<ShmServer>>,
    pinger: Mutex<Option<Periodic>>,
    promoter: Mutex<Option<JoinHandle<()>>>,
}

impl StoreNode {
    /// Opens the SSD tier, binds the data channel, mounts with the master (registering the
    /// SSD records found) and starts pinging. Fails if the master cannot be reached.
    pub fn start(opts: NodeOptions) -> L3Result<Self> {
        ShmMode::try_from_env()?;
        if opts.id.0 == 0 {
            return Err(L3Error::InvalidParams("node id 0 is reserved".into()));
        }
        if opts.segment_bytes == 0 || opts.max_batch_keys == 0 || opts.max_object_bytes == 0 {
            return Err(L3Error::InvalidParams(
                "segment size and limits must be positive".into(),
            ));
        }
        if opts.ping_interval.is_zero() {
            return Err(L3Error::InvalidParams("ping interval must be > 0".into()));
        }
        let ssd = match &opts.ssd {
            Some(c) => Some(SsdTier::open(c.clone())?.0),
            None => None,
        };
        let inner = Arc::new(NodeInner {
            segment: SegmentId(opts.id.0),
            link: MasterLink {
                locator: opts.locator.clone().unwrap_or(Locator::Fixed(opts.master)),
                token: opts.token.clone(),
                timeout: opts.master_timeout,
                fence: EpochFence::default(),
                conn: Mutex::new(None),
                limits: link::NodeLimits {
                    max_batch_keys: opts.max_batch_keys,
                    max_object_bytes: opts.max_object_bytes,
                    max_frame_bytes: opts.max_frame_bytes,
                },
                refused: Mutex::new(None),
            },
            mem: Mutex::new(Mem::new(NodeRecycler::new(
                opts.segment_bytes,
                opts.recycle_idle_bytes,
                opts.idle_trim_after,
            ))),
            gate: Mutex::new(()),
            ssd,
            data_addr: OnceLock::new(),
            shm_offer: OnceLock::new(),
            mounted: AtomicBool::new(false),
            applied: AtomicU64::new(0),
            freed: AtomicU64::new(0),
            promote_tx: Mutex::new(None),
            opts,
        });
        let mut promoter = None;
        if let Some(t) = &inner.ssd {
            t.start(Arc::new(NodeHooks(Arc::downgrade(&inner))))?;
            let (tx, rx) = sync_channel::<PromoteBatch>(PROMOTE_QUEUE);
            let weak = Arc::downgrade(&inner);
            let h = std::thread::Builder::new()
                .name("kvtier-l3-node-promoter".into())
                .spawn(move || {
                    while let Ok(batch) = rx.recv() {
                        let Some(n) = weak.upgrade() else { return };
                        n.promote(batch);
                    }
                })
                .map_err(|e| L3Error::Internal(format!("spawn promoter: {e}")))?;
            *inner.promote_tx.lock() = Some(tx);
            promoter = Some(h);
        }
        let x = XferServer::start(
            inner.clone(),
            inner.opts.listen,
            inner.opts.token.as_deref().map(TokenDigest::of),
            inner.opts.max_frame_bytes,
            inner.opts.xfer_write_timeout,
        )?;
        let _ = inner.data_addr.set(x.addr);
        let node = StoreNode {
            inner: inner.clone(),
            xfer: Mutex::new(Some(x)),
            shm: Mutex::new(shm::start(&inner)),
            pinger: Mutex::new(None),
            promoter: Mutex::new(promoter),
        };
        inner.mount_first()?;
        let weak = Arc::downgrade(&inner);
        let p = Periodic::spawn("kvtier-l3-node-ping", inner.opts.ping_interval, move || {
            let Some(n) = weak.upgrade() else {
                return false;
            };
            n.tick();
            // Refused by its master's protocol version: nothing more to ping (it exits).
            n.link.refused().is_none()
        })?;
        *node.pinger.lock() = Some(p);
        Ok(node)
    }

    /// Why this node's master refuses it for good: the master speaks another wire protocol
    /// version (-300; e.g. restarted in an upgrade while this node kept running). Every
    /// call it makes is then refused, so it stops pinging and its process exits with this
    /// error (`kvtier-l3 --role node`), rather than run on unmounted for as long as it lives.
    pub fn refused(&self) -> Option<L3Error> {
        self.inner.link.refused()
    }

    /// The data-channel address clients are sent to.
    pub fn data_addr(&self) -> SocketAddr {
        self.inner
            .data_addr
            .get()
            .copied()
            .unwrap_or(self.inner.opts.listen)
    }

    /// Stops serving, writes and registers every queued SSD copy, and leaves the master
    /// (its memory replicas are dropped there; its SSD replicas stay registered).
    pub fn shutdown(&self) {
        let pinger = self.pinger.lock().take();
        if let Some(mut p) = pinger {
            p.stop();
        }
        let xfer = self.xfer.lock().take();
        if let Some(mut x) = xfer {
            x.stop();
        }
        let shm = self.shm.lock().take();
        if let Some(mut s) = shm {
            s.stop();
        }
        // Closing the queue ends the promoter thread after its current batch.
        let tx = self.inner.promote_tx.lock().take();
        drop(tx);
        let promoter = self.promoter.lock().take();
        if let Some(h) = promoter {
            crate::error::join_logged("node promoter", h);
        }
        if let Some(s) = &self.inner.ssd {
            s.flush();
        }
        if self.inner.mounted.swap(false, Ordering::AcqRel) {
            // Unheard, the master declares this node dead after its client TTL instead.
            let left = self.inner.link.call(ClusterRequest::Leave {
                node: self.inner.opts.id,
            });
            crate::error::best_effort("leave the master", left);
        }
        if let Some(s) = &self.inner.ssd {
            s.shutdown();
        }
    }
}

impl Drop for StoreNode {
    fn drop(&mut self) {
        self.shutdown();
    }
}
