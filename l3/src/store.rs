//! The embedded store: master, one memory segment and the SSD tier in the caller's process.
//!
//! Why: the scheduler and the simulator need L3 semantics (leases, eviction, SSD, promotion)
//! without a network; this is the same code the server wraps, so what tests prove here holds
//! there. Reads copy once, from the segment's bytes (or the SSD) straight into the caller's
//! buffer, after the metadata lock is released.
//!
//! Invariants:
//! - The master lock is held only for metadata work; no I/O and no memcpy happen under it.
//! - Bytes handed to a reader come from a replica that was leased at resolution time, so
//!   eviction cannot free them under the reader (and `Arc` keeps them alive regardless).
//! - SSD bytes are returned only after their checksum verified; a corrupt copy is dropped from
//!   the master and reported as a miss (-704).

use std::sync::mpsc::{RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::api::{BatchResult, L3Store};
use crate::clock::Clock;
use crate::config::{OffloadMode, StoreConfig};
use crate::error::{L3Error, L3Result};
use crate::master::{
    DiskLoc, EvictionOutcome, LOCAL_NODE, Master, MasterPolicy, ReadSource, Removed,
};
use crate::metrics::{Metrics, Op};
use crate::pattern::KeyPattern;
use crate::promotion::Promoter;
use crate::ssd::{OffloadJob, SsdTier, TierHooks, TierStats};
use crate::types::{
    Blob, ClientId, ClientStatus, ExistOptions, PutHandle, PutOptions, QueryResult,
    ReplicaDescriptor, ReplicateConfig, SegmentId, StoreStats, Tenant, validate_key,
};

/// The client id the embedded store uses for its own segment (never declared dead).
pub const LOCAL_CLIENT: ClientId = ClientId(0);
/// The embedded store's own segment.
pub const LOCAL_SEGMENT: SegmentId = SegmentId(0);

/// Copies above this many bytes in one batch are split across two threads.
const PARALLEL_COPY_BYTES: u64 = 8 << 20;

pub(crate) struct Inner {
    pub(crate) cfg: StoreConfig,
    pub(crate) clock: Arc<Clock>,
    pub(crate) master: Mutex<Master>,
    pub(crate) ssd: Option<SsdTier>,
    pub(crate) promoter: Option<Promoter>,
    pub(crate) metrics: Metrics,
    sweeper: Mutex<Option<(SyncSender<()>, JoinHandle<()>)>>,
}

/// The in-process L3 store. Dropping it flushes queued SSD writes and stops its threads.
pub struct EmbeddedStore {
    inner: Arc<Inner>,
}

struct Hooks(Weak<Inner>);

impl TierHooks for Hooks {
    fn register(&self, items: &[(&OffloadJob, DiskLoc)]) -> Vec<bool> {
        let Some(inner) = self.0.upgrade() else {
            // Store is going away: the bucket is durable and a restart rescan registers it.
            return vec![true; items.len()];
        };
        let mut m = inner.master.lock();
        items
            .iter()
            .map(|(j, loc)| m.register_disk(LOCAL_NODE, &j.tenant, &j.key, j.token, *loc))
            .collect()
    }

    fn write_failed(&self, jobs: &[OffloadJob]) {
        if let Some(inner) = self.0.upgrade() {
            let mut m = inner.master.lock();
            for j in jobs.iter().filter(|j| j.staged) {
                m.unstage(&j.tenant, &j.key, j.token);
            }
        }
    }

    fn evict_disk(&self, recs: &[(Tenant, String, DiskLoc)]) -> bool {
        let Some(inner) = self.0.upgrade() else {
            return false;
        };
        let now = inner.clock.now_ms();
        let mut m = inner.master.lock();
        if !recs
            .iter()
            .all(|(t, k, l)| m.disk_evictable(LOCAL_NODE, t, k, l, now))
        {
            return false;
        }
        for (t, k, l) in recs {
            m.drop_disk(LOCAL_NODE, t, k, l);
        }
        true
    }
}

impl EmbeddedStore {
    /// Builds a store: validates the config, mounts the local segment, opens the SSD tier
    /// (rescanning and re-registering its buckets) and starts the background threads.
    pub fn new(cfg: StoreConfig) -> L3Result<Self> {
        Self::with_clock(cfg, Arc::new(Clock::new()))
    }

    /// As [`EmbeddedStore::new`], with a caller-provided clock (simulation).
    pub fn with_clock(cfg: StoreConfig, clock: Arc<Clock>) -> L3Result<Self> {
        cfg.validate()?;
        let policy = MasterPolicy::from_config(&cfg);
        let mut master = Master::new(policy);
        let now = clock.now_ms();
        master.register_immortal_client(LOCAL_CLIENT, now);
        if cfg.local_segment_bytes > 0 {
            master.mount_segment(LOCAL_CLIENT, LOCAL_SEGMENT, cfg.local_segment_bytes, now)?;
        }
        let (ssd, rescanned) = match &cfg.ssd {
            Some(s) => {
                let (tier, found) = SsdTier::open(s.clone())?;
                (Some(tier), found)
            }
            None => (None, Vec::new()),
        };
        let mut refused = Vec::new();
        for (t, k, loc) in rescanned {
            if !master.register_rescanned(LOCAL_NODE, &t, &k, loc) {
                refused.push(loc);
            }
        }
        if let Some(tier) = &ssd {
            tier.tombstone_many(&refused)?;
        }
        let has_ssd = ssd.is_some();
        let mut start_err = None;
        let inner = Arc::new_cyclic(|weak: &Weak<Inner>| {
            let promoter = if has_ssd {
                let w = weak.clone();
                let work: crate::promotion::PromoteFn =
                    Arc::new(move |t: &Tenant, k: &str| match w.upgrade() {
                        Some(inner) => inner.promote_one(t, k),
                        None => Err(L3Error::Unavailable("store dropped".into())),
                    });
                match Promoter::start(cfg.promotion.clone(), clock.clone(), work) {
                    Ok(p) => Some(p),
                    Err(e) => {
                        start_err = Some(e);
                        None
                    }
                }
            } else {
                None
            };
            Inner {
                cfg: cfg.clone(),
                clock: clock.clone(),
                master: Mutex::new(master),
                ssd,
                promoter,
                metrics: Metrics::default(),
                sweeper: Mutex::new(None),
            }
        });
        if let Some(e) = start_err {
            return Err(e);
        }
        if let Some(tier) = &inner.ssd {
            tier.start(Arc::new(Hooks(Arc::downgrade(&inner))))?;
        }
        Inner::start_sweeper(&inner)?;
        Ok(EmbeddedStore { inner })
    }

    /// The store's clock (tests and simulation may [`Clock::advance`] it).
    pub fn clock(&self) -> &Arc<Clock> {
        &self.inner.clock
    }

    /// Runs the housekeeping pass now: revoke timed-out puts, expire silent clients.
    pub fn sweep_now(&self) -> (u64, u64) {
        let now = self.inner.clock.now_ms();
        self.inner.master.lock().sweep(now)
    }

    /// Metrics registry.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Prometheus text of all metrics.
    pub fn render_metrics(&self) -> String {
        self.inner.render_metrics()
    }

    /// SSD tier numbers (None without an SSD tier).
    pub fn ssd_stats(&self) -> Option<TierStats> {
        self.inner.ssd.as_ref().map(|s| s.stats())
    }

    /// The promoter (None without an SSD tier).
    pub fn promoter(&self) -> Option<&Promoter> {
        self.inner.promoter.as_ref()
    }

    /// Whether the key currently has a memory / disk replica (tests, simulator).
    pub fn residency(&self, tenant: &Tenant, key: &str) -> (bool, bool) {
        let m = self.inner.master.lock();
        (m.in_memory(tenant, key), m.on_disk(tenant, key))
    }

    /// Whether the key is leased now.
    pub fn is_leased(&self, tenant: &Tenant, key: &str) -> bool {
        let now = self.inner.clock.now_ms();
        self.inner.master.lock().is_leased(tenant, key, now)
    }

    /// Reads objects without copying DRAM replicas: memory hits come back as shared
    /// [`Blob::Shared`] handles, SSD reads as verified owned bytes. This is what the server
    /// serialises straight onto the wire.
    pub fn batch_get_blobs<K: AsRef<str>>(&self, tenant: &Tenant, keys: &[K]) -> BatchResult<Blob> {
        self.inner.cfg.check_batch(keys.len())?;
        let t0 = Instant::now();
        let srcs = self.inner.resolve(tenant, keys);
        let out = self.inner.blobs(tenant, keys, srcs);
        self.inner.metrics.observe(Op::Get, t0.elapsed());
        Ok(out)
    }

    /// `BatchExistKey` over any key type (the transfer channel passes borrowed keys).
    /// Probes take no lease and touch no recency; with `prefetch_to_memory`, SSD-only keys
    /// are handed to the promoter (or a DRAM-pressure cool-down starts).
    pub fn exist_many<K: AsRef<str>>(
        &self,
        tenant: &Tenant,
        keys: &[K],
        opts: ExistOptions,
    ) -> BatchResult<bool> {
        self.inner.cfg.check_batch(keys.len())?;
        let t0 = Instant::now();
        let want_promote = opts.prefetch_to_memory && self.inner.promoter.is_some();
        let mut promote = Vec::new();
        let mut pressure = false;
        let out = {
            let m = self.inner.master.lock();
            if want_promote {
                pressure = m.under_pressure(0);
            }
            let sink = if want_promote && !pressure {
                Some(&mut promote)
            } else {
                None
            };
            m.exists_many(tenant, keys, sink)
        };
        if let Some(p) = &self.inner.promoter {
            if want_promote && pressure {
                p.note_pressure();
            } else if !promote.is_empty() {
                // Outcomes (queued / deduplicated / cooling / queue full) are counted by the
                // promoter; a probe never waits for them.
                let _ = p.trigger_many(promote.into_iter().map(|k| (tenant.clone(), k)).collect());
            }
        }
        self.inner.metrics.observe(Op::Exist, t0.elapsed());
        Ok(out)
    }

    /// [`L3Store::batch_get_with_query`] returning blobs (server side).
    pub fn batch_get_with_query_blobs(
        &self,
        tenant: &Tenant,
        queries: &[QueryResult],
    ) -> BatchResult<Blob> {
        self.inner.cfg.check_batch(queries.len())?;
        let t0 = Instant::now();
        let keys: Vec<String> = queries.iter().map(|q| q.key.clone()).collect();
        let srcs = self.inner.resolve_query(tenant, queries);
        let out = self.inner.blobs(tenant, &keys, srcs);
        self.inner.metrics.observe(Op::Get, t0.elapsed());
        Ok(out)
    }

    /// Store limits (the server advertises them).
    pub fn config(&self) -> &StoreConfig {
        &self.inner.cfg
    }

    /// Flushes the SSD queue and stops background threads (also done on drop).
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        self.inner.shutdown();
    }
}

