//! The embedded store: master, one memory segment and the SSD tier in the caller's process.
//!
//! Why: the scheduler and the simulator need L3 semantics (leases, eviction, SSD, promotion)
//! without a network; this is the same code the server wraps, so what tests prove here holds
//! there. Reads copy once, from the segment's bytes (or the SSD) straight into the caller's
//! buffer, after the metadata lock is released.
//!
//! This file builds the store, owns its background threads (sweeper, promoter, SSD writer)
//! and its metrics; the rest is split by path:
//! - `read`: resolving keys to sources and copying them out (the read path),
//! - `write`: put start / end and the write-through hand-off to the SSD (the write path),
//! - `tier`: the glue between the master and the SSD tier (offload, promotion, corruption,
//!   removal on disk),
//! - `api`: the [`L3Store`](crate::L3Store) implementation over those pieces.
//!
//! Invariant (kept by every submodule): the master lock is held only for metadata work; no
//! I/O and no memcpy happen under it.

mod api;
mod fill;
mod read;
mod tier;
mod write;

use std::sync::mpsc::{RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::api::BatchResult;
use crate::buffers::{IdleTrim, release_free_memory};
use crate::clock::Clock;
use crate::config::StoreConfig;
use crate::error::{L3Error, L3Result};
use crate::master::{LOCAL_NODE, Master, MasterPolicy};
use crate::metrics::{Metrics, Op};
use crate::promotion::Promoter;
use crate::ssd::{SsdTier, TierStats};
use crate::types::{Blob, ClientId, ExistOptions, QueryResult, SegmentId, Tenant};

pub use fill::Filler;
use tier::Hooks;

/// The client id the embedded store uses for its own segment (never declared dead).
pub const LOCAL_CLIENT: ClientId = ClientId(0);
/// The embedded store's own segment.
pub const LOCAL_SEGMENT: SegmentId = SegmentId(0);

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
        for ev in &cfg.kv_events {
            master.attach_events(crate::kv_events::StorageEvents::start(
                ev,
                crate::kv_events::Binding::AtStart,
            )?);
        }
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
                    Arc::new(move |t: &Tenant, k: &str, room| match w.upgrade() {
                        Some(inner) => inner.promote_one(t, k, room),
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

    /// The residency event streams, in `StoreConfig::kv_events`' order (empty: none).
    pub fn kv_events(&self) -> Vec<crate::kv_events::KvEventsHandle> {
        self.inner.master.lock().event_handles()
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

    /// DRAM bytes the tenant holds (what `StoreConfig::tenant_quota_bytes` caps).
    pub fn tenant_dram_bytes(&self, tenant: &Tenant) -> u64 {
        self.inner.master.lock().tenant_dram_bytes(tenant)
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
                let _ = p.trigger_many(
                    promote.into_iter().map(|k| (tenant.clone(), k)).collect(),
                    crate::promotion::Room::Refuse,
                );
            }
        }
        self.inner.metrics.observe(Op::Exist, t0.elapsed());
        Ok(out)
    }

    /// [`L3Store::batch_get_with_query`](crate::L3Store::batch_get_with_query) returning blobs
    /// (server side).
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
        let mut idle = IdleTrim::new(this.cfg.idle_trim_after);
        let keep = this.cfg.recycle_idle_bytes;
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
                    let mut m = inner.master.lock();
                    m.sweep(now);
                    let activity = m.segment_activity().wrapping_add(inner.metrics.ops_total());
                    if idle.due(activity, Instant::now()) {
                        let freed = m.trim_recycled(keep);
                        drop(m);
                        drop(freed); // outside the lock
                        release_free_memory();
                    }
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
                crate::error::join_logged("store sweeper", h);
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
            extra.push((
                "kvtier_l3_ssd_capacity_bytes",
                "SSD bytes the tier may use now (at most its own use plus the filesystem's free space)",
                t.capacity_bytes,
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
        let mut text = self.metrics.render(&stats, &extra);
        let events = self.master.lock().event_handles();
        text.push_str(&crate::kv_events::render_metrics(&events));
        text
    }
}
