//! The prefetch path, L3 → host (or device without a host tier), in one place: starting a
//! prefetch against the match *at that moment*, its deadline under the stop policy, finishing
//! it (adopting what arrived at exactly the offset its keys were computed for), and the pin
//! that keeps the prefetched pages until their request is admitted.
//!
//! Invariants kept here: a prefetch asks only for keys a probe answered (the caller,
//! `admission.rs`, re-probes when the match shrank below the probe); its pages are inserted
//! below the node locked at issue time, at the offset its keys were computed against; what
//! arrived stays pinned until admission, except that device pins give way when the head of the
//! queue does not fit (so pins cannot deadlock admission).

use kvtier_fsm::{OpKind, RequestEvent};
use kvtier_radix::{Device, Host, PrefixMatch};

use crate::config::PrefetchStopPolicy;
use crate::ops::{AnyLock, OpCtx, PrefetchDst};
use crate::release;
use crate::scheduler::Scheduler;
use crate::types::*;

impl Scheduler {
    /// Without a host tier prefetches land on device and their pins hold device pages; when
    /// the head of the queue does not fit, the pins of the requests behind it give way (they
    /// may lose their prefetched pages and recompute) so that pins cannot deadlock admission.
    /// Returns whether any pin was released.
    pub(crate) fn unpin_device_prefetches_behind(&mut self, head: RequestId) -> bool {
        if self.cfg.host_enabled || !self.cfg.l3_enabled {
            return false;
        }
        let behind: Vec<RequestId> = self
            .waiting
            .values()
            .copied()
            .filter(|w| *w != head)
            .collect();
        let mut released = false;
        for w in behind {
            released |= self.unpin_prefetch(w);
        }
        released
    }

    /// Issues a prefetch of prompt pages `local .. end`, where `local` is the match *now*: the
    /// keys are computed here, against this match, and the pages will be inserted at exactly
    /// this offset below the node locked here.
    pub(crate) fn start_prefetch(&mut self, id: RequestId, m: &PrefixMatch, end: usize) -> bool {
        let Some(r) = self.reqs.get(&id) else {
            return false;
        };
        let total_tokens = r.tokens.len();
        let (local, dst_spec, dst) = if self.cfg.host_enabled {
            // Prefetched pages hang below the host match; device-only pages past it would leave
            // a hole in host residency, so only prefetch when host covers the local match.
            if m.host_pages < m.device_pages {
                return false;
            }
            let local = m.host_pages;
            let Ok(hl) = self.cache.lock::<Host>(m.host_node) else {
                return false;
            };
            let Some(dst) = self.alloc_host(r.tenant, end - local) else {
                release::unlock(&mut self.cache, &mut self.stats, hl);
                return false;
            };
            (
                local,
                TierPages::Host(dst.clone()),
                PrefetchDst::Host(dst, hl),
            )
        } else {
            let local = m.device_pages;
            let Ok(dl) = self.cache.lock::<Device>(m.device_node) else {
                return false;
            };
            let Ok(dst) = self
                .cache
                .alloc_evicting_for::<Device>(r.tenant, end - local)
            else {
                release::unlock(&mut self.cache, &mut self.stats, dl);
                return false;
            };
            (
                local,
                TierPages::Device(dst.clone()),
                PrefetchDst::Device(dst, dl),
            )
        };
        let Some(r) = self.reqs.get(&id) else {
            return false;
        };
        let keys = self.l3_keys(&r.hashes[local..end]);
        self.apply(
            id,
            RequestEvent::SchedulePrefetch {
                start_page: local as u32,
                pages: (end - local) as u32,
            },
        );
        let op = self.new_op(
            OpKind::Prefetch,
            Some(id),
            false,
            OpSpec::Prefetch {
                keys,
                dst: dst_spec,
            },
            OpCtx::Prefetch {
                start: local,
                dst,
                lost_from: None,
            },
        );
        if let Some(deadline) = self.prefetch_deadline(total_tokens) {
            self.prefetch_deadlines.insert((deadline, op));
        }
        true
    }

