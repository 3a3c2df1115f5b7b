//! How a store's pages reach the tree: an [`OffloadManager`] store lands when the engine
//! reports it, and its pages are inserted once their parent pages are on host.
//!
//! Why apart: two requests with a common prefix computed in one step give two stores, the
//! second starting where the first's pages end; the second may land first. Its pages then
//! wait (`Landed`), locked on the deepest host-resident node of their chain, until the
//! parent store is inserted, and die with it if it fails (`Orphaned`: the slots stay held
//! until the engine reports the job, since its copy may still be in flight). `settle` runs
//! after every completion until nothing changes. Invariant (checked by
//! [`OffloadManager::check`]): `storing` is exactly the pages of stores not orphaned, the
//! held slots exactly the in-flight stores' slots.

use kvtier_radix::{Host, HostPageId, PageHash};

use crate::offload::{
    JobKind, JobOutcome, OffloadError, OffloadManager, PendingStore, StoreState, token_of,
};

impl OffloadManager {
    /// A store's bytes landed (`Done`: its pages become host hits) or not (`Failed`: its
    /// slots are freed). A prefetch job is refused ([`OffloadError::WrongJobKind`]: it
    /// completes with the pages it read, [`Self::complete_prefetch`]).
    pub fn complete_store(&mut self, job: u64, outcome: JobOutcome) -> Result<(), OffloadError> {
        if self.l3.is_prefetch(job) {
            return Err(OffloadError::WrongJobKind {
                job,
                kind: JobKind::Prefetch,
                called: JobKind::Store,
            });
        }
        self.land_store(job, outcome)
    }

    /// [`Self::complete_store`] for any store job, a prefetch's included.
    fn land_store(&mut self, job: u64, outcome: JobOutcome) -> Result<(), OffloadError> {
        let Some(p) = self.stores.get_mut(&job) else {
            return Err(OffloadError::UnknownJob {
                kind: JobKind::Store,
                job,
            });
        };
        match (p.state, outcome) {
            (StoreState::Landed, _) => return Err(OffloadError::AlreadyCompleted { job }),
            (StoreState::Orphaned, _) | (StoreState::Writing, JobOutcome::Failed) => {
                self.drop_store(job)
            }
            (StoreState::Writing, JobOutcome::Done) => p.state = StoreState::Landed,
        }
        self.l3.prefetch_ended(job);
        self.settle();
        Ok(())
    }

    /// Only the first `landed` pages of a store's run landed (a prefetch whose read failed
    /// part way): the rest are given up (slots freed, reported by [`Self::take_dropped`]) and
    /// the landed ones complete as `Done`; none landed is `Failed`.
    pub(crate) fn complete_store_prefix(
        &mut self,
        job: u64,
        landed: usize,
    ) -> Result<(), OffloadError> {
        let Some(p) = self.stores.get_mut(&job) else {
            return Err(OffloadError::UnknownJob {
                kind: JobKind::Store,
                job,
            });
        };
        if landed == 0 {
            return self.land_store(job, JobOutcome::Failed);
        }
        if landed < p.slots.len() && p.state == StoreState::Writing {
            let gone: Vec<PageHash> = p.chain.drain(p.from + landed..).collect();
            let freed: Vec<HostPageId> = p.slots.drain(landed..).collect();
            for h in &gone {
                self.storing.remove(h);
            }
            self.dropped.extend(gone);
            // Held by this store since prepare_store: freeing them cannot fail.
            self.free_held(&freed);
        }
        self.land_store(job, JobOutcome::Done)
    }

    /// Inserts every landed store whose parent pages are on host, moves the locks of stores
    /// whose parents just arrived onto them, and drops stores whose parent will never come
    /// (failed, or evicted before they landed); until nothing changes.
    fn settle(&mut self) {
        loop {
            let mut jobs: Vec<u64> = self.stores.keys().copied().collect();
            jobs.sort_unstable();
            let mut changed = false;
            for job in jobs {
                let Some(p) = self.stores.get(&job) else {
                    continue;
                };
                let (from, state) = (p.from, p.state);
                if state == StoreState::Orphaned {
                    continue;
                }
                let (_, resident) = self.cache.peek_prefix(&p.chain[..from]);
                if resident < from {
                    if !self.storing.contains(&p.chain[resident]) {
                        if state == StoreState::Landed {
                            self.drop_store(job);
                        } else {
                            self.orphan_store(job);
                        }
                        changed = true;
                    }
                    continue;
                }
                let locked_at = self.cache.node_end(p.lock.node()).unwrap_or(0);
                if locked_at < from {
                    let chain = p.chain[..from].to_vec();
                    let node = self.cache.match_prefix(&chain).host_node;
                    if let Some(p) = self.stores.remove(&job) {
                        let lock = match self.cache.relock(p.lock, node) {
                            Ok(l) => l,
                            Err(r) => r.handle,
                        };
                        self.stores.insert(job, PendingStore { lock, ..p });
                    }
                }
                if state == StoreState::Landed {
                    self.insert_store(job);
                    changed = true;
                }
            }
            if !changed {
                return;
            }
        }
    }

    /// Gives a landed store's pages to the tree (its parent is on host, under its lock).
    fn insert_store(&mut self, job: u64) {
        let Some(p) = self.stores.remove(&job) else {
            return;
        };
        for h in &p.chain[p.from..] {
            self.storing.remove(h);
        }
        let tokens: Vec<u32> = p.chain.iter().map(token_of).collect();
        let mut unused = p.slots.clone();
        let mut end_node = None;
        // Cannot fail: the locked start ends at `from` with a host copy, the chain continues
        // it and the slots are held (checked again by the tree all the same).
        if let Ok(out) = self.cache.insert_for::<Host>(
            p.tenant,
            p.lock.node(),
            p.from,
            &p.chain,
            &tokens,
            &p.slots,
        ) {
            end_node = Some(out.end_node);
            unused = out
                .duplicates
                .into_iter()
                .map(|(_, mine, _)| mine)
                .collect();
        }
        // The slots are ours (held since prepare_store): freeing them cannot fail.
        self.free_held(&unused);
        match end_node {
            Some(node) => self.take_hold(job, node),
            None => self.end_hold(job),
        }
        self.release(p.lock);
        self.l3.on_inserted(&p.chain, p.from);
    }

    /// A store whose pages can no longer be inserted, while the engine still writes them.
    fn orphan_store(&mut self, job: u64) {
        if let Some(p) = self.stores.get_mut(&job) {
            p.state = StoreState::Orphaned;
            for h in &p.chain[p.from..] {
                self.storing.remove(h);
            }
            self.dropped.extend_from_slice(&p.chain[p.from..]);
        }
    }

    /// Forgets a store: its slots freed, its pages no longer being stored.
    fn drop_store(&mut self, job: u64) {
        let Some(p) = self.stores.remove(&job) else {
            return;
        };
        if p.state != StoreState::Orphaned {
            for h in &p.chain[p.from..] {
                self.storing.remove(h);
            }
            self.dropped.extend_from_slice(&p.chain[p.from..]);
        }
        self.free_held(&p.slots);
        self.release(p.lock);
        self.end_hold(job);
    }
}
