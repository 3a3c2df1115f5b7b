//! Completions from the engine: cache ops and forward results.
//!
//! Every handler first *validates* the whole event — the op or step exists and is in flight,
//! the completion is of the op's kind, its payload is within bounds, the request's FSM accepts
//! the resulting event, a forward does not overtake the ops it waits for — and only then
//! mutates. A rejected event leaves the scheduler exactly as it was.

use kvtier_fsm::{OpEvent, RequestEvent, RequestState};

use crate::error::SchedulerError;
use crate::idhash::IdMap;
use crate::ops::{OpCtx, PrefetchDst};
use crate::release;
use crate::request::L3Progress;
use crate::scheduler::{RowKind, Scheduler};
use crate::types::*;

/// An op completion that passed the checks that do not involve its request's state.
struct CheckedOp {
    op: OpId,
    success: bool,
    /// The event the completion applies to its request.
    req_event: Option<(RequestId, RequestEvent)>,
}

impl Scheduler {
    /// An op's completion: validated as a whole first (nothing changes on `Err`), then applied
    /// by the handler of its kind.
    pub(crate) fn on_op_done(&mut self, ev: Event) -> Result<(), SchedulerError> {
        let Some((op, success)) = self.validate_op_done(&ev)? else {
            return Ok(());
        };
        let Some(rec) = self.ops.remove(&op) else {
            return Ok(());
        };
        let latency = self.now_ms.saturating_sub(rec.issued_ms);
        self.stats.record_completion(rec.kind(), success, latency);
        let req = rec.req;
        if let Some(r) = req.and_then(|id| self.reqs.get_mut(&id)) {
            r.ops.retain(|o| *o != op);
        }
        match (rec.ctx, ev) {
            (OpCtx::Query { start, .. }, Event::L3QueryDone { hit_pages, .. }) => {
                self.query_done(req, start, hit_pages)
            }
            (
                OpCtx::Prefetch {
                    start,
                    dst,
                    lost_from,
                },
                Event::PrefetchDone { completed, .. },
            ) => self.prefetch_done(op, req, (start, lost_from), dst, completed),
            (OpCtx::LoadBack { host_lock, to, .. }, _) => {
                self.load_back_done(req, host_lock, to, success)
            }
            (
                OpCtx::WriteBack {
                    host_lock,
                    from,
                    dst,
                    cause,
                },
                _,
            ) => self.finish_write_back(req, host_lock, from, dst, cause, success),
            (
                OpCtx::Demotion {
                    dev_lock,
                    host_lock,
                    from,
                    dst,
                },
                _,
            ) => self.demotion_done(dev_lock, host_lock, from, dst, success),
            (
                OpCtx::BackUp {
                    lock,
                    nodes,
                    hashes,
                    span,
                    tries,
                },
                _,
            ) => self.backup_done(req, lock, (&nodes, &hashes), (span, tries), success),
            _ => {}
        }
        Ok(())
    }

    /// Many op completions at once (Python `Scheduler.ops_done`): the whole batch is checked
    /// before any of it is applied, so on `Err` nothing changed and the engine can resend the
    /// valid ones. Each completion is checked as [`Scheduler::on_event`] would; an op may
    /// appear once (`DuplicateCompletion` otherwise), a forward result not at all
    /// (`NotAnOpCompletion`), and completions of one request are checked in order against the
    /// state the earlier ones of the batch leave it in. Returns the number applied.
    pub fn on_op_events(&mut self, evs: Vec<Event>) -> Result<usize, SchedulerError> {
        let mut seen = crate::idhash::IdSet::default();
        let mut states: IdMap<RequestId, RequestState> = IdMap::default();
        for ev in &evs {
            let Some(c) = self.check_op_done(ev)? else {
                if let Event::ForwardDone { step, .. } = ev {
                    return Err(SchedulerError::NotAnOpCompletion(*step));
                }
                continue;
            };
            if !seen.insert(c.op) {
                return Err(SchedulerError::DuplicateCompletion(c.op));
            }
            if let Some((rid, e)) = c.req_event {
                let r = self
                    .reqs
                    .get(&rid)
                    .ok_or(SchedulerError::UnknownRequest(rid))?;
                let now = states.get(&rid).unwrap_or(&r.state);
                let next = now
                    .next_state(&e)
                    .map_err(|reason| SchedulerError::IllegalEvent {
                        req: rid,
                        state: now.kind(),
                        event: e.kind(),
                        reason,
                    })?;
                states.insert(rid, next);
            }
        }
        let n = evs.len();
        for ev in evs {
            self.on_op_done(ev)?;
        }
        Ok(n)
    }

