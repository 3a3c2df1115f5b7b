//! L3 flows (probe, prefetch, backup) and the named regression tests from the seed reviews.

mod common;
use common::*;
use kvtier_radix::{PageHash, page_hashes};
use kvtier_scheduler::*;

fn l3_cfg() -> SchedulerConfig {
    SchedulerConfig {
        l3_enabled: true,
        prefetch_threshold: 2,
        prefetch_stop: PrefetchStopPolicy::WaitComplete,
        ..cfg()
    }
}

fn key(c: &SchedulerConfig, h: &PageHash) -> String {
    c.namespace.keys_for(c.page_size, c.rank).key(h)
}

/// Runs `prompt` to completion on a fresh scheduler so that all its pages end up in `e.l3`.
fn seed_l3(c: &SchedulerConfig, p: Vec<u32>) -> Engine {
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(c);
    e.submit(&mut s, 900, p, 1);
    e.run_to_idle(&mut s, 200);
    assert!(s.stats().op(OpKind::BackUp).succeeded >= 1);
    assert_quiescent(&s);
    e
}

#[test]
fn second_instance_prefetches_from_l3_instead_of_recomputing() {
    let c = l3_cfg();
    let p = prompt(1, 41);
    let seeded = seed_l3(&c, p.clone());
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.l3 = seeded.l3;
    e.submit(&mut s, 1, p, 3);
    e.run_to_idle(&mut s, 200);
    let st = s.stats();
    assert_eq!(st.op(OpKind::L3Query).succeeded, 1);
    assert_eq!(st.op(OpKind::Prefetch).succeeded, 1);
    assert_eq!(st.l3_hit_pages, 10, "(41-1)/4 usable pages all from L3");
    assert_eq!(
        st.host_hit_pages, 0,
        "loaded back via host but counted as L3 hits"
    );
    assert_eq!(st.op(OpKind::LoadBack).succeeded, 1);
    assert!(
        st.computed_tokens <= 1,
        "only the last token computed: {st:?}"
    );
    assert_quiescent(&s);
}

/// Seed review bug (1): "Partial L2+L3 hits insert prefetched suffix pages under the wrong
/// prefix" — host has the first h pages, L3 the rest; the prefetched pages must be keyed from
/// page h and inserted at page h.
#[test]
fn regression_partial_host_l3_hit_inserts_suffix_at_host_offset() {
    let c = l3_cfg();
    let p = prompt(1, 41);
    let hs = page_hashes(&p, c.page_size, None);
    let seeded = seed_l3(&c, p.clone());
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    // Only the first 3 pages exist locally (on host after write-back), L3 has all 10.
    e.submit(&mut s, 1, p[..13].to_vec(), 1);
    e.run_to_idle(&mut s, 100);
    assert_eq!(s.cache().peek_prefix(&hs).1, 3);
    e.l3 = seeded.l3;
    e.submit(&mut s, 2, p.clone(), 2);
    let mut prefetch_keys = None;
    e.run_watching(&mut s, 100, |plan| {
        for op in &plan.ops {
            if let OpSpec::Prefetch { keys, .. } = &op.spec {
                prefetch_keys = Some(keys.clone());
            }
        }
    });
    let keys = prefetch_keys.expect("a prefetch was issued");
    let want: Vec<String> = hs[3..10].iter().map(|h| key(&c, h)).collect();
    assert_eq!(keys, want, "prefetch keys start at the host match (page 3)");
    assert_eq!(s.stats().l3_hit_pages, 7);
    // The oracle in the engine checked every page the forward read.
    assert!(e.pages_checked >= 10);
    assert_quiescent(&s);
}

