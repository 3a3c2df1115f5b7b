//! Read-only (and splitting) queries about nodes: depths, residency, the page ids along a
//! path, L3 flags.
//!
//! Why apart from `cache/`: the scheduler walks paths and asks about residency on every
//! admission, write-back and backup; these are the tree's public read API, separate from
//! matching, inserting and the bookkeeping that keeps the invariants.

use crate::cache::RadixCache;
use crate::error::RadixError;
use crate::hash::PageHash;
use crate::node::NodeId;
use crate::tier::{PageId, Tier, TierKind};

impl RadixCache {
    /// End depth (in pages) of a node.
    pub fn node_end(&self, id: NodeId) -> Result<usize, RadixError> {
        Ok(self.node(id)?.end())
    }

    /// Whether a node has a copy on tier `t` (the root always does).
    pub fn is_resident(&self, id: NodeId, t: TierKind) -> Result<bool, RadixError> {
        Ok(self.node(id)?.has(t))
    }

    /// The tier-`T` page ids of the whole path root → `id` (pages `0..node_end(id)`).
    pub fn path_pages<T: Tier>(&self, id: NodeId) -> Result<Vec<PageId<T>>, RadixError> {
        let n = self.node(id)?;
        let mut out = vec![PageId::new(0); n.end()];
        let mut cur = Some(id);
        while let Some(c) = cur {
            let node = &self.nodes[c];
            let Some(pages) = &node.slot(T::KIND).pages else {
                return Err(RadixError::NotResident { tier: T::KIND });
            };
            let s = node.start as usize;
            for (o, p) in out[s..s + pages.len()].iter_mut().zip(pages.iter()) {
                *o = PageId::new(*p);
            }
            cur = node.parent;
        }
        Ok(out)
    }

    /// Tier-`T` page ids of depths `from..node_end(id)` along the path to `id`.
    pub fn path_pages_from<T: Tier>(
        &self,
        id: NodeId,
        from: usize,
    ) -> Result<Vec<PageId<T>>, RadixError> {
        let n = self.node(id)?;
        if from > n.end() {
            return Err(RadixError::OffsetMismatch {
                expected: n.end(),
                got: from,
            });
        }
        let mut out = vec![PageId::new(0); n.end() - from];
        let mut cur = Some(id);
        while let Some(c) = cur {
            let node = &self.nodes[c];
            if node.end() <= from {
                break;
            }
            let Some(pages) = &node.slot(T::KIND).pages else {
                return Err(RadixError::NotResident { tier: T::KIND });
            };
            // This node covers depths `s .. node.end()`, of which `from ..` are wanted.
            let s = node.start as usize;
            let skip = from.saturating_sub(s);
            for (o, p) in out[s + skip - from..node.end() - from]
                .iter_mut()
                .zip(&pages[skip..])
            {
                *o = PageId::new(*p);
            }
            cur = node.parent;
        }
        Ok(out)
    }

    /// The ancestor-or-self of `id` whose end depth is exactly `depth`, splitting a node if
    /// `depth` falls inside it. Errors if `depth > node_end(id)`.
    pub fn node_at_depth(&mut self, id: NodeId, depth: usize) -> Result<NodeId, RadixError> {
        let end = self.node(id)?.end();
        if depth > end {
            return Err(RadixError::OffsetMismatch {
                expected: end,
                got: depth,
            });
        }
        let mut cur = id;
        loop {
            let n = &self.nodes[cur];
            if n.end() == depth {
                return Ok(cur);
            }
            if (n.start as usize) < depth {
                let k = depth - n.start as usize;
                return Ok(self.split(cur, k));
            }
            match n.parent {
                Some(p) => cur = p,
                None => return Ok(cur),
            }
        }
    }

    /// Whether the node is known to be stored in L3.
    pub fn in_l3(&self, id: NodeId) -> Result<bool, RadixError> {
        Ok(self.node(id)?.in_l3)
    }

