//! The waiting queue, and the protection of its prompts' prefixes.
//!
//! Every entry to and exit from `Scheduler::waiting` goes through [`Scheduler::enqueue`] and
//! [`Scheduler::dequeue`], so that under [`QueueProtection::Waiting`] a request's prompt is
//! protected in the cache exactly while it waits (`kvtier_radix`'s `protect.rs`): from
//! submission (or retraction) to admission, cancellation or abort. The hashes protected are
//! kept beside the queue, so the protection taken back is the one given even if the request
//! changes meanwhile.
//!
//! Invariant (checked by `check.rs`): `protected_for` has an entry exactly for each waiting
//! request when protection is on, and none when it is off.

use kvtier_radix::PageHash;

use crate::config::QueueProtection;
use crate::scheduler::Scheduler;
use crate::types::RequestId;

impl Scheduler {
    /// Puts `id` (arrival `seq`) in the waiting queue.
    pub(crate) fn enqueue(&mut self, seq: u64, id: RequestId) {
        if self.waiting.insert(seq, id).is_some() {
            return;
        }
        if self.cfg.queue_protection == QueueProtection::Waiting
            && let Some(r) = self.reqs.get(&id)
        {
            let hashes: Vec<PageHash> = r.hashes.clone();
            self.cache.protect(&hashes);
            self.protected_for.insert(id, hashes);
        }
    }

    /// Takes the request of arrival `seq` out of the waiting queue (nothing if it is not there).
    pub(crate) fn dequeue(&mut self, seq: u64) {
        let Some(id) = self.waiting.remove(&seq) else {
            return;
        };
        if let Some(hashes) = self.protected_for.remove(&id)
            && let Err(e) = self.cache.unprotect(&hashes)
        {
            // Every protection here was given by `enqueue` with these hashes.
            debug_assert!(false, "queue protection of {id:?} not found: {e}");
        }
    }
}
