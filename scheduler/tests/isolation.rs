//! Per-request cache isolation: cache salt (tenants), adapters (LoRA) and multimodal extra keys.
//!
//! The rule (see `kvtier_radix::HashScope`): two requests share a page on any tier, or an L3
//! key, only if their tokens, salt, adapter and the extra keys of the whole prefix up to that
//! page are equal. The test engine's oracle stores each page's *scoped* hash as its content, so
//! a request that read another scope's KV fails the oracle, not just the hit counters.

mod common;
use common::*;
use kvtier_scheduler::*;
use proptest::prelude::*;

fn l3_cfg() -> SchedulerConfig {
    SchedulerConfig {
        l3_enabled: true,
        prefetch_threshold: 1,
        prefetch_stop: PrefetchStopPolicy::WaitComplete,
        record_kv_events: true,
        ..cfg()
    }
}

fn spec(id: u64, p: Vec<u32>) -> RequestSpec {
    RequestSpec::new(RequestId(id), p, 2)
}

fn hits(s: &Scheduler) -> (u64, u64, u64) {
    let st = s.stats();
    (st.device_hit_pages, st.host_hit_pages, st.l3_hit_pages)
}

/// Runs `first` to completion, then `second` with the same tokens, on one scheduler (device
/// and host tiers) and on a second scheduler sharing only L3; returns the hits of `second` on
/// each.
fn second_hits(first: RequestSpec, second: RequestSpec) -> ((u64, u64, u64), (u64, u64, u64)) {
    let c = l3_cfg();
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit_spec(&mut s, first);
    e.run_to_idle(&mut s, 300);
    let before = hits(&s);
    assert_eq!(before, (0, 0, 0));
    let l3_of_first = e.l3.clone();
    let mut other = second.clone();
    e.submit_spec(&mut s, second);
    e.run_to_idle(&mut s, 300);
    assert_quiescent(&s);
    let local = hits(&s);

    let mut s2 = Scheduler::new(c.clone()).unwrap();
    let mut e2 = Engine::new(&c);
    e2.l3 = l3_of_first;
    other.id = RequestId(other.id.0 + 1000);
    e2.submit_spec(&mut s2, other);
    e2.run_to_idle(&mut s2, 300);
    assert_quiescent(&s2);
    (local, hits(&s2))
}

#[test]
fn a_salted_request_never_hits_another_salts_prefix() {
    let p = prompt(1, 41);
    let (local, remote) = second_hits(
        spec(1, p.clone()).with_salt("a"),
        spec(2, p.clone()).with_salt("b"),
    );
    assert_eq!(local, (0, 0, 0), "device/host hits across salts");
    assert_eq!(remote, (0, 0, 0), "L3 hits across salts");
    // Unsalted vs salted: no sharing either way.
    let (local, remote) = second_hits(spec(1, p.clone()), spec(2, p.clone()).with_salt("a"));
    assert_eq!((local, remote), ((0, 0, 0), (0, 0, 0)));
}

#[test]
fn the_same_salt_shares_on_every_tier() {
    let p = prompt(1, 41);
    let (local, remote) = second_hits(spec(1, p.clone()).with_salt("a"), spec(2, p).with_salt("a"));
    assert_eq!(
        local.0 + local.1,
        10,
        "(41-1)/4 pages reused locally: {local:?}"
    );
    assert_eq!(remote.2, 10, "all usable pages from L3: {remote:?}");
}

#[test]
fn adapters_separate_like_salts() {
    let p = prompt(2, 41);
    let (local, remote) = second_hits(
        spec(1, p.clone()).with_adapter("lora-1"),
        spec(2, p.clone()).with_adapter("lora-2"),
    );
    assert_eq!((local, remote), ((0, 0, 0), (0, 0, 0)));
    let (local, _) = second_hits(
        spec(1, p.clone()).with_adapter("lora-1"),
        spec(2, p).with_adapter("lora-1"),
    );
    assert_eq!(local.0 + local.1, 10);
}

