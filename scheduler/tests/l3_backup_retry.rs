//! Write-through backups that fail while L3 is down are tried again once L3 answers
//! (`offload_l3.rs`): before, a failed BackUp was dropped, and pages computed during an L3
//! outage that stayed on host never reached L3. A fake L3 (a set of stored pages, and
//! whether it is down) runs every BackUp the manager plans: pages end L3-resident once it is
//! back, no plan retries more than `pages_per_plan` pages, no page L3 already stored is put
//! again, nothing is retried while L3 has not answered since its last failure, and a page
//! that left host meanwhile is not retried.

use std::collections::{HashMap, HashSet};

use kvtier_radix::{EvictionPolicy, KvEvent, PageHash, TierKind};
use kvtier_scheduler::{BackupPlan, BackupRetry, JobOutcome, L3Backups, Lookup, OffloadManager};
use proptest::prelude::*;

mod chains;
use chains::chain;

/// An L3 store: what it holds, whether it is down, and every put it took.
#[derive(Default)]
struct FakeL3 {
    stored: HashSet<PageHash>,
    down: bool,
    puts: HashMap<PageHash, u32>,
    /// Puts of a page the store already held (the manager must never send them).
    duplicate_puts: u32,
}

impl FakeL3 {
    /// Runs `b`: a put of each page, all or nothing.
    fn run(&mut self, b: &BackupPlan) -> JobOutcome {
        for p in &b.pages {
            *self.puts.entry(*p).or_default() += 1;
            if self.stored.contains(p) {
                self.duplicate_puts += 1;
            }
        }
        if self.down {
            return JobOutcome::Failed;
        }
        self.stored.extend(b.pages.iter().copied());
        JobOutcome::Done
    }
}

fn manager(slots: u32, retry: BackupRetry) -> OffloadManager {
    let mut m = OffloadManager::new(slots, EvictionPolicy::Lru).unwrap();
    m.set_l3_backups(L3Backups::WriteThrough);
    m.set_backup_retry(retry);
    m
}

fn store(m: &mut OffloadManager, c: &[PageHash]) -> Vec<PageHash> {
    let s = m.prepare_store(c, c.len()).unwrap().unwrap();
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    s.evicted
}

/// One engine step's backups: planned, run against `l3`, completed. The pages planned.
fn step(m: &mut OffloadManager, l3: &mut FakeL3) -> Vec<PageHash> {
    let plans = m.plan_backups();
    let mut pages = Vec::new();
    for b in &plans {
        let outcome = l3.run(b);
        m.complete_backup(b.job, outcome).unwrap();
        pages.extend(b.pages.iter().copied());
    }
    m.check().unwrap();
    pages
}

#[test]
fn pages_whose_backup_failed_while_l3_was_down_reach_it_once_it_answers_again() {
    let retry = BackupRetry {
        pages_per_plan: 4,
        ..BackupRetry::default()
    };
    let mut m = manager(32, retry);
    let mut l3 = FakeL3::default();
    let before = chain(1, 4);
    store(&mut m, &before);
    assert_eq!(step(&mut m, &mut l3), before);
    l3.down = true;
    let down = [chain(2, 4), chain(3, 4), chain(4, 2)];
    for c in &down {
        store(&mut m, c);
        assert_eq!(
            &step(&mut m, &mut l3),
            c,
            "a new run is tried while L3 is down"
        );
    }
    assert_eq!(m.backups_retrying(), (3, 0));
    // Steps with nothing new: L3 has not answered since it failed, nothing is retried (the
    // plans count towards the probe, one in `probe_every`: the manager wants them).
    for _ in 0..3 {
        assert!(m.backups_due());
        assert!(
            step(&mut m, &mut l3).is_empty(),
            "retried before L3 answered"
        );
    }
    // L3 back (empty). A new run's backup is the first to succeed; the failed ones follow,
    // at most 4 pages a step, oldest first.
    l3.down = false;
    l3.stored.clear();
    let after = chain(5, 3);
    store(&mut m, &after);
    assert_eq!(step(&mut m, &mut l3), after);
    assert!(m.backups_due());
    assert_eq!(step(&mut m, &mut l3), down[0]);
    assert_eq!(step(&mut m, &mut l3), down[1]);
    assert_eq!(step(&mut m, &mut l3), down[2]);
    assert!(!m.backups_due() && step(&mut m, &mut l3).is_empty());
    assert_eq!(m.backups_retrying(), (0, 0));
    for c in down.iter().chain([&after]) {
        assert!(
            c.iter().all(|p| l3.stored.contains(p)),
            "every page reached L3"
        );
        assert!(c.iter().all(|p| l3.puts[p] == 2 || c == &after));
    }
    assert_eq!(l3.duplicate_puts, 0);
    // Off host, they are answered from L3.
    let other = chain(9, 32);
    let evicted = store(&mut m, &other);
    assert!(down.iter().all(|c| c.iter().all(|p| evicted.contains(p))));
    assert_eq!(m.lookup(&down[1], 3), Lookup::InL3);
}

