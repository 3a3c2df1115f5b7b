//! Property tests: random workloads, capacities, policies, completion orders, failures and
//! aborts, driven through the checking engine. Whatever happens, every page a forward reads
//! holds the right KV (checked by the engine), every op is answered exactly once, and at
//! quiescence all locks are released, the pools balance and no request is left.

mod common;
use common::*;
use kvtier_scheduler::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Workload {
    cfg: SchedulerConfig,
    reqs: Vec<(Vec<u32>, u32, Option<usize>)>,
    actions: Vec<u8>,
    fail: Option<(OpKind, u64)>,
    lose_l3: bool,
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (
        prop_oneof![Just(2usize), Just(4)],
        12u32..48,
        prop_oneof![Just(0u32), 8u32..64],
        any::<bool>(),
        1usize..8,
        (
            0usize..3,
            any::<bool>(),
            0u8..3,
            0u8..3,
            0u8..3,
            any::<bool>(),
        ),
        (0u8..4, prop::option::of(1u32..12)),
    )
        .prop_map(
            |(
                ps,
                dev,
                host,
                l3,
                batch,
                (chunk, mixed, stop, write, retract, keep),
                (evict, demote),
            )| {
                let host_enabled = host > 0;
                let write_back = write >= 2 && host_enabled;
                SchedulerConfig {
                    page_size: ps,
                    device_pages: dev,
                    host_pages: host,
                    host_enabled,
                    l3_enabled: l3,
                    max_batch_size: batch,
                    token_budget: 16 * ps,
                    chunked_prefill_size: [4, 8, 64][chunk],
                    mixed_prefill_decode: mixed,
                    prefetch_threshold: 1,
                    prefetch_stop: [
                        PrefetchStopPolicy::BestEffort,
                        PrefetchStopPolicy::WaitComplete,
                        PrefetchStopPolicy::Timeout {
                            base_ms: 3,
                            per_1k_tokens_ms: 10,
                        },
                    ][stop as usize],
                    write_policy: write_policy_of(write, host_enabled),
                    keep_device_after_write_back: keep,
                    retraction: retraction_of(retract),
                    max_context_tokens: (dev as usize * ps).min(64),
                    eviction: match evict {
                        0 => Default::default(),
                        1 => "freq-depth"
                            .parse()
                            .expect("the conversation setting parses"),
                        2 => "adaptive".parse().expect("adaptive parses"),
                        _ => "shadow".parse().expect("shadow parses"),
                    },
                    host_admission: match demote {
                        // The learnt admission with the adaptive policy, on odd read-aheads.
                        Some(ahead_pages)
                            if host_enabled
                                && !write_back
                                && evict >= 2
                                && ahead_pages % 2 == 1 =>
                        {
                            HostAdmission::Adaptive {
                                ahead_pages: ahead_pages.min(dev),
                            }
                        }
                        Some(ahead_pages) if host_enabled && !write_back => {
                            HostAdmission::OnDeviceEviction {
                                ahead_pages: ahead_pages.min(dev),
                            }
                        }
                        _ => HostAdmission::OnFinish,
                    },
                    ..SchedulerConfig::default()
                }
            },
        )
}

fn workload() -> impl Strategy<Value = Workload> {
    config().prop_flat_map(|cfg| {
        let max = cfg.max_context_tokens;
        let req = (
            0u32..3,
            1usize..40,
            1u32..12,
            prop::option::weighted(0.2, 1usize..60),
        )
            .prop_map(move |(base, len, new, stop)| {
                let len = len.min(max.saturating_sub(new as usize)).max(1);
                // Three bases share prefixes; the tail depends on the length.
                let p: Vec<u32> = (0..len as u32)
                    .map(|i| {
                        if i < 24 {
                            base * 100 + i
                        } else {
                            7000 + i * (len as u32)
                        }
                    })
                    .collect();
                (p, new, stop)
            });
        (
            Just(cfg),
            prop::collection::vec(req, 1..10),
            prop::collection::vec(any::<u8>(), 50..400),
            prop::option::weighted(
                0.3,
                (
                    prop_oneof![
                        Just(OpKind::LoadBack),
                        Just(OpKind::WriteBack),
                        Just(OpKind::Prefetch),
                        Just(OpKind::BackUp)
                    ],
                    2u64..5,
                ),
            ),
            any::<bool>(),
        )
            .prop_map(|(cfg, reqs, actions, fail, lose_l3)| Workload {
                cfg,
                reqs,
                actions,
                fail,
                lose_l3,
            })
    })
}

