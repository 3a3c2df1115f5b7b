//! Queue-aware protection (`protect.rs`): the prefixes waiting prompts contain are evicted
//! after every other leaf, protection is soft (it never makes an allocation fail), counted,
//! and taking back what was not given is refused without a change.

mod common;

use common::{cache_with, prompt_with, put_device};
use kvtier_radix::*;
use proptest::prelude::*;

const PS: usize = 4;

/// Evicts at least `n` device pages; the first page of each node evicted, in order.
fn first_pages_evicted(c: &mut RadixCache, n: usize) -> Vec<PageHash> {
    c.evict::<Device>(n)
        .evicted
        .iter()
        .map(|e| e.hashes[0])
        .collect()
}

#[test]
fn a_waiting_prompts_prefix_is_evicted_after_every_other_leaf() {
    let mut c = cache_with(PS, 64, 8, false);
    // Three prefixes, inserted oldest first: LRU evicts `a` first.
    let (ta, ha) = prompt_with(PS, 1, 3);
    let (tb, hb) = prompt_with(PS, 2, 3);
    let (tc, hc) = prompt_with(PS, 3, 3);
    for (t, h) in [(&ta, &ha), (&tb, &hb), (&tc, &hc)] {
        put_device(&mut c, t, h);
    }
    // A waiting request's prompt starts with `a`'s first two pages, then goes elsewhere.
    let (_, other) = prompt_with(PS, 9, 4);
    let waiting = [ha[0], ha[1], other[2], other[3]];
    c.protect(&waiting);
    c.check_invariants().unwrap();
    let order = first_pages_evicted(&mut c, 9);
    // `b` and `c` go first (LRU among the unprotected), then `a`, protected but soft.
    assert_eq!(order, vec![hb[0], hc[0], ha[0]]);
    c.check_invariants().unwrap();
}

#[test]
fn unprotected_nodes_below_a_protected_one_go_first_and_the_split_keeps_ranks() {
    let mut c = cache_with(PS, 64, 8, false);
    let (ta, ha) = prompt_with(PS, 1, 6);
    put_device(&mut c, &ta, &ha);
    let (tb, hb) = prompt_with(PS, 2, 2);
    put_device(&mut c, &tb, &hb);
    // Protect only `a`'s first 3 pages (a waiting prompt sharing them); a later insert that
    // splits `a` at page 3 leaves its tail unprotected.
    c.protect(&ha[..3]);
    let mut fork = ta[..3 * PS].to_vec();
    fork.extend((0..(2 * PS) as u32).map(|i| 77_000 + i));
    let hf = page_hashes(&fork, PS, None);
    put_device(&mut c, &fork, &hf);
    c.check_invariants().unwrap();
    // 3 + 2 + 2 pages: every unprotected leaf.
    let first = first_pages_evicted(&mut c, 7);
    // Unprotected leaves first: `a`'s tail (from page 3), `b`, the fork's tail (LRU order).
    assert_eq!(first, vec![ha[3], hb[0], hf[3]]);
    // What is left is the protected front of `a`.
    assert_eq!(c.match_prefix(&ha).device_pages, 3);
    c.check_invariants().unwrap();
}

#[test]
fn protection_is_counted_and_a_bad_unprotect_changes_nothing() {
    let mut c = cache_with(PS, 64, 8, false);
    let (ta, ha) = prompt_with(PS, 1, 2);
    let (tb, hb) = prompt_with(PS, 2, 2);
    put_device(&mut c, &ta, &ha);
    put_device(&mut c, &tb, &hb);
    c.protect(&ha);
    c.protect(&ha);
    c.unprotect(&ha).unwrap();
    // Still protected once: `b` goes first.
    assert_eq!(c.evict::<Device>(1).evicted[0].hashes[0], hb[0]);
    put_device(&mut c, &tb, &hb);
    c.unprotect(&ha).unwrap();
    assert_eq!(c.protected_hashes(), 0);
    // Now LRU alone: `a` is the older.
    let before = c.protected_hashes();
    assert_eq!(
        c.unprotect(&ha),
        Err(RadixError::NotProtected { hash: ha[0] })
    );
    // A partly protected list is refused whole.
    c.protect(&ha[..1]);
    assert!(c.unprotect(&ha).is_err());
    assert_eq!(c.protected_hashes(), before + 1);
    c.unprotect(&ha[..1]).unwrap();
    assert_eq!(c.evict::<Device>(1).evicted[0].hashes[0], ha[0]);
    c.check_invariants().unwrap();
}

#[test]
fn protection_never_makes_an_allocation_fail() {
    let mut c = cache_with(PS, 8, 8, false);
    let (ta, ha) = prompt_with(PS, 1, 8);
    put_device(&mut c, &ta, &ha);
    c.protect(&ha);
    // The whole device is protected, yet a new prompt still gets all of it.
    let pages = c.alloc_evicting::<Device>(8).expect("protection is soft");
    assert_eq!(pages.len(), 8);
    c.check_invariants().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Insert(u32, usize),
    Protect(u32, usize),
    Unprotect(usize),
    Evict(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u32..6, 1usize..6).prop_map(|(s, n)| Op::Insert(s, n)),
        (0u32..6, 1usize..6).prop_map(|(s, n)| Op::Protect(s, n)),
        (0usize..8).prop_map(Op::Unprotect),
        (1usize..6).prop_map(Op::Evict),
    ]
}

proptest! {
    /// Under any interleaving of inserts, protections, their release and evictions: the
    /// cache's invariants hold, an eviction never takes a protected leaf while an unprotected
    /// one is evictable, and releasing every protection leaves none.
    #[test]
    fn protected_leaves_go_last_and_every_protection_comes_back(ops in prop::collection::vec(op(), 1..60)) {
        let mut c = cache_with(PS, 24, 8, false);
        let mut given: Vec<Vec<PageHash>> = Vec::new();
        for o in ops {
            match o {
                Op::Insert(s, n) => {
                    let (t, h) = prompt_with(PS, s, n);
                    let m = c.match_prefix(&h);
                    if let Ok(p) = c.alloc::<Device>(h.len() - m.device_pages) {
                        c.insert::<Device>(m.device_node, m.device_pages, &h, &t, &p).unwrap();
                    }
                }
                Op::Protect(s, n) => {
                    let (_, h) = prompt_with(PS, s, n);
                    c.protect(&h);
                    given.push(h);
                }
                Op::Unprotect(i) => {
                    if !given.is_empty() {
                        let h = given.remove(i % given.len());
                        c.unprotect(&h).unwrap();
                    }
                }
                Op::Evict(n) => {
                    let protected: std::collections::HashSet<PageHash> =
                        given.iter().flatten().copied().collect();
                    for e in c.evict::<Device>(n).evicted {
                        if protected.contains(&e.hashes[0]) {
                            // Only once no unprotected leaf is left.
                            let rest: Vec<NodeId> = c.evictable_lru::<Device>().collect();
                            for id in rest {
                                let first = c.node_hashes(id).unwrap()[0];
                                prop_assert!(protected.contains(&first));
                            }
                        }
                    }
                }
            }
            prop_assert!(c.check_invariants().is_ok(), "{:?}", c.check_invariants());
        }
        for h in given.drain(..) {
            c.unprotect(&h).unwrap();
        }
        prop_assert_eq!(c.protected_hashes(), 0);
        prop_assert!(c.check_invariants().is_ok());
    }
}
