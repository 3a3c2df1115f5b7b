//! A test engine that executes execution plans against simulated memory and checks, for every
//! forward, that every page it reads holds the KV its position requires.
//!
//! Content model (the integrity oracle): a page's content is the hash of the page it holds KV
//! for (`PageHash`), or `None` when it holds nothing complete. Copies (load-back, write-back,
//! prefetch, backup) move contents; a forward writes the hash of each page it completes. L3 is a
//! map from key to content; a backup asserts that the content it stores matches its key.
//!
//! Ops may complete at once or be held back and completed later in a random order; a copy reads
//! its source when it *completes*, so a source page reused before its copy finished is caught.

#![allow(dead_code)]

use std::collections::HashMap;

use kvtier_radix::page_hashes;
use kvtier_scheduler::model::PageModel;
use kvtier_scheduler::*;

pub struct Engine {
    pub page_size: usize,
    /// Page contents (a full page holds its chained hash) and page tables: the shared model.
    pub model: PageModel<Option<PageHash>>,
    pub l3: HashMap<String, PageHash>,
    /// The engine's copy of each request's page table and tokens.
    pub tokens: HashMap<RequestId, Vec<u32>>,
    /// Scopes of scoped requests: their pages' contents are the scoped chain.
    pub scopes: HashMap<RequestId, HashScope>,
    pub held: Vec<PlannedOp>,
    pub forward: Option<ForwardBatch>,
    pub ended: Vec<(RequestId, Outcome)>,
    pub pages_checked: u64,
    /// Fail ops of these kinds (every n-th, by op id), to test failure paths.
    pub fail_every: Option<(OpKind, u64)>,
    /// L3 is down (its server killed): probes find nothing, prefetches read nothing, backups
    /// fail, until this is cleared.
    pub l3_down: bool,
    /// Keys each successful backup stored, with how many times (a duplicate put shows as 2).
    pub puts: HashMap<String, u32>,
    /// Stop a request after this many generated tokens (engine-side stop condition).
    pub stop_after: HashMap<RequestId, usize>,
    /// Ops this engine reported as failed: a chunk waiting for one reads garbage, so it is
    /// not checked, and the pages it writes are garbage (content `None`).
    pub failed: std::collections::HashSet<OpId>,
    /// Leave prefetches in flight until the scheduler terminates them (BestEffort/Timeout).
    pub hold_prefetches: bool,
    /// How this engine answers `terminate_prefetch` (see [`Termination`]).
    pub termination: Termination,
    /// Prefetches the last plan asked to stop.
    terminating: Vec<OpId>,
    /// Copies still in flight after their op was reported: `(pages, index, content)`; they
    /// land at the end of the next step.
    late_writes: Vec<(TierPages, usize, Option<PageHash>)>,
}

/// How an engine stops a prefetch the scheduler terminates: half its pages have arrived and
/// the copy into the next page is in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Termination {
    /// The contract: report `PrefetchDone` only once every write into the destination pages
    /// has landed (the in-flight copy finishes first).
    Landed,
    /// A broken engine: reports at once; the in-flight copy lands a step later, into a page
    /// the scheduler has freed and may have handed to someone else.
    ReportEarly,
}

fn key_hash(key: &str) -> Option<PageHash> {
    kvtier_radix::parse_l3_key(key).map(|k| k.page)
}

impl Engine {
    pub fn new(cfg: &SchedulerConfig) -> Engine {
        Engine {
            page_size: cfg.page_size,
            model: PageModel::new(cfg.device_pages, cfg.host_pages),
            l3: HashMap::new(),
            tokens: HashMap::new(),
            scopes: HashMap::new(),
            held: Vec::new(),
            forward: None,
            ended: Vec::new(),
            pages_checked: 0,
            fail_every: None,
            l3_down: false,
            puts: HashMap::new(),
            stop_after: HashMap::new(),
            failed: Default::default(),
            hold_prefetches: false,
            termination: Termination::Landed,
            terminating: Vec::new(),
            late_writes: Vec::new(),
        }
    }

    pub fn submit(&mut self, s: &mut Scheduler, id: u64, prompt: Vec<u32>, max_new: u32) {
        self.submit_spec(s, RequestSpec::new(RequestId(id), prompt, max_new));
    }

    /// Submits any request (scoped ones too); the oracle hashes its pages in its scope.
    pub fn submit_spec(&mut self, s: &mut Scheduler, spec: RequestSpec) {
        self.tokens.insert(spec.id, spec.prompt.clone());
        let scope = HashScope::new(
            spec.cache_salt.as_deref(),
            spec.adapter.as_deref(),
            spec.extra_keys.clone(),
        );
        if !scope.is_plain() {
            self.scopes.insert(spec.id, scope);
        }
        s.submit(spec).expect("submit");
    }

