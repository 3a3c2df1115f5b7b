//! Copies of nodes that already exist: a demotion writes a device-resident path to host.
//!
//! Why a call of its own: [`RadixCache::insert`] needs the prompt's hashes and tokens, which a
//! request has but a demotion (the scheduler writing the coldest device leaves to host before
//! device evicts them) does not — the nodes are already in the tree, only a copy on another
//! tier is new. Prefix closure is kept because copies are added from the shallowest node down,
//! below a node that already has one (or the root).

use crate::cache::{RadixCache, Recency};
use crate::error::RadixError;
use crate::node::NodeId;
use crate::pool::PageState;
use crate::tenant::TenantId;
use crate::tier::{PageId, Tier, TierKind};

impl RadixCache {
    /// Gives tier-`T` copies to the nodes on the path to `end` that start at depth `from` or
    /// deeper; `pages[i]` holds page `from + i`, and `from + pages.len()` must be `end`'s end.
    /// Nodes that gained a copy on `T` meanwhile keep theirs: the caller's pages for them are
    /// returned, still held, for the caller to free. A copy is not a use: the nodes keep their
    /// place in every tier's eviction order (a demoted leaf stays device's coldest).
    ///
    /// Errors (nothing changed): unknown `end`; `from` not a node boundary on the path
    /// ([`RadixError::OffsetMismatch`]); a wrong number of pages
    /// ([`RadixError::LengthMismatch`]); the node above depth `from` without a copy on `T`
    /// ([`RadixError::NotResident`]); pages not held by the caller.
    pub fn add_copies<T: Tier>(
        &mut self,
        end: NodeId,
        from: usize,
        pages: &[PageId<T>],
    ) -> Result<Vec<PageId<T>>, RadixError> {
        let t = T::KIND;
        let path = self.path_nodes(end)?;
        let end_depth = self.node(end)?.end();
        if from + pages.len() != end_depth {
            return Err(RadixError::LengthMismatch {
                what: "pages",
                expected: end_depth.saturating_sub(from),
                got: pages.len(),
            });
        }
        let first = path.iter().position(|&(_, s, _)| s >= from);
        let first = match first {
            Some(i) if path[i].1 == from => i,
            None if from == end_depth => return Ok(Vec::new()),
            _ => {
                return Err(RadixError::OffsetMismatch {
                    expected: path
                        .iter()
                        .map(|p| p.1)
                        .find(|&s| s >= from)
                        .unwrap_or(end_depth),
                    got: from,
                });
            }
        };
        if first > 0 && !self.node(path[first - 1].0)?.has(t) {
            return Err(RadixError::NotResident { tier: t });
        }
        let raw: Vec<u32> = pages.iter().map(|p| p.index()).collect();
        self.pool(t).check(&raw, PageState::Held)?;

        // Validated: from here on nothing fails.
        let mut unused = Vec::new();
        for &(node, s, e) in &path[first..] {
            let mine = &raw[s - from..e - from];
            if self.nodes[node].has(t) {
                unused.extend(mine.iter().map(|&p| PageId::new(p)));
            } else {
                self.give_pages(node, t, mine, Recency::Keep);
            }
        }
        Ok(unused)
    }

    /// `n` pages on tier `T` for a copy of `node`, which lives on tier `from`: free pages first,
    /// then evicting `T`'s leaves that rank below `node`'s rank on `from` (colder than the
    /// page being copied, as an exclusive cache would drop them first). Fails without evicting
    /// anything ([`RadixError::PoolExhausted`]) if that does not give `n` pages: copying a page
    /// colder than everything on `T` would only push out a warmer one (and, for a demotion,
    /// make the two take turns forever). Leaves of other capped tenants within their caps are
    /// spared (see [`crate::tenant`]); the pages count against the node owner's cap until
    /// given to the tree, but the cap itself is the caller's to check.
    pub fn alloc_for_copy<T: Tier>(
        &mut self,
        node: NodeId,
        from: TierKind,
        n: usize,
    ) -> Result<Vec<PageId<T>>, RadixError> {
        let n_ref = self.node(node)?;
        // The copy takes room only from leaves ranked below the copied node (protection
        // first, then the policy's rank).
        let rank = (
            self.protection_of(n_ref.hashes.first()),
            self.ranking.rank(n_ref, from),
        );
        let owner = n_ref.tenant;
        let free = self.usage(T::KIND).free;
        let mut victims = Vec::new();
        let mut room = free;
        for &(p, r, _, id) in &self.books[T::KIND as usize].evictable {
            if room >= n || (p, r) >= rank {
                break;
            }
            if self.tenant_protected(self.nodes[id].tenant, owner, T::KIND) {
                continue;
            }
            room += self.nodes[id].len();
            victims.push(id);
        }
        if room < n {
            return Err(RadixError::PoolExhausted {
                tier: T::KIND,
                requested: n,
                available: room,
            });
        }
        for id in victims {
            self.evict_node::<T>(id)?;
        }
        let pages = self.alloc::<T>(n)?;
        self.tag_held(owner, T::KIND, pages.iter().map(|p| p.index()));
        Ok(pages)
    }

    /// The tenant that owns `id` (whose insert created it).
    pub fn owner(&self, id: NodeId) -> Result<TenantId, RadixError> {
        Ok(self.node(id)?.tenant)
    }
}
