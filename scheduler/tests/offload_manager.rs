//! The offloading-manager mode (`OffloadManager`): kvtier's radix tree deciding an engine's
//! host tier. A model engine writes each store's pages into a slot array and reads them back
//! on loads: every load must read exactly the pages it asked for, every evicted page must turn
//! into a miss, and the manager's consistency check must hold after every call.

use std::collections::HashMap;

use kvtier_radix::{EvictionPolicy, KvEvent, PageHash, TierKind};
use kvtier_scheduler::{JobOutcome, L3Backups, Lookup, OffloadError, OffloadManager};
use proptest::prelude::*;

mod chains;
use chains::shared_chain as chain;

#[test]
fn stores_then_hits_then_evicts_the_coldest_for_new_pages() {
    let mut m = OffloadManager::new(4, EvictionPolicy::Lru).unwrap();
    let a = chain(1, 3, 0);
    assert_eq!(m.lookup(&a, 0), Lookup::Miss);
    let plan = m.prepare_store(&a, 3).unwrap().unwrap();
    assert_eq!((plan.from, plan.slots.len(), plan.evicted.len()), (0, 3, 0));
    assert_eq!(
        m.lookup(&a, 0),
        Lookup::Pending,
        "not a hit before the bytes landed"
    );
    m.check().unwrap();
    m.complete_store(plan.job, JobOutcome::Done).unwrap();
    m.check().unwrap();
    assert!((0..3).all(|i| m.lookup(&a, i) == Lookup::Hit));
    assert_eq!(m.prepare_store(&a, 3).unwrap(), None, "already on host");
    // A second prompt of 3 pages: one slot free, the tree evicts its coldest leaf, a's run
    // (a node leaves a tier whole).
    let b = chain(2, 3, 0);
    let plan = m.prepare_store(&b, 3).unwrap().unwrap();
    assert_eq!(plan.slots.len(), 3);
    assert_eq!(plan.evicted, a);
    m.complete_store(plan.job, JobOutcome::Done).unwrap();
    assert_eq!(m.host_prefix(&a), 0);
    assert_eq!(m.host_prefix(&b), 3);
    m.check().unwrap();
}

#[test]
fn a_failed_store_frees_its_slots_and_stores_nothing() {
    let mut m = OffloadManager::new(8, EvictionPolicy::Lru).unwrap();
    let a = chain(1, 4, 0);
    let plan = m.prepare_store(&a, 4).unwrap().unwrap();
    m.complete_store(plan.job, JobOutcome::Failed).unwrap();
    assert_eq!(m.lookup(&a, 0), Lookup::Miss);
    assert_eq!(m.usage().free, 8);
    m.check().unwrap();
}

#[test]
fn a_loading_prefix_is_pinned_and_bad_calls_change_nothing() {
    let mut m = OffloadManager::new(2, EvictionPolicy::Lru).unwrap();
    let a = chain(1, 2, 0);
    let s = m.prepare_store(&a, 2).unwrap().unwrap();
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    let load = m.prepare_load(&a, 0, 2).unwrap();
    assert_eq!(load.slots, s.slots);
    // Everything is pinned by the load: a new prompt gets no slot.
    assert_eq!(m.prepare_store(&chain(2, 2, 0), 2).unwrap(), None);
    assert_eq!(
        m.prepare_load(&a, 1, 5),
        Err(OffloadError::BadRange {
            from: 1,
            to: 5,
            len: 2
        })
    );
    assert!(matches!(
        m.prepare_load(&chain(3, 1, 0), 0, 1),
        Err(OffloadError::NotOnHost { .. })
    ));
    assert!(m.complete_store(99, JobOutcome::Done).is_err());
    assert!(m.complete_load(99).is_err());
    m.check().unwrap();
    m.complete_load(load.job).unwrap();
    assert!(m.complete_load(load.job).is_err(), "a load completes once");
    let s2 = m.prepare_store(&chain(2, 2, 0), 2).unwrap().unwrap();
    assert_eq!(s2.evicted.len(), 2);
    m.check().unwrap();
}

