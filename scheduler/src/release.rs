//! Giving locks and pages back to the cache, with failures made visible.
//!
//! Why not `let _ = cache.unlock(..)`: a failed release is a scheduler bug (a lock given back
//! twice, a page freed that the request did not hold), and a discarded `Result` hides it until
//! the pools no longer balance far from the cause. Every release goes through here: a failure
//! is logged, counted in `Stats::internal_errors` (which `Scheduler::check` requires to be 0,
//! so every test that checks quiescence catches it, release builds included) and asserted in
//! debug builds.

use kvtier_radix::{LockHandle, PageId, RadixCache, RadixError, Tier};

use crate::stats::Stats;

fn failed(stats: &mut Stats, what: &'static str, e: RadixError) {
    checked::<()>(&mut stats.internal_errors, what, Err(e));
}

/// The result of a release (a free, an unlock, an eviction) that cannot fail unless the
/// caller's books are wrong: a failure is logged, added to `internal_errors` (a counter its
/// owner's `check` requires to be 0) and asserted in debug builds; the value, if any.
pub(crate) fn checked<T>(
    internal_errors: &mut u64,
    what: &'static str,
    r: Result<T, RadixError>,
) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::error!(what, error = %e, "internal: release failed");
            *internal_errors += 1;
            debug_assert!(false, "internal: {what} failed: {e}");
            None
        }
    }
}

/// Gives a lock back. A refused handle (another cache's, or a stale one) cannot be given back
/// anywhere from here: the failure is counted and the handle dropped, and the cache's
/// `outstanding_locks` keeps showing whatever it still pins.
pub(crate) fn unlock<T: Tier>(cache: &mut RadixCache, stats: &mut Stats, lock: LockHandle<T>) {
    if let Err(refused) = cache.unlock(lock) {
        failed(stats, "unlock", refused.error);
    }
}

/// Moves a request's lock to `node`; on refusal the old lock is handed back, still held (the
/// request keeps its shorter pinned prefix and gives it back when it finishes), and the
/// failure is counted like any failed release.
pub(crate) fn relock<T: Tier>(
    cache: &mut RadixCache,
    stats: &mut Stats,
    lock: LockHandle<T>,
    node: kvtier_radix::NodeId,
) -> Result<LockHandle<T>, LockHandle<T>> {
    cache.relock(lock, node).map_err(|refused| {
        failed(stats, "relock", refused.error);
        refused.handle
    })
}

/// Frees pages the scheduler holds (no-op for an empty slice).
pub(crate) fn free<T: Tier>(cache: &mut RadixCache, stats: &mut Stats, pages: &[PageId<T>]) {
    if pages.is_empty() {
        return;
    }
    if let Err(e) = cache.free(pages) {
        failed(stats, "free", e);
    }
}
