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

/// A SIGTERM the kernel delivers to the KV-event publisher's thread (a process-directed
/// signal lands on any thread) interrupts its poll: the thread took that for an error and
/// exited, and the shutdown then blocked for ever handing it the stop message. tgkill makes
/// the unlucky delivery certain; the server must still exit 0 promptly.
#[test]
fn sigterm_landing_on_the_event_publishers_thread_still_shuts_down() {
    for _ in 0..3 {
        let a = args(&[
            "--listen",
            "127.0.0.1:0",
            "--no-shm",
            "--kv-events",
            "tcp://127.0.0.1:*",
        ]);
        let mut p = spawn(&a, None);
        let pid = p.child.id() as i32;
        let publisher = || {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .ok()?
                .filter_map(|t| t.ok())
                .find(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim() == "kvtier-events")
                })
                .and_then(|t| t.file_name().to_str()?.parse::<i32>().ok())
        };
        // the stream starts beside the listener: wait for its thread
        let tid = (0..100)
            .find_map(|_| {
                publisher().or_else(|| {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    None
                })
            })
            .expect("the publisher's thread");
        // SAFETY: tgkill(2) on a thread of a child we own and have not reaped.
        let rc = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGTERM) };
        assert_eq!(rc, 0);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let status = loop {
            if let Some(s) = p.child.try_wait().unwrap() {
                break s;
            }
            if std::time::Instant::now() > deadline {
                p.child.kill().unwrap();
                panic!("still running 20 s after SIGTERM reached the publisher's thread");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert!(status.success(), "{status:?}");
    }
}
