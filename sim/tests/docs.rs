//! Every `kvtier` command in the shell blocks of docs/sim.md, docs/sim/policies.md,
//! docs/sim/shadow.md, docs/router.md and docs/router/ (benchmark.md, history.md, whole-traces.md,
//! p99-anatomy.md) runs (with `--dry-run`: flags, config
//! files and workloads are checked, nothing is simulated), so the documentation cannot drift
//! from the command line. Measured figures in the document name their commands the same way.

use std::path::Path;
use std::process::Command;

/// The trimmed lines inside the ```sh blocks of `md`.
fn sh_lines(md: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut in_sh = false;
    for line in md.lines() {
        let t = line.trim();
        if t.starts_with("```") {
            in_sh = !in_sh && t == "```sh";
        } else if in_sh {
            out.push(t);
        }
    }
    out
}

/// The `kvtier ...` commands of the ```sh blocks: the `cargo run ... --` prefix, pipes and
/// trailing comments removed.
fn documented_commands(md: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for t in sh_lines(md) {
        let t = t.split(" # ").next().unwrap_or("").trim();
        let t = t.split(" | ").next().unwrap_or("").trim();
        let t = match t.split_once("--bin kvtier -- ") {
            Some((_, rest)) => rest,
            None => match t.strip_prefix("kvtier ") {
                Some(rest) => rest,
                None => continue,
            },
        };
        out.push(t.split_whitespace().map(String::from).collect());
    }
    out
}

#[test]
fn every_documented_command_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let md: String = [
        "docs/sim.md",
        "docs/sim/policies.md",
        "docs/sim/shadow.md",
        "docs/router.md",
        "docs/router/benchmark.md",
        "docs/router/history.md",
        "docs/router/whole-traces.md",
        "docs/router/p99-anatomy.md",
    ]
    .iter()
    .map(|p| std::fs::read_to_string(root.join(p)).unwrap())
    .collect();
    let cmds = documented_commands(&md);
    assert!(cmds.len() >= 8, "found {} commands", cmds.len());
    for args in cmds {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .current_dir(&root)
            .args(&args)
            .arg("--dry-run")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kvtier {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("dry run:"));
    }
}

/// The `--example NAME` of each `cargo run -p kvtier-sim --example NAME [-- ARGS]` line of
/// the ```sh blocks, with its ARGS.
fn documented_examples(md: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for t in sh_lines(md) {
        if t.starts_with("cargo run ") && t.contains("-p kvtier-sim") {
            let words: Vec<&str> = t.split_whitespace().collect();
            if let Some(i) = words.iter().position(|w| *w == "--example") {
                let name = words.get(i + 1).expect("an example name").to_string();
                let args = match words.iter().position(|w| *w == "--") {
                    Some(d) => words[d + 1..].iter().map(|w| w.to_string()).collect(),
                    None => Vec::new(),
                };
                out.push((name, args));
            }
        }
    }
    out
}

/// For [`small_run`]: the example's own summary row says how many rows follow it.
const ROWS_FROM_SUMMARY: usize = usize::MAX;

/// How the examples test runs each documented example: its arguments (a small scale where the
/// documented run takes minutes) and the number of Markdown table rows it must print.
fn small_run(root: &Path, name: &str, documented: &[String]) -> (Vec<String>, usize) {
    match name {
        "index_memory" => (vec!["--chains-scale".into(), "0.02".into()], 3),
        // The documented run (a second): one row per (workload, instances, load) point of the
        // committed result it annotates.
        "ttft_floor" => {
            let json = root.join(documented.first().expect("ttft_floor names its JSON"));
            let rows: Vec<serde_json::Value> =
                serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
            let points: std::collections::BTreeSet<String> = rows
                .iter()
                .map(|r| format!("{} {} {}", r["workload"], r["instances"], r["load"]))
                .collect();
            (documented.to_vec(), points.len())
        }
        // The first 300 requests (seconds, not a minute): its summary row and one row per
        // request the summary says it lists (`ROWS_FROM_SUMMARY`).
        "p99_anatomy" => {
            let mut args = documented.to_vec();
            match args.get_mut(3) {
                Some(limit) => *limit = "300".into(),
                None => args.push("300".into()),
            }
            (args, ROWS_FROM_SUMMARY)
        }
        other => panic!("the docs name example {other}: give it a small run here"),
    }
}

