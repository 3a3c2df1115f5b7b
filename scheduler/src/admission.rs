//! Building the forward batch: decode rows, next prefill chunks, and admission of waiting
//! requests (device/host match, load-back, L3 probe and prefetch).
//!
//! Order within a step: running decodes first (they hold device pages and a user is waiting
//! on every token), then the next chunk of running prefills, then new admissions in arrival
//! order while the token budget, the batch size and device memory allow. Admission stops at
//! the first request that does not fit, so a long prompt is not starved by short ones behind it.

use kvtier_fsm::{OpKind, RequestEvent, RequestState};
use kvtier_radix::{Device, Host, PageId, PrefixMatch, TenantId};

use crate::ops::OpCtx;
use crate::release;
use crate::request::{L3Progress, MAX_REPROBES};
use crate::scheduler::{Budget, RowKind, Scheduler};
use crate::types::*;

enum Admit {
    /// Got a prefill chunk in this batch.
    Admitted,
    /// Went off to L3 (probe or prefetch); not in the batch.
    Deferred,
    /// Does not fit now; stop admitting.
    Blocked,
    /// Its tenant is at its device quota: it waits, the requests behind it are still tried
    /// (another tenant's usage must not hold them up).
    OverQuota,
}

/// An allocation refused by the tenant's own quota: only the tenant's own requests make room.
fn own_quota(e: &kvtier_radix::RadixError) -> bool {
    matches!(e, kvtier_radix::RadixError::TenantQuota { .. })
}

impl Scheduler {
    /// `n` more device pages for running request `id` of `tenant` (its next decode token or
    /// prefill chunk), or `None` (it waits, or was retracted to make room).
    ///
    /// Other tenants' leaves within their quotas are spared while other work runs (their
    /// pages come back when it ends). When `id` runs alone with nothing in flight, nothing
    /// will give pages back: sparing them then would retract `id` itself, whose next
    /// admission (the idle last resort) takes the same first chunk and meets the same wall
    /// at the next, for ever. So alone it allocates as that admission does, as a last resort
    /// (its own quota still holds).
    fn grow(&mut self, id: RequestId, tenant: TenantId, n: usize) -> Option<Vec<PageId<Device>>> {
        let alone = self.running.len() == 1 && self.ops.is_empty();
        let first = if alone {
            self.cache
                .alloc_evicting_for_last_resort::<Device>(tenant, n)
        } else {
            self.cache.alloc_evicting_for::<Device>(tenant, n)
        };
        match first {
            Ok(p) => Some(p),
            Err(e) if self.retract_for(id, own_quota(&e)) => {
                self.cache.alloc_evicting_for::<Device>(tenant, n).ok()
            }
            Err(_) => None,
        }
    }

    pub(crate) fn schedule_decode(
        &mut self,
        budget: &mut Budget,
        batch: &mut ForwardBatch,
        rows: &mut Vec<(RequestId, RowKind)>,
    ) {
        let ps = self.cfg.page_size;
        let ids: Vec<RequestId> = self.running.values().copied().collect();
        // Room for every row up front: no regrowth of the batch as rows are added.
        batch.decode.reserve(ids.len().min(budget.rows));
        rows.reserve(ids.len().min(budget.rows));
        for id in ids {
            if budget.rows == 0 || budget.tokens == 0 {
                break;
            }
            let Some(r) = self.reqs.get(&id) else {
                continue;
            };
            if !matches!(
                r.state,
                RequestState::Decoding {
                    in_flight: false,
                    abort_pending: false,
                    ..
                }
            ) {
                continue;
            }
            if r.kv_len() + 1 > r.table.pages.len() * ps {
                let Some(page) = self.grow(id, r.tenant, 1) else {
                    continue;
                };
                let Some(r) = self.reqs.get_mut(&id) else {
                    release::free(&mut self.cache, &mut self.stats, &page);
                    continue;
                };
                if !matches!(
                    r.state,
                    RequestState::Decoding {
                        in_flight: false,
                        ..
                    }
                ) {
                    // Retracted itself to make room.
                    release::free(&mut self.cache, &mut self.stats, &page);
                    continue;
                }
                r.table.pages.extend(page);
            }
            self.apply(id, RequestEvent::ScheduleDecode);
            let Some(r) = self.reqs.get_mut(&id) else {
                continue;
            };
            batch.decode.push(DecodeRow {
                req: id,
                position: r.kv_len() as u32,
                table: r.table.take_delta(),
            });
            rows.push((id, RowKind::Decode));
            budget.rows -= 1;
            budget.tokens -= 1;
        }
    }

