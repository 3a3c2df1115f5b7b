//! The shadow selector under a scheduler: `SchedulerConfig::shadow_sample_salt` and
//! `shadow_full_size_pages` reach the selector: the salt picks which 1-in-R sample the
//! sampled shadows replay, the bound when they are sampled. The selector itself is tested
//! in `radix/tests/shadow.rs`; the simulator's property tests run the scheduler under it.

mod common;
use common::*;
use kvtier_radix::EvictionPolicy;
use kvtier_scheduler::*;

/// The same 400 conversations (under one shared 4-page system prompt), submitted to
/// schedulers whose shadows are sampled 1 in 2: each salt replays about half of them, and two
/// salts replay different halves.
#[test]
fn the_sample_salt_picks_which_requests_the_shadows_replay() {
    let replayed = |salt: u64| {
        let c = SchedulerConfig {
            device_pages: 16_384,
            host_pages: 65_536,
            eviction: EvictionPolicy::Shadow,
            shadow_sample_salt: salt,
            ..cfg()
        };
        let mut s = Scheduler::new(c.clone()).unwrap();
        let mut e = Engine::new(&c);
        let mut members = Vec::new();
        for id in 0..400u32 {
            let mut p = prompt(0, 16);
            p.extend(prompt(id + 1, 12));
            let before = s.cache().shadow_snapshot().unwrap().replayed;
            e.submit(&mut s, u64::from(id), p, 1);
            members.push(s.cache().shadow_snapshot().unwrap().replayed > before);
        }
        assert_eq!(s.cache().shadow_snapshot().unwrap().sample, 2);
        members
    };
    let (a, b) = (replayed(0), replayed(1));
    for m in [&a, &b] {
        let n = m.iter().filter(|&&x| x).count();
        assert!((140..260).contains(&n), "{n} of 400 replayed at 1 in 2");
    }
    assert_ne!(a, b, "two salts, one sample");
}

/// `SchedulerConfig::shadow_full_size_pages` bounds the shadows: up to that many device +
/// host pages they are exact (1 in 1), above it sampled 1 prefix in ⌈capacity / it⌉; 0 is a
/// typed error naming the field, not a selector that divides by zero.
#[test]
fn the_full_size_bound_decides_when_the_shadows_are_sampled() {
    let sample = |full: u64| {
        let c = SchedulerConfig {
            device_pages: 16_384,
            host_pages: 65_536,
            eviction: EvictionPolicy::Shadow,
            shadow_full_size_pages: full,
            ..cfg()
        };
        let mut s = Scheduler::new(c.clone()).unwrap();
        let mut e = Engine::new(&c);
        e.submit(&mut s, 1, prompt(0, 16), 1);
        s.cache().shadow_snapshot().unwrap().sample
    };
    assert_eq!(SchedulerConfig::default().shadow_full_size_pages, 65_536);
    assert_eq!(sample(65_536), 2, "81,920 pages over a bound of 65,536");
    assert_eq!(
        sample(81_920),
        1,
        "the whole capacity within the bound: exact"
    );
    assert_eq!(sample(10_000), 9);
    let zero = SchedulerConfig {
        eviction: EvictionPolicy::Shadow,
        shadow_full_size_pages: 0,
        ..cfg()
    };
    assert_eq!(
        Scheduler::new(zero).err(),
        Some(ConfigError::Zero {
            field: "shadow_full_size_pages"
        })
    );
}
