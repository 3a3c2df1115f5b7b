//! The `kvtier` command: its main job runs, bad input gets a clear error and writes nothing.

use std::process::Command;

mod common;
use common::kvtier;

#[test]
fn default_sim_runs_and_reports_every_tier() {
    let out = kvtier()
        .args(["sim", "--quiet", "--clients", "12", "--rounds", "3"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
    for want in [
        "hit rate: device",
        "hit rate: host",
        "hit rate: L3",
        "Belady ceiling",
        "TTFT p50",
        "0 failures",
    ] {
        assert!(s.contains(want), "missing {want} in:\n{s}");
    }
}

#[test]
fn json_report_is_machine_readable() {
    let out = kvtier()
        .args([
            "sim",
            "--json",
            "--clients",
            "4",
            "--rounds",
            "2",
            "--instances",
            "2",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["hits"]["total"].as_f64().is_some());
    assert_eq!(v["oracle"]["failures"], 0);
}

#[test]
fn bad_input_gets_a_clear_error_and_writes_nothing() {
    let dir = std::env::temp_dir().join(format!("kvtier-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 1, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let out_dir = dir.join("sweep-out");
    let out = kvtier()
        .args(["sim", "--quiet", "--sweep", "--trace"])
        .arg(&trace)
        .arg("--sweep-out")
        .arg(&out_dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2") && err.contains("hash_ids"), "{err}");
    assert!(!out_dir.exists(), "nothing half-written");

    for (args, want) in [
        (vec!["sim", "--profile", "gpt-99"], "unknown profile"),
        (
            vec!["sim", "--write-policy", "sometimes"],
            "unknown write policy",
        ),
        (vec!["sim", "--prefetch-stop", "timeout:x:1"], "bad timeout"),
        (vec!["sim", "--device-pages", "0"], "configuration"),
    ] {
        let out = kvtier().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(want),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let missing = kvtier()
        .args(["sim", "--trace", "/nonexistent/trace.jsonl"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn sweep_writes_json_svg_and_png() {
    let dir = std::env::temp_dir().join(format!("kvtier-sweep-{}", std::process::id()));
    let out = kvtier()
        .args([
            "sim",
            "--quiet",
            "--sweep",
            "--clients",
            "8",
            "--rounds",
            "3",
            "--device-pages",
            "256",
            "--host-pages",
            "512",
        ])
        .arg("--sweep-out")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in ["sweep.json", "sweep.svg", "sweep.png"] {
        let m = std::fs::metadata(dir.join(f)).unwrap();
        assert!(m.len() > 100, "{f} too small");
    }
    let pts: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("sweep.json")).unwrap()).unwrap();
    for p in pts.as_array().unwrap() {
        assert!(p["hit_rate"].as_f64().unwrap() <= p["belady"].as_f64().unwrap() + 1e-9);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn toml_config_ssd_tier_and_overrides() {
    let dir = std::env::temp_dir().join(format!("kvtier-toml-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("sim.toml");
    std::fs::write(
        &cfg,
        "instances = 2\nl3_pages = 512\nl3_ssd_pages = 20000\n[links]\npcie_gb_per_s = 25.0\npcie_latency_us = 10.0\nl3_gb_per_s = 40.0\nl3_latency_us = 50.0\nl3_query_us = 100.0\nssd_gb_per_s = 2.0\n",
    )
    .unwrap();
    let out = kvtier()
        .args([
            "sim",
            "--json",
            "--clients",
            "40",
            "--rounds",
            "4",
            "--device-pages",
            "256",
            "--host-pages",
            "256",
        ])
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["oracle"]["failures"], 0);
    assert!(
        v["ssd_read_bytes"].as_u64().unwrap() > 0,
        "prefetches read SSD-only objects: {v}"
    );
    std::fs::write(&cfg, "instances = \"many\"\n").unwrap();
    let out = kvtier()
        .args(["sim", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("sim.toml"));
    let out = kvtier().args(["sim", "--l3-gbps", "-1"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn l3_subcommand_serves_the_store_on_loopback() {
    let help = kvtier().args(["l3", "--help"]).output().unwrap();
    assert!(help.status.success());
    let h = String::from_utf8_lossy(&help.stdout);
    assert!(h.contains("--role") && h.contains("master"), "{h}");
    let bad = kvtier().args(["l3", "--role", "leader"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));

    // A real server on an ephemeral loopback port: it says where it listens, then stops on SIGTERM.
    use std::io::{BufRead, BufReader};
    let mut child = kvtier()
        .args([
            "l3",
            "--listen",
            "127.0.0.1:0",
            "--segment-bytes",
            "1048576",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("LISTENING 127.0.0.1:"), "{line}");
    let addr: std::net::SocketAddr = line
        .trim()
        .trim_start_matches("LISTENING ")
        .parse()
        .unwrap();
    assert!(std::net::TcpStream::connect(addr).is_ok());
    kill_term(child.id());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

fn kill_term(pid: u32) {
    let ok = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}
