//! A full consistency check of the cache, for tests and debugging.
//!
//! Why: the cache keeps several derived counters (lock counts, resident-children counts,
//! locked-page totals, evictable sets, the hash index) so that hot paths are O(1) or O(log n).
//! Each is a chance to drift. [`RadixCache::check_invariants`] recomputes every one of them
//! from first principles and compares; property tests call it after every operation.

use std::collections::{BTreeSet, HashMap};

use crate::cache::RadixCache;
use crate::node::NodeId;
use crate::pool::PageState;
use crate::tier::TierKind;

impl RadixCache {
    /// Recomputes every derived structure and returns the first discrepancy found.
    pub fn check_invariants(&self) -> Result<(), String> {
        let tiers = [TierKind::Device, TierKind::Host];
        if let Some(m) = &self.memory
            && m.usage().0 > m.usage().1
        {
            return Err(format!("use memory holds {:?} (pages, most)", m.usage()));
        }
        // Children counts and resident-children counts.
        let mut children: HashMap<NodeId, u32> = HashMap::new();
        let mut res_children: HashMap<(NodeId, TierKind), u32> = HashMap::new();
        for (id, n) in &self.nodes {
            if id == self.root {
                if n.parent.is_some() {
                    return Err("root has a parent".into());
                }
                continue;
            }
            let Some(p) = n.parent else {
                return Err(format!("non-root node {id:?} has no parent"));
            };
            let Some(pn) = self.nodes.get(p) else {
                return Err(format!("node {id:?} has a dangling parent"));
            };
            if pn.end() != n.start as usize {
                return Err(format!(
                    "node {id:?} starts at {} but parent ends at {}",
                    n.start,
                    pn.end()
                ));
            }
            if n.hashes.is_empty() || n.tokens.len() != n.hashes.len() * self.page_size {
                return Err(format!("node {id:?} has an inconsistent run"));
            }
            if !n.has_any_copy() {
                return Err(format!("node {id:?} has no copy on any tier"));
            }
            if self.index.get(&n.hashes[0]) != Some(&id) {
                return Err(format!("index does not map node {id:?}'s first hash to it"));
            }
            *children.entry(p).or_default() += 1;
            for t in tiers {
                if n.has(t) {
                    if !pn.has(t) {
                        return Err(format!("{t} residency not prefix-closed at {id:?}"));
                    }
                    *res_children.entry((p, t)).or_default() += 1;
                }
                if let Some(pages) = &n.slot(t).pages
                    && pages.len() != n.len()
                {
                    return Err(format!("node {id:?} {t} page count != run length"));
                }
            }
        }
        if self.index.len() + 1 != self.nodes.len() {
            return Err(format!(
                "index has {} entries for {} non-root nodes",
                self.index.len(),
                self.nodes.len() - 1
            ));
        }
        // Lock counts: each record adds one to its node and all ancestors.
        let mut locks: HashMap<(NodeId, TierKind), u32> = HashMap::new();
        for r in self.locks.values() {
            let mut cur = Some(r.node);
            while let Some(id) = cur {
                let Some(n) = self.nodes.get(id) else {
                    return Err("lock record on a removed node".into());
                };
                *locks.entry((id, r.tier)).or_default() += 1;
                cur = n.parent;
            }
        }
        for t in tiers {
            let mut seen_pages: BTreeSet<u32> = BTreeSet::new();
            let mut locked_pages = 0;
            let mut evictable = BTreeSet::new();
            for (id, n) in &self.nodes {
                let s = n.slot(t);
                if s.lock != locks.get(&(id, t)).copied().unwrap_or(0) {
                    return Err(format!("{t} lock count drifted at {id:?}"));
                }
                if s.resident_children != res_children.get(&(id, t)).copied().unwrap_or(0) {
                    return Err(format!("{t} resident_children drifted at {id:?}"));
                }
                if n.children != children.get(&id).copied().unwrap_or(0) {
                    return Err(format!("children count drifted at {id:?}"));
                }
                if s.lock > 0 && s.pages.is_none() && id != self.root {
                    return Err(format!("{t} lock on a node without a {t} copy"));
                }
                if let Some(pages) = &s.pages {
                    for &p in pages {
                        if !seen_pages.insert(p) {
                            return Err(format!("{t} page {p} owned twice"));
                        }
                        if self.pool(t).state(p) != Some(PageState::Cached) {
                            return Err(format!("{t} page {p} in tree but not Cached in pool"));
                        }
                    }
                    if s.lock > 0 {
                        locked_pages += pages.len();
                    }
                }
                let should =
                    id != self.root && s.pages.is_some() && s.lock == 0 && s.resident_children == 0;
                if should {
                    let key = (
                        self.protection_of(n.hashes.first()),
                        self.tier_rank(n, t),
                        n.seq,
                        id,
                    );
                    if s.evict_key != Some(key) {
                        return Err(format!("{t} evictable key of {id:?} stale or missing"));
                    }
                    evictable.insert(key);
                } else if s.evict_key.is_some() {
                    return Err(format!("{t} node {id:?} wrongly evictable"));
                }
            }
            if evictable != self.books[t as usize].evictable {
                return Err(format!("{t} evictable set drifted"));
            }
            if locked_pages != self.books[t as usize].locked_pages {
                return Err(format!("{t} locked page total drifted"));
            }
            if seen_pages.len() != self.pool(t).cached_count() {
                return Err(format!("{t} pool cached count != pages in tree"));
            }
            self.pool(t).audit()?;
        }
        self.check_adaptive()?;
        self.check_tenants()
    }

    /// The adaptive policy's state: ranking matches its level, ghosts within their bound.
    fn check_adaptive(&self) -> Result<(), String> {
        if let Some(s) = &self.shadow {
            if self.policy != crate::EvictionPolicy::Shadow || self.adaptive.is_some() {
                return Err("shadow selector under another policy".into());
            }
            if self.ranking != s.choice().eviction {
                return Err("ranking is not the shadow selector's choice".into());
            }
            return s.check();
        }
        match &self.adaptive {
            None if self.policy == crate::EvictionPolicy::Shadow => {
                Err("shadow policy without its selector".into())
            }
            None if self.ranking != self.policy => Err("fixed policy but ranking differs".into()),
            None => Ok(()),
            Some(a) => {
                if self.policy != crate::EvictionPolicy::Adaptive {
                    return Err("adaptive state under a fixed policy".into());
                }
                if self.ranking != a.ranking() {
                    return Err("ranking is not the adaptive level's".into());
                }
                a.check_bounds()
            }
        }
    }
}
