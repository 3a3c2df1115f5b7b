//! [`StoreNode`]: a store node of a split deployment (`kvtier-l3 --role node`) — Mooncake's
//! client that mounts a segment: it holds the bytes of the memory replicas the master placed
//! in its segment and its own SSD tier, and serves them on its data channel.
//!
//! Why this shape: the master decides placement, leases and eviction; the node only keeps
//! bytes by allocation id and does what the master tells it. Every message the master sends
//! it rides on a reply the node asked for ([`NodeSync`] on pings and put ends), so the master
//! never connects to nodes and a dead node costs it nothing but a TTL.
//!
//! Lifecycle: open the SSD tier (rescanning buckets) → bind the data channel → `MountNode`
//! with the master (an empty segment, the offload mode) → `Rescanned` with every live SSD
//! record (the master refuses records of objects removed meanwhile; those are tombstoned) →
//! ping every `ping_interval`.
//!
//! Tiers, as in the single process: in write-through mode every ended put is queued for the
//! SSD, so a DRAM eviction only drops bytes; in offload-on-evict mode the master leaves the
//! bytes of an evicted replica staged here ([`NodeSync::offload`]): they stay readable under
//! their allocation until their SSD copy is registered, then go. A prefetching probe at the
//! master queues SSD-only keys for their node ([`NodeSync::promote`]); the node's promoter
//! thread reads them (verified) and asks for a replica in its own segment (`Promote`).
//! A ping answered `need_remount` (declared dead while partitioned, or a restarted master)
//! drops all memory bytes and mounts again. SIGTERM: stop serving, flush the SSD queue (each
//! record is registered once durable), `Leave`, exit.
//!
//! Invariants:
//! - A read returns bytes only for the tenant and key they were written for (memory: the
//!   allocation's recorded owner; SSD: the bucket record's tenant and key), and SSD bytes only
//!   after their checksum verified.
//! - A put ends (becomes visible at the master) only after its bytes are held here; its
//!   write-through SSD copy is queued after the master accepted the end.
//! - Bytes of an allocation the master freed are dropped when the node hears of it; bytes
//!   written but never ended are dropped after `put_timeout`; memory held never exceeds twice
//!   the segment (-200 beyond), which bounds the lag between a free and its notice.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_bytes::ByteBuf;

use crate::clock::Periodic;
use crate::config::{OffloadMode, SsdConfig, check_batch_keys, check_object_bytes};
use crate::error::{L3Error, L3Result};
use crate::master::{DiskLoc, NodeSync};
use crate::rpc::client::{ClientOptions, RemoteStore};
use crate::rpc::server::DEFAULT_MAX_FRAME;
use crate::rpc::service::{ClusterReply, ClusterRequest};
use crate::rpc::xfer::{
    XferHandler, XferReply, XferRequest, XferServer, refuse, send_blobs, write_frame,
};
use crate::ssd::{OffloadJob, SsdTier, TierHooks};
use crate::types::{
    Blob, ClientId, PutHandle, PutOptions, ReplicaDescriptor, SegmentId, Tenant, validate_key,
};

/// SSD records registered per `Rescanned` call.
const RESCAN_CHUNK: usize = 4096;
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
    /// Most keys per request.
    pub max_batch_keys: usize,
    /// Largest object.
    pub max_object_bytes: u64,
    /// Ping period (keep it well under the master's client TTL).
    pub ping_interval: Duration,
    /// Bytes written but never ended are dropped after this long.
    pub put_timeout: Duration,
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
            max_batch_keys: 65_536,
            max_object_bytes: 1 << 30,
            ping_interval: Duration::from_secs(1),
            put_timeout: Duration::from_secs(30),
        }
    }
}

struct Held {
    tenant: Tenant,
    key: String,
    token: u64,
    data: Arc<[u8]>,
    ended: bool,
    /// Evicted at the master, kept for its SSD write (offload-on-evict).
    staged: Staging,
    since: Instant,
}

