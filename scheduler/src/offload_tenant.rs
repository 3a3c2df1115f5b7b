//! Tenant quotas in the offloading-manager mode: one tenant's stores cannot evict another's
//! host pages while that tenant is within its cap.
//!
//! Why: an engine's host tier is shared by every tenant it serves (vLLM: every `cache_salt`,
//! every deployment behind one engine); without caps one tenant's burst of long one-off
//! prompts evicts every other tenant's cached prefixes. kvtier's radix tree already keeps
//! per-tenant books on a tier (`kvtier_radix` tenant caps: a capped tenant evicts its own
//! leaves first and is refused past its cap; nobody evicts a capped tenant within its cap),
//! as the [`crate::Scheduler`] uses for device and host pages; here the manager allocates a
//! store's slots and inserts its pages on behalf of the store's tenant.
//!
//! How: [`OffloadManager::set_tenant_cap`] caps a tenant's host pages (cached and held by its
//! stores and prefetches in flight). [`OffloadManager::prepare_store_for`] allocates through
//! the tree's tenant-aware allocation, storing fewer pages (or none) where the cap or the
//! protected pages of others leave no room; pages a store evicts are read from the tree's
//! events, which [`OffloadManager::drain_events`] still returns in order.

use kvtier_radix::{Host, HostPageId, KvEvent, PageHash, RadixError, TenantId, TierKind};

use crate::offload::OffloadManager;

impl OffloadManager {
    /// The tenant a name denotes (FNV-1a of the name; never [`TenantId::SHARED`]): how an
    /// engine's tenant names (a vLLM request's `kvtier_tenant`) become tree owners.
    pub fn tenant_of(name: &str) -> TenantId {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in b"kvtier-offload-tenant-v1".iter().chain(name.as_bytes()) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        TenantId(h.max(1))
    }

    /// Caps the host pages `tenant` may hold (`None`: uncapped); takes effect at its next
    /// store, nothing is evicted now. [`TenantId::SHARED`] (stores without a tenant) cannot
    /// be capped and is ignored.
    pub fn set_tenant_cap(&mut self, tenant: TenantId, cap: Option<usize>) {
        if tenant != TenantId::SHARED {
            self.cache.set_tenant_cap(tenant, TierKind::Host, cap);
        }
    }

    /// Host pages charged to `tenant` (cached in nodes it owns, plus held by its stores in
    /// flight); `None` if it has no cap.
    pub fn tenant_charge(&self, tenant: TenantId) -> Option<usize> {
        self.cache.tenant_charge(tenant, TierKind::Host)
    }

    /// Up to `want` host slots for `tenant`, evicting as the tree allows: `None` if none can
    /// be had. Also returns the pages evicted for them.
    pub(crate) fn alloc_slots(
        &mut self,
        tenant: TenantId,
        want: usize,
    ) -> Option<(Vec<HostPageId>, Vec<PageHash>)> {
        let usage = self.cache.usage(TierKind::Host);
        let mut n = want.min(usage.obtainable());
        if n == 0 {
            return None;
        }
        if !self.cache.has_tenant_caps() {
            let mut evicted = Vec::new();
            if n > usage.free {
                let out = self.cache.evict::<Host>(n - usage.free);
                evicted.extend(out.evicted.into_iter().flat_map(|e| e.hashes));
            }
            let n = n.min(self.cache.usage(TierKind::Host).free);
            // `n` is at most what is obtainable, and unlocked cached pages are all below no
            // lock, so the evictions freed enough; an empty or refused allocation is none.
            return match self.cache.alloc::<Host>(n) {
                Ok(s) if !s.is_empty() => Some((s, evicted)),
                Ok(_) | Err(_) => None,
            };
        }
        self.events.extend(self.cache.drain_events());
        // Each refusal names how much would fit; `n` strictly shrinks, so this ends.
        let slots = loop {
            match self.cache.alloc_evicting_for::<Host>(tenant, n) {
                Ok(s) => break Some(s),
                Err(RadixError::TenantQuota { charged, cap, .. }) if cap > charged => {
                    n = n.min(cap - charged)
                }
                Err(RadixError::PoolExhausted { available, .. })
                    if available > 0 && available < n =>
                {
                    n = available
                }
                Err(_) => break None,
            }
        };
        let after = self.cache.drain_events();
        let evicted = after
            .iter()
            .filter_map(|e| match e {
                KvEvent::Removed {
                    tier: TierKind::Host,
                    hashes,
                    ..
                } => Some(hashes.iter().copied()),
                _ => None,
            })
            .flatten()
            .collect();
        self.events.extend(after);
        slots.filter(|s| !s.is_empty()).map(|s| (s, evicted))
    }
}
