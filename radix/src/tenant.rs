//! Per-tenant quotas on pages, so that one tenant's burst cannot flush another's prefixes.
//!
//! Why: the tree is shared, and eviction ranks leaves without regard to whose they are; a
//! tenant that sends many long one-off prompts (or prefetches them from L3, or runs several at
//! once) evicts every other tenant's cached prefixes.
//!
//! What a cap caps: a tenant's **charge** on a tier, the pages of that tier cached in nodes it
//! owns plus the pages allocated on its behalf and not yet in the tree (running requests'
//! pages, prefetch and copy destinations). [`RadixCache::alloc_evicting_for`] keeps two rules:
//!
//! 1. **A tenant stays within its cap.** If its charge plus the request would exceed the cap,
//!    its own evictable leaves go first (in the policy's order); if that does not make room,
//!    the allocation is refused with [`RadixError::TenantQuota`] and the caller must free the
//!    tenant's own pages (the scheduler retracts one of the tenant's requests) or wait.
//! 2. **A tenant within its cap loses no page to another tenant's allocation.** Eviction on
//!    behalf of anyone (a capped tenant, or [`TenantId::SHARED`]) skips the leaves of every
//!    other capped tenant whose charge is within its cap; it takes free pages, its own
//!    leaves, uncapped (shared) leaves and those of tenants over their cap.
//!
//! How: every node has an owner, the tenant whose insert created it ([`TenantId::SHARED`] for
//! plain [`RadixCache::insert`]); a node split keeps its owner. Every page held on a tenant's
//! behalf is tagged with it until it is freed or given to the tree (whether or not the tenant
//! has a cap, so that a cap set while pages are in flight counts them). For a tenant with a
//! cap, each tier keeps the count of its cached pages, of its held pages and the set of its
//! evictable leaves (the same keys as the tier's set). Without capped tenants every allocation takes the plain path.

use std::collections::{BTreeMap, BTreeSet};

use crate::cache::RadixCache;
use crate::error::RadixError;
use crate::node::{EvictKey, NodeId};
use crate::tier::{PageId, Tier, TierKind};

/// A tenant of the cache (e.g. the hash of a request's cache salt).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub u64);

impl TenantId {
    /// Pages inserted without a tenant.
    pub const SHARED: TenantId = TenantId(0);
}

/// A capped tenant's bookkeeping on one tier.
#[derive(Debug, Default)]
pub(crate) struct TenantBook {
    pub cap: Option<usize>,
    /// Cached pages of this tier in nodes the tenant owns.
    pub cached: usize,
    /// Held pages of this tier allocated on the tenant's behalf (not in the tree).
    pub held: usize,
    /// The tenant's nodes in the tier's evictable set.
    pub evictable: BTreeSet<EvictKey>,
}

/// Books of the tenants that have a cap on some tier: `[device, host]`.
pub(crate) type TenantBooks = BTreeMap<TenantId, [TenantBook; 2]>;

impl RadixCache {
    /// Caps the pages `tenant` may keep cached on tier `t` (`None`: no cap). Takes effect at
    /// the tenant's next [`Self::alloc_evicting_for`]; nothing is evicted now.
    pub fn set_tenant_cap(&mut self, tenant: TenantId, t: TierKind, cap: Option<usize>) {
        if !self.tenants.contains_key(&tenant) {
            // Count what the tenant already holds.
            let mut books: [TenantBook; 2] = Default::default();
            for node in self.nodes.values() {
                if node.tenant != tenant {
                    continue;
                }
                for tier in [TierKind::Device, TierKind::Host] {
                    let s = node.slot(tier);
                    let b = &mut books[tier as usize];
                    b.cached += s.pages.as_ref().map_or(0, |p| p.len());
                    if let Some(k) = s.evict_key {
                        b.evictable.insert(k);
                    }
                }
            }
            // And the pages held on its behalf (stores, prefetches, running requests' pages
            // in flight): tagged whether or not it had a cap.
            for tier in [TierKind::Device, TierKind::Host] {
                books[tier as usize].held = self.held_for[tier as usize]
                    .values()
                    .filter(|&&o| o == tenant)
                    .count();
            }
            self.tenants.insert(tenant, books);
        }
        if let Some(books) = self.tenants.get_mut(&tenant) {
            books[t as usize].cap = cap;
        }
        if self
            .tenants
            .get(&tenant)
            .is_some_and(|b| b.iter().all(|x| x.cap.is_none()))
        {
            self.tenants.remove(&tenant);
        }
    }

    /// Whether some tenant has a cap (else every allocation takes the plain path).
    pub fn has_tenant_caps(&self) -> bool {
        !self.tenants.is_empty()
    }

    /// The cap of `tenant` on tier `t` (`None`: uncapped there).
    pub fn tenant_cap(&self, tenant: TenantId, t: TierKind) -> Option<usize> {
        self.tenants.get(&tenant).and_then(|b| b[t as usize].cap)
    }

