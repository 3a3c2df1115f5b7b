//! Problems a new user hit with `kvtier sim` (issue 12), each pinned by a test: a partial
//! `[scheduler]` table, long prompts rejected by a default context limit, and rejections
//! nobody was told about.

mod common;
use common::{kvtier, succeeds, temp_dir};

/// One trace line of `blocks` 512-token blocks, ids starting at `first_id`.
fn line(ts: u64, input: usize, first_id: u64) -> String {
    let ids: Vec<String> = (0..input.div_ceil(512) as u64)
        .map(|i| (first_id + i).to_string())
        .collect();
    format!(
        "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": 4, \"hash_ids\": [{}]}}\n",
        ids.join(", ")
    )
}

/// The report table of `trace` on 4,096 device pages of 64 tokens (a context limit of
/// 262,144 tokens), without an L3.
fn table_of(trace: &std::path::Path) -> String {
    let out = succeeds(
        kvtier()
            .args(["sim", "--quiet", "--no-l3", "--device-pages", "4096"])
            .arg("--trace")
            .arg(trace),
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_partial_scheduler_table_takes_the_defaults() {
    let dir = temp_dir("partial-toml");
    let cfg = dir.join("sim.toml");
    std::fs::write(
        &cfg,
        "l3_pages = 4096\n[scheduler]\ndevice_pages = 512\nhost_pages = 1024\n[links]\nl3_gb_per_s = 40.0\n",
    )
    .unwrap();
    let out = succeeds(
        kvtier()
            .args(["sim", "--json", "--clients", "6", "--rounds", "2"])
            .arg("--config")
            .arg(&cfg),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["oracle"]["failures"], 0);
    // The table's own fields are used: Belady's capacity is 512 + 1024 + 4096 pages.
    assert_eq!(v["belady"]["capacity_pages"], 512 + 1024 + 4096);

    // A field of the wrong type is still an error naming the file.
    std::fs::write(&cfg, "[scheduler]\ndevice_pages = \"lots\"\n").unwrap();
    let out = kvtier()
        .args(["sim", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("sim.toml") && err.contains("device_pages"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn long_prompts_run_and_rejections_are_counted_with_their_reason() {
    let dir = temp_dir("long-prompts");
    let trace = dir.join("long.jsonl");
    // 140K tokens (over the old 131,072 default), then 300K tokens (over the device capacity
    // of 4,096 pages × 64 tokens = 262,144), then a short one.
    let text = [
        line(0, 140_000, 0),
        line(10, 300_000, 1_000),
        line(20, 2_000, 0),
    ]
    .concat();
    std::fs::write(&trace, text).unwrap();
    let out = succeeds(
        kvtier()
            .args([
                "sim",
                "--json",
                "--no-l3",
                "--device-pages",
                "4096",
                "--host-pages",
                "8192",
            ])
            .arg("--trace")
            .arg(&trace),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 2, "{v}");
    assert_eq!(v["rejected"], 1, "{v}");
    let reasons = v["rejections"].as_array().expect("rejections listed");
    assert_eq!(reasons.len(), 1, "{v}");
    assert_eq!(reasons[0]["count"], 1);
    let why = reasons[0]["reason"].as_str().unwrap();
    assert!(why.contains("262144"), "{why}");
    assert_eq!(v["longest_request_tokens"], 300_004);

    // The table says it too.
    let s = table_of(&trace);
    assert!(
        s.contains("rejected") && s.contains("max_context_tokens 262144"),
        "{s}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_sweep_belady_line_is_for_the_capacity_on_its_x_axis() {
    let dir = temp_dir("sweep-belady");
    let common = [
        "--clients",
        "30",
        "--rounds",
        "3",
        "--device-pages",
        "32",
        "--host-pages",
        "64",
        "--l3-pages",
        "100000",
    ];
    let out = succeeds(
        kvtier()
            .args(["sim", "--json", "--sweep"])
            .args(common)
            .arg("--sweep-out")
            .arg(&dir),
    );
    let pts: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let one = kvtier()
        .args(["sim", "--json"])
        .args(common)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&one.stdout).unwrap();
    let local = &v["belady_local"];
    assert_eq!(local["capacity_pages"], 32 + 64);
    assert!(local["hit_rate"].as_f64().unwrap() < v["belady"]["hit_rate"].as_f64().unwrap());
    let p = pts
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["capacity_pages"] == 96)
        .expect("the ×1 point");
    assert_eq!(p["belady"], local["hit_rate"]);
    let gb = 96.0 * 64.0 * 131_072.0 / 1e9;
    assert!((p["capacity_gb"].as_f64().unwrap() - gb).abs() < 1e-9);
    let svg = std::fs::read_to_string(dir.join("sweep.svg")).unwrap();
    for want in [
        "device:host 1:2",
        "L3 100000 pages",
        "llama3-8b",
        "device share of hits",
    ] {
        assert!(svg.contains(want), "plot lacks {want}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A dry run names the workload and its request count once: the chat's name carried its
/// count and the line added it again ("synthetic chat (3200 requests) (3200 requests)").
#[test]
fn a_dry_run_says_the_request_count_once() {
    let dir = temp_dir("dry-run-count");
    let trace = dir.join("two.jsonl");
    std::fs::write(&trace, [line(0, 512, 1), line(5, 1024, 1)].concat()).unwrap();
    for (args, count) in [
        (
            vec!["sim", "--dry-run", "--clients", "3", "--rounds", "2"],
            6,
        ),
        (
            vec!["sim", "--dry-run", "--trace", trace.to_str().unwrap()],
            2,
        ),
    ] {
        let out = kvtier().args(&args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        let said = format!("({count} requests)");
        assert_eq!(text.matches(&said).count(), 1, "{args:?}: {text}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A sweep point with fewer device pages has a shorter context limit and rejects the longest
/// requests: its hit rate and TTFT are of the rest. The table, sweep.json and match-lru said
/// nothing of it (a point that rejected everything printed "0.00 (0 ms / 0 ms)" as if
/// measured, and match-lru interpolated between points that measured different requests).
#[test]
fn sweep_points_say_what_they_rejected_and_match_lru_uses_one_request_set() {
    let dir = temp_dir("sweep-rejected");
    let common = [
        "--sweep",
        "--no-compare",
        "--eviction",
        "lru",
        "--clients",
        "20",
        "--rounds",
        "3",
        "--device-pages",
        "128",
        "--host-pages",
        "128",
        "--l3-pages",
        "4096",
    ];
    let out = succeeds(
        kvtier()
            .args(["sim", "--json"])
            .args(common)
            .arg("--sweep-out")
            .arg(&dir),
    );
    let pts: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let pts = pts.as_array().unwrap();
    let at = |cap: u64| {
        pts.iter()
            .find(|p| p["capacity_pages"] == cap)
            .unwrap_or_else(|| panic!("no {cap}-page point"))
    };
    // 16 device pages (256 tokens): every request is longer.
    assert_eq!(at(32)["requests"], 0);
    assert_eq!(at(32)["rejected"], 60);
    // 32 device pages: the 20 longest are rejected, with their prompt tokens.
    assert_eq!(at(64)["requests"], 40);
    assert_eq!(at(64)["rejected"], 20);
    assert!(at(64)["rejected_prompt_tokens"].as_u64().unwrap() > 0);
    for cap in [128, 256, 512, 1024] {
        assert_eq!(at(cap)["rejected"], 0, "{cap}");
        assert_eq!(at(cap)["requests"], 60, "{cap}");
    }
    // match-lru compares the middle point (128 pages) with points of the same requests only.
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("match-lru.json")).unwrap()).unwrap();
    assert_eq!(m["at_capacity_pages"], 128);
    assert_eq!(m["left_out_capacity_pages"], serde_json::json!([32, 64]));

    let text = kvtier()
        .arg("sim")
        .args(common)
        .arg("--sweep-out")
        .arg(&dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    let row = |cap: &str| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(cap))
            .unwrap_or_else(|| panic!("no {cap} row in\n{text}"))
            .to_string()
    };
    assert!(
        row("32").contains("not measured: all 60 requests rejected"),
        "{text}"
    );
    assert!(!row("32").contains("0.00 (0 ms / 0 ms)"), "{text}");
    assert!(row("64").contains("| 20 ("), "{text}");
    assert!(row("128").contains("| 0"), "{text}");
    assert!(
        text.contains("left out of the match: 32, 64 pages (they rejected other requests)"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// docs/sim.md: the embedded L3 evicts past 0.90 of `--l3-pages` down to 0.80, so a full L3
/// holds 80-90 % of the pages it is given (the medium trace run's 262,144 held 229,111).
#[test]
fn a_full_l3_holds_80_to_90_percent_of_its_pages() {
    let out = succeeds(
        kvtier()
            .args([
                "sim",
                "--json",
                "--quiet",
                "--no-compare",
                "--clients",
                "100",
            ])
            .args(["--rounds", "2", "--no-host", "--device-pages", "256"])
            .args(["--l3-pages", "1000"]),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let held = v["l3_objects"].as_u64().unwrap();
    assert!(
        (800..=900).contains(&held),
        "L3 of 1,000 pages holds {held}"
    );
}

/// With L3 on, a sweep's hit rates include L3 hits while its Belady line is the ceiling of
/// device + host alone (the x axis), so a hit rate can sit above "the ceiling": the legend
/// says so. Without L3 the ceiling is of the same tiers as the hit rate.
#[test]
fn the_sweep_plot_says_its_ceiling_excludes_l3() {
    for (l3, says) in [
        (&["--l3-pages", "4096"][..], true),
        (&["--no-l3"][..], false),
    ] {
        let dir = temp_dir(if says { "sweep-l3" } else { "sweep-no-l3" });
        succeeds(
            kvtier()
                .args([
                    "sim",
                    "--quiet",
                    "--sweep",
                    "--no-compare",
                    "--eviction",
                    "lru",
                ])
                .args(["--clients", "20", "--rounds", "3", "--device-pages", "128"])
                .args(["--host-pages", "128"])
                .args(l3)
                .arg("--sweep-out")
                .arg(&dir),
        );
        let svg = std::fs::read_to_string(dir.join("sweep.svg")).unwrap();
        assert_eq!(
            svg.contains("Belady MIN ceiling, device + host only (excludes L3)"),
            says,
            "{l3:?}"
        );
        assert_eq!(svg.contains("(all tiers, L3 included)"), says, "{l3:?}");
        std::fs::remove_dir_all(&dir).ok();
    }
    let help = kvtier().args(["sim", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("device + host only"), "{help}");
}

/// A trace whose timestamps are wall-clock milliseconds (a production log's, 1.7e12) is the
/// same workload as one starting at 0: the simulated clock starts at the first request.
/// Before, the simulator idled until 1.7e12 ms and divided by it: a throughput of 0 requests
/// a second, and every figure that is a rate over the run with it.
#[test]
fn a_trace_starting_at_a_wall_clock_timestamp_is_the_same_workload() {
    let dir = temp_dir("offset-trace");
    let run = |offset: u64| {
        let trace = dir.join(format!("t{offset}.jsonl"));
        let body: String = (0..40u64)
            .map(|i| {
                line(
                    offset + i * 250,
                    1024 + 512 * (i as usize % 3),
                    10 * (i % 4),
                )
            })
            .collect();
        std::fs::write(&trace, body).unwrap();
        let out = succeeds(
            kvtier()
                .args(["sim", "--json", "--no-compare", "--trace"])
                .arg(&trace),
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["oracle"]["failures"], 0);
        v
    };
    let zero = run(0);
    let wall = run(1_733_500_000_000);
    assert!(
        zero["throughput_requests_per_s"].as_f64().unwrap() > 1.0,
        "{zero}"
    );
    for field in [
        "simulated_seconds",
        "throughput_requests_per_s",
        "throughput_output_tokens_per_s",
        "ttft_ms",
        "hits",
    ] {
        assert_eq!(zero[field], wall[field], "{field}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A run whose every request is rejected (each longer than the context limit) served
/// nothing: its report said hit rates of 0.00 % and TTFT 0.0 / 0.0 / 0.0 ms, as if measured
/// (found by an adversarial tester; a sweep point in that state already said "not
/// measured"). The table now says so; the exit stays 0 (the rejections are the result).
#[test]
fn a_run_that_served_nothing_says_so_instead_of_zero_figures() {
    let dir = temp_dir("all-rejected");
    let trace = dir.join("long.jsonl");
    std::fs::write(
        &trace,
        [line(0, 300_000, 0), line(10, 290_000, 1_000)].concat(),
    )
    .unwrap();
    let s = table_of(&trace);
    assert!(s.contains("rejected") && s.contains("2: "), "{s}");
    for label in ["TTFT p50 / p90 / p99", "total hit rate", "freq-depth"] {
        let row = s
            .lines()
            .find(|l| l.trim_start().starts_with(label))
            .unwrap_or_else(|| panic!("no {label} row: {s}"));
        assert!(
            row.contains("not measured") && !row.contains("0.0"),
            "{row}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
