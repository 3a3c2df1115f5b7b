//! Per-tenant caps: one tenant's burst cannot flush another tenant's prefixes, and the tenant
//! books stay exact under random operations (`check_invariants` audits them).

mod common;
use common::*;
use kvtier_radix::*;
use proptest::prelude::*;

const PS: usize = 2;

fn cache(dev: u32) -> RadixCache {
    cache_with(PS, dev, 8, false)
}

fn prompt(seed: u32, pages: usize) -> (Vec<u32>, Vec<PageHash>) {
    prompt_with(PS, seed, pages)
}

/// Inserts the prompt on device for `tenant` as the scheduler would: match, pin the start,
/// allocate (evicting on the tenant's behalf), insert, unpin. Returns pages obtained.
fn put(c: &mut RadixCache, tenant: TenantId, toks: &[u32], hs: &[PageHash]) -> Option<usize> {
    let m = c.match_prefix(hs);
    let n = hs.len() - m.device_pages;
    if n == 0 {
        return Some(0);
    }
    let lock = c.lock::<Device>(m.device_node).unwrap();
    let got = c.alloc_evicting_for::<Device>(tenant, n);
    let out = got.as_ref().ok().map(|pages| {
        let o = c
            .insert_for::<Device>(tenant, m.device_node, m.device_pages, hs, toks, pages)
            .unwrap();
        let dups: Vec<DevicePageId> = o.duplicates.iter().map(|d| d.1).collect();
        c.free(&dups).unwrap();
        n
    });
    c.unlock(lock).unwrap();
    out
}

/// Tenant A caches an 8-page prefix; tenant B then sends 20 one-off 8-page prompts into a
/// 64-page device tier. Does A's prefix survive?
fn a_survives(b_cap: Option<usize>) -> bool {
    let (a, b) = (TenantId(1), TenantId(2));
    let mut c = cache(64);
    c.set_tenant_cap(b, TierKind::Device, b_cap);
    let (ta, ha) = prompt(1, 8);
    put(&mut c, a, &ta, &ha).unwrap();
    for s in 0..20 {
        let (t, h) = prompt(100 + s, 8);
        put(&mut c, b, &t, &h).unwrap();
        c.check_invariants().unwrap();
        if let Some(cap) = b_cap {
            assert!(c.tenant_cached(b, TierKind::Device).unwrap() <= cap);
        }
    }
    c.peek_prefix(&ha).0 == 8
}

#[test]
fn a_burst_cannot_flush_another_tenants_prefix() {
    assert!(!a_survives(None), "without a cap the burst flushes A");
    assert!(
        a_survives(Some(56)),
        "capped at the room A leaves, B evicts only its own pages"
    );
}

#[test]
fn caps_count_what_a_tenant_already_holds_and_can_be_lifted() {
    let t = TenantId(7);
    let mut c = cache(64);
    let (tk, h) = prompt(3, 5);
    put(&mut c, t, &tk, &h).unwrap();
    assert_eq!(
        c.tenant_cached(t, TierKind::Device),
        None,
        "no cap, no books"
    );
    c.set_tenant_cap(t, TierKind::Device, Some(4));
    assert_eq!(c.tenant_cached(t, TierKind::Device), Some(5));
    c.check_invariants().unwrap();
    // The next allocation makes room under the cap from the tenant's own pages first.
    let (tk2, h2) = prompt(4, 3);
    put(&mut c, t, &tk2, &h2).unwrap();
    assert_eq!(c.tenant_cached(t, TierKind::Device), Some(3));
    assert_eq!(c.peek_prefix(&h).0, 0);
    c.set_tenant_cap(t, TierKind::Device, None);
    assert_eq!(c.tenant_cached(t, TierKind::Device), None);
    c.check_invariants().unwrap();
}

