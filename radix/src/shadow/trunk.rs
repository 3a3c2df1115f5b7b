//! The hot shared prefix ("trunk") of each prompt, from the request stream alone: where the
//! sampled selector keys a request.
//!
//! Why: sampled shadows (SHARDS) replay a request only if its key page's hash falls in a
//! 1-in-R sample, and the key must be a page every turn of a conversation has, so that the
//! conversation is in or out whole (a page hit needs its ancestors). Keyed at a fixed depth, a
//! prompt whose shared system prompt (tools, few-shot examples) is longer than that depth is
//! keyed by the system prompt: all conversations under it are in or out together, the sample
//! is a handful of groups and the cost bound (1/R of the requests) fails — 9,926 of 20,000
//! requests replayed at R = 5 on 4 system prompts of 16 pages (docs/sim/shadow.md, "Cost").
//! Keyed at the first page past the prompt's hot shared prefix, the sample is per
//! conversation whatever the system prompts' lengths.
//!
//! How: a page is *hot* once `hot_fanout` distinct pages have followed it in the stream (a
//! system prompt's last page gets one per conversation; a conversation's page one, its next
//! turn's, unless it forks). A prompt's trunk is its pages up to and including its deepest hot
//! page among the first `depth`. Distinct successors are counted when a page is first seen
//! after its predecessor (a page not in the table: new, so a successor not counted yet).
//! Bounded: two generations of at most `cap` pages each; a prompt moves the pages it passes
//! through to the newer, and when the newer is full the older is dropped (a page unused for
//! two generations is forgotten, and counted again if it comes back: a rarely used prefix may
//! turn hot early, which only moves its prompts' key one page deeper). Depends on the stream
//! alone, so tensor-parallel ranks, which see the same submissions, key alike.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use crate::cache::PrefixHasher;
use crate::hash::PageHash;

type Table = HashMap<u64, u32, BuildHasherDefault<PrefixHasher>>;

/// The stream's hot pages (see the module docs).
pub(crate) struct Trunks {
    depth: usize,
    hot: u32,
    cap: usize,
    newer: Table,
    older: Table,
}

impl Trunks {
    /// Tracks the first `depth` pages of each prompt, hot at `hot` distinct successors, at
    /// most `cap` pages a generation (all at least 1).
    pub(crate) fn new(depth: usize, hot: u32, cap: usize) -> Trunks {
        Trunks {
            depth: depth.max(1),
            hot: hot.max(1),
            cap: cap.max(1),
            newer: Table::default(),
            older: Table::default(),
        }
    }

    /// Records one prompt (its page hashes); returns its trunk's length in pages (0: no hot
    /// page among its first `depth`).
    pub(crate) fn observe(&mut self, hashes: &[PageHash]) -> usize {
        let mut trunk = 0;
        for (i, h) in hashes.iter().take(self.depth).enumerate() {
            let key = h.prefix_u64();
            let seen = self.take(key);
            if seen.is_none() && i > 0 {
                // A new page: its predecessor (in the newer generation: put there just
                // before) has one more distinct successor.
                let prev = hashes[i - 1].prefix_u64();
                if let Some(c) = self.newer.get_mut(&prev) {
                    *c = (*c + 1).min(self.hot);
                    if *c >= self.hot {
                        trunk = i;
                    }
                }
            }
            let count = seen.unwrap_or(0);
            self.put(key, count);
            if count >= self.hot {
                trunk = i + 1;
            }
        }
        trunk
    }

    /// Pages tracked (both generations; at most `2 × cap`).
    pub(crate) fn len(&self) -> usize {
        self.newer.len() + self.older.len()
    }

    /// A page's count, taken out of the older generation if it is there.
    fn take(&mut self, key: u64) -> Option<u32> {
        match self.newer.get(&key) {
            Some(&c) => Some(c),
            None => self.older.remove(&key),
        }
    }

    fn put(&mut self, key: u64, count: u32) {
        if !self.newer.contains_key(&key) && self.newer.len() >= self.cap {
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(key, count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    /// Prompts as paths in a small tree of pages: each page id picks a child of the previous
    /// page among 4, so that prefixes are shared at every depth.
    fn prompts() -> impl Strategy<Value = Vec<Vec<u8>>> {
        proptest::collection::vec(proptest::collection::vec(0u8..4, 1..10), 1..120)
    }

    fn hashes(path: &[u8]) -> Vec<PageHash> {
        let toks: Vec<u32> = path.iter().map(|&b| u32::from(b)).collect();
        crate::hash::page_hashes(&toks, 1, None)
    }

    proptest! {
        /// With room for every page, the trunk is exactly: up to the deepest page among the
        /// first `depth` that at least `hot` distinct pages have followed in the prompts so
        /// far (this one included).
        #[test]
        fn the_trunk_ends_at_the_deepest_page_with_enough_successors(
            ps in prompts(), hot in 1u32..4, depth in 1usize..10,
        ) {
            let mut t = Trunks::new(depth, hot, 1 << 20);
            let mut succ: BTreeMap<PageHash, BTreeSet<PageHash>> = BTreeMap::new();
            for p in &ps {
                let hs = hashes(p);
                let n = hs.len().min(depth);
                for w in hs[..n].windows(2) {
                    succ.entry(w[0]).or_default().insert(w[1]);
                }
                let want = (0..n)
                    .rev()
                    .find(|&i| succ.get(&hs[i]).map_or(0, BTreeSet::len) >= hot as usize)
                    .map_or(0, |i| i + 1);
                prop_assert_eq!(t.observe(&hs), want);
            }
        }

        /// The table never holds more than two generations.
        #[test]
        fn the_table_is_bounded(ps in prompts(), cap in 1usize..16) {
            let mut t = Trunks::new(10, 2, cap);
            for p in &ps {
                t.observe(&hashes(p));
                prop_assert!(t.len() <= 2 * cap, "{} pages kept, cap {}", t.len(), cap);
            }
        }
    }
}