fn run(w: Workload) -> Result<(), TestCaseError> {
    let mut s = Scheduler::new(w.cfg.clone()).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut e = Engine::new(&w.cfg);
    e.fail_every = w.fail;
    // Pre-populate L3 with the first base's pages (as another instance would have).
    if w.cfg.l3_enabled {
        let mut s0 = Scheduler::new(w.cfg.clone()).unwrap();
        let mut e0 = Engine::new(&w.cfg);
        e0.submit(
            &mut s0,
            1000,
            (0..30.min(w.cfg.max_context_tokens as u32 - 1)).collect(),
            1,
        );
        e0.run_to_idle(&mut s0, 500);
        e.l3 = e0.l3;
    }
    let mut next = 0usize;
    let mut now = 0u64;
    for a in &w.actions {
        now += 1;
        match a % 8 {
            0 if next < w.reqs.len() => {
                let (p, n, stop) = &w.reqs[next];
                if let Some(st) = stop {
                    e.stop_after.insert(RequestId(next as u64), *st);
                }
                e.submit(&mut s, next as u64, p.clone(), *n);
                next += 1;
            }
            1 | 2 => {
                let plan = s.next_execution_plan(now);
                // Terminated prefetches are answered right away.
                let term = plan.terminate_prefetch.clone();
                e.take_plan(plan);
                for t in term {
                    if let Some(i) = e.held.iter().position(|o| o.id == t) {
                        e.complete_op(&mut s, i);
                    }
                }
            }
            3 | 4 if !e.held.is_empty() => {
                let i = (*a as usize / 8) % e.held.len();
                e.complete_op(&mut s, i);
            }
            5 if e.forward_ready() => e.complete_forward(&mut s),
            6 if *a > 200 && next > 0 => {
                let id = RequestId((*a as u64) % next as u64);
                let _ = s.abort(id);
            }
            7 if w.lose_l3 && *a > 240 => {
                // An L3 object disappears (evicted by another tenant).
                if let Some(k) = e.l3.keys().next().cloned() {
                    e.l3.remove(&k);
                }
            }
            _ => {}
        }
        s.check().map_err(TestCaseError::fail)?;
    }
    while next < w.reqs.len() {
        let (p, n, _) = &w.reqs[next];
        e.submit(&mut s, next as u64, p.clone(), *n);
        next += 1;
    }
    // Drain: complete everything in order until idle.
    for i in 0..5000 {
        if s.is_idle() && e.held.is_empty() && e.forward.is_none() {
            break;
        }
        if e.forward.is_some() {
            while !e.held.is_empty() {
                e.complete_op(&mut s, 0);
            }
            e.complete_forward(&mut s);
        }
        e.step(&mut s, now + i);
    }
    prop_assert!(s.is_idle(), "not idle: {:?}", s.stats());
    // A plan taken at idle reports what the last completions ended; after it every
    // per-request and per-op book is empty (a leak grows with every request served).
    let plan = s.next_execution_plan(now + 5001);
    prop_assert!(plan.ops.is_empty() && plan.forward.step.is_none());
    e.take_plan(plan);
    let kept: Vec<_> = s.books().into_iter().filter(|(_, n)| *n > 0).collect();
    prop_assert!(kept.is_empty(), "books kept at idle: {:?}", kept);
    if std::env::var_os("KVTIER_PROP_VERBOSE").is_some() {
        let st = s.stats();
        eprintln!(
            "checked {} pages; finished {} aborted {}; retracted {}; ops {:?}",
            e.pages_checked,
            st.finished,
            st.aborted,
            st.retracted,
            st.ops
                .iter()
                .map(|(k, o)| (*k, o.issued, o.failed))
                .collect::<Vec<_>>()
        );
    }
    assert_quiescent(&s);
    let st = s.stats();
    prop_assert_eq!(st.finished + st.aborted + st.failed, w.reqs.len() as u64);
    for k in [
        OpKind::LoadBack,
        OpKind::WriteBack,
        OpKind::Prefetch,
        OpKind::BackUp,
        OpKind::L3Query,
    ] {
        let o = st.op(k);
        prop_assert_eq!(
            o.issued,
            o.succeeded + o.failed,
            "{:?} answered exactly once",
            k
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_never_serve_wrong_kv_and_end_quiescent(w in workload()) {
        run(w)?;
    }
}

/// Same calls, same plans: two schedulers driven by one random workload agree step by step.
#[test]
fn plans_are_a_pure_function_of_the_calls() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 24,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&workload(), |w| {
            let mut a = Scheduler::new(w.cfg.clone()).unwrap();
            let mut b = Scheduler::new(w.cfg.clone()).unwrap();
            let mut ea = Engine::new(&w.cfg);
            let mut eb = Engine::new(&w.cfg);
            for (i, (p, n, _)) in w.reqs.iter().enumerate() {
                ea.submit(&mut a, i as u64, p.clone(), *n);
                eb.submit(&mut b, i as u64, p.clone(), *n);
            }
            for t in 0..2000 {
                let pa = a.next_execution_plan(t);
                let pb = b.next_execution_plan(t);
                prop_assert_eq!(&pa, &pb);
                ea.take_plan(pa);
                eb.take_plan(pb);
                while !ea.held.is_empty() {
                    ea.complete_op(&mut a, 0);
                    eb.complete_op(&mut b, 0);
                }
                if ea.forward.is_some() {
                    ea.complete_forward(&mut a);
                    eb.complete_forward(&mut b);
                }
                if a.is_idle() {
                    break;
                }
            }
            prop_assert!(a.is_idle());
            Ok(())
        })
        .unwrap();
}
