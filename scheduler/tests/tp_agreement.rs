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
        tp_ranks: 2,
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
    /// Completions fed unreduced; a loss applied on the rank that heard of it alone (the
    /// collective skipped by the other rank).
    Unreduced,
    /// Completions agreed; the rank that heard of a loss calls `Scheduler::l3_lost` /
    /// `l3_lost_all` directly, as a single-rank engine does: refused, nothing changes.
    Direct,
    /// Completions agreed; losses never reported (what `Direct` must be equal to).
    Silent,
}

/// What one rank's store lost at a step, while the other rank's store kept everything.
#[derive(Clone, Debug)]
enum Loss {
    /// The store lost these of its keys (indices into its sorted keys, modulo their number)
    /// and its journal reports them: the engine passes them on.
    Keys(Vec<usize>),
    /// The store lost one key (as `Keys`) and its journal overflowed: the engine can only say
    /// "everything may be lost" (`l3_lost_all`).
    All(usize),
}

/// Two ranks' inputs: prompts (seed, length, step at which both ranks receive it), the pages
/// (by index over the prompts' pages) rank 1's L3 lacks from the start, one-sided store losses
/// `(step, rank, loss)`, and the seed of each rank's op-completion order.
#[derive(Clone, Debug)]
struct Workload {
    prompts: Vec<(u32, usize, u64)>,
    missing: Vec<usize>,
    losses: Vec<(u64, u32, Loss)>,
    seed: u64,
}

impl Workload {
    fn at_start(prompts: &[(u32, usize)], missing: &[usize], seed: u64) -> Workload {
        Workload {
            prompts: prompts.iter().map(|&(p, l)| (p, l, 0)).collect(),
            missing: missing.to_vec(),
            losses: vec![],
            seed,
        }
    }
}

/// Removes `loss`'s keys from the rank's store; returns the keys its journal reports, or
/// `None` if it overflowed.
fn lose(r: &mut Rank, loss: &Loss) -> Option<Vec<String>> {
    let mut keys: Vec<String> = r.e.l3.keys().cloned().collect();
    keys.sort();
    let pick = |i: &usize| (!keys.is_empty()).then(|| keys[i % keys.len()].clone());
    let (gone, overflowed): (Vec<String>, bool) = match loss {
        Loss::Keys(ix) => (ix.iter().filter_map(pick).collect(), false),
        Loss::All(i) => (pick(i).into_iter().collect(), true),
    };
    for k in &gone {
        r.e.l3.remove(k);
    }
    (!overflowed).then_some(gone)
}

/// The rank that heard of a loss applies it alone: its own words and an empty report for the
/// other rank, while the other rank skips the collective (what a direct `l3_lost` did before
/// a tensor-parallel rank refused it).
fn one_sided(r: &mut Rank, reported: Option<&[String]>) {
    let mut a = RankAgreement::new();
    match reported {
        Some(keys) => {
            a.lost(&r.s, keys);
        }
        None => a.lost_all(),
    }
    let words = [a.loss_words(), RankAgreement::new().loss_words()];
    a.apply_losses(&mut r.s, &words).unwrap();
}

/// A single-rank engine's loss report on a tensor-parallel rank (`keys`, or an overflow when
/// `None`): every direct call (`l3_lost` or `l3_lost_all`, and `l3_lost_pages`) is refused
/// with the typed error naming the agreement, and changes nothing (not even the statistics).
fn assert_direct_losses_refused(s: &mut Scheduler, keys: Option<&[String]>) {
    let before = s.stats();
    let refusal = Err(SchedulerError::LossNeedsAgreement {
        rank: s.config().rank,
        tp_ranks: s.config().tp_ranks,
    });
    let kb = s
        .config()
        .namespace
        .keys_for(s.config().page_size, s.config().rank);
    let pages: Vec<kvtier_radix::PageHash> = keys
        .unwrap_or_default()
        .iter()
        .filter_map(|k| kb.page_of(k))
        .collect();
    match keys {
        Some(keys) => assert_eq!(s.l3_lost(keys), refusal),
        None => assert_eq!(s.l3_lost_all(), refusal),
    }
    assert_eq!(s.l3_lost_pages(&pages), refusal);
    if let Err(e) = refusal {
        let msg = e.to_string();
        assert!(
            msg.contains("RankAgreement::lost") && msg.contains("agree_losses"),
            "{msg}"
        );
    }
    assert_eq!(s.stats(), before, "a refused call changed something");
}

