//! What a `RankAgreement` accepts from its rank: an agreed event is exactly one every rank
//! reported (or skipped), of the op's kind, within the op's bounds, for an op in flight when
//! it is agreed. A completion of another kind, a count above what the op asked for, or a
//! record of an op that is not in flight never becomes an event: the first two are a typed
//! error that changes nothing (raised after the collective, which the rank enters with that op
//! "not done", so no rank is left waiting in it), the last is dropped.

mod chains;
mod common;
use chains::chain;
use common::*;
use kvtier_radix::EvictionPolicy;
use kvtier_scheduler::*;

fn cfg_for(rank: u32) -> SchedulerConfig {
    SchedulerConfig {
        l3_enabled: true,
        prefetch_threshold: 1,
        rank,
        tp_ranks: 2,
        ..cfg()
    }
}

/// Two ranks' schedulers that planned `n` requests' L3 probes (41 tokens: 10 keys each).
fn probing(n: u64) -> (Vec<Scheduler>, Vec<OpId>) {
    probing_with(n, L3Sharing::PerRank)
}

/// [`probing`] with `sharing` (replicated: only the leader runs the probes).
fn probing_with(n: u64, sharing: L3Sharing) -> (Vec<Scheduler>, Vec<OpId>) {
    let mut ranks: Vec<Scheduler> = (0..2)
        .map(|r| {
            Scheduler::new(SchedulerConfig {
                l3_sharing: sharing,
                ..cfg_for(r)
            })
            .unwrap()
        })
        .collect();
    let mut ops = Vec::new();
    for s in &mut ranks {
        let mut e = Engine::new(s.config());
        for i in 0..n {
            e.submit(s, i + 1, prompt(i as u32 + 1, 41), 2);
        }
        ops = s.next_execution_plan(0).ops.iter().map(|o| o.id).collect();
    }
    assert_eq!(ops.len(), n as usize);
    (ranks, ops)
}

/// The element-wise minimum of every rank's values (an in-process all-reduce).
fn min_of(ranks: &[Scheduler], agrees: &[RankAgreement]) -> Vec<u64> {
    let vs: Vec<Vec<u64>> = agrees.iter().zip(ranks).map(|(a, s)| a.values(s)).collect();
    (0..vs[0].len())
        .map(|i| vs.iter().map(|v| v[i]).min().unwrap())
        .collect()
}

fn l3_done(op: OpId, hit_pages: u32) -> Event {
    Event::L3QueryDone { op, hit_pages }
}

