//! Tensor-parallel agreement in the offloading-manager mode: one `OffloadManager`, one
//! `RankAgreement` per rank, each rank reading (prefetch) or writing (backup) its own shard of
//! every page in L3. A page must become a host page only when every rank's shard landed, be
//! taken to be in L3 only when every rank's shard was written, and a loss one rank reports
//! must be forgotten for all; kvtier's check holds after every call.

use kvtier_radix::{EvictionPolicy, PageHash};
use kvtier_scheduler::{
    AgreedOps, AgreementError, Event, JobKind, JobOutcome, L3Backups, Lookup, OffloadError,
    OffloadManager, OpId, OpKind, RankAgreement,
};
use proptest::prelude::*;

mod chains;
use chains::chain;

/// A write-through manager whose host tier held `chain`, backed up (agreed by `ranks`) and
/// then evicted by another chain: `chain` is only in L3.
fn in_l3_only(ranks: &mut [RankAgreement], a: &[PageHash]) -> OffloadManager {
    let mut m = OffloadManager::new(a.len() as u32, EvictionPolicy::Lru).unwrap();
    m.set_l3_backups(L3Backups::WriteThrough);
    m.set_tp_ranks(ranks.len() as u32).unwrap();
    let s = m.prepare_store(a, a.len()).unwrap().unwrap();
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    for b in m.plan_backups() {
        for r in ranks.iter_mut() {
            r.push(Event::BackUpDone {
                op: OpId(b.job),
                success: true,
            })
            .unwrap();
        }
    }
    assert_eq!(m.agree_in_process(ranks).unwrap(), 1);
    let other = chain(0xee, a.len());
    let s = m.prepare_store(&other, other.len()).unwrap().unwrap();
    assert_eq!(s.evicted.len(), a.len());
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    for b in m.plan_backups() {
        for r in ranks.iter_mut() {
            r.push(Event::BackUpDone {
                op: OpId(b.job),
                success: true,
            })
            .unwrap();
        }
    }
    m.agree_in_process(ranks).unwrap();
    assert_eq!(m.lookup(a, 0), Lookup::InL3);
    m.check().unwrap();
    m
}

#[test]
fn a_prefetch_lands_only_when_every_rank_read_its_shard() {
    let a = chain(1, 3);
    let mut ranks = vec![RankAgreement::new(), RankAgreement::new()];
    let mut m = in_l3_only(&mut ranks, &a);
    let p = m.prepare_prefetch(&a, 3).unwrap().unwrap();
    assert_eq!(m.agreed_ops(), vec![(OpId(p.job), OpKind::Prefetch)]);
    ranks[0]
        .push(Event::PrefetchDone {
            op: OpId(p.job),
            completed: 3,
        })
        .unwrap();
    assert_eq!(
        m.agree_in_process(&mut ranks).unwrap(),
        0,
        "rank 1 not done"
    );
    assert_eq!(m.lookup(&a, 2), Lookup::Pending);
    m.check().unwrap();
    ranks[1]
        .push(Event::PrefetchDone {
            op: OpId(p.job),
            completed: 3,
        })
        .unwrap();
    assert_eq!(m.agree_in_process(&mut ranks).unwrap(), 1);
    assert!((0..3).all(|i| m.lookup(&a, i) == Lookup::Hit));
    assert!(m.agreed_ops().is_empty() && ranks.iter().all(|r| r.pending() == 0));
    m.check().unwrap();
}

#[test]
fn a_prefetch_reads_the_whole_run_known_in_l3_in_one_job() {
    // The engine asks about page 0 first; the pages after it that kvtier knows in L3 are
    // read by the same job (before, one job per page the engine asked about).
    let a = chain(9, 4);
    let mut ranks = vec![RankAgreement::new()];
    let mut m = in_l3_only(&mut ranks, &a);
    let p = m.prepare_prefetch(&a, 1).unwrap().unwrap();
    assert_eq!((p.from, p.slots.len()), (0, 4));
    assert!((0..4).all(|i| m.lookup(&a, i) == Lookup::Pending));
    assert_eq!(m.prepare_prefetch(&a, 2).unwrap(), None, "all being read");
    m.complete_prefetch(p.job, 4).unwrap();
    assert!((0..4).all(|i| m.lookup(&a, i) == Lookup::Hit));
    m.check().unwrap();
}

