//! DRAM replicas survive the master (issue 22): store nodes without an SSD tier, puts
//! acknowledged without `wait_persisted` (one and two replicas), then the master goes — the
//! etcd leader SIGKILLed (a standby takes over), or a single `--state-dir` master SIGKILLed
//! and restarted. Every acknowledged put reads back with its bytes: the nodes keep their
//! memory across the remount and report it, the new master adopts it. Keys removed just
//! before the kill (the nodes ping every 3 s, so they had not heard of the removes) do not
//! come back: their holders have a durable cancel, and a cancelled version is not adopted.
//! Before this, a node cleared its memory at the remount and every such put was lost.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::ha::{
    HaMaster, check_keys, free_addr, ha_client, ha_dram_node, leader, spawn_master,
    spawn_master_with,
};
use common::procs::{eventually, kill9, master_in, node_with};
use common::{client, payload, t};
use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::{
    L3Error, L3Store, PutOptions, QueryResult, RemoteStore, ReplicaDescriptor, ReplicateConfig,
};

/// Slow pings: a remove reaches the node (as a free) only after the master is dead.
const SLOW_PING_MS: u64 = 3000;

/// Puts `n` keys with `replicas` copies, DRAM only; returns the acknowledged ones (a batch
/// refused as a whole while a master fails over is sent again).
fn put_keys(c: &RemoteStore, prefix: &str, replicas: u32, n: usize) -> BTreeMap<String, Vec<u8>> {
    let tn = t("d");
    let keys: Vec<String> = (0..n)
        .map(|i| format!("{prefix}-x{replicas}-{i}"))
        .collect();
    let data: Vec<Vec<u8>> = (0..n)
        .map(|i| payload(i + 100 * replicas as usize + prefix.len(), 5000))
        .collect();
    let bufs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let cfg = ReplicateConfig {
        replica_num: replicas,
    };
    let end = Instant::now() + Duration::from_secs(30);
    let res = loop {
        match c.batch_put_from_with(&tn, &keys, &bufs, PutOptions::default(), cfg) {
            Ok(r) => break r,
            Err(e) => assert!(Instant::now() < end, "puts fail for 30 s: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let acked: BTreeMap<String, Vec<u8>> = keys
        .into_iter()
        .zip(data)
        .zip(res)
        .filter_map(|(kd, r)| r.ok().map(|_| kd))
        .collect();
    assert_eq!(acked.len(), n, "puts on a healthy cluster fail");
    acked
}

/// Removes every key ending in `-3` or `-7` from `live` (forced), returning them.
fn remove_some(c: &RemoteStore, live: &mut BTreeMap<String, Vec<u8>>) -> Vec<String> {
    let doomed: Vec<String> = live
        .keys()
        .filter(|k| k.ends_with("-3") || k.ends_with("-7"))
        .cloned()
        .collect();
    for k in &doomed {
        c.remove(&t("d"), k, true).unwrap();
        live.remove(k);
    }
    doomed
}

fn check(c: &RemoteStore, live: &BTreeMap<String, Vec<u8>>, removed: &[String]) {
    check_keys(c, &t("d"), live, removed);
}

#[test]
fn dram_only_puts_survive_leader_master_kills() {
    let etcd = LocalEtcd::start(3).unwrap();
    let mut masters: Vec<HaMaster> = (0..2)
        .map(|_| spawn_master(&etcd, free_addr(), 1))
        .collect();
    let (_, mut epoch) = leader(&etcd, Duration::from_secs(20)).expect("a leader");
    let _nodes: Vec<_> = (1..=3)
        .map(|id| ha_dram_node(&etcd, id, SLOW_PING_MS))
        .collect();
    let c = ha_client(&etcd);
    let (mut live, mut removed) = (BTreeMap::new(), Vec::new());
    for round in 0..2 {
        for replicas in [1, 2] {
            live.extend(put_keys(&c, &format!("r{round}"), replicas, 10));
        }
        removed.extend(remove_some(&c, &mut live));
        // At once: the nodes have not heard of the removes.
        let (laddr, _) = leader(&etcd, Duration::from_secs(5)).unwrap();
        let victim = masters.iter().position(|m| m.addr == laddr).unwrap();
        let _ = masters[victim].child.kill();
        let _ = masters[victim].child.wait();
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            match leader(&etcd, Duration::from_secs(1)) {
                Some((_, e)) if e > epoch => {
                    epoch = e;
                    break;
                }
                _ => assert!(Instant::now() < end, "no new leader"),
            }
        }
        masters[victim] = spawn_master(&etcd, laddr, 1);
        check(&c, &live, &removed);
    }
}

#[test]
fn dram_only_puts_survive_a_master_restart() {
    let state = tempfile::tempdir().unwrap();
    let mut master = master_in("127.0.0.1:0", state.path(), &[], None);
    let ping = SLOW_PING_MS.to_string();
    let _nodes: Vec<_> = (1..=2)
        .map(|id| node_with(master.addr, id, None, None, &["--ping-ms", &ping]))
        .collect();
    let c = client(master.addr, None);
    assert!(eventually(Duration::from_secs(10), || c
        .put(&t("d"), "probe", b"p", PutOptions::default())
        .is_ok()));
    let mut live = put_keys(&c, "restart", 1, 10);
    live.extend(put_keys(&c, "restart", 2, 10));
    let removed = remove_some(&c, &mut live);
    let addr = master.addr;
    kill9(&mut master.child);
    let _master = master_in(&addr.to_string(), state.path(), &[], None);
    let c = client(addr, None);
    assert!(
        eventually(Duration::from_secs(20), || !matches!(
            c.get(&t("d"), "probe"),
            Err(L3Error::Unavailable(_) | L3Error::RpcFail(_))
        )),
        "the restarted master never served"
    );
    check(&c, &live, &removed);
}

/// Descriptors a client took from the leader, used after that leader died: the read is
/// answered key by key — bytes that are the key's own, or the key refused (the new leader
/// does not vouch for an old epoch's descriptors: -704 or an expired lease, which an engine
/// takes as a miss) — never failed whole. Before, the first such read after a failover
/// failed with -900: the descriptors' check went to the dead master and, unlike a plain
/// get, was not tried again on the new leader.
#[test]
fn a_read_with_the_old_leaders_descriptors_is_answered_after_a_failover() {
    let etcd = LocalEtcd::start(1).unwrap();
    let mut masters: Vec<HaMaster> = (0..2)
        .map(|_| spawn_master(&etcd, free_addr(), 1))
        .collect();
    let (laddr, epoch) = leader(&etcd, Duration::from_secs(20)).expect("a leader");
    let _nodes: Vec<_> = (1..=2).map(|id| ha_dram_node(&etcd, id, 200)).collect();
    let c = ha_client(&etcd);
    let tn = t("d");
    let live = put_keys(&c, "q", 1, 8);
    let keys: Vec<String> = live.keys().cloned().collect();
    let qs: Vec<QueryResult> = c
        .batch_query(&tn, &keys)
        .unwrap()
        .into_iter()
        .map(|q| q.expect("a live key's descriptors"))
        .collect();

    let victim = masters.iter().position(|m| m.addr == laddr).unwrap();
    let _ = masters[victim].child.kill();
    let _ = masters[victim].child.wait();
    let end = Instant::now() + Duration::from_secs(30);
    while leader(&etcd, Duration::from_secs(1)).is_none_or(|(_, e)| e <= epoch) {
        assert!(Instant::now() < end, "no new leader");
    }

    let mut data = vec![0u8; keys.len() * 5000];
    let mut bufs: Vec<&mut [u8]> = data.chunks_mut(5000).collect();
    let r = c
        .batch_get_with_query(&tn, &qs, &mut bufs)
        .expect("a read after a failover is answered key by key");
    assert_eq!(r.len(), keys.len());
    for ((k, r), b) in keys.iter().zip(r).zip(&bufs) {
        match r {
            Ok(n) => assert_eq!(&b[..n as usize], live[k].as_slice(), "{k}"),
            Err(e) => assert!(
                matches!(e, L3Error::ObjectNotFound | L3Error::LeaseExpired),
                "{k}: {e}"
            ),
        }
    }
    // and the keys themselves are all there
    check(&c, &live, &[]);
}

/// The memory replicas of `q`: `(node id, alloc)` in the order a read tries them.
fn mem_replicas(q: &QueryResult) -> Vec<(u64, u64)> {
    q.replicas
        .iter()
        .filter_map(|r| match r {
            ReplicaDescriptor::Memory { segment, alloc, .. } => Some((segment.0, *alloc)),
            _ => None,
        })
        .collect()
}

/// Node 2's ping period in [`old_descriptors_read_no_removed_version`]: it hears of a free
/// up to 3 s after the remove.
const STALE_NODE_PING_MS: &str = "3000";

/// A master numbers its allocations from 1, so an earlier master's descriptor can name a
/// `(node, alloc)` that a later master gave to another version of the key. A master vouched
/// for a query result when *any* of its allocation ids was current for the key — whatever
/// the node — and the client then read the descriptors in order, the unvouched first: here
/// node 2's allocation of a version removed and replaced through the later master (node 2
/// pings slowly, so it still held the bytes), and the read returned the removed version's
/// bytes ("OLD") after "NEW" was acknowledged. A read with old descriptors must give the
/// key's current bytes or refuse them (-704, or -707: query again), never a removed version.
///
/// `c` reaches a master with nodes 1 and 2 (DRAM only, 16 MiB segments, node 2 pinging
/// every [`STALE_NODE_PING_MS`]) whose read lease is long (what is tested is the
/// allocations the descriptors name, not the lease, which the later master takes on its
/// own clock); `fail_over` replaces that master by another.
fn old_descriptors_read_no_removed_version(c: &RemoteStore, fail_over: impl FnOnce()) {
    let tn = t("d");
    let put = |k: &str, v: &[u8], replicas: u32| {
        let end = Instant::now() + Duration::from_secs(30);
        let cfg = ReplicateConfig {
            replica_num: replicas,
        };
        while let Err(e) = c.put_with(&tn, k, v, PutOptions::default(), cfg) {
            assert!(Instant::now() < end, "put {k} fails for 30 s: {e}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let query = |k: &str| -> QueryResult {
        c.batch_query(&tn, &[k.to_string()]).unwrap()[0]
            .clone()
            .unwrap()
    };
    let remove = |k: &str| c.remove(&tn, k, true).unwrap();

    // The first master: ids 1..=20 spent, so that the next master's numbering can be
    // brought to the descriptors'; a pad on node 1 places "k"'s two replicas on node 2
    // (alloc a) and then on node 1 (alloc a + 1).
    for i in 0..20 {
        put(&format!("spent-{i}"), b"s", 1);
        remove(&format!("spent-{i}"));
    }
    put("pad", b"p", 1);
    put("k", b"v1!", 2);
    let old = query("k");
    let reps = mem_replicas(&old);
    assert_eq!(reps.len(), 2, "{old:?}");
    let (a, b) = (reps[0], reps[1]);
    assert_eq!((a.0, b.0, b.1), (2, 1, a.1 + 1), "placement: {old:?}");
    remove("k");
    remove("pad");

    fail_over();
    // The next master's next allocation ids, up to a - 2 (each probe takes one).
    loop {
        put("probe", b"p", 1);
        let id = mem_replicas(&query("probe"))[0].1;
        remove("probe");
        assert!(id < a.1 - 1, "the next master already numbers past {}", a.1);
        if id == a.1 - 2 {
            break;
        }
    }
    put("pad", b"p", 1); // node 1, alloc a - 1: node 2 has more room
    put("k", b"OLD", 1); // node 2, alloc a: the first master's first descriptor
    assert_eq!(mem_replicas(&query("k")), vec![a], "placement");
    remove("k"); // node 2 keeps the bytes until its next ping
    remove("pad");
    put("k", b"NEW", 1); // node 1 (both empty again), alloc a + 1
    assert_eq!(mem_replicas(&query("k"))[0].1, b.1, "placement");

    let mut buf = [0u8; 16];
    let r = c
        .batch_get_with_query(&tn, std::slice::from_ref(&old), &mut [&mut buf[..]])
        .unwrap();
    match &r[0] {
        Ok(n) => assert_eq!(
            &buf[..*n as usize],
            b"NEW",
            "the first master's descriptors read a removed version"
        ),
        Err(e) => assert!(
            matches!(e, L3Error::ObjectNotFound | L3Error::LeaseExpired),
            "{e}"
        ),
    }
    assert_eq!(c.get(&tn, "k").unwrap(), b"NEW");
}

/// [`old_descriptors_read_no_removed_version`] across an etcd failover: the leader
/// SIGKILLed, the standby elected.
#[test]
fn an_old_leaders_descriptors_never_read_a_removed_version_through_the_new_leader() {
    let etcd = LocalEtcd::start(1).unwrap();
    let lease = ["--lease-ms", "120000"];
    let mut masters: Vec<HaMaster> = (0..2)
        .map(|_| spawn_master_with(&etcd, free_addr(), 1, &lease))
        .collect();
    let (laddr, epoch) = leader(&etcd, Duration::from_secs(20)).expect("a leader");
    let slow: u64 = STALE_NODE_PING_MS.parse().unwrap();
    let _nodes = [ha_dram_node(&etcd, 1, 200), ha_dram_node(&etcd, 2, slow)];
    let c = ha_client(&etcd);
    old_descriptors_read_no_removed_version(&c, || {
        let victim = masters.iter().position(|m| m.addr == laddr).unwrap();
        kill9(&mut masters[victim].child);
        let end = Instant::now() + Duration::from_secs(30);
        while leader(&etcd, Duration::from_secs(1)).is_none_or(|(_, e)| e <= epoch) {
            assert!(Instant::now() < end, "no new leader");
        }
    });
}

/// [`old_descriptors_read_no_removed_version`] across a restart of a `--state-dir` master
/// (SIGKILLed, started again on its address).
#[test]
fn descriptors_from_before_a_master_restart_never_read_a_removed_version() {
    let state = tempfile::tempdir().unwrap();
    let lease = ["--lease-ms", "120000"];
    let mut master = master_in("127.0.0.1:0", state.path(), &lease, None);
    let addr = master.addr;
    let _nodes = [
        node_with(addr, 1, None, None, &["--ping-ms", "200"]),
        node_with(addr, 2, None, None, &["--ping-ms", STALE_NODE_PING_MS]),
    ];
    let c = client(addr, None);
    let mut restarted = None;
    old_descriptors_read_no_removed_version(&c, || {
        kill9(&mut master.child);
        restarted = Some(master_in(&addr.to_string(), state.path(), &lease, None));
    });
}