    pub(crate) fn schedule_chunks(
        &mut self,
        budget: &mut Budget,
        batch: &mut ForwardBatch,
        rows: &mut Vec<(RequestId, RowKind)>,
    ) {
        let ps = self.cfg.page_size;
        let ids: Vec<RequestId> = self.running.values().copied().collect();
        for id in ids {
            if budget.rows == 0 || budget.tokens == 0 {
                break;
            }
            let Some(r) = self.reqs.get(&id) else {
                continue;
            };
            let RequestState::Prefilling {
                total,
                done,
                scheduled,
                abort_pending: false,
                ..
            } = r.state
            else {
                continue;
            };
            if done != scheduled || done >= total {
                continue;
            }
            let (done, total) = (done as usize, total as usize);
            let chunk = (total - done)
                .min(self.cfg.chunked_prefill_size)
                .min(budget.tokens);
            let need = (done + chunk)
                .div_ceil(ps)
                .saturating_sub(r.table.pages.len());
            if need > 0 {
                // Decode growth ate the pages this prefill was admitted with: preempt someone
                // (possibly this request) rather than wait forever.
                let Some(p) = self.grow(id, r.tenant, need) else {
                    continue;
                };
                match self.reqs.get_mut(&id) {
                    Some(r) if matches!(r.state, RequestState::Prefilling { .. }) => {
                        r.table.pages.extend(p)
                    }
                    _ => {
                        release::free(&mut self.cache, &mut self.stats, &p);
                        continue;
                    }
                }
            }
            self.apply(
                id,
                RequestEvent::ScheduleNextChunk {
                    tokens: chunk as u32,
                },
            );
            let Some(r) = self.reqs.get_mut(&id) else {
                continue;
            };
            batch.prefill.push(PrefillChunk {
                req: id,
                start: done as u32,
                len: chunk as u32,
                last: done + chunk == total,
                table: r.table.take_delta(),
                tokens: r.tokens[done..done + chunk].to_vec(),
                waits_for: Default::default(),
            });
            rows.push((id, RowKind::Prefill { waits_for: None }));
            self.stats.computed_tokens += chunk as u64;
            budget.rows -= 1;
            budget.tokens -= chunk;
        }
    }

    pub(crate) fn admit(
        &mut self,
        budget: &mut Budget,
        batch: &mut ForwardBatch,
        rows: &mut Vec<(RequestId, RowKind)>,
    ) {
        let waiting: Vec<(u64, RequestId)> = self.waiting.iter().map(|(s, i)| (*s, *i)).collect();
        if waiting.is_empty() {
            return;
        }
        // Pages running prefills will still allocate: admission leaves them alone, so chunked
        // prefills admitted together cannot deadlock each other.
        let ps = self.cfg.page_size;
        self.reserved_pages = self
            .running
            .values()
            .filter_map(|id| self.reqs.get(id))
            .map(|r| match r.state {
                RequestState::Prefilling { total, .. } => (total as usize)
                    .div_ceil(ps)
                    .saturating_sub(r.table.pages.len()),
                _ => 0,
            })
            .sum();
        for (_, id) in waiting {
            if budget.rows == 0
                || budget.tokens == 0
                || self.running.len() >= self.cfg.max_batch_size
            {
                break;
            }
            match self.try_admit(id, budget, batch, rows) {
                Admit::Admitted | Admit::Deferred => {}
                Admit::OverQuota => {
                    // Its tenant's prefetch pins behind it give way (they count against the
                    // same quota); either way the requests behind it are tried.
                    if self.unpin_device_prefetches_behind(id) {
                        let _ = self.try_admit(id, budget, batch, rows);
                    }
                }
                Admit::Blocked => {
                    // The pins behind the head give way for it; if any did, the head gets
                    // its chance in this pass. Waiting for the next pass instead stalled an
                    // engine that plans again only on events: the plan came out empty with
                    // nothing in flight, and nothing woke it.
                    if !self.unpin_device_prefetches_behind(id)
                        || matches!(self.try_admit(id, budget, batch, rows), Admit::Blocked)
                    {
                        break;
                    }
                }
            }
        }
    }

