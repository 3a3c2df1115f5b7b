//! Flags that would start a server no client can use are refused at start (exit 2, before
//! `LISTENING`): a frame too small for any request, an SSD tier of no bytes, an empty shared
//! secret (a client sending the empty token was admitted).

use std::process::{Command, Stdio};

fn exit_code(args: &[&str], env_token: Option<&str>) -> Option<i32> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"));
    cmd.args(["--listen", "127.0.0.1:0", "--segment-bytes", "1048576"])
        .args(args)
        .env_remove("KVTIER_L3_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(t) = env_token {
        cmd.env("KVTIER_L3_TOKEN", t);
    }
    let mut child = cmd.spawn().unwrap();
    // a server that started is a failure of this test: give it a moment, then stop it
    for _ in 0..100 {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code();
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    None
}

#[test]
fn flags_that_leave_a_useless_server_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    let empty = dir.path().join("token");
    std::fs::write(&empty, " \n").unwrap();
    let ssd = ssd.to_str().unwrap();
    let empty = empty.to_str().unwrap();
    for (args, env) in [
        (vec!["--max-frame", "0"], None),
        (vec!["--max-frame", "1"], None),
        (vec!["--max-frame", "4096"], None),
        (vec!["--ssd-dir", ssd, "--ssd-capacity", "0"], None),
        (vec!["--token-file", empty], None),
        (vec![], Some("")),
        (vec![], Some("  ")),
    ] {
        assert_eq!(exit_code(&args, env), Some(2), "{args:?} token {env:?}");
    }
}
