//! `replica_num > 1` and `BatchReplicaClear` with a segment (Mooncake's
//! test_clear_specific_segment_replica): with segments mounted by several clients, a put
//! asking for two replicas gets one in each of two clients' segments; clearing one segment
//! (once the lease expired) frees that replica only and the object reads from the other;
//! clearing the last one removes the object. A leased object, a missing key and a segment
//! holding no replica are skipped. On the embedded store and over a `kvtier-l3` server on
//! 127.0.0.1, over TCP and over shared memory (before, both stores kept one replica whatever
//! `replica_num` said, so clearing the putting client's segment removed the object).

use std::sync::Arc;
use std::time::Duration;

mod common;

use common::t;
use kvtier_l3::rpc::server::ServerOptions;
use kvtier_l3::{
    ClientId, ClientOptions, EmbeddedStore, L3Error, L3Store, PutOptions, RemoteStore,
    ReplicateConfig, SegmentId, ShmMode, StoreConfig, spawn_server,
};

const A: SegmentId = SegmentId(7);
const B: SegmentId = SegmentId(8);
/// Long enough that "leased" below still holds on a loaded 2-core CI machine (the check runs
/// right after the replica list that took the lease), short enough to wait out twice.
const LEASE: Duration = Duration::from_millis(400);

/// An embedded store with no memory of its own (as Mooncake's master) and a short lease.
fn bare() -> EmbeddedStore {
    EmbeddedStore::new(StoreConfig {
        local_segment_bytes: 0,
        lease_ttl: LEASE,
        ..Default::default()
    })
    .unwrap()
}

fn segs(s: &dyn L3Store, key: &str) -> Vec<SegmentId> {
    common::memory_segments(s, &t("t"), key)
}

fn cleared(s: &dyn L3Store, keys: &[&str], seg: SegmentId) -> Vec<bool> {
    let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    s.batch_replica_clear(&t("t"), &keys, seg)
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

/// The scenario on a store with segments A and B mounted (by clients 7 and 8).
fn scenario(s: &dyn L3Store) {
    s.mount_segment(ClientId(7), A, 4 << 20).unwrap();
    s.mount_segment(ClientId(8), B, 4 << 20).unwrap();
    let tn = t("t");
    let data = vec![5u8; 3000];
    let two = ReplicateConfig::replicas(2);
    s.put_with(&tn, "k", &data, PutOptions::default(), two)
        .unwrap();
    let keys = ["k2a".to_string(), "k2b".to_string()];
    let bufs: [&[u8]; 2] = [&data, &data];
    let r = s
        .batch_put_from_with(&tn, &keys, &bufs, PutOptions::default(), two)
        .unwrap();
    assert!(r.iter().all(|r| r.is_ok()), "{r:?}");
    s.put(&tn, "one", &data, PutOptions::default()).unwrap();
    for k in ["k", "k2a", "k2b"] {
        assert_eq!(
            segs(s, k),
            vec![A, B],
            "{k}: a replica in each client's segment"
        );
    }
    assert_eq!(segs(s, "one").len(), 1);
    // Leased (the replica list just taken leased it): skipped, nothing changes.
    assert_eq!(segs(s, "k"), vec![A, B]);
    assert_eq!(cleared(s, &["k"], A), vec![false]);
    assert_eq!(segs(s, "k"), vec![A, B]);
    std::thread::sleep(LEASE + LEASE / 2);
    assert_eq!(
        cleared(s, &["k", "missing", "k2a"], A),
        vec![true, false, true]
    );
    assert_eq!(s.get(&tn, "k").unwrap(), data, "read from B's replica");
    assert_eq!(segs(s, "k"), vec![B]);
    std::thread::sleep(LEASE + LEASE / 2);
    assert_eq!(cleared(s, &["k"], A), vec![false], "no replica left in A");
    assert_eq!(cleared(s, &["k"], SegmentId(99)), vec![false]);
    assert_eq!(
        cleared(s, &["k"], B),
        vec![true],
        "the last replica: the object goes"
    );
    assert!(matches!(s.get(&tn, "k"), Err(L3Error::ObjectNotFound)));
    assert_eq!(s.get(&tn, "k2b").unwrap(), data, "other keys untouched");
    // Segment B going away takes k2a (its replica in A was cleared) and leaves k2b (whose
    // replica in A is still there).
    s.unmount_segment(ClientId(8), B).unwrap();
    assert!(matches!(s.get(&tn, "k2a"), Err(L3Error::ObjectNotFound)));
    assert_eq!(s.get(&tn, "k2b").unwrap(), data);
}

#[test]
fn embedded() {
    scenario(&bare());
}

#[test]
fn over_a_server_by_tcp_and_by_shared_memory() {
    for shm in [ShmMode::Off, ShmMode::Auto] {
        let h = spawn_server(Arc::new(bare()), ServerOptions::default()).unwrap();
        let c = RemoteStore::connect(
            h.addr,
            ClientOptions {
                shm,
                ..Default::default()
            },
        )
        .unwrap();
        scenario(&c);
        h.shutdown();
    }
}