#[test]
fn a_retry_skips_what_l3_holds_and_what_left_host_and_gives_up_after_its_tries() {
    let retry = BackupRetry {
        pages_per_plan: 64,
        tries: 2,
        max_waiting: 16,
        ..BackupRetry::default()
    };
    let mut m = manager(8, retry);
    let mut l3 = FakeL3 {
        down: true,
        ..FakeL3::default()
    };
    let (a, b) = (chain(1, 4), chain(2, 4));
    store(&mut m, &a);
    store(&mut m, &b);
    assert_eq!(step(&mut m, &mut l3).len(), 8);
    // a leaves host (c takes its slots); a page of b reaches L3 from elsewhere (a probe).
    let c = chain(3, 4);
    m.touch(&b);
    assert_eq!(store(&mut m, &c), a);
    m.l3_found(&b[..1]).unwrap();
    l3.down = false;
    l3.stored.insert(b[0]);
    assert_eq!(
        step(&mut m, &mut l3),
        [&c[..], &b[1..]].concat(),
        "c (new), then, as the probe's answer allows retries, b's pages L3 lacks; none of a (off host)"
    );
    assert_eq!(l3.duplicate_puts, 0);
    assert!(a.iter().all(|p| l3.puts[p] == 1), "a was not retried");
    // Tries are counted per run: one that keeps failing once L3 answers is given up.
    let d = chain(4, 2);
    l3.down = true;
    store(&mut m, &d);
    step(&mut m, &mut l3);
    for _ in 0..2 {
        m.l3_found(&c[..1]).unwrap(); // L3 answered something
        assert_eq!(step(&mut m, &mut l3), d, "tried again");
    }
    m.l3_found(&c[..1]).unwrap();
    assert!(step(&mut m, &mut l3).is_empty(), "out of tries");
    assert_eq!(m.backups_retrying(), (0, 1));
}

/// After an outage, an engine that serves only hits (no store, so no new backup, and no
/// read) still retries its failed backups: one plan in `probe_every` tries one waiting run
/// as the probe; its success is L3's answer and the rest follow. While L3 stays down, no
/// plan but every `probe_every`th tries anything again.
#[test]
fn an_engine_serving_only_hits_after_an_outage_retries_within_the_probe_bound() {
    let every = BackupRetry::default().probe_every;
    let mut m = manager(32, BackupRetry::default());
    let mut l3 = FakeL3::default();
    let hit = chain(1, 2);
    store(&mut m, &hit);
    assert_eq!(step(&mut m, &mut l3), hit);
    l3.down = true;
    let down = [chain(2, 4), chain(3, 3)];
    for c in &down {
        store(&mut m, c);
        assert_eq!(&step(&mut m, &mut l3), c);
    }
    l3.down = false;
    // L3 is back; the engine serves `hit` from host every step.
    let mut plans = 0;
    while !down.iter().flatten().all(|p| l3.stored.contains(p)) && plans < 1000 {
        m.touch(&hit);
        if m.backups_due() {
            step(&mut m, &mut l3);
        }
        plans += 1;
    }
    assert!(
        plans <= every + 1,
        "{plans} plans before the failed backups reached L3"
    );
    assert_eq!(l3.duplicate_puts, 0);
    assert_eq!(m.backups_probed(), 1);
    assert!(!m.backups_due());
    // While L3 stays down, a probe every `every` plans, of one run, and no try spent.
    l3.down = true;
    let more = chain(4, 2);
    store(&mut m, &more);
    assert_eq!(step(&mut m, &mut l3), more);
    for plan in 1..=3 * every {
        let tried = step(&mut m, &mut l3);
        if plan.is_multiple_of(every) {
            assert_eq!(tried, more, "plan {plan}: the probe");
        } else {
            assert!(tried.is_empty(), "plan {plan} tried {tried:?}");
        }
    }
    assert_eq!((m.backups_probed(), m.backups_retrying()), (4, (1, 0)));
}

#[test]
fn waiting_failed_runs_are_bounded() {
    let retry = BackupRetry {
        pages_per_plan: 64,
        tries: 8,
        max_waiting: 2,
        ..BackupRetry::default()
    };
    let mut m = manager(16, retry);
    let mut l3 = FakeL3 {
        down: true,
        ..FakeL3::default()
    };
    let runs: Vec<_> = (1..=4).map(|p| chain(p, 2)).collect();
    for c in &runs {
        store(&mut m, c);
        step(&mut m, &mut l3);
    }
    assert_eq!(m.backups_retrying(), (2, 2), "the two oldest given up");
    l3.down = false;
    store(&mut m, &chain(9, 1));
    step(&mut m, &mut l3);
    let retried = step(&mut m, &mut l3);
    assert_eq!(retried, [runs[2].clone(), runs[3].clone()].concat());
}