    /// The chained hashes of the full pages of `req`'s first `upto` tokens, in its scope.
    fn hashes(&self, req: RequestId, upto: usize) -> Vec<PageHash> {
        let toks = &self.tokens[&req];
        let toks = &toks[..upto.min(toks.len())];
        match self.scopes.get(&req) {
            Some(sc) => sc.page_hashes(toks, self.page_size),
            None => page_hashes(toks, self.page_size, None),
        }
    }

    /// Takes a plan; ops are held (to be completed by `complete_*`), the forward is kept.
    pub fn take_plan(&mut self, plan: ExecutionPlan) {
        for (id, o) in &plan.ended {
            self.model.forget(*id);
            self.ended.push((*id, *o));
        }
        for id in &plan.retracted {
            self.model.forget(*id);
        }
        self.held.extend(plan.ops);
        // Terminated prefetches are answered by `stop_prefetches` (it needs the scheduler).
        self.terminating.extend(plan.terminate_prefetch);
        assert!(self.forward.is_none() || plan.forward.step.is_none());
        if plan.forward.step.is_some() {
            self.forward = Some(plan.forward);
        }
    }

    fn fails(&self, op: &PlannedOp) -> bool {
        matches!(self.fail_every, Some((k, n)) if k == op.kind && op.id.0.is_multiple_of(n))
            || (self.l3_down && op.kind == OpKind::BackUp)
    }

    /// Executes one held op (by index) and reports its completion.
    pub fn complete_op(&mut self, s: &mut Scheduler, idx: usize) {
        let op = self.held.remove(idx);
        let ev = self.execute_op(&op);
        s.on_event(ev).expect("op completion accepted");
    }

    /// Executes an op against this engine's memory and L3, returning its completion (for an
    /// engine that reduces completions across ranks before reporting them).
    pub fn execute_op(&mut self, op: &PlannedOp) -> Event {
        let fail = self.fails(op);
        if fail {
            self.failed.insert(op.id);
        }
        match &op.spec {
            OpSpec::L3Query { keys } => Event::L3QueryDone {
                op: op.id,
                hit_pages: keys
                    .iter()
                    .take_while(|k| !self.l3_down && self.l3.contains_key(*k))
                    .count() as u32,
            },
            OpSpec::Prefetch { keys, dst } => {
                let mut n = 0;
                for (i, k) in keys.iter().enumerate() {
                    if (fail && i >= keys.len() / 2) || self.l3_down {
                        break;
                    }
                    let Some(c) = self.l3.get(k).copied() else {
                        break;
                    };
                    self.model.set(dst, i, Some(c));
                    n += 1;
                }
                Event::PrefetchDone {
                    op: op.id,
                    completed: n,
                }
            }
            OpSpec::LoadBack { .. } => {
                if !fail {
                    self.model.copy(&op.spec);
                }
                Event::LoadBackDone {
                    op: op.id,
                    success: !fail,
                }
            }
            OpSpec::WriteBack { .. } => {
                if !fail {
                    self.model.copy(&op.spec);
                }
                Event::WriteBackDone {
                    op: op.id,
                    success: !fail,
                }
            }
            OpSpec::BackUp { keys, src } => {
                if !fail {
                    for (i, k) in keys.iter().enumerate() {
                        let c = self.model.get(src, i);
                        assert_eq!(c, key_hash(k), "backup stores other content under {k}");
                        if let Some(c) = c {
                            self.l3.insert(k.clone(), c);
                            *self.puts.entry(k.clone()).or_default() += 1;
                        }
                    }
                }
                Event::BackUpDone {
                    op: op.id,
                    success: !fail,
                }
            }
        }
    }

    /// Whether the held forward may complete (every op its chunks wait for has completed).
    pub fn forward_ready(&self) -> bool {
        let Some(f) = &self.forward else { return false };
        f.prefill
            .iter()
            .flat_map(|c| c.waits_for.iter())
            .all(|w| !self.held.iter().any(|o| o.id == *w))
    }

    fn apply_delta(&mut self, req: RequestId, d: &Option<PageTableDelta>) {
        self.model.apply_delta(req, d);
    }

    /// Checks that pages `0 .. upto_tokens / ps` of `req` hold the right KV.
    fn check_pages(&mut self, req: RequestId, upto_tokens: usize) {
        let want: Vec<Option<PageHash>> = self
            .hashes(req, upto_tokens)
            .into_iter()
            .map(Some)
            .collect();
        match self.model.check(req, 0, &want) {
            Ok(n) => {
                assert_eq!(n, want.len(), "{req:?}: page table shorter than its KV");
                self.pages_checked += n as u64;
            }
            Err(w) => panic!(
                "{req:?} reads wrong KV at page {} (device page {})",
                w.page, w.device_page
            ),
        }
    }

