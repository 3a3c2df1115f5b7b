//! The store's KV events across an etcd failover, with real processes: one etcd, two
//! `kvtier-l3 --role master --etcd` given the same `--kv-events` endpoints (only the leader
//! binds them), two DRAM-only store nodes following the leader, a client following it, and
//! a `kvtier-router` subscribed to the endpoints as `--storage`.
//!
//! The leader and one node are SIGKILLed together: the new leader binds the endpoints and
//! starts a new stream (from 0, `AllBlocksCleared` first) with what the surviving node
//! reports. The router must end with exactly the pages that still exist — the dead node's
//! are gone, which only a resync with the new stream can tell it — and then follow the new
//! leader's live removals.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::common::ha::{HaMaster, free_addr, ha_client, ha_dram_node, leader, spawn_master_with};
use crate::common::kv_events::{free_endpoint, key, pages, prompt, router, wire};
use crate::common::procs::eventually;
use crate::common::t;
use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::{ExistOptions, L3Store, PutOptions, RemoteStore};
use kvtier_router::launch;

fn storage(r: &launch::Running) -> BTreeSet<u64> {
    let c = r.cluster.lock().unwrap();
    c.router().index().storage_hashes().into_iter().collect()
}

/// Retries a call while the leader changes (at most 30 s).
fn retry<T>(what: &str, mut f: impl FnMut() -> Result<T, kvtier_l3::L3Error>) -> T {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) => assert!(Instant::now() < end, "{what}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn existing(c: &RemoteStore, keys: &[String]) -> Vec<bool> {
    retry("exist", || {
        c.batch_exist_key(&t("a"), keys, ExistOptions::default())
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn after_a_failover_the_router_resyncs_from_the_new_leaders_stream() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let etcd = LocalEtcd::start(1).unwrap();
    let (ev, rep) = (free_endpoint(), free_endpoint());
    let flags = ["--kv-events", &ev, "--kv-events-replay", &rep];
    let mut masters: Vec<HaMaster> = (0..2)
        .map(|_| spawn_master_with(&etcd, free_addr(), 1, &flags))
        .collect();
    let (laddr, epoch) = leader(&etcd, Duration::from_secs(20)).expect("a leader");
    let mut nodes = vec![ha_dram_node(&etcd, 1, 100), ha_dram_node(&etcd, 2, 100)];
    let c = ha_client(&etcd);
    let r = router(&rt, &ev, &rep, crate::common::kv_events::PS);
    // 16 pages, put one by one (each its own batch: the old stream runs well past what the
    // new one will number), two nodes sharing them
    let toks = prompt(9, 16);
    let hs = pages(&toks);
    let keys: Vec<String> = hs.iter().map(|h| key("m1", h, 0)).collect();
    for k in &keys {
        retry("put", || {
            c.put(&t("a"), k, &[1u8; 2000], PutOptions::default())
        });
        std::thread::sleep(Duration::from_millis(30));
    }
    let all: BTreeSet<u64> = hs.iter().map(wire).collect();
    assert!(
        eventually(Duration::from_secs(20), || storage(&r) == all),
        "the router sees the 16 pages from the first leader"
    );

    // the leader and node 2 die together: node 2's objects are lost for good
    let victim = masters.iter().position(|m| m.addr == laddr).unwrap();
    let _ = masters[victim].child.kill();
    let _ = masters[victim].child.wait();
    drop(nodes.pop());
    let end = Instant::now() + Duration::from_secs(30);
    while leader(&etcd, Duration::from_secs(1)).is_none_or(|(_, e)| e <= epoch) {
        assert!(Instant::now() < end, "no new leader");
    }
    let alive = existing(&c, &keys);
    let kept: BTreeSet<u64> = hs
        .iter()
        .zip(&alive)
        .filter(|x| *x.1)
        .map(|x| wire(x.0))
        .collect();
    assert!(
        !kept.is_empty() && kept.len() < hs.len(),
        "both nodes held pages ({} of 16 kept): the test tells a resync from none",
        kept.len()
    );
    assert!(
        eventually(Duration::from_secs(20), || storage(&r) == kept),
        "the router holds exactly what the new leader has: {} pages, want {}",
        storage(&r).len(),
        kept.len()
    );
    // and follows the new leader's stream live
    let doomed = hs.iter().zip(&alive).find(|x| *x.1).map(|x| x.0).unwrap();
    retry("remove", || c.remove(&t("a"), &key("m1", doomed, 0), false));
    let mut left = kept.clone();
    left.remove(&wire(doomed));
    assert!(
        eventually(Duration::from_secs(20), || storage(&r) == left),
        "a removal on the new leader reaches the router"
    );
    let counters = r.cluster.lock().unwrap().streams[0].counters.clone();
    assert!(
        counters.reconnects + counters.restarts >= 1,
        "the router saw a new stream: {counters:?}"
    );
    rt.block_on(r.stop());
    drop(nodes);
    drop(masters);
}
