//! Flags that would start a server no client can use are refused at start (exit 2, before
//! `LISTENING`): a frame too small for any request, an SSD tier of no bytes, a put timeout of
//! 0 (taken as 1 ms), an empty shared
//! secret (a client sending the empty token was admitted), a shared-memory switch
//! (`KVTIER_L3_SHM`) set to a value it does not know.

use std::process::{Command, Stdio};

fn exit_code(args: &[&str], env_token: Option<&str>) -> Option<i32> {
    exit_code_env(args, env_token, None)
}

fn exit_code_env(args: &[&str], env_token: Option<&str>, shm_env: Option<&str>) -> Option<i32> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"));
    cmd.args(["--listen", "127.0.0.1:0", "--segment-bytes", "1048576"])
        .args(args)
        .env_remove("KVTIER_L3_TOKEN")
        .env_remove("KVTIER_L3_SHM")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(t) = env_token {
        cmd.env("KVTIER_L3_TOKEN", t);
    }
    if let Some(v) = shm_env {
        cmd.env("KVTIER_L3_SHM", v);
    }
    let mut child = cmd.spawn().unwrap();
    // a server that started is a failure of this test: give it a moment, then stop it
    for _ in 0..100 {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code();
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    None
}

#[test]
fn flags_that_leave_a_useless_server_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    let empty = dir.path().join("token");
    std::fs::write(&empty, " \n").unwrap();
    let ssd = ssd.to_str().unwrap();
    let empty = empty.to_str().unwrap();
    for (args, env) in [
        (vec!["--max-frame", "0"], None),
        (vec!["--max-frame", "1"], None),
        (vec!["--max-frame", "4096"], None),
        (vec!["--ssd-dir", ssd, "--ssd-capacity", "0"], None),
        // 0 was taken as 1 ms (read as "off" by many): every put slower than that was
        // revoked mid-flight, -704 on a 30 MiB put over TCP about one time in three
        (vec!["--put-timeout-ms", "0"], None),
        (vec!["--token-file", empty], None),
        (vec![], Some("")),
        (vec![], Some("  ")),
    ] {
        assert_eq!(exit_code(&args, env), Some(2), "{args:?} token {env:?}");
    }
}

/// `KVTIER_L3_SHM` is the operator's off switch: a value it does not know (a typo of `off`)
/// was taken as "on". The server refuses to start with one; the values it knows start it.
#[test]
fn an_unknown_shm_switch_is_refused_at_start() {
    for bad in ["of", "offf", "disable", "inplce", "2"] {
        assert_eq!(exit_code_env(&[], None, Some(bad)), Some(2), "{bad:?}");
    }
    for good in ["off", "OFF", " no ", "inplace", "on", "auto", "1"] {
        assert_eq!(
            exit_code_env(&[], None, Some(good)),
            None,
            "{good:?} was refused"
        );
    }
}

/// A store node whose master (none runs at 127.0.0.1:1) it would fail to reach: a refusal
/// that names a flag came before it looked.
const NODE: [&str; 6] = [
    "--role",
    "node",
    "--master",
    "127.0.0.1:1",
    "--listen",
    "127.0.0.1:0",
];

