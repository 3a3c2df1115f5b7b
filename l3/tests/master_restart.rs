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

use common::procs::{Proc, eventually, kill9, master_in, node_with};
use common::{client, payload, persisted, t};
use kvtier_l3::{L3Error, L3Store, PutOptions, RemoteStore};

const N: usize = 20;

/// A master with a state dir and node 1 with an SSD tier pinging every 3 s (so the
/// changes a test makes reach the node only after the master is dead), `N` keys put with
/// `wait_persisted`, plus `kept`, whose return after a restart shows the node remounted.
struct Deployment {
    state: tempfile::TempDir,
    _ssd: tempfile::TempDir,
    master: Proc,
    _node: Proc,
    keys: Vec<String>,
}

impl Deployment {
    fn start(prefix: &str) -> Self {
        let state = tempfile::tempdir().unwrap();
        let ssd = tempfile::tempdir().unwrap();
        let master = master_in("127.0.0.1:0", state.path(), &[], None);
        let node = node_with(
            master.addr,
            1,
            Some(ssd.path()),
            None,
            &["--ping-ms", "3000"],
        );
        let c = client(master.addr, None);
        let keys: Vec<String> = (0..N).map(|i| format!("{prefix}-{i}")).collect();
        for (i, k) in keys.iter().enumerate() {
            c.put(&t("a"), k, &payload(i, 8192), persisted()).unwrap();
        }
        c.put(&t("a"), "kept", &payload(99, 8192), persisted())
            .unwrap();
        Deployment {
            state,
            _ssd: ssd,
            master,
            _node: node,
            keys,
        }
    }

    /// SIGKILLs the master, restarts it on the same address and state dir, and waits until
    /// node 1 has re-registered its SSD records; returns a client of the new master.
    fn restart_master(&mut self) -> RemoteStore {
        let addr = self.master.addr;
        kill9(&mut self.master.child);
        self.master = master_in(&addr.to_string(), self.state.path(), &[], None);
        let c = client(addr, None);
        assert!(
            eventually(Duration::from_secs(15), || c
                .is_exist(&t("a"), "kept")
                .unwrap_or(false)),
            "node 1 never re-registered with the restarted master"
        );
        c
    }
}

#[test]
fn an_acknowledged_remove_survives_a_master_sigkill_before_the_node_heard_of_it() {
    let mut d = Deployment::start("removed");
    let c = client(d.master.addr, None);
    let a = t("a");
    for k in &d.keys {
        c.remove(&a, k, true).unwrap();
        assert!(!c.is_exist(&a, k).unwrap());
    }
    let c = d.restart_master();
    let back: Vec<&String> = d
        .keys
        .iter()
        .filter(|k| c.is_exist(&a, k).unwrap_or(true))
        .collect();
    assert!(
        back.is_empty(),
        "{} of {N} acknowledged removes came back after a master restart: {back:?}",
        back.len()
    );
    for k in &d.keys {
        assert!(matches!(c.get(&a, k), Err(L3Error::ObjectNotFound)));
    }
    assert_eq!(c.get(&a, "kept").unwrap(), payload(99, 8192));
}

#[test]
fn a_removed_old_version_is_never_served_after_a_master_restart() {
    let mut d = Deployment::start("replaced");
    let c = client(d.master.addr, None);
    let a = t("a");
    // A DRAM-only node with far more free space takes every new version.
    let _n2 = node_with(
        d.master.addr,
        2,
        None,
        None,
        &["--ping-ms", "3000", "--segment-bytes", "268435456"],
    );
    for (i, k) in d.keys.iter().enumerate() {
        c.remove(&a, k, true).unwrap();
        c.put(&a, k, &payload(1000 + i, 8192), PutOptions::default())
            .unwrap();
        assert_eq!(c.get(&a, k).unwrap(), payload(1000 + i, 8192));
    }
    let c = d.restart_master();
    // The new versions lived in DRAM only and are gone with the master's metadata; the old
    // ones were removed: every read is a miss, never the old bytes.
    for (i, k) in d.keys.iter().enumerate() {
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
