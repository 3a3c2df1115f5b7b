//! SIGTERM at any moment after a server said `LISTENING` shuts it down cleanly (exit 0, after
//! its flush), for every role. A supervisor (systemd, Kubernetes, a test) may stop a server the
//! instant it reports ready; the handler must already be installed by then, or the default
//! disposition kills the process without the SSD flush.

mod common;
use common::procs::{args, master, spawn};

fn term_at_once(a: &[String]) {
    let mut p = spawn(a, None);
    // SAFETY: kill(2) on a child we own and have not reaped.
    let rc = unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
    assert_eq!(rc, 0);
    let status = p.child.wait().unwrap();
    assert!(status.success(), "{a:?}: {status:?}");
}

#[test]
fn sigterm_right_after_listening_is_a_clean_shutdown_for_every_role() {
    let seg = ["--segment-bytes", "1048576"];
    for _ in 0..8 {
        let mut both = args(&["--role", "both", "--listen", "127.0.0.1:0"]);
        both.extend(args(&seg));
        term_at_once(&both);
        let state = tempfile::tempdir().unwrap();
        let mut master = args(&["--role", "master", "--listen", "127.0.0.1:0", "--state-dir"]);
        master.push(state.path().display().to_string());
        term_at_once(&master);
        term_at_once(&args(&[
            "--role",
            "master",
            "--listen",
            "127.0.0.1:0",
            "--no-state-dir",
        ]));
    }
    let m = master(&[], None);
    for id in 1..=8u64 {
        let mut node = args(&["--role", "node", "--listen", "127.0.0.1:0", "--node-id"]);
        node.push(id.to_string());
        node.extend(args(&seg));
        node.extend(["--master".to_string(), m.addr.to_string()]);
        term_at_once(&node);
    }
}
