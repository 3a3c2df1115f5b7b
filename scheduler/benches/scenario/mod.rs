//! The issue-3 benchmark scenario, shared by the criterion bench (`benches/scheduler.rs`) and
//! the `sched-bench` binary (`src/bin/sched-bench.rs`).
//!
//! Scenario: `n` requests with distinct 4,096-token prompts, page size 64, token budget 8,192,
//! host pages = 2 × device pages, device sized so every prompt and its decode pages fit (no
//! memory pressure), every cache op acknowledged at once with its success completion, one
//! token per decode row. Requests are admitted in arrival order with mixed prefill + decode,
//! so when the last one starts decoding they are at different lengths and about `n / 64` of
//! them cross a page boundary (allocate a device page, send a page-table delta) every step:
//! the steady state of a decode batch.
//!
//! Nothing here is timed; the callers time the scheduler calls they measure.
//!
//! `KVTIER_BENCH_EVICTION=freq-depth` runs the scenario under the frequency/depth-aware
//! eviction policy instead of LRU (to measure what a policy costs per plan), and
//! `KVTIER_BENCH_ADMISSION=adaptive:256` (any `HostAdmission` spelling) under another host
//! admission than copies at finish.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvtier_scheduler::*;

pub const PAGE: usize = 64;
pub const PROMPT_TOKENS: usize = 4096;
pub const PROMPT_PAGES: usize = PROMPT_TOKENS / PAGE;
pub const TOKEN_BUDGET: usize = 8192;
/// Generation limit of the decode scenarios (never reached: the setup is rebuilt first).
pub const DECODE_MAX_NEW: u32 = 2048;

/// The eviction policy the scenario runs under (`KVTIER_BENCH_EVICTION`: `freq-depth`, `adaptive`; LRU by default).
pub fn eviction() -> kvtier_radix::EvictionPolicy {
    match std::env::var("KVTIER_BENCH_EVICTION").as_deref() {
        Ok("freq-depth") => kvtier_radix::EvictionPolicy::CONVERSATION,
        Ok("adaptive") => kvtier_radix::EvictionPolicy::Adaptive,
        _ => kvtier_radix::EvictionPolicy::Lru,
    }
}

/// The host admission the scenario runs under (`KVTIER_BENCH_ADMISSION`, a `HostAdmission`
/// spelling; copies at finish by default or when it does not parse).
pub fn host_admission() -> HostAdmission {
    std::env::var("KVTIER_BENCH_ADMISSION")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_default()
}

/// The scenario's configuration for `n` requests generating up to `max_new` tokens each.
pub fn config(n: usize, max_new: u32) -> SchedulerConfig {
    let per_req = PROMPT_PAGES + (max_new as usize).div_ceil(PAGE) + 2;
    let device = (n * per_req + n * per_req / 16 + 64) as u32;
    SchedulerConfig {
        page_size: PAGE,
        device_pages: device,
        host_pages: 2 * device,
        max_batch_size: n.max(1024),
        token_budget: TOKEN_BUDGET,
        chunked_prefill_size: 8192,
        mixed_prefill_decode: true,
        host_enabled: true,
        l3_enabled: false,
        max_context_tokens: PROMPT_TOKENS + max_new as usize,
        eviction: eviction(),
        host_admission: host_admission(),
        ..SchedulerConfig::default()
    }
}

/// Request `i`'s prompt: 4,096 tokens, distinct from every other request's from the first page.
pub fn prompt(i: u64) -> Vec<u32> {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..PROMPT_TOKENS)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as u32 % 128_000
        })
        .collect()
}

/// The success completion of a planned op ("every op acknowledged at once").
pub fn ack(op: &PlannedOp) -> Event {
    match &op.spec {
        OpSpec::L3Query { .. } => Event::L3QueryDone {
            op: op.id,
            hit_pages: 0,
        },
        OpSpec::Prefetch { keys, .. } => Event::PrefetchDone {
            op: op.id,
            completed: keys.len() as u32,
        },
        OpSpec::LoadBack { .. } => Event::LoadBackDone {
            op: op.id,
            success: true,
        },
        OpSpec::WriteBack { .. } => Event::WriteBackDone {
            op: op.id,
            success: true,
        },
        OpSpec::BackUp { .. } => Event::BackUpDone {
            op: op.id,
            success: true,
        },
    }
}

