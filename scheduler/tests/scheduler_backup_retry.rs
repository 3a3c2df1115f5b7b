//! The Scheduler tries failed backups again once L3 answers (`backup_retry.rs`, shared with the
//! OffloadManager's, whose tests are `l3_backup_retry.rs`): pages computed while L3 was down,
//! still on host, reach L3 after it comes back; nothing is retried before L3 answered, no plan
//! retries more than its bound, no page is put twice, pages that left host are not retried.

mod common;
use std::collections::HashSet;

use common::*;
use kvtier_radix::page_hashes;
use kvtier_scheduler::*;
use proptest::prelude::*;

fn l3_cfg() -> SchedulerConfig {
    l3_on(2)
}

/// A scheduler retrying failed backups per `retry`, its engine, and `p` computed while L3 was
/// down (its backup failed).
fn after_an_outage(retry: BackupRetry, p: &[u32]) -> (Scheduler, Engine) {
    let c = l3_cfg();
    let mut s = Scheduler::new(c.clone()).unwrap();
    s.set_backup_retry(retry);
    let mut e = Engine::new(&c);
    compute_while_down(&mut s, &mut e, 1, p);
    (s, e)
}

fn keys_of(s: &Scheduler, p: &[u32]) -> Vec<String> {
    s.l3_keys(&page_hashes(p, s.config().page_size, None))
}

/// Runs `p` while L3 is down: its backup fails, its pages stay on host.
fn compute_while_down(s: &mut Scheduler, e: &mut Engine, id: u64, p: &[u32]) {
    e.l3_down = true;
    e.submit(s, id, p.to_vec(), 1);
    e.run_to_idle(s, 200);
    e.l3_down = false;
}

#[test]
fn pages_computed_while_l3_was_down_reach_it_once_it_answers() {
    let down = prompt(1, 41);
    let (mut s, mut e) = after_an_outage(BackupRetry::default(), &down);
    let keys = keys_of(&s, &down);
    assert_eq!(s.stats().op(OpKind::BackUp).failed, 1);
    assert_eq!(s.stats().backups_retrying, 1);
    assert!(keys.iter().all(|k| !e.l3.contains_key(k)));
    // L3 has not answered since: idle plans try nothing again.
    let issued = s.stats().op(OpKind::BackUp).issued;
    for t in 0..5 {
        e.step(&mut s, 1000 + t);
    }
    assert!(s.is_idle());
    assert_eq!(s.stats().op(OpKind::BackUp).issued, issued);
    // Another prompt's backup succeeds: L3 answered, the failed pages go out.
    e.submit(&mut s, 2, prompt(2, 41), 1);
    e.run_to_idle(&mut s, 200);
    let missing = keys.iter().filter(|k| !e.l3.contains_key(*k)).count();
    assert_eq!(
        missing, 0,
        "pages computed while L3 was down never reached it"
    );
    let st = s.stats();
    assert_eq!((st.backups_retrying, st.backups_given_up), (0, 0));
    assert!(e.puts.values().all(|&n| n == 1), "a page put twice");
    assert_quiescent(&s);
}

#[test]
fn a_probe_that_finds_pages_is_an_answer_and_each_plan_retries_at_most_its_bound() {
    let down: Vec<Vec<u32>> = (1..=3).map(|i| prompt(i, 41)).collect();
    let retry = BackupRetry {
        pages_per_plan: 4,
        ..BackupRetry::default()
    };
    let (mut s, mut e) = after_an_outage(retry, &down[0]);
    for (i, p) in down.iter().enumerate().skip(1) {
        compute_while_down(&mut s, &mut e, i as u64 + 1, p);
    }
    assert_eq!(s.stats().backups_retrying, 3);
    let want: HashSet<String> = down.iter().flat_map(|p| keys_of(&s, p)).collect();
    // L3 is back, holding a prompt another instance computed: this one's probe finds it.
    let known = prompt(9, 41);
    for k in keys_of(&s, &known) {
        let h = kvtier_radix::parse_l3_key(&k).unwrap().page;
        e.l3.insert(k, h);
    }
    e.submit(&mut s, 9, known, 1);
    let mut per_plan = Vec::new();
    e.run_watching(&mut s, 200, |plan| {
        let n: usize = plan
            .ops
            .iter()
            .filter_map(|op| match &op.spec {
                OpSpec::BackUp { keys, .. } => {
                    Some(keys.iter().filter(|k| want.contains(*k)).count())
                }
                _ => None,
            })
            .sum();
        per_plan.push(n);
    });
    assert!(per_plan.iter().all(|&n| n <= 4), "{per_plan:?}");
    assert_eq!(per_plan.iter().sum::<usize>(), 30, "{per_plan:?}");
    assert!(want.iter().all(|k| e.l3.contains_key(k)));
    assert!(e.puts.values().all(|&n| n == 1), "a page put twice");
    assert_quiescent(&s);
}

#[test]
fn pages_that_left_host_are_not_tried_again() {
    // Host holds 12 pages: the outage's 10 are evicted by the next prompt's before L3 answers.
    let c = SchedulerConfig {
        host_pages: 12,
        ..l3_cfg()
    };
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    let down = prompt(1, 41);
    compute_while_down(&mut s, &mut e, 1, &down);
    e.submit(&mut s, 2, prompt(2, 41), 1);
    e.run_to_idle(&mut s, 200);
    assert_eq!(s.cache().peek_prefix(&page_hashes(&down, 4, None)).1, 0);
    let st = s.stats();
    assert_eq!(
        st.op(OpKind::BackUp).succeeded,
        1,
        "only the second prompt's"
    );
    assert_eq!((st.backups_retrying, st.backups_retried), (0, 0));
    assert_quiescent(&s);
}

