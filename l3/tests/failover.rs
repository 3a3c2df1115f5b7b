//! Master failover on etcd with real processes: 3 etcd members, 3 `kvtier-l3 --role master
//! --etcd` (1 s leader lease), 3 store nodes with SSD tiers following the leader, a client
//! following it through `etcd://`. The leader master is SIGKILLed and SIGSTOPped in turn;
//! after each: a new leader of a higher epoch serves, every acknowledged put (one and two
//! replicas) reads back with its bytes, no acknowledged remove comes back, and a paused
//! leader that resumes never answers as the leader again. Meanwhile two more clients put,
//! get and remove keys of their own, judged by an oracle (`common::oracle`): no acknowledged
//! put missing or read back with other bytes, no acknowledged remove back, no older version.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::ha::{
    HaMaster, check_keys, free_addr, ha_client, ha_node, leader, signal, spawn_master,
};
use common::{payload, t};
use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::{ClientOptions, L3Error, L3Store, PutOptions, RemoteStore, ReplicateConfig};

const TTL_S: u64 = 1;

fn new_leader(etcd: &LocalEtcd, after: u64) -> (std::net::SocketAddr, u64) {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some((a, e)) = leader(etcd, Duration::from_secs(1))
            && e > after
        {
            return (a, e);
        }
        assert!(Instant::now() < end, "no new leader after epoch {after}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Puts `n` keys of round `round` with `replicas` copies, acknowledged once their DRAM
/// replicas are written (no `wait_persisted`: a node keeps its DRAM replicas when it remounts
/// on a new leader, which adopts them); returns the acknowledged ones. Puts are not retried by the
/// client: a batch refused as a whole (the master was failing over) is sent again here.
fn put_round(c: &RemoteStore, round: usize, replicas: usize, n: usize) -> Vec<(String, Vec<u8>)> {
    let tn = t("ha");
    let keys: Vec<String> = (0..n)
        .map(|i| format!("r{round}-x{replicas}-{i}"))
        .collect();
    let data: Vec<Vec<u8>> = (0..n).map(|i| payload(round * 1000 + i, 3000)).collect();
    let bufs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let cfg = ReplicateConfig {
        replica_num: replicas as u32,
    };
    let end = Instant::now() + Duration::from_secs(30);
    let res = loop {
        match c.batch_put_from_with(&tn, &keys, &bufs, PutOptions::default(), cfg) {
            Ok(r) => break r,
            Err(e) => assert!(Instant::now() < end, "puts fail for 30 s: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    keys.into_iter()
        .zip(data)
        .zip(res)
        .filter_map(|(kd, r)| r.ok().map(|_| kd))
        .collect()
}

fn check(c: &RemoteStore, live: &BTreeMap<String, Vec<u8>>, removed: &[String]) {
    check_keys(c, &t("ha"), live, removed);
}

#[test]
fn killing_or_pausing_the_leader_loses_nothing_and_clients_follow() {
    let etcd = LocalEtcd::start(3).unwrap();
    let mut masters: Vec<HaMaster> = (0..3)
        .map(|_| spawn_master(&etcd, free_addr(), TTL_S))
        .collect();
    let (_, mut epoch) = leader(&etcd, Duration::from_secs(20)).expect("a leader");
    let ssd: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let _nodes: Vec<_> = (0..3)
        .map(|i| ha_node(&etcd, i as u64 + 1, ssd[i].path()))
        .collect();
    let c = ha_client(&etcd);
    assert!(c.is_cluster() && c.follows_leader());
    // Two more clients doing puts (1 and 2 replicas), gets and removes all along.
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|id| {
            let (c, stop) = (Arc::new(ha_client(&etcd)), stop.clone());
            std::thread::spawn(move || common::oracle::worker(c, id, stop))
        })
        .collect();
    let mut live = BTreeMap::new();
    let mut removed = Vec::new();
    for round in 0..4 {
        for replicas in [1, 2] {
            live.extend(put_round(&c, round, replicas, 8));
        }
        // Remove a few acknowledged keys of this round.
        let tn = t("ha");
        let doomed: Vec<String> = live.keys().filter(|k| k.ends_with("-3")).cloned().collect();
        for k in doomed {
            c.remove(&tn, &k, true).unwrap();
            live.remove(&k);
            removed.push(k);
        }
        check(&c, &live, &removed);
        let (laddr, _) = leader(&etcd, Duration::from_secs(5)).unwrap();
        let victim = masters.iter().position(|m| m.addr == laddr).unwrap();
        let pause = round % 2 == 1;
        if pause {
            signal(&masters[victim].child, libc::SIGSTOP);
        } else {
            let _ = masters[victim].child.kill();
            let _ = masters[victim].child.wait();
        }
        let (_, e) = new_leader(&etcd, epoch);
        assert!(e > epoch);
        epoch = e;
        check(&c, &live, &removed);
        assert_eq!(c.epoch(), epoch, "the client follows the newest leader");
        if pause {
            // The paused leader resumes: it must not answer as the leader again (at most,
            // once restarted as a standby, it redirects to the new leader).
            signal(&masters[victim].child, libc::SIGCONT);
            std::thread::sleep(Duration::from_millis(300));
            let direct = RemoteStore::connect(
                laddr,
                ClientOptions {
                    rpc_timeout: Duration::from_secs(2),
                    ..Default::default()
                },
            );
            if let Ok(d) = direct {
                assert_ne!(d.master_addr(), laddr, "a deposed leader answered hello");
                assert_eq!(d.epoch(), epoch, "redirected to an old leader");
            }
        } else {
            masters[victim] = spawn_master(&etcd, laddr, TTL_S);
        }
    }
    stop.store(true, Ordering::Release);
    for w in workers {
        let r = w.join().unwrap();
        eprintln!(
            "oracle worker: {} puts, {} removes, {} gets, {} transient",
            r.puts, r.removes, r.gets, r.transient
        );
        assert!(r.violations.is_empty(), "{:?}", r.violations);
        assert!(
            r.puts > 4 && r.removes > 0 && r.gets > 4,
            "no progress: {r:?}"
        );
    }
}

/// The etcd raft leader is SIGKILLed (then restarted), then SIGSTOPped (then resumed), under
/// a serving cluster: the master keeps or hands over its leadership cleanly (a paused member
/// costs one request deadline, then another member answers), and the store goes on with
/// nothing lost.
#[test]
fn killing_or_pausing_the_etcd_leader_loses_nothing() {
    let mut etcd = LocalEtcd::start(3).unwrap();
    let _masters: Vec<HaMaster> = (0..2)
        .map(|_| spawn_master(&etcd, free_addr(), TTL_S))
        .collect();
    leader(&etcd, Duration::from_secs(20)).expect("a leader");
    let ssd: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let _nodes: Vec<_> = (0..3)
        .map(|i| ha_node(&etcd, i as u64 + 1, ssd[i].path()))
        .collect();
    let c = ha_client(&etcd);
    let mut live = BTreeMap::new();
    for round in 0..2 {
        live.extend(put_round(&c, round, 2, 8));
        let dead = etcd.wait_leader(Duration::from_secs(10)).unwrap();
        let pause = round == 1;
        if pause {
            etcd.pause(dead);
        } else {
            etcd.kill(dead);
        }
        std::thread::sleep(Duration::from_millis(700));
        // Writes may fail while the master fails over; reads retry and must all succeed.
        check(&c, &live, &[]);
        live.extend(put_round(&c, round + 10, 1, 8));
        check(&c, &live, &[]);
        if pause {
            etcd.resume(dead);
        } else {
            etcd.restart(dead).unwrap();
        }
        etcd.wait_leader(Duration::from_secs(10)).unwrap();
    }
}

/// A store node is paused while keys whose SSD copies it holds are removed, and the leader
/// master is killed before the node heard of it: the new leader replays the tombstones from
/// etcd, so when the node resumes and remounts, none of those keys comes back.
#[test]
fn a_node_paused_during_a_remove_never_brings_the_key_back() {
    let etcd = LocalEtcd::start(3).unwrap();
    let mut masters: Vec<HaMaster> = (0..2)
        .map(|_| spawn_master(&etcd, free_addr(), TTL_S))
        .collect();
    let (_, epoch) = leader(&etcd, Duration::from_secs(20)).expect("a leader");
    let ssd: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let nodes: Vec<_> = (0..3)
        .map(|i| ha_node(&etcd, i as u64 + 1, ssd[i].path()))
        .collect();
    let c = ha_client(&etcd);
    let tn = t("ha");
    let mut on_paused = Vec::new();
    let mut others = BTreeMap::new();
    for i in 0..24 {
        let k = format!("p{i}");
        let v = payload(i, 2000);
        c.put(&tn, &k, &v, common::persisted()).unwrap();
        let q = c.get_replica_list(&tn, &k).unwrap();
        let writer = q.replicas.iter().find_map(|r| match r {
            kvtier_l3::ReplicaDescriptor::Disk { node: Some(n), .. } => Some(n.id.0),
            _ => None,
        });
        if writer == Some(1) {
            on_paused.push(k);
        } else {
            others.insert(k, v);
        }
    }
    assert!(!on_paused.is_empty(), "node 1 wrote no SSD copy");
    signal(&nodes[0].child, libc::SIGSTOP);
    for k in &on_paused {
        c.remove(&tn, k, true).unwrap();
    }
    let (laddr, _) = leader(&etcd, Duration::from_secs(5)).unwrap();
    let victim = masters.iter().position(|m| m.addr == laddr).unwrap();
    let _ = masters[victim].child.kill();
    let _ = masters[victim].child.wait();
    new_leader(&etcd, epoch);
    std::thread::sleep(Duration::from_millis(500));
    signal(&nodes[0].child, libc::SIGCONT);
    // Wait until the resumed node has mounted on the new leader and reported its records
    // (a check before that would pass even if the tombstones were forgotten).
    let back = common::procs::eventually(Duration::from_secs(20), || {
        matches!(
            c.cluster(kvtier_l3::rpc::service::ClusterRequest::Nodes),
            Ok(kvtier_l3::rpc::service::ClusterReply::Nodes(n)) if n.iter().any(|n| n.id.0 == 1)
        )
    });
    assert!(back, "the paused node never mounted on the new leader");
    std::thread::sleep(Duration::from_millis(500));
    check(&c, &others, &on_paused);
    // And the cluster takes new writes again.
    c.put(&tn, "after", b"x", PutOptions::default()).unwrap();
    assert_eq!(c.get(&tn, "after").unwrap(), b"x");
}

/// etcd loses its quorum (2 of 3 members SIGSTOPped): the leader cannot renew its lease, so
/// within the TTL no master serves at all (no split brain, no stale answers); once etcd is
/// back a leader is elected again and every acknowledged put reads back.
#[test]
fn without_an_etcd_quorum_no_master_serves_and_service_returns_after() {
    let etcd = LocalEtcd::start(3).unwrap();
    let _masters: Vec<HaMaster> = (0..2)
        .map(|_| spawn_master(&etcd, free_addr(), TTL_S))
        .collect();
    leader(&etcd, Duration::from_secs(20)).expect("a leader");
    let ssd: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let _nodes: Vec<_> = (0..3)
        .map(|i| ha_node(&etcd, i as u64 + 1, ssd[i].path()))
        .collect();
    let c = ha_client(&etcd);
    // A client that does not retry: it shows what a caller gets while etcd is away.
    let probe = RemoteStore::connect_to(
        kvtier_l3::ha::Locator::parse(&etcd.locator(common::ha::CLUSTER)).unwrap(),
        ClientOptions {
            failover_timeout: Duration::from_millis(1),
            leader_call_timeout: Duration::from_millis(500),
            ..Default::default()
        },
    )
    .unwrap();
    let live: BTreeMap<_, _> = put_round(&c, 0, 2, 8).into_iter().collect();
    assert!(!live.is_empty());
    let some_key = live.keys().next().unwrap().clone();
    assert!(probe.get(&t("ha"), &some_key).is_ok());
    let paused = [0, 1];
    for i in paused {
        etcd.pause(i);
    }
    // Past the TTL, the leader must have stopped: every call fails (typed), none answers.
    std::thread::sleep(Duration::from_millis(TTL_S * 1000 + 500));
    for _ in 0..5 {
        let r = probe.get(&t("ha"), &some_key);
        assert!(
            matches!(
                r,
                Err(L3Error::NotLeader(_) | L3Error::RpcFail(_) | L3Error::Unavailable(_))
            ),
            "a master served without an etcd quorum: {:?}",
            r.map(|v| v.len())
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for i in paused {
        etcd.resume(i);
    }
    check(&c, &live, &[]);
}
