//! The [`Scheduler`]: the engine calls it every step.
//!
//! Why one object with a pure-function plan: the engine's loop is `plan = next_execution_plan(now)
//! → run ops and forward → report events → repeat`. Every decision kvtier makes happens inside
//! `next_execution_plan` and `on_event`, from state that only those calls (and `submit`/`abort`)
//! change, with ties broken by stable ids — so two schedulers fed the same calls produce the
//! same plans, which is what lets every tensor-parallel rank run its own copy.
//!
//! This file holds the state, the public API and the plan's skeleton; admission, completions
//! and the request lifecycle live in `admission.rs`, `completion.rs` and `lifecycle.rs`.

use std::collections::{BTreeMap, BTreeSet};

use kvtier_fsm::{OpEvent, OpKind, RequestEvent, RequestState};
use kvtier_radix::{
    Device, Host, KvEvent, L3KeyBuilder, PageHash, RadixCache, RadixConfig, TierKind, page_hashes,
};

use crate::config::{ConfigError, PrefetchStopPolicy, SchedulerConfig};
use crate::error::SchedulerError;
use crate::idhash::{IdMap, IdSet};
use crate::ops::{OpCtx, OpRecord};
use crate::request::Request;
use crate::stats::Stats;
use crate::types::*;

/// One row of the forward in flight.
#[derive(Clone, Debug)]
pub(crate) enum RowKind {
    Prefill { waits_for: Option<OpId> },
    Decode,
}

pub(crate) struct InFlightStep {
    pub id: StepId,
    pub rows: Vec<(RequestId, RowKind)>,
}

/// Remaining room in the forward being built.
pub(crate) struct Budget {
    pub rows: usize,
    pub tokens: usize,
}