#[test]
fn a_store_after_a_pending_prefix_waits_for_it_and_dies_with_it() {
    for parent_ok in [true, false] {
        let mut m = OffloadManager::new(16, EvictionPolicy::Lru).unwrap();
        let (a, b) = (chain(1, 4, 2), chain(2, 4, 2)); // pages 0..2 shared
        let pa = m.prepare_store(&a, 4).unwrap().unwrap();
        let pb = m.prepare_store(&b, 4).unwrap().unwrap();
        assert_eq!((pa.from, pa.slots.len()), (0, 4));
        assert_eq!(
            (pb.from, pb.slots.len()),
            (2, 2),
            "b stores only its own pages"
        );
        m.complete_store(pb.job, JobOutcome::Done).unwrap();
        assert_eq!(
            m.lookup(&b, 3),
            Lookup::Pending,
            "landed, waiting for a's pages"
        );
        assert_eq!(
            m.complete_store(pb.job, JobOutcome::Done),
            Err(OffloadError::AlreadyCompleted { job: pb.job })
        );
        m.check().unwrap();
        let outcome = if parent_ok {
            JobOutcome::Done
        } else {
            JobOutcome::Failed
        };
        m.complete_store(pa.job, outcome).unwrap();
        m.check().unwrap();
        let dropped = m.take_dropped();
        if parent_ok {
            assert!(dropped.is_empty());
        } else {
            assert_eq!(
                dropped,
                [&a[..], &b[2..]].concat(),
                "a's pages, then b's orphaned ones"
            );
        }
        let want = if parent_ok { 4 } else { 0 };
        assert_eq!((m.host_prefix(&a), m.host_prefix(&b)), (want, want));
        assert_eq!(
            m.usage().free,
            16 - 2 * want + if parent_ok { 2 } else { 0 }
        );
    }
}

#[test]
fn a_waiting_store_pins_its_parent_once_it_is_in_the_tree() {
    let mut m = OffloadManager::new(6, EvictionPolicy::Lru).unwrap();
    let (a, b) = (chain(1, 3, 2), chain(2, 3, 2));
    let pa = m.prepare_store(&a, 3).unwrap().unwrap();
    let pb = m.prepare_store(&b, 3).unwrap().unwrap();
    m.complete_store(pa.job, JobOutcome::Done).unwrap();
    // b has not landed: a's pages are in the tree, and b's lock keeps the shared two.
    let c = chain(3, 5, 0);
    let pc = m.prepare_store(&c, 5).unwrap().unwrap();
    assert!(
        pc.evicted.iter().all(|h| !a[..2].contains(h)),
        "{:?}",
        pc.evicted
    );
    m.complete_store(pb.job, JobOutcome::Done).unwrap();
    assert_eq!(m.host_prefix(&b), 3);
    m.complete_store(pc.job, JobOutcome::Done).unwrap();
    m.check().unwrap();
}