#[test]
fn a_completion_of_another_kind_is_refused_and_never_agreed() {
    // The tester's case: rank 0 answers an L3 probe with LoadBackDone, rank 1 with BackUpDone.
    // `Scheduler::on_event` refuses either (WrongCompletionKind); the agreement must not turn
    // them into L3QueryDone { hit_pages: 1 } (a prefetch of an L3 hit nobody reported).
    let (ranks, ops) = probing(1);
    let q = ops[0];
    let mut agrees = [RankAgreement::new(), RankAgreement::new()];
    agrees[0]
        .push(Event::LoadBackDone {
            op: q,
            success: true,
        })
        .unwrap();
    agrees[1]
        .push(Event::BackUpDone {
            op: q,
            success: true,
        })
        .unwrap();
    let min = min_of(&ranks, &agrees);
    assert_eq!(
        min,
        vec![0],
        "a record of another kind contributes 'not done'"
    );
    for ((a, s), claimed) in agrees
        .iter_mut()
        .zip(&ranks)
        .zip([OpKind::LoadBack, OpKind::BackUp])
    {
        let want = AgreementError::WrongKind {
            op: q,
            kind: OpKind::L3Query,
            claimed,
        };
        let mut entered = false;
        let r = a.reduce(s, |v| {
            entered = true;
            v.copy_from_slice(&min)
        });
        assert_eq!(r, Err(want.clone()));
        assert!(entered, "enters the collective, then refuses");
        assert_eq!(a.check(s), Err(want.clone()));
        assert_eq!(a.apply_reduced(s, &min), Err(want));
        assert_eq!(a.pending(), 1, "nothing consumed");
        assert_eq!(a.dropped(), 0);
        assert_eq!(s.in_flight_ops().len(), 1);
    }
    // Ranks disagreeing on the kind: rank 1 answered right, rank 0 wrong. Rank 1's reduction
    // yields nothing (rank 0 contributed "not done"); rank 0's is refused.
    let (ranks, ops) = probing(1);
    let q = ops[0];
    let mut agrees = [RankAgreement::new(), RankAgreement::new()];
    agrees[0]
        .push(Event::WriteBackDone {
            op: q,
            success: true,
        })
        .unwrap();
    agrees[1].push(l3_done(q, 4)).unwrap();
    let min = min_of(&ranks, &agrees);
    assert_eq!(agrees[1].apply_reduced(&ranks[1], &min), Ok(vec![]));
    assert!(matches!(
        agrees[0].apply_reduced(&ranks[0], &min),
        Err(AgreementError::WrongKind {
            claimed: OpKind::WriteBack,
            ..
        })
    ));
    // A checked push refuses it at once.
    let mut a = RankAgreement::new();
    assert_eq!(
        a.push_checked(
            &ranks[0],
            Event::WriteBackDone {
                op: q,
                success: true
            }
        ),
        Err(AgreementError::WrongKind {
            op: q,
            kind: OpKind::L3Query,
            claimed: OpKind::WriteBack
        })
    );
    assert_eq!(a.pending(), 0);
    a.push_checked(&ranks[0], l3_done(q, 4)).unwrap();
    assert_eq!((agrees[0].pending(), agrees[1].pending()), (1, 1));
}

#[test]
fn a_count_above_the_ops_is_refused_before_anything_is_consumed() {
    // hit_pages 999 on every rank (10 keys probed): the minimum is 999 and no rank's value
    // is above its own, but `on_event` would refuse it after the record was consumed.
    let (mut ranks, ops) = probing(1);
    let mut agrees = [RankAgreement::new(), RankAgreement::new()];
    for a in &mut agrees {
        a.push(l3_done(ops[0], 999)).unwrap();
    }
    let min = min_of(&ranks, &agrees);
    for (a, s) in agrees.iter_mut().zip(&mut ranks) {
        let mut entered = false;
        let r = a.reduce(s, |v| {
            entered = true;
            v.copy_from_slice(&min)
        });
        let want = AgreementError::TooMany {
            op: ops[0],
            kind: OpKind::L3Query,
            got: 999,
            most: 10,
        };
        assert_eq!(r, Err(want.clone()));
        assert!(entered, "enters the collective, then refuses");
        assert_eq!(a.pending(), 1, "the record stays");
        assert_eq!(
            RankAgreement::new().push_checked(s, l3_done(ops[0], 11)),
            Err(AgreementError::TooMany {
                op: ops[0],
                kind: OpKind::L3Query,
                got: 11,
                most: 10
            })
        );
        assert_eq!(s.in_flight_ops().len(), 1);
    }
    // Exactly the keys probed is a valid answer.
    let mut agrees = [RankAgreement::new(), RankAgreement::new()];
    for a in &mut agrees {
        a.push(l3_done(ops[0], 10)).unwrap();
    }
    let min = min_of(&ranks, &agrees);
    for (a, s) in agrees.iter_mut().zip(&mut ranks) {
        let evs = a.reduce(s, |v| v.copy_from_slice(&min)).unwrap();
        assert_eq!(evs, vec![l3_done(ops[0], 10)]);
        s.on_op_events(evs).unwrap();
    }
}

