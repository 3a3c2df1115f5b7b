//! The simulated engine: a discrete-event loop that drives the real `Scheduler`s and the real
//! embedded L3 store, with copies and forwards completing at their modelled finish times.
//!
//! Integrity oracle: device and host pages hold an 8-byte fingerprint of the page hash whose
//! KV they contain; L3 objects hold the fingerprint as their (small) payload. Copies move
//! fingerprints when they *complete* (a source reused before its copy finished is caught); a
//! forward checks that every page it reads holds the fingerprint of the page its position
//! requires, and every backup checks that it stores under a key the content of that key's page.
//! Any mismatch is counted in `oracle_failures` (tests require zero).
//!
//! This file holds the simulation's state and its event loop (arrivals, the heap, the final
//! quiescence check); the rest:
//! - `plan`: an execution plan's ops and forward turned into timed events on the modelled
//!   links,
//! - `complete`: what happens when an op or a forward completes (L3 reads and writes, page
//!   copies, scheduler events),
//! - `oracle`: the integrity oracle's checks.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use kvtier_l3::{EmbeddedStore, L3Store, OffloadMode, SsdConfig, StoreConfig, Tenant};
use kvtier_radix::PageHash;
use kvtier_scheduler::*;

use crate::belady::AccessLog;
use crate::config::SimConfig;
use crate::report::{Collector, Report};
use crate::routing::ClusterRouter;
use crate::workload::{SimRequest, WorkloadError};

mod complete;
mod oracle;
mod plan;

/// What completes at a point in simulated time.
enum Pending {
    /// A request that arrives (pulled from the workload a window ahead of the clock).
    Arrival(Box<SimRequest>),
    Op {
        inst: usize,
        op: PlannedOp,
    },
    /// A prefetch completes at `at` unless a termination moved its completion.
    Prefetch {
        inst: usize,
        op: OpId,
        at: u64,
    },
    Forward {
        inst: usize,
        batch: ForwardBatch,
    },
    Wake(usize),
}

/// A prefetch in flight.
struct LivePrefetch {
    start: u64,
    dur: u64,
    keys: Vec<String>,
    dst: TierPages,
    /// Completion time of the live heap entry.
    at: u64,
    /// Pages that arrived before a termination.
    truncated: Option<usize>,
}

struct Track {
    /// Fingerprints of the request's full pages, extended as it grows.
    fps: Vec<u64>,
    hashes: Vec<PageHash>,
    /// Pages of the current table already verified since they last changed.
    verified: usize,
    arrival_us: u64,
    first_token_us: Option<u64>,
    /// Sequence length at which the request is done (its last forward re-verifies everything).
    final_len: usize,
    prompt_len: usize,
    logged: bool,
}

struct Instance {
    sched: Scheduler,
    /// Page contents (fingerprints) and page tables: the shared engine model, whose
    /// integrity oracle every forward goes through (`engine/oracle.rs`).
    model: kvtier_scheduler::model::PageModel<u64>,
    tracks: HashMap<RequestId, Track>,
    forward_busy: bool,
    /// Link availability (µs): host→device, device→host, network (reads; and writes under
    /// `L3Link::Shared`), network writes under `L3Link::Duplex`.
    h2d_free: u64,
    d2h_free: u64,
    net_free: u64,
    net_write_free: u64,
    prefetches: HashMap<OpId, LivePrefetch>,
    /// Time the instance spent in forward passes (µs).
    busy_us: u64,
}

/// How many requests are pulled from the workload ahead of the clock.
pub const ARRIVAL_WINDOW: usize = 64;

/// The store's clock advances this many of its milliseconds per simulated millisecond.
///
/// Why: the store's clock is wall time since it started plus what the simulator advances it
/// by, and a read lease (`lease_ttl`, 10 simulated seconds) expires on it: on a clock
/// advanced 1:1, the run's wall time moved lease expiries by as much as the run took (a lease
/// still held at simulated time t on one run had expired on another, and eviction chose
/// other victims). Scaled, wall time moves a deadline by less than one simulated millisecond
/// while a run's wall time between a lease and its check stays under 2^32 ms (49 days);
/// simulated time is then counted to 2^32 ms (49 days).
const STORE_MS_PER_SIM_MS: u64 = 1 << 32;

