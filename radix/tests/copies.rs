//! Copies of existing nodes on another tier (`add_copies`, `alloc_for_copy`): what a
//! demotion does. Each error leaves the cache exactly as it was; a copy is not a use (the
//! node keeps its place in the source tier's eviction order); room for a copy only comes from
//! colder leaves.

mod common;
use common::*;
use kvtier_radix::*;
use proptest::prelude::*;

const PS: usize = 4;

fn cache(dev: u32, host: u32) -> RadixCache {
    cache_with(PS, dev, host, false)
}

fn prompt(seed: u32, pages: usize) -> (Vec<u32>, Vec<PageHash>) {
    prompt_with(PS, seed, pages)
}

type Usage = (usize, usize, usize, usize);
type Snapshot = (
    Usage,
    Usage,
    usize,
    Vec<(usize, usize)>,
    Vec<NodeId>,
    Vec<NodeId>,
);

/// Everything a failed call must leave as it was.
fn snapshot(c: &RadixCache, prompts: &[Vec<PageHash>]) -> Snapshot {
    let usage = |t| {
        let u = c.usage(t);
        (u.free, u.held, u.cached, u.locked)
    };
    (
        usage(TierKind::Device),
        usage(TierKind::Host),
        c.node_count(),
        prompts.iter().map(|h| c.peek_prefix(h)).collect::<Vec<_>>(),
        c.evictable_lru::<Device>().collect::<Vec<_>>(),
        c.evictable_lru::<Host>().collect::<Vec<_>>(),
    )
}

#[test]
fn copies_give_host_the_path_and_keep_device_order() {
    let mut c = cache(16, 16);
    let (t1, h1) = prompt(1, 3);
    let (t2, h2) = prompt(2, 3);
    let cold = put_device(&mut c, &t1, &h1);
    let _warm = put_device(&mut c, &t2, &h2);
    assert_eq!(c.evictable_lru::<Device>().next(), Some(cold));
    let pages = c.alloc_for_copy::<Host>(cold, TierKind::Device, 3).unwrap();
    let unused = c.add_copies::<Host>(cold, 0, &pages).unwrap();
    assert!(unused.is_empty());
    assert_eq!(c.peek_prefix(&h1), (3, 3));
    assert_eq!(c.usage(TierKind::Host).cached, 3);
    assert_eq!(
        c.evictable_lru::<Device>().next(),
        Some(cold),
        "a copy is not a use: the demoted leaf stays device's coldest"
    );
    c.check_invariants().unwrap();
    // Evicting it on device now drops a copy, not the page.
    c.evict_node::<Device>(cold).unwrap();
    assert_eq!(c.peek_prefix(&h1), (0, 3));
    c.check_invariants().unwrap();
}