    /// Checks an op completion without changing anything: the op is in flight, the completion
    /// is of its kind, its payload is within bounds and the request's FSM accepts it. Returns
    /// the op and whether it succeeded (`None` for a forward result, handled elsewhere).
    fn validate_op_done(&self, ev: &Event) -> Result<Option<(OpId, bool)>, SchedulerError> {
        let Some(c) = self.check_op_done(ev)? else {
            return Ok(None);
        };
        if let Some((rid, e)) = &c.req_event {
            let r = self
                .reqs
                .get(rid)
                .ok_or(SchedulerError::UnknownRequest(*rid))?;
            self.check_event(r, e)?;
        }
        Ok(Some((c.op, c.success)))
    }

    /// The checks of [`Self::validate_op_done`] that do not involve the request's state;
    /// returns the request event the completion will apply.
    fn check_op_done(&self, ev: &Event) -> Result<Option<CheckedOp>, SchedulerError> {
        let Some((op, claimed)) = ev.op_kind() else {
            return Ok(None);
        };
        let success = match *ev {
            Event::L3QueryDone { .. } | Event::PrefetchDone { .. } => true,
            Event::LoadBackDone { success, .. }
            | Event::WriteBackDone { success, .. }
            | Event::BackUpDone { success, .. } => success,
            Event::ForwardDone { .. } => true,
        };
        let Some(rec) = self.ops.get(&op) else {
            return Err(if op.0 > 0 && op.0 < self.next_op {
                SchedulerError::DuplicateCompletion(op)
            } else {
                SchedulerError::UnknownOp(op)
            });
        };
        if rec.kind() != claimed {
            return Err(SchedulerError::WrongCompletionKind {
                op,
                actual: rec.kind(),
                claimed,
            });
        }
        rec.op
            .state
            .next_state(OpEvent::Complete { success })
            .map_err(|reason| SchedulerError::BadCompletion {
                op,
                what: "op not in flight",
                detail: format!("{reason}"),
            })?;
        let req_event = match (ev, &rec.ctx) {
            (Event::L3QueryDone { hit_pages, .. }, OpCtx::Query { n, .. }) => {
                if *hit_pages as usize > *n {
                    return Err(SchedulerError::BadCompletion {
                        op,
                        what: "hit_pages",
                        detail: format!("{hit_pages} > {n} keys probed"),
                    });
                }
                Some(RequestEvent::QueryDone {
                    hit_pages: *hit_pages,
                })
            }
            (Event::PrefetchDone { completed, .. }, OpCtx::Prefetch { dst, .. }) => {
                let n = match dst {
                    PrefetchDst::Host(p, _) => p.len(),
                    PrefetchDst::Device(p, _) => p.len(),
                };
                if *completed as usize > n {
                    return Err(SchedulerError::BadCompletion {
                        op,
                        what: "completed",
                        detail: format!("{completed} > {n} pages requested"),
                    });
                }
                Some(RequestEvent::PrefetchDone {
                    completed: *completed,
                })
            }
            (Event::WriteBackDone { .. }, OpCtx::WriteBack { .. }) => {
                Some(RequestEvent::WriteBackDone {
                    success,
                    backups: 0,
                })
            }
            (Event::BackUpDone { .. }, OpCtx::BackUp { .. }) => {
                rec.req.map(|_| RequestEvent::BackupDone)
            }
            _ => None,
        };
        Ok(Some(CheckedOp {
            op,
            success,
            req_event: req_event.and_then(|e| rec.req.map(|rid| (rid, e))),
        }))
    }

    /// `L3QueryDone`: record what the probe found; the request waits for admission again.
    fn query_done(&mut self, req: Option<RequestId>, start: usize, hit_pages: u32) {
        if hit_pages > 0 {
            self.backup_retry.answered();
        }
        let Some(id) = req else { return };
        if let Some(r) = self.reqs.get_mut(&id) {
            let reprobes = match r.l3 {
                L3Progress::Unprobed { reprobes } => reprobes,
                _ => 0,
            };
            r.l3 = L3Progress::Probed {
                start,
                hit: hit_pages as usize,
                reprobes,
            };
        }
        self.apply(id, RequestEvent::QueryDone { hit_pages });
        self.requeue_or_release(id);
    }

