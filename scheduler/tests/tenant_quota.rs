//! Per-tenant quotas keyed by the cache salt: one tenant's burst cannot flush another's
//! prefixes.

mod common;
use common::*;
use kvtier_scheduler::*;

/// Tenant A caches a prefix; tenant B then sends a burst of one-off prompts that need the
/// whole device and host tiers; then A asks for its prefix again. Returns A's hit pages.
fn a_hits_after_b_bursts(quota: TenantQuota) -> u64 {
    let c = SchedulerConfig {
        device_pages: 32,
        host_pages: 48,
        max_context_tokens: 96,
        tenant_quota: quota,
        ..cfg()
    };
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    let a = prompt(1, 41);
    e.submit_spec(
        &mut s,
        RequestSpec::new(RequestId(1), a.clone(), 2).with_salt("A"),
    );
    e.run_to_idle(&mut s, 400);
    for i in 0..16 {
        e.submit_spec(
            &mut s,
            RequestSpec::new(RequestId(100 + i), prompt(100 + i as u32, 61), 2).with_salt("B"),
        );
    }
    e.run_to_idle(&mut s, 2000);
    let before = s.stats();
    e.submit_spec(&mut s, RequestSpec::new(RequestId(2), a, 2).with_salt("A"));
    e.run_to_idle(&mut s, 400);
    assert_quiescent(&s);
    let after = s.stats();
    (after.device_hit_pages - before.device_hit_pages)
        + (after.host_hit_pages - before.host_hit_pages)
}

#[test]
fn a_capped_tenants_burst_does_not_flush_another_tenants_prefix() {
    let unlimited = a_hits_after_b_bursts(TenantQuota::default());
    assert_eq!(
        unlimited, 0,
        "without quotas B's burst flushes A's prefix (the test can fail)"
    );
    let capped = a_hits_after_b_bursts(TenantQuota {
        device_pages: Some(16),
        host_pages: Some(24),
    });
    assert_eq!(capped, 10, "A's 10 usable prefix pages survived B's burst");
}