/// After an outage, a scheduler whose requests hit pages L3 already holds (no new backup, no
/// read) still retries its failed backups within a bounded number of plans (one plan in
/// `probe_every` tries one waiting run as the probe).
#[test]
fn a_scheduler_serving_only_hits_after_an_outage_retries_within_the_probe_bound() {
    let every = u64::from(BackupRetry::default().probe_every);
    let c = l3_cfg();
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    let hit = prompt(3, 41);
    e.submit(&mut s, 1, hit.clone(), 1);
    e.run_to_idle(&mut s, 200);
    let down = prompt(1, 41);
    compute_while_down(&mut s, &mut e, 2, &down);
    let keys = keys_of(&s, &down);
    assert!(keys.iter().all(|k| !e.l3.contains_key(k)));
    let mut plans = 0u64;
    while !keys.iter().all(|k| e.l3.contains_key(k)) && plans < 1000 {
        if plans.is_multiple_of(8) {
            e.submit(&mut s, 10 + plans, hit.clone(), 1);
        }
        e.step(&mut s, 5000 + plans);
        plans += 1;
    }
    assert!(
        plans <= every + 8,
        "{plans} plans before the failed backups reached L3"
    );
    assert!(e.puts.values().all(|&n| n == 1), "a page put twice");
    e.run_to_idle(&mut s, 200);
    assert_quiescent(&s);
    let st = s.stats();
    assert_eq!((st.backups_probed, st.backups_retrying), (1, 0));
}

/// Runs `p` with L3 up until its backup succeeded (L3 answered), then with L3 down again.
fn answer_then_fail(s: &mut Scheduler, e: &mut Engine, id: u64, p: &[u32]) {
    let keys = keys_of(s, p);
    e.submit(s, id, p.to_vec(), 1);
    for t in 0..200 {
        if keys.iter().all(|k| e.l3.contains_key(k)) {
            e.l3_down = true;
        }
        if s.is_idle() {
            break;
        }
        e.step(s, t);
    }
    e.run_to_idle(s, 200);
    e.l3_down = false;
}

#[test]
fn a_run_that_keeps_failing_is_given_up() {
    let down = prompt(1, 41);
    let retry = BackupRetry {
        tries: 2,
        ..BackupRetry::default()
    };
    let (mut s, mut e) = after_an_outage(retry, &down);
    for i in 0..3u32 {
        answer_then_fail(&mut s, &mut e, 10 + u64::from(i), &prompt(10 + i, 41));
    }
    let st = s.stats();
    assert_eq!(st.backups_retried, 2, "tried again twice, then given up");
    assert_eq!((st.backups_retrying, st.backups_given_up), (0, 1));
    assert!(keys_of(&s, &down).iter().all(|k| !e.l3.contains_key(k)));
    assert_quiescent(&s);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Prompts sharing prefixes, L3 down for some of them, host small enough to evict: after
    /// L3 is back and answered, every page on host is in L3 (write-through), no page was put
    /// twice, the oracle never read a wrong page, and the scheduler is consistent.
    #[test]
    fn after_an_outage_what_host_holds_reaches_l3_once(
        host_pages in 24u32..96,
        policy in 0u8..3,
        reqs in prop::collection::vec((0u32..4, 9usize..60, any::<bool>(), 0usize..4), 1..10),
    ) {
        let c = SchedulerConfig {
            host_pages,
            write_policy: write_policy_of(policy, true),
            ..l3_cfg()
        };
        let mut s = Scheduler::new(c.clone()).unwrap();
        let mut e = Engine::new(&c);
        let mut prompts = Vec::new();
        let mut t = 0;
        for (i, &(seed, len, down, steps)) in reqs.iter().enumerate() {
            let p = prompt(seed, len);
            e.l3_down = down;
            e.submit(&mut s, i as u64 + 1, p.clone(), 2);
            prompts.push(p);
            for _ in 0..steps {
                e.step(&mut s, t);
                t += 1;
            }
        }
        e.l3_down = false;
        e.run_to_idle(&mut s, 2000);
        // A fresh prompt's backup is L3's answer (write-through policies back it up).
        let fresh = prompt(99, 41);
        e.submit(&mut s, 99, fresh.clone(), 1);
        e.run_to_idle(&mut s, 2000);
        prompts.push(fresh);
        assert_quiescent(&s);
        prop_assert!(e.puts.values().all(|&n| n == 1), "a page put twice: {:?}", e.puts);
        let st = s.stats();
        prop_assert_eq!(st.backups_given_up, 0);
        if c.write_policy == WritePolicy::WriteThrough {
            prop_assert_eq!(st.backups_retrying, 0);
            for p in &prompts {
                let hs = page_hashes(p, c.page_size, None);
                let on_host = s.cache().peek_prefix(&hs).1;
                for k in &s.l3_keys(&hs[..on_host]) {
                    prop_assert!(e.l3.contains_key(k), "a host page never reached L3: {}", k);
                }
            }
        }
    }
}