#[test]
fn write_through_backs_up_stored_pages_and_evicted_ones_are_prefetched_from_l3() {
    let mut m = OffloadManager::new(3, EvictionPolicy::Lru).unwrap();
    m.set_l3_backups(L3Backups::WriteThrough);
    let a = chain(1, 3, 0);
    let s = m.prepare_store(&a, 3).unwrap().unwrap();
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    let backups = m.plan_backups();
    assert_eq!(backups.len(), 1);
    assert_eq!(
        (backups[0].pages.clone(), backups[0].slots.clone()),
        (a.clone(), s.slots.clone())
    );
    assert!(m.plan_backups().is_empty(), "planned once");
    // Pinned while the backup runs: a new prompt finds no slot.
    assert_eq!(m.prepare_store(&chain(2, 1, 0), 1).unwrap(), None);
    m.check().unwrap();
    m.complete_backup(backups[0].job, JobOutcome::Done).unwrap();
    assert!(m.complete_backup(backups[0].job, JobOutcome::Done).is_err());
    let b = chain(2, 3, 0);
    let sb = m.prepare_store(&b, 3).unwrap().unwrap();
    assert_eq!(sb.evicted, a);
    m.complete_store(sb.job, JobOutcome::Done).unwrap();
    assert_eq!(m.lookup(&a, 2), Lookup::InL3, "off host, in L3");
    // The prefetch is a store whose bytes come from L3.
    let back = m.prepare_store(&a, 3).unwrap().unwrap();
    assert_eq!(
        back.evicted, b,
        "b was never backed up yet, but is the coldest"
    );
    m.complete_store(back.job, JobOutcome::Done).unwrap();
    assert_eq!(m.lookup(&a, 2), Lookup::Hit);
    assert!(
        m.plan_backups().is_empty(),
        "b left host before its backup was planned, a is in L3 already"
    );
    m.l3_lost(&a[1..]).unwrap();
    let c = chain(3, 3, 0);
    let sc = m.prepare_store(&c, 3).unwrap().unwrap();
    assert_eq!(sc.evicted, a);
    assert_eq!(
        (m.lookup(&a, 0), m.lookup(&a, 1)),
        (Lookup::InL3, Lookup::Miss)
    );
    m.complete_store(sc.job, JobOutcome::Done).unwrap();
    let bc = m.plan_backups();
    assert_eq!(bc[0].pages, c);
    m.complete_backup(bc[0].job, JobOutcome::Failed).unwrap();
    assert!(
        m.plan_backups().is_empty(),
        "a failed backup is not tried again before L3 answers (l3_backup_retry.rs)"
    );
    m.check().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Store { prompt: u8, len: usize },
    Complete { nth: usize, ok: bool },
    Load { prompt: u8, len: usize },
    FinishLoad { nth: usize },
    Touch { prompt: u8 },
    PlanBackups,
    CompleteBackup { nth: usize, ok: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..5, 1usize..7).prop_map(|(prompt, len)| Op::Store { prompt, len }),
        (0usize..4, prop::bool::weighted(0.8)).prop_map(|(nth, ok)| Op::Complete { nth, ok }),
        (0u8..5, 1usize..7).prop_map(|(prompt, len)| Op::Load { prompt, len }),
        (0usize..4).prop_map(|nth| Op::FinishLoad { nth }),
        (0u8..5).prop_map(|prompt| Op::Touch { prompt }),
        Just(Op::PlanBackups),
        (0usize..4, any::<bool>()).prop_map(|(nth, ok)| Op::CompleteBackup { nth, ok }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any sequence of stores, completions (some failed), loads and touches over prompts that
    /// share prefixes: the consistency check holds after every call; a load reads exactly
    /// the pages a completed store wrote; evicted pages are misses until stored again; the
    /// host's `Stored`/`Removed` events replay to exactly the pages that are hits.
    #[test]
    fn the_host_tier_stays_consistent_and_loads_read_what_was_stored(
        slots in 1u32..12,
        shared in 0usize..4,
        freq in any::<bool>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let policy = if freq { EvictionPolicy::CONVERSATION } else { EvictionPolicy::Lru };
        let mut m = OffloadManager::new(slots, policy).unwrap();
        m.set_l3_backups(L3Backups::WriteThrough);
        let mut backups = Vec::new();
        let mut in_l3: std::collections::HashSet<PageHash> = Default::default();
        let mut content: HashMap<u32, PageHash> = HashMap::new(); // slot -> page written
        let mut stores = Vec::new();
        let mut loads = Vec::new();
        let mut resident: std::collections::HashSet<PageHash> = Default::default();
        for op in ops {
            let mut evicted = Vec::new();
            match op {
                Op::Store { prompt, len } => {
                    let c = chain(prompt, len, shared);
                    let host = m.host_prefix(&c);
                    if let Some(p) = m.prepare_store(&c, len).unwrap() {
                        prop_assert!(!p.slots.is_empty());
                        evicted = p.evicted.clone();
                        let direct = p.from == host; // no parent store to wait for
                        stores.push((p, c, direct));
                    }
                }
                Op::Complete { nth, ok } => {
                    if !stores.is_empty() {
                        let (p, c, direct) = stores.remove(nth % stores.len());
                        if ok {
                            for (i, s) in p.slots.iter().enumerate() {
                                content.insert(s.index(), c[p.from + i]);
                            }
                        }
                        let outcome = if ok { JobOutcome::Done } else { JobOutcome::Failed };
                        m.complete_store(p.job, outcome).unwrap();
                        if ok && direct {
                            // Its parent was on host (and locked): inserted at once. (A store
                            // after a parent store waits for it, and dies with it.)
                            prop_assert!(m.host_prefix(&c) >= p.from + p.slots.len());
                        }
                    }
                }
                Op::Load { prompt, len } => {
                    let c = chain(prompt, len, shared);
                    let hits = (0..len).take_while(|&i| m.lookup(&c, i) == Lookup::Hit).count();
                    for (i, h) in c.iter().enumerate().skip(hits) {
                        // InL3 only for pages a backup stored.
                        if m.lookup(&c, i) == Lookup::InL3 {
                            prop_assert!(in_l3.contains(h));
                        }
                    }
                    prop_assert_eq!(hits, m.host_prefix(&c));
                    if hits > 0 {
                        let l = m.prepare_load(&c, 0, hits).unwrap();
                        for (i, s) in l.slots.iter().enumerate() {
                            prop_assert_eq!(content.get(&s.index()), Some(&c[i]), "slot {} of page {}", s.index(), i);
                        }
                        loads.push(l.job);
                    } else {
                        prop_assert!(m.prepare_load(&c, 0, len).is_err());
                    }
                }
                Op::FinishLoad { nth } => {
                    if !loads.is_empty() {
                        let j = loads.remove(nth % loads.len());
                        m.complete_load(j).unwrap();
                    }
                }
                Op::Touch { prompt } => m.touch(&chain(prompt, 6, shared)),
                Op::PlanBackups => {
                    for b in m.plan_backups() {
                        // A backup reads host slots that hold exactly its pages.
                        for (p, s) in b.pages.iter().zip(&b.slots) {
                            prop_assert_eq!(content.get(&s.index()), Some(p));
                        }
                        backups.push((b.job, b.pages));
                    }
                }
                Op::CompleteBackup { nth, ok } => {
                    if !backups.is_empty() {
                        let (j, pages) = backups.remove(nth % backups.len());
                        let outcome = if ok { JobOutcome::Done } else { JobOutcome::Failed };
                        m.complete_backup(j, outcome).unwrap();
                        if ok {
                            in_l3.extend(pages);
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
                            prop_assert!(resident.remove(&h));
                            evicted.retain(|e| *e != h);
                        }
                    }
                    other => prop_assert!(false, "unexpected event {:?}", other),
                }
            }
            prop_assert!(evicted.is_empty(), "evicted but no Removed event: {:?}", evicted);
            prop_assert_eq!(resident.len(), m.usage().cached);
            prop_assert!(m.usage().cached + m.usage().held <= slots as usize);
        }
    }
}

/// Tenant quotas (`offload_tenant.rs`): a tenant within its host cap loses no page to
/// another tenant's stores, and a tenant past its cap evicts its own pages first.
#[test]
fn a_tenant_within_its_cap_keeps_its_host_pages_under_another_tenants_burst() {
    use kvtier_radix::TenantId;
    let (a, b) = (TenantId(1), TenantId(2));
    let mut m = OffloadManager::new(8, EvictionPolicy::Lru).unwrap();
    m.set_tenant_cap(a, Some(4));
    m.set_tenant_cap(b, Some(4));
    let mine = chain(1, 4, 0);
    let s = m.prepare_store_for(a, &mine, 4).unwrap().unwrap();
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    assert_eq!(m.tenant_charge(a), Some(4));
    // b stores 3 prompts of 4 pages: it may use the 4 free slots, then only its own.
    for p in 2..5u8 {
        let c = chain(p, 4, 0);
        let s = m.prepare_store_for(b, &c, 4).unwrap().unwrap();
        assert!(
            s.evicted.iter().all(|h| !mine.contains(h)),
            "a's pages evicted for b"
        );
        assert_eq!(s.slots.len(), 4);
        m.complete_store(s.job, JobOutcome::Done).unwrap();
        m.check().unwrap();
        assert_eq!(m.host_prefix(&mine), 4, "a within its cap keeps everything");
        assert!(m.tenant_charge(b).unwrap() <= 4);
    }
    // The evictions reach the events too (in order, once).
    let removed: usize = m
        .drain_events()
        .iter()
        .map(|e| match e {
            KvEvent::Removed { hashes, .. } => hashes.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(removed, 8);
    // Without a cap the same burst evicts a (plain LRU): the control.
    let mut m = OffloadManager::new(8, EvictionPolicy::Lru).unwrap();
    let s = m.prepare_store(&mine, 4).unwrap().unwrap();
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    for p in 2..5u8 {
        let c = chain(p, 4, 0);
        let s = m.prepare_store(&c, 4).unwrap().unwrap();
        m.complete_store(s.job, JobOutcome::Done).unwrap();
    }
    assert_eq!(m.host_prefix(&mine), 0);
}

#[test]
fn a_tenant_past_its_cap_stores_only_what_fits() {
    use kvtier_radix::TenantId;
    let t = TenantId(7);
    let mut m = OffloadManager::new(16, EvictionPolicy::Lru).unwrap();
    m.set_tenant_cap(t, Some(3));
    let c = chain(1, 5, 0);
    let s = m.prepare_store_for(t, &c, 5).unwrap().unwrap();
    assert_eq!(s.slots.len(), 3, "the cap bounds one store");
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    assert_eq!((m.host_prefix(&c), m.tenant_charge(t)), (3, Some(3)));
    // Its next prompt evicts its own coldest leaf (the whole 3-page node) to fit.
    let d = chain(2, 2, 0);
    let s = m.prepare_store_for(t, &d, 2).unwrap().unwrap();
    assert_eq!((s.slots.len(), s.evicted.len()), (2, 3));
    m.complete_store(s.job, JobOutcome::Done).unwrap();
    m.check().unwrap();
}

/// The shadow selector learns from submitted requests, which a manager never sees: refused
/// with a typed error instead of silently staying at its first choice.
#[test]
fn a_manager_refuses_the_shadow_policy() {
    assert!(matches!(
        OffloadManager::new(8, EvictionPolicy::Shadow),
        Err(OffloadError::ShadowNeedsRequests)
    ));
}