    /// `PrefetchDone`: adopt what arrived (see `prefetch.rs`); the request waits again.
    fn prefetch_done(
        &mut self,
        op: OpId,
        req: Option<RequestId>,
        (start, lost_from): (usize, Option<usize>),
        dst: PrefetchDst,
        completed: u32,
    ) {
        self.prefetch_deadlines.retain(|(_, o)| *o != op);
        self.terminate.retain(|o| *o != op);
        if completed > 0 {
            self.backup_retry.answered();
        }
        let Some(id) = req else { return };
        self.finish_prefetch(id, (start, lost_from), dst, completed as usize);
        self.apply(id, RequestEvent::PrefetchDone { completed });
        self.requeue_or_release(id);
    }

    /// `LoadBackDone`: the device copies are published, or the chunk that read them must be
    /// recomputed.
    fn load_back_done(
        &mut self,
        req: Option<RequestId>,
        host_lock: kvtier_radix::LockHandle<kvtier_radix::Host>,
        to: usize,
        success: bool,
    ) {
        release::unlock(&mut self.cache, &mut self.stats, host_lock);
        if let Some(id) = req {
            if success {
                self.publish_device(id, to);
            } else if let Some(r) = self.reqs.get_mut(&id) {
                r.recompute = true;
            }
        }
    }

    /// `BackUpDone`: on success the covered nodes are in L3 (unless a loss report overtook the
    /// completion) and L3 answers again; on failure the run waits to be tried again
    /// (`backup_retry.rs`); the source pages are unpinned.
    fn backup_done(
        &mut self,
        req: Option<RequestId>,
        lock: crate::ops::AnyLock,
        (nodes, hashes): (&[(usize, usize)], &[kvtier_radix::PageHash]),
        (span, tries): ((usize, usize), u32),
        success: bool,
    ) {
        let end = lock.node();
        if success {
            self.mark_in_l3(end, nodes);
            self.backup_retry.answered();
        } else {
            self.backup_failed(end, span, tries);
        }
        let mut lost = std::collections::HashSet::new();
        for h in hashes {
            self.backing_up.remove(h);
            if self.lost_in_backup.remove(h) {
                lost.insert(*h);
            }
        }
        if success && !lost.is_empty() {
            self.cache.forget_l3(&lost);
        }
        lock.release(&mut self.cache, &mut self.stats);
        if let Some(id) = req {
            self.apply(id, RequestEvent::BackupDone);
            if self.reqs.get(&id).is_some_and(|r| r.state.is_terminal()) {
                self.release(id);
            }
        }
    }

    /// Inserts the held copies `pages` of the request's pages `from ..` below `start` on tier
    /// `T`: the tree takes the pages it lacks; the caller's duplicates of pages it already has
    /// are freed, as is everything if the insert is refused. Returns the node ending the run.
    pub(crate) fn adopt_pages<T: kvtier_radix::Tier>(
        &mut self,
        id: RequestId,
        start: kvtier_radix::NodeId,
        from: usize,
        pages: &[kvtier_radix::PageId<T>],
    ) -> Option<kvtier_radix::NodeId> {
        let r = self.reqs.get(&id)?;
        match self
            .cache
            .insert_labelled::<T>(start, from, &r.hashes, &r.tokens, pages, r.owner())
        {
            Ok(out) => {
                let dups: Vec<_> = out.duplicates.iter().map(|d| d.1).collect();
                release::free(&mut self.cache, &mut self.stats, &dups);
                Some(out.end_node)
            }
            Err(e) => {
                tracing::error!(req = ?id, error = %e, "insert of copied pages refused");
                release::free(&mut self.cache, &mut self.stats, pages);
                None
            }
        }
    }

    /// Marks in L3 every node on the path to `end` lying entirely inside one of `ranges`.
    pub(crate) fn mark_in_l3(&mut self, end: kvtier_radix::NodeId, ranges: &[(usize, usize)]) {
        let Ok(path) = self.cache.path_nodes(end) else {
            return;
        };
        for (node, s, e) in path {
            if ranges.iter().any(|&(a, b)| a <= s && e <= b) {
                let _ = self.cache.set_in_l3(node, true);
            }
        }
    }

    /// After a completion: a request that became terminal is released, one that is waiting
    /// again goes back into the queue.
    pub(crate) fn requeue_or_release(&mut self, id: RequestId) {
        let Some(r) = self.reqs.get(&id) else {
            return;
        };
        if r.state.is_terminal() {
            self.release(id);
        } else {
            let seq = r.seq;
            self.enqueue(seq, id);
        }
    }

