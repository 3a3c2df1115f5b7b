//! The adaptive eviction policy (`EvictionPolicy::Adaptive`): it moves towards frequency
//! credit when reused leaves come back after eviction, back towards LRU when fresh ones do;
//! its ghost state stays within its bound; two caches fed the same operations (tensor-parallel
//! ranks) evict the same leaves and learn the same level; a locked leaf is never evicted.

use kvtier_radix::*;
use proptest::prelude::*;

const PS: usize = 4;

fn cache(device_pages: u32) -> RadixCache {
    let mut c = RadixCache::new(RadixConfig {
        page_size: PS,
        device_pages,
        host_pages: 4,
        record_events: false,
    })
    .unwrap();
    c.set_eviction_policy(EvictionPolicy::Adaptive);
    c
}

fn prompt(seed: u32, pages: usize) -> (Vec<u32>, Vec<PageHash>) {
    let toks: Vec<u32> = (0..(pages * PS) as u32)
        .map(|i| seed * 10_000 + i)
        .collect();
    let hs = page_hashes(&toks, PS, None);
    (toks, hs)
}

/// Matches `hs` and puts what device lacks on device, evicting as needed (the start node
/// pinned meanwhile, as the scheduler does). Returns the evicted leaves' first hashes; nothing
/// when the pages cannot be obtained.
fn put(c: &mut RadixCache, toks: &[u32], hs: &[PageHash]) -> Vec<PageHash> {
    let m = c.match_prefix(hs);
    let n = hs.len() - m.device_pages;
    if n == 0 {
        return Vec::new();
    }
    let lock = c.lock::<Device>(m.device_node).unwrap();
    let before: Vec<(NodeId, PageHash)> = c
        .evictable_lru::<Device>()
        .map(|id| (id, c.node_hashes(id).unwrap()[0]))
        .collect();
    let got = c.alloc_evicting::<Device>(n);
    let evicted: Vec<PageHash> = before
        .iter()
        .filter(|(id, _)| c.is_resident(*id, TierKind::Device) != Ok(true))
        .map(|(_, h)| *h)
        .collect();
    if let Ok(pages) = got {
        let out = c
            .insert::<Device>(m.device_node, m.device_pages, hs, toks, &pages)
            .unwrap();
        let dups: Vec<_> = out.duplicates.iter().map(|d| d.1).collect();
        c.free(&dups).unwrap();
    }
    c.unlock(lock).unwrap();
    evicted
}

fn level(c: &RadixCache) -> u32 {
    c.adaptive_snapshot().unwrap().level
}

/// Hot prefixes, each read twice per round (so they are `Reused` when evicted), pushed out by
/// one-off prompts between rounds: the reused leaves come back, the one-offs never do.
fn reused_rounds(c: &mut RadixCache, rounds: u32, seed: u32) {
    for r in 0..rounds {
        for hot in 0..4 {
            let (t, h) = prompt(seed + hot, 3);
            put(c, &t, &h);
            c.match_prefix(&h[..2]);
        }
        for k in 0..6 {
            let (t, h) = prompt(seed + 1_000 + r * 10 + k, 4);
            put(c, &t, &h);
        }
        c.check_invariants().unwrap();
    }
}

/// Prefixes read twice and then never again (finished conversations: `Reused` when evicted,
/// never back), and fresh prompts read once more two rounds later (a conversation's newest
/// turn, read by its next one: `Once` when evicted, and back).
fn fresh_rounds(c: &mut RadixCache, rounds: u32, seed: u32) {
    for r in 0..rounds {
        let (t, h) = prompt(seed + r, 3);
        put(c, &t, &h);
        c.match_prefix(&h[..2]);
        c.match_prefix(&h[..1]);
        let (t, h) = prompt(seed + 2_000 + r, 3);
        put(c, &t, &h);
        if let Some(back) = r.checked_sub(2) {
            let (t, h) = prompt(seed + 2_000 + back, 3);
            put(c, &t, &h);
        }
        c.check_invariants().unwrap();
    }
}

#[test]
fn learns_frequency_when_reused_leaves_come_back_and_recency_when_fresh_ones_do() {
    let mut c = cache(16);
    assert_eq!(level(&c), 0, "starts as LRU");
    assert_eq!(
        c.learnt_admission(),
        Some(LearntAdmission::CopyAtFinish),
        "starts copying at finish"
    );
    reused_rounds(&mut c, 400, 1);
    let up = level(&c);
    // One step already protects the hot prefixes here (its credit, 437 pages of traffic,
    // dwarfs this 16-page cache), so their misses stop and the level stays.
    assert!(up >= 1, "level {up} after reused leaves came back");
    assert!(matches!(
        c.adaptive_snapshot(),
        Some(AdaptiveSnapshot { ghost_hits_reused, .. }) if ghost_hits_reused > 0
    ));
    fresh_rounds(&mut c, 1_000, 6_000);
    let down = level(&c);
    assert!(
        down < up,
        "level {down} after fresh leaves came back (was {up}): {:?}",
        c.adaptive_snapshot()
    );
    c.check_invariants().unwrap();
}

