//! An engine driving the scheduler the way integrators get it wrong or production load
//! stresses it, all at once: request ids used again as soon as their request ended, op
//! completions reported in batches (`on_op_events`) in any order, completions of the wrong
//! kind, for ops already completed or never issued, and with payloads out of bounds, aborts
//! of any id at any time (twice, of ended and unknown ids), L3 losses, tenants with quotas,
//! tiny pools, chunk sizes of one token and every eviction policy. Whatever happens: every
//! bad completion is refused with a typed error, the full `check` holds after every call,
//! the KV events folded from the start are exactly what the cache holds (and carry the
//! tokens of their pages), every page a forward reads holds the right KV (the engine's
//! oracle), and once everything is answered nothing is held, locked or left live.

mod common;
use std::collections::HashSet;

use common::*;
use kvtier_radix::TierKind;
use kvtier_scheduler::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Run {
    cfg: SchedulerConfig,
    actions: Vec<(u8, u8, u8)>,
    fail: Option<(OpKind, u64)>,
    /// Drain the KV events after every this many actions (they may pass their cap between).
    drain_every: usize,
}

fn run_strategy() -> impl Strategy<Value = Run> {
    let kinds = prop_oneof![
        Just(OpKind::LoadBack),
        Just(OpKind::WriteBack),
        Just(OpKind::Prefetch),
        Just(OpKind::BackUp)
    ];
    (
        (1usize..5, 4u32..24, prop_oneof![Just(0u32), 2u32..32]),
        (any::<bool>(), 1usize..5, 0usize..3, any::<bool>()),
        (0u8..3, 0u8..3, any::<bool>(), 0u8..4, any::<bool>(), 0u8..3),
        (prop::option::of((1u32..10, 1u32..20)), any::<bool>()),
        prop::collection::vec(any::<(u8, u8, u8)>(), 50..300),
        prop::option::weighted(0.3, (kinds, 2u64..4)),
        (prop::option::of(64u64..4096), 1usize..8),
    )
        .prop_map(
            |(pools, sched, policies, (quota, demote), actions, fail, drains)| {
                let (events_cap, drain_every) = drains;
                let (ps, dev, host) = pools;
                let (l3, batch, chunk, mixed) = sched;
                let (stop, write, keep, evict, protect, retract) = policies;
                let host_enabled = host > 0;
                let write_back = write == 2 && host_enabled;
                let cfg = SchedulerConfig {
                    page_size: ps,
                    device_pages: dev,
                    host_pages: host,
                    host_enabled,
                    l3_enabled: l3,
                    max_batch_size: batch,
                    token_budget: 8 * ps,
                    chunked_prefill_size: [1, 3, 64][chunk],
                    mixed_prefill_decode: mixed,
                    prefetch_threshold: 1,
                    prefetch_stop: [
                        PrefetchStopPolicy::BestEffort,
                        PrefetchStopPolicy::WaitComplete,
                        PrefetchStopPolicy::Timeout {
                            base_ms: 2,
                            per_1k_tokens_ms: 5,
                        },
                    ][stop as usize],
                    write_policy: write_policy_of(write, write_back),
                    keep_device_after_write_back: keep,
                    retraction: retraction_of(retract),
                    max_context_tokens: (dev as usize * ps).min(48),
                    eviction: ["lru", "freq-depth", "adaptive", "shadow"][evict as usize]
                        .parse()
                        .expect("a policy name"),
                    host_admission: if demote && host_enabled && !write_back && evict != 3 {
                        HostAdmission::OnDeviceEviction {
                            ahead_pages: 1 + dev / 4,
                        }
                    } else {
                        HostAdmission::OnFinish
                    },
                    queue_protection: if protect {
                        QueueProtection::Waiting
                    } else {
                        QueueProtection::Off
                    },
                    tenant_quota: match quota {
                        Some((d, h)) => TenantQuota {
                            device_pages: Some(d.min(dev)),
                            host_pages: host_enabled.then_some(h),
                        },
                        None => TenantQuota::default(),
                    },
                    record_kv_events: true,
                    kv_events_max_bytes: events_cap
                        .unwrap_or(SchedulerConfig::default().kv_events_max_bytes),
                    ..SchedulerConfig::default()
                };
                Run {
                    cfg,
                    actions,
                    fail,
                    drain_every,
                }
            },
        )
}

