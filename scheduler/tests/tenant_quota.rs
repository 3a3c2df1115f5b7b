//! Per-tenant quotas keyed by the cache salt (docs/scheduler.md, Isolation): a tenant's pages
//! on each tier — cached in its nodes plus held for its running requests, prefetches and
//! copies — stay within its quota after every plan, and a tenant within its quota loses no
//! page to another tenant's allocations, on device or on host, whether the other tenant
//! computes, prefetches from L3 or runs many requests at once.

mod common;
use common::*;
use kvtier_radix::TierKind;
use kvtier_scheduler::*;
use proptest::prelude::*;

const QUOTA: TenantQuota = TenantQuota {
    device_pages: Some(16),
    host_pages: Some(24),
};

fn quota_cfg(quota: TenantQuota) -> SchedulerConfig {
    SchedulerConfig {
        device_pages: 32,
        host_pages: 48,
        max_context_tokens: 96,
        tenant_quota: quota,
        l3_enabled: true,
        prefetch_threshold: 1,
        prefetch_stop: PrefetchStopPolicy::WaitComplete,
        record_kv_events: true,
        ..cfg()
    }
}

fn salted(id: u64, p: Vec<u32>, salt: &str) -> RequestSpec {
    RequestSpec::new(RequestId(id), p, 2).with_salt(salt)
}

/// Pages of `salt` removed from each tier `[device, host]` by the events drained now.
fn removed(s: &mut Scheduler, salt: &str) -> [usize; 2] {
    let mut n = [0, 0];
    for ev in s.drain_kv_events() {
        if let KvEvent::Removed {
            tier,
            hashes,
            label,
        } = ev
            && label.is_some_and(|l| l.cache_salt.as_deref() == Some(salt))
        {
            n[tier as usize] += hashes.len();
        }
    }
    n
}

/// Puts `salt`'s pages of prompt `p` in the engine's L3 (as another instance left them).
fn seed_l3(s: &Scheduler, e: &mut Engine, p: &[u32], salt: &str) {
    let scope = HashScope::new(Some(salt), None, vec![]);
    let hashes = scope.page_hashes(p, s.config().page_size);
    for (k, h) in s.l3_keys(&hashes).into_iter().zip(hashes) {
        e.l3.insert(k, h);
    }
}

/// Issue 19's case: tenant A caches a 10-page prefix; tenant B sends a burst of 5 prompts at
/// once, all prefetched from L3. Returns A's pages removed per tier during B's burst and A's
/// device hits when it asks again.
fn burst_against_a(quota: TenantQuota) -> ([usize; 2], u64) {
    let c = quota_cfg(quota);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    let a = prompt(1, 41);
    e.submit_spec(&mut s, salted(1, a.clone(), "A"));
    e.run_to_idle(&mut s, 400);
    s.drain_kv_events();
    for i in 0..5 {
        let p = prompt(100 + i, 61);
        seed_l3(&s, &mut e, &p, "B");
        e.submit_spec(&mut s, salted(100 + i as u64, p, "B"));
    }
    e.run_to_idle(&mut s, 2000);
    assert!(s.stats().l3_hit_pages > 0, "B's burst prefetched from L3");
    let lost = removed(&mut s, "A");
    let before = s.stats().device_hit_pages;
    e.submit_spec(&mut s, salted(2, a, "A"));
    e.run_to_idle(&mut s, 400);
    assert_quiescent(&s);
    (lost, s.stats().device_hit_pages - before)
}

#[test]
fn another_tenants_prefetched_burst_removes_nothing_of_a_tenant_within_its_quota() {
    let (lost, hits) = burst_against_a(TenantQuota::default());
    assert!(
        lost[0] > 0 && lost[1] > 0 && hits == 0,
        "without quotas B's burst flushes A's prefix off both tiers (the test can fail): {lost:?}, {hits}"
    );
    let (lost, hits) = burst_against_a(QUOTA);
    assert_eq!(lost, [0, 0], "A lost pages [device, host] to B's burst");
    assert_eq!(hits, 10, "A's 10 usable prefix pages are still on device");
}

/// Tenant B alone, two concurrent 61-token requests (16 pages each, its whole device quota):
/// after every step its device pages in use (held by requests or cached) stay within 16, and
/// both requests finish (one waits or is retracted, none deadlocks).
#[test]
fn concurrent_requests_of_one_tenant_stay_within_its_device_quota() {
    let c = quota_cfg(QUOTA);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    for i in 0..2 {
        e.submit_spec(&mut s, salted(i, prompt(200 + i as u32, 61), "B"));
    }
    let mut peak = [0, 0];
    for t in 0..400 {
        if s.is_idle() {
            break;
        }
        e.step(&mut s, t);
        let st = s.stats();
        peak[0] = peak[0].max(st.device.cached + st.device.held);
        peak[1] = peak[1].max(st.host.cached + st.host.held);
    }
    e.run_to_idle(&mut s, 10);
    assert_quiescent(&s);
    assert_eq!(e.ended.len(), 2, "both requests finished");
    assert!(peak[0] <= 16, "B used {} device pages, quota 16", peak[0]);
    assert!(peak[1] <= 24, "B used {} host pages, quota 24", peak[1]);
}

