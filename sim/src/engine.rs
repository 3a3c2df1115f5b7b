//! The simulated engine: a discrete-event loop that drives the real `Scheduler`s and the real
//! embedded L3 store, with copies and forwards completing at their modelled finish times.
//!
//! Integrity oracle: device and host pages hold an 8-byte fingerprint of the page hash whose
//! KV they contain; L3 objects hold the fingerprint as their (small) payload. Copies move
//! fingerprints when they *complete* (a source reused before its copy finished is caught); a
//! forward checks that every page it reads holds the fingerprint of the page its position
//! requires, and every backup checks that it stores under a key the content of that key's page.
//! Any mismatch is counted in `oracle_failures` (tests require zero).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use kvtier_l3::{
    EmbeddedStore, ErrorCode, L3Store, OffloadMode, PutOptions, SsdConfig, StoreConfig, Tenant,
};
use kvtier_radix::{PageHash, TierKind};
use kvtier_scheduler::*;

use crate::belady::AccessLog;
use crate::config::SimConfig;
use crate::report::{Collector, Report};
use crate::workload::{SimRequest, WorkloadError, generated_token, route};

mod oracle;

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
    /// Link availability (µs): host→device, device→host, network.
    h2d_free: u64,
    d2h_free: u64,
    net_free: u64,
    prefetches: HashMap<OpId, LivePrefetch>,
}

/// How many requests are pulled from the workload ahead of the clock.
pub const ARRIVAL_WINDOW: usize = 64;

/// Waits until the SSD writer has written every queued offload (see the prefetch cost).
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
    tenant: Tenant,
    heap: BinaryHeap<Reverse<(u64, u64, usize)>>,
    pending: Vec<Option<Pending>>,
    free_slots: Vec<usize>,
    seq: u64,
    now_us: u64,
    store_now_ms: u64,
    pub col: Collector,
    backups_done: u64,
    /// Page accesses in the order the engine saw them, for the Belady ceiling: prompt pages
    /// looked up at a request's first prefill (counted), every page computed (written).
    pub accesses: AccessLog,
    /// The SSD tier's temporary directory, removed when the simulation ends.
    temp_dir: Option<std::path::PathBuf>,
}