/// Where an evicted-but-staged allocation stands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Staging {
    /// A live replica (not evicted).
    No,
    /// Waiting for its SSD write; a master free does not drop it.
    Writing,
    /// Written (or failed): dropped at the first tick after `since` plus a ping period,
    /// so a reader holding its descriptor a moment longer still finds it.
    Retired,
}

#[derive(Default)]
struct Mem {
    allocs: HashMap<u64, Held>,
    /// Bytes of live replicas (staged bytes are bounded by the SSD queue and the grace
    /// period instead: they must not make puts fail while they drain).
    used: u64,
    /// (tenant, key, token) → allocation of staged bytes.
    staged: HashMap<(Tenant, String, u64), u64>,
}

impl Mem {
    fn drop_alloc(&mut self, alloc: u64) {
        if let Some(h) = self.allocs.remove(&alloc) {
            if h.staged == Staging::No {
                self.used = self.used.saturating_sub(h.data.len() as u64);
            } else {
                self.staged.remove(&(h.tenant, h.key, h.token));
            }
        }
    }

    /// The staged bytes of this object version are done with (written or failed).
    fn retire(&mut self, t: &Tenant, key: &str, token: u64) {
        if let Some(a) = self.staged.get(&(t.clone(), key.to_string(), token))
            && let Some(h) = self.allocs.get_mut(a)
        {
            h.staged = Staging::Retired;
            h.since = Instant::now();
        }
    }
}

/// A batch of promotions for the promoter thread.
type PromoteBatch = Vec<(Tenant, String, DiskLoc)>;

/// The node's connection to the master; reconnects on the next call after a failure.
struct MasterLink {
    addr: SocketAddr,
    token: Option<String>,
    conn: Mutex<Option<Arc<RemoteStore>>>,
}

impl MasterLink {
    fn call(&self, req: ClusterRequest) -> L3Result<ClusterReply> {
        let c = {
            let mut g = self.conn.lock();
            match &*g {
                Some(c) => c.clone(),
                None => {
                    let c = Arc::new(RemoteStore::connect(
                        self.addr,
                        ClientOptions {
                            token: self.token.clone(),
                            rpc_timeout: Duration::from_secs(10),
                            use_transfer_channel: false,
                            ..Default::default()
                        },
                    )?);
                    if !c.limits().cluster {
                        return Err(L3Error::InvalidParams(format!(
                            "{} is not a master (start one with `kvtier-l3 --role master`)",
                            self.addr
                        )));
                    }
                    *g = Some(c.clone());
                    c
                }
            }
        };
        let r = c.cluster(req);
        if let Err(L3Error::RpcFail(_)) = &r {
            *self.conn.lock() = None;
        }
        r
    }
}

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
    mounted: AtomicBool,
    promote_tx: Mutex<Option<SyncSender<PromoteBatch>>>,
}

struct NodeHooks(Weak<NodeInner>);

impl TierHooks for NodeHooks {
    fn register(&self, items: &[(&OffloadJob, DiskLoc)]) -> Vec<bool> {
        let Some(n) = self.0.upgrade() else {
            return vec![true; items.len()];
        };
        let req = ClusterRequest::RegisterDisk {
            node: n.opts.id,
            items: items
                .iter()
                .map(|(j, l)| (j.tenant.clone(), j.key.clone(), j.token, *l))
                .collect(),
        };
        match n.link.call(req) {
            Ok(ClusterReply::Accepted(v)) if v.len() == items.len() => {
                // Registered (or refused: removed meanwhile): staged bytes are done with.
                let mut m = n.mem.lock();
                for (j, _) in items.iter().filter(|(j, _)| j.staged) {
                    m.retire(&j.tenant, &j.key, j.token);
                }
                v
            }
            // Master unreachable: keep the durable records; the next mount re-registers them.
            other => {
                tracing::warn!(
                    ?other,
                    "ssd registration not confirmed; kept for re-registration"
                );
                vec![true; items.len()]
            }
        }
    }