/// A random multi-tenant workload: quotas, the write policy and host admission; tenant A's
/// prompts (run first, then A goes quiet); then requests of B, C and the unsalted common space
/// `(tenant, prompt seed, length, in L3, arrival step)`, many at once.
#[derive(Clone, Debug)]
struct Mix {
    quota: (u32, u32),
    /// Device pages beyond the three tenants' quotas.
    device_pages: u32,
    policy: u8,
    a: Vec<(u32, usize)>,
    others: Vec<(u8, u32, usize, bool, u64)>,
}

fn mix() -> impl Strategy<Value = Mix> {
    (
        (16..24u32, 12..32u32),
        16..24u32,
        0..3u8,
        prop::collection::vec((0..3u32, 9..60usize), 1..3),
        prop::collection::vec(
            (0..3u8, 0..6u32, 9..60usize, any::<bool>(), 0..30u64),
            1..14,
        ),
    )
        .prop_map(|(quota, device_pages, policy, a, others)| Mix {
            quota,
            device_pages,
            policy,
            a,
            others,
        })
}

const SALTS: [&str; 3] = ["A", "B", "C"];

/// Every tenant's pages per tier within its quota.
fn within_quota(s: &Scheduler, q: (u32, u32), when: &str) -> Result<(), TestCaseError> {
    for salt in SALTS {
        for (t, cap) in [(TierKind::Device, q.0), (TierKind::Host, q.1)] {
            let n = s.tenant_pages(salt, t).unwrap_or(0);
            prop_assert!(
                n <= cap as usize,
                "{}: {} has {} {} pages, quota {}",
                when,
                salt,
                n,
                t,
                cap
            );
        }
    }
    Ok(())
}