/// The forward's results: one token per row, in the batch's row order (decode rows, then
/// prefill chunks). `stop` sets the engine's stop flag on every decode row.
pub fn outputs(f: &ForwardBatch, stop: bool) -> Vec<TokenOutput> {
    let mut out = Vec::with_capacity(f.rows());
    for d in &f.decode {
        out.push(TokenOutput {
            req: d.req,
            token: 7 + d.position % 1000,
            stop,
        });
    }
    for c in &f.prefill {
        out.push(TokenOutput {
            req: c.req,
            token: 11,
            stop: false,
        });
    }
    out
}

/// A scheduler plus the minimal engine that drives it.
pub struct Driver {
    pub s: Scheduler,
    pub n: usize,
    pub now: u64,
    /// Decode steps that can still run before the first request reaches `max_new`.
    pub steps_left: usize,
    /// Plans made so far.
    pub plans: usize,
}

impl Driver {
    pub fn new(cfg: SchedulerConfig, n: usize) -> Driver {
        Driver {
            s: Scheduler::new(cfg).expect("config"),
            n,
            now: 0,
            steps_left: 0,
            plans: 0,
        }
    }

    /// Submits requests `ids` with the scenario's prompts (`prompt(id)`).
    pub fn submit(&mut self, ids: std::ops::Range<u64>, max_new: u32) {
        for id in ids {
            self.s
                .submit(RequestSpec::new(
                    RequestId(id),
                    prompt(id % 1_000_000),
                    max_new,
                ))
                .expect("submit");
        }
    }

    pub fn plan(&mut self) -> ExecutionPlan {
        self.now += 1;
        self.plans += 1;
        self.s.next_execution_plan(self.now)
    }

    /// Acknowledges every op of `plan` at once, with its success completion.
    pub fn ack_ops(&mut self, plan: &ExecutionPlan) {
        for op in &plan.ops {
            self.s.on_event(ack(op)).expect("op completion");
        }
    }

    /// Reports the forward of `plan` (if any).
    pub fn forward_done(&mut self, plan: &ExecutionPlan, stop: bool) {
        if let Some(step) = plan.forward.step {
            let outputs = outputs(&plan.forward, stop);
            self.s
                .on_event(Event::ForwardDone { step, outputs })
                .expect("forward completion");
        }
    }

    /// One engine step: plan, ops acknowledged, forward reported. Returns the plan.
    pub fn step(&mut self) -> ExecutionPlan {
        let plan = self.plan();
        self.ack_ops(&plan);
        self.forward_done(&plan, false);
        plan
    }

    /// Steps until every live request is decoding (no prefill left in the batch).
    pub fn run_until_all_decoding(&mut self) {
        let mut steps = 0usize;
        loop {
            let plan = self.step();
            steps += 1;
            if plan.forward.prefill.is_empty() && plan.forward.decode.len() == self.n {
                break;
            }
            assert!(steps < 100_000, "setup does not converge");
        }
        // The first request has generated at most `steps` tokens.
        self.steps_left = (DECODE_MAX_NEW as usize).saturating_sub(steps + 2);
    }

    /// Steps until the scheduler is idle (all requests ended, all ops answered).
    pub fn run_to_idle(&mut self) {
        let mut steps = 0usize;
        while !self.s.is_idle() {
            self.step();
            steps += 1;
            assert!(steps < 100_000, "run_to_idle does not converge");
        }
        // Collect what the last completions ended.
        let plan = self.plan();
        assert!(plan.ops.is_empty() && plan.forward.step.is_none());
    }
}

/// `n` requests all decoding (the setup of the decode scenarios; one decode plan already ran
/// and was reported, so the next plan is a pure decode step).
pub fn decoding(n: usize) -> Driver {
    let mut d = Driver::new(config(n, DECODE_MAX_NEW), n);
    d.submit(0..n as u64, DECODE_MAX_NEW);
    d.run_until_all_decoding();
    d
}

