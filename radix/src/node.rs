//! One node of the radix tree: a run of whole pages and where copies of them live.
//!
//! Why a run and not one page per node: prompts share long prefixes and then diverge, so
//! most of the tree is long unbranched chains; storing a chain as one node keeps matching to
//! one hash comparison per page and one map lookup per *branch*, and keeps the arena small.
//! Residency is per node and all-or-nothing per tier: when only part of a node is wanted on a
//! tier, the node is split first, so "node has a device copy" always means every page of it.

use slotmap::new_key_type;
use smallvec::SmallVec;

use std::sync::Arc;

use crate::events::ScopeLabel;
use crate::hash::PageHash;
use crate::tier::TierKind;

new_key_type! {
    /// Stable id of a tree node. A node's *end depth* never changes (a split creates the new
    /// node for the front part), so an id held across calls still names the same prefix end.
    pub struct NodeId;
}

/// Key of a node in a tier's evictable set: unprotected before protected (`protect.rs`), then
/// lowest rank first (`RadixCache::tier_rank`: on device backed copies before sole ones, then
/// the policy's rank, for LRU the last access), ties broken by the node's creation
/// sequence number, which is the same on every tensor-parallel rank.
pub(crate) type EvictKey = (crate::protect::Protection, u64, u64, NodeId);

/// Residency and lock state of one node on one tier.
#[derive(Debug, Clone, Default)]
pub(crate) struct TierSlot {
    /// One page id per page of the node when the node has a copy on this tier.
    pub pages: Option<SmallVec<[u32; 4]>>,
    /// Number of live locks on this tier held on this node *or any descendant*. A node with
    /// `lock > 0` is never evicted from this tier.
    pub lock: u32,
    /// Number of children with a copy on this tier (a node is a tier-leaf when this is 0).
    pub resident_children: u32,
    /// Present iff the node is in the tier's evictable set under this key.
    pub evict_key: Option<EvictKey>,
    /// `(tick, traffic)` when this tier got a copy of pages the node had elsewhere (a
    /// demotion): the copy ranks on this tier as if used then, while the node keeps its rank
    /// on the tier it came from. Zero (no effect) for pages computed or loaded for a request.
    pub copied_at: (u64, u64),
}

#[derive(Debug, Clone)]
pub(crate) struct Node {
    /// `None` only for the root.
    pub parent: Option<NodeId>,
    /// Depth, in pages, of this node's first page.
    pub start: u32,
    pub hashes: SmallVec<[PageHash; 1]>,
    /// `hashes.len() * page_size` token ids.
    pub tokens: Vec<u32>,
    /// Number of child nodes.
    pub children: u32,
    pub device: TierSlot,
    pub host: TierSlot,
    /// Known (from a successful backup or an L3 hit) to be stored in L3.
    pub in_l3: bool,
    pub last_access: u64,
    /// Number of requests that reused this node (drives write-through-selective).
    pub hit_count: u32,
    /// Distinct matches through this node: a match repeating the previous query (a blocked
    /// request tried again) is not counted. Drives frequency-aware eviction.
    pub uses: u32,
    /// The cache's traffic clock (pages given to the device tier) at the last touch.
    pub last_use: u64,
    /// The tenant whose insert created the node (see `tenant.rs`).
    pub tenant: crate::tenant::TenantId,
    /// Creation sequence number.
    pub seq: u64,
    /// The scope (salt, adapter) of the prefix; the same for a whole subtree below the root,
    /// since the scope seeds the hash chain.
    pub label: Option<Arc<ScopeLabel>>,
}

impl Node {
    pub(crate) fn len(&self) -> usize {
        self.hashes.len()
    }
    pub(crate) fn end(&self) -> usize {
        self.start as usize + self.hashes.len()
    }
    pub(crate) fn slot(&self, t: TierKind) -> &TierSlot {
        match t {
            TierKind::Device => &self.device,
            TierKind::Host => &self.host,
        }
    }
    pub(crate) fn slot_mut(&mut self, t: TierKind) -> &mut TierSlot {
        match t {
            TierKind::Device => &mut self.device,
            TierKind::Host => &mut self.host,
        }
    }
    pub(crate) fn has(&self, t: TierKind) -> bool {
        self.slot(t).pages.is_some()
    }
    pub(crate) fn has_any_copy(&self) -> bool {
        self.device.pages.is_some() || self.host.pages.is_some()
    }
}