#[derive(Debug, Clone)]
enum Op {
    Store { prompt: u8, len: usize },
    Step,
    Down(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..12, 1usize..5).prop_map(|(prompt, len)| Op::Store { prompt, len }),
        4 => Just(Op::Step),
        1 => any::<bool>().prop_map(Op::Down),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any interleaving of stores (evicting), steps and an L3 going down and up: every
    /// backup reads host slots of its own pages, no page L3 holds is put again, no plan
    /// retries more than `pages_per_plan` pages; while L3 has not answered since its last
    /// failure, only a probe retries (one plan in `probe_every`, counted from the last
    /// failure or probe); and once L3 is up for good, every page on host reaches L3 within
    /// `probe_every` plans and those the retries need, with no new store (without probes, a
    /// new store's backup is the answer they wait for).
    #[test]
    fn failed_backups_end_in_l3_once_it_is_back(
        ops in prop::collection::vec(op(), 1..60),
        budget in 1usize..6,
        probe_every in 0u32..5,
    ) {
        let retry = BackupRetry { pages_per_plan: budget, tries: u32::MAX, max_waiting: usize::MAX, probe_every };
        let mut m = manager(10, retry);
        let mut l3 = FakeL3::default();
        let mut resident: HashSet<PageHash> = HashSet::new();
        // Pages on host whose last backup failed: planning one of them is a retry.
        let mut failed: HashSet<PageHash> = HashSet::new();
        let mut failing = false;
        // Plans since the last failure or probe while failing.
        let mut quiet = 0u32;
        for op in ops {
            match op {
                Op::Store { prompt, len } => {
                    if let Some(s) = m.prepare_store(&chain(prompt, len), len).unwrap() {
                        m.complete_store(s.job, JobOutcome::Done).unwrap();
                    }
                }
                Op::Down(d) => l3.down = d,
                Op::Step => {
                    let plans = m.plan_backups();
                    let retried = plans.iter().flat_map(|b| &b.pages).filter(|p| failed.contains(p)).count();
                    prop_assert!(retried <= budget, "{} retried pages in one plan", retried);
                    if failing {
                        quiet += 1;
                        if retried > 0 {
                            prop_assert!(probe_every > 0 && quiet >= probe_every, "retried after {} quiet plans", quiet);
                            quiet = 0;
                        }
                    }
                    for b in &plans {
                        prop_assert!(b.pages.iter().all(|p| resident.contains(p)));
                        let outcome = l3.run(b);
                        m.complete_backup(b.job, outcome).unwrap();
                        failing = outcome == JobOutcome::Failed;
                        if failing {
                            quiet = 0;
                        }
                        for p in &b.pages {
                            if failing { failed.insert(*p); } else { failed.remove(p); }
                        }
                    }
                }
            }
            m.check().map_err(TestCaseError::fail)?;
            for e in m.drain_events() {
                match e {
                    KvEvent::Stored { tier: TierKind::Host, hashes, .. } => resident.extend(hashes),
                    KvEvent::Removed { tier: TierKind::Host, hashes, .. } => {
                        for h in hashes {
                            resident.remove(&h);
                            failed.remove(&h);
                        }
                    }
                    _ => {}
                }
            }
            prop_assert_eq!(l3.duplicate_puts, 0);
        }
        // L3 up for good: the probe (or, without, a new page's backup) answers, then the
        // retries drain.
        l3.down = false;
        let mut plans = 10 / budget + 3;
        if probe_every > 0 {
            plans += probe_every as usize;
        } else if let Some(s) = m.prepare_store(&chain(99, 1), 1).unwrap() {
            m.complete_store(s.job, JobOutcome::Done).unwrap();
        }
        for e in m.drain_events() {
            match e {
                KvEvent::Stored { tier: TierKind::Host, hashes, .. } => resident.extend(hashes),
                KvEvent::Removed { tier: TierKind::Host, hashes, .. } => {
                    for h in hashes { resident.remove(&h); }
                }
                _ => {}
            }
        }
        for _ in 0..plans {
            step(&mut m, &mut l3);
        }
        prop_assert!(!m.backups_due());
        let missing: Vec<_> = resident.iter().filter(|p| !l3.stored.contains(p)).collect();
        prop_assert!(missing.is_empty(), "{} pages on host never reached L3", missing.len());
        prop_assert_eq!(l3.duplicate_puts, 0);
    }
}