/// The end of the simulated clock's range (µs). Event times are sums of rates' durations and
/// arrivals, added saturating: a sum past the range is this value, and an event due at it
/// ends the run with [`clock_ended_error`]. Why an error: wrapped, such a time was *earlier*
/// than the work before it (`--pcie-gbps 1e-300` reported shorter TTFTs than 25 GB/s).
const CLOCK_END: u64 = u64::MAX;

fn clock_ended_error() -> String {
    "the simulated clock ran past its range (2^64 µs, about 584,000 years): a rate too slow \
     for the workload (a link's GB/s, the profile's prefill tokens/s) or a trace's timestamps \
     that far apart; nothing past it could be measured"
        .into()
}

/// The tenant the simulated instances store their pages under.
const TENANT: &str = "sim";

/// Bytes one simulated page takes on the SSD tier: its bucket file (one object each, see
/// [`Simulation::new`]) holds a file header, a record header, the tenant, the key and the
/// payload. `l3_ssd_pages` is a number of pages, as `l3_pages` is: the tier's capacity is that
/// many of these (before, `pages × payload_bytes`, and a 16-byte payload's 83-byte key and
/// headers left room for a ninth of the pages).
fn ssd_object_bytes(sched: &SchedulerConfig, payload_bytes: usize) -> u64 {
    use kvtier_l3::ssd::bucket::{FILE_HDR, REC_HDR};
    FILE_HDR + (REC_HDR + TENANT.len() + page_key_len(sched) + payload_bytes) as u64
}

/// What one simulated page is charged in the store's DRAM segment: its payload, its key and
/// the store's metadata per object (`kvtier_l3::charge`). `l3_pages` is a number of pages:
/// the segment holds that many of these.
fn l3_page_charge(sched: &SchedulerConfig, payload_bytes: usize) -> u64 {
    kvtier_l3::charge(payload_bytes as u64, page_key_len(sched))
}

/// Length of a simulated page's L3 key (every page's is the same: namespace, digest, rank).
fn page_key_len(sched: &SchedulerConfig) -> usize {
    sched
        .namespace
        .keys_for(sched.page_size, 0)
        .key(&PageHash([0; 32]))
        .len()
}

/// Waits until the SSD writer has written every queued offload and evicted what that
/// overflowed ([`Simulation::settle_store`]).
/// (The embedded store's flush cannot fail: it only waits for its writer.)
fn flush_offloads(s: &EmbeddedStore) {
    s.flush().ok();
}

pub fn fingerprint(h: &PageHash) -> u64 {
    h.prefix_u64()
}

/// The fingerprint encoded in an L3 key `"{ns}:{hex digest}:{rank}"`.
pub fn key_fingerprint(key: &str) -> Option<u64> {
    kvtier_radix::parse_l3_key(key).map(|k| fingerprint(&k.page))
}

/// Runs a workload through the simulator and returns the report.
pub struct Simulation {
    cfg: SimConfig,
    insts: Vec<Instance>,
    store: Option<Arc<EmbeddedStore>>,
    /// SSD-only L3 objects a probe had promoted to DRAM: key → simulated time (µs) the
    /// promotion is done. Modelled on the simulated clock (the store's own promoter runs on
    /// wall time and would make runs irreproducible); the entry is used by the next prefetch
    /// of the key.
    promoting: HashMap<String, u64>,
    /// Where the simulator reads the store's loss journal from next.
    loss_cursor: Option<kvtier_l3::LossCursor>,
    /// Keys backed up, kept when the router reads the store's stream: the end-of-run check
    /// of its view ([`Simulation::check_storage_view`]).
    l3_written: HashSet<String>,
    tenant: Tenant,
    heap: BinaryHeap<Reverse<(u64, u64, usize)>>,
    pending: Vec<Option<Pending>>,
    free_slots: Vec<usize>,
    seq: u64,
    now_us: u64,
    /// An event was due at the end of the clock's range ([`CLOCK_END`]): times are added
    /// saturating, so a time past the range lands exactly there, and the run is an error
    /// rather than a report of wrapped (shorter) times.
    clock_ended: bool,
    store_now_ms: u64,
    /// The last request pulled: its id and arrival (ms). Requests must come in arrival order.
    last_arrival: Option<(u64, u64)>,
    pub col: Collector,
    backups_done: u64,
    /// Page accesses in the order the engine saw them, for the Belady ceiling: prompt pages
    /// looked up at a request's first prefill (counted), every page computed (written).
    pub accesses: AccessLog,
    /// The SSD tier's temporary directory, removed when the simulation ends.
    temp_dir: Option<std::path::PathBuf>,
    /// Which instance serves each request (`--router`), fed the instances' events.
    router: ClusterRouter,
}