/// Found by an adversarial tester (through `OffloadManager.set_tenant_cap`): pages held on a
/// tenant's behalf (a store or prefetch in flight) were counted only while the tenant had a
/// cap. A cap set while they were held (first time, or again after being lifted) started the
/// books at its cached pages alone: the audit failed ("held count drifted") and the tenant
/// was granted its cap again on top of the pages it held.
#[test]
fn a_cap_set_while_pages_are_held_counts_them() {
    let t = TenantId(9);
    for capped_before in [false, true] {
        let mut c = cache(64);
        if capped_before {
            c.set_tenant_cap(t, TierKind::Device, Some(4));
        }
        let held = c.alloc_evicting_for::<Device>(t, 3).unwrap();
        if capped_before {
            c.set_tenant_cap(t, TierKind::Device, None); // lifted while held
        }
        c.set_tenant_cap(t, TierKind::Device, Some(4));
        assert_eq!(
            c.tenant_charge(t, TierKind::Device),
            Some(3),
            "capped_before {capped_before}"
        );
        c.check_invariants().unwrap();
        assert!(
            matches!(
                c.alloc_evicting_for::<Device>(t, 2),
                Err(RadixError::TenantQuota { charged: 3, .. })
            ),
            "3 held + 2 > 4"
        );
        c.free(&held).unwrap();
        assert_eq!(c.tenant_charge(t, TierKind::Device), Some(0));
        c.check_invariants().unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random inserts by three tenants with random caps, random evictions and cap changes:
    /// the books stay exact, and while every tenant is capped, the caps fit in the tier and
    /// every other tenant is within its cap, an allocation after which its tenant fits under
    /// its own cap takes no page from another tenant.
    #[test]
    fn tenant_books_stay_exact_and_fitting_tenants_spare_the_others(
        ops in prop::collection::vec((0usize..3, 0u32..12, 1usize..7, 0u8..8), 1..60),
        initial_caps in prop::collection::vec(prop::option::of(2usize..16), 3),
        dev in 12u32..40,
    ) {
        let mut c = cache(dev);
        let tenants = [TenantId(1), TenantId(2), TenantId(3)];
        let mut caps = initial_caps.clone();
        for (t, cap) in tenants.iter().zip(&caps) {
            c.set_tenant_cap(*t, TierKind::Device, *cap);
        }
        for (who, seed, pages, action) in ops {
            let x = tenants[who];
            match action {
                0 => { c.evict::<Device>(1); }
                1 => {
                    caps[who] = caps[who].map(|v| v / 2 + 1);
                    c.set_tenant_cap(x, TierKind::Device, caps[who]);
                }
                _ => {
                    // Prompts share prefixes across tenants (seed % 4 picks the first page).
                    let base: Vec<u32> = (0..PS as u32).map(|i| (seed % 4) * 100 + i).collect();
                    let (rest, _) = prompt(seed + 10, pages);
                    let toks: Vec<u32> = base.into_iter().chain(rest).collect();
                    let hs = page_hashes(&toks, PS, None);
                    let held = |c: &RadixCache, i: usize| c.tenant_cached(tenants[i], TierKind::Device);
                    let before: Vec<Option<usize>> = (0..3).map(|i| held(&c, i)).collect();
                    let guarded = caps.iter().all(|c| c.is_some())
                        && caps.iter().flatten().sum::<usize>() <= dev as usize
                        && (0..3).all(|i| i == who || before[i] <= caps[i]);
                    let got = put(&mut c, x, &toks, &hs);
                    let fits = matches!((held(&c, who), caps[who]), (Some(h), Some(cap)) if h <= cap);
                    if guarded && fits && got.is_some_and(|n| n > 0) {
                        for i in (0..3).filter(|&i| i != who) {
                            prop_assert!(held(&c, i) >= before[i], "{:?} lost pages to {x:?}", tenants[i]);
                        }
                    }
                }
            }
            if let Err(e) = c.check_invariants() { prop_assert!(false, "invariant: {e}"); }
        }
    }
}
