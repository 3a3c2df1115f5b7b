//! Replicas (`ReplicateConfig::replica_num`) in the split deployment, with real
//! `kvtier-l3 --role master` / `--role node` processes on 127.0.0.1 and, for the property
//! test, an in-process master and store-node threads on loopback.
//!
//! What is checked: replicas land on distinct nodes; a put is visible only once every
//! replica is written (a replica on a dead node revokes it); a read survives the SIGKILL of
//! a node holding one replica, both before the master notices (the client falls back to the
//! next replica) and after (the master drops the dead node's replicas, the others stay);
//! `replica_num` above the live node count gives one replica per live node; no two replicas
//! of one object ever share a node, whatever the sequence of puts, removes and node deaths.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::procs::{Proc, eventually, master, node};
use common::{client, payload, t};
use kvtier_l3::master::{EvictionOutcome, Master, MasterPolicy};
use kvtier_l3::{
    ClientId, ClusterMaster, EmbeddedStore, L3Store, NodeOptions, PutOptions, RemoteStore,
    ReplicaDescriptor, ReplicateConfig, SegmentId, ServerOptions, StoreConfig, StoreNode, Tenant,
    spawn_cluster_master,
};
use proptest::prelude::*;

/// Node ids of an object's memory replicas, in descriptor order.
fn mem_nodes(c: &RemoteStore, tn: &Tenant, key: &str) -> Vec<ClientId> {
    c.get_replica_list(tn, key)
        .unwrap()
        .replicas
        .iter()
        .filter(|r| matches!(r, ReplicaDescriptor::Memory { .. }))
        .map(|r| r.node().expect("a node's replica names it").id)
        .collect()
}

fn distinct(v: &[ClientId]) -> bool {
    v.iter().collect::<HashSet<_>>().len() == v.len()
}

fn put_n(c: &RemoteStore, tn: &Tenant, key: &str, data: &[u8], n: u32) -> kvtier_l3::L3Result<()> {
    c.put_with(
        tn,
        key,
        data,
        PutOptions::default(),
        ReplicateConfig::replicas(n),
    )
}

