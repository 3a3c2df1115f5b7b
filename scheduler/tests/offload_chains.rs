//! The manager takes its page-hash chains from the engine, and a list that is not a chain (a
//! hash repeated, or a hash that followed another page before) is refused: before, it was
//! accepted, the tree's index broke (`check()` failed right after) and a later load handed
//! out slots holding other pages than the ones asked for (wrong KV).

use std::collections::HashMap;

use kvtier_radix::{EvictionPolicy, PageHash};
use kvtier_scheduler::{JobOutcome, OffloadError, OffloadManager};
use proptest::prelude::*;

fn h(i: u8) -> PageHash {
    PageHash([i; 32])
}

fn store(m: &mut OffloadManager, chain: &[PageHash]) -> Result<(), OffloadError> {
    if let Some(p) = m.prepare_store(chain, chain.len())? {
        m.complete_store(p.job, JobOutcome::Done)?;
    }
    Ok(())
}

#[test]
fn a_chain_repeating_a_page_is_refused_and_changes_nothing() {
    let mut m = OffloadManager::new(8, EvictionPolicy::Lru).unwrap();
    let before = m.usage();
    assert_eq!(
        m.prepare_store(&[h(1), h(2), h(1)], 3),
        Err(OffloadError::NotAChain { index: 2 })
    );
    assert_eq!(m.usage(), before);
    assert_eq!(m.storing(), 0);
    m.check().unwrap();
    // the same pages as a chain are fine
    store(&mut m, &[h(1), h(2), h(3)]).unwrap();
    assert_eq!(m.host_prefix(&[h(1), h(2), h(3)]), 3);
    m.check().unwrap();
}

#[test]
fn a_page_that_followed_another_page_is_refused_elsewhere() {
    let mut m = OffloadManager::new(8, EvictionPolicy::Lru).unwrap();
    store(&mut m, &[h(3)]).unwrap();
    // h(3) is a first page: as the second page of another chain it is not a chain
    assert_eq!(
        m.prepare_store(&[h(1), h(3)], 2),
        Err(OffloadError::NotAChain { index: 1 })
    );
    store(&mut m, &[h(1)]).unwrap();
    let l = m.prepare_load(&[h(1)], 0, 1).unwrap();
    m.complete_load(l.job).unwrap();
    m.check().unwrap();
    // ... and the same while h(3)'s store is still in flight
    let mut m = OffloadManager::new(8, EvictionPolicy::Lru).unwrap();
    let p = m.prepare_store(&[h(3)], 1).unwrap().unwrap();
    assert_eq!(
        m.prepare_store(&[h(1), h(3)], 2),
        Err(OffloadError::NotAChain { index: 1 })
    );
    m.complete_store(p.job, JobOutcome::Done).unwrap();
    m.check().unwrap();
}

#[test]
fn a_query_that_agrees_with_the_tree_only_at_its_end_is_no_hit() {
    // The tree holds c, d, a, e. A list c, d, b, e shares its first two pages and its last:
    // the last page decided a whole run's match (`common_prefix`), so it was a 4-page hit and
    // its load handed out a's slot for b.
    let mut m = OffloadManager::new(8, EvictionPolicy::Lru).unwrap();
    let stored = [h(10), h(11), h(12), h(13)];
    let plan = m.prepare_store(&stored, 4).unwrap().unwrap();
    m.complete_store(plan.job, JobOutcome::Done).unwrap();
    let wrong = [h(10), h(11), h(20), h(13)];
    assert_eq!(
        m.host_prefix(&wrong),
        2,
        "only the consistent part is matched"
    );
    assert_eq!(
        m.prepare_load(&wrong, 0, 4),
        Err(OffloadError::NotAChain { index: 3 })
    );
    assert_eq!(
        m.prepare_store(&wrong, 4),
        Err(OffloadError::NotAChain { index: 3 })
    );
    let l = m.prepare_load(&wrong, 0, 2).unwrap();
    assert_eq!(l.slots, plan.slots[..2]);
    m.complete_load(l.job).unwrap();
    m.check().unwrap();
}

