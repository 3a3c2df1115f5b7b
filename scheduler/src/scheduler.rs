//! The [`Scheduler`]: the engine calls it every step.
//!
//! Why one object with a pure-function plan: the engine's loop is `plan = next_execution_plan(now)
//! → run ops and forward → report events → repeat`. Every decision kvtier makes happens inside
//! `next_execution_plan` and `on_event`, from state that only those calls (and `submit`/`abort`)
//! change, with ties broken by stable ids — so two schedulers fed the same calls produce the
//! same plans, which is what lets every tensor-parallel rank run its own copy.
//!
//! This file holds the state, the public API and the plan's skeleton; submission (validation,
//! hashing, tenants) lives in `submit.rs`, the full consistency check in `check.rs`, and
//! admission, completions and the request lifecycle in `admission.rs`, `completion.rs` and
//! `lifecycle.rs`.

use std::collections::{BTreeMap, BTreeSet};

use kvtier_fsm::{OpEvent, OpKind, RequestEvent, RequestState};
use kvtier_radix::{
    Host, KvEvent, L3KeyBuilder, PageHash, RadixCache, RadixConfig, TenantId, TierKind,
};

use crate::config::{ConfigError, SchedulerConfig};
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
    /// The page hashes protected for each waiting request (`waiting.rs`).
    pub(crate) protected_for: IdMap<RequestId, Vec<kvtier_radix::PageHash>>,
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
    /// Pages being demoted device → host (`demotion.rs`).
    pub(crate) demoting_pages: usize,
    /// Set when a demotion's copy failed: no new demotions until a request finishes (so a
    /// failing host path costs one failed copy per finished request, as copies at finish do,
    /// not one per plan).
    pub(crate) demotions_paused: bool,
    /// Pages of in-flight backups that L3 reported lost before the backup's completion.
    pub(crate) lost_in_backup: IdSet<PageHash>,
    /// Failed backups waiting for L3 to answer again (`backup_retry.rs`).
    pub(crate) backup_retry: crate::backup_retry::RetryQueue,
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
        cache.set_events_cap_bytes(Some(
            usize::try_from(cfg.kv_events_max_bytes).unwrap_or(usize::MAX),
        ));
        cache.set_eviction_policy(cfg.eviction);
        if cfg.eviction == kvtier_radix::EvictionPolicy::Shadow {
            // A fixed host admission: the selector compares eviction orders under it only.
            let fixed = match cfg.host_admission {
                crate::config::HostAdmission::Adaptive { .. } => None,
                crate::config::HostAdmission::OnFinish => {
                    Some(kvtier_radix::LearntAdmission::CopyAtFinish)
                }
                crate::config::HostAdmission::OnDeviceEviction { .. } => {
                    Some(kvtier_radix::LearntAdmission::Demote)
                }
            };
            let shadow = kvtier_radix::ShadowConfig {
                sample_salt: cfg.shadow_sample_salt,
                full_size_pages: cfg.shadow_full_size_pages,
                ..kvtier_radix::ShadowConfig::default()
            };
            let shadow = match fixed {
                Some(a) => shadow.with_admission(a),
                None => shadow,
            };
            cache.set_shadow_config(shadow)?;
        }
        let key_rank = match cfg.l3_sharing {
            crate::config::L3Sharing::PerRank => cfg.rank,
            crate::config::L3Sharing::Replicated { leader } => leader,
        };
        let keys = cfg.namespace.keys_for(cfg.page_size, key_rank);
        Ok(Scheduler {
            cfg,
            cache,
            keys,
            reqs: IdMap::default(),
            waiting: BTreeMap::new(),
            protected_for: IdMap::default(),
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
            demoting_pages: 0,
            demotions_paused: false,
            lost_in_backup: IdSet::default(),
            backup_retry: Default::default(),
            stats: Stats::new(),
            reserved_pages: 0,
            now_ms: 0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// How failed backups are tried again ([`crate::BackupRetry`]; its default until set).
    /// Tensor-parallel ranks set the same, as they share a config.
    pub fn set_backup_retry(&mut self, conf: crate::BackupRetry) {
        self.backup_retry.set_conf(conf);
    }

    /// Read access to the prefix cache (for inspection and tests).
    pub fn cache(&self) -> &RadixCache {
        &self.cache
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

    /// L3 lost these objects (the store reported them evicted or removed, a node holding them
    /// died): the pages' tree nodes and their descendants are no longer taken to be in L3, so
    /// write-through backs them up again and the write-back policy backs a host copy up before
    /// dropping it. Keys of other namespaces or ranks are ignored. Returns the number of tree
    /// nodes whose L3 flag was cleared.
    ///
    /// Why the engine must report losses: the tree's "in L3" flag is set by a successful
    /// backup or prefetch and is otherwise a *hint*; L3 evicts on its own schedule. Without the
    /// report, a page dropped from host under write-back on the strength of a stale flag is
    /// gone from every tier.
    ///
    /// A scheduler that is one rank of several (`SchedulerConfig::tp_ranks` > 1) refuses it
    /// with [`SchedulerError::LossNeedsAgreement`] and changes nothing: applied on the rank
    /// that heard of the loss alone it would make the ranks diverge. Such a rank records the
    /// keys with `RankAgreement::lost`, and `RankAgreement::agree_losses` applies the union
    /// of every rank's losses on every rank.
    pub fn l3_lost<K: AsRef<str>>(&mut self, keys: &[K]) -> Result<usize, SchedulerError> {
        self.single_rank_loss()?;
        let lost: std::collections::HashSet<PageHash> = keys
            .iter()
            .filter_map(|k| self.keys.page_of(k.as_ref()))
            .collect();
        Ok(self.forget_l3_set(lost))
    }

    /// [`Self::l3_lost`] by page hash (namespace-free). Returns the number of tree nodes whose
    /// L3 flag was cleared; refused on one rank of several, as [`Self::l3_lost`].
    pub fn l3_lost_pages(&mut self, pages: &[PageHash]) -> Result<usize, SchedulerError> {
        self.single_rank_loss()?;
        Ok(self.forget_l3_set(pages.iter().copied().collect()))
    }

    /// Direct loss reports are for a scheduler that is the only rank.
    fn single_rank_loss(&self) -> Result<(), SchedulerError> {
        match self.cfg.tp_ranks {
            1 => Ok(()),
            tp_ranks => Err(SchedulerError::LossNeedsAgreement {
                rank: self.cfg.rank,
                tp_ranks,
            }),
        }
    }

    /// Clears the L3 marks of `pages` (what the agreement applies: every rank's union).
    pub(crate) fn forget_l3_agreed(&mut self, pages: &[PageHash]) -> usize {
        self.forget_l3_set(pages.iter().copied().collect())
    }

    fn forget_l3_set(&mut self, lost: std::collections::HashSet<PageHash>) -> usize {
        // A loss can overtake the completion of the backup that stored the page: remember it,
        // so that the `BackUpDone` does not mark the page as in L3 again.
        self.lost_in_backup.extend(
            lost.iter()
                .filter(|h| self.backing_up.contains(*h))
                .copied(),
        );
        self.note_prefetch_losses(Some(&lost));
        let n = self.cache.forget_l3(&lost);
        self.stats.l3_lost_nodes += n as u64;
        n
    }

    /// The store's loss report was incomplete (its journal overflowed): no L3 mark can be
    /// trusted, so every one is cleared, as by [`Self::l3_lost`] for every page. Returns the
    /// number of tree nodes whose L3 flag was cleared. Refused on one rank of several, as
    /// [`Self::l3_lost`]: such a rank calls `RankAgreement::lost_all`.
    pub fn l3_lost_all(&mut self) -> Result<usize, SchedulerError> {
        self.single_rank_loss()?;
        Ok(self.forget_l3_all_marks())
    }

    /// Clears every L3 mark (what the agreement applies when some rank overflowed).
    pub(crate) fn forget_l3_all_marks(&mut self) -> usize {
        self.lost_in_backup.extend(self.backing_up.iter().copied());
        self.note_prefetch_losses(None);
        let n = self.cache.forget_l3_all();
        self.stats.l3_lost_nodes += n as u64;
        n
    }

    /// Store/remove events of cached pages since the last call, for a KV-aware router; if
    /// those passed `kv_events_max_bytes`, `KvEvent::Cleared` and every copy held now.
    pub fn drain_kv_events(&mut self) -> Vec<KvEvent> {
        self.cache.drain_events()
    }

    /// Every copy the cache holds now, as `Stored` events (parents first): the state a
    /// subscriber that missed the history rebuilds from (see `kvtier-events`).
    pub fn resident_kv_events(&self) -> Vec<KvEvent> {
        self.cache.resident_events()
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
        (s.backups_retrying, s.backups_given_up, s.backups_retried) = self.backup_retry.counts();
        s.backups_probed = self.backup_retry.probes();
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

    /// Nothing in flight and nothing live: every op answered, every request ended, and no
    /// failed backup due to be tried again (L3 answered since it failed, or the next plan is
    /// the probe's: the next plan backs it up; while L3 has not, failed backups wait without
    /// keeping the scheduler busy, one plan in `BackupRetry::probe_every` excepted).
    pub fn is_idle(&self) -> bool {
        self.reqs.is_empty()
            && self.ops.is_empty()
            && self.step.is_none()
            && !self.backup_retry.due()
    }

    /// The size of every per-request and per-op book, by name: requests (live, waiting,
    /// running, protected pages of waiting ones), ops (in flight, prefetch deadlines, created
    /// and not yet planned, to terminate), what the next plan reports (ended, retracted),
    /// pages of backups and demotions in flight, the step in flight. All 0 once the
    /// scheduler is idle and a plan has been taken since,
    /// whatever ended each request (finished, aborted or failed in any state, retracted) or
    /// op (done, failed, terminated): a book left non-empty there grows with the requests a
    /// long-running engine serves. (Failed backups waiting for L3 to answer are bounded by
    /// `BackupRetry::max_waiting`, and the pages reserved for running prefills, recomputed by
    /// every admission before it is read, are not counted here.)
    pub fn books(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("requests", self.reqs.len()),
            ("waiting", self.waiting.len()),
            ("protected_for", self.protected_for.len()),
            ("running", self.running.len()),
            ("ops", self.ops.len()),
            ("prefetch_deadlines", self.prefetch_deadlines.len()),
            ("outbox", self.outbox.len()),
            ("terminate", self.terminate.len()),
            ("ended", self.ended.len()),
            ("retracted_out", self.retracted_out.len()),
            ("backing_up", self.backing_up.len()),
            ("lost_in_backup", self.lost_in_backup.len()),
            ("demoting_pages", self.demoting_pages),
            ("step", usize::from(self.step.is_some())),
        ]
    }

    /// Ops not yet completed: those issued ([`Self::in_flight_ops`]) and those created
    /// since the last plan (a finished request's write-back), which the next plan issues.
    /// So an engine plans again while this is non-zero; it does not wait for it to drop.
    pub fn ops_in_flight(&self) -> usize {
        self.ops.len()
    }

    /// The ops issued and not yet completed, by id (the same list on every tensor-parallel
    /// rank fed the same calls: what `RankAgreement` reduces over).
    pub fn in_flight_ops(&self) -> Vec<(OpId, OpKind)> {
        let mut v: Vec<(OpId, OpKind)> = self
            .ops
            .iter()
            .filter(|(_, r)| !matches!(r.op.state, kvtier_fsm::OpState::Pending))
            .map(|(id, r)| (*id, r.kind()))
            .collect();
        v.sort_unstable_by_key(|(id, _)| *id);
        v
    }

    /// Whether this rank runs ops of `kind`: every op, except that under
    /// `L3Sharing::Replicated` only the leader runs `L3Query` and `BackUp` (the others
    /// `RankAgreement::skip` them).
    pub fn runs_here(&self, kind: OpKind) -> bool {
        match self.cfg.l3_sharing {
            crate::config::L3Sharing::PerRank => true,
            crate::config::L3Sharing::Replicated { leader } => {
                leader == self.cfg.rank || !matches!(kind, OpKind::L3Query | OpKind::BackUp)
            }
        }
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
        self.plan_demotions();
        self.plan_backup_retries();

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
    /// bug: it is logged and counted (`internal_errors`, which [`Self::check`] reports)
    /// rather than the process brought down; the request keeps its state.
    pub(crate) fn apply(&mut self, id: RequestId, event: RequestEvent) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if let Err(e) = r.state.apply_mut(event) {
            // counted, so that `check()` fails in a release build too
            self.stats.internal_errors += 1;
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

    /// The L3 keys of pages under this scheduler's namespace and rank.
    pub fn l3_keys(&self, hashes: &[PageHash]) -> Vec<String> {
        self.keys.keys(hashes)
    }

    /// The tenant a live request is charged to.
    pub(crate) fn tenant_of(&self, id: RequestId) -> TenantId {
        self.reqs.get(&id).map_or(TenantId::SHARED, |r| r.tenant)
    }

    /// Host pages for `n`, evicting per the write policy (see `lifecycle.rs`).
    pub(crate) fn alloc_host(
        &mut self,
        tenant: TenantId,
        n: usize,
    ) -> Option<Vec<kvtier_radix::HostPageId>> {
        if n == 0 {
            return Some(Vec::new());
        }
        if self.cfg.write_policy == crate::config::WritePolicy::WriteBack && self.cfg.l3_enabled {
            self.make_room_on_host(tenant, n);
            return self.cache.alloc_for::<Host>(tenant, n).ok();
        }
        self.cache.alloc_evicting_for::<Host>(tenant, n).ok()
    }
}