type Mirror = [HashSet<PageHash>; 2];

/// Folds KV events into the pages each tier holds: a page is stored once (below a parent
/// the tier holds) and removed only while held; a stored run carries its pages' tokens.
fn fold(m: &mut Mirror, events: Vec<KvEvent>, ps: usize) -> Result<(), TestCaseError> {
    for e in events {
        match e {
            KvEvent::Stored {
                tier,
                parent,
                hashes,
                tokens,
                label,
            } => {
                prop_assert_eq!(tokens.len(), hashes.len() * ps);
                if label.is_none() {
                    let want = kvtier_radix::page_hashes(&tokens, ps, parent.as_ref());
                    prop_assert_eq!(&want, &hashes, "a Stored event's tokens");
                }
                if let Some(p) = parent {
                    prop_assert!(m[tier as usize].contains(&p), "parent not on {:?}", tier);
                }
                for h in hashes {
                    prop_assert!(m[tier as usize].insert(h), "stored twice on {:?}", tier);
                }
            }
            KvEvent::Removed { tier, hashes, .. } => {
                for h in hashes {
                    prop_assert!(m[tier as usize].remove(&h), "removed, never stored");
                }
            }
            // the events since the last drain passed their cap: what follows is everything
            KvEvent::Cleared => *m = Mirror::default(),
        }
    }
    Ok(())
}

/// Completions no engine may send for `op` (held: of the wrong kind, or out of bounds;
/// not held: already completed, never issued or unknown): each is refused.
fn bad_completions(s: &mut Scheduler, e: &Engine, op: OpId, c: u8) -> Result<(), TestCaseError> {
    let held = e.held.iter().find(|o| o.id == op).map(|o| o.kind);
    let ok = c.is_multiple_of(2);
    let n = u32::from(c % 4);
    let mut evs = vec![
        Event::LoadBackDone { op, success: ok },
        Event::PrefetchDone { op, completed: n },
        Event::L3QueryDone { op, hit_pages: n },
        Event::WriteBackDone { op, success: ok },
        Event::BackUpDone { op, success: ok },
    ];
    evs.retain(|ev| held.is_none() || ev.op_kind().map(|k| k.1) != held);
    match held {
        Some(OpKind::Prefetch) => evs.push(Event::PrefetchDone {
            op,
            completed: 10_000,
        }),
        Some(OpKind::L3Query) => evs.push(Event::L3QueryDone {
            op,
            hit_pages: 10_000,
        }),
        _ => {}
    }
    for ev in evs {
        prop_assert!(s.on_event(ev.clone()).is_err(), "accepted {:?}", ev);
        prop_assert!(
            s.on_op_events(vec![ev.clone()]).is_err(),
            "batch accepted {:?}",
            ev
        );
    }
    Ok(())
}

