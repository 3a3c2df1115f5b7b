//! Matching a prompt against the tree: [`RadixCache::match_prefix`] (marks the path used and
//! splits the last node so the result ends on node boundaries) and [`RadixCache::peek_prefix`]
//! (read-only, for routers and what-if queries).
//!
//! Why apart: matching runs for every request on every scheduling pass, so its cost is the
//! point: one map lookup per branch point ([`RadixCache::child_at`]) and one binary search
//! per run of pages (`common_prefix`), never a page-by-page walk. Inserting walks the tree
//! the same way and uses the same two helpers.

use crate::hash::PageHash;

use crate::node::NodeId;
use crate::tier::TierKind;

use super::{PrefixMatch, RadixCache};

impl RadixCache {
    /// Finds the longest cached prefix of a prompt given its page hashes, on each tier.
    ///
    /// Marks the matched nodes as used (LRU); splits the last node if
    /// the prompt diverges inside it, so the returned nodes end exactly at the matched depths.
    pub fn match_prefix(&mut self, hashes: &[PageHash]) -> PrefixMatch {
        self.tick += 1;
        let mut m = PrefixMatch {
            matched_pages: 0,
            device_pages: 0,
            device_node: self.root,
            host_pages: 0,
            host_node: self.root,
        };
        let query = hashes.last().map(|h| (hashes.len(), *h));
        let repeated = query.is_some() && query == self.last_query;
        self.last_query = query;
        let mut node = self.root;
        let mut depth = 0usize;
        while depth < hashes.len() {
            let Some(child) = self.child_at(node, depth, &hashes[depth]) else {
                break;
            };
            let c = &self.nodes[child];
            let n = common_prefix(&c.hashes, &hashes[depth..]);
            let full = n == c.len();
            let child = if full { child } else { self.split(child, n) };
            let c = &mut self.nodes[child];
            if !repeated {
                c.uses = c.uses.saturating_add(1);
            }
            let (has_dev, has_host) = (c.has(TierKind::Device), c.has(TierKind::Host));
            self.touch(child);
            depth += n;
            if has_dev {
                m.device_pages = depth;
                m.device_node = child;
            }
            if has_host {
                m.host_pages = depth;
                m.host_node = child;
            }
            node = child;
            if !full {
                break;
            }
        }
        m.matched_pages = depth;
        if !repeated
            && let Some(next) = hashes.get(depth)
            && let Some(a) = self.adaptive.as_mut()
            && a.on_miss(next, self.traffic)
        {
            self.rerank();
        }
        m
    }

    /// Read-only match: `(device_pages, host_pages)` matched, without touching LRU or
    /// splitting. For routers and what-if queries.
    pub fn peek_prefix(&self, hashes: &[PageHash]) -> (usize, usize) {
        let (mut dev, mut host) = (0, 0);
        for (c, depth, _) in self.peek_walk(hashes) {
            if self.nodes[c].has(TierKind::Device) {
                dev = depth;
            }
            if self.nodes[c].has(TierKind::Host) {
                host = depth;
            }
        }
        (dev, host)
    }

    /// Read-only: the deepest node whose whole path is a prefix of `hashes`, and its end
    /// depth (the root and 0 when there is none), without touching LRU or splitting. For a
    /// planner that kept a chain (a failed backup's) and needs its node again.
    pub fn peek_node(&self, hashes: &[PageHash]) -> (NodeId, usize) {
        self.peek_walk(hashes)
            .take_while(|&(_, _, whole)| whole)
            .last()
            .map_or((self.root, 0), |(node, depth, _)| (node, depth))
    }

    /// The nodes a read-only match of `hashes` walks through, shallowest first: each with
    /// the depth matched at its end and whether all of it matched (the last one may not).
    fn peek_walk<'a>(
        &'a self,
        hashes: &'a [PageHash],
    ) -> impl Iterator<Item = (NodeId, usize, bool)> + 'a {
        let (mut node, mut depth, mut stop) = (self.root, 0usize, false);
        std::iter::from_fn(move || {
            if stop || depth >= hashes.len() {
                return None;
            }
            let child = self.child_at(node, depth, &hashes[depth])?;
            let c = &self.nodes[child];
            let n = common_prefix(&c.hashes, &hashes[depth..]);
            depth += n;
            stop = n < c.len();
            node = child;
            Some((child, depth, !stop))
        })
    }

    /// The child of `parent` starting at `depth` with first page hash `h`, if any. A map hit
    /// whose node sits elsewhere (only possible with hashes that are not a chain) is no child.
    pub(super) fn child_at(&self, parent: NodeId, depth: usize, h: &PageHash) -> Option<NodeId> {
        let &id = self.index.get(h)?;
        let c = self.nodes.get(id)?;
        (c.parent == Some(parent) && c.start as usize == depth).then_some(id)
    }
}

/// Length of the common prefix of two runs of chained page hashes that start at the same
/// depth below the same parent.
///
/// Because each hash covers its whole prefix, equality is monotone along a run: if page `i`
/// matches, every page before it does. So the last page decides a full match in one
/// comparison, and a divergence is found by binary search — O(log n) 32-byte comparisons and
/// cache lines touched instead of O(n). (Hashes that are not a chain break this precondition
/// of the public API; they cannot describe cached KV anyway.)
pub(super) fn common_prefix(a: &[PageHash], b: &[PageHash]) -> usize {
    let n = a.len().min(b.len());
    if n == 0 || a[0] != b[0] {
        return 0;
    }
    if a[n - 1] == b[n - 1] {
        return n;
    }
    // a[..lo] == b[..lo] (lo ≥ 1) and a[hi] != b[hi].
    let (mut lo, mut hi) = (1, n - 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if a[mid] == b[mid] {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}