#[test]
fn a_record_of_an_op_not_yet_issued_does_not_complete_it_later() {
    // Op ids are sequential: rank 0's engine pushes a completion for the id the next op will
    // get. It must not answer that op once issued (rank 0 never ran it).
    let (mut ranks, ops) = probing(1);
    let next = OpId(ops[0].0 + 1);
    let mut agrees = [RankAgreement::new(), RankAgreement::new()];
    agrees[0].push(l3_done(next, 5)).unwrap();
    let min = min_of(&ranks, &agrees);
    for (a, s) in agrees.iter_mut().zip(&ranks) {
        assert_eq!(a.apply_reduced(s, &min), Ok(vec![]));
    }
    assert_eq!(agrees[0].pending(), 0, "dropped: its op is not in flight");
    assert_eq!(agrees[0].dropped(), 1);
    // Checked, it is refused at once.
    assert_eq!(
        RankAgreement::new().push_checked(&ranks[0], l3_done(next, 5)),
        Err(AgreementError::NotInFlight(next))
    );
    assert_eq!(
        RankAgreement::new().skip_checked(&ranks[0], next),
        Err(AgreementError::NotInFlight(next))
    );
    // The op is issued now; rank 1 answers it, rank 0 has not.
    let mut issued = Vec::new();
    for s in &mut ranks {
        let mut e = Engine::new(s.config());
        e.submit(s, 9, prompt(9, 41), 2);
        issued = s.next_execution_plan(1).ops.iter().map(|o| o.id).collect();
    }
    assert_eq!(issued, vec![next]);
    agrees[1].push(l3_done(next, 5)).unwrap();
    let min = min_of(&ranks, &agrees);
    for (a, s) in agrees.iter_mut().zip(&ranks) {
        assert_eq!(
            a.apply_reduced(s, &min),
            Ok(vec![]),
            "rank 0 has not run it"
        );
    }
}

#[test]
fn a_duplicate_of_an_agreed_completion_is_dropped_not_kept() {
    let (ranks, ops) = probing(2);
    let mut agrees = [RankAgreement::new(), RankAgreement::new()];
    for a in &mut agrees {
        a.push(l3_done(ops[0], 3)).unwrap();
    }
    let min = min_of(&ranks, &agrees);
    for (a, s) in agrees.iter_mut().zip(&ranks) {
        assert_eq!(a.apply_reduced(s, &min).unwrap(), vec![l3_done(ops[0], 3)]);
    }
    // Applied on both ranks; then rank 0 pushes the same completion again, and a completion
    // of an op id that was never issued.
    let mut ranks = ranks;
    for s in &mut ranks {
        s.on_event(l3_done(ops[0], 3)).unwrap();
    }
    agrees[0].push(l3_done(ops[0], 3)).unwrap();
    agrees[0].push(l3_done(OpId(12345), 1)).unwrap();
    let min = min_of(&ranks, &agrees);
    assert_eq!(agrees[0].apply_reduced(&ranks[0], &min), Ok(vec![]));
    assert_eq!(
        agrees[0].pending(),
        0,
        "records of ops not in flight are dropped"
    );
    assert_eq!((agrees[0].dropped(), agrees[1].dropped()), (2, 0));
    assert_eq!(
        agrees[0].push_checked(&ranks[0], l3_done(ops[0], 3)),
        Err(AgreementError::NotInFlight(ops[0]))
    );
    agrees[0]
        .push_checked(&ranks[0], l3_done(ops[1], 3))
        .unwrap();
    assert_eq!(
        agrees[0].push_checked(&ranks[0], l3_done(ops[1], 3)),
        Err(AgreementError::Duplicate(ops[1]))
    );
}