/// Seed review bug (3): "L3 keys computed at submit time no longer matching the host match at
/// prefetch time" — the host match grows while the probe is in flight; the prefetch must be keyed
/// against the match at prefetch time.
#[test]
fn regression_prefetch_keys_follow_host_match_at_prefetch_time() {
    let c = l3_cfg();
    let p = prompt(1, 41);
    let hs = page_hashes(&p, c.page_size, None);
    let seeded = seed_l3(&c, p.clone());
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.l3 = seeded.l3.clone();
    e.submit(&mut s, 2, p.clone(), 2);
    // First plan: the probe for request 2 (local match 0).
    let plan = s.next_execution_plan(0);
    assert!(matches!(plan.ops[0].spec, OpSpec::L3Query { ref keys } if keys.len() == 10));
    e.take_plan(plan);
    let probe = e.held.remove(0);
    // While it is in flight, another request brings the first 5 pages onto host (L3 hidden
    // from it so it computes them).
    e.l3.clear();
    e.submit(&mut s, 1, p[..21].to_vec(), 1);
    e.run_to_idle_except(&mut s, 100, RequestId(2));
    assert_eq!(s.cache().peek_prefix(&hs).1, 5, "host match moved to 5");
    e.l3 = seeded.l3;
    e.held.insert(0, probe);
    e.complete_op(&mut s, 0); // probe answers: 10 hits from page 0
    let plan = s.next_execution_plan(1000);
    let keys = plan
        .ops
        .iter()
        .find_map(|o| match &o.spec {
            OpSpec::Prefetch { keys, .. } => Some(keys.clone()),
            _ => None,
        })
        .expect("prefetch issued");
    let want: Vec<String> = hs[5..10].iter().map(|h| key(&c, h)).collect();
    assert_eq!(
        keys, want,
        "keys computed against the current host match (page 5)"
    );
    e.take_plan(plan);
    e.run_to_idle(&mut s, 100);
    assert_quiescent(&s);
}

/// Seed review bug (2): "Backup source host pages are not pinned until backup completes" — hold
/// the backups, create host pressure, then let the backups read their sources: the engine
/// asserts that the content stored under each key is that key's page.
#[test]
fn regression_backup_sources_stay_pinned_until_backup_done() {
    let mut c = l3_cfg();
    c.host_pages = 12;
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 41), 1);
    let mut backups = Vec::new();
    for t in 0..100 {
        let plan = s.next_execution_plan(t);
        e.take_plan(plan);
        while !e.held.is_empty() {
            if e.held[0].kind == OpKind::BackUp {
                backups.push(e.held.remove(0));
            } else {
                e.complete_op(&mut s, 0);
            }
        }
        if e.forward.is_some() {
            e.complete_forward(&mut s);
        }
        if !backups.is_empty() && s.live_requests() == 0 {
            break;
        }
    }
    assert_eq!(backups.len(), 1);
    assert_eq!(s.stats().host.locked, 10, "backup pins its 10 host pages");
    // Host pressure: other prompts need host pages for their write-backs.
    for i in 0..4 {
        e.submit(&mut s, 10 + i, prompt(50 + i as u32, 41), 1);
    }
    for t in 100..400 {
        let plan = s.next_execution_plan(t);
        e.take_plan(plan);
        while !e.held.is_empty() {
            if e.held[0].kind == OpKind::BackUp {
                backups.push(e.held.remove(0));
            } else {
                e.complete_op(&mut s, 0);
            }
        }
        if e.forward.is_some() {
            e.complete_forward(&mut s);
        }
        if s.live_requests() == 0 {
            break;
        }
    }
    // Now the backups read their sources (the engine asserts content == key's page).
    e.held.extend(backups);
    while !e.held.is_empty() {
        e.complete_op(&mut s, 0);
    }
    e.run_to_idle(&mut s, 100);
    assert_quiescent(&s);
}

#[test]
fn host_disabled_moves_pages_directly_between_device_and_l3() {
    let mut c = l3_cfg();
    c.host_enabled = false;
    c.host_pages = 0;
    let p = prompt(3, 41);
    let mut s1 = Scheduler::new(c.clone()).unwrap();
    let mut e1 = Engine::new(&c);
    let mut saw_device_backup = false;
    e1.submit(&mut s1, 1, p.clone(), 1);
    e1.run_watching(&mut s1, 100, |plan| {
        saw_device_backup |= plan.ops.iter().any(|o| {
            matches!(
                o.spec,
                OpSpec::BackUp {
                    src: TierPages::Device(_),
                    ..
                }
            )
        });
        assert!(
            !plan
                .ops
                .iter()
                .any(|o| matches!(o.kind, OpKind::WriteBack | OpKind::LoadBack))
        );
    });
    assert!(saw_device_backup);
    let mut s2 = Scheduler::new(c.clone()).unwrap();
    let mut e2 = Engine::new(&c);
    e2.l3 = e1.l3.clone();
    e2.submit(&mut s2, 2, p, 1);
    let mut saw_device_prefetch = false;
    e2.run_watching(&mut s2, 100, |plan| {
        saw_device_prefetch |= plan.ops.iter().any(|o| {
            matches!(
                o.spec,
                OpSpec::Prefetch {
                    dst: TierPages::Device(_),
                    ..
                }
            )
        });
    });
    assert!(saw_device_prefetch);
    assert_eq!(s2.stats().l3_hit_pages, 10);
    assert_quiescent(&s2);
}

