//! A client given a standby master's plain address (no `etcd://`) is redirected to the leader
//! and keeps working across failovers. Real processes: 3 etcd members, 3 `kvtier-l3 --role
//! master --etcd` on fixed ports, 3 store nodes with SSD tiers.
//!
//! Why: a standby that only campaigned (listening on nothing) left such a client with a dead
//! address; now every standby answers `NotLeader` naming the leader, the client follows it,
//! and after the leader dies it asks the address it was given again.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::ha::{ha_cluster, leader, spawn_master};
use common::{payload, t};
use kvtier_l3::{ClientOptions, L3Store, RemoteStore};

#[test]
fn a_client_given_a_standby_reaches_the_leader_and_follows_failovers() {
    let cl = ha_cluster(3);
    let (etcd, mut masters) = (&cl.etcd, cl.masters);
    let (mut laddr, mut epoch) = leader(etcd, Duration::from_secs(5)).expect("a leader");
    // The standby this client is given (it may be elected in turn, then killed).
    let standby = masters.iter().find(|m| m.addr != laddr).unwrap().addr;
    // Standbys listen once they campaign: wait for the port.
    let up = common::procs::eventually(Duration::from_secs(10), || {
        std::net::TcpStream::connect(standby).is_ok()
    });
    assert!(up, "the standby {standby} does not listen");
    let c = RemoteStore::connect(
        standby,
        ClientOptions {
            failover_timeout: Duration::from_secs(30),
            leader_call_timeout: Duration::from_millis(1000),
            ..Default::default()
        },
    )
    .expect("a client given a standby's address connects");
    assert_eq!(c.master_addr(), laddr, "not redirected to the leader");
    assert!(c.follows_leader() && c.is_cluster());
    assert_eq!(c.epoch(), epoch);
    let tn = t("redirect");
    let mut live = BTreeMap::new();
    for round in 0..3 {
        for i in 0..6 {
            let (k, v) = (format!("r{round}-{i}"), payload(round * 100 + i, 2500));
            let end = Instant::now() + Duration::from_secs(30);
            // Puts are not retried by the client (a put straddling a failover is refused).
            while let Err(e) = c.put(&tn, &k, &v, common::persisted()) {
                assert!(Instant::now() < end, "puts fail for 30 s: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            live.insert(k, v);
        }
        let victim = masters.iter().position(|m| m.addr == laddr).unwrap();
        let _ = masters[victim].child.kill();
        let _ = masters[victim].child.wait();
        // A supervisor restarts it (it comes back as a standby): when the leader killed is
        // the very address this client was given, that is what the client asks again.
        masters[victim] = spawn_master(etcd, laddr, 1);
        // Reads retry through the standby's address until the new leader serves.
        for (k, v) in &live {
            assert_eq!(&c.get(&tn, k).unwrap(), v, "{k}");
        }
        let (a, e) = leader(etcd, Duration::from_secs(5)).unwrap();
        assert!(e > epoch, "no new epoch");
        assert_eq!(c.master_addr(), a, "the client is not on the new leader");
        assert_eq!(c.epoch(), e);
        (laddr, epoch) = (a, e);
    }
}
