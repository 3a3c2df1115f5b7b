//! The scheduler's full consistency check, [`Scheduler::check`], run by the scheduler's tests
//! (the property tests after every action), the simulator and the end-to-end tests.
//!
//! Why: a scheduler bug that leaks a lock or lets a page table drift from the tree corrupts KV
//! much later and far away; checking the cross-structure invariants often pins it to the step
//! that broke them. Invariants checked (beyond the cache's own):
//! - no lock or page failed to be given back (`internal_errors == 0`);
//! - a live request's device lock ends at its `tree_pages`, and its page table agrees with the
//!   tree along that path; no tree pages without a lock;
//! - the request's own pages past the tree are `Held`;
//! - the cache's outstanding locks are exactly those requests (lock, prefetch pin) and ops
//!   (per op kind) account for;
//! - queue protection (`waiting.rs`) is held for exactly the waiting requests when it is on,
//!   and the cache protects exactly their prompts' distinct pages.

use kvtier_radix::Device;

use crate::ops::OpCtx;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Full consistency check (tests): the cache's invariants, plus every live request's page
    /// table and lock agreeing with the tree, and the lock count matching what requests and ops
    /// hold.
    pub fn check(&self) -> Result<(), String> {
        self.cache.check_invariants()?;
        self.check_queue_protection()?;
        if self.stats.internal_errors > 0 {
            return Err(format!(
                "{} locks or pages could not be given back",
                self.stats.internal_errors
            ));
        }
        let mut dev_locks = 0;
        let mut host_locks = 0;
        for r in self.reqs.values() {
            if let Some(l) = &r.table.lock {
                dev_locks += 1;
                let end = self.cache.node_end(l.node()).map_err(|e| e.to_string())?;
                if end != r.table.tree_pages {
                    return Err(format!(
                        "{:?}: lock ends at {end}, tree_pages {}",
                        r.id, r.table.tree_pages
                    ));
                }
                let tree = self
                    .cache
                    .path_pages::<Device>(l.node())
                    .map_err(|e| e.to_string())?;
                if tree[..] != r.table.pages[..r.table.tree_pages] {
                    return Err(format!("{:?}: page table disagrees with the tree", r.id));
                }
            } else if r.table.tree_pages != 0 {
                return Err(format!("{:?}: tree pages without a lock", r.id));
            }
            match &r.prefetch_pin {
                Some(crate::ops::AnyLock::Host(_)) => host_locks += 1,
                Some(crate::ops::AnyLock::Device(_)) => dev_locks += 1,
                None => {}
            }
            for p in &r.table.pages[r.table.tree_pages.min(r.table.pages.len())..] {
                if self.cache.page_state(*p) != Some(kvtier_radix::PageState::Held) {
                    return Err(format!("{:?}: own page {p:?} not held", r.id));
                }
            }
        }
        for o in self.ops.values() {
            match &o.ctx {
                OpCtx::LoadBack { .. } | OpCtx::WriteBack { .. } => host_locks += 1,
                OpCtx::Demotion { .. } => {
                    host_locks += 1;
                    dev_locks += 1;
                }
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

    fn check_queue_protection(&self) -> Result<(), String> {
        let on = self.cfg.queue_protection == crate::config::QueueProtection::Waiting;
        let waiting: std::collections::HashSet<_> = self.waiting.values().copied().collect();
        let protected: std::collections::HashSet<_> = self.protected_for.keys().copied().collect();
        if (on && waiting != protected) || (!on && !protected.is_empty()) {
            return Err(format!(
                "queue protection held for {protected:?}, waiting {waiting:?} (on: {on})"
            ));
        }
        let distinct: std::collections::HashSet<_> =
            self.protected_for.values().flatten().copied().collect();
        if distinct.len() != self.cache.protected_hashes() {
            return Err(format!(
                "the cache protects {} pages, the waiting prompts have {}",
                self.cache.protected_hashes(),
                distinct.len()
            ));
        }
        Ok(())
    }
}
