//! Use memory: how often pages that left the cache had been used, so that a page computed
//! again is not ranked as if it had never been seen.
//!
//! Why: on the public conversation trace 76 % of the blocks a prompt brings are never read
//! again, and a block's chance of another read grows with the reads it has had. A frequency
//! signal that lives only on cached nodes forgets a page the moment it is evicted: a page
//! read again after its eviction (the common case at small capacities, where reuse distances
//! exceed the cache) comes back with no uses, ranked like a one-off tail. Remembering the
//! uses of removed pages for a few capacities of evictions (metadata only, as TinyLFU's
//! frequency history or ARC's ghost lists) lets the re-read count as what it is: a second use.
//!
//! How: when a node leaves the tree (no copy on any tier) each of its page hashes is
//! remembered with the node's uses; when an insert creates a leaf, the pages it covers are
//! recalled (and forgotten) and the leaf is cut where the recalled value changes, each part
//! starting with the recalled uses plus one (the miss that brought the page back is a use).
//! Bounded: at most [`USE_MEMORY_CAPACITIES`] times the cache's device + host pages are
//! remembered, the oldest forgotten first, each by the first 8 bytes of its hash (a collision
//! only misranks a page; about 45 bytes a remembered page: a map entry and a queue entry);
//! deterministic (driven only by the cache's operations, in their order), so tensor-parallel
//! ranks agree.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use crate::cache::PrefixHasher;
use crate::hash::PageHash;

/// Pages remembered, in capacities of the cache (device + host pages). Measured on the
/// conversation trace (docs/sim/shadow.md, "Round 8"): 1 capacity keeps most re-reads
/// from looking new only at large caches, 5 gains 0.3–1.7 points more at small ones, 10 no
/// more than 5.
pub const USE_MEMORY_CAPACITIES: usize = 5;

/// Remembered uses of pages that left the cache (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct UseMemory {
    capacity: usize,
    stamp: u64,
    /// Remembered pages, oldest first, with the stamp they were remembered at (an entry whose
    /// stamp differs from the map's is stale: the page was remembered again later or recalled).
    order: VecDeque<(u64, u64)>,
    /// Page key → (uses, stamp).
    uses: HashMap<u64, (u32, u64), BuildHasherDefault<PrefixHasher>>,
}

impl UseMemory {
    pub(crate) fn new(capacity: usize) -> Self {
        UseMemory {
            capacity,
            stamp: 0,
            order: VecDeque::new(),
            uses: HashMap::default(),
        }
    }

    /// Remembers that each of `hashes` had been used `uses` times when it left the cache.
    pub(crate) fn remember(&mut self, hashes: &[PageHash], uses: u32) {
        if self.capacity == 0 {
            return;
        }
        for h in hashes {
            self.stamp += 1;
            let k = h.prefix_u64();
            self.uses.insert(k, (uses, self.stamp));
            self.order.push_back((self.stamp, k));
        }
        while self.order.len() > self.capacity {
            if let Some((stamp, k)) = self.order.pop_front()
                && self.uses.get(&k).is_some_and(|&(_, s)| s == stamp)
            {
                self.uses.remove(&k);
            }
        }
    }

    /// The uses `h` had when it left the cache, if remembered; forgets it.
    pub(crate) fn recall(&mut self, h: &PageHash) -> Option<u32> {
        self.uses.remove(&h.prefix_u64()).map(|(u, _)| u)
    }

    /// Pages remembered now, and the most that may be.
    pub(crate) fn usage(&self) -> (usize, usize) {
        (self.uses.len(), self.capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn page(i: u8) -> PageHash {
        PageHash([i; 32])
    }

    #[derive(Clone, Debug)]
    enum Op {
        Remember(Vec<u8>, u32),
        Recall(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (prop::collection::vec(0u8..12, 0..5), 0u32..4).prop_map(|(p, u)| Op::Remember(p, u)),
            (0u8..12).prop_map(Op::Recall),
        ]
    }

    proptest! {
        /// Against a model that keeps every remembered page event: a page is recalled with the
        /// uses of its latest remembering iff that is among the last `capacity` page events
        /// and it was not recalled since; nothing more than `capacity` pages is ever kept.
        #[test]
        fn recalls_exactly_the_latest_remembered_within_capacity(
            cap in 0usize..8, ops in prop::collection::vec(op(), 0..60)
        ) {
            let mut m = UseMemory::new(cap);
            // (page, uses, recalled since) per page event, oldest first.
            let mut events: Vec<(u8, u32, bool)> = Vec::new();
            for o in ops {
                match o {
                    Op::Remember(pages, u) => {
                        m.remember(&pages.iter().map(|&p| page(p)).collect::<Vec<_>>(), u);
                        if cap > 0 {
                            events.extend(pages.iter().map(|&p| (p, u, false)));
                        }
                    }
                    Op::Recall(p) => {
                        let window = events.len().saturating_sub(cap);
                        let latest = events.iter().rposition(|e| e.0 == p);
                        let want = latest
                            .filter(|&i| i >= window && !events[i].2)
                            .map(|i| events[i].1);
                        prop_assert_eq!(m.recall(&page(p)), want);
                        if let Some(i) = latest {
                            events[i].2 = true;
                        }
                    }
                }
                prop_assert!(m.usage().0 <= cap);
            }
        }
    }
}