/// The exit code and stderr of a `kvtier-l3` that must refuse to start (killed if it runs).
fn refusal(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args(["--segment-bytes", "1048576"])
        .args(args)
        .env_remove("KVTIER_L3_TOKEN")
        .env_remove("KVTIER_L3_SHM")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    for _ in 0..100 {
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            return (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into(),
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    (None, "it started".into())
}

/// A node's `--master-timeout-ms 0` (or `--put-timeout-ms 0`) was taken as 1 ms: every call
/// on its master timed out. Refused before it looks for its master.
#[test]
fn a_nodes_zero_timeouts_are_refused() {
    for flag in ["--master-timeout-ms", "--put-timeout-ms"] {
        let args: Vec<&str> = NODE.iter().copied().chain([flag, "0"]).collect();
        let (code, err) = refusal(&args);
        assert_eq!(code, Some(2), "{flag}: {err}");
        assert!(err.contains(flag), "{flag}: {err}");
    }
}

/// A store node reads none of the master's flags: given `--tenant-quota` (the nodes hold a
/// split deployment's DRAM, so that is where an operator puts it) it started and capped
/// nothing. It refuses to start, naming the flag, before it looks for its master (none runs
/// at 127.0.0.1:1 here: a node that got that far failed on the connection instead). A tenant
/// named twice in `--tenant-quota` kept one of the two caps, silently: refused too.
#[test]
fn a_masters_flag_on_a_node_and_a_tenant_capped_twice_are_refused() {
    let node = NODE;
    for flag in [
        &["--tenant-quota", "alice=1048576"][..],
        &["--lease-ms", "5000"],
        &["--client-ttl-ms", "5000"],
        &["--client-segments-max-bytes", "1048576"],
        &["--promotion-on-hit"],
        &["--promotion-admission-threshold", "3"],
        &["--loss-journal-keys", "10"],
        &["--rebuild-timeout-ms", "10"],
        &["--kv-events-block-size", "32"],
        &["--kv-events-parts-per-page", "2"],
        &["--cluster", "prod"],
        &["--leader-ttl-s", "9"],
    ] {
        let args: Vec<&str> = node.iter().chain(flag).copied().collect();
        let (code, err) = refusal(&args);
        assert_eq!(code, Some(1), "{flag:?}: {err}");
        assert!(
            err.contains(flag[0]) && !err.contains("connect"),
            "{flag:?}: {err}"
        );
    }
    let (code, err) = refusal(&[
        "--listen",
        "127.0.0.1:0",
        "--tenant-quota",
        "alice=1048576",
        "--tenant-quota",
        "bob=5",
        "--tenant-quota",
        "alice=1073741824",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("alice") && !err.contains("bob"), "{err}");
}

/// A node's own flags on a master or a `both` server did nothing: `--ping-ms`,
/// `--node-id` and `--master-timeout-ms` started it as if not given. Refused, naming the flag,
/// as `--master` already was.
#[test]
fn a_nodes_flags_on_a_master_or_a_both_server_are_refused() {
    for role in [
        &["--role", "master", "--no-state-dir"][..],
        &["--role", "both"],
    ] {
        for flag in [
            &["--ping-ms", "50"][..],
            &["--node-id", "7"],
            &["--master-timeout-ms", "5000"],
        ] {
            let args: Vec<&str> = ["--listen", "127.0.0.1:0"]
                .iter()
                .chain(role)
                .chain(flag)
                .copied()
                .collect();
            let (code, err) = refusal(&args);
            assert_eq!(code, Some(1), "{role:?} {flag:?}: {err}");
            assert!(err.contains(flag[0]), "{role:?} {flag:?}: {err}");
        }
    }
}

/// The SSD tier's flags without an SSD tier did nothing: `--offload on-evict` or
/// `--ssd-capacity` with no `--ssd-dir` started a DRAM-only server (what DRAM evicted was
/// gone, not on SSD), `--promotion-on-hit` on one promoted nothing, and a master (which holds
/// no SSD tier: its nodes take these) ignored `--offload`/`--ssd-capacity`. Likewise
/// `--promotion-admission-threshold` without `--promotion-on-hit`. Each is refused, named.
#[test]
fn ssd_flags_without_an_ssd_tier_are_refused() {
    let both = ["--listen", "127.0.0.1:0"];
    let node = NODE;
    let master = [
        "--role",
        "master",
        "--no-state-dir",
        "--listen",
        "127.0.0.1:0",
    ];
    for (role, flag) in [
        (&both[..], &["--offload", "on-evict"][..]),
        (&both, &["--ssd-capacity", "1048576"]),
        (&both, &["--promotion-on-hit"]),
        (&both, &["--promotion-admission-threshold", "3"]),
        (&node, &["--offload", "on-evict"]),
        (&node, &["--ssd-capacity", "1048576"]),
        (&master, &["--offload", "on-evict"]),
        (&master, &["--ssd-capacity", "1048576"]),
        (&master, &["--promotion-admission-threshold", "3"]),
    ] {
        let args: Vec<&str> = role.iter().chain(flag).copied().collect();
        let (code, err) = refusal(&args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        let named = flag.iter().rev().find(|f| f.starts_with("--")).unwrap();
        assert!(
            err.contains(named) && !err.contains("connect"),
            "{args:?}: {err}"
        );
    }
    // with their tier they start (a master's promotion flags act on its nodes' tiers)
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    let ssd = ssd.to_str().unwrap();
    for args in [
        &[
            "--listen",
            "127.0.0.1:0",
            "--ssd-dir",
            ssd,
            "--offload",
            "on-evict",
            "--promotion-on-hit",
        ][..],
        &[
            "--role",
            "master",
            "--no-state-dir",
            "--listen",
            "127.0.0.1:0",
            "--promotion-on-hit",
        ],
    ] {
        assert_eq!(refusal(args).0, None, "{args:?} was refused");
    }
}
