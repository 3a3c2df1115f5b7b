//! The scheduler with the real embedded L3 store: instances sharing it, tenants isolated in it,
//! losses it reports, tensor-parallel ranks agreeing over it.

use std::sync::Arc;

use kvtier_e2e::StoreEngine;
use kvtier_l3::{EmbeddedStore, L3Store, StoreConfig};
use kvtier_scheduler::*;

fn cfg(rank: u32) -> SchedulerConfig {
    SchedulerConfig {
        page_size: 4,
        device_pages: 64,
        host_pages: 128,
        max_batch_size: 8,
        token_budget: 64,
        chunked_prefill_size: 32,
        max_context_tokens: 256,
        l3_enabled: true,
        prefetch_threshold: 1,
        prefetch_stop: PrefetchStopPolicy::WaitComplete,
        rank,
        ..SchedulerConfig::default()
    }
}

/// Rank `rank` of a tensor-parallel pair.
fn tp_cfg(rank: u32) -> SchedulerConfig {
    SchedulerConfig {
        tp_ranks: 2,
        ..cfg(rank)
    }
}

fn store() -> Arc<dyn L3Store> {
    Arc::new(
        EmbeddedStore::new(StoreConfig {
            local_segment_bytes: 1 << 20,
            ..StoreConfig::default()
        })
        .expect("store"),
    )
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 1000 + i).collect()
}

fn req(id: u64, p: Vec<u32>) -> RequestSpec {
    RequestSpec::new(RequestId(id), p, 3)
}

#[test]
fn a_second_instance_reads_the_first_ones_pages_from_the_store() {
    let l3 = store();
    let mut a = StoreEngine::new(cfg(0), l3.clone(), "e2e");
    a.submit(req(1, prompt(1, 41))).unwrap();
    a.run_to_idle().unwrap();
    let mut b = StoreEngine::new(cfg(0), l3, "e2e");
    b.submit(req(2, prompt(1, 41))).unwrap();
    b.run_to_idle().unwrap();
    assert_eq!(b.s.stats().l3_hit_pages, 10);
    assert!(b.pages_checked > 0);
}

#[test]
fn tenants_share_nothing_through_the_store() {
    let l3 = store();
    let mut a = StoreEngine::new(cfg(0), l3.clone(), "e2e");
    a.submit(req(1, prompt(1, 41)).with_salt("tenant-a"))
        .unwrap();
    a.run_to_idle().unwrap();
    let mut b = StoreEngine::new(cfg(0), l3.clone(), "e2e");
    b.submit(req(2, prompt(1, 41)).with_salt("tenant-b"))
        .unwrap();
    b.run_to_idle().unwrap();
    assert_eq!(
        b.s.stats().l3_hit_pages,
        0,
        "another tenant's pages were hit"
    );
    let mut c = StoreEngine::new(cfg(0), l3, "e2e");
    c.submit(req(3, prompt(1, 41)).with_salt("tenant-a"))
        .unwrap();
    c.run_to_idle().unwrap();
    assert_eq!(c.s.stats().l3_hit_pages, 10, "the same tenant shares");
}

#[test]
fn a_removal_the_store_reports_is_backed_up_again() {
    let l3 = store();
    let mut a = StoreEngine::new(cfg(0), l3.clone(), "e2e");
    let p = prompt(2, 41);
    a.submit(req(1, p.clone())).unwrap();
    a.run_to_idle().unwrap();
    let keys = a.s.l3_keys(&kvtier_radix::page_hashes(&p, 4, None));
    l3.remove(&a.tenant, &keys[2], true).unwrap();
    assert!(!l3.is_exist(&a.tenant, &keys[2]).unwrap());
    assert!(a.s.l3_lost(&keys[2..3]).unwrap() >= 1);
    a.submit(req(2, p)).unwrap();
    a.run_to_idle().unwrap();
    assert!(l3.is_exist(&a.tenant, &keys[2]).unwrap(), "backed up again");
}

