//! Inserting a prompt's pages on one tier: [`RadixCache::insert`], [`RadixCache::insert_for`]
//! and [`RadixCache::insert_labelled`].
//!
//! Why validate first: an insert touches many things at once (splits, a new leaf, page states
//! in the pool, tenant books, router events). Failing halfway would break the ownership and
//! residency invariants, so every check (offset, residency of `start`, lengths, continuation
//! of the hash chain, pages held by the caller, the chain along the path) runs on a read-only
//! walk, and the mutating walk that follows cannot fail.

use std::sync::Arc;

use smallvec::SmallVec;

use crate::error::RadixError;
use crate::events::ScopeLabel;
use crate::hash::PageHash;
use crate::node::{Node, NodeId, TierSlot};
use crate::pool::PageState;
use crate::tenant::TenantId;
use crate::tier::{PageId, Tier};

use super::matching::common_prefix;
use super::{InsertOutcome, InsertOwner, RadixCache, Recency};

impl RadixCache {
    /// Inserts a copy on tier `T` of pages `from_page .. from_page + pages.len()` of a prompt.
    ///
    /// `start` must be a node ending at depth `from_page` that has a copy on `T` (or the root),
    /// and `hashes`/`tokens` are the whole prompt's page hashes and token ids. Along the path,
    /// nodes that lack a copy on `T` receive the caller's pages; nodes that already have one
    /// report the caller's page as a duplicate. New pages past the path become a new leaf.
    ///
    /// Errors (nothing changed): unknown `start`; `start` not ending at `from_page`
    /// ([`RadixError::OffsetMismatch`]); `start` not holding a copy on `T`; `hashes[from_page-1]`
    /// not being `start`'s last hash ([`RadixError::NotAContinuation`]: the pages were computed
    /// against another prefix); too few hashes or tokens; pages not held by the caller.
    pub fn insert<T: Tier>(
        &mut self,
        start: NodeId,
        from_page: usize,
        hashes: &[PageHash],
        tokens: &[u32],
        pages: &[PageId<T>],
    ) -> Result<InsertOutcome<T>, RadixError> {
        self.insert_owner = TenantId::SHARED;
        self.insert_impl(start, from_page, hashes, tokens, pages, None)
    }

    /// [`Self::insert`] on behalf of `tenant`, who owns the nodes it creates (see
    /// [`crate::tenant`]).
    pub fn insert_for<T: Tier>(
        &mut self,
        tenant: TenantId,
        start: NodeId,
        from_page: usize,
        hashes: &[PageHash],
        tokens: &[u32],
        pages: &[PageId<T>],
    ) -> Result<InsertOutcome<T>, RadixError> {
        self.insert_owner = tenant;
        self.insert_impl(start, from_page, hashes, tokens, pages, None)
    }

    /// [`Self::insert`] for a scoped request: `owner.tenant` owns the nodes it creates (see
    /// [`crate::tenant`]); a new leaf directly below the root records `owner.label` (deeper
    /// leaves inherit their parent's), and KV events carry it.
    pub fn insert_labelled<T: Tier>(
        &mut self,
        start: NodeId,
        from_page: usize,
        hashes: &[PageHash],
        tokens: &[u32],
        pages: &[PageId<T>],
        owner: InsertOwner<'_>,
    ) -> Result<InsertOutcome<T>, RadixError> {
        self.insert_owner = owner.tenant;
        self.insert_impl(start, from_page, hashes, tokens, pages, owner.label)
    }

