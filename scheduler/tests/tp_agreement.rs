//! Tensor-parallel agreement: two ranks' schedulers over *different* L3 contents (rank 1 lost
//! some of its shards), random workloads, ops completing at different times on each rank.
//! With `RankAgreement` (completions reduced across ranks: min, min, all) the plans are the
//! same every step; without it they diverge, and `ExecutionPlan::digest` names the step.

mod common;
use common::*;
use kvtier_scheduler::*;
use proptest::prelude::*;

fn cfg_for(rank: u32) -> SchedulerConfig {
    SchedulerConfig {
        l3_enabled: true,
        prefetch_threshold: 1,
        prefetch_stop: PrefetchStopPolicy::WaitComplete,
        device_pages: 40,
        host_pages: 48,
        max_context_tokens: 96,
        rank,
        ..cfg()
    }
}

/// The plan with L3 keys stripped of their rank suffix (what must be equal across ranks).
fn normalized(p: &ExecutionPlan) -> ExecutionPlan {
    let strip = |ks: &mut Vec<String>| {
        for k in ks {
            if let Some((head, _)) = k.rsplit_once(':') {
                *k = head.to_string();
            }
        }
    };
    let mut p = p.clone();
    for op in &mut p.ops {
        match &mut op.spec {
            OpSpec::L3Query { keys }
            | OpSpec::Prefetch { keys, .. }
            | OpSpec::BackUp { keys, .. } => strip(keys),
            _ => {}
        }
    }
    p
}

struct Rank {
    s: Scheduler,
    e: Engine,
    agree: RankAgreement,
    rng: u64,
}

impl Rank {
    fn coin(&mut self) -> bool {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng & 1 == 0
    }