/// The `--example` commands of docs/router.md, docs/router/benchmark.md, docs/router/history.md,
/// docs/router/whole-traces.md and docs/router/p99-anatomy.md name examples of
/// this package, and each runs (from the repository root) where `cargo test` built it beside
/// this test (it builds every example unless a single target is asked for).
#[test]
fn every_documented_example_exists_and_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut runs = Vec::new();
    for page in [
        "docs/router.md",
        "docs/router/benchmark.md",
        "docs/router/history.md",
        "docs/router/whole-traces.md",
        "docs/router/p99-anatomy.md",
    ] {
        let md = std::fs::read_to_string(root.join(page)).unwrap();
        runs.extend(documented_examples(&md));
    }
    for expected in ["index_memory", "ttft_floor", "p99_anatomy"] {
        assert!(runs.iter().any(|(n, _)| n == expected), "{runs:?}");
    }
    let exe = std::env::current_exe().unwrap();
    let examples = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples");
    for (name, documented) in runs {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("examples/{name}.rs"));
        assert!(src.is_file(), "{} is not there", src.display());
        let (args, expected_rows) = small_run(&root, &name, &documented);
        assert!(expected_rows > 0, "{name}: nothing to check");
        let from_summary = expected_rows == ROWS_FROM_SUMMARY;
        let bin = examples.join(&name);
        if !bin.is_file() {
            eprintln!("{name}: not built beside this test; its source is there");
            continue;
        }
        let out = Command::new(&bin)
            .args(&args)
            .current_dir(&root)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let table: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| workload"))
            .collect();
        let rows = table.len();
        // p99_anatomy: the summary row (first), whose next-to-last cell counts the rows after it
        let expected_rows = if from_summary {
            let cells: Vec<&str> = table.first().expect("a summary row").split('|').collect();
            let listed: usize = cells[cells.len() - 3].trim().parse().expect("a count");
            1 + listed
        } else {
            expected_rows
        };
        assert_eq!(
            rows,
            expected_rows,
            "{name} {args:?}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// Runs `python3 ARGS` in the repository; its stdout (the test fails if it fails).
fn python(root: &Path, args: &[&str]) -> String {
    let out = Command::new("python3")
        .current_dir(root)
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The two traces issue 36 added to the policy matrix are what their documented generator
/// (`python3 scripts/gen_policy_traces.py DIR`, docs/sim/shadow.md) writes, byte for byte.
#[test]
fn the_policy_traces_are_what_their_generator_writes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = std::env::temp_dir().join(format!("kvtier-traces-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    python(
        &root,
        &["scripts/gen_policy_traces.py", dir.to_str().unwrap()],
    );
    for t in ["agent_trace.jsonl", "shift_trace.jsonl"] {
        let made = std::fs::read(dir.join(t)).unwrap();
        let kept = std::fs::read(root.join("traces").join(t)).unwrap();
        assert!(
            made == kept,
            "traces/{t} differs from the generator's output"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The matrix tables of docs/sim/shadow.md are what `scripts/matrix_tables.py` prints from
/// the committed sweeps, every round kept (each table's rows appear in the page as printed).
#[test]
fn the_matrix_tables_are_the_scripts_output() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let page = std::fs::read_to_string(root.join("docs/sim/shadow.md")).unwrap();
    let printed = python(&root, &["scripts/matrix_tables.py"])
        + &python(&root, &["scripts/matrix_tables.py", "--round1"])
        + &python(&root, &["scripts/matrix_tables.py", "--round", "shadow6"])
        + &python(&root, &["scripts/matrix_tables.py", "--round", "shadow8"])
        + &python(
            &root,
            &[
                "scripts/matrix_tables.py",
                "--round",
                "shadow9",
                "--fixed-from",
                "shadow8",
            ],
        )
        + &python(&root, &["scripts/matrix_tables.py", "--protect"]);
    let rows: Vec<&str> = printed.lines().filter(|l| l.starts_with("| ")).collect();
    assert!(rows.len() > 40, "{} rows", rows.len());
    for row in rows {
        assert!(page.contains(row), "not in docs/sim/shadow.md: {row}");
    }
}

/// The reuse tables of docs/sim/shadow.md ("Why recency cannot reach them") are what
/// `scripts/reuse_distance.py` prints from the conversation trace.
#[test]
fn the_reuse_tables_are_the_scripts_output() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let page = std::fs::read_to_string(root.join("docs/sim/shadow.md")).unwrap();
    let printed = python(&root, &["scripts/reuse_distance.py"]);
    let rows: Vec<&str> = printed
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| ---"))
        .collect();
    assert!(rows.len() >= 12, "{} rows", rows.len());
    for row in rows {
        assert!(page.contains(row), "not in docs/sim/shadow.md: {row}");
    }
}