/// Runs the workload on two ranks; returns, per step, the two plans' digests and whether the
/// normalized plans were equal.
fn run(w: &Workload, mode: Mode) -> Vec<(u64, u64, bool)> {
    let mut ranks: Vec<Rank> = (0..2)
        .map(|r| {
            let c = cfg_for(r);
            let mut e = Engine::new(&c);
            // Each rank's shard of every prompt page is in its L3, except what rank 1 lacks.
            let kb = c.namespace.keys_for(c.page_size, r);
            let mut n = 0;
            for &(p, len, _) in &w.prompts {
                for h in kvtier_radix::page_hashes(&prompt(p, len), c.page_size, None) {
                    if !(r == 1 && w.missing.contains(&n)) {
                        e.l3.insert(kb.key(&h), h);
                    }
                    n += 1;
                }
            }
            Rank {
                s: Scheduler::new(c).unwrap(),
                e,
                agree: RankAgreement::new(),
                rng: w.seed.wrapping_mul(2 * r as u64 + 1) | 1,
            }
        })
        .collect();
    let last_input = w
        .prompts
        .iter()
        .map(|p| p.2)
        .chain(w.losses.iter().map(|l| l.0))
        .max()
        .unwrap_or(0);
    let mut steps = Vec::new();
    for t in 0..3000u64 {
        if t > last_input && ranks.iter().all(|r| r.s.is_idle()) {
            break;
        }
        for (i, &(p, len, at)) in w.prompts.iter().enumerate() {
            if at == t {
                for r in &mut ranks {
                    r.e.submit(&mut r.s, i as u64, prompt(p, len), 3);
                }
            }
        }
        // One rank's store loses objects; only that rank's engine hears of it.
        for (at, rank, loss) in &w.losses {
            if *at != t {
                continue;
            }
            let r = &mut ranks[*rank as usize];
            let reported = lose(r, loss);
            match (mode, reported) {
                (Mode::Agreed, Some(keys)) => {
                    r.agree.lost(&r.s, &keys);
                }
                (Mode::Agreed, None) => r.agree.lost_all(),
                (Mode::Unreduced, reported) => one_sided(r, reported.as_deref()),
                (Mode::Direct, reported) => {
                    assert_direct_losses_refused(&mut r.s, reported.as_deref())
                }
                (Mode::Silent, _) => {}
            }
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
                        Mode::Unreduced => r.s.on_event(ev).unwrap(),
                        _ => r.agree.push(ev).unwrap(),
                    }
                } else {
                    i += 1;
                }
            }
        }
        if mode != Mode::Unreduced {
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
            // The losses: every rank's words all-gathered, the union applied on every rank.
            let words: Vec<Vec<u64>> = ranks.iter_mut().map(|r| r.agree.loss_words()).collect();
            for r in &mut ranks {
                r.agree.apply_losses(&mut r.s, &words).unwrap();
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
    if mode != Mode::Unreduced {
        for r in &ranks {
            assert!(r.s.is_idle(), "rank not idle: {:?}", r.s.stats());
            assert_quiescent(&r.s);
        }
    }
    steps
}

fn loss() -> impl Strategy<Value = Loss> {
    prop_oneof![
        4 => prop::collection::vec(0..64usize, 1..5).prop_map(Loss::Keys),
        1 => (0..64usize).prop_map(Loss::All),
    ]
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        prop::collection::vec((0..4u32, 9..60usize, 0..60u64), 1..8),
        prop::collection::vec(0..40usize, 0..12),
        prop::collection::vec((0..80u64, 0..2u32, loss()), 0..5),
        1..u64::MAX,
    )
        .prop_map(|(prompts, missing, losses, seed)| Workload {
            prompts,
            missing,
            losses,
            seed,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Ops finish at different times on each rank, rank 1's L3 lacks some shards, and either
    /// rank's store loses objects mid-run (reported to that rank only, or its journal
    /// overflows): with the agreement every plan is the same on both ranks.
    #[test]
    fn agreed_ranks_plan_identically_every_step(w in workload()) {
        let steps = run(&w, Mode::Agreed);
        for (i, (d0, d1, same)) in steps.into_iter().enumerate() {
            prop_assert!(same, "step {}: plans differ", i);
            prop_assert_eq!(d0, d1, "step {}: digests differ on equal plans", i);
        }
    }

    /// A tensor-parallel rank's direct loss report (`l3_lost`, `l3_lost_all`, `l3_lost_pages`)
    /// is refused with `LossNeedsAgreement` and changes nothing: step for step, the run is the
    /// one in which the losses were never reported, and the ranks still plan identically.
    #[test]
    fn a_tp_ranks_direct_loss_report_is_refused_and_changes_nothing(w in workload()) {
        let direct = run(&w, Mode::Direct);
        prop_assert_eq!(&direct, &run(&w, Mode::Silent));
        for (i, (d0, d1, same)) in direct.into_iter().enumerate() {
            prop_assert!(same && d0 == d1, "step {}: plans differ", i);
        }
    }

    /// Without agreement, wherever the ranks' plans first differ the digests differ too (and
    /// they are equal at every step before it).
    #[test]
    fn the_digest_names_the_step_where_unreduced_ranks_diverge(w in workload()) {
        let steps = run(&w, Mode::Unreduced);
        for (i, (d0, d1, same)) in steps.iter().enumerate() {
            prop_assert_eq!(d0 == d1, *same, "step {}", i);
        }
    }
}

#[test]
fn unreduced_ranks_do_diverge() {
    // The agreement is needed: rank 1 lacks shards, so without it the plans part ways.
    let w = Workload::at_start(&[(1, 41), (2, 41), (1, 57)], &[3, 12], 7);
    let steps = run(&w, Mode::Unreduced);
    let first = steps.iter().position(|s| !s.2).expect("ranks diverged");
    assert_ne!(
        steps[first].0, steps[first].1,
        "the digest shows the divergence"
    );
    assert!(steps[..first].iter().all(|s| s.0 == s.1));
    // ... and with the agreement they do not.
    assert!(run(&w, Mode::Agreed).iter().all(|s| s.2 && s.0 == s.1));
}

/// Issue 19's case: same requests, every op answered identically, but rank 0's store lost 3
/// keys of its shard and only rank 0 is told. Unagreed, the next finish backs the pages up
/// on rank 0 only; agreed, both ranks forget them and back them up in the same step. The
/// same with a journal overflow on rank 1 (`l3_lost_all` on one rank).
#[test]
fn one_sided_losses_are_agreed_across_ranks() {
    for (rank, loss) in [(0, Loss::Keys(vec![0, 1, 2])), (1, Loss::All(0))] {
        let w = Workload {
            prompts: vec![(1, 41, 0), (1, 45, 40)],
            missing: vec![],
            losses: vec![(30, rank, loss.clone())],
            seed: 11,
        };
        let steps = run(&w, Mode::Unreduced);
        assert!(
            steps.iter().any(|s| !s.2 && s.0 != s.1),
            "{loss:?} on rank {rank}: unagreed ranks diverge"
        );
        let steps = run(&w, Mode::Agreed);
        assert!(steps.len() > 40, "the second request ran");
        for (i, s) in steps.iter().enumerate() {
            assert!(
                s.2 && s.0 == s.1,
                "{loss:?} on rank {rank}: step {i} differs"
            );
        }
    }
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

#[test]
fn bad_loss_words_are_refused_and_change_nothing() {
    let c = cfg_for(0);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 41), 2);
    e.run_to_idle(&mut s, 400);
    let hashes = kvtier_radix::page_hashes(&prompt(1, 41), c.page_size, None);
    let mut a = RankAgreement::new();
    let keys = s.l3_keys(&hashes[..3]);
    let other_rank = c.namespace.keys_for(c.page_size, 1).key(&hashes[0]);
    assert_eq!(a.lost(&s, &[keys[0].clone(), other_rank, "junk".into()]), 1);
    let mine = a.loss_words();
    let mut padded = mine.clone();
    padded.extend([0, 0]);
    let none = vec![LOSS_WORDS_TAG, 0, 0];
    let bad: Vec<(Vec<Vec<u64>>, &str)> = vec![
        (vec![mine.clone(), vec![1, 2, 3]], "not loss words"),
        (vec![mine.clone(), vec![LOSS_WORDS_TAG, 0, 2]], "short"),
        (vec![mine.clone(), vec![LOSS_WORDS_TAG, 3, 0]], "flag"),
        (vec![none.clone(), none.clone()], "own losses left out"),
        (vec![mine.clone()], "one rank's words of two"),
        (vec![mine.clone(), none.clone(), none], "three ranks' words"),
    ];
    for (g, why) in bad {
        assert!(a.apply_losses(&mut s, &g).is_err(), "{why}");
        assert_eq!(a.pending_losses(), (1, false), "{why}");
    }
    assert_eq!(s.stats().l3_lost_nodes, 0, "nothing applied");
    // The other rank reports a loss of its own: the union clears both pages' marks here.
    let mut b = RankAgreement::new();
    let s1 = Scheduler::new(cfg_for(1)).unwrap();
    let k1 = c.namespace.keys_for(c.page_size, 1).key(&hashes[2]);
    assert_eq!(b.lost(&s1, &[k1]), 1);
    assert!(a.apply_losses(&mut s, &[b.loss_words(), padded]).unwrap() >= 1);
    assert_eq!(a.pending_losses(), (0, false));
}

/// A scheduler that ran `prompt(1, 41)` to idle: its pages are marked in L3.
fn served(c: &SchedulerConfig) -> Scheduler {
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(c);
    e.submit(&mut s, 1, prompt(1, 41), 2);
    e.run_to_idle(&mut s, 400);
    s
}

/// Issue 33 (5a): a scheduler that is one rank of several refuses a direct loss report with
/// a typed error naming the agreement, and nothing changes; the same loss through the
/// agreement is applied. A single-rank scheduler keeps the direct calls.
#[test]
fn a_tp_rank_refuses_direct_losses_and_a_single_rank_keeps_them() {
    let hashes = kvtier_radix::page_hashes(&prompt(1, 41), 4, None);
    for rank in [0, 1] {
        let c = cfg_for(rank);
        let mut s = served(&c);
        let keys = s.l3_keys(&hashes[..3]);
        let before = s.stats();
        assert_direct_losses_refused(&mut s, Some(&keys));
        assert_direct_losses_refused(&mut s, None);
        s.check().unwrap();
        // Through the agreement (the other rank reported nothing): applied.
        let mut a = RankAgreement::new();
        assert_eq!(a.lost(&s, &keys), 3);
        let words = [a.loss_words(), RankAgreement::new().loss_words()];
        assert!(a.apply_losses(&mut s, &words).unwrap() >= 1);
        assert!(s.stats().l3_lost_nodes > before.l3_lost_nodes);
    }
    let single = SchedulerConfig {
        tp_ranks: 1,
        ..cfg_for(0)
    };
    let mut s = served(&single);
    let keys = s.l3_keys(&hashes[..3]);
    assert!(s.l3_lost(&keys).unwrap() >= 1);
    assert_eq!(s.l3_lost_pages(&hashes[..3]), Ok(0), "already cleared");
    assert!(s.l3_lost_all().is_ok());
}

/// The agreement checks that the scheduler knows its group: gathered words of another number
/// of ranks than `tp_ranks` are refused (a rank-0 engine that left `tp_ranks` at 1 is caught at
/// its first agreement), and nothing changes.
#[test]
fn losses_gathered_from_another_number_of_ranks_than_tp_ranks_are_refused() {
    let hashes = kvtier_radix::page_hashes(&prompt(1, 41), 4, None);
    for (tp_ranks, gathered) in [(1u32, 2usize), (2, 1), (2, 3)] {
        let c = SchedulerConfig {
            tp_ranks,
            ..cfg_for(0)
        };
        let mut s = served(&c);
        let mut a = RankAgreement::new();
        assert_eq!(a.lost(&s, &s.l3_keys(&hashes[..2])), 2);
        let mut words = vec![RankAgreement::new().loss_words(); gathered];
        words[0] = a.loss_words();
        let err = a.agree_losses(&mut s, |_| words.clone()).unwrap_err();
        assert_eq!(
            err,
            AgreementError::RankCount {
                got: gathered,
                tp_ranks
            }
        );
        assert!(err.to_string().contains("tp_ranks"), "{err}");
        assert_eq!(a.pending_losses(), (2, false));
        assert_eq!(s.stats().l3_lost_nodes, 0, "nothing applied");
    }
}

#[test]
fn a_rank_outside_its_group_is_a_config_error() {
    let bad = [
        (
            SchedulerConfig {
                tp_ranks: 0,
                ..cfg_for(0)
            },
            ConfigError::Zero { field: "tp_ranks" },
        ),
        (
            SchedulerConfig {
                rank: 2,
                ..cfg_for(0)
            },
            ConfigError::RankOutOfRange {
                rank: 2,
                tp_ranks: 2,
            },
        ),
        (
            SchedulerConfig {
                rank: 1,
                tp_ranks: 1,
                ..cfg_for(0)
            },
            ConfigError::RankOutOfRange {
                rank: 1,
                tp_ranks: 1,
            },
        ),
        (
            SchedulerConfig {
                l3_sharing: L3Sharing::Replicated { leader: 2 },
                ..cfg_for(0)
            },
            ConfigError::LeaderOutOfRange {
                leader: 2,
                tp_ranks: 2,
            },
        ),
    ];
    for (c, want) in bad {
        assert_eq!(Scheduler::new(c).err(), Some(want));
    }
}
