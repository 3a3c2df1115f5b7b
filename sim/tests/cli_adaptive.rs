//! `kvtier sim --eviction adaptive` (issue 25): the report shows what the policy learnt per
//! instance and every fixed option beside it (LRU and freq-depth, each with copies at finish
//! and with demotion), the oracle stays clean, the policy stays under Belady; the sweep names
//! the best fixed option per point and the capacity each line needs to match LRU's hit rate at
//! its middle point.

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

#[test]
fn the_sweep_names_the_best_fixed_option_and_the_capacity_to_match_lru() {
    let dir = std::env::temp_dir().join(format!("kvtier-sweep-adaptive-{}", std::process::id()));
    let out = kvtier()
        .args(["sim", "--no-l3", "--sweep", "--eviction", "adaptive"])
        .args(SMALL)
        .arg("--sweep-out")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
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