impl Drop for Simulation {
    fn drop(&mut self) {
        if let Some(s) = &self.store {
            s.shutdown();
        }
        if let Some(d) = &self.temp_dir {
            kvtier_l3::error::best_effort("remove the temp dir", std::fs::remove_dir_all(d));
        }
    }
}

impl Simulation {
    pub fn new(cfg: SimConfig) -> Result<Simulation, String> {
        let mut insts = Vec::new();
        let mut sched_cfg = cfg.effective_scheduler();
        let router = ClusterRouter::new(&cfg)?;
        // Write-back makes L3 the only copy of pages host drops: watch every drop. KV-aware
        // routers read the same events.
        sched_cfg.record_kv_events |= router.wants_events()
            || (sched_cfg.l3_enabled && sched_cfg.write_policy == WritePolicy::WriteBack);
        for _ in 0..cfg.instances.max(1) {
            let sched = Scheduler::new(sched_cfg.clone()).map_err(|e| e.to_string())?;
            insts.push(Instance {
                sched,
                model: kvtier_scheduler::model::PageModel::new(
                    cfg.scheduler.device_pages,
                    cfg.scheduler.host_pages,
                ),
                tracks: HashMap::new(),
                forward_busy: false,
                h2d_free: 0,
                d2h_free: 0,
                net_free: 0,
                net_write_free: 0,
                prefetches: HashMap::new(),
                busy_us: 0,
            });
        }
        let mut temp_dir = None;
        let store = if cfg.scheduler.l3_enabled {
            let ssd = if cfg.l3_ssd_pages > 0 {
                let dir = match &cfg.l3_ssd_dir {
                    Some(d) => d.clone(),
                    None => {
                        static N: std::sync::atomic::AtomicU64 =
                            std::sync::atomic::AtomicU64::new(0);
                        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        // Memory-backed where there is one: every simulated object is its own
                        // bucket file (below), each written with an fsync that a disk makes
                        // 15x slower.
                        let shm = std::path::Path::new("/dev/shm");
                        let base = if shm.is_dir() {
                            shm.to_path_buf()
                        } else {
                            std::env::temp_dir()
                        };
                        let d = base.join(format!("kvtier-sim-ssd-{}-{n}", std::process::id()));
                        temp_dir = Some(d.clone());
                        d
                    }
                };
                let mut s = SsdConfig::new(dir);
                s.mode = OffloadMode::OnEvict;
                s.capacity_bytes =
                    cfg.l3_ssd_pages * ssd_object_bytes(&sched_cfg, cfg.payload_bytes);
                s.bucket_bytes_limit = 1 << 20;
                // One object per bucket: the writer takes whatever the queue holds when it
                // wakes, so with larger buckets where a backup's evictions were cut into
                // buckets (what an SSD eviction drops together) depended on thread timing.
                s.bucket_keys_limit = 1;
                s.queue_len = 1 << 16;
                Some(s)
            } else {
                None
            };
            let s = EmbeddedStore::new(StoreConfig {
                local_segment_bytes: cfg.l3_pages.max(1)
                    * l3_page_charge(&sched_cfg, cfg.payload_bytes),
                lease_ttl: Duration::from_millis(10_000 * STORE_MS_PER_SIM_MS),
                max_batch_keys: 1 << 20,
                loss_journal_keys: 1 << 20,
                ssd,
                // kvtier's router learns the store's residency from the store's own stream,
                // as a deployment's router does (taken each plan: the simulated clock).
                kv_events: router
                    .wants_store_events()
                    .then(kvtier_l3::KvEventsConfig::pull)
                    .into_iter()
                    .collect(),
                ..StoreConfig::default()
            })
            .map_err(|e| e.to_string())?;
            Some(Arc::new(s))
        } else {
            None
        };
        let tenant = Tenant::new(TENANT).map_err(|e| e.to_string())?;
        let loss_cursor = match &store {
            Some(s) => Some(
                s.losses_since(&tenant, None)
                    .map_err(|e| e.to_string())?
                    .next,
            ),
            None => None,
        };
        let ps = cfg.scheduler.page_size;
        Ok(Simulation {
            col: Collector::new(ps, cfg.profile.kv_bytes_per_token * ps as u64),
            cfg,
            insts,
            store,
            promoting: HashMap::new(),
            tenant,
            heap: BinaryHeap::new(),
            pending: Vec::new(),
            free_slots: Vec::new(),
            seq: 0,
            now_us: 0,
            clock_ended: false,
            store_now_ms: 0,
            last_arrival: None,
            backups_done: 0,
            loss_cursor,
            l3_written: HashSet::new(),
            accesses: AccessLog::default(),
            temp_dir,
            router,
        })
    }

