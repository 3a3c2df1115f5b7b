//! `kvtier sim --eviction adaptive` (issue 25): the report shows what the policy learnt per
//! instance and every fixed option beside it (LRU and freq-depth, each with copies at finish
//! and with demotion), the oracle stays clean, the policy stays under Belady; the sweep names
//! the best fixed option per point and the capacity each line needs to match LRU's hit rate at
//! its middle point, each figure with its TTFT p50 / p99.

use std::process::Command;

mod common;
use common::kvtier;

const SMALL: [&str; 8] = [
    "--clients",
    "40",
    "--rounds",
    "4",
    "--device-pages",
    "512",
    "--host-pages",
    "512",
];

/// Runs a `--json` simulation and parses its report.
fn json(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_report_shows_what_it_learnt_and_every_fixed_option() {
    let v = json(
        kvtier()
            .args([
                "sim",
                "--json",
                "--eviction",
                "adaptive",
                "--instances",
                "2",
            ])
            .args(SMALL),
    );
    assert_eq!(v["policy"], "adaptive");
    assert_eq!(v["oracle"]["failures"], 0);
    let learnt = v["adaptive"].as_array().unwrap();
    assert_eq!(learnt.len(), 2, "one snapshot per instance");
    for s in learnt {
        assert!(s["level"].as_u64().unwrap() <= 8);
    }
    let names: Vec<&str> = v["compared"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["policy"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "lru",
            "freq-depth:56000:4:60",
            "lru + on-device-eviction:256",
            "freq-depth:56000:4:60 + on-device-eviction:256"
        ]
    );
    assert!(v["hits"]["total"].as_f64().unwrap() <= v["belady"]["hit_rate"].as_f64().unwrap());
}

/// The printed output of an adaptive sweep over `SMALL`, files written to `dir`.
fn sweep_text(dir: &std::path::Path) -> String {
    let out = kvtier()
        .args(["sim", "--no-l3", "--sweep", "--eviction", "adaptive"])
        .args(SMALL)
        .arg("--sweep-out")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_sweep_names_the_best_fixed_option_and_the_capacity_to_match_lru() {
    let dir = std::env::temp_dir().join(format!("kvtier-sweep-adaptive-{}", std::process::id()));
    let s = sweep_text(&dir);
    assert!(s.contains("best fixed:"), "{s}");
    assert!(s.contains("capacity to match LRU's"), "{s}");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("match-lru.json")).unwrap())
            .unwrap();
    let pols = m["policies"].as_array().unwrap();
    assert_eq!(pols[0]["policy"], "adaptive");
    // LRU matches itself at the middle point.
    let lru = pols.iter().find(|p| p["policy"] == "lru").unwrap();
    let at = m["at_capacity_pages"].as_f64().unwrap();
    let lru_cap = lru["capacity_pages"].as_f64().unwrap();
    assert!(lru_cap <= at + 1e-6, "{lru_cap} > {at}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--host-admission adaptive:256` on the conversation trace: leaves host dropped come back
/// (within a device capacity of traffic) more than leaves device dropped, so the learnt
/// admission switches from copies at finish to demotion (the report says so, and the run
/// differs from adaptive with copies at finish), with the oracle clean and the policy under
/// Belady.
#[test]
fn the_learnt_admission_switches_to_demotion_on_the_conversation_trace() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../traces/conversation_trace.jsonl"
    );
    let run = |admission: &str| {
        json(
            kvtier()
                .args(["sim", "--json", "--no-compare", "--no-l3"])
                .args(["--eviction", "adaptive", "--host-admission", admission])
                .args([
                    "--trace",
                    trace,
                    "--device-pages",
                    "8192",
                    "--host-pages",
                    "32768",
                ]),
        )
    };
    let learnt = run("adaptive:256");
    let at_finish = run("on-finish");
    assert_eq!(learnt["policy"], "adaptive + adaptive:256");
    assert_eq!(learnt["oracle"]["failures"], 0);
    let snap = &learnt["adaptive"][0];
    assert_eq!(snap["admission"], "Demote", "{snap}");
    assert!(snap["admission_score"].as_i64().unwrap() > 0, "{snap}");
    let (l, f) = (
        learnt["hits"]["total"].as_f64().unwrap(),
        at_finish["hits"]["total"].as_f64().unwrap(),
    );
    assert_ne!(l, f, "the learnt admission changed nothing");
    assert!(l <= learnt["belady"]["hit_rate"].as_f64().unwrap());
}

/// Every hit rate a sweep reports has its run's time to first token beside it (the configured
/// policy and every compared one): the same figures a single run at that capacity reports, in
/// the JSON and in the printed table.
#[test]
fn every_sweep_figure_has_the_ttft_of_its_own_run() {
    let dir = std::env::temp_dir().join(format!("kvtier-sweep-ttft-{}", std::process::id()));
    let pts = json(
        kvtier()
            .args([
                "sim",
                "--no-l3",
                "--json",
                "--sweep",
                "--eviction",
                "adaptive",
            ])
            .args(SMALL)
            .arg("--sweep-out")
            .arg(&dir),
    );
    let pts = pts.as_array().unwrap();
    assert!(pts.len() >= 4, "{pts:?}");
    for p in pts {
        for t in std::iter::once(&p["ttft_ms"]).chain(
            p["compared"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| &c["ttft_ms"]),
        ) {
            let (p50, p99) = (t["p50"].as_f64().unwrap(), t["p99"].as_f64().unwrap());
            assert!(p50 > 0.0 && p50 <= p99, "{p}");
        }
    }
    // The point at the given capacity (1 024 pages) against one run there.
    let mid = pts.iter().find(|p| p["capacity_pages"] == 1024).unwrap();
    let one = json(
        kvtier()
            .args(["sim", "--no-l3", "--json", "--eviction", "adaptive"])
            .args(SMALL),
    );
    assert_eq!(mid["ttft_ms"], one["ttft_ms"]);
    assert_eq!(mid["hit_rate"], one["hits"]["total"]);
    let compared = one["compared"].as_array().unwrap();
    assert_eq!(mid["compared"].as_array().unwrap().len(), compared.len());
    for c in compared {
        let m = mid["compared"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["policy"] == c["policy"])
            .unwrap_or_else(|| panic!("{} missing at the sweep point", c["policy"]));
        assert_eq!(m["ttft_ms"], c["ttft_ms"], "{}", c["policy"]);
        assert_eq!(m["hit_rate"], c["hit_rate"], "{}", c["policy"]);
    }
    // The table prints them: the header names TTFT per policy, the row the one-run figures.
    let text = sweep_text(&dir);
    assert!(text.contains("lru: hit % (TTFT p50 / p99)"), "{text}");
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("1024 "))
        .unwrap();
    let ttft = kvtier_sim::sweep_table::fmt_ttft(&kvtier_sim::report::Percentiles {
        p50: one["ttft_ms"]["p50"].as_f64().unwrap(),
        p90: 0.0,
        p99: one["ttft_ms"]["p99"].as_f64().unwrap(),
    });
    assert!(row.contains(&ttft), "{ttft} not in {row}");
    assert!(text.contains("best fixed:"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}
