//! Leaf-first eviction per tier, in the order of the cache's [`EvictionPolicy`] (LRU by
//! default).
//!
//! Why leaf-first: residency is prefix-closed, so only a node with no child on the tier can
//! lose its copy without leaving a hole in the middle of a cached prefix. Each tier keeps a
//! `BTreeSet` of such unlocked leaves ordered by `(policy rank, creation seq)`: the victim is
//! its first element, O(log n), and every tensor-parallel rank picks the same one. On device a
//! *backed* copy (host holds the same pages) ranks before every sole copy: dropping it costs a
//! load, not a recompute (`RadixCache::tier_rank`; under freq-depth it was a fifth of the
//! capacity held twice, docs/sim/shadow.md "Round 8"). Evicting a
//! device copy keeps the host copy; a node left with no copy is removed from the tree, which
//! may make its parent the next leaf.

use crate::adaptive::{AdaptiveSnapshot, AdaptiveState, GhostKind, LearntAdmission};
use crate::cache::RadixCache;
use crate::error::RadixError;
use crate::events::KvEvent;
use crate::hash::PageHash;
use crate::memory::{USE_MEMORY_CAPACITIES, UseMemory};
use crate::node::NodeId;
use crate::policy::EvictionPolicy;
use crate::shadow::{ShadowConfig, ShadowConfigError, ShadowSelector, ShadowSnapshot};
use crate::tier::{Tier, TierKind};

/// What one eviction did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvictedNode {
    /// Depth of the node's first page.
    pub start: usize,
    pub hashes: Vec<PageHash>,
    /// The node had no copy left and was removed from the tree.
    pub removed: bool,
    /// The node was known to be stored in L3.
    pub in_l3: bool,
}

/// Result of [`RadixCache::evict`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EvictOutcome {
    pub freed_pages: usize,
    pub evicted: Vec<EvictedNode>,
}

impl RadixCache {
    /// Evicts the lowest-ranked unlocked leaves of tier `T` (least recently used first under
    /// LRU) until at least `n_pages` pages are freed or nothing evictable is left.
    pub fn evict<T: Tier>(&mut self, n_pages: usize) -> EvictOutcome {
        let mut out = EvictOutcome::default();
        while out.freed_pages < n_pages {
            let Some(&(_, _, _, id)) = self.books[T::KIND as usize].evictable.first() else {
                break;
            };
            let ev = self.evict_leaf(id, T::KIND);
            out.freed_pages += ev.hashes.len();
            out.evicted.push(ev);
        }
        out
    }

    /// Evictable leaves of tier `T` in eviction order (least recently used first under LRU).
    /// Evicting the first one may
    /// make its parent evictable, so a policy that needs to act before eviction (e.g. back up
    /// to L3) should look at the first few, act, and evict them with [`Self::evict_node`].
    pub fn evictable_lru<T: Tier>(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.books[T::KIND as usize]
            .evictable
            .iter()
            .map(|&(_, _, _, id)| id)
    }

    /// The policy that ranks evictable leaves.
    pub fn eviction_policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// Switches the eviction policy; every evictable leaf is ranked again at once. Switching to
    /// [`EvictionPolicy::Adaptive`] starts it afresh (at LRU, no ghosts). A policy that ranks
    /// by uses starts an empty use memory (`memory.rs`); LRU keeps none.
    pub fn set_eviction_policy(&mut self, policy: EvictionPolicy) {
        self.policy = policy;
        let capacity = self.device_pool.capacity() + self.host_pool.capacity();
        self.memory = policy
            .reads_uses()
            .then(|| UseMemory::new(USE_MEMORY_CAPACITIES * capacity));
        self.adaptive = (policy == EvictionPolicy::Adaptive)
            .then(|| AdaptiveState::new(self.device_pool.capacity(), self.host_pool.capacity()));
        self.shadow = None;
        if policy == EvictionPolicy::Shadow {
            // The default constants are valid and the sizes are the cache's own, so this only
            // fails for a config given with `set_shadow_config`, which checked it already.
            self.shadow = ShadowSelector::new(
                self.shadow_config.clone(),
                self.device_pool.capacity() as u32,
                self.host_pool.capacity() as u32,
            )
            .ok()
            .map(Box::new);
        }
        self.rerank();
    }

    /// The constants of the shadow selector ([`EvictionPolicy::Shadow`]); under that policy
    /// the selector starts afresh with them. Errors (nothing changed): a config the selector
    /// refuses.
    pub fn set_shadow_config(&mut self, cfg: ShadowConfig) -> Result<(), ShadowConfigError> {
        ShadowSelector::new(cfg.clone(), 1, 1)?;
        self.shadow_config = cfg;
        if self.policy == EvictionPolicy::Shadow {
            self.set_eviction_policy(EvictionPolicy::Shadow);
        }
        Ok(())
    }

