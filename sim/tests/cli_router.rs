//! `kvtier sim --router` and `kvtier router-bench`: a tiny benchmark runs end to end and writes
//! its table, JSON and plot; `--routing` still works; bad input is a clear error.

mod common;
use common::{kvtier, succeeds};

#[test]
fn router_and_its_alias_routing_both_run() {
    for flag in ["--router", "--routing"] {
        let out = succeeds(kvtier().args([
            "sim",
            "--quiet",
            "--no-compare",
            "--clients",
            "6",
            "--rounds",
            "2",
            "--instances",
            "2",
            flag,
            "kvtier",
        ]));
        let s = String::from_utf8_lossy(&out.stdout);
        assert!(
            s.contains("router") && s.contains("kvtier: requests per instance"),
            "{s}"
        );
    }
}

#[test]
fn a_tiny_router_bench_writes_table_json_and_plot() {
    let dir = std::env::temp_dir().join(format!("kvtier-router-bench-{}", std::process::id()));
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    succeeds(
        kvtier()
            .current_dir(root)
            .args([
                "router-bench",
                "--quiet",
                "--workloads",
                "traces/synthetic_trace.jsonl,chat",
                "--limit",
                "12",
                "--clients",
                "4",
                "--rounds",
                "2",
                "--instances",
                "2",
                "--loads",
                "0.5",
            ])
            .arg("--out")
            .arg(&dir),
    );
    for f in [
        "router-bench.json",
        "router-bench.md",
        "router-bench.svg",
        "router-bench.png",
    ] {
        let m = std::fs::metadata(dir.join(f)).unwrap();
        assert!(m.len() > 100, "{f} too small");
    }
    let rows: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("router-bench.json")).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    // 2 workloads x 1 instance count x 1 load x 5 routers.
    assert_eq!(rows.len(), 10);
    for r in rows {
        assert_eq!(r["routed"], r["requests"], "{r}");
        assert_eq!(r["oracle_failures"], 0);
    }
    let md = std::fs::read_to_string(dir.join("router-bench.md")).unwrap();
    assert!(md.contains("dynamo p99 / kvtier p99"), "{md}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_router_bench_input_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("kvtier-rb-bad-{}", std::process::id()));
    for (args, want) in [
        (vec!["--loads", "0"], "--loads"),
        (vec!["--instances", "0"], "--instances"),
        (vec!["--limit", "0"], "--limit"),
        // said only "chat: empty workload"; a huge one was built in memory (out of memory)
        (vec!["--workloads", "chat", "--clients", "0"], "--clients"),
        (vec!["--workloads", "chat", "--rounds", "0"], "--rounds"),
        (vec!["--workloads", "chat", "--rounds", "100000"], "cap"),
        (
            vec!["--workloads", "/nonexistent/t.jsonl"],
            "/nonexistent/t.jsonl",
        ),
    ] {
        let out = kvtier()
            .arg("router-bench")
            .args(&args)
            .arg("--out")
            .arg(&dir)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!dir.exists(), "nothing written");
    }
    let out = kvtier()
        .args(["sim", "--router", "fastest"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// `router-bench --config` never ran `SimConfig::check`, so values `kvtier sim` refuses ran:
/// `payload_bytes = 7` panicked in the integrity oracle ("range end index 162 out of range for
/// slice of length 161", exit 101), `--instances 5000` ran past the 4,096 cap (exit 0), and a
/// `tp_ranks = 2` scheduler ran as one rank. Each is refused before anything runs (dry runs
/// too), naming the key; nothing is written.
#[test]
fn router_bench_refuses_the_configurations_sim_refuses() {
    let dir = common::temp_dir("rb-check");
    let out_dir = dir.join("out");
    for (i, (toml, args, want)) in [
        ("payload_bytes = 7\n", vec![], "payload_bytes"),
        ("[scheduler]\ntp_ranks = 2\n", vec![], "tp_ranks"),
        ("[links]\nl3_gb_per_s = -1.0\n", vec![], "l3_gb_per_s"),
        ("", vec!["--instances", "2,5000"], "instances 5000"),
        (
            "[scheduler]\ndevice_pages = 100000\nhost_pages = 100000\n",
            vec!["--instances", "2,2048"],
            "device_pages",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let cfg = dir.join(format!("c{i}.toml"));
        std::fs::write(&cfg, toml).unwrap();
        for dry in [true, false] {
            let mut cmd = kvtier();
            cmd.args([
                "router-bench",
                "--quiet",
                "--workloads",
                "chat",
                "--clients",
                "4",
                "--rounds",
                "2",
                "--loads",
                "0.5",
                "--routers",
                "round-robin",
            ])
            .args(&args)
            .arg("--config")
            .arg(&cfg)
            .arg("--out")
            .arg(&out_dir);
            if dry {
                cmd.arg("--dry-run");
            }
            let out = cmd.output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(
                out.status.code(),
                Some(2),
                "{toml:?} {args:?} dry {dry}: {err}"
            );
            assert!(!err.contains("panicked"), "{toml:?}: {err}");
            assert!(
                err.contains(want),
                "{toml:?} {args:?}: stderr lacks {want:?}: {err}"
            );
            assert!(!out_dir.exists(), "{toml:?}: nothing written");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
