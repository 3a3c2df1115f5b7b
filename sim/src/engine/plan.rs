//! Timing an execution plan: each op is put on its modelled link (PCIe each way, the network
//! for L3) after what that link already carries, and the forward starts once the ops it
//! waits for are done.
//!
//! Why apart from the event loop: this is the cost model of the engine — link occupancy, SSD
//! reads before prefetches, promotions started by probes, prefetch terminations — and the
//! numbers a report shows come from here. Times are added saturating: a time past the
//! clock's range ends the run with an error (`CLOCK_END` in the event loop) instead of
//! wrapping to an earlier one.

use kvtier_scheduler::*;

use super::{LivePrefetch, Pending, Simulation};
use crate::profile::L3Link;
use crate::report::RequestTiming;

impl Simulation {
    pub(super) fn plan(&mut self, inst: usize) -> Result<(), String> {
        if self.insts[inst].forward_busy {
            return Ok(());
        }
        let now = self.now_us;
        self.report_l3_losses();
        let plan = self.insts[inst].sched.next_execution_plan(now / 1000);
        self.check_host_drops(inst);
        let links = self.cfg.links.clone();
        let page_bytes = self.col.page_bytes;
        {
            let i = &mut self.insts[inst];
            for (id, outcome) in &plan.ended {
                i.model.forget(*id);
                if let Some(tr) = i.tracks.remove(id) {
                    let timing = tr.first_token_us.map(|f| RequestTiming {
                        id: id.0,
                        instance: inst,
                        arrival_us: tr.arrival_us,
                        ttft_us: f - tr.arrival_us,
                        prompt_tokens: tr.prompt_len,
                    });
                    self.col.ended(*outcome, timing);
                }
                self.router.ended(id.0, now);
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
                            // Residency as the last backup left it: `settle_store`.
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
                    (&mut i.net_free, links.l3_us(bytes).saturating_add(ssd))
                }
                OpKind::BackUp => match links.l3_link {
                    L3Link::Shared => (&mut i.net_free, links.l3_us(bytes)),
                    L3Link::Duplex => (&mut i.net_write_free, links.l3_us(bytes)),
                },
                OpKind::L3Query => {
                    // The probe asks the store to promote SSD-only hits to DRAM
                    // (`prefetch_to_memory`): their SSD reads start now, one after another,
                    // off the prefetch's critical path.
                    if let (Some(s), OpSpec::L3Query { keys }) = (&self.store, &op.spec)
                        && self.cfg.l3_ssd_pages > 0
                        && self.cfg.l3_promote_on_probe
                    {
                        let mut t = now.saturating_add(links.l3_query_us as u64);
                        for k in keys {
                            match s.residency(&self.tenant, k) {
                                (false, true) if !self.promoting.contains_key(k) => {
                                    t = t.saturating_add(links.ssd_us(page_bytes));
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
            let end = start.saturating_add(dur);
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
            let end = before_forward_end.saturating_add(dur);
            self.insts[inst].forward_busy = true;
            self.insts[inst].busy_us = self.insts[inst].busy_us.saturating_add(dur);
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
            self.push(now.saturating_add(2000), Pending::Wake(inst));
        }
        Ok(())
    }
}