#[test]
fn prefetch_timeout_terminates_on_the_clock() {
    let mut c = l3_cfg();
    c.prefetch_stop = PrefetchStopPolicy::Timeout {
        base_ms: 100,
        per_1k_tokens_ms: 1000,
    };
    let p = prompt(1, 41);
    let seeded = seed_l3(&c, p.clone());
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.l3 = seeded.l3;
    e.submit(&mut s, 1, p, 1);
    let plan = s.next_execution_plan(0);
    e.take_plan(plan);
    e.complete_op(&mut s, 0); // probe
    let plan = s.next_execution_plan(10);
    assert!(plan.ops.iter().any(|o| o.kind == OpKind::Prefetch));
    let prefetch = plan
        .ops
        .iter()
        .find(|o| o.kind == OpKind::Prefetch)
        .unwrap()
        .id;
    e.take_plan(plan);
    // Deadline: 10 + 100 + 1000*41/1000 = 151 ms.
    assert!(s.next_execution_plan(150).terminate_prefetch.is_empty());
    assert_eq!(
        s.next_execution_plan(151).terminate_prefetch,
        vec![prefetch]
    );
    assert!(
        s.next_execution_plan(152).terminate_prefetch.is_empty(),
        "asked once"
    );
    e.run_to_idle(&mut s, 100);
    assert_quiescent(&s);
}

#[test]
fn best_effort_terminates_at_the_next_plan_and_wait_complete_never() {
    for (policy, expect) in [
        (PrefetchStopPolicy::BestEffort, true),
        (PrefetchStopPolicy::WaitComplete, false),
    ] {
        let mut c = l3_cfg();
        c.prefetch_stop = policy;
        let p = prompt(1, 41);
        let seeded = seed_l3(&c, p.clone());
        let mut s = Scheduler::new(c.clone()).unwrap();
        let mut e = Engine::new(&c);
        e.l3 = seeded.l3;
        e.submit(&mut s, 1, p, 1);
        let plan = s.next_execution_plan(0);
        e.take_plan(plan);
        e.complete_op(&mut s, 0);
        let plan = s.next_execution_plan(1);
        e.take_plan(plan);
        let t = s.next_execution_plan(1_000_000).terminate_prefetch;
        assert_eq!(!t.is_empty(), expect, "{policy:?}");
        e.run_to_idle(&mut s, 100);
        assert_quiescent(&s);
    }
}

#[test]
fn failed_backup_is_not_recorded_as_stored() {
    let c = l3_cfg();
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.fail_every = Some((OpKind::BackUp, 1));
    e.submit(&mut s, 1, prompt(1, 41), 1);
    e.run_to_idle(&mut s, 100);
    assert_eq!(s.stats().op(OpKind::BackUp).failed, 1);
    assert!(e.l3.is_empty());
    // The next finish of the same prefix tries again (nothing was marked as in L3).
    e.fail_every = None;
    e.submit(&mut s, 2, prompt(1, 41), 1);
    e.run_to_idle(&mut s, 100);
    assert_eq!(s.stats().op(OpKind::BackUp).succeeded, 1);
    assert_eq!(e.l3.len(), 10);
    assert_quiescent(&s);
}

#[test]
fn write_back_policy_backs_up_only_on_host_eviction() {
    let mut c = l3_cfg();
    c.write_policy = WritePolicy::WriteBack;
    c.host_pages = 24;
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 41), 1);
    e.run_to_idle(&mut s, 100);
    assert_eq!(
        s.stats().op(OpKind::BackUp).issued,
        0,
        "no backup while host has room"
    );
    for i in 0..4 {
        e.submit(&mut s, 10 + i, prompt(20 + i as u32, 41), 1);
        e.run_to_idle(&mut s, 200);
    }
    assert!(
        s.stats().op(OpKind::BackUp).succeeded >= 1,
        "host eviction backed pages up"
    );
    for k in e.l3.keys() {
        assert!(k.contains(':'));
    }
    assert_quiescent(&s);
}

#[test]
fn write_through_selective_backs_up_only_hot_prefixes() {
    let mut c = l3_cfg();
    c.write_policy = WritePolicy::WriteThroughSelective { hit_threshold: 2 };
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 41), 1);
    e.run_to_idle(&mut s, 100);
    assert_eq!(e.l3.len(), 0, "matched once: cold");
    e.submit(&mut s, 2, prompt(1, 41), 1);
    e.run_to_idle(&mut s, 100);
    e.submit(&mut s, 3, prompt(1, 41), 1);
    e.run_to_idle(&mut s, 100);
    assert!(!e.l3.is_empty(), "hot after repeated hits");
    assert_quiescent(&s);
}