impl Drop for Simulation {
    fn drop(&mut self) {
        if let Some(s) = &self.store {
            s.shutdown();
        }
        if let Some(d) = &self.temp_dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

impl Simulation {
    pub fn new(cfg: SimConfig) -> Result<Simulation, String> {
        let mut insts = Vec::new();
        let mut sched_cfg = cfg.effective_scheduler();
        // Write-back makes L3 the only copy of pages host drops: watch every drop.
        sched_cfg.record_kv_events |=
            sched_cfg.l3_enabled && sched_cfg.write_policy == WritePolicy::WriteBack;
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
                prefetches: HashMap::new(),
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
                        let d = std::env::temp_dir()
                            .join(format!("kvtier-sim-ssd-{}-{n}", std::process::id()));
                        temp_dir = Some(d.clone());
                        d
                    }
                };
                let mut s = SsdConfig::new(dir);
                s.mode = OffloadMode::OnEvict;
                s.capacity_bytes = cfg.l3_ssd_pages * cfg.payload_bytes as u64;
                s.bucket_bytes_limit = 1 << 20;
                s.bucket_keys_limit = 4096;
                s.queue_len = 1 << 16;
                Some(s)
            } else {
                None
            };
            let s = EmbeddedStore::new(StoreConfig {
                local_segment_bytes: cfg.l3_pages.max(1) * cfg.payload_bytes as u64,
                lease_ttl: Duration::from_secs(10),
                max_batch_keys: 1 << 20,
                ssd,
                ..StoreConfig::default()
            })
            .map_err(|e| e.to_string())?;
            Some(Arc::new(s))
        } else {
            None
        };
        let tenant = Tenant::new("sim").map_err(|e| e.to_string())?;
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
            store_now_ms: 0,
            backups_done: 0,
            accesses: AccessLog::default(),
            temp_dir,
        })
    }

    fn push(&mut self, at_us: u64, p: Pending) {
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

    /// Replays `reqs` (sorted by arrival) to the end. `progress` is called after each request
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
        while let Some(Reverse((t, _, slot))) = self.heap.pop() {
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
        let stats: Vec<Stats> = self.insts.iter().map(|i| i.sched.stats()).collect();
        let accesses = std::mem::take(&mut self.accesses);
        let col = std::mem::take(&mut self.col);
        let mut report = col.finish(&stats, self.now_us, wall.elapsed());
        report.accesses = accesses;
        if let Some(s) = &self.store {
            report.l3_objects = s.stats().map(|x| x.objects).unwrap_or(0);
        }
        Ok(report)
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
            s.clock()
                .advance(Duration::from_millis(ms - self.store_now_ms));
            self.store_now_ms = ms;
        }
    }

    fn arrive(&mut self, r: SimRequest) -> Result<usize, String> {
        let inst = route(&r, self.insts.len(), self.cfg.routing);
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
            Err(e) => self.col.rejected(&e),
        }
        Ok(inst)
    }

    fn plan(&mut self, inst: usize) -> Result<(), String> {
        if self.insts[inst].forward_busy {
            return Ok(());
        }
        let now = self.now_us;
        let plan = self.insts[inst].sched.next_execution_plan(now / 1000);
        self.check_host_drops(inst);
        let links = self.cfg.links.clone();
        let page_bytes = self.col.page_bytes;
        {
            let i = &mut self.insts[inst];
            for (id, outcome) in &plan.ended {
                i.model.forget(*id);
                if let Some(tr) = i.tracks.remove(id) {
                    self.col
                        .ended(*outcome, tr.first_token_us.map(|f| f - tr.arrival_us));
                }
            }
            for id in &plan.retracted {
                i.model.forget(*id);
                if let Some(tr) = i.tracks.get_mut(id) {
                    tr.verified = 0;
                }
            }
        }
        let mut before_forward_end = now;
        for op in plan.ops {
            let n = match &op.spec {
                OpSpec::L3Query { keys } => keys.len(),
                OpSpec::Prefetch { keys, .. } | OpSpec::BackUp { keys, .. } => keys.len(),
                OpSpec::LoadBack { src, .. } => src.len(),
                OpSpec::WriteBack { src, .. } => src.len(),
            } as u64;
            let bytes = n * page_bytes;
            let i = &mut self.insts[inst];
            let (link, dur) = match op.kind {
                OpKind::LoadBack => (&mut i.h2d_free, links.pcie_us(bytes)),
                OpKind::WriteBack => (&mut i.d2h_free, links.pcie_us(bytes)),
                OpKind::Prefetch => {
                    // SSD-only objects are read from the store's SSD before they travel —
                    // unless the probe already had them promoted to DRAM (then only what is
                    // left of that promotion is waited for).
                    let (ssd_only, promo_ready) = match (&self.store, &op.spec) {
                        (Some(s), OpSpec::Prefetch { keys, .. }) if self.cfg.l3_ssd_pages > 0 => {
                            // Offloads run on the store's writer thread (wall time): let them
                            // land so residency, and the run, do not depend on thread timing.
                            flush_offloads(s);
                            let mut n = 0u64;
                            let mut ready = 0u64;
                            for k in keys {
                                if let Some(r) = self.promoting.remove(k) {
                                    ready = ready.max(r);
                                } else if s.residency(&self.tenant, k) == (false, true) {
                                    n += 1;
                                }
                            }
                            (n, ready)
                        }
                        _ => (0, 0),
                    };
                    self.col.ssd_read(ssd_only * page_bytes);
                    // The transfer starts when the network link is free; a promotion that
                    // finished by then costs nothing.
                    let ssd = links
                        .ssd_us(ssd_only * page_bytes)
                        .max(promo_ready.saturating_sub(now.max(i.net_free)));
                    self.col.prefetch_ssd_wait(ssd);
                    (&mut i.net_free, links.l3_us(bytes) + ssd)
                }
                OpKind::BackUp => (&mut i.net_free, links.l3_us(bytes)),
                OpKind::L3Query => {
                    // The probe asks the store to promote SSD-only hits to DRAM
                    // (`prefetch_to_memory`): their SSD reads start now, one after another,
                    // off the prefetch's critical path.
                    if let (Some(s), OpSpec::L3Query { keys }) = (&self.store, &op.spec)
                        && self.cfg.l3_ssd_pages > 0
                        && self.cfg.l3_promote_on_probe
                    {
                        flush_offloads(s);
                        let mut t = now + links.l3_query_us as u64;
                        for k in keys {
                            match s.residency(&self.tenant, k) {
                                (false, true) if !self.promoting.contains_key(k) => {
                                    t += links.ssd_us(page_bytes);
                                    self.col.ssd_read(page_bytes);
                                    self.promoting.insert(k.clone(), t);
                                }
                                (false, false) => break, // the probe's hits end here
                                _ => {}
                            }
                        }
                        if self.promoting.len() > 1 << 16 {
                            self.promoting.retain(|_, r| *r > now);
                        }
                    }
                    (&mut 0u64, links.l3_query_us as u64)
                }
            };
            let start = now.max(*link);
            let end = start + dur;
            if op.kind != OpKind::L3Query {
                *link = end;
            }
            self.col.traffic(op.kind, bytes);
            if op.before_forward {
                before_forward_end = before_forward_end.max(end);
            }
            if let OpSpec::Prefetch { keys, dst } = op.spec {
                i.prefetches.insert(
                    op.id,
                    LivePrefetch {
                        start,
                        dur,
                        keys,
                        dst,
                        at: end,
                        truncated: None,
                    },
                );
                self.push(
                    end,
                    Pending::Prefetch {
                        inst,
                        op: op.id,
                        at: end,
                    },
                );
            } else {
                self.push(end, Pending::Op { inst, op });
            }
        }
        for op in plan.terminate_prefetch {
            if let Some(p) = self.insts[inst].prefetches.get_mut(&op) {
                let n = p.keys.len();
                let done = if now <= p.start {
                    0
                } else {
                    ((now - p.start) as u128 * n as u128 / p.dur.max(1) as u128) as usize
                };
                p.truncated = Some(done.min(n));
                p.at = now;
                self.push(now, Pending::Prefetch { inst, op, at: now });
            }
        }
        if plan.forward.step.is_some() {
            let f = &plan.forward;
            let prefill: u64 = f.prefill.iter().map(|c| c.len as u64).sum();
            let ctx: u64 = f.decode.iter().map(|d| d.position as u64).sum();
            let dur = self
                .cfg
                .profile
                .forward_us(prefill, f.decode.len() as u64, ctx);
            let end = before_forward_end + dur;
            self.insts[inst].forward_busy = true;
            self.col.forward(prefill, f.decode.len() as u64, dur);
            self.push(
                end,
                Pending::Forward {
                    inst,
                    batch: plan.forward,
                },
            );
        } else if !self.insts[inst].prefetches.is_empty() {
            // Prefetch stop policies run on the clock: look again shortly.
            self.push(now + 2000, Pending::Wake(inst));
        }
        Ok(())
    }

    /// Under write-back, host is the last local tier a page leaves: every page the scheduler
    /// dropped from host must still be in L3 or on this instance's device, or it is lost from
    /// every tier (an oracle failure). Runs only where KV events are recorded (write-back
    /// with L3: `Simulation::new` turns them on).
    fn check_host_drops(&mut self, inst: usize) {
        if !self.insts[inst].sched.config().record_kv_events {
            return;
        }
        let Some(store) = self.store.clone() else {
            return;
        };
        let mut dropped = Vec::new();
        for ev in self.insts[inst].sched.drain_kv_events() {
            if let KvEvent::Removed {
                tier: TierKind::Host,
                hashes,
                ..
            } = ev
            {
                dropped.extend(hashes);
            }
        }
        if dropped.is_empty() {
            return;
        }
        let i = &self.insts[inst];
        let on_device: std::collections::HashSet<u64> = i.model.device.iter().copied().collect();
        let keys = i.sched.l3_keys(&dropped);
        let exist = store.batch_is_exist(&self.tenant, &keys);
        for (j, h) in dropped.iter().enumerate() {
            let in_l3 = matches!(exist.as_ref().map(|v| v.get(j)), Ok(Some(Ok(true))));
            if !in_l3 && !on_device.contains(&fingerprint(h)) {
                self.col.oracle_failure(format!(
                    "page {} dropped from host while in no other tier",
                    keys[j]
                ));
            }
        }
    }

    fn complete_prefetch(&mut self, inst: usize, op: OpId) -> Result<(), String> {
        let Some(p) = self.insts[inst].prefetches.remove(&op) else {
            return Ok(());
        };
        let mut n = p.truncated.unwrap_or(p.keys.len());
        let every = self.cfg.faults.fail_prefetch_every;
        if every > 0 && op.0.is_multiple_of(every) {
            n /= 2;
        }
        let done = self.fetch(inst, &p.keys[..n], &p.dst);
        self.insts[inst]
            .sched
            .on_event(Event::PrefetchDone {
                op,
                completed: done as u32,
            })
            .map_err(|e| format!("engine event rejected: {e}"))
    }

    /// Reads `keys` from L3 into `dst`; returns how many leading pages arrived intact.
    fn fetch(&mut self, inst: usize, keys: &[String], dst: &TierPages) -> usize {
        let Some(store) = &self.store else { return 0 };
        let pb = self.cfg.payload_bytes;
        let mut buf = vec![0u8; keys.len() * pb];
        let results = {
            let mut bufs: Vec<&mut [u8]> = buf.chunks_mut(pb).collect();
            match store.batch_get_into(&self.tenant, keys, &mut bufs) {
                Ok(r) => r,
                Err(_) => return 0,
            }
        };
        let mut done = 0;
        for (i, r) in results.iter().enumerate() {
            if r.is_err() {
                break;
            }
            let mut b = [0u8; 8];
            b.copy_from_slice(&buf[i * pb..i * pb + 8]);
            let fp = u64::from_le_bytes(b);
            if Some(fp) != key_fingerprint(&keys[i]) {
                self.col
                    .oracle_failure(format!("L3 returned other content for {}", keys[i]));
                break;
            }
            self.insts[inst].model.set(dst, i, fp);
            done += 1;
        }
        self.col.l3_read(done as u64);
        done
    }

    /// Stores the source pages under `keys`; checks each page holds its key's content.
    fn backup(&mut self, inst: usize, op: OpId, keys: &[String], src: &TierPages) -> bool {
        let Some(store) = self.store.clone() else {
            return false;
        };
        let every = self.cfg.faults.fail_backup_every;
        if every > 0 && op.0.is_multiple_of(every) {
            return false;
        }
        let pb = self.cfg.payload_bytes;
        let ins = &self.insts[inst];
        let mut payload = vec![0u8; keys.len() * pb];
        for (i, k) in keys.iter().enumerate() {
            let fp = ins.model.get(src, i);
            if Some(fp) != key_fingerprint(k) {
                self.col
                    .oracle_failure(format!("backup would store other content under {k}"));
                return false;
            }
            payload[i * pb..i * pb + 8].copy_from_slice(&fp.to_le_bytes());
        }
        let bufs: Vec<&[u8]> = payload.chunks(pb).collect();
        let ok = match store.batch_put_from(&self.tenant, keys, &bufs, PutOptions::default()) {
            Ok(rs) => rs.iter().all(|r| match r {
                Ok(()) => true,
                Err(e) => e.code() == ErrorCode::ObjectAlreadyExists,
            }),
            Err(_) => false,
        };
        if ok {
            self.col.l3_written(keys.len() as u64);
        }
        self.backups_done += 1;
        let lose = self.cfg.faults.lose_l3_every;
        if lose > 0
            && self.backups_done.is_multiple_of(lose)
            && let Some(k) = keys.first()
        {
            // An L3 object disappears (evicted elsewhere, node lost); the store's report reaches
            // every instance, as an engine subscribed to its evictions would pass it on.
            if store.remove(&self.tenant, k, true).is_ok() {
                for i in &mut self.insts {
                    i.sched.l3_lost(std::slice::from_ref(k));
                }
            }
        }
        ok
    }

    fn complete_op(&mut self, inst: usize, op: PlannedOp) -> Result<(), String> {
        let ev = match op.spec {
            OpSpec::LoadBack { .. } => {
                self.insts[inst].model.copy(&op.spec);
                Event::LoadBackDone {
                    op: op.id,
                    success: true,
                }
            }
            OpSpec::WriteBack { .. } => {
                self.insts[inst].model.copy(&op.spec);
                Event::WriteBackDone {
                    op: op.id,
                    success: true,
                }
            }
            OpSpec::L3Query { keys } => {
                let hits = match &self.store {
                    Some(s) => match s.batch_is_exist(&self.tenant, &keys) {
                        Ok(v) => v.iter().take_while(|r| matches!(r, Ok(true))).count(),
                        Err(_) => 0,
                    },
                    None => 0,
                };
                Event::L3QueryDone {
                    op: op.id,
                    hit_pages: hits as u32,
                }
            }
            OpSpec::Prefetch { .. } => return Ok(()),
            OpSpec::BackUp { keys, src } => {
                let success = self.backup(inst, op.id, &keys, &src);
                Event::BackUpDone { op: op.id, success }
            }
        };
        self.insts[inst]
            .sched
            .on_event(ev)
            .map_err(|e| format!("engine event rejected: {e}"))
    }

    fn apply_delta(&mut self, inst: usize, id: RequestId, d: &Option<PageTableDelta>) {
        let i = &mut self.insts[inst];
        i.model.apply_delta(id, d);
        if let Some(d) = d
            && let Some(tr) = i.tracks.get_mut(&id)
        {
            tr.verified = tr.verified.min(d.from as usize);
        }
    }

    fn complete_forward(&mut self, inst: usize, batch: ForwardBatch) -> Result<(), String> {
        let ps = self.cfg.scheduler.page_size;
        let now = self.now_us;
        let mut outputs = Vec::with_capacity(batch.rows());
        for c in &batch.prefill {
            self.log_prompt(inst, c.req);
            self.apply_delta(inst, c.req, &c.table);
            let (start, end) = (c.start as usize, (c.start + c.len) as usize);
            self.verify(inst, c.req, start / ps);
            self.write(inst, c.req, start / ps, end / ps);
            let mut token = 0;
            if c.last {
                token = generated_token(c.req.0, end);
                if let Some(tr) = self.insts[inst].tracks.get_mut(&c.req)
                    && tr.first_token_us.is_none()
                {
                    tr.first_token_us = Some(now);
                }
            }
            outputs.push(TokenOutput {
                req: c.req,
                token,
                stop: false,
            });
        }
        for d in &batch.decode {
            self.apply_delta(inst, d.req, &d.table);
            let p = d.position as usize;
            if let Some(tr) = self.insts[inst].tracks.get_mut(&d.req)
                && p + 2 >= tr.final_len
            {
                // Last step: re-read the whole table, catching any page changed under it.
                tr.verified = 0;
            }
            self.verify(inst, d.req, p / ps);
            if (p + 1).is_multiple_of(ps) {
                self.write(inst, d.req, p / ps, p / ps + 1);
            }
            outputs.push(TokenOutput {
                req: d.req,
                token: generated_token(d.req.0, p + 1),
                stop: false,
            });
        }
        let step = batch.step.ok_or("forward without a step id")?;
        self.insts[inst]
            .sched
            .on_event(Event::ForwardDone { step, outputs })
            .map_err(|e| format!("engine forward rejected: {e}"))
    }
}
