//! Issue 33, item 1, with real processes: an acknowledged remove must not come back after a
//! failover when the reply that told a DRAM-only node of the frees was lost.
//!
//! The sequence the issue found (60 of 60 keys came back): put keys on one DRAM-only node;
//! SIGSTOP the node; remove every key; SIGSTOP the leader; SIGCONT the node — its ping
//! queues at the paused leader and times out (`--master-timeout-ms 1000`); SIGCONT the
//! leader after 1.6 s (it answers the queued ping into the void: the frees are handed out
//! and lost); let a few pings pass (the node acknowledges the removes' cancels); SIGKILL the
//! leader; read through the new leader. The next leader adopted the bytes the node kept.
//! Now the frees are repeated until the node acknowledges dropping the bytes, and a node
//! drops a cancelled version's DRAM copies before acknowledging the cancel.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::ha::{HaMaster, free_addr, ha_client, ha_dram_node, leader, signal, spawn_master};
use common::{payload, t};
use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::{L3Error, L3Store, PutOptions};

const KEYS: usize = 60;
/// The leader's lease: longer than its pause below, so it is still the leader after it.
const LEADER_TTL_S: u64 = 4;

#[test]
fn a_remove_whose_free_reply_was_lost_stays_removed_after_the_leader_dies() {
    let etcd = LocalEtcd::start(3).unwrap();
    let mut masters: Vec<HaMaster> = (0..2)
        .map(|_| spawn_master(&etcd, free_addr(), LEADER_TTL_S))
        .collect();
    let (laddr, epoch) = leader(&etcd, Duration::from_secs(20)).expect("a leader");
    let node = ha_dram_node(&etcd, 1, 200);
    let c = ha_client(&etcd);
    let tn = t("r");
    let mut live = BTreeMap::new();
    for i in 0..KEYS {
        let (k, v) = (format!("k{i}"), payload(i, 3000));
        let end = Instant::now() + Duration::from_secs(20);
        while let Err(e) = c.put(&tn, &k, &v, PutOptions::default()) {
            assert!(Instant::now() < end, "put {k} fails for 20 s: {e}");
            std::thread::sleep(Duration::from_millis(100));
        }
        live.insert(k, v);
    }
    for (k, v) in &live {
        assert_eq!(&c.get(&tn, k).unwrap(), v);
    }

    signal(&node.child, libc::SIGSTOP);
    for k in live.keys() {
        c.remove(&tn, k, true).unwrap();
    }
    let victim = masters.iter().position(|m| m.addr == laddr).unwrap();
    signal(&masters[victim].child, libc::SIGSTOP);
    signal(&node.child, libc::SIGCONT);
    // The node's ping waits at the paused leader and times out after 1 s.
    std::thread::sleep(Duration::from_millis(1600));
    signal(&masters[victim].child, libc::SIGCONT);
    // A few pings: the node acknowledges the removes' cancels.
    std::thread::sleep(Duration::from_millis(1500));
    let (still, e) = leader(&etcd, Duration::from_secs(1)).expect("a leader");
    assert_eq!(
        (still, e),
        (laddr, epoch),
        "the paused leader lost its lease"
    );
    // Drop (SIGCONT, SIGKILL, wait) the leader; a standby takes over.
    masters.remove(victim);
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        match leader(&etcd, Duration::from_secs(1)) {
            Some((_, e)) if e > epoch => break,
            _ => assert!(Instant::now() < end, "no new leader"),
        }
    }
    // Read until the new leader has rebuilt (the node mounted and reported what it kept).
    let mut back = Vec::new();
    for k in live.keys() {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            match c.get(&tn, k) {
                Ok(v) => {
                    back.push((k.clone(), v.len()));
                    break;
                }
                Err(L3Error::ObjectNotFound) => break,
                Err(e) => {
                    assert!(Instant::now() < end, "get {k} fails for 30 s: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
    assert!(
        back.is_empty(),
        "{} of {KEYS} removed keys came back after the failover: {back:?}",
        back.len()
    );
    drop(node);
}