impl Inner {
    fn start_sweeper(this: &Arc<Inner>) -> L3Result<()> {
        let period = this
            .cfg
            .put_timeout
            .min(this.cfg.client_ttl)
            .div_f64(4.0)
            .clamp(Duration::from_millis(10), Duration::from_secs(1));
        let (tx, rx) = sync_channel::<()>(1);
        let weak = Arc::downgrade(this);
        let h = std::thread::Builder::new()
            .name("kvtier-l3-sweeper".into())
            .spawn(move || {
                loop {
                    match rx.recv_timeout(period) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    let Some(inner) = weak.upgrade() else { return };
                    let now = inner.clock.now_ms();
                    inner.master.lock().sweep(now);
                }
            })
            .map_err(|e| L3Error::Internal(format!("spawn sweeper: {e}")))?;
        *this.sweeper.lock() = Some((tx, h));
        Ok(())
    }

    fn shutdown(&self) {
        let sweeper = self.sweeper.lock().take();
        if let Some((tx, h)) = sweeper {
            drop(tx);
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        if let Some(p) = &self.promoter {
            p.shutdown();
        }
        if let Some(s) = &self.ssd {
            s.flush();
            s.shutdown();
        }
    }

    fn render_metrics(&self) -> String {
        let mut stats = self.master.lock().stats();
        let mut extra: Vec<(&str, &str, u64)> = Vec::new();
        let evictions = self.master.lock().evictions_total;
        self.metrics
            .evictions
            .store(evictions, std::sync::atomic::Ordering::Relaxed);
        if let Some(s) = &self.ssd {
            let t = s.stats();
            stats.disk_used_bytes = t.used_bytes;
            extra.push((
                "kvtier_l3_ssd_objects_written_total",
                "Objects written to SSD",
                t.written_objects,
            ));
            extra.push((
                "kvtier_l3_ssd_write_failures_total",
                "Failed bucket writes",
                t.write_failures,
            ));
            extra.push((
                "kvtier_l3_ssd_evicted_buckets_total",
                "SSD buckets evicted",
                t.evicted_buckets,
            ));
        }
        if let Some(p) = &self.promoter {
            use std::sync::atomic::Ordering::Relaxed;
            let c = p.counters();
            extra.push((
                "kvtier_l3_promotions_queued_total",
                "Promotions queued",
                c.queued.load(Relaxed),
            ));
            extra.push((
                "kvtier_l3_promotions_completed_total",
                "Promotions completed",
                c.completed.load(Relaxed),
            ));
            extra.push((
                "kvtier_l3_promotions_failed_total",
                "Promotions failed",
                c.failed.load(Relaxed),
            ));
            extra.push((
                "kvtier_l3_promotions_skipped_total",
                "Promotion triggers skipped",
                c.skipped.load(Relaxed),
            ));
        }
        self.metrics.render(&stats, &extra)
    }

    /// Promotion work: read the SSD copy (verified) and add a memory replica.
    fn promote_one(&self, t: &Tenant, key: &str) -> L3Result<()> {
        let Some(ssd) = &self.ssd else {
            return Err(L3Error::UnableOffload);
        };
        let (token, loc) = {
            let m = self.master.lock();
            if m.under_pressure(0) {
                return Err(L3Error::NoAvailableHandle { needed: 0 });
            }
            m.ssd_only(t, key).ok_or(L3Error::ObjectNotFound)?
        };
        let mut buf = vec![0u8; loc.size as usize];
        if !ssd.read(&loc, &mut buf)? {
            self.on_corrupt(t, key, &loc);
            return Err(L3Error::ObjectNotFound);
        }
        let now = self.clock.now_ms();
        self.master
            .lock()
            .promote(t, key, token, Arc::from(buf), now)
    }

    /// After the master removed objects: cancels their queued SSD writes and tombstones
    /// their SSD copies (published or registered), durably, so an acknowledged remove
    /// survives a crash at any point of the write.
    fn forget_on_disk(&self, t: &Tenant, removed: &[Removed]) -> L3Result<()> {
        let Some(ssd) = &self.ssd else { return Ok(()) };
        let mut locs = Vec::new();
        for r in removed {
            locs.extend(ssd.cancel(t, &r.key, r.token));
            locs.extend(r.disk.map(|(_, l)| l));
        }
        ssd.tombstone_many(&locs)
    }

    fn on_corrupt(&self, t: &Tenant, key: &str, loc: &DiskLoc) {
        Metrics::add(&self.metrics.corrupt_reads, 1);
        self.master.lock().drop_disk(LOCAL_NODE, t, key, loc);
        if let Some(s) = &self.ssd
            && let Err(e) = s.tombstone(loc)
        {
            tracing::warn!(error = %e, "could not tombstone a corrupt record");
        }
    }

    fn offload_evicted(&self, out: EvictionOutcome) {
        let Some(ssd) = &self.ssd else { return };
        for s in out.to_offload {
            let (t, k, tok) = (s.tenant.clone(), s.key.clone(), s.token);
            let job = OffloadJob {
                tenant: s.tenant,
                key: s.key,
                token: s.token,
                data: s.data,
                staged: true,
                done: None,
            };
            if ssd.enqueue(job, false).is_err() {
                Metrics::add(&self.metrics.offload_skipped, 1);
                self.master.lock().unstage(&t, &k, tok);
            }
        }
    }

    /// A put's bytes in a buffer of their own: a recycled one when the segment has one of
    /// this size (taken under the lock, filled after it), else a fresh one. One copy.
    fn object_bytes(&self, data: &[u8]) -> Arc<[u8]> {
        let recycled = self.master.lock().take_buffer(data.len() as u64);
        crate::buffers::fill(recycled, data)
    }

    fn put_start(&self, t: &Tenant, key: &str, size: u64) -> L3Result<PutHandle> {
        self.cfg.check_put(key, size)?;
        let now = self.clock.now_ms();
        let mut out = EvictionOutcome::default();
        let r = {
            let mut m = self.master.lock();
            let r = m.put_start(t, key, size, 1, now, &mut out);
            // Announced with the eviction that staged them, so a remove cancels them.
            if let Some(ssd) = &self.ssd {
                for s in &out.to_offload {
                    ssd.announce(&s.tenant, &s.key, s.token);
                }
            }
            r
        };
        if !out.to_offload.is_empty() {
            self.offload_evicted(out);
        }
        r
    }

    fn put_end(&self, h: &PutHandle, opts: PutOptions) -> L3Result<()> {
        let now = self.clock.now_ms();
        let write_through = self
            .ssd
            .as_ref()
            .filter(|s| s.config().mode == OffloadMode::WriteThrough);
        let data = {
            let mut m = self.master.lock();
            let data = m.put_end(h, opts.soft_pin, now)?;
            // Announced in the critical section that makes the object visible: a remove
            // either precedes both or finds the announcement and cancels the write.
            if let (Some(ssd), Some(_)) = (write_through, &data) {
                ssd.announce(&h.tenant, &h.key, h.token);
            }
            data
        };
        let Some(ssd) = write_through else {
            return Ok(());
        };
        let Some(data) = data else { return Ok(()) };
        let (job, wait) = OffloadJob::for_put(h, data, opts.wait_persisted);
        match ssd.enqueue(job, opts.wait_persisted) {
            Ok(()) => {}
            Err(e) => {
                Metrics::add(&self.metrics.offload_skipped, 1);
                // The object is in DRAM; only its SSD copy is missing.
                return if opts.wait_persisted { Err(e) } else { Ok(()) };
            }
        }
        match wait {
            Some(rx) => rx
                .recv()
                .map_err(|_| L3Error::Unavailable("ssd writer stopped".into()))?,
            None => Ok(()),
        }
    }

    /// Resolves query results while their leases hold (-707 per expired key). Descriptors
    /// are reused only if they still name this tenant's object: a forged or stale one is a
    /// miss, never foreign bytes.
    fn resolve_query(
        &self,
        tenant: &Tenant,
        queries: &[QueryResult],
    ) -> Vec<L3Result<(u64, ReadSource)>> {
        let now = self.clock.now_ms();
        let m = self.master.lock();
        queries
            .iter()
            .map(|q| {
                if now >= q.lease_deadline_ms {
                    Metrics::add(&self.metrics.lease_rejections, 1);
                    return Err(L3Error::LeaseExpired);
                }
                validate_key(&q.key)?;
                let qr = m.current_replicas(tenant, &q.key)?;
                for r in &q.replicas {
                    match r {
                        ReplicaDescriptor::Memory { alloc, .. } if qr.0.contains(alloc) => {
                            if let Some(d) = m.alloc_data(*alloc) {
                                return Ok((d.len() as u64, ReadSource::Memory(d)));
                            }
                        }
                        ReplicaDescriptor::Disk {
                            bucket,
                            offset,
                            size,
                            crc,
                            ..
                        } => {
                            let loc = DiskLoc {
                                bucket: *bucket,
                                offset: *offset,
                                size: *size,
                                crc: *crc,
                            };
                            if qr.1 == Some(loc) {
                                return Ok((loc.size, ReadSource::Disk(loc)));
                            }
                        }
                        _ => {}
                    }
                }
                Err(L3Error::ObjectNotFound)
            })
            .collect()
    }

    /// Turns sources into blobs: DRAM shared, SSD read and verified.
    fn blobs<K: AsRef<str>>(
        &self,
        t: &Tenant,
        keys: &[K],
        srcs: Vec<L3Result<(u64, ReadSource)>>,
    ) -> Vec<L3Result<Blob>> {
        let mut out = Vec::with_capacity(srcs.len());
        for (i, s) in srcs.into_iter().enumerate() {
            out.push(match s {
                Err(e) => Err(e),
                Ok((_, ReadSource::Memory(d))) => {
                    Metrics::add(&self.metrics.hits_memory, 1);
                    Ok(Blob::Shared(d))
                }
                Ok((size, ReadSource::Disk(loc))) => match &self.ssd {
                    None => Err(L3Error::UnableOffload),
                    Some(ssd) => {
                        let mut v = vec![0u8; size as usize];
                        match ssd.read(&loc, &mut v) {
                            Ok(true) => {
                                Metrics::add(&self.metrics.hits_disk, 1);
                                Ok(Blob::Owned(v))
                            }
                            Ok(false) => {
                                self.on_corrupt(t, keys[i].as_ref(), &loc);
                                Err(L3Error::ObjectNotFound)
                            }
                            Err(e) => Err(e),
                        }
                    }
                },
            });
        }
        Metrics::add(
            &self.metrics.misses,
            out.iter().filter(|r| r.is_err()).count() as u64,
        );
        out
    }

    /// Resolves keys to sources under one lock; waits for in-flight promotions of SSD-only
    /// keys (notification, bounded by `ssd_get_wait`) and re-resolves those.
    fn resolve<K: AsRef<str>>(&self, t: &Tenant, keys: &[K]) -> Vec<L3Result<(u64, ReadSource)>> {
        let now = self.clock.now_ms();
        let mut res: Vec<L3Result<(u64, ReadSource)>> = {
            let mut m = self.master.lock();
            keys.iter()
                .map(|k| {
                    validate_key(k.as_ref())?;
                    m.read_source(t, k.as_ref(), now)
                })
                .collect()
        };
        if let Some(p) = &self.promoter {
            // One deadline for the whole batch (not `ssd_get_wait` per key).
            let on_disk = res
                .iter()
                .enumerate()
                .filter(|(_, r)| matches!(r, Ok((_, ReadSource::Disk(_)))))
                .map(|(i, _)| (i, keys[i].as_ref()));
            let promoted = p.wait_many(t, on_disk);
            if !promoted.is_empty() {
                let now = self.clock.now_ms();
                let mut m = self.master.lock();
                for i in promoted {
                    res[i] = m.read_source(t, keys[i].as_ref(), now);
                }
            }
        }
        res
    }

    /// Copies resolved sources into buffers: memory copies (parallel when large), then
    /// verified SSD reads.
    fn fill(
        &self,
        t: &Tenant,
        keys: &[String],
        srcs: Vec<L3Result<(u64, ReadSource)>>,
        bufs: &mut [&mut [u8]],
    ) -> Vec<L3Result<u64>> {
        let mut out: Vec<L3Result<u64>> = Vec::with_capacity(srcs.len());
        let mut mem_jobs: Vec<(Arc<[u8]>, usize)> = Vec::new();
        let mut disk_jobs: Vec<(DiskLoc, usize)> = Vec::new();
        for (i, s) in srcs.into_iter().enumerate() {
            match s {
                Err(e) => out.push(Err(e)),
                Ok((size, src)) => {
                    let have = bufs[i].len() as u64;
                    if have < size {
                        out.push(Err(L3Error::BufferOverflow { needed: size, have }));
                        continue;
                    }
                    out.push(Ok(size));
                    match src {
                        ReadSource::Memory(d) => mem_jobs.push((d, i)),
                        ReadSource::Disk(l) => disk_jobs.push((l, i)),
                    }
                }
            }
        }
        let mem_bytes: u64 = mem_jobs.iter().map(|(d, _)| d.len() as u64).sum();
        Metrics::add(&self.metrics.hits_memory, mem_jobs.len() as u64);
        copy_all(&mem_jobs, bufs, mem_bytes >= PARALLEL_COPY_BYTES);
        if let Some(ssd) = &self.ssd {
            let results = read_disk_all(ssd, &disk_jobs, bufs);
            for ((loc, i), r) in disk_jobs.iter().zip(results) {
                match r {
                    Ok(true) => Metrics::add(&self.metrics.hits_disk, 1),
                    Ok(false) => {
                        self.on_corrupt(t, &keys[*i], loc);
                        out[*i] = Err(L3Error::ObjectNotFound);
                    }
                    Err(e) => out[*i] = Err(e),
                }
            }
        } else {
            for (_, i) in &disk_jobs {
                out[*i] = Err(L3Error::UnableOffload);
            }
        }
        let misses = out.iter().filter(|r| r.is_err()).count() as u64;
        Metrics::add(&self.metrics.misses, misses);
        out
    }
}

/// Memory copies into the caller's buffers; split over two threads for large batches.
fn copy_all(jobs: &[(Arc<[u8]>, usize)], bufs: &mut [&mut [u8]], parallel: bool) {
    if !parallel || jobs.len() < 2 {
        for (d, i) in jobs {
            bufs[*i][..d.len()].copy_from_slice(d);
        }
        return;
    }
    // Pair each job with its destination slice, then split the list in two halves by bytes.
    let mut slots: Vec<Option<&mut [u8]>> = bufs.iter_mut().map(|b| Some(&mut **b)).collect();
    let mut work: Vec<(&[u8], &mut [u8])> = Vec::with_capacity(jobs.len());
    for (d, i) in jobs {
        if let Some(dst) = slots[*i].take() {
            work.push((&d[..], dst));
        }
    }
    let total: usize = work.iter().map(|(s, _)| s.len()).sum();
    let mut acc = 0;
    let mut split = work.len();
    for (n, (s, _)) in work.iter().enumerate() {
        if acc >= total / 2 {
            split = n;
            break;
        }
        acc += s.len();
    }
    let (a, b) = work.split_at_mut(split);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            for (s, d) in b.iter_mut() {
                d[..s.len()].copy_from_slice(s);
            }
        });
        for (s, d) in a.iter_mut() {
            d[..s.len()].copy_from_slice(s);
        }
    });
}