#[test]
fn a_shard_one_rank_could_not_read_is_computed_on_every_rank() {
    let a = chain(2, 3);
    let mut ranks = vec![RankAgreement::new(), RankAgreement::new()];
    let mut m = in_l3_only(&mut ranks, &a);
    let p = m.prepare_prefetch(&a, 3).unwrap().unwrap();
    // Rank 1's shard of page 1 was gone from L3: its read stopped after page 0.
    for (r, completed) in ranks.iter_mut().zip([3, 1]) {
        r.push(Event::PrefetchDone {
            op: OpId(p.job),
            completed,
        })
        .unwrap();
    }
    assert_eq!(m.agree_in_process(&mut ranks).unwrap(), 1);
    assert_eq!(m.lookup(&a, 0), Lookup::Hit, "every rank read page 0");
    assert_eq!(
        m.lookup(&a, 1),
        Lookup::Miss,
        "lost for all ranks: computed"
    );
    assert_eq!(m.lookup(&a, 2), Lookup::Miss);
    let u = m.usage();
    // The prefetch evicted the other chain (one node) for its 3 slots; 2 came back free.
    assert_eq!((u.cached, u.held, u.free), (1, 0, 2));
    assert_eq!(m.take_dropped(), a[1..].to_vec());
    m.check().unwrap();
}

#[test]
fn a_backup_one_rank_failed_does_not_count_as_in_l3() {
    let a = chain(3, 2);
    let mut m = OffloadManager::new(2, EvictionPolicy::Lru).unwrap();
    m.set_l3_backups(L3Backups::WriteThrough);
    m.set_tp_ranks(2).unwrap();
    let mut ranks = vec![RankAgreement::new(), RankAgreement::new()];
    let s = m.prepare_store(&a, 2).unwrap().unwrap();
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    let b = m.plan_backups().pop().unwrap();
    for (r, success) in ranks.iter_mut().zip([true, false]) {
        r.push(Event::BackUpDone {
            op: OpId(b.job),
            success,
        })
        .unwrap();
    }
    assert_eq!(m.agree_in_process(&mut ranks).unwrap(), 1);
    let other = chain(4, 2);
    let s = m.prepare_store(&other, 2).unwrap().unwrap();
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    assert_eq!(
        m.lookup(&a, 0),
        Lookup::Miss,
        "not every rank's shard is in L3"
    );
    m.check().unwrap();
}

#[test]
fn a_loss_one_rank_reports_is_forgotten_for_all_even_during_a_backup() {
    let a = chain(5, 2);
    let mut ranks = vec![RankAgreement::new(), RankAgreement::new()];
    let mut m = in_l3_only(&mut ranks, &a);
    assert_eq!(ranks[1].lost_pages(&a[1..]), 1);
    let words: Vec<Vec<u64>> = ranks.iter_mut().map(|r| r.loss_words()).collect();
    for r in ranks.iter_mut() {
        r.apply_losses(&mut m, &words).unwrap();
    }
    assert_eq!(m.lookup(&a, 0), Lookup::InL3);
    assert_eq!(m.lookup(&a, 1), Lookup::Miss, "the union is applied");
    // A loss that overtakes the backup writing the page: the backup's success must not
    // mark it in L3 again.
    let c = chain(6, 1);
    let s = m.prepare_store(&c, 1).unwrap().unwrap();
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    let b = m.plan_backups().pop().unwrap();
    ranks[0].lost_pages(&c);
    let words: Vec<Vec<u64>> = ranks.iter_mut().map(|r| r.loss_words()).collect();
    for r in ranks.iter_mut() {
        r.agree_losses(&mut m, |_| words.clone()).unwrap();
    }
    for r in ranks.iter_mut() {
        r.push(Event::BackUpDone {
            op: OpId(b.job),
            success: true,
        })
        .unwrap();
    }
    m.agree_in_process(&mut ranks).unwrap();
    let d = chain(7, 2);
    let s = m.prepare_store(&d, 2).unwrap().unwrap();
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    assert_eq!(m.host_prefix(&c), 0);
    assert_eq!(m.lookup(&c, 0), Lookup::Miss);
    m.check().unwrap();
}