#[test]
fn replicas_on_distinct_nodes_survive_a_killed_node() {
    let m = master(&["--client-ttl-ms", "1000"], None);
    let mut nodes: Vec<Proc> = (1..=3).map(|id| node(m.addr, id, None, None)).collect();
    let c = client(m.addr, None);
    let a = t("a");
    let objs: Vec<Vec<u8>> = (0..12).map(|i| payload(i, 32 * 1024 + i)).collect();
    let keys: Vec<String> = (0..12).map(|i| format!("r{i}")).collect();
    // Client-level puts with 2 replicas, a batch with 3.
    for (k, o) in keys[..6].iter().zip(&objs) {
        put_n(&c, &a, k, o, 2).unwrap();
    }
    let refs: Vec<&[u8]> = objs[6..].iter().map(Vec::as_slice).collect();
    let r = c
        .batch_put_from_with(
            &a,
            &keys[6..],
            &refs,
            PutOptions::default(),
            ReplicateConfig::replicas(3),
        )
        .unwrap();
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    for (i, k) in keys.iter().enumerate() {
        let on = mem_nodes(&c, &a, k);
        assert_eq!(on.len(), if i < 6 { 2 } else { 3 }, "{k}: {on:?}");
        assert!(distinct(&on), "{k}: two replicas on one node: {on:?}");
        assert_eq!(c.get(&a, k).unwrap(), objs[i]);
    }
    // Two-phase put with 2 replicas: the handle names both, on distinct nodes, and the
    // object is invisible until put_end.
    let h = c
        .put_start_with(&a, "two-phase", 4096, ReplicateConfig::replicas(2))
        .unwrap();
    let hn: Vec<ClientId> = h.replicas().map(|r| r.node().unwrap().id).collect();
    assert_eq!(hn.len(), 2);
    assert!(distinct(&hn));
    c.put_write(&h, &[9u8; 4096]).unwrap();
    assert!(
        !c.is_exist(&a, "two-phase").unwrap(),
        "not visible before put_end"
    );
    c.put_end(&h, PutOptions::default()).unwrap();
    assert_eq!(c.get(&a, "two-phase").unwrap(), vec![9u8; 4096]);
    // Bad configs are typed errors and place nothing.
    for n in [0, 65] {
        let e = put_n(&c, &a, "bad", b"x", n).unwrap_err();
        assert_eq!(e.code_i32(), -600, "replica_num {n}");
    }
    assert!(!c.is_exist(&a, "bad").unwrap());

    // SIGKILL the node holding the first replica of r0 (the one reads try first).
    let victim = mem_nodes(&c, &a, "r0")[0];
    let vi = (victim.0 - 1) as usize;
    nodes[vi].child.kill().unwrap();
    nodes[vi].child.wait().unwrap();
    // Before the master notices: the client falls back to the next replica.
    for (k, o) in keys.iter().zip(&objs) {
        assert_eq!(&c.get(&a, k).unwrap(), o, "{k} right after the kill");
    }
    let mut big = vec![0u8; 12 * 40_000];
    let mut bufs: Vec<&mut [u8]> = big.chunks_mut(40_000).collect();
    let got = c.batch_get_into(&a, &keys, &mut bufs).unwrap();
    for (i, g) in got.iter().enumerate() {
        assert_eq!(*g, Ok(objs[i].len() as u64), "{}", keys[i]);
        assert_eq!(&bufs[i][..objs[i].len()], &objs[i][..]);
    }
    // A replicated put placed on the dead node (still believed alive) cannot complete: it
    // fails and is revoked, so the key stays absent.
    let e = put_n(&c, &a, "during-outage", &[1u8; 1000], 3).unwrap_err();
    assert!(
        matches!(e.code_i32(), -900 | -1010),
        "a write to the dead node fails with a transport error: {e:?}"
    );
    assert!(!c.is_exist(&a, "during-outage").unwrap(), "revoked");
    // Once the sweeper declared it dead, its replicas are gone from every descriptor and
    // every object is still read from the others.
    assert!(
        eventually(Duration::from_secs(10), || !mem_nodes(&c, &a, "r0")
            .contains(&victim)),
        "the dead node's replicas must be dropped after the TTL"
    );
    for (i, k) in keys.iter().enumerate() {
        let on = mem_nodes(&c, &a, k);
        assert!(!on.contains(&victim), "{k}: {on:?}");
        assert!(!on.is_empty(), "{k} lost every replica");
        assert_eq!(c.get(&a, k).unwrap(), objs[i], "{k} after the node died");
    }
    // replica_num above the live node count: one replica per live node (Mooncake's best
    // effort), and the put succeeds.
    put_n(&c, &a, "wide", &[5u8; 2048], 5).unwrap();
    let on = mem_nodes(&c, &a, "wide");
    assert_eq!(on.len(), 2, "{on:?}");
    assert!(distinct(&on) && !on.contains(&victim));
    assert_eq!(c.get(&a, "wide").unwrap(), vec![5u8; 2048]);
}

#[test]
fn embedded_store_accepts_replica_num_and_keeps_one_replica() {
    let s = EmbeddedStore::new(StoreConfig {
        local_segment_bytes: 1 << 20,
        ..Default::default()
    })
    .unwrap();
    let a = t("a");
    s.put_with(
        &a,
        "k",
        b"bytes",
        PutOptions::default(),
        ReplicateConfig::replicas(3),
    )
    .unwrap();
    let q = s.get_replica_list(&a, "k").unwrap();
    assert_eq!(q.replicas.len(), 1, "one process, one failure domain");
    assert_eq!(s.get(&a, "k").unwrap(), b"bytes");
    let h = s
        .put_start_with(&a, "h", 3, ReplicateConfig::replicas(2))
        .unwrap();
    assert!(h.extra_replicas.is_empty());
    for n in [0, 65] {
        let e = s
            .put_with(
                &a,
                "bad",
                b"x",
                PutOptions::default(),
                ReplicateConfig::replicas(n),
            )
            .unwrap_err();
        assert_eq!(e.code_i32(), -600);
    }
    assert!(!s.is_exist(&a, "bad").unwrap());
}

// ---- property tests ------------------------------------------------------------------------

fn policy() -> MasterPolicy {
    MasterPolicy::from_config(&StoreConfig::default())
}