#[test]
fn books_of_evicted_pages_are_rebuilt_from_the_tree_and_stay_bounded() {
    // 3 slots, 200 distinct one-page chains: the parents' books are pruned to what the tree
    // holds, and a page evicted long ago may start a chain again.
    let mut m = OffloadManager::new(3, EvictionPolicy::Lru).unwrap();
    for i in 0..200u8 {
        store(&mut m, &[h(i)]).unwrap();
        m.check().unwrap();
        assert!(
            m.chain_book_entries() <= 2 * 3 + 64,
            "{} entries",
            m.chain_book_entries()
        );
    }
    // h(1) was a first page, long evicted and forgotten: it may follow h(0) now
    store(&mut m, &[h(0), h(1)]).unwrap();
    assert_eq!(m.host_prefix(&[h(0), h(1)]), 2);
    m.check().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Store(Vec<u8>),
    Complete { nth: usize, ok: bool },
    Load(Vec<u8>),
    FinishLoad { nth: usize },
    Touch(Vec<u8>),
}

/// Lists of pages from an alphabet of six hashes: most are not chains.
fn pages() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0u8..6, 1..6)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => pages().prop_map(Op::Store),
        3 => (0usize..4, prop::bool::weighted(0.8)).prop_map(|(nth, ok)| Op::Complete { nth, ok }),
        3 => pages().prop_map(Op::Load),
        1 => (0usize..4).prop_map(|nth| Op::FinishLoad { nth }),
        1 => pages().prop_map(Op::Touch),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any lists of pages, chains or not: the manager's check holds after every call, a
    /// refused call changes nothing, and every load reads slots holding exactly the pages
    /// asked for, in order.
    #[test]
    fn any_lists_keep_the_tree_consistent_and_loads_exact(
        slots in 1u32..8,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut m = OffloadManager::new(slots, EvictionPolicy::Lru).unwrap();
        let mut content: HashMap<u32, PageHash> = HashMap::new();
        let mut stores = Vec::new();
        let mut loads = Vec::new();
        for op in ops {
            match op {
                Op::Store(p) => {
                    let c: Vec<PageHash> = p.iter().map(|&i| h(i)).collect();
                    let (usage, storing) = (m.usage(), m.storing());
                    match m.prepare_store(&c, c.len()) {
                        Ok(Some(plan)) => stores.push((plan, c)),
                        Ok(None) => {}
                        Err(e) => {
                            prop_assert!(matches!(e, OffloadError::NotAChain { .. }), "{e}");
                            prop_assert_eq!((m.usage(), m.storing()), (usage, storing));
                        }
                    }
                }
                Op::Complete { nth, ok } => {
                    if !stores.is_empty() {
                        let (plan, c) = stores.remove(nth % stores.len());
                        if ok {
                            for (i, s) in plan.slots.iter().enumerate() {
                                content.insert(s.index(), c[plan.from + i]);
                            }
                        }
                        let outcome = if ok { JobOutcome::Done } else { JobOutcome::Failed };
                        m.complete_store(plan.job, outcome).unwrap();
                    }
                }
                Op::Load(p) => {
                    let c: Vec<PageHash> = p.iter().map(|&i| h(i)).collect();
                    let hits = m.host_prefix(&c);
                    if hits > 0 {
                        let l = m.prepare_load(&c, 0, hits).unwrap();
                        for (i, s) in l.slots.iter().enumerate() {
                            prop_assert_eq!(content.get(&s.index()), Some(&c[i]), "page {} of {:?}", i, p);
                        }
                        loads.push(l.job);
                    }
                }
                Op::FinishLoad { nth } => {
                    if !loads.is_empty() {
                        let j = loads.remove(nth % loads.len());
                        m.complete_load(j).unwrap();
                    }
                }
                Op::Touch(p) => m.touch(&p.iter().map(|&i| h(i)).collect::<Vec<_>>()),
            }
            m.check().map_err(TestCaseError::fail)?;
        }
    }
}