/// A loss recorded between this rank's words and the agreement (another thread's
/// `lost_pages` while `all_gather` runs: the Python binding lets go of the agreement then) is
/// agreed at the next round. Before, the agreement checked the union against every loss
/// recorded so far: this rank failed with `OwnLossesMissing` while the others applied the
/// union, and the ranks' L3 marks diverged.
#[test]
fn a_loss_recorded_while_the_words_are_gathered_waits_for_the_next_round() {
    let a = chain(7, 3);
    let mut ranks = vec![RankAgreement::new(), RankAgreement::new()];
    let mut m = in_l3_only(&mut ranks, &a);
    ranks[0].lost_pages(&a[2..]);
    let words: Vec<Vec<u64>> = ranks.iter_mut().map(|r| r.loss_words()).collect();
    assert_eq!(ranks[0].lost_pages(&a[1..2]), 1, "recorded meanwhile");
    for r in ranks.iter_mut() {
        r.apply_losses(&mut m, &words).unwrap();
    }
    assert_eq!(m.lookup(&a, 1), Lookup::InL3, "not agreed yet");
    assert_eq!(m.lookup(&a, 2), Lookup::Miss, "the union is applied");
    assert_eq!(ranks[0].pending_losses(), (1, false));
    assert_eq!(ranks[1].pending_losses(), (0, false));
    let words: Vec<Vec<u64>> = ranks.iter_mut().map(|r| r.loss_words()).collect();
    for r in ranks.iter_mut() {
        r.agree_losses(&mut m, |_| words.clone()).unwrap();
    }
    assert_eq!(m.lookup(&a, 1), Lookup::Miss, "agreed at the next round");
    assert_eq!(ranks[0].pending_losses(), (0, false));
    m.check().unwrap();
}

#[test]
fn other_completions_and_unknown_jobs_are_refused_and_change_nothing() {
    let a = chain(8, 2);
    let mut ranks = vec![RankAgreement::new()];
    let mut m = in_l3_only(&mut ranks, &a);
    let p = m.prepare_prefetch(&a, 2).unwrap().unwrap();
    for ev in [
        Event::LoadBackDone {
            op: OpId(p.job),
            success: true,
        },
        Event::L3QueryDone {
            op: OpId(p.job),
            hit_pages: 1,
        },
    ] {
        assert!(matches!(
            m.apply_agreed(&ev),
            Err(OffloadError::NotAnL3Completion(_))
        ));
    }
    assert!(matches!(
        m.complete_prefetch(p.job + 100, 1),
        Err(OffloadError::UnknownJob { .. })
    ));
    assert_eq!(m.lookup(&a, 0), Lookup::Pending);
    m.check().unwrap();
    m.complete_prefetch(p.job, 2).unwrap();
    assert!(matches!(
        m.complete_prefetch(p.job, 2),
        Err(OffloadError::UnknownJob { .. })
    ));
    assert_eq!(m.lookup(&a, 1), Lookup::Hit);
    m.check().unwrap();
}

proptest! {
    /// Any number of ranks, any pages each rank reads of each prefetch, any order of their
    /// reports: after the agreement a chain's host prefix is the minimum any rank read, the
    /// pages after it are misses, and kvtier's check holds after every report.
    #[test]
    fn the_agreed_prefetch_is_the_minimum_over_ranks(
        reads in prop::collection::vec(prop::collection::vec(0usize..=4, 1..4), 1..4),
        order in prop::collection::vec(any::<u8>(), 0..16),
    ) {
        let n_ranks = reads[0].len();
        let chains: Vec<Vec<PageHash>> = (0..reads.len()).map(|i| chain(10 + i as u8, 4)).collect();
        let mut ranks: Vec<RankAgreement> = (0..n_ranks).map(|_| RankAgreement::new()).collect();
        let mut m = OffloadManager::new(32, EvictionPolicy::Lru).unwrap();
        m.set_l3_backups(L3Backups::WriteThrough);
        m.set_tp_ranks(n_ranks as u32).unwrap();
        let mut jobs = Vec::new();
        for c in &chains {
            chains::found_by_every_rank(&mut m, c);
            jobs.push(m.prepare_prefetch(c, 4).unwrap().unwrap().job);
        }
        // Every (prefetch, rank) report, in an order drawn from `order`.
        let mut reports: Vec<(usize, usize)> = (0..chains.len())
            .flat_map(|p| (0..n_ranks).map(move |r| (p, r)))
            .collect();
        for (i, o) in order.iter().enumerate() {
            let n = reports.len();
            reports.swap(i % n, *o as usize % n);
        }
        for (p, r) in reports {
            let completed = reads[p].get(r).copied().unwrap_or(reads[p][0]) as u32;
            ranks[r].push(Event::PrefetchDone { op: OpId(jobs[p]), completed }).unwrap();
            m.agree_in_process(&mut ranks).unwrap();
            m.check().unwrap();
        }
        prop_assert!(m.agreed_ops().is_empty());
        for (p, c) in chains.iter().enumerate() {
            let min = (0..n_ranks).map(|r| reads[p].get(r).copied().unwrap_or(reads[p][0])).min().unwrap();
            prop_assert_eq!(m.host_prefix(c), min);
            for i in min..4 {
                prop_assert_eq!(m.lookup(c, i), Lookup::Miss);
            }
        }
    }
}