#[derive(Debug, Clone)]
enum Op {
    /// key, size (KiB), replica_num
    Put(u8, u8, u32),
    Remove(u8),
    /// A node stops pinging and is declared dead.
    Kill(u64),
    /// A node (re)joins with an empty segment.
    Join(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..24, 1u8..48, 1u32..6).prop_map(|(k, s, n)| Op::Put(k, s, n)),
        2 => (0u8..24).prop_map(Op::Remove),
        1 => (1u64..6).prop_map(Op::Kill),
        1 => (1u64..6).prop_map(Op::Join),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, .. ProptestConfig::default() })]

    /// The master's placement, with eviction pressure (256 KiB segments) and node deaths:
    /// no two memory replicas of an object ever share a node, a put gets
    /// min(replica_num, nodes with room) replicas (at least one), and a node's death leaves
    /// the other replicas of every object in place.
    #[test]
    fn no_two_replicas_share_a_node(ops in proptest::collection::vec(op(), 1..80)) {
        let mut m = Master::new(policy());
        let ten = t("p");
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mut live: HashSet<u64> = HashSet::new();
        let mut now = 0u64;
        for id in 1..=3u64 {
            m.mount_node(ClientId(id), SegmentId(id), 256 << 10, addr, now).unwrap();
            live.insert(id);
        }
        for o in ops {
            now += 1;
            match o {
                Op::Put(k, s, n) => {
                    let key = format!("k{k}");
                    let size = s as u64 * 1024;
                    let mut out = EvictionOutcome::default();
                    if let Ok(h) = m.put_start(&ten, &key, size, n as usize, now, &mut out) {
                        let on: Vec<ClientId> = h.replicas().map(|r| r.node().unwrap().id).collect();
                        prop_assert!(distinct(&on), "{on:?}");
                        prop_assert!(!on.is_empty() && on.len() <= (n as usize).min(live.len()));
                        prop_assert!(on.iter().all(|c| live.contains(&c.0)));
                        for r in h.replicas() {
                            let node = r.node().unwrap().id;
                            m.end_replica(node, &h.for_replica(r), false, now).unwrap();
                        }
                        prop_assert!(m.exists(&ten, &key));
                    }
                }
                Op::Remove(k) => {
                    let _ = m.remove(&ten, &format!("k{k}"), true, now);
                }
                Op::Kill(id) => {
                    if live.remove(&id) {
                        m.leave_node(ClientId(id));
                    }
                }
                Op::Join(id) => {
                    if live.insert(id) {
                        m.mount_node(ClientId(id), SegmentId(id), 256 << 10, addr, now).unwrap();
                    }
                }
            }
            for k in 0..24u8 {
                let key = format!("k{k}");
                if let Ok(q) = m.query(&ten, &key, now) {
                    let on: Vec<ClientId> = q.replicas.iter().filter_map(|r| r.node()).map(|n| n.id).collect();
                    prop_assert!(distinct(&on), "{key}: {on:?}");
                    prop_assert!(on.iter().all(|c| live.contains(&c.0)), "{key} on a dead node");
                    prop_assert_eq!(on.len(), m.mem_replicas(&ten, &key));
                }
            }
            // the census stats() reads equals one counted from every object
            prop_assert!(m.check_census().is_ok(), "{:?}", m.check_census());
        }
    }
}

/// An in-process split deployment: a master server and `n` store-node threads on loopback.
struct Cluster {
    nodes: Vec<StoreNode>,
    master: kvtier_l3::ClusterMasterHandle,
}

fn cluster(n: u64) -> Cluster {
    let cm = ClusterMaster::new(StoreConfig {
        local_segment_bytes: 0,
        ..Default::default()
    })
    .unwrap();
    let master = spawn_cluster_master(cm, ServerOptions::default()).unwrap();
    let nodes = (1..=n)
        .map(|id| {
            let mut o = NodeOptions::new(ClientId(id), master.addr);
            o.segment_bytes = 4 << 20;
            o.ping_interval = Duration::from_millis(100);
            StoreNode::start(o).unwrap()
        })
        .collect();
    Cluster { nodes, master }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, .. ProptestConfig::default() })]

    /// The same invariant end to end, through RemoteStore against a real master and four
    /// store-node threads: every object's memory replicas sit on distinct nodes, as many
    /// as asked (four nodes have room), and each reads back its own bytes.
    #[test]
    fn replicas_on_distinct_nodes_end_to_end(
        puts in proptest::collection::vec((1u32..6, 1usize..20_000), 1..24),
    ) {
        let cl = cluster(4);
        let c = Arc::new(client(cl.master.addr, None));
        let ten = t("e2e");
        for (i, (n, len)) in puts.iter().enumerate() {
            let key = format!("k{i}");
            let data = payload(i, *len);
            put_n(&c, &ten, &key, &data, *n).unwrap();
            let on = mem_nodes(&c, &ten, &key);
            prop_assert!(distinct(&on), "{key}: {on:?}");
            prop_assert_eq!(on.len(), (*n as usize).min(4));
            prop_assert_eq!(c.get(&ten, &key).unwrap(), data);
        }
        drop(c);
        drop(cl.nodes);
        drop(cl.master);
    }
}