    /// Every op a chunk of the held forward waits for is no longer in flight.
    fn forward_ready(&self) -> bool {
        let Some(f) = &self.e.forward else {
            return false;
        };
        let live = self.s.in_flight_ops();
        f.prefill
            .iter()
            .flat_map(|c| c.waits_for.iter())
            .all(|w| !live.iter().any(|(o, _)| o == w))
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Agreed,
    Unreduced,
}

/// Runs the workload on two ranks; returns, per step, the two plans' digests and whether the
/// normalized plans were equal.
fn run(prompts: &[(u32, usize)], lost: &[usize], seed: u64, mode: Mode) -> Vec<(u64, u64, bool)> {
    let mut ranks: Vec<Rank> = (0..2)
        .map(|r| {
            let c = cfg_for(r);
            let mut e = Engine::new(&c);
            // Each rank's shard of every prompt page is in its L3, except what rank 1 lost.
            let kb = c.namespace.keys_for_rank(r);
            let mut n = 0;
            for &(p, len) in prompts {
                for h in kvtier_radix::page_hashes(&prompt(p, len), c.page_size, None) {
                    if !(r == 1 && lost.contains(&n)) {
                        e.l3.insert(kb.key(&h), h);
                    }
                    n += 1;
                }
            }
            Rank {
                s: Scheduler::new(c).unwrap(),
                e,
                agree: RankAgreement::new(),
                rng: seed.wrapping_mul(2 * r as u64 + 1) | 1,
            }
        })
        .collect();
    for (i, &(p, len)) in prompts.iter().enumerate() {
        for r in &mut ranks {
            r.e.submit(&mut r.s, i as u64, prompt(p, len), 3);
        }
    }
    let mut steps = Vec::new();
    for t in 0..3000u64 {
        if ranks.iter().all(|r| r.s.is_idle()) {
            break;
        }
        let plans: Vec<ExecutionPlan> = ranks
            .iter_mut()
            .map(|r| r.s.next_execution_plan(t))
            .collect();
        steps.push((
            plans[0].digest(),
            plans[1].digest(),
            normalized(&plans[0]) == normalized(&plans[1]),
        ));
        if mode == Mode::Unreduced && !steps.last().unwrap().2 {
            break; // diverged: the run is no longer meaningful
        }
        for (r, plan) in ranks.iter_mut().zip(plans) {
            r.e.take_plan(plan);
        }
        // Each rank finishes a random subset of its held ops.
        for r in &mut ranks {
            let mut i = 0;
            while i < r.e.held.len() {
                if r.coin() {
                    let op = r.e.held.remove(i);
                    let ev = r.e.execute_op(&op);
                    match mode {
                        Mode::Agreed => r.agree.push(ev).unwrap(),
                        Mode::Unreduced => r.s.on_event(ev).unwrap(),
                    }
                } else {
                    i += 1;
                }
            }
        }
        if mode == Mode::Agreed {
            let v0 = ranks[0].agree.values(&ranks[0].s);
            let v1 = ranks[1].agree.values(&ranks[1].s);
            assert_eq!(v0.len(), v1.len(), "ops in flight differ between ranks");
            let min: Vec<u64> = v0.iter().zip(&v1).map(|(a, b)| *a.min(b)).collect();
            for r in &mut ranks {
                let evs = r.agree.reduce(&r.s, |v| v.copy_from_slice(&min)).unwrap();
                for ev in evs {
                    r.s.on_event(ev).unwrap();
                }
            }
            if ranks.iter().all(|r| r.forward_ready()) {
                for r in &mut ranks {
                    r.e.complete_forward(&mut r.s);
                }
            }
        } else {
            for r in &mut ranks {
                if r.forward_ready() {
                    r.e.complete_forward(&mut r.s);
                }
            }
        }
    }
    if mode == Mode::Agreed {
        for r in &ranks {
            assert!(r.s.is_idle(), "rank not idle: {:?}", r.s.stats());
            assert_quiescent(&r.s);
        }
    }
    steps
}

fn workload() -> impl Strategy<Value = (Vec<(u32, usize)>, Vec<usize>, u64)> {
    (
        prop::collection::vec((0..4u32, 9..60usize), 1..8),
        prop::collection::vec(0..40usize, 0..12),
        1..u64::MAX,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn agreed_ranks_plan_identically_every_step((prompts, lost, seed) in workload()) {
        let steps = run(&prompts, &lost, seed, Mode::Agreed);
        for (i, (d0, d1, same)) in steps.into_iter().enumerate() {
            prop_assert!(same, "step {}: plans differ", i);
            prop_assert_eq!(d0, d1, "step {}: digests differ on equal plans", i);
        }
    }

    /// Without agreement, wherever the ranks' plans first differ the digests differ too (and
    /// they are equal at every step before it).
    #[test]
    fn the_digest_names_the_step_where_unreduced_ranks_diverge((prompts, lost, seed) in workload()) {
        let steps = run(&prompts, &lost, seed, Mode::Unreduced);
        for (i, (d0, d1, same)) in steps.iter().enumerate() {
            prop_assert_eq!(d0 == d1, *same, "step {}", i);
        }
    }
}

#[test]
fn unreduced_ranks_do_diverge() {
    // The agreement is needed: rank 1 lost shards, so without it the plans part ways.
    let prompts = [(1, 41), (2, 41), (1, 57)];
    let steps = run(&prompts, &[3, 12], 7, Mode::Unreduced);
    let first = steps.iter().position(|s| !s.2).expect("ranks diverged");
    assert_ne!(
        steps[first].0, steps[first].1,
        "the digest shows the divergence"
    );
    assert!(steps[..first].iter().all(|s| s.0 == s.1));
    // ... and with the agreement they do not.
    assert!(
        run(&prompts, &[3, 12], 7, Mode::Agreed)
            .iter()
            .all(|s| s.2 && s.0 == s.1)
    );
}

#[test]
fn agreement_rejects_forward_results_and_duplicates() {
    let mut a = RankAgreement::new();
    assert_eq!(
        a.push(Event::ForwardDone {
            step: StepId(1),
            outputs: vec![]
        }),
        Err(AgreementError::Forward)
    );
    a.push(Event::LoadBackDone {
        op: OpId(3),
        success: true,
    })
    .unwrap();
    assert_eq!(a.skip(OpId(3)), Err(AgreementError::Duplicate(OpId(3))));
    assert_eq!(a.pending(), 1);
}

/// Two L3 probes in flight on one scheduler (rank 0 of a pair).
fn two_probes() -> (Scheduler, OpId, OpId) {
    let mut s = Scheduler::new(cfg_for(0)).unwrap();
    let mut e = Engine::new(s.config());
    e.submit(&mut s, 1, prompt(1, 41), 2);
    e.submit(&mut s, 2, prompt(2, 41), 2);
    let plan = s.next_execution_plan(0);
    let ops: Vec<OpId> = plan.ops.iter().map(|o| o.id).collect();
    assert_eq!(ops.len(), 2);
    (s, ops[0], ops[1])
}

#[test]
fn a_reduced_value_above_this_ranks_own_is_refused() {
    // A SUM or MAX all-reduce configured by mistake: the "minimum" exceeds what this rank
    // reported (3 hit pages), or completes an op this rank has not finished. No MIN over
    // ranks can produce either; the reduction is refused and nothing is consumed.
    let (s, q0, q1) = two_probes();
    let mut a = RankAgreement::new();
    a.push(Event::L3QueryDone {
        op: q0,
        hit_pages: 3,
    })
    .unwrap();
    assert_eq!(a.values(&s), vec![4, 0]);
    for bad in [[5, 0], [4, 6], [0, 3], [SKIPPED, 0]] {
        let err = a.apply_reduced(&s, &bad).unwrap_err();
        assert!(
            matches!(err, AgreementError::NotMinimum { .. }),
            "{bad:?}: {err:?}"
        );
        let mut b = a.clone();
        assert_eq!(b.reduce(&s, |v| v.copy_from_slice(&bad)), Err(err));
        assert_eq!(a.pending(), 1);
    }
    assert_eq!(
        a.apply_reduced(&s, &[3, 0]).unwrap(),
        vec![Event::L3QueryDone {
            op: q0,
            hit_pages: 2
        }]
    );
    assert_eq!(a.pending(), 0);
    let _ = q1;
}

#[test]
fn a_batch_of_completions_is_checked_whole_before_any_is_applied() {
    let (mut s, q0, q1) = two_probes();
    let ok = |op| Event::L3QueryDone { op, hit_pages: 0 };
    let bad_batches = [
        (vec![ok(q0), ok(OpId(999))], "unknown op"),
        (vec![ok(q0), ok(q0)], "twice in the batch"),
        (
            vec![
                ok(q0),
                Event::BackUpDone {
                    op: q1,
                    success: true,
                },
            ],
            "wrong kind",
        ),
        (
            vec![
                ok(q0),
                Event::L3QueryDone {
                    op: q1,
                    hit_pages: 99,
                },
            ],
            "impossible payload",
        ),
        (
            vec![
                ok(q0),
                Event::ForwardDone {
                    step: StepId(1),
                    outputs: vec![],
                },
            ],
            "a forward result",
        ),
    ];
    for (batch, why) in bad_batches {
        assert!(s.on_op_events(batch).is_err(), "{why}");
        assert_eq!(s.in_flight_ops().len(), 2, "{why}: something was applied");
    }
    assert_eq!(s.on_op_events(vec![ok(q0), ok(q1)]), Ok(2));
    assert!(s.in_flight_ops().is_empty());
    s.check().unwrap();
}