    fn try_admit(
        &mut self,
        id: RequestId,
        budget: &mut Budget,
        batch: &mut ForwardBatch,
        rows: &mut Vec<(RequestId, RowKind)>,
    ) -> Admit {
        let ps = self.cfg.page_size;
        let Some(r) = self.reqs.get(&id) else {
            return Admit::Deferred;
        };
        if matches!(r.state, RequestState::Retracted { .. }) {
            self.apply(id, RequestEvent::ResumeFromRetracted);
        }
        let Some(r) = self.reqs.get_mut(&id) else {
            return Admit::Deferred;
        };
        let total = r.tokens.len();
        // Leave at least one token to compute: the last prompt token's logits start decoding.
        let usable = (total - 1) / ps;
        r.ensure_hashes(usable, ps);
        let usable = usable.min(r.hashes.len());
        let m = self.cache.match_prefix(&r.hashes[..usable]);
        let seq = r.seq;

        if matches!(r.state, RequestState::Submitted) && r.l3 != L3Progress::Done {
            let local = m.matched_pages;
            let threshold = (self.cfg.prefetch_threshold as usize).max(1);
            // A prefetch starts at the host match (the device match without a host tier).
            let from = if self.cfg.host_enabled {
                m.host_pages
            } else {
                m.device_pages
            };
            let probe_from = match r.l3 {
                L3Progress::Unprobed { .. } if usable >= local + threshold => Some(local),
                L3Progress::Probed {
                    start, reprobes, ..
                } if from < start && reprobes < MAX_REPROBES && usable >= from + threshold => {
                    // The local match shrank since the probe: pages `from .. start` were never
                    // probed, and a prefetch must not ask for them. Probe again from here.
                    r.l3 = L3Progress::Unprobed {
                        reprobes: reprobes + 1,
                    };
                    Some(local)
                }
                L3Progress::Probed { start, hit, .. } => {
                    r.l3 = L3Progress::Done;
                    let end = (start + hit).min(usable);
                    if from >= start && end >= local + threshold && self.start_prefetch(id, &m, end)
                    {
                        self.dequeue(seq);
                        return Admit::Deferred;
                    }
                    None
                }
                _ => {
                    r.l3 = L3Progress::Done;
                    None
                }
            };
            if let Some(local) = probe_from
                && let Some(r) = self.reqs.get(&id)
            {
                let keys = self.keys.keys(&r.hashes[local..usable]);
                self.apply(id, RequestEvent::ScheduleQuery);
                self.new_op(
                    OpKind::L3Query,
                    Some(id),
                    false,
                    OpSpec::L3Query { keys },
                    OpCtx::Query {
                        start: local,
                        n: usable - local,
                    },
                );
                self.dequeue(seq);
                return Admit::Deferred;
            }
        }
        self.admit_prefill(id, m, budget, batch, rows)
    }