/// Issue 33 (5a): a manager planning for several ranks refuses a direct loss report (one
/// rank's store heard of it) with a typed error naming the agreement, and nothing changes;
/// an agreement of another number of ranks than it plans for is refused too. A single-rank
/// manager keeps the direct calls.
#[test]
fn a_manager_of_several_ranks_refuses_direct_losses_and_gathers_of_another_size() {
    let a = chain(9, 2);
    let mut ranks = vec![RankAgreement::new(), RankAgreement::new()];
    let mut m = in_l3_only(&mut ranks, &a);
    let known = m.l3_known();
    let refusal = Err(OffloadError::LossNeedsAgreement { tp_ranks: 2 });
    assert_eq!(m.l3_lost(&a[1..]), refusal);
    assert_eq!(m.l3_lost_all(), refusal);
    let msg = OffloadError::LossNeedsAgreement { tp_ranks: 2 }.to_string();
    assert!(
        msg.contains("lost_pages") && msg.contains("agree_losses"),
        "{msg}"
    );
    assert_eq!((m.l3_known(), m.lookup(&a, 1)), (known, Lookup::InL3));
    m.check().unwrap();
    assert_eq!(
        m.agree_in_process(&mut ranks[..1]),
        Err(AgreementError::RankCount {
            got: 1,
            tp_ranks: 2
        })
    );
    assert_eq!(ranks[1].lost_pages(&a[1..]), 1);
    let one = vec![ranks[1].loss_words()];
    assert_eq!(
        ranks[1].agree_losses(&mut m, |_| one.clone()),
        Err(AgreementError::RankCount {
            got: 1,
            tp_ranks: 2
        })
    );
    assert_eq!(m.lookup(&a, 1), Lookup::InL3, "nothing applied");
    let words: Vec<Vec<u64>> = ranks.iter_mut().map(|r| r.loss_words()).collect();
    for r in ranks.iter_mut() {
        r.agree_losses(&mut m, |_| words.clone()).unwrap();
    }
    assert_eq!(m.lookup(&a, 1), Lookup::Miss, "agreed: forgotten");
    m.check().unwrap();

    let mut single = vec![RankAgreement::new()];
    let mut m = in_l3_only(&mut single, &a);
    assert_eq!(m.l3_lost(&a[1..]), Ok(()));
    assert_eq!(m.lookup(&a, 1), Lookup::Miss);
    assert_eq!(m.l3_lost_all(), Ok(()));
    assert_eq!(m.lookup(&a, 0), Lookup::Miss);
    assert_eq!(m.set_tp_ranks(0), Err(OffloadError::ZeroRanks));
    m.check().unwrap();
}

#[test]
fn a_prefetch_count_above_its_pages_is_refused_by_every_path() {
    // The tester's case: a 3-page prefetch completed with 1,000 pages (bytes for pages,
    // another job's count) was accepted by the checked push, agreed in process and by
    // `reduce`, and marked every page landed; the scheduler's probes refused the same.
    let a = chain(3, 3);
    let mut ranks = vec![RankAgreement::new(), RankAgreement::new()];
    let mut m = in_l3_only(&mut ranks, &a);
    let p = m.prepare_prefetch(&a, 3).unwrap().unwrap();
    let op = OpId(p.job);
    let over = Event::PrefetchDone {
        op,
        completed: 1000,
    };
    let want = AgreementError::TooMany {
        op,
        kind: OpKind::Prefetch,
        got: 1000,
        most: 3,
    };
    assert_eq!(
        RankAgreement::new().push_checked(&m, over.clone()),
        Err(want.clone())
    );
    for r in ranks.iter_mut() {
        r.push(over.clone()).unwrap();
    }
    assert_eq!(m.agree_in_process(&mut ranks), Err(want.clone()));
    let mut entered = false;
    assert_eq!(
        ranks[0].reduce(&m, |v| {
            entered = true;
            assert_eq!(v, [0], "refused: not done");
        }),
        Err(want)
    );
    assert!(entered);
    assert_eq!(m.lookup(&a, 2), Lookup::Pending, "nothing landed");
    m.check().unwrap();
    // the manager's own completion refuses it too, and the job is still there
    assert!(matches!(
        m.complete_prefetch(p.job, 4),
        Err(OffloadError::TooManyPages { job, completed: 4, pages: 3 }) if job == p.job
    ));
    m.complete_prefetch(p.job, 3).unwrap();
    assert_eq!(m.lookup(&a, 0), Lookup::Hit);
    m.check().unwrap();
}