    fn push(&mut self, at_us: u64, p: Pending) {
        self.clock_ended |= at_us == CLOCK_END;
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.pending[s] = Some(p);
                s
            }
            None => {
                self.pending.push(Some(p));
                self.pending.len() - 1
            }
        };
        self.seq += 1;
        self.heap.push(Reverse((at_us, self.seq, slot)));
    }

    /// Replays `reqs` (sorted by arrival: a request arriving before the one before it is an
    /// error) to the end. `progress` is called after each request
    /// ends with the number ended so far.
    ///
    /// Requests are pulled from `reqs` a window of [`ARRIVAL_WINDOW`] ahead of the clock and
    /// dropped when they end, so a trace is streamed: memory holds the live requests, not the
    /// workload. An error from `reqs` ends the run with that error.
    pub fn run(
        mut self,
        reqs: impl IntoIterator<Item = Result<SimRequest, WorkloadError>>,
        mut progress: impl FnMut(u64),
    ) -> Result<Report, String> {
        let mut reqs = reqs.into_iter();
        for _ in 0..ARRIVAL_WINDOW {
            if !self.pull(&mut reqs)? {
                break;
            }
        }
        let wall = std::time::Instant::now();
        loop {
            if self.clock_ended {
                return Err(clock_ended_error());
            }
            let Some(Reverse((t, _, slot))) = self.heap.pop() else {
                break;
            };
            let Some(p) = self.pending[slot].take() else {
                continue;
            };
            self.free_slots.push(slot);
            self.now_us = self.now_us.max(t);
            self.sync_store_clock();
            let inst = match p {
                Pending::Arrival(r) => {
                    // Keep the heap small: schedule arrivals a window ahead.
                    self.pull(&mut reqs)?;
                    self.arrive(*r)?
                }
                Pending::Op { inst, op } => {
                    self.complete_op(inst, op)?;
                    inst
                }
                Pending::Prefetch { inst, op, at } => {
                    if self.insts[inst].prefetches.get(&op).map(|p| p.at) != Some(at) {
                        continue; // superseded by a termination
                    }
                    self.complete_prefetch(inst, op)?;
                    inst
                }
                Pending::Forward { inst, batch } => {
                    self.complete_forward(inst, batch)?;
                    self.insts[inst].forward_busy = false;
                    inst
                }
                Pending::Wake(inst) => inst,
            };
            // Completions drop host pages too (a finish writes back and makes room): check
            // them now, against the store as the scheduler saw it.
            self.check_host_drops(inst);
            self.plan(inst)?;
            progress(self.col.ended);
        }
        // Quiescence: every request ended, every op answered, every lock given back, and the
        // pools balance (nothing held outside the tree).
        for (i, inst) in self.insts.iter().enumerate() {
            if !inst.sched.is_idle() {
                return Err(format!(
                    "simulation stalled: instance {i} not idle: {:?}",
                    inst.sched.stats()
                ));
            }
            inst.sched
                .check()
                .map_err(|e| format!("instance {i}: {e}"))?;
            let st = inst.sched.stats();
            if st.device.held + st.host.held + st.device.locked + st.host.locked != 0
                || inst.sched.cache().outstanding_locks() != (0, 0)
            {
                return Err(format!("instance {i} not quiescent at the end: {st:?}"));
            }
        }
        self.check_storage_view();
        let stats: Vec<Stats> = self.insts.iter().map(|i| i.sched.stats()).collect();
        let accesses = std::mem::take(&mut self.accesses);
        let col = std::mem::take(&mut self.col);
        let mut report = col.finish(&stats, self.now_us, wall.elapsed());
        report.accesses = accesses;
        report.adaptive = self
            .insts
            .iter()
            .filter_map(|i| i.sched.cache().adaptive_snapshot())
            .collect();
        report.shadow = self
            .insts
            .iter()
            .filter_map(|i| i.sched.cache().shadow_snapshot())
            .collect();
        if let Some(s) = &self.store {
            report.l3_objects = s.stats().map(|x| x.objects).unwrap_or(0);
        }
        report.routing = crate::report::RoutingReport {
            router: self.cfg.routing.name().to_string(),
            routed: self.router.routed.clone(),
            busy_s: self.insts.iter().map(|i| i.busy_us as f64 / 1e6).collect(),
            index: self.router.index_stats(),
        };
        Ok(report)
    }

    /// At the end of a run: the pages the router believes the shared store holds (learnt
    /// from the store's stream) are exactly the pages the store holds of those written.
    fn check_storage_view(&mut self) {
        let (Some(store), Some(view)) = (&self.store, self.router.storage_view()) else {
            return;
        };
        let mut held = HashSet::new();
        for k in &self.l3_written {
            let Some(page) = kvtier_radix::parse_l3_key(k).map(|p| p.page) else {
                continue;
            };
            match store.is_exist(&self.tenant, k) {
                Ok(true) => {
                    held.insert(kvtier_events::HashFormat::int64(&page));
                }
                Ok(false) => {}
                Err(e) => self.col.oracle_failure(format!("store: {k}: {e}")),
            }
        }
        let view: HashSet<u64> = view.into_iter().collect();
        let (phantom, missed) = (
            view.difference(&held).count(),
            held.difference(&view).count(),
        );
        if phantom + missed > 0 {
            self.col.oracle_failure(format!(
                "router's view of the store: {phantom} pages it does not hold, {missed} it holds missing"
            ));
        }
    }

    /// Schedules the next request of the workload; false when it is exhausted.
    fn pull(
        &mut self,
        reqs: &mut impl Iterator<Item = Result<SimRequest, WorkloadError>>,
    ) -> Result<bool, String> {
        match reqs.next() {
            None => Ok(false),
            Some(Err(e)) => Err(e.to_string()),
            Some(Ok(r)) => {
                // An arrival earlier than the clock would be clamped to it: the workload
                // replayed would not be the one given.
                if let Some((id, at)) = self.last_arrival
                    && r.arrival_ms < at
                {
                    return Err(format!(
                        "request {} arrives at {} ms, before request {id} at {at} ms: requests must be sorted by arrival",
                        r.id, r.arrival_ms
                    ));
                }
                self.last_arrival = Some((r.id, r.arrival_ms));
                self.push(
                    r.arrival_ms.saturating_mul(1000),
                    Pending::Arrival(Box::new(r)),
                );
                Ok(true)
            }
        }
    }

    fn sync_store_clock(&mut self) {
        let ms = self.now_us / 1000;
        if let Some(s) = &self.store
            && ms > self.store_now_ms
        {
            s.clock().advance(Duration::from_millis(
                (ms - self.store_now_ms).saturating_mul(STORE_MS_PER_SIM_MS),
            ));
            self.store_now_ms = ms;
        }
    }

    fn arrive(&mut self, r: SimRequest) -> Result<usize, String> {
        let inst = self.router.route(&r, self.now_us);
        let id = RequestId(r.id);
        let i = &mut self.insts[inst];
        let prompt_len = r.prompt.len();
        let spec = RequestSpec::new(id, r.prompt, r.output_len);
        self.col
            .longest(prompt_len as u64 + u64::from(r.output_len));
        match i.sched.submit_at(spec, self.now_us / 1000) {
            Ok(()) => {
                i.tracks.insert(
                    id,
                    Track {
                        fps: Vec::new(),
                        hashes: Vec::new(),
                        verified: 0,
                        arrival_us: self.now_us,
                        first_token_us: None,
                        final_len: prompt_len + r.output_len as usize,
                        prompt_len,
                        logged: false,
                    },
                );
                self.col.submitted(prompt_len as u64);
            }
            Err(e) => {
                self.col.rejected(&e, prompt_len as u64);
                self.router.ended(id.0, self.now_us);
            }
        }
        Ok(inst)
    }
}
