//! Completions: what the engine does when an op or a forward finishes at its modelled time —
//! page copies applied to the model, L3 reads and writes on the real embedded store, and the
//! matching event handed back to the scheduler.
//!
//! Why apart from the event loop: this is where the simulated engine touches the real store
//! and where the faults the config asks for (failed prefetches and backups, lost L3 objects)
//! are injected.

use kvtier_l3::{ErrorCode, L3Store, PutOptions};
use kvtier_scheduler::*;

use super::{Simulation, flush_offloads, key_fingerprint};
use crate::workload::generated_token;

impl Simulation {
    pub(super) fn complete_prefetch(&mut self, inst: usize, op: OpId) -> Result<(), String> {
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
            let pages: Vec<_> = keys
                .iter()
                .filter_map(|k| kvtier_radix::parse_l3_key(k).map(|k| k.page))
                .collect();
            self.router.l3_written(inst, &pages);
            if self.router.wants_store_events() {
                self.l3_written.extend(keys.iter().cloned());
            }
        }
        self.backups_done += 1;
        let lose = self.cfg.faults.lose_l3_every;
        if lose > 0
            && self.backups_done.is_multiple_of(lose)
            && let Some(k) = keys.first()
        {
            // An L3 object disappears (evicted elsewhere, node lost); the loss journal
            // reports it with the rest.
            store.remove(&self.tenant, k, true).ok();
        }
        self.settle_store();
        self.report_l3_losses();
        ok
    }

    /// With an SSD tier: lets the store's SSD writer finish what the last backup queued (the
    /// objects its puts evicted from DRAM) and evict the SSD buckets that overflowed.
    ///
    /// Why after every backup: a backup is the only thing the simulator does that gives the
    /// writer work, so every later read of the store — a probe's existence check, a
    /// prefetch's residency and read, the loss journal — sees the store as the simulated
    /// time left it, not as far as the writer thread got on the wall clock (which made runs
    /// with an SSD tier differ from run to run). The loss journal is then complete before a
    /// scheduler trusts an "in L3" mark to drop a host copy (write-back), and the oracle
    /// checks that drop against the store as it was.
    pub(super) fn settle_store(&self) {
        // From the configuration (the store has an SSD tier exactly when `l3_ssd_pages > 0`),
        // not `ssd_stats()`, which locks the tier.
        if self.cfg.l3_ssd_pages > 0
            && let Some(s) = &self.store
        {
            flush_offloads(s);
        }
    }

    /// Passes the store's loss journal to every instance, as an engine embedding the store
    /// does: objects evicted to make room (by this backup or any other), removed, or lost
    /// with their SSD bucket stop counting as "in L3" before any scheduler trusts the mark
    /// to drop a host copy.
    pub(super) fn report_l3_losses(&mut self) {
        let Some(store) = &self.store else {
            return;
        };
        // The simulator's store always keeps a journal; were it off there would be nothing
        // to report.
        let Ok(lost) = store.losses_since(&self.tenant, self.loss_cursor) else {
            return;
        };
        self.loss_cursor = Some(lost.next);
        let keys: Vec<&str> = lost.keys.iter().map(String::as_str).collect();
        if !keys.is_empty() {
            let pages: Vec<_> = keys
                .iter()
                .filter_map(|k| kvtier_radix::parse_l3_key(k).map(|k| k.page))
                .collect();
            self.router.l3_lost(&pages);
        }
        for ev in store.kv_events() {
            match ev.take_batch() {
                Ok(batch) => self.router.store_events(&batch),
                Err(e) => self.col.oracle_failure(format!("store events: {e}")),
            }
        }
        for (n, i) in self.insts.iter_mut().enumerate() {
            // Each simulated instance is a single-rank engine (`tp_ranks` 1): its scheduler
            // takes the report directly; a refusal is a misconfigured run, counted as such.
            let reported = if lost.overflowed {
                i.sched.l3_lost_all()
            } else if !keys.is_empty() {
                i.sched.l3_lost(&keys)
            } else {
                Ok(0)
            };
            if let Err(e) = reported {
                self.col
                    .oracle_failure(format!("instance {n}: loss report refused: {e}"));
            }
        }
    }

    pub(super) fn complete_op(&mut self, inst: usize, op: PlannedOp) -> Result<(), String> {
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

    pub(super) fn complete_forward(
        &mut self,
        inst: usize,
        batch: ForwardBatch,
    ) -> Result<(), String> {
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
                    self.router.first_token(c.req.0, now);
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