fn run(w: Run) -> Result<(), TestCaseError> {
    let ps = w.cfg.page_size;
    let max = w.cfg.max_context_tokens;
    let mut s = Scheduler::new(w.cfg.clone()).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut e = Engine::new(&w.cfg);
    if w.cfg.l3_enabled {
        // Another instance (its own engine) stored two prompts' pages in L3.
        let mut s0 = Scheduler::new(w.cfg.clone()).unwrap();
        let mut e0 = Engine::new(&w.cfg);
        for base in 0..2u32 {
            let p = (0..(max - 1).min(30) as u32).map(|i| base * 100 + i);
            e0.submit(&mut s0, u64::from(base), p.collect(), 1);
        }
        e0.run_to_idle(&mut s0, 500);
        e.l3 = e0.l3;
    }
    e.fail_every = w.fail;
    let mut mirror = Mirror::default();
    let (mut now, mut submitted) = (0u64, 0u64);
    for (step, &(a, b, c)) in w.actions.iter().enumerate() {
        now += 1;
        match a % 10 {
            0 | 1 => {
                // Ids 0..5 only: an id is used again as soon as its request ended.
                let id = RequestId(u64::from(b % 5));
                let new = 1 + u32::from(b / 5) % 4;
                let len = (1 + usize::from(c) % (max - 1).max(1)).min(max - new as usize);
                let base = u32::from(c / 64);
                let prompt = (0..len as u32)
                    .map(|i| base * 100 + if i < 8 { i } else { i * (1 + u32::from(c) % 3) });
                let mut spec = RequestSpec::new(id, prompt.collect(), new);
                if b % 3 == 1 {
                    spec.cache_salt = Some(format!("t{}", c % 2));
                }
                if s.request_state(id).is_some() {
                    let r = s.submit(spec);
                    prop_assert!(
                        matches!(r, Err(SchedulerError::DuplicateRequest(_))),
                        "{:?}",
                        r
                    );
                    continue;
                }
                let scope = HashScope::new(spec.cache_salt.as_deref(), None, Vec::new());
                e.tokens.insert(id, spec.prompt.clone());
                e.scopes.remove(&id);
                match s.submit(spec) {
                    Ok(()) => {
                        submitted += 1;
                        if !scope.is_plain() {
                            e.scopes.insert(id, scope);
                        }
                    }
                    Err(SchedulerError::ExceedsTenantQuota { .. }) => {}
                    Err(SchedulerError::EmptyPrompt) if len == 0 => {}
                    Err(x) => prop_assert!(false, "submit refused: {}", x),
                }
            }
            2 | 3 => {
                let plan = s.next_execution_plan(now);
                e.take_plan(plan);
            }
            4 | 5 if !e.held.is_empty() => {
                // Some of the ops in flight, completed in one batch in any order.
                let k = 1 + usize::from(b) % e.held.len();
                let mut evs = Vec::new();
                for j in 0..k {
                    let i = (usize::from(c) + j * 7) % e.held.len();
                    let op = e.held.remove(i);
                    evs.push(e.execute_op(&op));
                }
                s.on_op_events(evs)
                    .map_err(|x| TestCaseError::fail(format!("batch refused: {x}")))?;
            }
            6 if e.forward_ready() => e.complete_forward(&mut s),
            7 if c % 4 == 0 => {
                let _ = s.abort(RequestId(u64::from(b % 6)));
            }
            8 => {
                let op = OpId(u64::from(b) % (s.stats().plans + 5));
                bad_completions(&mut s, &e, op, c)?;
            }
            9 if c % 4 == 0 => {
                if let Some(k) = e.l3.keys().next().cloned() {
                    e.l3.remove(&k);
                    s.l3_lost(&[k]).unwrap();
                }
            }
            _ => {}
        }
        s.check()
            .map_err(|x| TestCaseError::fail(format!("check: {x}")))?;
        prop_assert!(s.cache().pending_event_bytes() as u64 <= w.cfg.kv_events_max_bytes);
        if (step + 1) % w.drain_every != 0 {
            continue;
        }
        fold(&mut mirror, s.drain_kv_events(), ps)?;
        let mut resident = Mirror::default();
        fold(&mut resident, s.resident_kv_events(), ps)?;
        prop_assert_eq!(
            &mirror,
            &resident,
            "the events do not add up to what is cached"
        );
    }
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
        s.check()
            .map_err(|x| TestCaseError::fail(format!("check: {x}")))?;
    }
    assert_quiescent(&s);
    let st = s.stats();
    prop_assert_eq!(st.finished + st.aborted + st.failed, submitted);
    for t in [TierKind::Device, TierKind::Host] {
        prop_assert_eq!(s.cache().usage(t).held, 0);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn misuse_and_odd_orders_leave_the_scheduler_consistent_and_quiescent(w in run_strategy()) {
        run(w)?;
    }
}
