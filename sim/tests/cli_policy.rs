//! `kvtier sim --eviction`: a policy other than LRU is reported beside LRU at the same
//! capacity (hit rate and TTFT), in the table, the JSON and the sweep; bad names are errors.

use std::process::Command;

fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

const SMALL: [&str; 8] = [
    "--clients",
    "40",
    "--rounds",
    "4",
    "--device-pages",
    "64",
    "--host-pages",
    "256",
];

#[test]
fn a_policy_is_reported_beside_lru() {
    let out = kvtier()
        .args(["sim", "--json", "--no-l3", "--eviction", "freq-depth"])
        .args(SMALL)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["policy"], "freq-depth:56000:4:60");
    assert_eq!(v["oracle"]["failures"], 0);
    let lru = &v["lru"];
    assert!(lru["hit_rate"].as_f64().unwrap() <= v["belady"]["hit_rate"].as_f64().unwrap());
    assert!(lru["ttft_ms"]["p99"].as_f64().is_some());

    let out = kvtier()
        .args([
            "sim",
            "--quiet",
            "--no-l3",
            "--eviction",
            "freq-depth:100:2:3",
        ])
        .args(SMALL)
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("eviction freq-depth:100:2:3") && s.contains("LRU, same capacity"),
        "{s}"
    );

    // LRU itself has nothing to compare with.
    let out = kvtier()
        .args(["sim", "--json", "--no-l3", "--eviction", "lru"])
        .args(SMALL)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["lru"].is_null());
}

#[test]
fn the_sweep_has_an_lru_line() {
    let dir = std::env::temp_dir().join(format!("kvtier-sweep-lru-{}", std::process::id()));
    let out = kvtier()
        .args([
            "sim",
            "--json",
            "--no-l3",
            "--sweep",
            "--eviction",
            "freq-depth",
        ])
        .args(SMALL)
        .arg("--sweep-out")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    let pts: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for p in pts.as_array().unwrap() {
        let lru = p["lru"].as_f64().expect("an LRU value at every point");
        assert!(lru <= p["belady"].as_f64().unwrap() + 1e-9);
    }
    let svg = std::fs::read_to_string(dir.join("sweep.svg")).unwrap();
    assert!(svg.contains("LRU (all tiers)") && svg.contains("freq-depth"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_policies_are_errors() {
    for (p, want) in [
        ("mru", "unknown eviction policy"),
        ("freq-depth:1:2", "unknown eviction policy"),
        ("freq-depth:x:2:3", "bad number"),
        ("freq-depth:1:99999999999:3", "too large"),
    ] {
        let out = kvtier().args(["sim", "--eviction", p]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{p}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{p}: {err}");
    }
}
