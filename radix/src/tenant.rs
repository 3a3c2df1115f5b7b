//! Per-tenant caps on cached pages, so that one tenant's burst cannot flush another's prefixes.
//!
//! Why caps: the tree is shared, and eviction ranks leaves without regard to whose they are;
//! a tenant that sends many long one-off prompts evicts every other tenant's cached prefixes.
//! With a cap, a tenant's allocations ([`RadixCache::alloc_evicting_for`]) first evict its own
//! leaves (in the policy's order) until its cached pages plus the new ones fit under its cap,
//! and only then take free or other tenants' pages; when the caps of the tenants that burst
//! leave room for the others, the others' prefixes stay.
//!
//! How: every node has an owner, the tenant whose insert created it ([`TenantId::SHARED`] for
//! plain [`RadixCache::insert`]); a node split keeps its owner. For a tenant with a cap, each
//! tier keeps the count of its cached pages and the set of its evictable leaves (the same keys
//! as the tier's set). Tenants without a cap cost nothing. The scheduler will pass the tenant
//! of a request (its cache salt); until then, callers tag inserts and allocations themselves.

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

    /// Pages of tier `t` cached in nodes `tenant` owns, if the tenant has a cap on some tier.
    pub fn tenant_cached(&self, tenant: TenantId, t: TierKind) -> Option<usize> {
        self.tenants.get(&tenant).map(|b| b[t as usize].cached)
    }

    /// [`Self::alloc_evicting`] on behalf of `tenant`: if the tenant has a cap on `T` and its
    /// cached pages plus `n` exceed it, its own evictable leaves go first. Fails without
    /// evicting anything if `n` pages cannot be obtained.
    pub fn alloc_evicting_for<T: Tier>(
        &mut self,
        tenant: TenantId,
        n: usize,
    ) -> Result<Vec<PageId<T>>, RadixError> {
        let u = self.usage(T::KIND);
        if n > u.obtainable() {
            return Err(RadixError::PoolExhausted {
                tier: T::KIND,
                requested: n,
                available: u.obtainable(),
            });
        }
        while let Some(id) = self.own_victim(tenant, T::KIND, n) {
            if !self.evict_owned(id, T::KIND) {
                break; // cannot happen while the books mirror the tier's set (audited)
            }
        }
        self.alloc_evicting::<T>(n)
    }

    /// The tenant's first evictable leaf on `t` while its cached pages plus `n` exceed its cap.
    fn own_victim(&self, tenant: TenantId, t: TierKind, n: usize) -> Option<NodeId> {
        let book = &self.tenants.get(&tenant)?[t as usize];
        let cap = book.cap?;
        if book.cached + n <= cap {
            return None;
        }
        book.evictable.first().map(|&(_, _, id)| id)
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
