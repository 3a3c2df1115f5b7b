//! `kvtier sim --eviction`: every report and sweep shows the simulator's other online policy
//! (LRU beside freq-depth, freq-depth beside LRU) at the same capacity (hit rate and TTFT), in
//! the table, the JSON and the sweep, unless `--no-compare`; bad names are errors.

mod common;
use common::kvtier;

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
    let cmp = v["compared"].as_array().unwrap();
    assert_eq!(cmp.len(), 1);
    let lru = &cmp[0];
    assert_eq!(lru["policy"], "lru");
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
        s.contains("eviction freq-depth:100:2:3") && s.contains("lru, same capacity"),
        "{s}"
    );

    // LRU (the default) is shown beside the conversation setting of freq-depth.
    let out = kvtier()
        .args(["sim", "--json", "--no-l3"])
        .args(SMALL)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["policy"], "lru");
    assert_eq!(v["compared"][0]["policy"], "freq-depth:56000:4:60");

    // And nothing is compared on request.
    let out = kvtier()
        .args(["sim", "--json", "--no-l3", "--no-compare"])
        .args(SMALL)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["compared"].as_array().unwrap().len(), 0);
}

#[test]
fn the_sweep_has_a_line_per_online_policy() {
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
        let lru = &p["compared"][0];
        assert_eq!(lru["policy"], "lru");
        let lru = lru["hit_rate"]
            .as_f64()
            .expect("an LRU value at every point");
        assert!(lru <= p["belady"].as_f64().unwrap() + 1e-9);
    }
    let svg = std::fs::read_to_string(dir.join("sweep.svg")).unwrap();
    assert!(svg.contains("lru (all tiers)") && svg.contains("freq-depth"));
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