    /// Feeds a submitted request's prompt to the shadow selector (nothing under other
    /// policies); at the selector's decision points the ranking may change (every evictable
    /// leaf is ranked again). Call it once per request, in submission order, on every
    /// tensor-parallel rank.
    pub fn observe_request(&mut self, hashes: &[PageHash]) {
        if let Some(s) = self.shadow.as_mut()
            && s.observe(hashes)
        {
            self.rerank();
        }
    }

    /// What the shadow selector chose and measured (`None` under other policies).
    pub fn shadow_snapshot(&self) -> Option<ShadowSnapshot> {
        self.shadow.as_ref().map(|s| s.snapshot())
    }

    /// What the adaptive policy has learnt (`None` under a fixed policy).
    pub fn adaptive_snapshot(&self) -> Option<AdaptiveSnapshot> {
        self.adaptive.as_ref().map(AdaptiveState::snapshot)
    }

    /// Where the adaptive policy would give finished requests' pages their host copy
    /// (`None` under a fixed policy).
    pub fn learnt_admission(&self) -> Option<LearntAdmission> {
        match &self.shadow {
            Some(s) => Some(s.choice().admission),
            None => self.adaptive.as_ref().map(AdaptiveState::admission),
        }
    }

    /// Ranks every evictable leaf again by the current ranking (the configured policy, or the
    /// adaptive policy's level).
    pub(crate) fn rerank(&mut self) {
        self.ranking = match (&self.adaptive, &self.shadow) {
            (Some(a), _) => a.ranking(),
            (None, Some(s)) => s.choice().eviction,
            (None, None) => self.policy,
        };
        let ids: Vec<NodeId> = self.nodes.keys().collect();
        for t in [TierKind::Device, TierKind::Host] {
            for &id in &ids {
                self.refresh_evictable(id, t);
            }
        }
    }

    /// Evicts one specific node from tier `T`; it must be an unlocked leaf on that tier.
    pub fn evict_node<T: Tier>(&mut self, id: NodeId) -> Result<EvictedNode, RadixError> {
        let n = self.node(id)?;
        if n.slot(T::KIND).evict_key.is_none() {
            return Err(RadixError::NotEvictable { tier: T::KIND });
        }
        Ok(self.evict_leaf(id, T::KIND))
    }

    fn evict_leaf(&mut self, id: NodeId, t: TierKind) -> EvictedNode {
        let node = &mut self.nodes[id];
        let owner = node.tenant;
        let slot = node.slot_mut(t);
        let old_key = slot.evict_key.take();
        if let Some(k) = old_key {
            self.books[t as usize].evictable.remove(&k);
        }
        let pages = slot.pages.take().unwrap_or_default();
        slot.copied_at = (0, 0);
        let node = &self.nodes[id];
        let parent = node.parent;
        let removed = !node.has_any_copy();
        let ev = EvictedNode {
            start: node.start as usize,
            hashes: node.hashes.to_vec(),
            removed,
            in_l3: node.in_l3,
        };
        let label = node.label.clone();
        self.pool_mut(t).release_cached(&pages);
        self.tenant_key_changed(owner, t, old_key, None);
        self.tenant_pages(owner, t, 0, pages.len());
        if self.record_events {
            self.events.push(KvEvent::Removed {
                tier: t,
                hashes: ev.hashes.clone(),
                label,
            });
        }
        if removed && let (Some(a), Some(&first)) = (self.adaptive.as_mut(), ev.hashes.first()) {
            let kind = if self.nodes[id].uses == 0 {
                GhostKind::Once
            } else {
                GhostKind::Reused
            };
            a.remember(first, ev.hashes.len(), kind, t, self.traffic);
        }
        if removed {
            if let Some(m) = self.memory.as_mut() {
                m.remember(&ev.hashes, self.nodes[id].uses);
            }
            // No copy on either tier: by prefix closure no child has one either, and nodes
            // without copies do not exist, so this node is a leaf of the tree.
            if let Some(first) = ev.hashes.first() {
                self.index.remove(first);
            }
            self.nodes.remove(id);
        }
        if !removed && t == TierKind::Host {
            // The device copy is no longer backed: it ranks as a sole copy now.
            self.refresh_evictable(id, TierKind::Device);
        }
        if let Some(p) = parent {
            let pn = &mut self.nodes[p];
            let ps = pn.slot_mut(t);
            ps.resident_children = ps.resident_children.saturating_sub(1);
            if removed {
                pn.children = pn.children.saturating_sub(1);
            }
            self.refresh_evictable(p, t);
        }
        ev
    }
}