#[test]
fn a_prefetch_is_not_completed_as_a_store() {
    // `complete_store` on a prefetch job was accepted: "done" completed the prefetch,
    // "failed" left its pages marked in L3 (a failed prefetch forgets them as lost).
    let a = chain(4, 2);
    let mut ranks = vec![RankAgreement::new()];
    let mut m = in_l3_only(&mut ranks, &a);
    let p = m.prepare_prefetch(&a, 2).unwrap().unwrap();
    for outcome in [JobOutcome::Done, JobOutcome::Failed] {
        assert!(matches!(
            m.complete_store(p.job, outcome),
            Err(OffloadError::WrongJobKind { job, kind: JobKind::Prefetch, called: JobKind::Store }) if job == p.job
        ));
    }
    assert_eq!(m.lookup(&a, 1), Lookup::Pending, "nothing changed");
    m.check().unwrap();
    m.complete_prefetch(p.job, 0).unwrap();
    assert_eq!(
        m.lookup(&a, 0),
        Lookup::Miss,
        "a failed prefetch forgets the pages"
    );
    m.check().unwrap();
}

/// One manager per rank (SGLang's layout): the ranks' plans must stay equal, so a find that
/// one rank's probe made must not be answered `InL3` on that rank alone.
fn rank_managers(n: usize) -> Vec<OffloadManager> {
    (0..n)
        .map(|_| {
            let mut m = OffloadManager::new(8, EvictionPolicy::Lru).unwrap();
            m.set_l3_backups(L3Backups::WriteThrough);
            m.set_tp_ranks(n as u32).unwrap();
            m
        })
        .collect()
}

fn lookups(m: &OffloadManager, c: &[PageHash]) -> Vec<Lookup> {
    (0..c.len()).map(|i| m.lookup(c, i)).collect()
}

#[test]
fn one_ranks_find_alone_is_refused_and_the_ranks_agree_the_shortest_run() {
    let a = chain(0x51, 3);
    let mut ms = rank_managers(2);
    // Before: rank 0's own find made it answer [InL3, InL3, InL3], rank 1 [Miss, Miss, Miss].
    assert_eq!(
        ms[0].l3_found(&a),
        Err(OffloadError::FoundNeedsAgreement { tp_ranks: 2 })
    );
    assert_eq!(lookups(&ms[0], &a), lookups(&ms[1], &a));
    assert_eq!(ms[0].l3_known(), 0);
    // Rank 0's probe found all three pages, rank 1's only the first: both answer that one.
    let mut ranks = vec![RankAgreement::new(), RankAgreement::new()];
    assert_eq!(ranks[0].found_pages(&a), 3);
    assert_eq!(ranks[1].found_pages(&a[..1]), 1);
    let gathered: Vec<Vec<u64>> = ranks.iter_mut().map(|r| r.found_words()).collect();
    for (m, r) in ms.iter_mut().zip(&mut ranks) {
        assert_eq!(r.apply_found(m, &gathered), Ok(1));
        assert_eq!(r.pending_found(), 0);
        m.check().unwrap();
    }
    let agreed = vec![Lookup::InL3, Lookup::Miss, Lookup::Miss];
    assert_eq!(
        (lookups(&ms[0], &a), lookups(&ms[1], &a)),
        (agreed.clone(), agreed)
    );
    // One manager over every rank (vLLM's layout): the same, in process.
    let mut one = rank_managers(1).pop().unwrap();
    one.set_tp_ranks(2).unwrap();
    ranks[0].found_pages(&a[..2]);
    ranks[1].found_pages(&a);
    assert_eq!(one.agree_found_in_process(&mut ranks), Ok(2));
    assert_eq!(
        lookups(&one, &a),
        [Lookup::InL3, Lookup::InL3, Lookup::Miss]
    );
    assert_eq!(ranks[0].pending_found() + ranks[1].pending_found(), 0);
}

