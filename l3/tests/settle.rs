//! Settlement of removes with store nodes (split deployment), on a real in-process
//! [`ClusterMaster`] driven through its `cluster` requests exactly as a node drives it: a
//! removed or replaced object version must never come back through a node's restart rescan,
//! whatever the node had heard of it when it crashed.

use std::net::SocketAddr;
use std::sync::Arc;

mod common;

use common::t;
use kvtier_l3::master::{DiskLoc, NodeSync, Settle};
use kvtier_l3::rpc::service::{ClusterReply, ClusterRequest};
use kvtier_l3::{
    ClientId, ClusterMaster, L3Error, L3Store, PutHandle, ReplicaDescriptor, ReplicateConfig,
    SegmentId, StoreConfig, Tenant,
};

const N1: ClientId = ClientId(1);
const N2: ClientId = ClientId(2);
const SIZE: u64 = 4096;

fn cm() -> Arc<ClusterMaster> {
    ClusterMaster::new(StoreConfig {
        local_segment_bytes: 0,
        ..Default::default()
    })
    .unwrap()
}

/// A node (re)joins: its memory segment is empty (a restart).
fn mount(cm: &ClusterMaster, node: ClientId, capacity: u64) {
    let addr: SocketAddr = format!("127.0.0.1:{}", 40_000 + node.0).parse().unwrap();
    cm.handle(ClusterRequest::MountNode {
        node,
        segment: SegmentId(node.0),
        capacity,
        data_addr: addr,
        offload_on_evict: false,
    })
    .unwrap();
}

/// A complete put of `key`, its bytes held by `node` (write-through: its SSD copy pending).
fn put(cm: &ClusterMaster, node: ClientId, tn: &Tenant, key: &str) -> PutHandle {
    let h = cm
        .batch_put_start_with(tn, &[key.to_string()], &[SIZE], ReplicateConfig::default())
        .unwrap()
        .remove(0)
        .unwrap();
    let on = match &h.replica {
        ReplicaDescriptor::Memory { node: Some(n), .. } => n.id,
        other => panic!("{other:?}"),
    };
    assert_eq!(on, node, "placed on another node than the test meant");
    let reply = cm
        .handle(ClusterRequest::PutEndReplicas {
            node,
            handles: vec![h.clone()],
            soft_pin: false,
        })
        .unwrap();
    let ClusterReply::EndedReplicas(res, _) = reply else {
        panic!("{reply:?}")
    };
    let ended = res[0].as_ref().unwrap();
    assert!(ended.complete && ended.primary);
    h
}

fn register(cm: &ClusterMaster, node: ClientId, h: &PutHandle, loc: DiskLoc) -> bool {
    let reply = cm
        .handle(ClusterRequest::RegisterDisk {
            node,
            items: vec![(h.tenant.clone(), h.key.clone(), h.token, loc)],
        })
        .unwrap();
    let ClusterReply::Accepted(v) = reply else {
        panic!("{reply:?}")
    };
    v[0]
}

fn rescanned(cm: &ClusterMaster, node: ClientId, tn: &Tenant, key: &str, loc: DiskLoc) -> bool {
    let reply = cm
        .handle(ClusterRequest::Rescanned {
            node,
            disks: vec![(tn.clone(), key.to_string(), loc)],
        })
        .unwrap();
    let ClusterReply::Accepted(v) = reply else {
        panic!("{reply:?}")
    };
    v[0]
}

/// A ping acknowledging every settle up to `applied`.
fn ping(cm: &ClusterMaster, node: ClientId, applied: u64) -> NodeSync {
    match cm.handle(ClusterRequest::Ping { node, applied }).unwrap() {
        ClusterReply::Sync(s) => s,
        other => panic!("{other:?}"),
    }
}

/// The sync a put-end reply carries (no handles).
fn put_end_sync(cm: &ClusterMaster, node: ClientId) -> NodeSync {
    match cm
        .handle(ClusterRequest::PutEndReplicas {
            node,
            handles: vec![],
            soft_pin: false,
        })
        .unwrap()
    {
        ClusterReply::EndedReplicas(_, s) => s,
        other => panic!("{other:?}"),
    }
}

fn loc(bucket: u64) -> DiskLoc {
    DiskLoc {
        bucket,
        offset: 64,
        size: SIZE,
        crc: 0xC0FFEE,
    }
}

