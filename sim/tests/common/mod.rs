//! Fixtures of the `kvtier` command's tests: one set for the crate's CLI test binaries.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;
use std::process::{Command, Output};

/// The `kvtier` binary this crate built.
pub fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

/// A directory under the system's temp dir, named by `tag` and this test process.
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvtier-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `cmd`; it must succeed (its stderr is the failure message).
pub fn succeeds(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    out
}
