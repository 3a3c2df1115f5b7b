//! [`LocalEtcd`]: a real etcd cluster of N members on 127.0.0.1 (ephemeral ports, a temp
//! data dir), for the failover tests, `l3-bench --only failover` and the docs' example.
//!
//! Why in the library: the tests, the benchmark and the HA example all need the same thing —
//! Debian's `etcd` binary started as separate processes, a quorum awaited, members killed,
//! paused and restarted by PID, and everything stopped when dropped — and one copy of it
//! keeps them honest. Short heartbeat/election timeouts (50/500 ms) make an etcd leader
//! loss cost half a second instead of etcd's default second.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::etcd::Etcd;
use crate::error::{L3Error, L3Result};

struct Member {
    name: String,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

/// A local etcd cluster; its processes are SIGKILLed and its data removed on drop.
pub struct LocalEtcd {
    members: Vec<Member>,
    dir: PathBuf,
    initial: String,
}

/// Where member ports are picked: below the kernel's default ephemeral range (32768 and up).
/// A port `bind(0)` hands out is free only until the listener is closed; before the member
/// binds it, an outgoing connection (etcd members dial each other; other tests run beside)
/// may take it, and the member then fails to start. Ports here are not handed out for
/// outgoing connections by default; a clash left (another test picked the same one) is
/// caught by [`LocalEtcd::start`], which starts the cluster again.
const PORTS: std::ops::Range<u32> = 20_000..32_000;

fn free_port() -> L3Result<u16> {
    use std::hash::{BuildHasher, Hasher};
    for _ in 0..256 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let p = PORTS.start + (h.finish() % u64::from(PORTS.end - PORTS.start)) as u32;
        let p = u16::try_from(p).map_err(|e| L3Error::Internal(e.to_string()))?;
        if TcpListener::bind(("127.0.0.1", p)).is_ok() {
            return Ok(p);
        }
    }
    let l = TcpListener::bind("127.0.0.1:0")
        .map_err(|e| L3Error::Internal(format!("bind a free port: {e}")))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| L3Error::Internal(e.to_string()))
}

/// Attempts of [`LocalEtcd::start`], each with a fresh data dir and fresh ports.
const START_ATTEMPTS: usize = 3;

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on the PID of a child this struct owns and has not reaped.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

