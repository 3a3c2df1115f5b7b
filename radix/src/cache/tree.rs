//! The tree's structural primitives, shared by matching, inserting, copies between tiers and
//! eviction: splitting a node ([`RadixCache::split`]), giving a node pages
//! ([`RadixCache::give_pages`]), marking a node used ([`RadixCache::touch`]) and keeping the
//! evictable sets current ([`RadixCache::refresh_evictable`]).
//!
//! Why in one place: these are the only code paths that change a node's shape or its residency
//! bookkeeping, so they keep the invariants that depend on it:
//! - a parent counts its children with a copy on each tier (`resident_children`), which
//!   `give_pages` bumps and `split` sets for the new front node;
//! - a tier's evictable set holds exactly the non-root nodes with a copy on that tier, no lock
//!   and no child with a copy there, ranked by the current policy; every change that can
//!   alter that membership or the rank goes through `refresh_evictable`.

use smallvec::SmallVec;

use crate::events::KvEvent;
use crate::node::{Node, NodeId, TierSlot};
use crate::tier::TierKind;

use super::{RadixCache, Recency};

/// Added to the rank of a device copy host lacks: every such copy ranks above (is evicted
/// after) every device copy host also holds. Policy ranks are clamped below it.
pub(crate) const SOLE_DEVICE_COPY: u64 = 1 << 62;

impl RadixCache {
    /// Gives a node that lacks a copy on `t` the caller's (held, validated) pages.
    pub(crate) fn give_pages(&mut self, id: NodeId, t: TierKind, pages: &[u32], recency: Recency) {
        if t == TierKind::Device && recency == Recency::Touch {
            self.traffic += pages.len() as u64;
        }
        self.pool_mut(t).mark_cached(pages);
        self.untag_held(t, pages);
        let owner = self.nodes[id].tenant;
        self.tenant_pages(owner, t, pages.len(), 0);
        let node = &mut self.nodes[id];
        match recency {
            Recency::Touch => node.last_use = self.traffic,
            Recency::Keep => node.slot_mut(t).copied_at = (self.tick, self.traffic),
        }
        node.slot_mut(t).pages = Some(pages.iter().copied().collect());
        let parent = node.parent;
        if self.record_events {
            let parent_hash = parent.and_then(|p| self.nodes[p].hashes.last().copied());
            let hashes = self.nodes[id].hashes.to_vec();
            let tokens = self.nodes[id].tokens.clone();
            self.events.push(KvEvent::Stored {
                tier: t,
                parent: parent_hash,
                hashes,
                tokens,
                label: self.nodes[id].label.clone(),
            });
        }
        if let Some(p) = parent {
            self.nodes[p].slot_mut(t).resident_children += 1;
            self.refresh_evictable(p, t);
        }
        // The last use changed: both tiers rank the node again.
        self.refresh_evictable(id, TierKind::Device);
        self.refresh_evictable(id, TierKind::Host);
    }

    /// Splits `id` after its first `k` pages (0 < k < len). The new node holds the front part
    /// and becomes `id`'s parent; `id` keeps its end depth, its children and its lock records.
    pub(crate) fn split(&mut self, id: NodeId, k: usize) -> NodeId {
        let seq = self.next_seq;
        self.next_seq += 1;
        let ps = self.page_size;
        let n = &mut self.nodes[id];
        debug_assert!(k > 0 && k < n.len());
        // The front part keeps the node's buffers (truncated) and only the back part is copied
        // out: a prompt matching all but the last pages of a long run (the common split) costs
        // a copy of those last pages, not of the whole run plus a shift (and no fresh
        // allocation the size of the run).
        let back_hashes = SmallVec::from_slice(&n.hashes[k..]);
        n.hashes.truncate(k);
        let front_hashes = std::mem::replace(&mut n.hashes, back_hashes);
        let back_tokens = n.tokens.split_off(k * ps);
        let front_tokens = std::mem::replace(&mut n.tokens, back_tokens);
        let front_slot = |slot: &mut TierSlot| TierSlot {
            pages: slot.pages.as_mut().map(|p| {
                let back = SmallVec::from_slice(&p[k..]);
                p.truncate(k);
                std::mem::replace(p, back)
            }),
            lock: slot.lock,
            resident_children: slot.pages.is_some() as u32,
            evict_key: None,
            copied_at: slot.copied_at,
        };
        let device = front_slot(&mut n.device);
        let host = front_slot(&mut n.host);
        let front = Node {
            parent: n.parent,
            start: n.start,
            hashes: front_hashes,
            tokens: front_tokens,
            children: 1,
            device,
            host,
            in_l3: n.in_l3,
            last_access: n.last_access,
            hit_count: n.hit_count,
            uses: n.uses,
            last_use: n.last_use,
            tenant: n.tenant,
            seq,
            label: n.label.clone(),
        };
        n.start += k as u32;
        let back_first = n.hashes[0];
        let front_first = front.hashes[0];
        let fid = self.nodes.insert(front);
        self.nodes[id].parent = Some(fid);
        self.index.insert(front_first, fid);
        self.index.insert(back_first, id);
        // The back part's first page changed, and with it its protection (`protect.rs`).
        self.refresh_evictable(id, TierKind::Device);
        self.refresh_evictable(id, TierKind::Host);
        fid
    }

    /// Marks `id` as used now.
    pub(crate) fn touch(&mut self, id: NodeId) {
        let traffic = self.traffic;
        let n = &mut self.nodes[id];
        n.last_access = self.tick;
        n.last_use = traffic;
        self.refresh_evictable(id, TierKind::Device);
        self.refresh_evictable(id, TierKind::Host);
    }

    /// A node's rank in tier `t`'s evictable set: the policy's rank, and on device a copy
    /// that host also holds (a *backed* copy) before every sole copy (`evict.rs`).
    pub(crate) fn tier_rank(&self, node: &crate::node::Node, t: TierKind) -> u64 {
        let r = self.ranking.rank(node, t).min(SOLE_DEVICE_COPY - 1);
        if t == TierKind::Device && !node.has(TierKind::Host) {
            r + SOLE_DEVICE_COPY
        } else {
            r
        }
    }

    /// Puts `id` into, or takes it out of, tier `t`'s evictable set as its state requires.
    pub(crate) fn refresh_evictable(&mut self, id: NodeId, t: TierKind) {
        let root = self.root;
        let Some(node) = self.nodes.get(id) else {
            return;
        };
        let rank = self.tier_rank(node, t);
        let key = (self.protection_of(node.hashes.first()), rank, node.seq, id);
        let Some(node) = self.nodes.get_mut(id) else {
            return;
        };
        let slot = node.slot_mut(t);
        let should =
            id != root && slot.pages.is_some() && slot.lock == 0 && slot.resident_children == 0;
        let want = should.then_some(key);
        if slot.evict_key != want {
            let set = &mut self.books[t as usize].evictable;
            let old = slot.evict_key.take();
            if let Some(old) = old {
                set.remove(&old);
            }
            if let Some(k) = want {
                set.insert(k);
            }
            slot.evict_key = want;
            let owner = node.tenant;
            self.tenant_key_changed(owner, t, old, want);
        }
    }
}
