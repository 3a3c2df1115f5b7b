//! `QueueProtection::Waiting` through the checking engine: a prefix that a queued request will
//! match survives the running requests' allocations (LRU alone evicts it, being the oldest),
//! protection ends with the wait (admission, abort), and the scheduler's check holds after
//! every step under random workloads.

mod common;
use common::*;
use kvtier_scheduler::*;
use proptest::prelude::*;

fn device_only(p: QueueProtection) -> SchedulerConfig {
    SchedulerConfig {
        host_enabled: false,
        host_pages: 0,
        // One request at a time: the others wait.
        max_batch_size: 1,
        queue_protection: p,
        ..cfg()
    }
}

/// Device pages the waiting request `w` found cached when it was admitted.
fn waiting_requests_hit(p: QueueProtection) -> u64 {
    let c = device_only(p);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    // The shared prefix (10 pages) is cached first, so LRU ranks it oldest; then two cold
    // one-off prompts (12 pages each) fill more of the 64-page device.
    e.submit(&mut s, 1, prompt(1, 40), 1);
    e.run_to_idle(&mut s, 100);
    for i in 0..2 {
        e.submit(&mut s, 10 + i, prompt(10 + i as u32, 48), 1);
        e.run_to_idle(&mut s, 100);
    }
    // A long request runs (it needs 40 new pages: something must be evicted) while `w`,
    // which reuses the prefix, waits behind it.
    e.submit(&mut s, 20, prompt(20, 160), 1);
    let mut w = prompt(1, 40);
    w.extend(prompt(30, 8));
    e.submit(&mut s, 21, w, 1);
    let before = s.stats().device_hit_pages;
    e.run_to_idle(&mut s, 200);
    assert_quiescent(&s);
    assert!(e.pages_checked > 0);
    s.stats().device_hit_pages - before
}

#[test]
fn a_queued_requests_prefix_survives_the_running_requests_allocations() {
    // LRU alone evicts the oldest leaf: the prefix `w` waits for.
    assert_eq!(waiting_requests_hit(QueueProtection::Off), 0);
    // Protected while `w` waits: the two cold prompts go instead.
    assert_eq!(waiting_requests_hit(QueueProtection::Waiting), 10);
}

#[test]
fn protection_ends_with_the_wait() {
    let c = device_only(QueueProtection::Waiting);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 40), 4);
    e.submit(&mut s, 2, prompt(2, 40), 4);
    // Both waiting: both prompts protected (10 pages each).
    assert_eq!(s.cache().protected_hashes(), 20);
    s.check().unwrap();
    s.abort(RequestId(2)).unwrap();
    assert_eq!(s.cache().protected_hashes(), 10);
    e.run_to_idle(&mut s, 100);
    assert_eq!(s.cache().protected_hashes(), 0);
    assert_quiescent(&s);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Random prompts sharing prefixes, arriving in bursts onto a small device, with and
    /// without a host tier: the scheduler's check (which includes the queue's protection
    /// books) holds at the end of every burst, and nothing stays protected once idle.
    #[test]
    fn queue_protection_keeps_the_books_under_random_bursts(
        bursts in prop::collection::vec(prop::collection::vec((0u32..4, 1usize..12, 8usize..80), 1..6), 1..6),
        host in any::<bool>(),
    ) {
        let c = SchedulerConfig {
            host_enabled: host,
            host_pages: if host { 128 } else { 0 },
            max_batch_size: 2,
            queue_protection: QueueProtection::Waiting,
            ..cfg()
        };
        let mut s = Scheduler::new(c.clone()).unwrap();
        let mut e = Engine::new(&c);
        let mut id = 0;
        for burst in bursts {
            for (shared, seed, len) in burst {
                id += 1;
                let mut p = prompt(shared, 16);
                p.extend(prompt(100 + seed as u32, len));
                e.submit(&mut s, id, p, 2);
            }
            s.check().map_err(TestCaseError::fail)?;
            e.run_to_idle(&mut s, 500);
        }
        prop_assert_eq!(s.cache().protected_hashes(), 0);
        assert_quiescent(&s);
    }
}
