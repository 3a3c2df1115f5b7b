//! A restarted master serves only once its store nodes have reported their records, and a
//! node that stays away past the rebuild timeout is fenced (issue 19's chaos run): real
//! `kvtier-l3` processes on 127.0.0.1, real SSD directories, real SIGKILL.
//!
//! Why: a restarted master rebuilds its objects from what the nodes report at their remount.
//! Before, it answered clients at once: a key whose only copy was on the SSD of a node not
//! back yet read "not found", its remove answered -704 and removed nothing, and once the
//! node came back the key was there again; a node that came back after its keys had been
//! put anew and removed had its old records adopted (a removed key, or a version older
//! than an acknowledged put, served). `l3-chaos` found 352 resurrected removes and 162 stale
//! versions in 30 s with master and node kills; 0 after.

use std::time::Duration;

mod common;

use common::procs::{Proc, eventually, kill9, master_in, node_with};
use common::{client, payload, persisted, t};
use kvtier_l3::rpc::service::{ClusterReply, ClusterRequest};
use kvtier_l3::{L3Error, L3Store, RemoteStore};

fn live_nodes(c: &RemoteStore) -> Vec<u64> {
    match c.cluster(ClusterRequest::Nodes) {
        Ok(ClusterReply::Nodes(v)) => v.iter().map(|n| n.id.0).collect(),
        _ => Vec::new(),
    }
}

fn unavailable<T: std::fmt::Debug>(r: Result<T, L3Error>) -> bool {
    matches!(r, Err(L3Error::Unavailable(_)))
}

#[test]
fn a_restarted_master_answers_nothing_about_keys_until_its_nodes_are_back() {
    let state = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let mut master = master_in(
        "127.0.0.1:0",
        state.path(),
        &["--client-ttl-ms", "1000"],
        None,
    );
    let addr = master.addr.to_string();
    let mut node = node_with(master.addr, 1, Some(ssd.path()), None, &[]);
    let c = client(master.addr, None);
    c.put(&t("a"), "k", &payload(1, 8192), persisted()).unwrap();

    kill9(&mut node.child);
    kill9(&mut master.child);
    let _master = master_in(&addr, state.path(), &["--client-ttl-ms", "1000"], None);
    let c = client(_master.addr, None);
    // Node 1 holds the only copy of `k` and is down: "not found" would be a lie, and a
    // remove answered -704 would leave `k` to come back with the node.
    assert!(
        unavailable(c.get(&t("a"), "k")),
        "{:?}",
        c.get(&t("a"), "k")
    );
    assert!(unavailable(c.remove(&t("a"), "k", true)));
    assert!(unavailable(c.is_exist(&t("a"), "k")));
    assert!(unavailable(c.put(&t("a"), "other", b"x", persisted())));
    // Losses and stats still answer (they say nothing about a key).
    assert!(c.losses_since(&t("a"), None).is_ok());
    assert!(c.stats().is_ok());

    let _node = node_with(_master.addr, 1, Some(ssd.path()), None, &[]);
    assert!(
        eventually(Duration::from_secs(15), || c
            .get(&t("a"), "k")
            .is_ok_and(|b| b == payload(1, 8192))),
        "the persisted key is served once its node is back"
    );
    c.remove(&t("a"), "k", true).unwrap();
    assert!(matches!(c.get(&t("a"), "k"), Err(L3Error::ObjectNotFound)));
}

/// Node 1 (SSD) holds `k`; the master and node 1 die; the master comes back, waits out its
/// rebuild timeout, and serves with node 2 only: `k` is put anew (on node 2) and removed.
/// Node 1 then comes back with its old record of `k`.
fn fenced_deployment() -> (
    Proc,
    RemoteStore,
    Proc,
    tempfile::TempDir,
    tempfile::TempDir,
) {
    let state = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let flags = ["--client-ttl-ms", "1000", "--rebuild-timeout-ms", "1500"];
    let mut master = master_in("127.0.0.1:0", state.path(), &flags, None);
    let addr = master.addr.to_string();
    let mut node1 = node_with(master.addr, 1, Some(ssd.path()), None, &[]);
    let c = client(master.addr, None);
    c.put(&t("a"), "k", &payload(1, 8192), persisted()).unwrap();
    let node2 = node_with(master.addr, 2, None, None, &[]);
    assert!(eventually(Duration::from_secs(10), || live_nodes(&c).len() == 2));

    kill9(&mut node1.child);
    kill9(&mut master.child);
    let master = master_in(&addr, state.path(), &flags, None);
    let c = client(master.addr, None);
    assert!(
        eventually(Duration::from_secs(15), || matches!(
            c.get(&t("a"), "k"),
            Err(L3Error::ObjectNotFound)
        )),
        "the master serves once the rebuild timeout passed"
    );
    assert!(eventually(Duration::from_secs(10), || live_nodes(&c) == [2]));
    c.put(&t("a"), "k", &payload(2, 4096), Default::default())
        .unwrap();
    assert_eq!(c.get(&t("a"), "k").unwrap(), payload(2, 4096));
    (master, c, node2, state, ssd)
}

#[test]
fn a_fenced_node_never_brings_back_a_key_removed_while_it_was_away() {
    let (master, c, _node2, _state, ssd) = fenced_deployment();
    c.remove(&t("a"), "k", true).unwrap();
    let _node1 = node_with(master.addr, 1, Some(ssd.path()), None, &[]);
    assert!(eventually(Duration::from_secs(10), || live_nodes(&c).contains(&1)));
    for _ in 0..20 {
        let r = c.get(&t("a"), "k");
        assert!(
            matches!(r, Err(L3Error::ObjectNotFound)),
            "removed key is back: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_fenced_node_never_serves_an_older_version_and_is_a_member_again() {
    let (master, c, mut node2, _state, ssd) = fenced_deployment();
    let _node1 = node_with(master.addr, 1, Some(ssd.path()), None, &[]);
    assert!(eventually(Duration::from_secs(10), || live_nodes(&c).contains(&1)));
    // The newer version is lost with node 2 (DRAM only): `k` is gone, never version 1.
    kill9(&mut node2.child);
    assert!(eventually(Duration::from_secs(10), || !live_nodes(&c).contains(&2)));
    for _ in 0..20 {
        let r = c.get(&t("a"), "k");
        assert!(
            matches!(r, Err(L3Error::ObjectNotFound)),
            "version 1 came back: {:?}",
            r.map(|b| b == payload(1, 8192))
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Node 1 (the only node left) is a member again: it takes new persisted puts.
    c.put(&t("a"), "new", &payload(3, 8192), persisted())
        .unwrap();
    assert_eq!(c.get(&t("a"), "new").unwrap(), payload(3, 8192));
}