    pub(crate) fn on_forward_done(
        &mut self,
        step: StepId,
        outputs: &[TokenOutput],
    ) -> Result<(), SchedulerError> {
        // ---- validate --------------------------------------------------------------
        let Some(st) = self.step.as_ref() else {
            return Err(SchedulerError::UnknownStep(step));
        };
        if st.id != step {
            return Err(SchedulerError::UnknownStep(step));
        }
        if outputs.len() != st.rows.len() {
            return Err(SchedulerError::RowCountMismatch {
                step,
                expected: st.rows.len(),
                got: outputs.len(),
            });
        }
        // Row index of each output: same order as the batch's rows (decode rows, then prefill
        // chunks), or as `ForwardBatch` lists them (prefill chunks, then decode rows), each
        // recognised in one pass without a map; any other order by lookup.
        let n = outputs.len();
        let in_order = outputs.iter().zip(&st.rows).all(|(o, (r, _))| o.req == *r);
        let decode_rows = st
            .rows
            .iter()
            .filter(|(_, k)| matches!(k, RowKind::Decode))
            .count();
        let prefill_first = !in_order
            && outputs
                .iter()
                .enumerate()
                .all(|(i, o)| o.req == st.rows[(i + decode_rows) % n].0);
        let order: Vec<usize> = if in_order {
            (0..n).collect()
        } else if prefill_first {
            (0..n).map(|i| (i + decode_rows) % n).collect()
        } else {
            let index: IdMap<RequestId, usize> = st
                .rows
                .iter()
                .enumerate()
                .map(|(i, (r, _))| (*r, i))
                .collect();
            let mut seen = vec![false; st.rows.len()];
            let mut order = Vec::with_capacity(outputs.len());
            for o in outputs {
                let Some(&i) = index.get(&o.req) else {
                    return Err(SchedulerError::NotInStep { step, req: o.req });
                };
                if std::mem::replace(&mut seen[i], true) {
                    return Err(SchedulerError::NotInStep { step, req: o.req });
                }
                order.push(i);
            }
            order
        };
        for &i in &order {
            let (rid, kind) = &st.rows[i];
            let r = self
                .reqs
                .get(rid)
                .ok_or(SchedulerError::UnknownRequest(*rid))?;
            let ev = match kind {
                RowKind::Prefill { waits_for } => {
                    if let Some(op) = waits_for
                        && self.ops.contains_key(op)
                    {
                        return Err(SchedulerError::CompletionOutOfOrder { step, op: *op });
                    }
                    RequestEvent::PrefillDone
                }
                RowKind::Decode => RequestEvent::DecodeStep,
            };
            self.check_event(r, &ev)?;
        }

        // ---- apply -------------------------------------------------------------------
        let Some(st) = self.step.take() else {
            return Ok(());
        };
        for (o, &i) in outputs.iter().zip(&order) {
            let (id, kind) = &st.rows[i];
            match kind {
                RowKind::Prefill { .. } => self.prefill_done(*id, o),
                RowKind::Decode => self.decode_done(*id, o),
            }
        }
        Ok(())
    }

    fn prefill_done(&mut self, id: RequestId, out: &TokenOutput) {
        let ps = self.cfg.page_size;
        self.apply(id, RequestEvent::PrefillDone);
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        match r.state {
            RequestState::Aborted => self.release(id),
            _ if r.recompute => {
                // A page this chunk read never arrived from host: its KV (and the token, if
                // any: it is not appended) are garbage. Drop everything the request computed
                // without publishing it, and recompute from the tree.
                r.recompute = false;
                self.retract(id, crate::ops::RetractedKv::Garbage);
            }
            RequestState::Prefilling { done, .. } => {
                self.publish_device(id, done as usize / ps);
            }
            RequestState::Decoding { .. } => {
                let full = r.tokens.len() / ps;
                r.tokens.push(out.token);
                if r.first_token_ms.is_none() {
                    r.first_token_ms = Some(self.now_ms);
                    let ttft = self.now_ms.saturating_sub(r.arrival_ms);
                    self.stats.ttft_ms_sum += ttft;
                    self.stats.ttft_count += 1;
                    metrics::histogram!("kvtier_ttft_ms").record(ttft as f64);
                }
                self.publish_device(id, full);
                self.maybe_finish(id, out.stop);
            }
            _ => {}
        }
    }

    fn decode_done(&mut self, id: RequestId, out: &TokenOutput) {
        self.apply(id, RequestEvent::DecodeStep);
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if r.state.is_terminal() {
            self.release(id);
            return;
        }
        r.tokens.push(out.token);
        self.maybe_finish(id, out.stop);
    }

    fn maybe_finish(&mut self, id: RequestId, stop: bool) {
        let Some(r) = self.reqs.get(&id) else {
            return;
        };
        if stop || r.generated() >= r.max_new as usize {
            self.finish(id);
        }
    }
}
