//! Two masters must never share a `--state-dir` (adversarial tester). A second master
//! started on the running one's state dir — on the same address, where it cannot bind and
//! exits 1, or on another one — replayed and compacted the settle log at start: it renamed a
//! new `settles.log` over the running master's, which went on appending to the unlinked
//! file. Every settle after that was lost, and the keys the running master then removed
//! came back after its restart (10 of 10). Now the state dir is locked for the master's
//! life: the second one fails at start, naming the dir, and touches nothing.
//!
//! Real `kvtier-l3` processes on 127.0.0.1, real files, real SIGKILL.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;

use common::procs::{eventually, kill9, master_in, node_with};
use common::{client, payload, persisted, t};
use kvtier_l3::{L3Error, L3Store};

const N: usize = 10;

/// Starts a second master on `state`, listening on `listen`. Returns whether it came up
/// (then it is SIGKILLed, as the tester did) and what it wrote to stderr.
fn second_master(listen: &str, state: &Path) -> (bool, Option<i32>, String) {
    let mut kid = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args(["--role", "master", "--listen", listen, "--state-dir"])
        .arg(state)
        .env_remove("KVTIER_L3_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = kid.stdout.take().unwrap();
    let started = kvtier_l3::cli::read_listening(out).is_ok();
    let code = if started {
        kill9(&mut kid);
        None
    } else {
        kid.wait().unwrap().code()
    };
    let mut err = String::new();
    kid.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (started, code, err)
}

fn run(same_address: bool) {
    let state = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let mut m1 = master_in("127.0.0.1:0", state.path(), &[], None);
    let addr = m1.addr;
    // Pings every 3 s: the removes below reach the node only after the master is dead,
    // so only the settle log keeps them.
    let _node = node_with(addr, 1, Some(ssd.path()), None, &["--ping-ms", "3000"]);
    let a = t("a");
    let c = client(addr, None);
    let keys: Vec<String> = (0..N).map(|i| format!("k{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        c.put(&a, k, &payload(i, 4096), persisted()).unwrap();
    }
    c.put(&a, "kept", &payload(99, 4096), persisted()).unwrap();
    let log = state.path().join("settles.log");
    let before = std::fs::read(&log).unwrap();

    let listen = if same_address {
        addr.to_string()
    } else {
        "127.0.0.1:0".to_string()
    };
    let (started, code, err) = second_master(&listen, state.path());
    assert!(
        !started,
        "a second master started on a state dir in use (same address: {same_address})"
    );
    assert_eq!(code, Some(1), "second master: {err}");
    assert!(
        err.contains(&state.path().display().to_string()) && err.contains("in use"),
        "the refusal does not name the state dir: {err}"
    );
    assert_eq!(
        std::fs::read(&log).unwrap(),
        before,
        "the refused master changed the settle log"
    );

    // The first master goes on: removes acknowledged before the node hears of them.
    for k in &keys {
        c.remove(&a, k, true).unwrap();
    }
    kill9(&mut m1.child);
    let _m = master_in(&addr.to_string(), state.path(), &[], None);
    let c = client(addr, None);
    assert!(
        eventually(Duration::from_secs(15), || c
            .is_exist(&a, "kept")
            .unwrap_or(false)),
        "node 1 never re-registered with the restarted master"
    );
    let back: Vec<&String> = keys
        .iter()
        .filter(|k| !matches!(c.get(&a, k), Err(L3Error::ObjectNotFound)))
        .collect();
    assert!(
        back.is_empty(),
        "{} of {N} removed keys came back after the restart: {back:?}",
        back.len()
    );
}

#[test]
fn a_second_master_on_the_same_address_and_state_dir_changes_nothing() {
    run(true);
}

#[test]
fn a_second_master_on_another_address_is_refused_the_state_dir() {
    run(false);
}