/// Verified SSD reads straight into the caller's buffers; several in flight for big batches.
fn read_disk_all(
    ssd: &SsdTier,
    jobs: &[(DiskLoc, usize)],
    bufs: &mut [&mut [u8]],
) -> Vec<L3Result<bool>> {
    if jobs.is_empty() {
        return Vec::new();
    }
    let mut slots: Vec<Option<&mut [u8]>> = bufs.iter_mut().map(|b| Some(&mut **b)).collect();
    let mut work: Vec<(DiskLoc, &mut [u8])> = Vec::with_capacity(jobs.len());
    let mut results: Vec<L3Result<bool>> = Vec::with_capacity(jobs.len());
    for (loc, i) in jobs {
        if let Some(dst) = slots[*i].take() {
            work.push((*loc, dst));
        }
    }
    const READERS: usize = 4;
    if work.len() < 4 {
        for (loc, dst) in work.iter_mut() {
            results.push(ssd.read(loc, &mut dst[..loc.size as usize]));
        }
        return results;
    }
    let chunk = work.len().div_ceil(READERS);
    let mut parts: Vec<Vec<L3Result<bool>>> = Vec::new();
    std::thread::scope(|sc| {
        let handles: Vec<_> = work
            .chunks_mut(chunk)
            .map(|part| {
                sc.spawn(move || {
                    part.iter_mut()
                        .map(|(loc, dst)| ssd.read(loc, &mut dst[..loc.size as usize]))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            parts.push(
                h.join()
                    .unwrap_or_else(|_| vec![Err(L3Error::Internal("reader panicked".into()))]),
            );
        }
    });
    for p in parts {
        results.extend(p);
    }
    results.resize_with(jobs.len(), || {
        Err(L3Error::Internal("reader lost results".into()))
    });
    results
}

impl L3Store for EmbeddedStore {
    fn put_start(&self, tenant: &Tenant, key: &str, size: u64) -> L3Result<PutHandle> {
        self.inner.put_start(tenant, key, size)
    }

    fn put_write(&self, handle: &PutHandle, data: &[u8]) -> L3Result<()> {
        if data.len() as u64 != handle.size {
            return Err(L3Error::InvalidParams(
                "data length differs from put size".into(),
            ));
        }
        let bytes = self.inner.object_bytes(data);
        self.inner.master.lock().put_write(handle, bytes)
    }

    fn put_end(&self, handle: &PutHandle, opts: PutOptions) -> L3Result<()> {
        self.inner.put_end(handle, opts)
    }

    fn put_revoke(&self, handle: &PutHandle) -> L3Result<()> {
        self.inner.master.lock().put_revoke(handle)
    }

    /// One process is one failure domain: a valid `replica_num` is accepted and one memory
    /// replica is kept (extra copies in the same process would only cost DRAM).
    fn batch_put_start_with(
        &self,
        tenant: &Tenant,
        keys: &[String],
        sizes: &[u64],
        cfg: ReplicateConfig,
    ) -> BatchResult<PutHandle> {
        cfg.validate()?;
        self.inner.cfg.check_batch(keys.len())?;
        if keys.len() != sizes.len() {
            return Err(L3Error::InvalidParams(
                "keys and sizes differ in length".into(),
            ));
        }
        Ok(keys
            .iter()
            .zip(sizes)
            .map(|(k, &s)| self.inner.put_start(tenant, k, s))
            .collect())
    }

    fn batch_put_end(&self, handles: &[PutHandle], opts: PutOptions) -> BatchResult<()> {
        self.inner.cfg.check_batch(handles.len())?;
        Ok(handles
            .iter()
            .map(|h| self.inner.put_end(h, opts))
            .collect())
    }

    fn batch_put_revoke(&self, handles: &[PutHandle]) -> BatchResult<()> {
        self.inner.cfg.check_batch(handles.len())?;
        let mut m = self.inner.master.lock();
        Ok(handles.iter().map(|h| m.put_revoke(h)).collect())
    }

    fn get_replica_list(&self, tenant: &Tenant, key: &str) -> L3Result<QueryResult> {
        validate_key(key)?;
        let now = self.inner.clock.now_ms();
        self.inner.master.lock().query(tenant, key, now)
    }

    fn batch_exist_key(
        &self,
        tenant: &Tenant,
        keys: &[String],
        opts: ExistOptions,
    ) -> BatchResult<bool> {
        self.exist_many(tenant, keys, opts)
    }

    fn batch_query(&self, tenant: &Tenant, keys: &[String]) -> BatchResult<QueryResult> {
        self.inner.cfg.check_batch(keys.len())?;
        let t0 = Instant::now();
        let now = self.inner.clock.now_ms();
        let out = self.inner.master.lock().query_many(tenant, keys, now);
        self.inner.metrics.observe(Op::Query, t0.elapsed());
        Ok(out)
    }

    fn batch_get_with_query(
        &self,
        tenant: &Tenant,
        queries: &[QueryResult],
        bufs: &mut [&mut [u8]],
    ) -> BatchResult<u64> {
        self.inner.cfg.check_batch(queries.len())?;
        if queries.len() != bufs.len() {
            return Err(L3Error::InvalidParams(
                "queries and buffers differ in length".into(),
            ));
        }
        let t0 = Instant::now();
        let keys: Vec<String> = queries.iter().map(|q| q.key.clone()).collect();
        let srcs = self.inner.resolve_query(tenant, queries);
        let out = self.inner.fill(tenant, &keys, srcs, bufs);
        self.inner.metrics.observe(Op::Get, t0.elapsed());
        Ok(out)
    }

    fn remove(&self, tenant: &Tenant, key: &str, force: bool) -> L3Result<()> {
        validate_key(key)?;
        let t0 = Instant::now();
        let now = self.inner.clock.now_ms();
        let removed = self.inner.master.lock().remove(tenant, key, force, now)?;
        self.inner
            .forget_on_disk(tenant, std::slice::from_ref(&removed))?;
        self.inner.metrics.observe(Op::Remove, t0.elapsed());
        Ok(())
    }

    fn remove_all(&self, tenant: &Tenant, force: bool) -> L3Result<u64> {
        let now = self.inner.clock.now_ms();
        let removed = self.inner.master.lock().remove_all(tenant, force, now);
        self.inner.forget_on_disk(tenant, &removed)?;
        Ok(removed.len() as u64)
    }

    fn remove_by_regex(&self, tenant: &Tenant, pattern: &str, force: bool) -> L3Result<u64> {
        let pattern = KeyPattern::new(pattern)?;
        let t0 = Instant::now();
        let now = self.inner.clock.now_ms();
        let removed = (self.inner.master.lock()).remove_matching(tenant, &pattern, force, now);
        self.inner.forget_on_disk(tenant, &removed)?;
        self.inner.metrics.observe(Op::Remove, t0.elapsed());
        Ok(removed.len() as u64)
    }

    fn copy_replica(&self, tenant: &Tenant, key: &str, target: SegmentId) -> L3Result<bool> {
        validate_key(key)?;
        self.inner.master.lock().copy_replica(tenant, key, target)
    }

    fn move_replica(
        &self,
        tenant: &Tenant,
        key: &str,
        source: SegmentId,
        target: SegmentId,
    ) -> L3Result<()> {
        validate_key(key)?;
        (self.inner.master.lock()).move_replica(tenant, key, source, target)
    }

    fn mount_segment(&self, client: ClientId, segment: SegmentId, capacity: u64) -> L3Result<()> {
        let now = self.inner.clock.now_ms();
        self.inner
            .master
            .lock()
            .mount_segment(client, segment, capacity, now)
    }

    fn unmount_segment(&self, client: ClientId, segment: SegmentId) -> L3Result<()> {
        self.inner
            .master
            .lock()
            .unmount_segment(client, segment)
            .map(|_| ())
    }

    fn ping(&self, client: ClientId) -> L3Result<ClientStatus> {
        let now = self.inner.clock.now_ms();
        Ok(self.inner.master.lock().ping(client, now))
    }

    fn put(&self, tenant: &Tenant, key: &str, data: &[u8], opts: PutOptions) -> L3Result<()> {
        let t0 = Instant::now();
        let h = self.inner.put_start(tenant, key, data.len() as u64)?;
        let bytes = self.inner.object_bytes(data);
        // Bind the result first: the guard of the first lock must be gone before the revoke
        // locks again (parking_lot's mutex is not reentrant; holding it here deadlocked the
        // store when a forced remove raced this put).
        let written = self.inner.master.lock().put_write(&h, bytes);
        if let Err(e) = written {
            // The revoke fails only if the pending object is already gone (a forced remove
            // took it): nothing is left to release then.
            let _ = self.inner.master.lock().put_revoke(&h);
            return Err(e);
        }
        let r = self.inner.put_end(&h, opts);
        self.inner.metrics.observe(Op::Put, t0.elapsed());
        r
    }

    fn get(&self, tenant: &Tenant, key: &str) -> L3Result<Vec<u8>> {
        let size = self.get_size(tenant, key)?;
        let mut buf = vec![0u8; size as usize];
        let n = self.get_into(tenant, key, &mut buf)?;
        buf.truncate(n as usize);
        Ok(buf)
    }

    /// One replica whatever `replica_num` says (see `batch_put_start_with`).
    fn batch_put_from_with(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &[&[u8]],
        opts: PutOptions,
        cfg: ReplicateConfig,
    ) -> BatchResult<()> {
        cfg.validate()?;
        self.inner.cfg.check_batch(keys.len())?;
        if keys.len() != bufs.len() {
            return Err(L3Error::InvalidParams(
                "keys and buffers differ in length".into(),
            ));
        }
        Ok(keys
            .iter()
            .zip(bufs)
            .map(|(k, b)| self.put(tenant, k, b, opts))
            .collect())
    }

    fn batch_get_into(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &mut [&mut [u8]],
    ) -> BatchResult<u64> {
        self.inner.cfg.check_batch(keys.len())?;
        if keys.len() != bufs.len() {
            return Err(L3Error::InvalidParams(
                "keys and buffers differ in length".into(),
            ));
        }
        let t0 = Instant::now();
        let srcs = self.inner.resolve(tenant, keys);
        let out = self.inner.fill(tenant, keys, srcs, bufs);
        self.inner.metrics.observe(Op::Get, t0.elapsed());
        Ok(out)
    }

    fn get_size(&self, tenant: &Tenant, key: &str) -> L3Result<u64> {
        validate_key(key)?;
        self.inner.master.lock().size_of(tenant, key)
    }

    fn flush(&self) -> L3Result<()> {
        if let Some(s) = &self.inner.ssd {
            s.flush();
        }
        Ok(())
    }

    fn stats(&self) -> L3Result<StoreStats> {
        let mut s = self.inner.master.lock().stats();
        if let Some(t) = &self.inner.ssd {
            s.disk_used_bytes = t.stats().used_bytes;
        }
        Ok(s)
    }
}