    /// Pages of tier `t` cached in nodes `tenant` owns, if the tenant has a cap on some tier.
    pub fn tenant_cached(&self, tenant: TenantId, t: TierKind) -> Option<usize> {
        self.tenants.get(&tenant).map(|b| b[t as usize].cached)
    }

    /// What counts against `tenant`'s cap on tier `t` (if it has a cap on some tier): its
    /// cached pages plus the pages held on its behalf.
    pub fn tenant_charge(&self, tenant: TenantId, t: TierKind) -> Option<usize> {
        self.tenants
            .get(&tenant)
            .map(|b| b[t as usize].cached + b[t as usize].held)
    }

    /// Whether `owner`'s leaves on `t` are spared by an allocation for `requester`: another
    /// capped tenant within its cap.
    pub fn tenant_protected(&self, owner: TenantId, requester: TenantId, t: TierKind) -> bool {
        owner != requester
            && self.tenants.get(&owner).is_some_and(|b| {
                let b = &b[t as usize];
                b.cap.is_some_and(|cap| b.cached + b.held <= cap)
            })
    }

    /// Allocates `n` pages of `T` on behalf of `tenant` (see the module docs): its own leaves
    /// first while it would exceed its cap, refused with [`RadixError::TenantQuota`] if it
    /// still would; then free pages, then leaves in the policy's order except those of other
    /// capped tenants within their caps. Fails with [`RadixError::PoolExhausted`] if `n` pages
    /// cannot be obtained (without evicting anything when fewer than `n` are obtainable at
    /// all). The pages count against the tenant's cap until freed or given to the tree.
    pub fn alloc_evicting_for<T: Tier>(
        &mut self,
        tenant: TenantId,
        n: usize,
    ) -> Result<Vec<PageId<T>>, RadixError> {
        if self.tenants.is_empty() {
            let pages = self.alloc_evicting::<T>(n)?;
            self.tag_held(tenant, T::KIND, pages.iter().map(|p| p.index()));
            return Ok(pages);
        }
        let t = T::KIND;
        let u = self.usage(t);
        if n > u.obtainable() {
            return Err(RadixError::PoolExhausted {
                tier: t,
                requested: n,
                available: u.obtainable(),
            });
        }
        while let Some(id) = self.own_victim(tenant, t, n) {
            if !self.evict_owned(id, t) {
                break; // cannot happen while the books mirror the tier's set (audited)
            }
        }
        self.check_cap(tenant, t, n)?;
        while self.usage(t).free < n {
            let victim = self.books[t as usize]
                .evictable
                .iter()
                .map(|&(_, _, _, id)| id)
                .find(|&id| !self.tenant_protected(self.nodes[id].tenant, tenant, t));
            match victim {
                Some(id) if self.evict_owned(id, t) => {}
                _ => break,
            }
        }
        let free = self.usage(t).free;
        if free < n {
            return Err(RadixError::PoolExhausted {
                tier: t,
                requested: n,
                available: free,
            });
        }
        let pages = self.alloc::<T>(n)?;
        self.tag_held(tenant, t, pages.iter().map(|p| p.index()));
        Ok(pages)
    }

    /// [`Self::alloc_evicting_for`] as a last resort, when waiting would not free pages (the
    /// caller knows nothing runs): the tenant's own cap still holds, but any unlocked leaf may
    /// be evicted, other tenants' within their caps included.
    pub fn alloc_evicting_for_last_resort<T: Tier>(
        &mut self,
        tenant: TenantId,
        n: usize,
    ) -> Result<Vec<PageId<T>>, RadixError> {
        if let Ok(p) = self.alloc_evicting_for::<T>(tenant, n) {
            return Ok(p);
        }
        self.check_cap(tenant, T::KIND, n)?;
        let pages = self.alloc_evicting::<T>(n)?;
        self.tag_held(tenant, T::KIND, pages.iter().map(|p| p.index()));
        Ok(pages)
    }

    /// Allocates `n` free pages of `T` for `tenant` without evicting anything, refused with
    /// [`RadixError::TenantQuota`] if they would take the tenant over its cap (for callers
    /// that make room themselves, e.g. a write-back policy that backs pages up first).
    pub fn alloc_for<T: Tier>(
        &mut self,
        tenant: TenantId,
        n: usize,
    ) -> Result<Vec<PageId<T>>, RadixError> {
        self.check_cap(tenant, T::KIND, n)?;
        let pages = self.alloc::<T>(n)?;
        self.tag_held(tenant, T::KIND, pages.iter().map(|p| p.index()));
        Ok(pages)
    }

    /// Refuses `n` more pages of `t` for `tenant` if they would take it over its cap.
    fn check_cap(&self, tenant: TenantId, t: TierKind, n: usize) -> Result<(), RadixError> {
        let Some(b) = self.tenants.get(&tenant).map(|b| &b[t as usize]) else {
            return Ok(());
        };
        match b.cap {
            Some(cap) if b.cached + b.held + n > cap => Err(RadixError::TenantQuota {
                tier: t,
                tenant: tenant.0,
                charged: b.cached + b.held,
                cap,
                requested: n,
            }),
            _ => Ok(()),
        }
    }