    fn write_failed(&self, jobs: &[OffloadJob]) {
        let Some(n) = self.0.upgrade() else { return };
        n.unstage(jobs.iter().filter(|j| j.staged));
    }

    fn evict_disk(&self, recs: &[(Tenant, String, DiskLoc)]) -> bool {
        let Some(n) = self.0.upgrade() else {
            return false;
        };
        matches!(
            n.link.call(ClusterRequest::EvictDisk {
                node: n.opts.id,
                recs: recs.to_vec(),
            }),
            Ok(ClusterReply::Evictable(true))
        )
    }
}

impl NodeInner {
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

    /// Joins the master with an empty segment, then registers every live SSD record.
    fn mount(&self) -> L3Result<()> {
        let _gate = self.gate.lock();
        self.mounted.store(false, Ordering::Release);
        *self.mem.lock() = Mem::default();
        self.link.call(ClusterRequest::MountNode {
            node: self.opts.id,
            segment: self.segment,
            capacity: self.opts.segment_bytes,
            data_addr: self.data_addr()?,
            offload_on_evict: self.offload_on_evict(),
        })?;
        if let Some(ssd) = &self.ssd {
            let recs = ssd.live_records();
            let mut refused = 0usize;
            for chunk in recs.chunks(RESCAN_CHUNK) {
                let reply = self.link.call(ClusterRequest::Rescanned {
                    node: self.opts.id,
                    disks: chunk.to_vec(),
                })?;
                let ClusterReply::Accepted(ok) = reply else {
                    return Err(L3Error::RpcFail("unexpected reply to Rescanned".into()));
                };
                let dead: Vec<DiskLoc> = chunk
                    .iter()
                    .zip(ok)
                    .filter(|(_, accepted)| !accepted)
                    .map(|((_, _, loc), _)| *loc)
                    .collect();
                refused += dead.len();
                if let Err(e) = ssd.tombstone_many(&dead) {
                    tracing::warn!(error = %e, "could not tombstone refused records");
                }
            }
            tracing::info!(
                registered = recs.len() - refused,
                refused,
                "ssd replicas registered with the master"
            );
        }
        self.mounted.store(true, Ordering::Release);
        Ok(())
    }

    fn apply(&self, s: NodeSync) {
        let _gate = self.gate.lock();
        let mut jobs = Vec::new();
        let mut lost = Vec::new();
        if !s.freed.is_empty() || !s.offload.is_empty() {
            let mut m = self.mem.lock();
            // Evicted replicas to write first: their allocations are in `freed` too.
            for a in &s.offload {
                let Some(h) = m.allocs.get_mut(a) else {
                    continue;
                };
                if !h.ended || h.staged != Staging::No || self.ssd.is_none() {
                    continue;
                }
                h.staged = Staging::Writing;
                let (t, k, tok, data) = (h.tenant.clone(), h.key.clone(), h.token, h.data.clone());
                m.used = m.used.saturating_sub(data.len() as u64);
                m.staged.insert((t.clone(), k.clone(), tok), *a);
                jobs.push(OffloadJob {
                    tenant: t,
                    key: k,
                    token: tok,
                    data,
                    staged: true,
                    done: None,
                });
            }
            for a in &s.freed {
                if m.allocs.get(a).is_some_and(|h| h.staged == Staging::No) {
                    m.drop_alloc(*a);
                }
            }
        }
        if let Some(ssd) = &self.ssd {
            for j in jobs {
                ssd.announce(&j.tenant, &j.key, j.token);
                let (t, k, tok) = (j.tenant.clone(), j.key.clone(), j.token);
                if ssd.enqueue(j, false).is_err() {
                    lost.push(OffloadJob {
                        tenant: t,
                        key: k,
                        token: tok,
                        data: Arc::from(Vec::new()),
                        staged: true,
                        done: None,
                    });
                }
            }
            if let Err(e) = ssd.tombstone_many(&s.tombstones) {
                tracing::warn!(error = %e, "could not tombstone removed records");
            }
        }
        // A full SSD queue skips the write, as in the single process: the copy is dropped.
        self.unstage(lost.iter());
        if !s.promote.is_empty()
            && let Some(tx) = &*self.promote_tx.lock()
        {
            // A full promoter queue skips the batch (a later probe asks again).
            let _ = tx.try_send(s.promote);
        }
    }

