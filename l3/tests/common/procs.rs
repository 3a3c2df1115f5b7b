//! Real `kvtier-l3` processes on 127.0.0.1 (ephemeral ports) for the split-deployment tests:
//! a master, store nodes, and `eventually` for what the master's sweeper decides.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process, killed (SIGKILL) when dropped.
pub struct Proc {
    pub child: Child,
    pub addr: SocketAddr,
    /// A master's state dir made for it (removed after the process is killed).
    pub state: Option<tempfile::TempDir>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn spawn(args: &[String], token: Option<&str>) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"));
    cmd.args(args)
        .env_remove("KVTIER_L3_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(t) = token {
        cmd.env("KVTIER_L3_TOKEN", t);
    }
    let mut child = cmd.spawn().unwrap();
    let out = child.stdout.take().unwrap();
    let addr = kvtier_l3::cli::read_listening(out).unwrap_or_else(|e| panic!("{e} from {args:?}"));
    Proc {
        child,
        addr,
        state: None,
    }
}

pub fn args(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// A master on an ephemeral port with a state dir of its own.
pub fn master(extra: &[&str], token: Option<&str>) -> Proc {
    let dir = tempfile::tempdir().unwrap();
    let mut p = master_in("127.0.0.1:0", dir.path(), extra, token);
    p.state = Some(dir);
    p
}

/// A master keeping its durable state (settles) in `state` — give the same directory to a
/// restart on the same address.
pub fn master_in(listen: &str, state: &Path, extra: &[&str], token: Option<&str>) -> Proc {
    let mut a = args(&["--state-dir", &state.display().to_string()]);
    a.extend(args(extra));
    master_at(
        listen,
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        token,
    )
}

/// A master with exactly these flags (`--state-dir DIR` or `--no-state-dir` among them).
pub fn master_at(listen: &str, extra: &[&str], token: Option<&str>) -> Proc {
    let mut a = args(&["--role", "master", "--listen", listen]);
    a.extend(args(extra));
    spawn(&a, token)
}

pub fn node(master: SocketAddr, id: u64, ssd: Option<&Path>, token: Option<&str>) -> Proc {
    node_with(master, id, ssd, token, &[])
}

/// A node with extra flags (given after the defaults, so they override them).
pub fn node_with(
    master: SocketAddr,
    id: u64,
    ssd: Option<&Path>,
    token: Option<&str>,
    extra: &[&str],
) -> Proc {
    spawn(&node_args(master, id, ssd, extra), token)
}

/// The command line of [`node_with`].
pub fn node_args(master: SocketAddr, id: u64, ssd: Option<&Path>, extra: &[&str]) -> Vec<String> {
    let mut a = args(&["--role", "node"]);
    for (flag, value) in [
        ("--listen", "127.0.0.1:0"),
        ("--segment-bytes", "16777216"),
        ("--ping-ms", "100"),
    ] {
        if !extra.contains(&flag) {
            a.extend(args(&[flag, value]));
        }
    }
    a.extend(args(extra));
    a.extend(["--master".to_string(), master.to_string()]);
    a.extend(["--node-id".to_string(), id.to_string()]);
    if let Some(d) = ssd {
        a.push("--ssd-dir".into());
        a.push(d.display().to_string());
    }
    a
}

/// Polls `f` until it holds or `limit` passes.
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts a `kvtier-l3` process without waiting for its `LISTENING` line (a node whose
/// mount has not been answered prints nothing yet); its output is discarded.
pub fn spawn_unready(args: &[String]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args(args)
        .env_remove("KVTIER_L3_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Re-runs this test binary as a child running only `test`, with `env` set to `val`, and
/// waits until it prints `KVTIER-CHILD READY` (panics if it ends first).
pub fn test_child(test: &str, env: &str, val: &str) -> Child {
    use std::io::{BufRead, BufReader};
    let mut kid = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(env, val)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = kid.stdout.take().unwrap();
    let ready = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .any(|l| l.contains("KVTIER-CHILD READY"));
    assert!(ready, "the child {test} did not start");
    kid
}

/// SIGKILLs a process and reaps it.
pub fn kill9(p: &mut Child) {
    let ok = Command::new("kill")
        .args(["-KILL", &p.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -KILL failed");
    p.wait().unwrap();
}