#[test]
fn an_image_span_separates_the_pages_from_its_first_page_on() {
    // Same placeholder tokens, different images at tokens 10..14 (page 2 of 4-token pages):
    // pages 0 and 1 are shared, page 2 onwards are not.
    let p = prompt(3, 41);
    let img = |d: u8| {
        let mut s = spec(0, p.clone());
        s.extra_keys = vec![ExtraKey {
            start: 10,
            end: 14,
            digest: vec![d; 32],
        }];
        s
    };
    let mut a = img(1);
    a.id = RequestId(1);
    let mut b = img(2);
    b.id = RequestId(2);
    let (local, remote) = second_hits(a.clone(), b);
    assert_eq!(local.0 + local.1, 2, "{local:?}");
    assert_eq!(remote.2 + remote.0 + remote.1, 2, "{remote:?}");
    let mut same = img(1);
    same.id = RequestId(2);
    let (local, _) = second_hits(a, same);
    assert_eq!(local.0 + local.1, 10);
}

#[test]
fn kv_events_carry_the_scope_label() {
    let c = l3_cfg();
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit_spec(
        &mut s,
        spec(1, prompt(1, 21))
            .with_salt("tenant-7")
            .with_adapter("lora"),
    );
    e.submit_spec(&mut s, spec(2, prompt(2, 21)));
    e.run_to_idle(&mut s, 300);
    let evs = s.drain_kv_events();
    let labels: Vec<_> = evs
        .iter()
        .filter_map(|e| match e {
            KvEvent::Stored { label, .. } => Some(label.clone()),
            _ => None,
        })
        .collect();
    let want = ScopeLabel {
        cache_salt: Some("tenant-7".into()),
        adapter: Some("lora".into()),
    };
    assert!(
        labels.iter().any(|l| l.as_deref() == Some(&want)),
        "{labels:?}"
    );
    assert!(
        labels.iter().any(|l| l.is_none()),
        "unscoped pages have no label"
    );
}

#[test]
fn bad_extra_keys_are_typed_errors_and_change_nothing() {
    let mut s = Scheduler::new(cfg()).unwrap();
    for (start, end) in [(5, 5), (7, 3), (0, 42)] {
        let mut r = spec(1, prompt(1, 41));
        r.extra_keys = vec![ExtraKey {
            start,
            end,
            digest: vec![1],
        }];
        assert!(matches!(
            s.submit(r),
            Err(SchedulerError::BadExtraKey { .. })
        ));
        assert_eq!(s.live_requests(), 0);
    }
    assert!(s.is_idle());
}

#[test]
fn unscoped_l3_keys_stay_sglang_compatible() {
    // The plain chain is SGLang's `get_hash_str` chain (checked against hashlib in radix);
    // an unscoped request's L3 keys must be exactly those digests.
    let c = l3_cfg();
    let p = prompt(4, 41);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, p.clone(), 2);
    e.run_to_idle(&mut s, 300);
    let want: Vec<String> = c
        .namespace
        .keys_for(c.page_size, c.rank)
        .keys(&kvtier_radix::page_hashes(&p, c.page_size, None));
    for k in &want {
        assert!(e.l3.contains_key(k), "missing {k}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random requests over few prompts, salts and adapters through one scheduler with small
    /// tiers and L3: the oracle (page content = scoped hash) passes on every forward, and a
    /// request's hit pages never exceed what the sharing rule allows against earlier ones.
    #[test]
    fn scoped_workloads_never_read_another_scopes_kv(
        reqs in prop::collection::vec((0..3u32, prop::option::of(0..2u8), prop::option::of(0..2u8)), 1..12)
    ) {
        let c = SchedulerConfig { device_pages: 24, host_pages: 32, max_context_tokens: 96, ..l3_cfg() };
        let mut s = Scheduler::new(c.clone()).unwrap();
        let mut e = Engine::new(&c);
        for (i, (p, salt, adapter)) in reqs.iter().enumerate() {
            let mut r = spec(i as u64, prompt(*p, 33));
            r.cache_salt = salt.map(|x| format!("s{x}"));
            r.adapter = adapter.map(|x| format!("a{x}"));
            let allowed = reqs[..i].iter().any(|q| q == &reqs[i]);
            let before = hits(&s);
            e.submit_spec(&mut s, r);
            e.run_to_idle(&mut s, 400);
            let after = hits(&s);
            let got = (after.0 - before.0) + (after.1 - before.1) + (after.2 - before.2);
            if !allowed {
                prop_assert_eq!(got, 0, "request {} hit another scope's pages", i);
            }
        }
        assert_quiescent(&s);
    }
}
