//! Bad input an adversarial tester found `kvtier sim` accepting: each is refused with exit 2
//! and a message naming the line or the flag, never a panic, an out-of-memory abort or a
//! report of a different workload than the one asked for.

use std::process::{Command, Output};

mod common;
use common::{kvtier, temp_dir};

/// `kvtier ARGS` with its address space capped at 2 GiB, so a command that would read or
/// build without bound aborts quickly instead of exhausting the machine.
fn kvtier_capped(args: &[&str]) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 2097152; exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .output()
        .unwrap()
}

/// Exit 2, no panic, and stderr naming every one of `want`.
fn assert_refused(out: &Output, want: &[&str], what: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{what}: {err}");
    assert!(!err.contains("panicked"), "{what}: {err}");
    for w in want {
        assert!(err.contains(w), "{what}: stderr lacks {w:?}: {err}");
    }
}

fn line(ts: u64, ids: &[u64]) -> String {
    let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
    format!(
        "{{\"timestamp\": {ts}, \"input_length\": {}, \"output_length\": 3, \"hash_ids\": [{}]}}\n",
        ids.len() * 512,
        ids.join(", ")
    )
}

/// The engine replays requests in arrival order and clamped an earlier arrival to its clock,
/// so a trace whose timestamps go backwards was replayed as a different workload (exit 0).
#[test]
fn a_trace_whose_timestamps_go_backwards_is_refused_naming_the_line() {
    let dir = temp_dir("unsorted");
    let trace = dir.join("unsorted.jsonl");
    // Equal timestamps are in order; line 4 (after a blank line) goes back from 100 to 5.
    let text = [
        line(0, &[1]),
        line(100, &[1, 2]),
        "\n".into(),
        line(5, &[1, 3]),
    ]
    .concat();
    std::fs::write(&trace, text).unwrap();
    let sweep_out = dir.join("sweep");
    let sweep_out = sweep_out.to_str().unwrap();
    for extra in [
        &[][..],
        &["--sweep", "--sweep-out", sweep_out],
        &["--dry-run"],
    ] {
        let mut args = vec!["sim", "--quiet", "--no-compare", "--trace"];
        args.push(trace.to_str().unwrap());
        args.extend_from_slice(extra);
        let out = kvtier().args(&args).output().unwrap();
        assert_refused(
            &out,
            &["unsorted.jsonl", "line 4", "timestamp", "line 2"],
            &format!("{args:?}"),
        );
        assert!(!dir.join("sweep").exists(), "nothing half-written");
    }
    // The same lines in order run.
    let sorted = [line(0, &[1]), line(5, &[1, 3]), line(100, &[1, 2])].concat();
    std::fs::write(&trace, sorted).unwrap();
    let out = kvtier()
        .args(["sim", "--quiet", "--no-compare", "--trace"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `--trace /dev/zero` read one line of NULs for ever (out of memory): a line is read up to
/// a cap, and a line of NULs or of bytes that are not UTF-8 is refused naming it.
#[cfg(unix)]
#[test]
fn a_line_past_the_cap_or_not_text_is_refused() {
    let out = kvtier_capped(&["sim", "--quiet", "--trace", "/dev/zero"]);
    assert_refused(&out, &["/dev/zero", "line 1", "4 MiB"], "/dev/zero");

    let dir = temp_dir("not-text");
    for (name, bad, want) in [
        ("nul.jsonl", &b"\0\0\0\n"[..], "NUL"),
        ("latin1.jsonl", &b"{\"timestamp\": 1, \xff}\n"[..], "UTF-8"),
    ] {
        let trace = dir.join(name);
        let mut text = line(0, &[1]).into_bytes();
        text.extend_from_slice(bad);
        std::fs::write(&trace, text).unwrap();
        let out = kvtier()
            .args(["sim", "--quiet", "--trace"])
            .arg(&trace)
            .output()
            .unwrap();
        assert_refused(&out, &[name, "line 2", want], name);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A sweep point whose configuration the scheduler refuses was skipped without a word: with
/// `--host-admission on-device-eviction:256 --device-pages 1024` the ×1/8 point (128 device
/// pages, fewer than 256 ahead) vanished. It is still left out (the documented two-instance
/// sweeps are measured over the points that can run) but said: on stderr beside `--json`,
/// under the table, and in a dry run.
#[test]
fn a_sweep_point_the_configuration_cannot_run_is_said_to_be_left_out() {
    let dir = temp_dir("sweep-invalid");
    let out_dir = dir.join("out");
    let args = [
        "sim",
        "--quiet",
        "--no-compare",
        "--sweep",
        "--clients",
        "4",
        "--rounds",
        "2",
        "--device-pages",
        "1024",
        "--host-pages",
        "4096",
        "--host-admission",
        "on-device-eviction:256",
    ];
    let want = ["×1/8 point (device 128 / host 512 pages)", "ahead_pages"];
    let json = kvtier()
        .args(args)
        .arg("--json")
        .arg("--sweep-out")
        .arg(&out_dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&json.stderr);
    assert!(json.status.success(), "{err}");
    let pts: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(pts.as_array().unwrap().len(), 5);
    for w in want {
        assert!(err.contains(w), "stderr lacks {w:?}: {err}");
    }
    for extra in [&["--dry-run"][..], &[]] {
        let out = kvtier()
            .args(args)
            .args(extra)
            .arg("--sweep-out")
            .arg(&out_dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{extra:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        for w in want.iter().chain(&["left out"]) {
            assert!(text.contains(w), "{extra:?}: stdout lacks {w:?}: {text}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Every point keeps at least 8 device and 8 host pages, so with small tiers several points
/// were the same capacity: `--device-pages 16 --host-pages 16` gave 16, 16, 16, 32, 64, 128.
#[test]
fn sweep_points_of_the_same_capacity_are_refused() {
    let dir = temp_dir("sweep-same");
    let out_dir = dir.join("out");
    let out = kvtier()
        .args([
            "sim",
            "--quiet",
            "--no-compare",
            "--sweep",
            "--clients",
            "4",
            "--rounds",
            "2",
            "--device-pages",
            "16",
            "--host-pages",
            "16",
            "--dry-run",
            "--sweep-out",
        ])
        .arg(&out_dir)
        .output()
        .unwrap();
    assert_refused(
        &out,
        &["--sweep", "×1/8", "×1/4", "--device-pages"],
        "16 / 16",
    );
    assert!(!out_dir.exists(), "nothing half-written");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--clients 0` or `--rounds 0` made an empty chat workload and a report of zeros (exit 0);
/// `--instances 0` silently ran one instance; `--limit 0` said only "empty workload".
#[test]
fn flags_that_leave_nothing_to_run_are_refused_naming_the_flag() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../traces/synthetic_trace.jsonl"
    );
    for (args, want) in [
        (vec!["sim", "--clients", "0"], "--clients"),
        (vec!["sim", "--rounds", "0"], "--rounds"),
        (vec!["sim", "--clients", "0", "--dry-run"], "--clients"),
        (vec!["sim", "--instances", "0"], "--instances"),
        (vec!["sim", "--trace", trace, "--limit", "0"], "--limit"),
        // a flag of the other workload was ignored: the run was not the one asked for
        (vec!["sim", "--limit", "10"], "--limit"),
        (vec!["sim", "--trace", trace, "--clients", "4"], "--clients"),
        (vec!["sim", "--trace", trace, "--rounds", "2"], "--rounds"),
    ] {
        let out = kvtier().args(&args).output().unwrap();
        assert_refused(&out, &[want], &format!("{args:?}"));
        assert!(out.stdout.is_empty(), "{args:?}: no report");
    }
}

/// A chat workload is built in memory (every turn's prompt is the conversation so far), so
/// `--rounds 100000` allocated without bound (out of memory): it is refused at a cap.
#[cfg(unix)]
#[test]
fn a_chat_workload_past_the_memory_cap_is_refused() {
    for args in [
        ["sim", "--clients", "1", "--rounds", "100000", "--dry-run"],
        [
            "sim",
            "--clients",
            "4000000000",
            "--rounds",
            "8",
            "--dry-run",
        ],
    ] {
        let out = kvtier_capped(&args);
        assert_refused(
            &out,
            &["--clients", "--rounds", "tokens"],
            &format!("{args:?}"),
        );
    }
    // The documentation's largest chat workloads are under the cap.
    for args in [
        ["sim", "--clients", "100", "--rounds", "32", "--dry-run"],
        ["sim", "--clients", "1600", "--rounds", "2", "--dry-run"],
    ] {
        let out = kvtier().args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
    }
}

/// The traces the repository ships (and the public trace beside the checkout, where there is
/// one) are sorted, text, and within the line cap: the new refusals accept every one.
#[test]
fn every_shipped_trace_is_accepted() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut traces: Vec<_> = std::fs::read_dir(root.join("traces"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    assert!(traces.len() >= 4, "{traces:?}");
    let public = root.join("../shared/traces/conversation_trace.jsonl");
    if public.exists() {
        traces.push(public);
    }
    for t in traces {
        let f = std::io::BufReader::new(std::fs::File::open(&t).unwrap());
        let s = kvtier_sim::workload::scan_trace(f, None)
            .unwrap_or_else(|e| panic!("{}: {e}", t.display()));
        assert!(s.requests > 1000, "{}", t.display());
    }
}

/// Flags a run cannot use were ignored and gave a report byte for byte the same as without
/// them: `--ssd-gbps` without an SSD tier, the shadow selector's flags under another eviction
/// policy, L3 flags with L3 off. Each is refused naming the flag and what it needs, as the
/// other workload's flags are.
#[test]
fn flags_the_run_would_ignore_are_refused_naming_the_flag() {
    let cases: Vec<(Vec<&str>, &[&str])> = vec![
        (vec!["--ssd-gbps", "1"], &["--ssd-gbps", "SSD tier"]),
        (
            vec!["--ssd-gbps", "1", "--l3-ssd-pages", "100", "--no-l3"],
            &["--ssd-gbps", "--no-l3"],
        ),
        (
            vec!["--shadow-full-size-pages", "100"],
            &["--shadow-full-size-pages", "--eviction shadow"],
        ),
        (
            vec!["--shadow-sample-salt", "3", "--eviction", "lru"],
            &["--shadow-sample-salt", "--eviction shadow"],
        ),
        (
            vec!["--no-l3", "--prefetch-stop", "best-effort"],
            &["--prefetch-stop", "--no-l3"],
        ),
        (
            vec!["--no-l3", "--prefetch-threshold", "4"],
            &["--prefetch-threshold", "--no-l3"],
        ),
        (
            vec!["--no-l3", "--l3-gbps", "10"],
            &["--l3-gbps", "--no-l3"],
        ),
        (
            vec!["--no-l3", "--l3-link", "duplex"],
            &["--l3-link", "--no-l3"],
        ),
        (
            vec!["--no-l3", "--write-policy", "write-back"],
            &["--write-policy", "--no-l3"],
        ),
        (
            vec!["--no-l3", "--l3-ssd-pages", "100"],
            &["--l3-ssd-pages", "--no-l3"],
        ),
        (
            vec!["--no-l3", "--l3-pages", "100"],
            &["--l3-pages", "--no-l3"],
        ),
    ];
    for (flags, want) in cases {
        let mut args = vec!["sim", "--clients", "2", "--rounds", "1", "--no-compare"];
        args.extend(&flags);
        let out = kvtier().args(&args).output().unwrap();
        assert_refused(&out, want, &format!("{flags:?}"));
        assert!(out.stdout.is_empty(), "{flags:?}: no report");
    }
    // The same flags where the run uses them still run.
    for flags in [
        vec!["--ssd-gbps", "1", "--l3-ssd-pages", "100"],
        vec!["--eviction", "shadow", "--shadow-full-size-pages", "100"],
        vec!["--eviction", "shadow", "--shadow-sample-salt", "3"],
        vec![
            "--prefetch-stop",
            "best-effort",
            "--write-policy",
            "write-back",
        ],
        vec![
            "--prefetch-threshold",
            "4",
            "--l3-gbps",
            "10",
            "--l3-pages",
            "100",
        ],
        vec!["--l3-link", "duplex"],
    ] {
        let mut args = vec![
            "sim",
            "--clients",
            "2",
            "--rounds",
            "1",
            "--no-compare",
            "--quiet",
        ];
        args.extend(&flags);
        let out = kvtier().args(&args).output().unwrap();
        assert!(
            out.status.success(),
            "{flags:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A rate so slow that one transfer or forward takes past 2^64 µs wrapped the simulated clock
/// and the run reported *faster* times: `--pcie-gbps 1e-300` gave TTFT p50 24.2 ms against
/// 28.4 ms at 25 GB/s (exit 0), and a trace stamped 0 and 2^64 - 1 ms claimed its requests
/// ran 18,446,744,073,709 s apart (the clock saturated at 2^64 µs). A clock past its range is
/// an error naming it; no report.
#[test]
fn a_simulated_clock_past_its_range_is_an_error_not_a_faster_run() {
    let small = [
        "sim",
        "--quiet",
        "--no-compare",
        "--clients",
        "20",
        "--rounds",
        "3",
        "--device-pages",
        "64",
        "--host-pages",
        "1024",
    ];
    for slow in [
        ["--pcie-gbps", "1e-300"],
        ["--l3-gbps", "1e-300"],
        ["--prefill-tokens-per-s", "1e-300"],
    ] {
        let out = kvtier().args(small).args(slow).output().unwrap();
        assert_refused(&out, &["clock"], &format!("{slow:?}"));
        assert!(out.stdout.is_empty(), "{slow:?}: no report");
    }
    let dir = temp_dir("clock");
    for last in [u64::MAX, u64::MAX / 1000 - 5] {
        let trace = dir.join(format!("far-{last}.jsonl"));
        std::fs::write(&trace, line(0, &[1, 2]) + &line(last, &[1, 2])).unwrap();
        let out = kvtier()
            .args(["sim", "--quiet", "--no-compare", "--trace"])
            .arg(&trace)
            .output()
            .unwrap();
        assert_refused(&out, &["clock"], &format!("timestamp {last}"));
        assert!(out.stdout.is_empty(), "timestamp {last}: no report");
    }
    // a slow but representable rate still runs, and is slower
    let out = common::succeeds(
        kvtier()
            .args(small)
            .args(["--pcie-gbps", "0.001", "--json"]),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["ttft_ms"]["p50"].as_f64().unwrap() > 1e6,
        "{}",
        v["ttft_ms"]
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A small chat run, nothing beside it.
const SMALL_CHAT: [&str; 7] = [
    "sim",
    "--quiet",
    "--no-compare",
    "--clients",
    "4",
    "--rounds",
    "2",
];

/// The simulator runs each instance as a single-rank engine, but `[scheduler] tp_ranks = 2`
/// was accepted: the first L3 loss report was then refused by the scheduler (a multi-rank
/// scheduler needs the ranks' agreement) and the run printed a whole report before failing
/// with "integrity oracle failed" (exit 2), or, with no loss, ran as one rank and reported it
/// (exit 0, also under `l3_sharing = { Replicated = { leader = 1 } }`, whose rank 0 skips the
/// probes it ran). Refused before the run, naming the key.
#[test]
fn a_tensor_parallel_scheduler_config_is_refused_before_the_run() {
    let dir = temp_dir("tp");
    for (i, table) in [
        "[scheduler]\ntp_ranks = 2\n",
        "[scheduler]\ntp_ranks = 2\nrank = 1\n",
        "[scheduler]\ntp_ranks = 2\nl3_sharing = { Replicated = { leader = 1 } }\n",
    ]
    .iter()
    .enumerate()
    {
        let cfg = dir.join(format!("tp{i}.toml"));
        std::fs::write(&cfg, table).unwrap();
        for dry in [false, true] {
            let mut cmd = kvtier();
            cmd.args(SMALL_CHAT)
                .args([
                    "--device-pages",
                    "64",
                    "--host-pages",
                    "64",
                    "--l3-pages",
                    "64",
                    "--config",
                ])
                .arg(&cfg);
            if dry {
                cmd.arg("--dry-run");
            }
            let out = cmd.output().unwrap();
            assert_refused(&out, &["tp_ranks", "single-rank"], table);
            assert!(out.stdout.is_empty(), "{table}: no report");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `--sweep-out` naming a file (or a path under one) was found unusable only after every
/// point had run (5 s for the default chat, minutes on a trace), with "error: File exists
/// (os error 17)" naming no path; a dry run said the sweep would run. And `--sweep-out`
/// without `--sweep` was ignored (exit 0, nothing written). Both are refused before anything
/// runs, naming the path or the flag; a dry run writes nothing.
#[test]
fn an_unusable_sweep_out_is_refused_before_the_sweep_runs() {
    let dir = temp_dir("sweep-out");
    let file = dir.join("a-file");
    std::fs::write(&file, "").unwrap();
    let chat = [
        "sim",
        "--quiet",
        "--clients",
        "4",
        "--rounds",
        "2",
        "--sweep",
    ];
    for bad in [file.clone(), file.join("sub")] {
        for dry in [true, false] {
            let mut cmd = kvtier();
            cmd.args(chat).arg("--sweep-out").arg(&bad);
            if dry {
                cmd.arg("--dry-run");
            }
            let out = cmd.output().unwrap();
            let what = format!("{} dry {dry}", bad.display());
            assert_refused(&out, &[&bad.display().to_string(), "--sweep-out"], &what);
            assert!(out.stdout.is_empty(), "{what}: nothing ran");
        }
    }
    let fresh = dir.join("fresh/out");
    common::succeeds(
        kvtier()
            .args(chat)
            .arg("--sweep-out")
            .arg(&fresh)
            .arg("--dry-run"),
    );
    assert!(
        !fresh.exists() && !dir.join("fresh").exists(),
        "a dry run writes nothing"
    );
    // the same chat without --sweep
    let out = kvtier()
        .args(&chat[..6])
        .arg("--sweep-out")
        .arg(&fresh)
        .output()
        .unwrap();
    assert_refused(&out, &["--sweep-out", "--sweep"], "--sweep-out alone");
    std::fs::remove_dir_all(&dir).ok();
}

/// Pools are allocated whole, about 5 bytes of bookkeeping per page: `--device-pages
/// 4294967295` (or `--host-pages`) aborted on a failed 17 GB allocation (exit 134, a
/// backtrace) under a 4 GiB address-space cap, and without one took the machine's memory.
/// Device + host pages of all instances are capped; past it, a refusal naming the flags.
#[cfg(unix)]
#[test]
fn pools_past_the_page_cap_are_refused_not_an_allocation_abort() {
    for args in [
        vec!["--device-pages", "4294967295"],
        vec!["--host-pages", "4294967295"],
        vec!["--device-pages", "200000000", "--host-pages", "200000000"],
        vec![
            "--device-pages",
            "100000",
            "--host-pages",
            "100000",
            "--instances",
            "4096",
        ],
    ] {
        let mut full = SMALL_CHAT.to_vec();
        full.extend(&args);
        let out = kvtier_capped(&full);
        assert_refused(
            &out,
            &["device_pages", "host_pages", "instances"],
            &format!("{args:?}"),
        );
    }
    // the documentation's largest pools run
    let out = kvtier_capped(&[
        "sim",
        "--clients",
        "4",
        "--rounds",
        "2",
        "--device-pages",
        "16384",
        "--host-pages",
        "65536",
        "--instances",
        "4",
        "--sweep",
        "--dry-run",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
