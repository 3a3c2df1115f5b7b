//! What an etcd HA master accepts at startup (issue 33, items 3 and 4), through the real
//! `kvtier-l3` binary: etcd endpoints that cannot work and leader TTLs outside the bound are
//! refused at once, naming what is wrong (before, the master campaigned silently forever);
//! and how soon a master serves does not grow with its TTL (before, the standby's poll of
//! TTL/10 delayed a new leader by 30 s at TTL 300 and 6 minutes at TTL 3,600).

mod common;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::ha::{HaMaster, free_addr, leader, master_flags, signal};
use common::procs::args;
use kvtier_l3::ha::local_etcd::LocalEtcd;

/// Runs `kvtier-l3 ARGS` and waits up to `limit` for it to exit: (exit code, stderr), or
/// None (killed) when it still runs then.
fn run_for(args: &[String], limit: Duration) -> Option<(Option<i32>, String)> {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args(args)
        .env_remove("KVTIER_L3_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let end = Instant::now() + limit;
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            let mut err = String::new();
            c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            return Some((st.code(), err));
        }
        if Instant::now() >= end {
            let _ = c.kill();
            let _ = c.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `kvtier-l3 --role master --listen 127.0.0.1:0 --etcd ETCD EXTRA...`.
fn etcd_master(etcd: &str, extra: &[&str]) -> Vec<String> {
    let mut a = args(&[
        "--role",
        "master",
        "--listen",
        "127.0.0.1:0",
        "--etcd",
        etcd,
    ]);
    a.extend(args(extra));
    a
}

#[test]
fn etcd_endpoints_that_cannot_work_are_refused_naming_them() {
    for (spec, bad) in [
        ("host:notaport", "host:notaport"),
        ("127.0.0.1:99999", "127.0.0.1:99999"),
        ("[::1", "[::1"),
        ("[::1]:", "[::1]:"),
        ("127.0.0.1:0", "127.0.0.1:0"),
        (":2379", ":2379"),
        ("bad_host!:2379", "bad_host!:2379"),
        ("127.0.0.1:2379,host:notaport", "host:notaport"),
        (
            "etcd://127.0.0.1:2379;http://127.0.0.1:99999",
            "http://127.0.0.1:99999",
        ),
    ] {
        let master = etcd_master(spec, &[]);
        // A node takes them in its `etcd://` locator (where '/' starts the cluster name).
        let locator = format!("etcd://{}", spec.trim_start_matches("etcd://"));
        let node = args(&[
            "--role",
            "node",
            "--listen",
            "127.0.0.1:0",
            "--master",
            &locator,
        ]);
        let runs: &[&[String]] = if spec.contains("http://") {
            &[&master]
        } else {
            &[&master, &node]
        };
        for args in runs {
            let (code, err) = run_for(args, Duration::from_secs(10))
                .unwrap_or_else(|| panic!("{args:?}: still running after 10 s"));
            assert_ne!(code, Some(0), "{args:?} exited 0: {err}");
            assert!(
                err.contains(&format!("etcd endpoint {bad:?}")),
                "{args:?}: the error does not name {bad:?}: {err}"
            );
        }
    }
    // Good endpoints of every accepted form parse (the master then campaigns: killed here).
    for spec in [
        "127.0.0.1:1",
        "http://localhost:1/",
        "etcd://[::1]:1;etcd-0.example:1",
    ] {
        let args = etcd_master(spec, &[]);
        assert!(
            run_for(&args, Duration::from_secs(2)).is_none(),
            "{spec} was refused"
        );
    }
}

#[test]
fn a_leader_ttl_outside_its_bound_is_refused() {
    for ttl in ["0", "3601", "9000000001", "-1", "five"] {
        let flag = format!("--leader-ttl-s={ttl}");
        let args = etcd_master("127.0.0.1:1", &[&flag]);
        let (code, err) = run_for(&args, Duration::from_secs(10))
            .unwrap_or_else(|| panic!("--leader-ttl-s {ttl}: still running after 10 s"));
        assert_eq!(code, Some(2), "--leader-ttl-s {ttl}: {err}");
        assert!(err.contains("--leader-ttl-s"), "{err}");
    }
    let help = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    let help = String::from_utf8(help.stdout).unwrap();
    assert!(help.contains("1 to 3600"), "{help}");
}

/// The TTL of the step-up test: the bound (the master was not serving 25 s after
/// winning at this TTL).
const TTL_S: u64 = 3600;

/// A master of the test cluster with TTL [`TTL_S`], its stdout piped.
fn master(etcd: &LocalEtcd) -> HaMaster {
    let listen = free_addr();
    let child: Child = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args(master_flags(etcd, listen, TTL_S))
        .env_remove("KVTIER_L3_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    HaMaster {
        child,
        addr: listen,
    }
}

/// Asserts that `m` serves (`LISTENING` on its stdout, read on a thread: the read blocks)
/// within 8 s and is then the published leader; its epoch.
fn serves_within_8_s(etcd: &LocalEtcd, m: &mut HaMaster, what: &str) -> u64 {
    let out = m.child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = kvtier_l3::cli::read_listening(out);
        let _ = tx.send(r.is_ok());
    });
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(8)),
        Ok(true),
        "{what}, TTL {TTL_S} s, is not serving 8 s later"
    );
    let (addr, epoch) = leader(etcd, Duration::from_secs(5)).expect("a published leader");
    assert_eq!(addr, m.addr, "{what} is not the published leader");
    epoch
}

/// Issue 33, item 3: the elected master served 1.2 / 3.0 / 10.1 / 30.1 s after winning at
/// TTL 10 / 30 / 100 / 300 (its standby listener's poll thread slept TTL/10 and the leader
/// waited for it), and a standby noticed a resigned leader only at its next TTL/10 poll.
/// Both are bounded by a short fixed interval now, whatever the TTL.
#[test]
fn how_soon_a_master_serves_does_not_grow_with_its_ttl() {
    let etcd = LocalEtcd::start(1).unwrap();
    let mut first = master(&etcd);
    let epoch = serves_within_8_s(&etcd, &mut first, "the only master of the cluster");
    // A standby with the same TTL: it listens (redirecting), and takes over within seconds
    // once the leader resigns (SIGTERM revokes its lease).
    let mut second = master(&etcd);
    assert!(common::procs::eventually(Duration::from_secs(10), || {
        std::net::TcpStream::connect(second.addr).is_ok()
    }));
    signal(&first.child, libc::SIGTERM);
    assert!(first.child.wait().unwrap().success());
    let epoch2 = serves_within_8_s(&etcd, &mut second, "the standby of a resigned leader");
    assert!(epoch2 > epoch);
}
