//! Every `kvtier` command in docs/sim.md's shell blocks runs (with `--dry-run`: flags, config
//! files and workloads are checked, nothing is simulated), so the documentation cannot drift
//! from the command line. Measured figures in the document name their commands the same way.

use std::path::Path;
use std::process::Command;

/// The `kvtier ...` commands of the ```sh blocks: the `cargo run ... --` prefix, pipes and
/// trailing comments removed.
fn documented_commands(md: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut in_sh = false;
    for line in md.lines() {
        let t = line.trim();
        if t.starts_with("```") {
            in_sh = !in_sh && t == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
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
    let md = std::fs::read_to_string(root.join("docs/sim.md")).unwrap();
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
