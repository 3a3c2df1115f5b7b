//! A put whose two phases straddle a master failover, with real processes (3 etcd members, 2
//! `kvtier-l3 --role master --etcd`, 3 store nodes with SSD tiers, a client following the
//! leader through `etcd://`).
//!
//! Why a test of its own: a put's start is placed by one leader epoch; the bytes go to store
//! nodes; its end is settled by whichever leader holds the cluster then. If the leader died
//! in between, the new one never placed that put and cannot vouch for its bytes, so the
//! caller must get a typed `EpochFenced` ("put it again") — never a silent success, and never
//! a half-written object readable by anyone.

mod common;

use std::time::{Duration, Instant};

use common::ha::{HaMaster, ha_client, ha_cluster, leader, spawn_master};
use common::{payload, t};
use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::rpc::service::{ClusterReply, ClusterRequest};
use kvtier_l3::{DataPath, L3Error, L3Store, PutOptions, RemoteStore};

/// Kills the leader master; returns once a leader of a higher epoch is published and every
/// store node has mounted on it and it serves (so what the client sees next is the new leader's verdict,
/// not a node still looking for a master).
fn fail_over(etcd: &LocalEtcd, masters: &mut [HaMaster], c: &RemoteStore) {
    let (laddr, epoch) = leader(etcd, Duration::from_secs(5)).expect("a leader");
    let victim = masters.iter().position(|m| m.addr == laddr).unwrap();
    let _ = masters[victim].child.kill();
    let _ = masters[victim].child.wait();
    let end = Instant::now() + Duration::from_secs(20);
    while !matches!(leader(etcd, Duration::from_secs(1)), Some((_, e)) if e > epoch) {
        assert!(Instant::now() < end, "no new leader after epoch {epoch}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Serving key calls: every node has mounted again and reported its records.
    let serving = common::procs::eventually(Duration::from_secs(20), || {
        matches!(
            c.cluster(ClusterRequest::Nodes),
            Ok(ClusterReply::Nodes(n)) if n.len() == 3
        ) && c.get(&t("straddle"), "absent") == Err(L3Error::ObjectNotFound)
    });
    assert!(serving, "the new leader never served");
    masters[victim] = spawn_master(etcd, laddr, 1);
}

#[test]
fn a_put_straddling_a_failover_is_fenced_and_nothing_half_written_is_readable() {
    let cl = ha_cluster(2);
    let (etcd, mut masters) = (&cl.etcd, cl.masters);
    let c = ha_client(etcd);
    let tn = t("straddle");
    let v = payload(7, 5000);

    // 1. Start and write under the old leader, end under the new one.
    let h = c.put_start(&tn, "written", v.len() as u64).unwrap();
    c.put_write(&h, &v).unwrap();
    let old_epoch = c.epoch();
    fail_over(etcd, &mut masters, &c);
    match c.put_end(&h, common::persisted()) {
        Err(L3Error::EpochFenced(m)) => assert!(m.contains("put it again"), "{m}"),
        other => panic!("a put ended across a failover gave {other:?}, not EpochFenced"),
    }
    assert!(
        c.epoch() > old_epoch,
        "the client did not follow the new leader"
    );

    // 2. Start under the old leader, write and end under the new one. The client is on the
    // nodes' host: the write goes through the node's shared memory, which fences the stale
    // epoch as its data channel does.
    let h2 = c.put_start(&tn, "unwritten", v.len() as u64).unwrap();
    fail_over(etcd, &mut masters, &c);
    let paths = c.node_paths();
    assert!(
        paths.iter().all(|(_, p)| *p == DataPath::SharedMemory),
        "{paths:?}"
    );
    let wrote = c.put_write(&h2, &v);
    assert!(
        matches!(wrote, Err(L3Error::EpochFenced(_))),
        "a stale epoch's write over shared memory: {wrote:?}"
    );
    let ended = c.put_end(&h2, PutOptions::default());
    assert!(
        matches!(wrote, Err(L3Error::EpochFenced(_)))
            || matches!(ended, Err(L3Error::EpochFenced(_))),
        "a put started before a failover was accepted after it: write {wrote:?}, end {ended:?}"
    );
    assert!(
        !matches!(ended, Ok(())),
        "a put started before a failover ended with Ok"
    );

    // Nothing half-written is readable, to this client or a fresh one.
    let fresh = ha_client(etcd);
    for k in ["written", "unwritten"] {
        for reader in [&c, &fresh] {
            assert_eq!(
                reader.get(&tn, k).map(|b| b.len()),
                Err(L3Error::ObjectNotFound),
                "{k}"
            );
            assert!(
                !reader.exist_key(&tn, k, Default::default()).unwrap(),
                "{k} exists"
            );
        }
    }
    // Put again, as the error says: it succeeds and reads back whole.
    c.put(&tn, "written", &v, common::persisted()).unwrap();
    assert_eq!(fresh.get(&tn, "written").unwrap(), v);
}