    /// Staged copies whose SSD write failed or was skipped: dropped here and at the master.
    fn unstage<'a>(&self, jobs: impl Iterator<Item = &'a OffloadJob>) {
        let items: Vec<(Tenant, String, u64)> = {
            let mut m = self.mem.lock();
            jobs.map(|j| {
                m.retire(&j.tenant, &j.key, j.token);
                (j.tenant.clone(), j.key.clone(), j.token)
            })
            .collect()
        };
        if items.is_empty() {
            return;
        }
        if let Err(e) = self.link.call(ClusterRequest::Unstage {
            node: self.opts.id,
            items,
        }) {
            tracing::warn!(error = %e, "could not tell the master of failed offloads");
        }
    }

    /// Promoter thread work: read each SSD copy (verified), get a replica for it in this
    /// node's segment from the master, keep the bytes under it.
    fn promote(&self, batch: PromoteBatch) {
        let Some(ssd) = &self.ssd else { return };
        let mut read: Vec<((Tenant, String, DiskLoc), Vec<u8>)> = Vec::new();
        for (t, k, loc) in batch {
            match ssd.owner_of(&loc) {
                Some((tt, kk)) if tt == t && kk == k => {}
                _ => continue,
            }
            let mut v = vec![0u8; loc.size as usize];
            match ssd.read(&loc, &mut v) {
                Ok(true) => read.push(((t, k, loc), v)),
                Ok(false) => self.on_corrupt(&t, &k, loc),
                Err(e) => tracing::warn!(error = %e, "promotion read failed"),
            }
        }
        if read.is_empty() {
            return;
        }
        let _gate = self.gate.lock();
        let room = {
            let m = self.mem.lock();
            let want: u64 = read.iter().map(|(_, v)| v.len() as u64).sum();
            m.used + want <= self.opts.segment_bytes.saturating_mul(2)
        };
        if !room {
            return;
        }
        let items: Vec<(Tenant, String, DiskLoc)> = read.iter().map(|(i, _)| i.clone()).collect();
        let n = items.len();
        let res = match self.link.call(ClusterRequest::Promote {
            node: self.opts.id,
            items,
        }) {
            Ok(ClusterReply::Promoted(v)) if v.len() == n => v,
            other => {
                tracing::warn!(?other, "promotion not confirmed by the master");
                return;
            }
        };
        let mut m = self.mem.lock();
        for (((t, k, _), v), r) in read.into_iter().zip(res) {
            let Ok((alloc, token)) = r else { continue };
            m.used += v.len() as u64;
            m.allocs.insert(
                alloc,
                Held {
                    tenant: t,
                    key: k,
                    token,
                    data: Arc::from(v),
                    ended: true,
                    staged: Staging::No,
                    since: Instant::now(),
                },
            );
        }
    }

    fn on_corrupt(&self, t: &Tenant, key: &str, loc: DiskLoc) {
        let _ = self.link.call(ClusterRequest::DropDisk {
            node: self.opts.id,
            tenant: t.clone(),
            key: key.to_string(),
            loc,
        });
        if let Some(ssd) = &self.ssd
            && let Err(e) = ssd.tombstone(&loc)
        {
            tracing::warn!(error = %e, "could not tombstone a corrupt record");
        }
    }

    /// One ping period: drop stale unended writes, ping (or mount), apply the reply.
    fn tick(&self) {
        let stale = self.opts.put_timeout;
        let grace = self.opts.ping_interval;
        {
            let mut m = self.mem.lock();
            let old: Vec<u64> = m
                .allocs
                .iter()
                .filter(|(_, h)| {
                    (!h.ended && h.since.elapsed() > stale)
                        || (h.staged == Staging::Retired && h.since.elapsed() >= grace)
                })
                .map(|(&a, _)| a)
                .collect();
            for a in old {
                m.drop_alloc(a);
            }
        }
        if !self.mounted.load(Ordering::Acquire) {
            if let Err(e) = self.mount() {
                tracing::warn!(error = %e, "mount with the master failed; retrying");
            }
            return;
        }
        match self.link.call(ClusterRequest::Ping { node: self.opts.id }) {
            Ok(ClusterReply::Sync(s)) if s.need_remount => {
                tracing::warn!(
                    "master does not know this node (declared dead or restarted): remounting"
                );
                if let Err(e) = self.mount() {
                    tracing::warn!(error = %e, "remount failed; retrying");
                }
            }
            Ok(ClusterReply::Sync(s)) => self.apply(s),
            Ok(other) => tracing::warn!(?other, "unexpected ping reply"),
            Err(e) => tracing::warn!(error = %e, "ping failed"),
        }
    }

    fn alloc_of(&self, h: &PutHandle) -> L3Result<u64> {
        match h.replica {
            ReplicaDescriptor::Memory {
                segment,
                alloc,
                size,
                ..
            } if segment == self.segment && size == h.size => Ok(alloc),
            _ => Err(L3Error::InvalidParams(
                "the handle names no allocation of this node".into(),
            )),
        }
    }

    fn write_one(&self, h: &PutHandle, data: Vec<u8>) -> L3Result<()> {
        validate_key(&h.key)?;
        let alloc = self.alloc_of(h)?;
        if data.len() as u64 != h.size {
            return Err(L3Error::InvalidParams(
                "data length differs from put size".into(),
            ));
        }
        check_object_bytes(h.size, self.opts.max_object_bytes)?;
        let bytes: Arc<[u8]> = Arc::from(data);
        let mut m = self.mem.lock();
        let prev = match m.allocs.get(&alloc) {
            Some(e) if e.ended => return Err(L3Error::ObjectAlreadyExists),
            Some(e) => e.data.len() as u64,
            None => 0,
        };
        let used = m.used.saturating_sub(prev);
        if used + h.size > self.opts.segment_bytes.saturating_mul(2) {
            return Err(L3Error::NoAvailableHandle { needed: h.size });
        }
        m.used = used + h.size;
        m.allocs.insert(
            alloc,
            Held {
                tenant: h.tenant.clone(),
                key: h.key.clone(),
                token: h.token,
                data: bytes,
                ended: false,
                staged: Staging::No,
                since: Instant::now(),
            },
        );
        Ok(())
    }

    fn end_many(&self, handles: &[PutHandle], out: &mut [L3Result<()>], opts: PutOptions) {
        let mut ready = Vec::new();
        {
            let m = self.mem.lock();
            for (i, h) in handles.iter().enumerate() {
                if out[i].is_err() {
                    continue;
                }
                let r = self.alloc_of(h).and_then(|a| match m.allocs.get(&a) {
                    Some(e) if e.token == h.token && e.tenant == h.tenant && e.key == h.key => {
                        if e.ended {
                            Err(L3Error::ObjectAlreadyExists)
                        } else {
                            Ok(())
                        }
                    }
                    _ => Err(L3Error::ReplicaIsNotReady),
                });
                match r {
                    Ok(()) => ready.push(i),
                    Err(e) => out[i] = Err(e),
                }
            }
        }
        if ready.is_empty() {
            return;
        }
        let req = ClusterRequest::PutEndReplicas {
            node: self.opts.id,
            handles: ready.iter().map(|&i| handles[i].clone()).collect(),
            soft_pin: opts.soft_pin,
        };
        let (res, sync) = match self.link.call(req) {
            Ok(ClusterReply::EndedReplicas(res, sync)) if res.len() == ready.len() => (res, sync),
            Ok(_) => {
                for &i in &ready {
                    out[i] = Err(L3Error::RpcFail("unexpected reply from the master".into()));
                }
                return;
            }
            Err(e) => {
                for &i in &ready {
                    out[i] = Err(e.clone());
                }
                return;
            }
        };
        let mut jobs = Vec::new();
        {
            let mut m = self.mem.lock();
            for (&i, r) in ready.iter().zip(res) {
                let Ok(alloc) = self.alloc_of(&handles[i]) else {
                    continue;
                };
                match r {
                    Ok(ended) => {
                        if let Some(e) = m.allocs.get_mut(&alloc) {
                            e.ended = true;
                            // One SSD copy per object: the first replica's node writes it.
                            if ended.primary {
                                jobs.push((i, e.data.clone()));
                            }
                        }
                    }
                    Err(e) => {
                        // Revoked or gone at the master: the allocation is free there.
                        if matches!(e, L3Error::IllegalClient(_) | L3Error::ObjectNotFound) {
                            m.drop_alloc(alloc);
                        }
                        out[i] = Err(e);
                    }
                }
            }
        }
        self.apply(sync);
        // Offload-on-evict writes evictions only (as the single process does).
        let Some(ssd) = self
            .ssd
            .as_ref()
            .filter(|s| s.config().mode == OffloadMode::WriteThrough)
        else {
            return;
        };
        let mut waits = Vec::new();
        for (i, data) in jobs {
            let h = &handles[i];
            ssd.announce(&h.tenant, &h.key, h.token);
            let (job, wait) = OffloadJob::for_put(h, data, opts.wait_persisted);
            match ssd.enqueue(job, opts.wait_persisted) {
                Ok(()) => {
                    if let Some(rx) = wait {
                        waits.push((i, rx));
                    }
                }
                // The object is in DRAM; only its SSD copy is missing.
                Err(e) if opts.wait_persisted => out[i] = Err(e),
                Err(_) => {}
            }
        }
        for (i, rx) in waits {
            match rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => out[i] = Err(e),
                Err(_) => out[i] = Err(L3Error::Unavailable("ssd writer stopped".into())),
            }
        }
    }

    fn node_put(
        &self,
        handles: Vec<PutHandle>,
        data: Vec<ByteBuf>,
        end: Option<PutOptions>,
    ) -> L3Result<Vec<L3Result<()>>> {
        check_batch_keys(handles.len(), self.opts.max_batch_keys)?;
        if !data.is_empty() && data.len() != handles.len() {
            return Err(L3Error::InvalidParams(
                "handles and data differ in length".into(),
            ));
        }
        let mut out: Vec<L3Result<()>> = vec![Ok(()); handles.len()];
        for (i, (h, d)) in handles.iter().zip(data).enumerate() {
            out[i] = self.write_one(h, d.into_vec());
        }
        if let Some(opts) = end {
            self.end_many(&handles, &mut out, opts);
        }
        Ok(out)
    }

    fn read_one(&self, t: &Tenant, key: &str, r: &ReplicaDescriptor) -> L3Result<Blob> {
        validate_key(key)?;
        match r {
            ReplicaDescriptor::Memory { segment, alloc, .. } => {
                if *segment != self.segment {
                    return Err(L3Error::ObjectNotFound);
                }
                let m = self.mem.lock();
                match m.allocs.get(alloc) {
                    Some(e) if e.ended && e.tenant == *t && e.key == key => {
                        Ok(Blob::Shared(e.data.clone()))
                    }
                    _ => Err(L3Error::ObjectNotFound),
                }
            }
            d => {
                let loc = DiskLoc::from_descriptor(d).ok_or(L3Error::ObjectNotFound)?;
                let ssd = self.ssd.as_ref().ok_or(L3Error::UnableOffload)?;
                match ssd.owner_of(&loc) {
                    Some((tt, kk)) if tt == *t && kk == key => {}
                    _ => return Err(L3Error::ObjectNotFound),
                }
                let mut v = vec![0u8; loc.size as usize];
                if ssd.read(&loc, &mut v)? {
                    Ok(Blob::Owned(v))
                } else {
                    // Corrupt: a miss, dropped at the master and tombstoned here.
                    self.on_corrupt(t, key, loc);
                    Err(L3Error::ObjectNotFound)
                }
            }
        }
    }

    fn node_read(
        &self,
        tenant: &Tenant,
        keys: &[String],
        replicas: &[ReplicaDescriptor],
        n_caps: usize,
    ) -> L3Result<Vec<L3Result<Blob>>> {
        check_batch_keys(keys.len(), self.opts.max_batch_keys)?;
        if replicas.len() != keys.len() || n_caps != keys.len() {
            return Err(L3Error::InvalidParams(
                "keys, replicas and capacities differ in length".into(),
            ));
        }
        Ok(keys
            .iter()
            .zip(replicas)
            .map(|(k, r)| self.read_one(tenant, k, r))
            .collect())
    }
}