#[test]
fn an_offload_managers_job_is_not_completed_by_another_kind() {
    // A backup job answered with PrefetchDone on rank 0 and L3QueryDone on rank 1 became
    // BackUpDone { success: true }: its pages were marked in L3 though no backup ran.
    let a = chain(1, 2);
    let mut m = OffloadManager::new(4, EvictionPolicy::Lru).unwrap();
    m.set_l3_backups(L3Backups::WriteThrough);
    m.set_tp_ranks(2).unwrap();
    let s = m.prepare_store(&a, 2).unwrap().unwrap();
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    let bs = m.plan_backups();
    assert_eq!(bs.len(), 1);
    let op = OpId(bs[0].job);
    let mut ranks = vec![RankAgreement::new(), RankAgreement::new()];
    ranks[0]
        .push(Event::PrefetchDone { op, completed: 1 })
        .unwrap();
    ranks[1].push(l3_done(op, 7)).unwrap();
    assert_eq!(
        m.agree_in_process(&mut ranks),
        Err(AgreementError::WrongKind {
            op,
            kind: OpKind::BackUp,
            claimed: OpKind::Prefetch
        })
    );
    assert_eq!(m.backups_pending(), (0, 1), "the backup is still in flight");
    assert_eq!(m.l3_known(), 0, "nothing marked in L3");
    assert_eq!((ranks[0].pending(), ranks[1].pending()), (1, 1));
    m.check().unwrap();
    // One rank right, the other wrong: refused as a whole, the right one not consumed.
    let mut ranks = vec![RankAgreement::new(), RankAgreement::new()];
    ranks[0]
        .push(Event::BackUpDone { op, success: true })
        .unwrap();
    ranks[1]
        .push(Event::PrefetchDone { op, completed: 1 })
        .unwrap();
    assert!(matches!(
        m.agree_in_process(&mut ranks),
        Err(AgreementError::WrongKind { .. })
    ));
    assert_eq!((ranks[0].pending(), ranks[1].pending()), (1, 1));
    assert_eq!((m.backups_pending(), m.l3_known()), ((0, 1), 0));
    m.check().unwrap();
}

/// An adversarial tester's wrong data: a rank's skip says another rank answers for all, and
/// was taken for an op this rank runs itself. An OffloadManager rank that skipped its
/// prefetch got `PrefetchDone(3)` from the other rank's answer and served 3 pages it never
/// read; a per-rank scheduler's skip of its own probe took the other rank's hit count; a
/// replicated leader's skip of its own probe left every value SKIPPED, so the probe never
/// ended (both ranks Querying after 50 steps). Refused now: at once when checked, after the
/// collective (entered with every op "not done") when not.
#[test]
fn a_rank_cannot_skip_an_op_it_runs() {
    // Per-rank keys: every rank runs its probe.
    let (ranks, ops) = probing(1);
    let op = ops[0];
    let must = AgreementError::MustRun {
        op,
        kind: OpKind::L3Query,
    };
    assert_eq!(
        RankAgreement::new().skip_checked(&ranks[1], op),
        Err(must.clone())
    );
    let mut agrees = [RankAgreement::new(), RankAgreement::new()];
    agrees[0].push(l3_done(op, 7)).unwrap();
    agrees[1].skip(op).unwrap();
    let min = min_of(&ranks, &agrees);
    assert_eq!(
        min,
        vec![0],
        "the skipping rank enters with the op not done"
    );
    assert_eq!(
        agrees[1].reduce(&ranks[1], |v| v.copy_from_slice(&min)),
        Err(must)
    );
    assert_eq!(
        agrees[0].reduce(&ranks[0], |v| v.copy_from_slice(&min)),
        Ok(vec![])
    );
    assert_eq!(
        agrees[1].pending(),
        1,
        "the refused skip is kept: nothing changed"
    );

    // Replicated keys: the leader runs the probe (may not skip it), the other rank does not.
    let (ranks, ops) = probing_with(1, L3Sharing::Replicated { leader: 0 });
    let op = ops[0];
    assert_eq!(
        RankAgreement::new().skip_checked(&ranks[0], op),
        Err(AgreementError::MustRun {
            op,
            kind: OpKind::L3Query
        })
    );
    let mut agrees = [RankAgreement::new(), RankAgreement::new()];
    agrees[0].push(l3_done(op, 7)).unwrap();
    agrees[1].skip_checked(&ranks[1], op).unwrap();
    let min = min_of(&ranks, &agrees);
    for (a, s) in agrees.iter_mut().zip(&ranks) {
        assert_eq!(
            a.reduce(s, |v| v.copy_from_slice(&min)),
            Ok(vec![l3_done(op, 7)])
        );
    }

    // The offloading manager has no leader: every rank runs every job.
    let mut m = OffloadManager::new(32, EvictionPolicy::Lru).unwrap();
    m.set_l3_backups(L3Backups::WriteThrough);
    m.set_tp_ranks(2).unwrap();
    let c = chain(40, 3);
    chains::found_by_every_rank(&mut m, &c);
    let job = m.prepare_prefetch(&c, 3).unwrap().unwrap().job;
    let op = OpId(job);
    assert_eq!(
        RankAgreement::new().skip_checked(&m, op),
        Err(AgreementError::MustRun {
            op,
            kind: OpKind::Prefetch
        })
    );
    let mut ranks = vec![RankAgreement::new(), RankAgreement::new()];
    ranks[0]
        .push(Event::PrefetchDone { op, completed: 3 })
        .unwrap();
    ranks[1].skip(op).unwrap();
    let known = m.l3_known();
    assert!(matches!(
        m.agree_in_process(&mut ranks),
        Err(AgreementError::MustRun { .. })
    ));
    assert_eq!(m.l3_known(), known, "no page landed");
    assert_eq!(m.agreed_ops(), vec![(op, OpKind::Prefetch)]);
    m.check().unwrap();
}