#[test]
fn two_ranks_agree_over_a_store_that_lost_one_ranks_shards() {
    // Both ranks back their shards up, then the store loses some of rank 1's.
    let l3 = store();
    let p = prompt(3, 41);
    let mut seed: Vec<StoreEngine> = (0..2)
        .map(|r| StoreEngine::new(tp_cfg(r), l3.clone(), "e2e"))
        .collect();
    for e in &mut seed {
        e.submit(req(1, p.clone())).unwrap();
        e.run_to_idle().unwrap();
    }
    let k1 = seed[1].s.l3_keys(&kvtier_radix::page_hashes(&p, 4, None));
    l3.remove(&seed[1].tenant, &k1[4], true).unwrap();

    let mut ranks: Vec<StoreEngine> = (0..2)
        .map(|r| StoreEngine::new(tp_cfg(r), l3.clone(), "e2e"))
        .collect();
    let mut agree = [RankAgreement::new(), RankAgreement::new()];
    for e in &mut ranks {
        e.submit(req(2, p.clone())).unwrap();
    }
    for t in 0..1000 {
        if ranks.iter().all(|e| e.s.is_idle()) {
            break;
        }
        let plans: Vec<ExecutionPlan> = ranks
            .iter_mut()
            .map(|e| e.s.next_execution_plan(t))
            .collect();
        assert_eq!(
            plans[0].digest(),
            plans[1].digest(),
            "step {t}: ranks diverged"
        );
        for ((e, a), plan) in ranks.iter_mut().zip(&mut agree).zip(&plans) {
            for op in &plan.ops {
                a.push(e.execute(op).unwrap()).unwrap();
            }
        }
        let v: Vec<Vec<u64>> = ranks
            .iter()
            .zip(&agree)
            .map(|(e, a)| a.values(&e.s))
            .collect();
        let min: Vec<u64> = v[0].iter().zip(&v[1]).map(|(x, y)| *x.min(y)).collect();
        for (e, a) in ranks.iter_mut().zip(&mut agree) {
            for ev in a.reduce(&e.s, |x| x.copy_from_slice(&min)).unwrap() {
                e.s.on_event(ev).unwrap();
            }
        }
        for (e, plan) in ranks.iter_mut().zip(&plans) {
            if plan.forward.step.is_some() {
                let ev = e.forward(&plan.forward).unwrap();
                e.s.on_event(ev).unwrap();
            }
        }
    }
    for e in &ranks {
        assert!(e.s.is_idle());
        e.s.check().unwrap();
        // Rank 1 lost page 4: both ranks prefetched only pages 0..4 and computed the rest.
        assert_eq!(e.s.stats().l3_hit_pages, 4);
    }
}

/// The store is down while a prompt is computed: its backup fails and its pages stay on host.
/// While the store is down, idle plans try nothing again; once it is back and has answered
/// (another prompt's backup succeeded), the failed pages are backed up, so a second instance
/// reads them from the store instead of computing them.
#[test]
fn pages_computed_while_the_store_was_down_reach_it_once_it_is_back() {
    let l3 = store();
    let mut a = StoreEngine::new(cfg(0), l3.clone(), "e2e");
    let (down, after) = (prompt(4, 41), prompt(5, 41));
    let hashes = kvtier_radix::page_hashes(&down, 4, None);
    let keys = a.s.l3_keys(&hashes);
    a.l3_down = true;
    a.submit(req(1, down.clone())).unwrap();
    a.run_to_idle().unwrap();
    assert!(a.s.stats().op(OpKind::BackUp).failed >= 1);
    assert_eq!(
        a.s.cache().peek_prefix(&hashes).1,
        10,
        "the pages are on host"
    );
    assert_eq!(a.s.stats().backups_retrying, 1, "the failed backup waits");
    let issued = a.s.stats().op(OpKind::BackUp).issued;
    for t in 0..5 {
        a.step(100 + t).unwrap();
    }
    assert_eq!(
        a.s.stats().op(OpKind::BackUp).issued,
        issued,
        "a backup tried again while the store had not answered"
    );
    a.l3_down = false;
    a.submit(req(2, after)).unwrap();
    a.run_to_idle().unwrap();
    let missing: Vec<&String> = keys
        .iter()
        .filter(|k| !l3.is_exist(&a.tenant, k).unwrap_or(false))
        .collect();
    assert!(
        missing.is_empty(),
        "pages computed while the store was down never reached it: {missing:?}"
    );
    let st = a.s.stats();
    assert_eq!((st.backups_retrying, st.backups_given_up), (0, 0));
    assert_eq!(st.backups_retried, 1);
    let mut b = StoreEngine::new(cfg(0), l3, "e2e");
    b.submit(req(3, down)).unwrap();
    b.run_to_idle().unwrap();
    assert_eq!(b.s.stats().l3_hit_pages, 10);
}
