//! The shared-secret token survives a failover: the leader given `KVTIER_L3_TOKEN` stores
//! its digest in etcd, and a standby started without the token refuses a wrong (or no)
//! token and accepts the right one once it leads. Real processes: 3 etcd members, 2
//! `kvtier-l3 --role master --etcd`, 2 DRAM store nodes holding the token.

mod common;

use std::time::{Duration, Instant};

use common::ha::{
    CLUSTER, free_addr, ha_client_token, ha_dram_node_token, leader, spawn_master,
    spawn_master_token,
};
use common::{payload, t};
use kvtier_l3::ha::ClusterKeys;
use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::{L3Error, L3Store, PutOptions};

const TOKEN: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f0";

/// The right token is served (after the leader's rebuild); a wrong one and none are refused.
fn token_holds(etcd: &LocalEtcd, round: usize) {
    let end = Instant::now() + Duration::from_secs(30);
    let good = loop {
        if let Ok(c) = ha_client_token(etcd, Some(TOKEN))
            && c.get(&t("a"), "absent") == Err(L3Error::ObjectNotFound)
        {
            break c;
        }
        assert!(
            Instant::now() < end,
            "round {round}: the leader never served the token"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let v = payload(round, 1000);
    let key = format!("k{round}");
    good.put(&t("a"), &key, &v, PutOptions::default()).unwrap();
    assert_eq!(good.get(&t("a"), &key).unwrap(), v);
    // An absent key: answered by the master alone (the nodes, which hold the token too,
    // would refuse a present key's bytes whatever the master does).
    for bad in [Some("wrong"), Some(&TOKEN[1..]), None] {
        let r = ha_client_token(etcd, bad).and_then(|c| c.get(&t("a"), "absent"));
        assert!(
            matches!(r, Err(L3Error::IllegalClient(_))),
            "round {round}: token {bad:?} gave {r:?}"
        );
    }
}

#[test]
fn a_wrong_token_is_still_refused_by_a_new_leader_started_without_the_token() {
    let etcd = LocalEtcd::start(3).unwrap();
    let mut first = spawn_master_token(&etcd, free_addr(), 1, &[], Some(TOKEN));
    let (laddr, epoch) = leader(&etcd, Duration::from_secs(20)).expect("a leader");
    assert_eq!(laddr, first.addr, "the master given the token leads first");
    let standby = spawn_master(&etcd, free_addr(), 1);
    let _nodes: Vec<_> = (1..=2)
        .map(|i| ha_dram_node_token(&etcd, i, 100, Some(TOKEN)))
        .collect();
    token_holds(&etcd, 0);
    let _ = first.child.kill();
    let _ = first.child.wait();
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        match leader(&etcd, Duration::from_secs(1)) {
            Some((a, e)) if e > epoch => {
                assert_eq!(
                    a, standby.addr,
                    "the standby (started without the token) leads"
                );
                break;
            }
            _ => assert!(Instant::now() < end, "no new leader"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    token_holds(&etcd, 1);
    // etcd holds a digest, never the token itself.
    let keys = ClusterKeys::new(CLUSTER).unwrap();
    let stored = etcd
        .client()
        .unwrap()
        .get(&keys.token)
        .unwrap()
        .expect("a token key");
    let stored = String::from_utf8(stored.value).unwrap();
    assert!(!stored.contains(TOKEN), "etcd holds the plaintext token");
}