    /// The insert itself; the owner of new nodes is `self.insert_owner`.
    fn insert_impl<T: Tier>(
        &mut self,
        start: NodeId,
        from_page: usize,
        hashes: &[PageHash],
        tokens: &[u32],
        pages: &[PageId<T>],
        label: Option<&Arc<ScopeLabel>>,
    ) -> Result<InsertOutcome<T>, RadixError> {
        let t = T::KIND;
        let end = from_page + pages.len();
        let s = self.node(start)?;
        if s.end() != from_page {
            return Err(RadixError::OffsetMismatch {
                expected: s.end(),
                got: from_page,
            });
        }
        if !s.has(t) {
            return Err(RadixError::NotResident { tier: t });
        }
        if hashes.len() < end {
            return Err(RadixError::LengthMismatch {
                what: "page hashes",
                expected: end,
                got: hashes.len(),
            });
        }
        if tokens.len() < end * self.page_size {
            return Err(RadixError::LengthMismatch {
                what: "tokens",
                expected: end * self.page_size,
                got: tokens.len(),
            });
        }
        if from_page > 0 && s.hashes.last() != Some(&hashes[from_page - 1]) {
            return Err(RadixError::NotAContinuation {
                page: from_page - 1,
            });
        }
        let raw: Vec<u32> = pages.iter().map(|p| p.index()).collect();
        self.pool(t).check(&raw, PageState::Held)?;
        self.validate_path(start, from_page, &hashes[..end])?;

        // Validated: from here on nothing fails.
        self.tick += 1;
        let mut out = InsertOutcome {
            end_node: start,
            inserted: 0,
            duplicates: Vec::new(),
        };
        let mut node = start;
        let mut depth = from_page;
        while depth < end {
            let Some(child) = self.child_at(node, depth, &hashes[depth]) else {
                // New pages past the path: one leaf, or a chain of leaves cut where the
                // remembered uses of the pages change (`memory.rs`).
                let mut at = depth;
                for (len, uses) in self.recalled_runs(&hashes[depth..end]) {
                    let ps = self.page_size;
                    let leaf = self.new_leaf(
                        node,
                        at,
                        &hashes[at..at + len],
                        &tokens[at * ps..(at + len) * ps],
                        label,
                    );
                    self.nodes[leaf].uses = uses;
                    let from = at - from_page;
                    self.give_pages(leaf, t, &raw[from..from + len], Recency::Touch);
                    node = leaf;
                    at += len;
                }
                out.inserted += end - depth;
                break;
            };
            let n = common_prefix(&self.nodes[child].hashes, &hashes[depth..end]);
            let child = if n < self.nodes[child].len() {
                self.split(child, n)
            } else {
                child
            };
            let mine = &raw[depth - from_page..depth - from_page + n];
            if let Some(theirs) = &self.nodes[child].slot(t).pages {
                out.duplicates.extend(
                    mine.iter()
                        .zip(theirs.iter())
                        .enumerate()
                        .map(|(i, (&a, &b))| (depth + i, PageId::new(a), PageId::new(b))),
                );
            } else {
                self.give_pages(child, t, mine, Recency::Touch);
                out.inserted += n;
            }
            self.touch(child);
            node = child;
            depth += n;
        }
        out.end_node = node;
        Ok(out)
    }

    /// Read-only walk of the path an insert would take, rejecting inconsistent hash chains
    /// before anything is mutated.
    fn validate_path(
        &self,
        start: NodeId,
        from_page: usize,
        hashes: &[PageHash],
    ) -> Result<(), RadixError> {
        let mut node = start;
        let mut depth = from_page;
        while depth < hashes.len() {
            match self.child_at(node, depth, &hashes[depth]) {
                Some(child) => {
                    let c = &self.nodes[child];
                    let n = common_prefix(&c.hashes, &hashes[depth..]);
                    depth += n;
                    node = child;
                    if n < c.len() {
                        // The rest becomes a new leaf under the split point.
                        break;
                    }
                }
                None => break,
            }
        }
        if depth < hashes.len() && self.index.contains_key(&hashes[depth]) {
            return Err(RadixError::NotAContinuation { page: depth });
        }
        Ok(())
    }

    /// The runs of `hashes` (lengths, in order) that become one leaf each, with the uses each
    /// starts with: the whole run with none, unless the use memory recalls some of its pages
    /// (each recalled page is forgotten: it is in the tree again).
    fn recalled_runs(&mut self, hashes: &[PageHash]) -> SmallVec<[(usize, u32); 2]> {
        let Some(m) = self.memory.as_mut() else {
            return smallvec::smallvec![(hashes.len(), 0)];
        };
        let mut runs: SmallVec<[(usize, Option<u32>); 2]> = SmallVec::new();
        for h in hashes {
            let u = m.recall(h);
            match runs.last_mut() {
                Some((n, v)) if *v == u => *n += 1,
                _ => runs.push((1, u)),
            }
        }
        runs.into_iter()
            .map(|(n, u)| (n, u.map_or(0, |u| u.saturating_add(1))))
            .collect()
    }

    /// Creates a leaf under `parent` (without pages: the caller gives them).
    fn new_leaf(
        &mut self,
        parent: NodeId,
        start: usize,
        hashes: &[PageHash],
        tokens: &[u32],
        label: Option<&Arc<ScopeLabel>>,
    ) -> NodeId {
        let label = if parent == self.root {
            label.cloned()
        } else {
            self.nodes[parent].label.clone()
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let leaf = self.nodes.insert(Node {
            parent: Some(parent),
            start: start as u32,
            hashes: hashes.iter().copied().collect(),
            tokens: tokens.to_vec(),
            children: 0,
            device: TierSlot::default(),
            host: TierSlot::default(),
            in_l3: false,
            last_access: self.tick,
            hit_count: 0,
            uses: 0,
            last_use: self.traffic,
            tenant: self.insert_owner,
            seq,
            label,
        });
        self.index.insert(hashes[0], leaf);
        self.nodes[parent].children += 1;
        leaf
    }
}