impl LocalEtcd {
    /// Starts `n` members (the `etcd` binary on PATH, or `$KVTIER_ETCD_BIN`) and waits for
    /// a quorum with a leader.
    /// A cluster that fails to elect a leader (a member could not bind its port, or exited)
    /// is stopped and started again on new ports, up to [`START_ATTEMPTS`] times.
    pub fn start(n: usize) -> L3Result<Self> {
        if n == 0 {
            return Err(L3Error::InvalidParams(
                "an etcd cluster needs a member".into(),
            ));
        }
        let mut last = L3Error::Unavailable("etcd not started".into());
        for attempt in 1..=START_ATTEMPTS {
            match Self::start_once(n) {
                Ok(me) => return Ok(me),
                Err(e @ L3Error::Unavailable(_)) if attempt < START_ATTEMPTS => {
                    tracing::warn!(error = %e, attempt, "local etcd did not come up; again");
                    last = e;
                }
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    fn start_once(n: usize) -> L3Result<Self> {
        static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvtier-etcd-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        // A dir of the same name is a leftover of an earlier process with this pid (killed
        // before its drop): its members' data would belong to another cluster.
        if dir.exists() {
            crate::error::best_effort("remove a stale etcd dir", std::fs::remove_dir_all(&dir));
        }
        std::fs::create_dir_all(&dir)
            .map_err(|e| L3Error::Internal(format!("{}: {e}", dir.display())))?;
        let mut members = Vec::new();
        for i in 0..n {
            members.push(Member {
                name: format!("m{i}"),
                client: free_port()?,
                peer: free_port()?,
                child: None,
            });
        }
        let initial = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut me = LocalEtcd {
            members,
            dir,
            initial,
        };
        for i in 0..n {
            me.spawn(i)?;
        }
        // As `wait_leader`, but a member that exited (its port was taken) fails at once.
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            if me.leader().is_some() {
                return Ok(me);
            }
            if me.members.iter_mut().any(|m| {
                m.child
                    .as_mut()
                    .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))))
            }) {
                return Err(L3Error::Unavailable(
                    "an etcd member exited at start".into(),
                ));
            }
            if Instant::now() >= end {
                return Err(L3Error::Unavailable("etcd elected no leader".into()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn spawn(&mut self, i: usize) -> L3Result<()> {
        let bin = std::env::var("KVTIER_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
        let m = &self.members[i];
        let data = self.dir.join(&m.name);
        let client = format!("http://127.0.0.1:{}", m.client);
        let peer = format!("http://127.0.0.1:{}", m.peer);
        let child = Command::new(&bin)
            .args(["--name", &m.name, "--data-dir"])
            .arg(&data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial])
            .args(["--initial-cluster-state", "new"])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                L3Error::Unavailable(format!(
                    "cannot start {bin:?} ({e}): install etcd (Debian: apt-get install etcd-server)"
                ))
            })?;
        self.members[i].child = Some(child);
        Ok(())
    }

    /// `127.0.0.1:p,…` of every member (for `kvtier-l3 --etcd`).
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `etcd://a;b;c/CLUSTER`: the locator clients and nodes follow the leader with.
    pub fn locator(&self, cluster: &str) -> String {
        let eps: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client))
            .collect();
        format!("etcd://{}/{cluster}", eps.join(";"))
    }

    /// A client of the whole cluster.
    pub fn client(&self) -> L3Result<Etcd> {
        Etcd::parse(&self.endpoints(), Duration::from_millis(500))
    }

    /// The member that is etcd's raft leader now, if one answers.
    pub fn leader(&self) -> Option<usize> {
        let mut ids = Vec::new();
        let mut leader = None;
        for m in &self.members {
            let one = Etcd::parse(
                &format!("127.0.0.1:{}", m.client),
                Duration::from_millis(300),
            )
            .ok()?;
            let st = one.status().ok();
            ids.push(st.as_ref().map(|s| s.0));
            if let Some((_, l)) = st
                && l != 0
            {
                leader = Some(l);
            }
        }
        let l = leader?;
        ids.iter().position(|id| *id == Some(l))
    }

    /// Waits until a member reports a leader.
    pub fn wait_leader(&self, limit: Duration) -> L3Result<usize> {
        let end = Instant::now() + limit;
        loop {
            if let Some(i) = self.leader() {
                return Ok(i);
            }
            if Instant::now() >= end {
                return Err(L3Error::Unavailable("etcd elected no leader".into()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            crate::error::best_effort("kill an etcd member", c.kill());
            crate::error::best_effort("reap an etcd member", c.wait());
        }
    }

    /// Starts member `i` again on its data dir (after [`LocalEtcd::kill`]).
    pub fn restart(&mut self, i: usize) -> L3Result<()> {
        self.kill(i);
        self.spawn(i)
    }

    /// SIGSTOPs member `i`.
    pub fn pause(&self, i: usize) {
        if let Some(c) = &self.members[i].child {
            signal(c, libc::SIGSTOP);
            // SIGSTOP takes effect when the member is next scheduled: on a loaded machine it
            // may still answer a request sent right after kill(2) returns. Wait (at most a
            // second) until the kernel shows it stopped.
            let stat = format!("/proc/{}/stat", c.id());
            for _ in 0..200 {
                let stopped = std::fs::read_to_string(&stat).is_ok_and(|s| {
                    s.rsplit_once(')')
                        .is_some_and(|(_, rest)| rest.trim_start().starts_with(['T', 't']))
                });
                if stopped {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
    }

    /// SIGCONTs member `i`.
    pub fn resume(&self, i: usize) {
        if let Some(c) = &self.members[i].child {
            signal(c, libc::SIGCONT);
        }
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.resume(i);
            self.kill(i);
        }
        crate::error::best_effort(
            "remove the etcd data dir",
            std::fs::remove_dir_all(&self.dir),
        );
    }
}
