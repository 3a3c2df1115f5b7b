//! Tenant quotas survive a failover: the leader given `--tenant-quota` writes them to etcd,
//! and a standby started without the flag enforces them once it leads. Real processes: 3
//! etcd members, 2 `kvtier-l3 --role master --etcd`, 3 store nodes with SSD tiers.

mod common;

use std::time::{Duration, Instant};

use common::ha::{free_addr, ha_client, ha_node, leader, spawn_master, spawn_master_with};
use common::{payload, t};
use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::{L3Error, L3Store, PutOptions, RemoteStore};

const CAP: u64 = 8192;

/// Over its cap the capped tenant is refused (-200); under it, and any other tenant, not.
fn quota_holds(c: &RemoteStore, round: usize) {
    let big = payload(round, 2 * CAP as usize);
    let small = payload(round, 1000);
    let end = Instant::now() + Duration::from_secs(30);
    // Wait for the leader to serve key calls (rebuild after a failover).
    while c.get(&t("capped"), "absent") != Err(L3Error::ObjectNotFound) {
        assert!(Instant::now() < end, "the leader never served");
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = c.put(
        &t("capped"),
        &format!("big{round}"),
        &big,
        PutOptions::default(),
    );
    assert!(
        matches!(r, Err(L3Error::NoAvailableHandle { .. })),
        "round {round}: a put over the tenant's quota gave {r:?}"
    );
    let tn = t("capped");
    c.put(&tn, &format!("small{round}"), &small, PutOptions::default())
        .unwrap();
    let free = t("free");
    c.put(&free, &format!("big{round}"), &big, PutOptions::default())
        .unwrap();
}

#[test]
fn a_tenant_over_quota_is_still_refused_by_a_new_leader_started_without_the_flag() {
    let etcd = LocalEtcd::start(3).unwrap();
    let quota = format!("capped={CAP}");
    let mut capped = spawn_master_with(&etcd, free_addr(), 1, &["--tenant-quota", &quota]);
    let (laddr, epoch) = leader(&etcd, Duration::from_secs(20)).expect("a leader");
    assert_eq!(laddr, capped.addr, "the master given the flag leads first");
    let _standby = spawn_master(&etcd, free_addr(), 1);
    let ssd: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let _nodes: Vec<_> = (0..3)
        .map(|i| ha_node(&etcd, i as u64 + 1, ssd[i].path()))
        .collect();
    let c = ha_client(&etcd);
    quota_holds(&c, 0);
    let _ = capped.child.kill();
    let _ = capped.child.wait();
    let end = Instant::now() + Duration::from_secs(20);
    while !matches!(leader(&etcd, Duration::from_secs(1)), Some((_, e)) if e > epoch) {
        assert!(Instant::now() < end, "no new leader");
        std::thread::sleep(Duration::from_millis(20));
    }
    quota_holds(&c, 1);
}