/// What one rank recorded for one op: nothing, a skip, or a completion of a kind (index into
/// `KINDS`) with a count (or success: even counts succeed).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Rec {
    None,
    Skip,
    Done(usize, u32),
}

const KINDS: [OpKind; 5] = [
    OpKind::L3Query,
    OpKind::Prefetch,
    OpKind::LoadBack,
    OpKind::WriteBack,
    OpKind::BackUp,
];

fn event_of(kind: OpKind, op: OpId, n: u32) -> Event {
    let success = n.is_multiple_of(2);
    match kind {
        OpKind::L3Query => Event::L3QueryDone { op, hit_pages: n },
        OpKind::Prefetch => Event::PrefetchDone { op, completed: n },
        OpKind::LoadBack => Event::LoadBackDone { op, success },
        OpKind::WriteBack => Event::WriteBackDone { op, success },
        OpKind::BackUp => Event::BackUpDone { op, success },
    }
}

fn record(a: &mut RankAgreement, op: OpId, r: Rec) {
    match r {
        Rec::None => {}
        Rec::Skip => a.skip(op).unwrap(),
        Rec::Done(k, n) => a.push(event_of(KINDS[k], op, n)).unwrap(),
    }
}

fn rec() -> impl Strategy<Value = Rec> {
    prop_oneof![
        2 => Just(Rec::None),
        1 => Just(Rec::Skip),
        3 => (0..5usize, 0..13u32).prop_map(|(k, n)| Rec::Done(k, n)),
        3 => (0..12u32).prop_map(|n| Rec::Done(0, n)),
    ]
}