#[test]
fn copies_below_an_existing_host_prefix_and_duplicates_come_back() {
    let mut c = cache(16, 16);
    let (t, h) = prompt(1, 5);
    let end = put_device(&mut c, &t, &h);
    // Host already has the first two pages.
    let hp = c.alloc::<Host>(2).unwrap();
    c.insert::<Host>(c.root(), 0, &h, &t, &hp).unwrap();
    // The first two pages are now their own node: copy from depth 2.
    let pages = c.alloc::<Host>(3).unwrap();
    assert!(c.add_copies::<Host>(end, 2, &pages).unwrap().is_empty());
    assert_eq!(c.peek_prefix(&h), (5, 5));
    c.check_invariants().unwrap();
    // A second copy of a path host already has hands every page back, still held.
    let again = c.alloc::<Host>(3).unwrap();
    let unused = c.add_copies::<Host>(end, 2, &again).unwrap();
    assert_eq!(unused, again);
    c.free(&unused).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn bad_copies_are_typed_errors_and_change_nothing() {
    let mut c = cache(16, 8);
    let (t, h) = prompt(1, 4);
    let end = put_device(&mut c, &t, &h);
    let hp = c.alloc::<Host>(1).unwrap();
    c.insert::<Host>(c.root(), 0, &h, &t, &hp).unwrap(); // splits at depth 1
    let pages = c.alloc::<Host>(3).unwrap();
    let before = snapshot(&c, std::slice::from_ref(&h));
    assert!(matches!(
        c.add_copies::<Host>(end, 1, &pages[..2]),
        Err(RadixError::LengthMismatch { .. })
    ));
    assert!(matches!(
        c.add_copies::<Host>(end, 2, &pages[..2]),
        Err(RadixError::OffsetMismatch {
            expected: 4,
            got: 2
        })
    ));
    // Depth 0 is a boundary, but the pages must then cover all four.
    assert!(matches!(
        c.add_copies::<Host>(end, 0, &pages),
        Err(RadixError::LengthMismatch { .. })
    ));
    // Pages the caller does not hold.
    let first = c.node_at_depth(end, 1).unwrap();
    let cached = c.path_pages::<Host>(first).unwrap();
    let mut bad = pages[..2].to_vec();
    bad.push(cached[0]);
    assert!(c.add_copies::<Host>(end, 1, &bad).is_err());
    let dup = vec![pages[0], pages[0], pages[1]];
    assert!(matches!(
        c.add_copies::<Host>(end, 1, &dup),
        Err(RadixError::DuplicatePage { .. })
    ));
    assert_eq!(snapshot(&c, std::slice::from_ref(&h)), before);
    // A copy below a node host lacks breaks prefix closure.
    let (t2, h2) = prompt(2, 4);
    let end2 = put_device(&mut c, &t2, &h2);
    let _ = c.node_at_depth(end2, 2).unwrap();
    let before2 = snapshot(&c, &[h.clone(), h2.clone()]);
    assert!(matches!(
        c.add_copies::<Host>(end2, 2, &pages[..2]),
        Err(RadixError::NotResident {
            tier: TierKind::Host
        })
    ));
    assert_eq!(snapshot(&c, &[h.clone(), h2.clone()]), before2);
    c.evict_node::<Device>(end2).unwrap();
    assert!(matches!(
        c.add_copies::<Host>(end2, 0, &pages[..2]),
        Err(RadixError::UnknownNode)
    ));
    c.free(&pages).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn room_for_a_copy_comes_only_from_colder_leaves() {
    let mut c = cache(16, 4);
    let (t1, h1) = prompt(1, 2);
    let (t2, h2) = prompt(2, 2);
    let (t3, h3) = prompt(3, 2);
    // Host holds 1 (cold) and 3 (warm); 2 sits on device between them in recency.
    let n1 = put_device(&mut c, &t1, &h1);
    let p = c.alloc::<Host>(2).unwrap();
    c.insert::<Host>(c.root(), 0, &h1, &t1, &p).unwrap();
    let n2 = put_device(&mut c, &t2, &h2);
    put_device(&mut c, &t3, &h3);
    let p = c.alloc::<Host>(2).unwrap();
    c.insert::<Host>(c.root(), 0, &h3, &t3, &p).unwrap();
    c.match_prefix(&h3); // 3 is the most recent
    let all = [h1.clone(), h2.clone(), h3.clone()];
    // 2 pages for node 2: only node 1 is colder, and it has exactly 2.
    let got = c.alloc_for_copy::<Host>(n2, TierKind::Device, 2).unwrap();
    assert_eq!(c.peek_prefix(&h1), (2, 0), "the colder host copy made room");
    assert_eq!(c.peek_prefix(&h3), (2, 2), "the warmer one stays");
    c.free(&got).unwrap();
    // Node 1 (now the coldest of all) finds no colder host leaf: refused, nothing evicted.
    let p = c.alloc::<Host>(2).unwrap();
    c.insert::<Host>(c.root(), 0, &h2, &t2, &p).unwrap();
    let before = snapshot(&c, &all);
    assert!(matches!(
        c.alloc_for_copy::<Host>(n1, TierKind::Device, 2),
        Err(RadixError::PoolExhausted { .. })
    ));
    assert_eq!(snapshot(&c, &all), before);
    c.check_invariants().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random device trees, random host prefixes, random demotions of device leaves: the
    /// cache's invariants hold after every step, a copied path matches fully on host, and a
    /// refused copy changes nothing.
    #[test]
    fn demoting_random_leaves_keeps_the_cache_consistent(
        prompts in prop::collection::vec((0u32..4, 1usize..7), 1..10),
        host_cap in 2u32..24,
        order in prop::collection::vec(any::<u16>(), 1..20),
    ) {
        let mut c = cache(64, host_cap);
        let mut all = Vec::new();
        for (i, &(base, len)) in prompts.iter().enumerate() {
            // Prompts of a base share their first pages.
            let toks: Vec<u32> = (0..(len * PS) as u32)
                .map(|j| if j < 8 { base * 100 + j } else { 10_000 + i as u32 * 100 + j })
                .collect();
            let hs = page_hashes(&toks, PS, None);
            put_device(&mut c, &toks, &hs);
            all.push(hs);
        }
        c.check_invariants().map_err(TestCaseError::fail)?;
        for pick in order {
            let leaves: Vec<NodeId> = c
                .evictable_lru::<Device>()
                .filter(|&n| c.is_resident(n, TierKind::Host) != Ok(true))
                .collect();
            if leaves.is_empty() {
                break;
            }
            let end = leaves[pick as usize % leaves.len()];
            let path = c.path_nodes(end).unwrap();
            let &(_, from, _) = path
                .iter()
                .find(|(n, _, _)| c.is_resident(*n, TierKind::Host) != Ok(true))
                .unwrap();
            let to = c.node_end(end).unwrap();
            let before = snapshot(&c, &all);
            match c.alloc_for_copy::<Host>(end, TierKind::Device, to - from) {
                Ok(pages) => {
                    // Room may have come from the path's own host copies: copy from the
                    // first node host lacks now.
                    let path = c.path_nodes(end).unwrap();
                    let &(_, from2, _) = path
                        .iter()
                        .find(|(n, _, _)| c.is_resident(*n, TierKind::Host) != Ok(true))
                        .unwrap();
                    if from2 != from {
                        c.free(&pages).unwrap();
                        continue;
                    }
                    let unused = c.add_copies::<Host>(end, from, &pages).unwrap();
                    prop_assert!(unused.is_empty());
                    prop_assert_eq!(c.is_resident(end, TierKind::Host), Ok(true));
                }
                Err(RadixError::PoolExhausted { .. }) => {
                    prop_assert_eq!(snapshot(&c, &all), before);
                }
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            }
            c.check_invariants().map_err(TestCaseError::fail)?;
        }
    }
}