    /// Records that a node's pages are (or are no longer) stored in L3.
    pub fn set_in_l3(&mut self, id: NodeId, stored: bool) -> Result<(), RadixError> {
        if id == self.root {
            return Ok(());
        }
        self.nodes.get_mut(id).ok_or(RadixError::UnknownNode)?.in_l3 = stored;
        Ok(())
    }

    /// L3 lost the pages `lost` (the store evicted or removed them, or a node holding them
    /// died): every node holding one of them, and every descendant of such a node, is no
    /// longer known to be in L3 (a page is only reachable in L3 through its whole prefix, as
    /// probes and prefetches read leading runs). Returns the number of nodes cleared.
    ///
    /// One pass over the nodes plus a walk up from each flagged node: it runs when the store
    /// reports losses (batched by the engine), not per request.
    pub fn forget_l3(&mut self, lost: &std::collections::HashSet<PageHash>) -> usize {
        if lost.is_empty() {
            return 0;
        }
        let hit: std::collections::HashSet<NodeId> = self
            .nodes
            .iter()
            .filter(|(id, n)| {
                *id != self.root && n.in_l3 && n.hashes.iter().any(|h| lost.contains(h))
            })
            .map(|(id, _)| id)
            .collect();
        if hit.is_empty() {
            return 0;
        }
        let mut clear = Vec::new();
        for (id, n) in &self.nodes {
            if id == self.root || !n.in_l3 {
                continue;
            }
            let mut cur = Some(id);
            while let Some(c) = cur {
                if hit.contains(&c) {
                    clear.push(id);
                    break;
                }
                cur = self.nodes[c].parent;
            }
        }
        for id in &clear {
            self.nodes[*id].in_l3 = false;
        }
        clear.len()
    }

    /// Every node is no longer known to be in L3 (the engine lost track of what L3 holds).
    /// Returns the number of nodes cleared.
    pub fn forget_l3_all(&mut self) -> usize {
        let mut n = 0;
        for (_, node) in self.nodes.iter_mut() {
            n += usize::from(std::mem::take(&mut node.in_l3));
        }
        n
    }

    /// The page hashes of a node's run (pages `start .. end` of its prefix).
    pub fn node_hashes(&self, id: NodeId) -> Result<&[PageHash], RadixError> {
        Ok(&self.node(id)?.hashes)
    }

    /// Records that one request reused the prefix ending at `node` (every node on its path
    /// counts one more reuse). Called once per request, not per match attempt: a request that
    /// probes, prefetches and is admitted, or waits blocked for many steps, matches many times
    /// but reuses the prefix once.
    pub fn record_reuse(&mut self, node: NodeId) -> Result<(), RadixError> {
        self.node(node)?;
        let mut cur = node;
        while cur != self.root {
            let n = &mut self.nodes[cur];
            n.hit_count = n.hit_count.saturating_add(1);
            match n.parent {
                Some(p) => cur = p,
                None => break,
            }
        }
        Ok(())
    }

    /// How many requests reused this node's pages (see [`Self::record_reuse`]).
    /// How many requests reused this node's pages (see [`Self::record_reuse`]).
    pub fn hit_count(&self, id: NodeId) -> Result<u32, RadixError> {
        Ok(self.node(id)?.hit_count)
    }

    /// The nodes on the path root → `id` (root excluded), shallowest first, with their depth
    /// ranges: `(node, start, end)`.
    pub fn path_nodes(&self, id: NodeId) -> Result<Vec<(NodeId, usize, usize)>, RadixError> {
        self.node(id)?;
        let mut out = Vec::new();
        let mut cur = id;
        while cur != self.root {
            let n = &self.nodes[cur];
            out.push((cur, n.start as usize, n.end()));
            match n.parent {
                Some(p) => cur = p,
                None => break,
            }
        }
        out.reverse();
        Ok(out)
    }
}