/// One decode step of a [`decoding`] driver: returns (plan time, ForwardDone time).
pub fn timed_decode_step(d: &mut Driver) -> (Duration, Duration) {
    d.now += 1;
    d.plans += 1;
    let t0 = Instant::now();
    let plan = d.s.next_execution_plan(d.now);
    let t_plan = t0.elapsed();
    assert_eq!(plan.forward.decode.len(), d.n, "not a full decode step");
    assert!(plan.forward.prefill.is_empty() && plan.ops.is_empty());
    let step = plan.forward.step.expect("forward");
    let outputs = outputs(&plan.forward, false);
    drop(plan);
    let t1 = Instant::now();
    d.s.on_event(Event::ForwardDone { step, outputs })
        .expect("forward completion");
    let t_ingest = t1.elapsed();
    d.steps_left -= 1;
    (t_plan, t_ingest)
}

/// `n` requests decoding with a decode plan in flight, ready for the ForwardDone that makes
/// them all finish: returns the driver and that event (every row carries the stop flag).
pub fn about_to_finish(n: usize) -> (Driver, Event) {
    let mut d = decoding(n);
    let plan = d.plan();
    assert_eq!(plan.forward.decode.len(), n);
    let step = plan.forward.step.expect("forward");
    let outputs = outputs(&plan.forward, true);
    (d, Event::ForwardDone { step, outputs })
}

/// Finishing all `n`: the ForwardDone that ends them (write-back planning included), then
/// the plan that emits the `n` write-backs. Returns the time of both calls together.
pub fn timed_finish(d: &mut Driver, ev: Event) -> Duration {
    d.now += 1;
    let t0 = Instant::now();
    d.s.on_event(ev).expect("forward completion");
    let plan = d.s.next_execution_plan(d.now);
    let t = t0.elapsed();
    let wb = plan
        .ops
        .iter()
        .filter(|o| o.kind == OpKind::WriteBack)
        .count();
    assert_eq!(wb, d.n, "one write-back per finished request");
    assert!(plan.forward.step.is_none());
    t
}

/// Configuration of the load-back scenario: the scenario's, with device copies dropped after
/// write-back (so the prompts are host-only) and a token budget that fits the 256 one-page
/// prefill chunks the resubmitted prompts need (a 4,096-token prompt keeps its last page to
/// compute: 256 × 64 = 16,384 tokens; with 8,192 only 128 would be admitted per plan).
pub fn loadback_config(n: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        keep_device_after_write_back: false,
        token_budget: budget,
        ..config(n, 1)
    }
}

/// `n` prompts ran to completion (one token each), were written back to host and dropped from
/// device; then the same prompts are resubmitted under new ids. The next plan admits them with
/// load-backs.
pub fn host_only(n: usize, budget: usize) -> Driver {
    let mut d = Driver::new(loadback_config(n, budget), n);
    d.submit(0..n as u64, 1);
    d.run_to_idle();
    let st = d.s.stats();
    assert_eq!(st.device.cached, 0, "device copies dropped");
    assert_eq!(st.host.cached, n * PROMPT_PAGES, "prompts on host");
    for id in 0..n as u64 {
        d.s.submit(RequestSpec::new(RequestId(1_000_000 + id), prompt(id), 1))
            .expect("resubmit");
    }
    d
}

/// The first plan after resubmitting: returns its time and its number of load-backs.
pub fn timed_loadback_plan(d: &mut Driver) -> (Duration, usize) {
    d.now += 1;
    let t0 = Instant::now();
    let plan = d.s.next_execution_plan(d.now);
    let t = t0.elapsed();
    let lb = plan
        .ops
        .iter()
        .filter(|o| o.kind == OpKind::LoadBack)
        .count();
    assert_eq!(
        lb,
        plan.forward.prefill.len(),
        "one load-back per admitted request"
    );
    (t, lb)
}