fn disk_replicas(cm: &ClusterMaster, tn: &Tenant, key: &str) -> Vec<DiskLoc> {
    match cm.get_replica_list(tn, key) {
        Ok(q) => q
            .replicas
            .iter()
            .filter_map(DiskLoc::from_descriptor)
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Bug 1: the remove is acknowledged while the node's write-through copy is queued; the
/// node publishes the bucket and crashes before registering it. Its restart rescan must not
/// bring the key back.
#[test]
fn remove_while_ssd_write_pending_refuses_the_rescanned_record() {
    let cm = cm();
    let a = t("a");
    mount(&cm, N1, 64 << 20);
    put(&cm, N1, &a, "k");
    cm.remove(&a, "k", false).unwrap();
    // Crash after the rename, before `RegisterDisk`: restart, rescan.
    mount(&cm, N1, 64 << 20);
    assert!(
        !rescanned(&cm, N1, &a, "k", loc(1)),
        "removed key re-registered"
    );
    assert!(matches!(cm.get_size(&a, "k"), Err(L3Error::ObjectNotFound)));
}

/// Bug 1, worse: the key was replaced meanwhile by a newer version of the same size with no
/// disk copy (on another node). The old record must not become the new version's disk copy.
#[test]
fn replaced_version_never_adopts_the_old_record() {
    let cm = cm();
    let a = t("a");
    mount(&cm, N1, 64 << 20);
    put(&cm, N1, &a, "k");
    cm.remove(&a, "k", false).unwrap();
    mount(&cm, N2, 128 << 20);
    put(&cm, N2, &a, "k");
    mount(&cm, N1, 64 << 20);
    assert!(!rescanned(&cm, N1, &a, "k", loc(1)), "old record adopted");
    assert!(disk_replicas(&cm, &a, "k").is_empty());
    // The new version is still served from its memory replica.
    assert_eq!(cm.get_size(&a, "k").unwrap(), SIZE);
}

/// Bug 2: the tombstone of a removed object's registered SSD copy is delivered on a ping,
/// but the node crashes before its tombstone is durable: the master must still refuse.
#[test]
fn delivered_but_unacknowledged_tombstone_still_refuses() {
    let cm = cm();
    let a = t("a");
    mount(&cm, N1, 64 << 20);
    let h = put(&cm, N1, &a, "k");
    assert!(register(&cm, N1, &h, loc(1)));
    cm.remove(&a, "k", false).unwrap();
    let s = ping(&cm, N1, 0);
    assert!(!s.need_remount);
    assert_eq!(s.settles, vec![(1, Settle::Tombstone(loc(1)))]);
    // Crash before the tombstone is durable; restart, rescan.
    mount(&cm, N1, 64 << 20);
    assert!(
        !rescanned(&cm, N1, &a, "k", loc(1)),
        "removed key re-registered"
    );
    assert!(matches!(cm.get_size(&a, "k"), Err(L3Error::ObjectNotFound)));
}

/// The same with a cancel that *was* acknowledged (so the master no longer knows the old
/// version): the old record is still never attached to the newer version, because nothing
/// proves which version a rescanned record holds.
#[test]
fn acknowledged_cancel_still_never_adopts_the_old_record() {
    let cm = cm();
    let a = t("a");
    mount(&cm, N1, 64 << 20);
    let old = put(&cm, N1, &a, "k");
    cm.remove(&a, "k", false).unwrap();
    let s = ping(&cm, N1, 0);
    let cancel = Settle::Cancel {
        tenant: a.clone(),
        key: "k".into(),
        token: old.token,
    };
    assert_eq!(s.settles, vec![(1, cancel)]);
    assert!(ping(&cm, N1, 1).settles.is_empty());
    assert_eq!(cm.unsettled(N1), 0);
    mount(&cm, N2, 128 << 20);
    put(&cm, N2, &a, "k");
    mount(&cm, N1, 64 << 20);
    assert!(!rescanned(&cm, N1, &a, "k", loc(1)), "old record adopted");
    assert!(disk_replicas(&cm, &a, "k").is_empty());
}

/// Settles stay until acknowledged: every ping repeats the unacknowledged ones, a put-end
/// reply carries only new ones, a remount hands all of them out again, an acknowledgement
/// drops exactly those up to its number (one past what was issued is ignored), and once
/// they are gone a re-put key's fresh record registers (and re-registers) normally.
#[test]
fn settles_repeat_until_acknowledged_then_go() {
    let cm = cm();
    let a = t("a");
    mount(&cm, N1, 64 << 20);
    let h1 = put(&cm, N1, &a, "k1");
    assert!(register(&cm, N1, &h1, loc(1)));
    let h2 = put(&cm, N1, &a, "k2");
    cm.remove(&a, "k1", false).unwrap();
    cm.remove(&a, "k2", false).unwrap();
    let want = vec![
        (1, Settle::Tombstone(loc(1))),
        (
            2,
            Settle::Cancel {
                tenant: a.clone(),
                key: "k2".into(),
                token: h2.token,
            },
        ),
    ];
    assert_eq!(ping(&cm, N1, 0).settles, want);
    assert_eq!(ping(&cm, N1, 0).settles, want, "a ping repeats them");
    // A put end's reply carries only what was not handed out yet.
    assert!(put_end_sync(&cm, N1).settles.is_empty());
    // Remount: all again, even on a put end.
    mount(&cm, N1, 64 << 20);
    assert_eq!(put_end_sync(&cm, N1).settles, want);
    // An acknowledgement past what was issued is ignored; a partial one drops the first.
    assert_eq!(ping(&cm, N1, 3).settles, want);
    let s = ping(&cm, N1, 1);
    assert_eq!(s.settles, want[1..].to_vec());
    assert_eq!(s.settled, 1);
    assert!(
        !rescanned(&cm, N1, &a, "k2", loc(2)),
        "cancel not acknowledged yet"
    );
    let s = ping(&cm, N1, 2);
    assert!(s.settles.is_empty());
    assert_eq!(s.settled, 2);
    assert_eq!(cm.unsettled(N1), 0);
    // Re-put: its fresh record registers, and after a restart re-registers.
    let h = put(&cm, N1, &a, "k2");
    assert!(register(&cm, N1, &h, loc(3)));
    mount(&cm, N1, 64 << 20);
    assert!(rescanned(&cm, N1, &a, "k2", loc(3)));
    assert_eq!(disk_replicas(&cm, &a, "k2"), vec![loc(3)]);
    // And a record of a key unknown to the master with nothing to settle is adopted.
    assert!(rescanned(&cm, N1, &a, "fresh", loc(4)));
}
