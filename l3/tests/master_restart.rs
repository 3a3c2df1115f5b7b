//! A master restart never brings back what it acknowledged as gone (issue 19, item 1): real
//! `kvtier-l3` master and node processes on 127.0.0.1, real SSD directories, real SIGKILL.
//!
//! Why: the master drops a removed version at once and tells the node holding its SSD
//! record a ping later (a *settle*, kept until the node acknowledges it). Settles lived only
//! in the master's memory: a master SIGKILLed between the remove and the node's next ping
//! forgot them, the node re-registered its records at the remount, and the removed key was
//! back (20 of 20 keys) — or, when a newer version had been put on a DRAM-only node, the
//! removed old version was served in its place. Now the master makes each settle durable in
//! its `--state-dir` before any reply leaves it, and reloads them at restart.

use std::time::Duration;

mod common;

use common::procs::{eventually, kill9, master_in, node_with};
use common::{client, payload, persisted, t};
use kvtier_l3::{L3Error, L3Store, PutOptions};

const N: usize = 20;

#[test]
fn an_acknowledged_remove_survives_a_master_sigkill_before_the_node_heard_of_it() {
    let state = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let mut m = master_in("127.0.0.1:0", state.path(), &[], None);
    let addr = m.addr;
    // Pings every 3 s: the removes below reach the node only after the master is dead.
    let _n = node_with(addr, 1, Some(ssd.path()), None, &["--ping-ms", "3000"]);
    let c = client(addr, None);
    let a = t("a");
    let keys: Vec<String> = (0..N).map(|i| format!("removed-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        c.put(&a, k, &payload(i, 8192), persisted()).unwrap();
    }
    c.put(&a, "kept", &payload(99, 8192), persisted()).unwrap();
    for k in &keys {
        c.remove(&a, k, true).unwrap();
        assert!(!c.is_exist(&a, k).unwrap());
    }
    kill9(&mut m.child);
    drop(m);
    let _m = master_in(&addr.to_string(), state.path(), &[], None);
    let c = client(addr, None);
    // The node's next ping is answered "remount"; it re-registers its SSD records.
    assert!(
        eventually(Duration::from_secs(15), || c
            .is_exist(&a, "kept")
            .unwrap_or(false)),
        "the node never re-registered with the restarted master"
    );
    let back: Vec<&String> = keys
        .iter()
        .filter(|k| c.is_exist(&a, k).unwrap_or(true))
        .collect();
    assert!(
        back.is_empty(),
        "{} of {N} acknowledged removes came back after a master restart: {back:?}",
        back.len()
    );
    for k in &keys {
        assert!(matches!(c.get(&a, k), Err(L3Error::ObjectNotFound)));
    }
    assert_eq!(c.get(&a, "kept").unwrap(), payload(99, 8192));
}

#[test]
fn a_removed_old_version_is_never_served_after_a_master_restart() {
    let state = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let mut m = master_in("127.0.0.1:0", state.path(), &[], None);
    let addr = m.addr;
    let _n1 = node_with(addr, 1, Some(ssd.path()), None, &["--ping-ms", "3000"]);
    let c = client(addr, None);
    let a = t("a");
    let keys: Vec<String> = (0..N).map(|i| format!("replaced-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        c.put(&a, k, &payload(i, 8192), persisted()).unwrap();
    }
    c.put(&a, "kept", &payload(99, 8192), persisted()).unwrap();
    // A DRAM-only node with far more free space takes every new version.
    let _n2 = node_with(
        addr,
        2,
        None,
        None,
        &["--ping-ms", "3000", "--segment-bytes", "268435456"],
    );
    for (i, k) in keys.iter().enumerate() {
        c.remove(&a, k, true).unwrap();
        c.put(&a, k, &payload(1000 + i, 8192), PutOptions::default())
            .unwrap();
        assert_eq!(c.get(&a, k).unwrap(), payload(1000 + i, 8192));
    }
    kill9(&mut m.child);
    drop(m);
    let _m = master_in(&addr.to_string(), state.path(), &[], None);
    let c = client(addr, None);
    assert!(
        eventually(Duration::from_secs(15), || c
            .is_exist(&a, "kept")
            .unwrap_or(false)),
        "node 1 never re-registered with the restarted master"
    );
    // The new versions lived in DRAM only and are gone with the master's metadata; the old
    // ones were removed: every read is a miss, never the old bytes.
    for (i, k) in keys.iter().enumerate() {
        match c.get(&a, k) {
            Err(L3Error::ObjectNotFound) => {}
            Ok(b) if b == payload(1000 + i, 8192) => {}
            Ok(b) if b == payload(i, 8192) => {
                panic!("{k}: the removed old version was served after the master restart")
            }
            other => panic!("{k}: unexpected {other:?}"),
        }
    }
}