    fn write_pages(&mut self, req: RequestId, from_tok: usize, to_tok: usize) {
        let hs: Vec<Option<PageHash>> = self.hashes(req, to_tok).into_iter().map(Some).collect();
        self.model.write(req, from_tok / self.page_size, &hs);
    }

    pub fn token_for(req: RequestId, pos: usize) -> u32 {
        ((req.0 as u32).wrapping_mul(7919) ^ (pos as u32).wrapping_mul(104_729)) % 1000 + 5000
    }

    /// Runs the held forward, checking every page it reads, and reports the results.
    pub fn complete_forward(&mut self, s: &mut Scheduler) {
        let f = self.forward.take().expect("forward");
        let mut outputs = Vec::new();
        for c in &f.prefill {
            self.apply_delta(c.req, &c.table);
            let start = c.start as usize;
            let len = c.len as usize;
            assert_eq!(
                &self.tokens[&c.req][start..start + len],
                &c.tokens[..],
                "chunk tokens"
            );
            let garbage = c.waits_for.iter().any(|w| self.failed.contains(w));
            if garbage {
                // Garbage in, garbage out: the scheduler must discard this chunk.
                let ps = self.page_size;
                let table = self.model.table(c.req).to_vec();
                for p in &table[start / ps..(start + len).div_ceil(ps).min(table.len())] {
                    self.model.device[p.index() as usize] = None;
                }
            } else {
                self.check_pages(c.req, start);
                self.write_pages(c.req, start, start + len);
            }
            let mut token = 0;
            let mut stop = false;
            if c.last && !garbage {
                let pos = start + len;
                token = Self::token_for(c.req, pos);
                let t = self.tokens.get_mut(&c.req).unwrap();
                t.push(token);
                stop = self.stop_after.get(&c.req).is_some_and(|n| t.len() >= *n);
            }
            outputs.push(TokenOutput {
                req: c.req,
                token,
                stop,
            });
        }
        for d in &f.decode {
            self.apply_delta(d.req, &d.table);
            let p = d.position as usize;
            assert_eq!(p + 1, self.tokens[&d.req].len(), "decode position");
            self.check_pages(d.req, p);
            self.write_pages(d.req, p, p + 1);
            let token = Self::token_for(d.req, p + 1);
            let t = self.tokens.get_mut(&d.req).unwrap();
            t.push(token);
            let stop = self.stop_after.get(&d.req).is_some_and(|n| t.len() >= *n);
            outputs.push(TokenOutput {
                req: d.req,
                token,
                stop,
            });
        }
        s.on_event(Event::ForwardDone {
            step: f.step.expect("step"),
            outputs,
        })
        .expect("forward completion accepted");
    }

    /// Steps with every op acknowledged at once, showing each plan to `see` first, until the
    /// scheduler is idle (or `max_steps`).
    pub fn run_watching(
        &mut self,
        s: &mut Scheduler,
        max_steps: u64,
        mut see: impl FnMut(&ExecutionPlan),
    ) {
        for t in 0..max_steps {
            let plan = s.next_execution_plan(t);
            see(&plan);
            self.take_plan(plan);
            while !self.held.is_empty() {
                self.complete_op(s, 0);
            }
            if self.forward.is_some() {
                self.complete_forward(s);
            }
            if s.is_idle() {
                return;
            }
        }
        panic!("not idle after {max_steps} steps");
    }

    /// One engine step with every op acknowledged at once (prefetches stay in flight with
    /// `hold_prefetches` until terminated): plan, ops, forward.
    pub fn step(&mut self, s: &mut Scheduler, now: u64) -> bool {
        let plan = s.next_execution_plan(now);
        let busy = !plan.ops.is_empty() || plan.forward.step.is_some();
        self.take_plan(plan);
        let late = std::mem::take(&mut self.late_writes);
        self.stop_prefetches(s);
        let mut i = 0;
        while i < self.held.len() {
            if self.hold_prefetches && self.held[i].kind == OpKind::Prefetch {
                i += 1;
            } else {
                self.complete_op(s, i);
            }
        }
        if self.forward.is_some() {
            self.complete_forward(s);
        }
        // Copies an early-reporting engine left in flight land now, after the scheduler
        // freed their pages and this step's ops may have reused them.
        for (pages, i, content) in late {
            self.model.set(&pages, i, content);
        }
        busy
    }