#[test]
fn a_fixed_policy_has_no_adaptive_state_and_switching_back_starts_afresh() {
    let mut c = cache(16);
    reused_rounds(&mut c, 400, 1);
    assert!(level(&c) > 0);
    c.set_eviction_policy(EvictionPolicy::Lru);
    assert_eq!(c.adaptive_snapshot(), None);
    assert_eq!(
        c.learnt_admission(),
        None,
        "no learnt admission under a fixed policy"
    );
    c.check_invariants().unwrap();
    c.set_eviction_policy(EvictionPolicy::Adaptive);
    assert_eq!(c.adaptive_snapshot(), Some(AdaptiveSnapshot::default()));
    c.check_invariants().unwrap();
}

#[test]
fn spelling() {
    assert_eq!("adaptive".parse(), Ok(EvictionPolicy::Adaptive));
    assert_eq!(EvictionPolicy::Adaptive.to_string(), "adaptive");
    assert!("adaptive:3".parse::<EvictionPolicy>().is_err());
}

#[derive(Clone, Debug)]
enum Op {
    /// Match and insert prompt `i`, `pages` pages long.
    Put { i: u32, pages: usize },
    /// Match a prefix of prompt `i` only (a read).
    Read { i: u32, pages: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..40u32, 1..6usize).prop_map(|(i, pages)| Op::Put { i, pages }),
        2 => (0..40u32, 1..6usize).prop_map(|(i, pages)| Op::Read { i, pages }),
    ]
}

fn apply(c: &mut RadixCache, op: &Op) -> Vec<PageHash> {
    match *op {
        Op::Put { i, pages } => {
            let (t, h) = prompt(i, pages);
            put(c, &t, &h)
        }
        Op::Read { i, pages } => {
            let (_, h) = prompt(i, pages);
            c.match_prefix(&h);
            Vec::new()
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// Two identical caches (two tensor-parallel ranks) fed the same operations hold the same
    /// tree, evict the same leaves and learn the same state; the ghost state never exceeds its
    /// bound (device + host pages); a leaf pinned by a lock keeps its pages throughout.
    #[test]
    fn bounded_deterministic_and_never_evicts_a_pinned_leaf(
        ops in prop::collection::vec(op(), 1..400),
        dev in 6u32..24,
        pinned in 0..40u32,
    ) {
        let mut a = cache(dev);
        let mut b = cache(dev);
        let (pt, ph) = prompt(pinned, 2);
        put(&mut a, &pt, &ph);
        put(&mut b, &pt, &ph);
        let la = a.match_prefix(&ph).device_node;
        let lb = b.match_prefix(&ph).device_node;
        let lock_a = a.lock::<Device>(la).unwrap();
        let lock_b = b.lock::<Device>(lb).unwrap();
        for op in &ops {
            let ea = apply(&mut a, op);
            let eb = apply(&mut b, op);
            prop_assert_eq!(ea, eb);
            prop_assert_eq!(a.adaptive_snapshot(), b.adaptive_snapshot());
            // The learnt host admission is its score's, the score within the cache's
            // capacity (both snapshots are equal: the same on both ranks).
            let snap = a.adaptive_snapshot().unwrap();
            prop_assert!(snap.admission_score.unsigned_abs() <= u64::from(dev) + 4);
            let want = if snap.admission_score > 0 {
                LearntAdmission::Demote
            } else {
                LearntAdmission::CopyAtFinish
            };
            prop_assert_eq!(a.learnt_admission(), Some(want));
            prop_assert_eq!(snap.admission, want);
            let order_a: Vec<_> = a.evictable_lru::<Device>().map(|n| a.node_hashes(n).unwrap().to_vec()).collect();
            let order_b: Vec<_> = b.evictable_lru::<Device>().map(|n| b.node_hashes(n).unwrap().to_vec()).collect();
            prop_assert_eq!(order_a, order_b);
            let s = a.adaptive_snapshot().unwrap();
            prop_assert!(s.ghosts <= dev as usize + 4, "{} ghosts", s.ghosts);
            prop_assert!(s.level <= ADAPTIVE_LEVELS);
            prop_assert_eq!(a.peek_prefix(&ph).0, 2, "the pinned prefix lost device pages");
            a.check_invariants().map_err(TestCaseError::fail)?;
        }
        a.unlock(lock_a).unwrap();
        b.unlock(lock_b).unwrap();
        a.check_invariants().map_err(TestCaseError::fail)?;
    }
}