    /// Inserts the first `completed` prefetched pages at page `start` — the offset their keys
    /// were computed against — below the node locked when the prefetch was issued, and frees
    /// the rest. Pages that meanwhile reached the tree another way are duplicates and freed.
    /// They are marked in L3 up to `lost_from`, the first page L3 reported lost meanwhile.
    pub(crate) fn finish_prefetch(
        &mut self,
        id: RequestId,
        (start, lost_from): (usize, Option<usize>),
        dst: PrefetchDst,
        completed: usize,
    ) {
        // Pages that arrived are adopted below the node locked at issue time; the rest is freed.
        let end = match dst {
            PrefetchDst::Host(pages, lock) => {
                let end = self.adopt_pages::<Host>(id, lock.node(), start, &pages[..completed]);
                release::free(&mut self.cache, &mut self.stats, &pages[completed..]);
                release::unlock(&mut self.cache, &mut self.stats, lock);
                end
            }
            PrefetchDst::Device(pages, lock) => {
                let end = self.adopt_pages::<Device>(id, lock.node(), start, &pages[..completed]);
                release::free(&mut self.cache, &mut self.stats, &pages[completed..]);
                release::unlock(&mut self.cache, &mut self.stats, lock);
                end
            }
        };
        if let Some(end) = end {
            let marked = (start + completed).min(lost_from.unwrap_or(usize::MAX));
            self.mark_in_l3(end, &[(start, marked)]);
        }
        // Pin what arrived until the request is admitted (see `Request::prefetch_pin`).
        let pin = match end {
            Some(end) if completed > 0 && self.cfg.host_enabled => {
                self.cache.lock::<Host>(end).ok().map(AnyLock::Host)
            }
            Some(end) if completed > 0 => self.cache.lock::<Device>(end).ok().map(AnyLock::Device),
            _ => None,
        };
        if let Some(r) = self.reqs.get_mut(&id) {
            r.prefetched = Some((start, completed));
            if let Some(old) = std::mem::replace(&mut r.prefetch_pin, pin) {
                old.release(&mut self.cache, &mut self.stats);
            }
        } else if let Some(pin) = pin {
            pin.release(&mut self.cache, &mut self.stats);
        }
    }

    /// Gives back the pin on the request's prefetched pages (admitted, or ended).
    pub(crate) fn unpin_prefetch(&mut self, id: RequestId) -> bool {
        match self.reqs.get_mut(&id).and_then(|r| r.prefetch_pin.take()) {
            Some(pin) => {
                pin.release(&mut self.cache, &mut self.stats);
                true
            }
            None => false,
        }
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

impl Scheduler {
    /// L3 lost `lost` (every page if `None`: the loss report overflowed): a prefetch in flight
    /// may have read them before they went, so its completion would mark them in L3 again;
    /// each prefetch remembers its first lost page instead (as `lost_in_backup` does for
    /// backups), and marks only the pages before it.
    pub(crate) fn note_prefetch_losses(
        &mut self,
        lost: Option<&std::collections::HashSet<kvtier_radix::PageHash>>,
    ) {
        for rec in self.ops.values_mut() {
            let OpCtx::Prefetch {
                start,
                dst,
                lost_from,
            } = &mut rec.ctx
            else {
                continue;
            };
            let Some(r) = rec.req.and_then(|id| self.reqs.get(&id)) else {
                continue;
            };
            let n = match dst {
                PrefetchDst::Host(p, _) => p.len(),
                PrefetchDst::Device(p, _) => p.len(),
            };
            let first = match lost {
                None => Some(*start),
                Some(lost) => r
                    .hashes
                    .get(*start..*start + n)
                    .unwrap_or_default()
                    .iter()
                    .position(|h| lost.contains(h))
                    .map(|i| *start + i),
            };
            if let Some(first) = first {
                *lost_from = Some(lost_from.map_or(first, |f| f.min(first)));
            }
        }
    }
}
