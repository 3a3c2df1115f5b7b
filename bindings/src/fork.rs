//! Objects a forked child inherits from its parent.
//!
//! Why: `os.fork()` (an engine forking its workers, `multiprocessing`'s fork start method)
//! copies the process's memory but only the forking thread. A store's locks may be held at
//! the fork by another thread of the parent, which the child does not have (the child's
//! first call on it waited for ever), and the store's own threads (sweeper, clock, accept
//! loops, segment pingers) are absent: dropping the child's copy joined them, a Rust panic
//! ("threads should not terminate unexpectedly") at the child's exit or in `close()`. So a
//! handle records the process that made it; in another process its calls are refused with
//! `UnavailableInMode` (-1011, as a server client's already were) and dropping or closing
//! it leaks the copy instead of tearing it down (the child's memory goes at its exit; the
//! parent's store is not the child's to close). The child opens or connects its own.

use kvtier_l3::{L3Error, L3Result};

/// The process that made an object.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Owner(u32);

impl Owner {
    /// This process.
    pub(crate) fn here() -> Self {
        Owner(std::process::id())
    }

    /// Whether this is the process that made the object (false in a child forked after).
    pub(crate) fn is_here(self) -> bool {
        self.0 == std::process::id()
    }

    /// Ok in the process that made the object, `UnavailableInMode` in a child forked after.
    pub(crate) fn check(self, what: &str) -> L3Result<()> {
        if self.is_here() {
            return Ok(());
        }
        Err(L3Error::UnavailableInMode(format!(
            "this {what} was made by process {} and this is process {} (forked after): a \
             child opens or connects its own",
            self.0,
            std::process::id()
        )))
    }
}