use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Two ranks' records over `n` L3 probes in flight (10 keys each) and over op ids not in
    /// flight (the ids after them): a rank whose completion of an op in flight is of another
    /// kind or above 10 is refused before the collective with that typed error and nothing
    /// of it changes; its values never complete that op on any rank. When no rank is refused,
    /// every rank gets the same events: one per op in flight every rank answered or skipped
    /// (not all skipped), of the op's kind, with the minimum count; the scheduler takes them
    /// all, the other ops' records stay, and the records of ops not in flight are dropped.
    #[test]
    fn an_agreed_event_is_exactly_one_every_rank_reported(
        n in 1..4u64,
        recs in prop::collection::vec((rec(), rec()), 6),
    ) {
        // Rank 0 leads: it runs the probes and may not skip them; rank 1 may.
        let (mut ranks, ops) = probing_with(n, L3Sharing::Replicated { leader: 0 });
        let ids: Vec<OpId> = (0..6).map(|i| OpId(ops[0].0 + i)).collect();
        let mut agrees = [RankAgreement::new(), RankAgreement::new()];
        for (op, (r0, r1)) in ids.iter().zip(&recs) {
            record(&mut agrees[0], *op, *r0);
            record(&mut agrees[1], *op, *r1);
        }
        let live = &recs[..n as usize];
        let wrong = |r: Rec| matches!(r, Rec::Done(k, h) if k != 0 || h > 10);
        let bad_of = |rank: usize, r: Rec| wrong(r) || (rank == 0 && r == Rec::Skip);
        let min = min_of(&ranks, &agrees);
        for (i, (r0, r1)) in live.iter().enumerate() {
            if bad_of(0, *r0) || wrong(*r1) {
                prop_assert_eq!(min[i], 0, "a refused record never completes its op");
            }
        }
        let refused: Vec<bool> = (0..2)
            .map(|r| live.iter().any(|p| bad_of(r, if r == 0 { p.0 } else { p.1 })))
            .collect();
        if refused.iter().any(|b| *b) {
            for (r, (a, s)) in agrees.iter_mut().zip(&ranks).enumerate() {
                let before = (a.pending(), a.values(s), a.dropped());
                let mut entered = false;
                let got = a.reduce(s, |v| {
                    entered = true;
                    v.copy_from_slice(&min)
                });
                if refused[r] {
                    let first = live
                        .iter()
                        .zip(&ops)
                        .find(|(p, _)| bad_of(r, if r == 0 { p.0 } else { p.1 }))
                        .unwrap();
                    let (k, h) = match if r == 0 { first.0.0 } else { first.0.1 } {
                        Rec::Done(k, h) => (k, h),
                        _ => (usize::MAX, 0),
                    };
                    let want = if k == usize::MAX {
                        AgreementError::MustRun { op: *first.1, kind: OpKind::L3Query }
                    } else if k != 0 {
                        AgreementError::WrongKind { op: *first.1, kind: OpKind::L3Query, claimed: KINDS[k] }
                    } else {
                        AgreementError::TooMany { op: *first.1, kind: OpKind::L3Query, got: h, most: 10 }
                    };
                    prop_assert_eq!(got, Err(want));
                    prop_assert!(entered);
                    prop_assert_eq!((a.pending(), a.values(s), a.dropped()), before);
                } else {
                    // The refused rank entered the collective too, with every op "not
                    // done": this one agrees nothing (the refused rank applies nothing, and
                    // an op agreed here alone would part the ranks' plans).
                    prop_assert_eq!(got, Ok(vec![]));
                }
            }
            prop_assert_eq!(ranks[0].in_flight_ops().len(), n as usize);
            return Ok(());
        }
        let mut want = Vec::new();
        for (op, (r0, r1)) in ops.iter().zip(live) {
            let h = match (r0, r1) {
                (Rec::Done(_, a), Rec::Done(_, b)) => (*a).min(*b),
                (Rec::Done(_, a), Rec::Skip) | (Rec::Skip, Rec::Done(_, a)) => *a,
                _ => continue,
            };
            want.push(l3_done(*op, h));
        }
        let stale = |r: usize| {
            recs[n as usize..]
                .iter()
                .filter(|p| (if r == 0 { p.0 } else { p.1 }) != Rec::None)
                .count()
        };
        let mut got = Vec::new();
        for (r, (a, s)) in agrees.iter_mut().zip(&ranks).enumerate() {
            let evs = a.reduce(s, |v| v.copy_from_slice(&min)).unwrap();
            prop_assert_eq!(&evs, &want);
            prop_assert_eq!(a.dropped(), stale(r) as u64);
            let kept = live
                .iter()
                .zip(&ops)
                .filter(|(p, op)| {
                    (if r == 0 { p.0 } else { p.1 }) != Rec::None
                        && !want.iter().any(|e| e.op_kind().unwrap().0 == **op)
                })
                .count();
            prop_assert_eq!(a.pending(), kept);
            got.push(evs);
        }
        for (s, evs) in ranks.iter_mut().zip(got) {
            prop_assert_eq!(s.on_op_events(evs), Ok(want.len()));
            s.check().unwrap();
        }
    }

    /// The offloading manager's prefetch and backup jobs, agreed in process over 1 to 3 ranks:
    /// if any rank recorded a completion of another kind than a job's, or a prefetch's count
    /// above its 3 pages, the agreement is refused with `WrongKind` (`TooMany`) and nothing changes on any rank or in the manager; otherwise exactly
    /// the jobs every rank answered (or skipped, not all) are completed.
    #[test]
    fn an_offload_managers_agreement_is_refused_whole_or_exact(
        n_ranks in 1..4usize,
        recs in prop::collection::vec(prop::collection::vec(rec(), 3), 4),
    ) {
        let mut m = OffloadManager::new(32, EvictionPolicy::Lru).unwrap();
        m.set_l3_backups(L3Backups::WriteThrough);
        m.set_tp_ranks(n_ranks as u32).unwrap();
        // Two backups (of two stored chains) and two prefetches (of chains known in L3).
        for p in 0..2u8 {
            let c = chain(20 + p, 2);
            let s = m.prepare_store(&c, 2).unwrap().unwrap();
            m.complete_store(s.job, JobOutcome::Done).unwrap();
        }
        prop_assert_eq!(m.plan_backups().len(), 2);
        for p in 0..2u8 {
            let c = chain(30 + p, 3);
            chains::found_by_every_rank(&mut m, &c);
            m.prepare_prefetch(&c, 3).unwrap().unwrap();
        }
        let jobs = m.agreed_ops();
        prop_assert_eq!(jobs.len(), 4);
        let mut ranks: Vec<RankAgreement> = (0..n_ranks).map(|_| RankAgreement::new()).collect();
        for ((op, _), per_rank) in jobs.iter().zip(&recs) {
            for (a, r) in ranks.iter_mut().zip(per_rank) {
                record(a, *op, *r);
            }
        }
        // Every rank runs every job: a skip is refused too.
        let wrong = jobs.iter().zip(&recs).any(|((_, kind), per_rank)| {
            per_rank[..n_ranks].iter().any(|r| {
                *r == Rec::Skip
                    || matches!(r, Rec::Done(k, n) if KINDS[*k] != *kind || (*kind == OpKind::Prefetch && *n > 3))
            })
        });
        let before: Vec<usize> = ranks.iter().map(|a| a.pending()).collect();
        let known = m.l3_known();
        let got = m.agree_in_process(&mut ranks);
        m.check().unwrap();
        if wrong {
            prop_assert!(matches!(got, Err(AgreementError::WrongKind { .. } | AgreementError::TooMany { .. } | AgreementError::MustRun { .. })), "{:?}", got);
            prop_assert_eq!(ranks.iter().map(|a| a.pending()).collect::<Vec<_>>(), before);
            prop_assert_eq!(m.agreed_ops(), jobs);
            prop_assert_eq!(m.l3_known(), known);
            return Ok(());
        }
        let done: Vec<(OpId, OpKind)> = jobs
            .iter()
            .zip(&recs)
            .filter(|(_, per_rank)| {
                let rs = &per_rank[..n_ranks];
                rs.iter().all(|r| *r != Rec::None) && rs.iter().any(|r| *r != Rec::Skip)
            })
            .map(|(j, _)| *j)
            .collect();
        prop_assert_eq!(got, Ok(done.len()));
        let left: Vec<(OpId, OpKind)> = jobs.iter().filter(|j| !done.contains(j)).copied().collect();
        prop_assert_eq!(m.agreed_ops(), left);
    }
}