impl XferHandler for NodeInner {
    fn handle(&self, sock: &mut TcpStream, req: XferRequest) -> bool {
        match req {
            XferRequest::NodePut { handles, data, end } => {
                let r = self.node_put(handles, data, end);
                write_frame(sock, &XferReply::Batch(r)).is_ok()
            }
            XferRequest::NodeRead {
                tenant,
                keys,
                replicas,
                caps,
            } => {
                let r = self.node_read(&tenant, &keys, &replicas, caps.len());
                send_blobs(sock, r, &caps).is_ok()
            }
            XferRequest::NodeFlush => {
                if let Some(s) = &self.ssd {
                    s.flush();
                }
                write_frame(sock, &XferReply::Batch(Ok(Vec::new()))).is_ok()
            }
            other => refuse(
                sock,
                &other,
                "this is a store node: metadata calls and probes go to the master",
            ),
        }
    }
}

/// A running store node. Dropping it (or [`StoreNode::shutdown`]) stops serving, flushes the
/// SSD queue and leaves the master.
pub struct StoreNode {
    inner: Arc<NodeInner>,
    xfer: Mutex<Option<XferServer>>,
    pinger: Mutex<Option<Periodic>>,
    promoter: Mutex<Option<JoinHandle<()>>>,
}

impl StoreNode {
    /// Opens the SSD tier, binds the data channel, mounts with the master (registering the
    /// SSD records found) and starts pinging. Fails if the master cannot be reached.
    pub fn start(opts: NodeOptions) -> L3Result<Self> {
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
                addr: opts.master,
                token: opts.token.clone(),
                conn: Mutex::new(None),
            },
            mem: Mutex::new(Mem::default()),
            gate: Mutex::new(()),
            ssd,
            data_addr: OnceLock::new(),
            mounted: AtomicBool::new(false),
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
            inner.opts.token.as_deref().map(Arc::from),
            inner.opts.max_frame_bytes,
        )?;
        let _ = inner.data_addr.set(x.addr);
        let node = StoreNode {
            inner: inner.clone(),
            xfer: Mutex::new(Some(x)),
            pinger: Mutex::new(None),
            promoter: Mutex::new(promoter),
        };
        inner.mount()?;
        let weak = Arc::downgrade(&inner);
        let p = Periodic::spawn("kvtier-l3-node-ping", inner.opts.ping_interval, move || {
            let Some(n) = weak.upgrade() else {
                return false;
            };
            n.tick();
            true
        })?;
        *node.pinger.lock() = Some(p);
        Ok(node)
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
        // Closing the queue ends the promoter thread after its current batch.
        let tx = self.inner.promote_tx.lock().take();
        drop(tx);
        let promoter = self.promoter.lock().take();
        if let Some(h) = promoter {
            let _ = h.join();
        }
        if let Some(s) = &self.inner.ssd {
            s.flush();
        }
        if self.inner.mounted.swap(false, Ordering::AcqRel) {
            let _ = self.inner.link.call(ClusterRequest::Leave {
                node: self.inner.opts.id,
            });
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