    /// Answers the prefetches the last plan terminated: the first half of the keys arrived,
    /// the copy into the next page is in flight (see [`Termination`]).
    fn stop_prefetches(&mut self, s: &mut Scheduler) {
        for op in std::mem::take(&mut self.terminating) {
            let Some(i) = self.held.iter().position(|o| o.id == op) else {
                continue; // already completed
            };
            let op = self.held.remove(i);
            let OpSpec::Prefetch { keys, dst } = &op.spec else {
                continue;
            };
            let mut done = 0;
            for (i, k) in keys.iter().enumerate() {
                let Some(c) = self.l3.get(k).copied() else {
                    break;
                };
                if i < keys.len() / 2 {
                    self.model.set(dst, i, Some(c));
                    done += 1;
                    continue;
                }
                match self.termination {
                    // The in-flight copy lands, then the engine reports.
                    Termination::Landed => self.model.set(dst, i, Some(c)),
                    Termination::ReportEarly => self.late_writes.push((dst.clone(), i, Some(c))),
                }
                break;
            }
            s.on_event(Event::PrefetchDone {
                op: op.id,
                completed: done,
            })
            .expect("prefetch completion accepted");
        }
    }

    /// Steps until every request but `except` has ended, holding back `except`'s ops.
    pub fn run_to_idle_except(&mut self, s: &mut Scheduler, max_steps: usize, except: RequestId) {
        for i in 0..max_steps {
            if s.live_requests() <= 1
                && self.forward.is_none()
                && self.held.iter().all(|o| o.req == Some(except))
            {
                return;
            }
            let plan = s.next_execution_plan(i as u64);
            self.take_plan(plan);
            let mut j = 0;
            while j < self.held.len() {
                if self.held[j].req == Some(except) {
                    j += 1;
                } else {
                    self.complete_op(s, j);
                }
            }
            if self.forward.is_some() {
                self.complete_forward(s);
            }
        }
        panic!("still busy after {max_steps} steps");
    }

    /// Steps until the scheduler is idle (or `max_steps`), returning the steps taken.
    pub fn run_to_idle(&mut self, s: &mut Scheduler, max_steps: usize) -> usize {
        for i in 0..max_steps {
            if s.is_idle() {
                // Collect what the last completions ended.
                let plan = s.next_execution_plan(i as u64);
                assert!(plan.ops.is_empty() && plan.forward.step.is_none());
                self.take_plan(plan);
                return i;
            }
            self.step(s, i as u64);
        }
        panic!("not idle after {max_steps} steps: {:?}", s.stats());
    }
}

pub fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        page_size: 4,
        device_pages: 64,
        host_pages: 128,
        max_batch_size: 8,
        token_budget: 64,
        chunked_prefill_size: 32,
        max_context_tokens: 256,
        ..SchedulerConfig::default()
    }
}

/// `cfg()` with L3 below host: probes from `prefetch_threshold` pages, prefetches waited for.
pub fn l3_on(prefetch_threshold: u32) -> SchedulerConfig {
    SchedulerConfig {
        l3_enabled: true,
        prefetch_threshold,
        prefetch_stop: PrefetchStopPolicy::WaitComplete,
        ..cfg()
    }
}

/// `cfg()` with the host admission learnt by the adaptive eviction policy
/// (`HostAdmission::Adaptive`), demoting with `ahead_pages` once it demotes.
pub fn learning(ahead_pages: u32) -> SchedulerConfig {
    SchedulerConfig {
        eviction: kvtier_radix::EvictionPolicy::Adaptive,
        host_admission: HostAdmission::Adaptive { ahead_pages },
        ..cfg()
    }
}

/// The write policy a property test's choice `i` (0..3) picks: write-through, selective
/// (second hit), or write-back where `write_back_ok` (it needs the host tier), else
/// write-through.
pub fn write_policy_of(i: u8, write_back_ok: bool) -> WritePolicy {
    match i {
        0 => WritePolicy::WriteThrough,
        1 => WritePolicy::WriteThroughSelective { hit_threshold: 2 },
        _ if write_back_ok => WritePolicy::WriteBack,
        _ => WritePolicy::WriteThrough,
    }
}

/// The retraction policy a property test's choice `i` (0..3) picks.
pub fn retraction_of(i: u8) -> RetractionPolicy {
    [
        RetractionPolicy::LatestArrival,
        RetractionPolicy::FewestGenerated,
        RetractionPolicy::MostPages,
    ][usize::from(i % 3)]
}

pub fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 1000 + i).collect()
}

/// At quiescence nothing is held: no locks, no held pages, no live requests.
pub fn assert_quiescent(s: &Scheduler) {
    assert!(s.is_idle(), "not idle: {:?}", s.stats());
    s.check().expect("scheduler consistent");
    let st = s.stats();
    assert_eq!(st.device.held, 0, "device pages still held");
    assert_eq!(st.host.held, 0, "host pages still held");
    assert_eq!(st.device.locked, 0, "device pages still locked");
    assert_eq!(st.host.locked, 0, "host pages still locked");
    assert_eq!(s.cache().outstanding_locks(), (0, 0));
}