    /// Admits a request into prefill: pins its device match, loads host-only pages back, and
    /// schedules its first chunk.
    fn admit_prefill(
        &mut self,
        id: RequestId,
        m: PrefixMatch,
        budget: &mut Budget,
        batch: &mut ForwardBatch,
        rows: &mut Vec<(RequestId, RowKind)>,
    ) -> Admit {
        let ps = self.cfg.page_size;
        let Some(r) = self.reqs.get(&id) else {
            return Admit::Deferred;
        };
        let total = r.tokens.len();
        let seq = r.seq;
        let prefetched = r.prefetched;
        let first_admission = !r.resumed;
        let dev = m.device_pages;
        let host = if self.cfg.host_enabled {
            m.host_pages
        } else {
            0
        };
        let lb = host.saturating_sub(dev);
        let cached = dev + lb;
        let chunk = (total - cached * ps)
            .min(self.cfg.chunked_prefill_size)
            .min(budget.tokens);
        if chunk == 0 {
            return Admit::Blocked;
        }
        let new_pages = (cached * ps + chunk).div_ceil(ps) - cached;
        let Ok(dl) = self.cache.lock::<Device>(m.device_node) else {
            return Admit::Blocked;
        };
        let hl = if lb > 0 {
            match self.cache.lock::<Host>(m.host_node) {
                Ok(h) => Some(h),
                Err(_) => {
                    release::unlock(&mut self.cache, &mut self.stats, dl);
                    return Admit::Blocked;
                }
            }
        } else {
            None
        };
        let whole_prompt = total.div_ceil(ps) - cached;
        let obtainable = self
            .cache
            .usage(kvtier_radix::TierKind::Device)
            .obtainable();
        if obtainable < lb + whole_prompt + self.reserved_pages {
            release::unlock(&mut self.cache, &mut self.stats, dl);
            if let Some(h) = hl {
                release::unlock(&mut self.cache, &mut self.stats, h);
            }
            return Admit::Blocked;
        }
        let tenant = self.tenant_of(id);
        // Quotas: other tenants within theirs are spared while something runs (its pages come
        // back); with nothing running or in flight, waiting would be forever: last resort.
        let idle = self.running.is_empty() && self.ops.is_empty();
        let fresh = match if idle {
            self.cache
                .alloc_evicting_for_last_resort::<Device>(tenant, lb + new_pages)
        } else {
            self.cache
                .alloc_evicting_for::<Device>(tenant, lb + new_pages)
        } {
            Ok(p) => p,
            Err(e) => {
                release::unlock(&mut self.cache, &mut self.stats, dl);
                if let Some(h) = hl {
                    release::unlock(&mut self.cache, &mut self.stats, h);
                }
                return match e {
                    kvtier_radix::RadixError::TenantQuota { .. } => Admit::OverQuota,
                    _ => Admit::Blocked,
                };
            }
        };
        // The load-back's destination, then the page table: the device match's pages and the
        // fresh ones (taken as they are when nothing matched on device: one allocation and
        // copy less per admission).
        let lb_dst = hl.as_ref().map(|_| fresh[..lb].to_vec());
        let pages = if dev == 0 {
            fresh
        } else {
            let mut pages = self
                .cache
                .path_pages::<Device>(m.device_node)
                .unwrap_or_default();
            pages.extend_from_slice(&fresh);
            pages
        };
        let mut waits_for = smallvec::SmallVec::new();
        if let Some(hl) = hl {
            let src = self
                .cache
                .path_pages_from::<Host>(m.host_node, dev)
                .unwrap_or_default();
            let op = self.new_op(
                OpKind::LoadBack,
                Some(id),
                true,
                OpSpec::LoadBack {
                    src,
                    dst: lb_dst.unwrap_or_default(),
                },
                OpCtx::LoadBack {
                    host_lock: hl,
                    to: host,
                },
            );
            waits_for.push(op);
        }
        self.apply(
            id,
            RequestEvent::ScheduleFirstChunk {
                total: total as u32,
                cached: (cached * ps) as u32,
                tokens: chunk as u32,
            },
        );
        // Pages the last prefetch brought from L3 count as L3 hits, whether they were then
        // loaded back from host or (without a host tier) landed on device directly.
        let overlap = |a: usize, b: usize| {
            prefetched.map_or(0, |(s, n)| (s + n).min(b).saturating_sub(s.max(a)))
        };
        let (l3_dev, l3_lb) = (overlap(0, dev), overlap(dev, host.max(dev)));
        if first_admission && cached > 0 {
            // One reuse per request (write-through-selective counts requests, not matches).
            let deepest = if host > dev {
                m.host_node
            } else {
                m.device_node
            };
            if let Err(e) = self.cache.record_reuse(deepest) {
                tracing::error!(req = ?id, error = %e, "internal: record_reuse");
            }
        }
        if first_admission {
            self.stats
                .record_hits("device", (dev - l3_dev) as u64, ps as u64);
            self.stats
                .record_hits("host", (lb - l3_lb) as u64, ps as u64);
            self.stats
                .record_hits("l3", (l3_dev + l3_lb) as u64, ps as u64);
        }
        self.stats.computed_tokens += chunk as u64;
        let Some(r) = self.reqs.get_mut(&id) else {
            return Admit::Deferred;
        };
        r.table.pages = pages;
        r.prefetched = None;
        // Admitted: its own locks (device match, load-back source) now hold what it reads.
        self.unpin_prefetch(id);
        let Some(r) = self.reqs.get_mut(&id) else {
            return Admit::Deferred;
        };
        r.table.tree_pages = dev;
        r.table.lock = Some(dl);
        r.table.sent = 0;
        r.table.dirty_from = usize::MAX;
        let start = cached * ps;
        batch.prefill.push(PrefillChunk {
            req: id,
            start: start as u32,
            len: chunk as u32,
            last: start + chunk == total,
            table: r.table.take_delta(),
            tokens: r.tokens[start..start + chunk].to_vec(),
            waits_for: waits_for.clone(),
        });
        rows.push((
            id,
            RowKind::Prefill {
                waits_for: waits_for.first().copied(),
            },
        ));
        self.dequeue(seq);
        self.running.insert(seq, id);
        self.reserved_pages += whole_prompt - new_pages;
        budget.rows -= 1;
        budget.tokens -= chunk;
        Admit::Admitted
    }
}