#[test]
fn a_find_agreement_that_cannot_be_exact_is_refused_and_changes_nothing() {
    let a = chain(0x52, 2);
    let mut ms = rank_managers(2);
    let mut r = RankAgreement::new();
    r.found_pages(&a);
    let mine = r.found_words();
    let other = RankAgreement::new().found_words();
    // Another number of ranks, this rank's words left out, loss words for found words.
    assert!(matches!(
        r.apply_found(&mut ms[0], std::slice::from_ref(&mine)),
        Err(AgreementError::RankCount {
            got: 1,
            tp_ranks: 2
        })
    ));
    assert_eq!(
        r.apply_found(&mut ms[0], &[other.clone(), other.clone()]),
        Err(AgreementError::OwnFindsMissing)
    );
    let loss = RankAgreement::new().loss_words();
    assert!(matches!(
        r.apply_found(&mut ms[0], &[mine.clone(), loss]),
        Err(AgreementError::BadFoundWords { rank: 1, .. })
    ));
    assert!(matches!(
        ms[0].agree_found_in_process(&mut [RankAgreement::new()]),
        Err(AgreementError::RankCount {
            got: 1,
            tp_ranks: 2
        })
    ));
    assert_eq!((r.pending_found(), ms[0].l3_known()), (2, 0));
    // A find recorded while the words are gathered waits for the next round.
    let c = chain(0x53, 1);
    r.found_pages(&c);
    let mut padded = mine.clone();
    padded.extend([0, 0]);
    assert_eq!(r.apply_found(&mut ms[0], &[padded, mine]), Ok(2));
    assert_eq!(r.pending_found(), 1);
    assert_eq!(ms[0].lookup(&c, 0), Lookup::Miss);
}

proptest! {
    /// Whatever each rank's probe finds (a run from the host prefix, or any pages): after the
    /// agreement, every rank's manager (one per rank, words all-gathered) and a manager over
    /// every rank (in process) answer every lookup alike, `InL3` exactly for the pages every
    /// rank found, so runs agree on the shortest.
    #[test]
    fn after_the_find_agreement_every_rank_answers_alike(
        finds in prop::collection::vec(prop::collection::vec(any::<bool>(), 6), 1..5),
        runs in any::<bool>(),
    ) {
        let n = finds.len();
        let a = chain(0x54, 6);
        let found: Vec<Vec<PageHash>> = finds
            .iter()
            .map(|f| {
                let run = f.iter().take_while(|x| **x).count();
                a.iter()
                    .zip(f)
                    .enumerate()
                    .filter(|(i, (_, x))| if runs { *i < run } else { **x })
                    .map(|(_, (p, _))| *p)
                    .collect()
            })
            .collect();
        let mut ms = rank_managers(n);
        let mut ranks: Vec<RankAgreement> = (0..n).map(|_| RankAgreement::new()).collect();
        for (m, f) in ms.iter_mut().zip(&found) {
            if n > 1 {
                prop_assert!(m.l3_found(f).is_err());
            }
        }
        for (r, f) in ranks.iter_mut().zip(&found) {
            r.found_pages(f);
        }
        let gathered: Vec<Vec<u64>> = ranks.iter_mut().map(|r| r.found_words()).collect();
        for (m, r) in ms.iter_mut().zip(&mut ranks) {
            r.apply_found(m, &gathered).unwrap();
            m.check().unwrap();
        }
        let mut one = rank_managers(n).pop().unwrap();
        let mut again: Vec<RankAgreement> = found
            .iter()
            .map(|f| {
                let mut r = RankAgreement::new();
                r.found_pages(f);
                r
            })
            .collect();
        one.agree_found_in_process(&mut again).unwrap();
        let every: Vec<Lookup> = (0..a.len())
            .map(|i| if found.iter().all(|f| f.contains(&a[i])) { Lookup::InL3 } else { Lookup::Miss })
            .collect();
        for m in ms.iter().chain([&one]) {
            prop_assert_eq!(lookups(m, &a), every.clone());
        }
        if runs {
            let shortest = found.iter().map(Vec::len).min().unwrap();
            prop_assert_eq!(every.iter().take_while(|l| **l == Lookup::InL3).count(), shortest);
        }
    }
}