pub struct Scheduler {
    pub(crate) cfg: SchedulerConfig,
    pub(crate) cache: RadixCache,
    pub(crate) keys: L3KeyBuilder,
    pub(crate) reqs: IdMap<RequestId, Request>,
    /// Requests waiting for admission (Submitted, PrefetchDone, Retracted), by arrival seq.
    pub(crate) waiting: BTreeMap<u64, RequestId>,
    /// Requests prefilling or decoding, by arrival seq.
    pub(crate) running: BTreeMap<u64, RequestId>,
    pub(crate) ops: IdMap<OpId, OpRecord>,
    pub(crate) next_op: u64,
    /// Prefetches to terminate at `deadline` (ms): `(deadline, op)`.
    pub(crate) prefetch_deadlines: BTreeSet<(u64, OpId)>,
    pub(crate) step: Option<InFlightStep>,
    pub(crate) next_step: u64,
    pub(crate) next_seq: u64,
    /// Ops created since the last plan, to be issued by the next one.
    pub(crate) outbox: Vec<PlannedOp>,
    pub(crate) terminate: Vec<OpId>,
    pub(crate) ended: Vec<(RequestId, Outcome)>,
    pub(crate) retracted_out: Vec<RequestId>,
    /// Pages whose backup to L3 is in flight.
    pub(crate) backing_up: IdSet<PageHash>,
    pub(crate) stats: Stats,
    /// Device pages running prefills will still allocate (computed during admission).
    pub(crate) reserved_pages: usize,
    /// The `now` of the latest plan (ms).
    pub(crate) now_ms: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Result<Scheduler, ConfigError> {
        cfg.validate()?;
        let mut cache = RadixCache::new(RadixConfig {
            page_size: cfg.page_size,
            device_pages: cfg.device_pages,
            host_pages: if cfg.host_enabled { cfg.host_pages } else { 0 },
            record_events: cfg.record_kv_events,
        })
        .map_err(|_| ConfigError::Zero { field: "page_size" })?;
        cache.set_eviction_policy(cfg.eviction);
        let keys = cfg.namespace.keys_for_rank(cfg.rank);
        Ok(Scheduler {
            cfg,
            cache,
            keys,
            reqs: IdMap::default(),
            waiting: BTreeMap::new(),
            running: BTreeMap::new(),
            ops: IdMap::default(),
            next_op: 1,
            prefetch_deadlines: BTreeSet::new(),
            step: None,
            next_step: 1,
            next_seq: 0,
            outbox: Vec::new(),
            terminate: Vec::new(),
            ended: Vec::new(),
            retracted_out: Vec::new(),
            backing_up: IdSet::default(),
            stats: Stats::new(),
            reserved_pages: 0,
            now_ms: 0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Read access to the prefix cache (for inspection and tests).
    pub fn cache(&self) -> &RadixCache {
        &self.cache
    }

    /// Adds a request to the waiting queue. Its prompt's page hashes are computed once, here.
    pub fn submit(&mut self, spec: RequestSpec) -> Result<(), SchedulerError> {
        self.submit_at(spec, self.now_ms)
    }

    /// Like [`Self::submit`], with the arrival time (ms) for latency statistics.
    pub fn submit_at(&mut self, spec: RequestSpec, now_ms: u64) -> Result<(), SchedulerError> {
        if self.reqs.contains_key(&spec.id) {
            return Err(SchedulerError::DuplicateRequest(spec.id));
        }
        if spec.prompt.is_empty() {
            return Err(SchedulerError::EmptyPrompt);
        }
        if spec.max_new_tokens == 0 {
            return Err(SchedulerError::ZeroMaxNewTokens);
        }
        let total = spec.prompt.len() + spec.max_new_tokens as usize;
        if total > self.cfg.max_context_tokens {
            return Err(SchedulerError::TooLong {
                tokens: total,
                max: self.cfg.max_context_tokens,
            });
        }
        let hashes = page_hashes(&spec.prompt, self.cfg.page_size, None);
        let seq = self.next_seq;
        self.next_seq += 1;
        let prompt_len = spec.prompt.len();
        self.reqs.insert(
            spec.id,
            Request {
                id: spec.id,
                seq,
                tokens: spec.prompt,
                prompt_len,
                max_new: spec.max_new_tokens,
                hashes,
                state: RequestState::Submitted,
                pages: Vec::new(),
                tree_pages: 0,
                dev_lock: None,
                sent: 0,
                dirty_from: usize::MAX,
                l3_probe: None,
                l3_done: !self.cfg.l3_enabled,
                prefetched: None,
                resumed: false,
                ops: Default::default(),
                recompute: false,
                arrival_ms: now_ms,
                first_token_ms: None,
            },
        );
        self.waiting.insert(seq, spec.id);
        self.stats.submitted += 1;
        metrics::counter!("kvtier_requests_submitted_total").increment(1);
        Ok(())
    }

    /// Aborts a request. With an op or forward in flight the abort is deferred until its
    /// completion; otherwise the request ends now and its pages and locks are released.
    pub fn abort(&mut self, id: RequestId) -> Result<(), SchedulerError> {
        let r = self
            .reqs
            .get(&id)
            .ok_or(SchedulerError::UnknownRequest(id))?;
        let next = self.check_event(r, &RequestEvent::Abort)?;
        let r = self
            .reqs
            .get_mut(&id)
            .ok_or(SchedulerError::UnknownRequest(id))?;
        r.state = next;
        if r.state.is_terminal() {
            self.release(id);
        }
        Ok(())
    }

    /// Feeds one completion back. On `Err`, nothing changed.
    pub fn on_event(&mut self, ev: Event) -> Result<(), SchedulerError> {
        match ev {
            Event::ForwardDone { step, outputs } => self.on_forward_done(step, &outputs),
            other => self.on_op_done(other),
        }
    }

    /// Store/remove events of cached pages since the last call, for a KV-aware router.
    pub fn drain_kv_events(&mut self) -> Vec<KvEvent> {
        self.cache.drain_events()
    }

    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.waiting = self.waiting.len();
        s.running = self.running.len();
        s.prefetching = self
            .reqs
            .values()
            .filter(|r| matches!(r.state, RequestState::Prefetching { .. }))
            .count();
        s.device = self.cache.usage(TierKind::Device);
        s.host = self.cache.usage(TierKind::Host);
        s
    }

    /// Number of live requests.
    pub fn live_requests(&self) -> usize {
        self.reqs.len()
    }

    /// The state of a live request.
    pub fn request_state(&self, id: RequestId) -> Option<&RequestState> {
        self.reqs.get(&id).map(|r| &r.state)
    }

    /// Tokens (prompt + generated) of a live request.
    pub fn request_tokens(&self, id: RequestId) -> Option<&[u32]> {
        self.reqs.get(&id).map(|r| r.tokens.as_slice())
    }

    /// Nothing in flight and nothing live: every op answered, every request ended.
    pub fn is_idle(&self) -> bool {
        self.reqs.is_empty() && self.ops.is_empty() && self.step.is_none()
    }

    /// Ops issued and not yet completed.
    pub fn ops_in_flight(&self) -> usize {
        self.ops.len()
    }

    /// Full consistency check (tests): the cache's invariants, plus every live request's page
    /// table and lock agreeing with the tree, and the lock count matching what requests and ops
    /// hold.
    pub fn check(&self) -> Result<(), String> {
        self.cache.check_invariants()?;
        let mut dev_locks = 0;
        let mut host_locks = 0;
        for r in self.reqs.values() {
            if let Some(l) = &r.dev_lock {
                dev_locks += 1;
                let end = self.cache.node_end(l.node()).map_err(|e| e.to_string())?;
                if end != r.tree_pages {
                    return Err(format!(
                        "{:?}: lock ends at {end}, tree_pages {}",
                        r.id, r.tree_pages
                    ));
                }
                let tree = self
                    .cache
                    .path_pages::<Device>(l.node())
                    .map_err(|e| e.to_string())?;
                if tree[..] != r.pages[..r.tree_pages] {
                    return Err(format!("{:?}: page table disagrees with the tree", r.id));
                }
            } else if r.tree_pages != 0 {
                return Err(format!("{:?}: tree pages without a lock", r.id));
            }
            for p in &r.pages[r.tree_pages.min(r.pages.len())..] {
                if self.cache.page_state(*p) != Some(kvtier_radix::PageState::Held) {
                    return Err(format!("{:?}: own page {p:?} not held", r.id));
                }
            }
        }
        for o in self.ops.values() {
            match &o.ctx {
                OpCtx::LoadBack { .. } | OpCtx::WriteBack { .. } => host_locks += 1,
                OpCtx::Prefetch { dst, .. } => match dst {
                    crate::ops::PrefetchDst::Host(..) => host_locks += 1,
                    crate::ops::PrefetchDst::Device(..) => dev_locks += 1,
                },
                OpCtx::BackUp { lock, .. } => match lock {
                    crate::ops::AnyLock::Host(_) => host_locks += 1,
                    crate::ops::AnyLock::Device(_) => dev_locks += 1,
                },
                OpCtx::Query { .. } => {}
            }
        }
        let (d, h) = self.cache.outstanding_locks();
        if (d, h) != (dev_locks, host_locks) {
            return Err(format!(
                "cache has ({d}, {h}) locks, requests and ops account for ({dev_locks}, {host_locks})"
            ));
        }
        Ok(())
    }

    // ----- the plan ----------------------------------------------------------------------

    /// What the engine should do now. `now_ms` is the engine's clock, used for prefetch
    /// timeouts and latency statistics; the plan depends only on the calls made so far.
    pub fn next_execution_plan(&mut self, now_ms: u64) -> ExecutionPlan {
        let _span = tracing::debug_span!("kvtier_plan", now_ms).entered();
        self.now_ms = self.now_ms.max(now_ms);
        self.stats.plans += 1;
        let mut plan = ExecutionPlan::default();

        // Prefetch stop policies on the clock.
        while let Some(&(deadline, op)) = self.prefetch_deadlines.first() {
            if deadline > self.now_ms {
                break;
            }
            self.prefetch_deadlines.pop_first();
            self.terminate.push(op);
        }

        if self.step.is_none() {
            let mut budget = Budget {
                rows: self.cfg.max_batch_size,
                tokens: self.cfg.token_budget,
            };
            let mut batch = ForwardBatch::default();
            let mut rows = Vec::new();
            if self.cfg.mixed_prefill_decode {
                self.schedule_decode(&mut budget, &mut batch, &mut rows);
                self.schedule_chunks(&mut budget, &mut batch, &mut rows);
                self.admit(&mut budget, &mut batch, &mut rows);
            } else {
                // Prefill batches first (as SGLang does without mixing); decode when none.
                self.schedule_chunks(&mut budget, &mut batch, &mut rows);
                self.admit(&mut budget, &mut batch, &mut rows);
                if batch.prefill.is_empty() {
                    self.schedule_decode(&mut budget, &mut batch, &mut rows);
                }
            }
            if !batch.is_empty() {
                let id = StepId(self.next_step);
                self.next_step += 1;
                batch.step = Some(id);
                self.step = Some(InFlightStep { id, rows });
            }
            plan.forward = batch;
        }

        plan.ops.reserve(self.outbox.len());
        for mut op in self.outbox.drain(..) {
            if let Some(rec) = self.ops.get_mut(&op.id) {
                // Pending → Issued cannot fail for an op just created.
                let _ = rec.op.apply_mut(OpEvent::Issue);
                rec.issued_ms = self.now_ms;
                self.stats.record_issue(rec.kind());
            }
            op.before_forward = op.before_forward && plan.forward.step.is_some();
            plan.ops.push(op);
        }
        plan.terminate_prefetch = std::mem::take(&mut self.terminate);
        plan.ended = std::mem::take(&mut self.ended);
        plan.retracted = std::mem::take(&mut self.retracted_out);
        if self.stats.plans.is_multiple_of(64) {
            self.stats().publish_gauges();
        }
        plan
    }

    // ----- helpers shared by the flows ------------------------------------------------

    /// The state `event` would move the request to, or the typed error.
    pub(crate) fn check_event(
        &self,
        r: &Request,
        event: &RequestEvent,
    ) -> Result<RequestState, SchedulerError> {
        r.state
            .next_state(event)
            .map_err(|reason| SchedulerError::IllegalEvent {
                req: r.id,
                state: r.state.kind(),
                event: event.kind(),
                reason,
            })
    }

    /// Applies an event the flow has established is legal. An illegal one here is a scheduler
    /// bug: it is logged and the request is failed rather than the process brought down.
    pub(crate) fn apply(&mut self, id: RequestId, event: RequestEvent) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if let Err(e) = r.state.apply_mut(event) {
            tracing::error!(req = ?id, error = %e, "internal: illegal transition");
            debug_assert!(false, "internal: illegal transition {e}");
        }
    }

    /// Registers a new op (Pending) and queues it for the next plan.
    pub(crate) fn new_op(
        &mut self,
        kind: OpKind,
        req: Option<RequestId>,
        before_forward: bool,
        spec: OpSpec,
        ctx: OpCtx,
    ) -> OpId {
        let id = OpId(self.next_op);
        self.next_op += 1;
        self.ops.insert(
            id,
            OpRecord {
                op: kvtier_fsm::CacheOp::new(kind),
                req,
                issued_ms: self.now_ms,
                ctx,
            },
        );
        if let Some(r) = req.and_then(|r| self.reqs.get_mut(&r)) {
            r.ops.push(id);
        }
        self.outbox.push(PlannedOp {
            id,
            kind,
            req,
            before_forward,
            spec,
        });
        id
    }

    pub(crate) fn keys_for(&self, hashes: &[PageHash]) -> Vec<String> {
        self.keys.keys(hashes)
    }

    /// Host pages for `n`, evicting per the write policy (see `lifecycle.rs`).
    pub(crate) fn alloc_host(&mut self, n: usize) -> Option<Vec<kvtier_radix::HostPageId>> {
        if n == 0 {
            return Some(Vec::new());
        }
        if self.cfg.write_policy == crate::config::WritePolicy::WriteBack && self.cfg.l3_enabled {
            self.make_room_on_host(n);
            return self.cache.alloc::<Host>(n).ok();
        }
        self.cache.alloc_evicting::<Host>(n).ok()
    }

    /// The prefetch deadline for a request of `tokens` tokens issued now.
    pub(crate) fn prefetch_deadline(&self, tokens: usize) -> Option<u64> {
        match self.cfg.prefetch_stop {
            PrefetchStopPolicy::WaitComplete => None,
            PrefetchStopPolicy::BestEffort => Some(self.now_ms),
            PrefetchStopPolicy::Timeout {
                base_ms,
                per_1k_tokens_ms,
            } => Some(
                self.now_ms
                    .saturating_add(base_ms)
                    .saturating_add(per_1k_tokens_ms.saturating_mul(tokens as u64) / 1000),
            ),
        }
    }
}