    /// Tags held pages with `tenant` until they are freed or given to the tree, and counts
    /// them against its cap if it has one. Every tenant's pages are tagged (not only a capped
    /// tenant's): a cap set while they are held must count them ([`Self::set_tenant_cap`]).
    /// [`TenantId::SHARED`] has no cap and is not tagged.
    pub(crate) fn tag_held(
        &mut self,
        tenant: TenantId,
        t: TierKind,
        pages: impl Iterator<Item = u32>,
    ) {
        if tenant == TenantId::SHARED {
            return;
        }
        let mut book = self.tenants.get_mut(&tenant);
        for p in pages {
            if self.held_for[t as usize].insert(p, tenant).is_none()
                && let Some(b) = book.as_mut()
            {
                b[t as usize].held += 1;
            }
        }
    }

    /// Held pages leave their tenant's charge (freed, or given to the tree, where the node's
    /// owner is charged for them as cached).
    pub(crate) fn untag_held(&mut self, t: TierKind, pages: &[u32]) {
        if self.held_for[t as usize].is_empty() {
            return;
        }
        for p in pages {
            if let Some(tenant) = self.held_for[t as usize].remove(p)
                && let Some(b) = self.tenants.get_mut(&tenant)
            {
                let h = &mut b[t as usize].held;
                *h = h.saturating_sub(1);
            }
        }
    }

    /// The tenant's first evictable leaf on `t` while its charge plus `n` exceeds its cap.
    fn own_victim(&self, tenant: TenantId, t: TierKind, n: usize) -> Option<NodeId> {
        let book = &self.tenants.get(&tenant)?[t as usize];
        let cap = book.cap?;
        if book.cached + book.held + n <= cap {
            return None;
        }
        book.evictable.first().map(|&(_, _, _, id)| id)
    }

    /// Evicts an evictable leaf of tier `t` (taken from a tenant's set); false if it was not.
    fn evict_owned(&mut self, id: NodeId, t: TierKind) -> bool {
        match t {
            TierKind::Device => self.evict_node::<crate::tier::Device>(id).is_ok(),
            TierKind::Host => self.evict_node::<crate::tier::Host>(id).is_ok(),
        }
    }

    /// Keeps a capped owner's evictable set in step with the tier's (called on every change
    /// of a node's key on `t`).
    pub(crate) fn tenant_key_changed(
        &mut self,
        owner: TenantId,
        t: TierKind,
        old: Option<EvictKey>,
        new: Option<EvictKey>,
    ) {
        if let Some(b) = self.tenants.get_mut(&owner) {
            let set = &mut b[t as usize].evictable;
            if let Some(k) = old {
                set.remove(&k);
            }
            if let Some(k) = new {
                set.insert(k);
            }
        }
    }

    /// Counts pages a capped owner gains (`delta > 0`) or loses on `t`.
    pub(crate) fn tenant_pages(
        &mut self,
        owner: TenantId,
        t: TierKind,
        gained: usize,
        lost: usize,
    ) {
        if let Some(b) = self.tenants.get_mut(&owner) {
            let c = &mut b[t as usize].cached;
            *c = (*c + gained).saturating_sub(lost);
        }
    }

    /// Audit of the tenant books against the tree (for `check_invariants`).
    pub(crate) fn check_tenants(&self) -> Result<(), String> {
        for (tenant, books) in &self.tenants {
            for t in [TierKind::Device, TierKind::Host] {
                let mut cached = 0;
                let mut evictable = BTreeSet::new();
                for n in self.nodes.values().filter(|n| n.tenant == *tenant) {
                    let s = n.slot(t);
                    cached += s.pages.as_ref().map_or(0, |p| p.len());
                    if let Some(k) = s.evict_key {
                        evictable.insert(k);
                    }
                }
                let b = &books[t as usize];
                let held = self.held_for[t as usize]
                    .iter()
                    .filter(|(p, o)| {
                        **o == *tenant
                            && self.pool(t).state(**p) == Some(crate::pool::PageState::Held)
                    })
                    .count();
                if let Some((p, _)) = self.held_for[t as usize]
                    .iter()
                    .find(|(p, _)| self.pool(t).state(**p) != Some(crate::pool::PageState::Held))
                {
                    return Err(format!("{t} page {p} is tagged held but is not"));
                }
                if b.held != held {
                    return Err(format!("{tenant:?} {t} held count drifted"));
                }
                if b.cached != cached {
                    return Err(format!("{tenant:?} {t} cached count drifted"));
                }
                if b.evictable != evictable {
                    return Err(format!("{tenant:?} {t} evictable set drifted"));
                }
            }
        }
        Ok(())
    }
}