fn run_mix(m: &Mix) -> Result<(), TestCaseError> {
    // The capped tenants' quotas fit in each tier, with room for the largest request of the
    // uncapped common space: then nobody needs a protected tenant's pages.
    let c = SchedulerConfig {
        device_pages: 3 * m.quota.0 + m.device_pages,
        host_pages: 3 * m.quota.1 + 16,
        tenant_quota: TenantQuota {
            device_pages: Some(m.quota.0),
            host_pages: Some(m.quota.1),
        },
        write_policy: if m.policy == 1 {
            WritePolicy::WriteBack
        } else {
            WritePolicy::WriteThrough
        },
        host_admission: if m.policy == 2 {
            HostAdmission::OnDeviceEviction { ahead_pages: 8 }
        } else {
            HostAdmission::OnFinish
        },
        ..quota_cfg(TenantQuota::default())
    };
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    for (i, &(p, len)) in m.a.iter().enumerate() {
        e.submit_spec(&mut s, salted(i as u64, prompt(p, len), "A"));
        for t in 0..400 {
            if s.is_idle() {
                break;
            }
            e.step(&mut s, t);
            within_quota(&s, m.quota, "A alone")?;
        }
    }
    e.run_to_idle(&mut s, 10);
    s.drain_kv_events();
    let a_pages = [TierKind::Device, TierKind::Host].map(|t| s.tenant_pages("A", t));
    let last = m.others.iter().map(|o| o.4).max().unwrap_or(0);
    let mut t = 1000;
    for step in 0..3000u64 {
        for (i, &(who, p, len, in_l3, at)) in m.others.iter().enumerate() {
            if at != step {
                continue;
            }
            let p = prompt(100 + p, len);
            let id = 100 + i as u64;
            let spec = match who {
                0 => RequestSpec::new(RequestId(id), p.clone(), 2),
                w => salted(id, p.clone(), SALTS[w as usize]),
            };
            if in_l3 && who > 0 {
                seed_l3(&s, &mut e, &p, SALTS[who as usize]);
            }
            e.submit_spec(&mut s, spec);
        }
        if step > last && s.is_idle() {
            break;
        }
        e.step(&mut s, t);
        t += 1;
        within_quota(&s, m.quota, "after a plan")?;
        let lost = removed(&mut s, "A");
        prop_assert_eq!(
            lost,
            [0, 0],
            "A, within its quota and idle, lost [device, host] pages"
        );
    }
    e.run_to_idle(&mut s, 10);
    assert_quiescent(&s);
    // Every page A had survived (a demotion may have given it host copies since).
    let now = [TierKind::Device, TierKind::Host].map(|t| s.tenant_pages("A", t));
    prop_assert_eq!(
        now[0],
        a_pages[0],
        "A's device pages survived the other tenants"
    );
    prop_assert!(
        now[1] >= a_pages[1],
        "A's host pages survived: {:?} < {:?}",
        now[1],
        a_pages[1]
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// After every plan each tenant's pages on each tier (cached plus held) are within its
    /// quota, and a tenant within its quota that sends nothing loses no page on any tier to
    /// other tenants' computing, prefetching and concurrent requests; every request finishes.
    #[test]
    fn quotas_cap_each_tier_and_spare_tenants_within_them(m in mix()) {
        run_mix(&m)?;
    }
}

#[test]
fn a_request_larger_than_its_tenants_device_quota_is_refused() {
    // 61 + 8 tokens need 18 pages of 4 > 16: it could never run within the quota.
    let mut s = Scheduler::new(quota_cfg(QUOTA)).unwrap();
    let big = RequestSpec::new(RequestId(1), prompt(1, 61), 8).with_salt("B");
    assert_eq!(
        s.submit(big),
        Err(SchedulerError::ExceedsTenantQuota {
            pages: 18,
            quota: 16
        })
    );
    assert_eq!(s.live_requests(), 0);
    // Unsalted requests are not capped.
    s.submit(RequestSpec::new(RequestId(2), prompt(1, 61), 8))
        .unwrap();
}

/// Quotas that add up to more than the device (oversubscribed: caps, not reservations).
fn oversubscribed(device_pages: u32, quota: u32, chunk: usize) -> SchedulerConfig {
    SchedulerConfig {
        page_size: 1,
        device_pages,
        host_pages: 0,
        host_enabled: false,
        l3_enabled: false,
        max_context_tokens: device_pages as usize,
        token_budget: device_pages as usize,
        chunked_prefill_size: chunk,
        max_batch_size: 4,
        tenant_quota: TenantQuota {
            device_pages: Some(quota),
            host_pages: None,
        },
        ..SchedulerConfig::default()
    }
}

/// The adversarial tester's case: tenant A's finished request keeps 5 of 8 device pages
/// (within its quota of 6); tenant B's 5-token prompt, prefilled 2 tokens a chunk, was
/// admitted while nothing ran (the last resort may take A's pages), then its second chunk
/// was refused A's pages (something runs: B itself), B retracted itself, was admitted
/// again, and so on for ever (computed tokens growing, no error).
#[test]
fn a_request_running_alone_is_not_retracted_for_ever_by_other_tenants_pages() {
    let c = oversubscribed(8, 6, 2);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit_spec(
        &mut s,
        RequestSpec::new(RequestId(1), prompt(1, 5), 1).with_salt("A"),
    );
    e.run_to_idle(&mut s, 100);
    e.submit_spec(
        &mut s,
        RequestSpec::new(RequestId(2), prompt(2, 5), 1).with_salt("B"),
    );
    e.run_to_idle(&mut s, 200);
    assert_quiescent(&s);
    assert!(
        s.stats().retracted < 5,
        "retracted {} times",
        s.stats().retracted
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// With quotas that oversubscribe the device and chunked prefill, every request of every
    /// tenant finishes (none is retracted and re-admitted for ever), and each tenant stays
    /// within its quota after every plan.
    #[test]
    fn oversubscribed_quotas_never_livelock(
        device_pages in 6..24u32,
        share in 60..100u32,
        chunk in 1..6usize,
        reqs in prop::collection::vec((0..3usize, 0..40u32, 1..24usize, 0..20u64), 1..10),
    ) {
        let quota = (device_pages * share / 100).max(2);
        let c = oversubscribed(device_pages, quota, chunk);
        let mut s = Scheduler::new(c.clone()).unwrap();
        let mut e = Engine::new(&c);
        let last = reqs.iter().map(|r| r.3).max().unwrap_or(0);
        for step in 0..2000u64 {
            for (i, &(who, seed, len, at)) in reqs.iter().enumerate() {
                if at != step {
                    continue;
                }
                let len = len.min(quota as usize - 1).max(1);
                let spec = RequestSpec::new(RequestId(i as u64), prompt(seed, len), 1)
                    .with_salt(SALTS[who]);
                e.submit_spec(&mut s, spec);
            }
            if step > last && s.is_idle() {
                break;
            }
            e.step(&mut s, step);
            within_quota(&s, (quota, u32::MAX), "after a plan")?;
        }
        prop_assert!(s.is_idle(), "livelock: {:?}", s.stats());
        e.run_to_idle(&mut s, 10);
        assert_quiescent(&s);
    }
}
