//! The masters of the deployment under test: one `--role master --state-dir`, or (with
//! `--masters N`, N ≥ 2) N `--role master --etcd` processes on a 3-member etcd cluster this
//! binary starts on loopback, one of them the elected leader.
//!
//! Why a leader-aware fault: a standby that dies changes nothing a client sees; the chaos is
//! in the leader dying (SIGKILL) or hanging (SIGSTOP, later SIGCONT: it finds its lease gone
//! and steps down) while clients, nodes and the loss-journal reader follow it through
//! `etcd://`. The leader is whichever master's address the etcd leader key holds; every
//! master listens on its own fixed port (chosen here), so that address names its process.
//! One etcd member at a time may also be SIGKILLed and restarted on its ports and data dir
//! (two of three keep the quorum).

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::ha::{ClusterKeys, Etcd, read_leader};

/// The etcd cluster name of the chaos deployment.
const CLUSTER: &str = "chaos";

/// Members of the local etcd cluster.
pub const ETCD_MEMBERS: usize = 3;

/// A running `kvtier-l3` process (resumed if paused, then SIGKILLed, when dropped).
pub struct Proc {
    pub child: Child,
}

impl Proc {
    /// Sends `sig` to the process (a child we own).
    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid; it is not reaped before `drop`.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, sig);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Already dead is fine: this is a kill, not a release of anything.
        self.signal(libc::SIGCONT);
        kvtier_l3::error::best_effort("kill a process", self.child.kill());
        kvtier_l3::error::best_effort("reap a process", self.child.wait());
    }
}

/// Where server processes' stderr goes (`--logs`); discarded when unset.
static LOGS: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Sends every server process's stderr to `dir/NAME.log` from now on (appended across
/// restarts, so a fault's effects can be read next to the faults' own log lines).
pub fn log_to(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    LOGS.set(dir.to_path_buf())
        .map_err(|_| "the log dir is set once".to_string())
}

/// Spawns `bin args` with its stdout piped (for `LISTENING`) or discarded; `name` names its
/// log file.
pub fn spawn(bin: &Path, args: &[String], piped: bool, name: &str) -> Result<Proc, String> {
    let stderr = match LOGS.get() {
        Some(d) => {
            let path = d.join(format!("{name}.log"));
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            Stdio::from(f)
        }
        None => Stdio::null(),
    };
    let child = Command::new(bin)
        .args(args)
        .env_remove("KVTIER_L3_TOKEN")
        .stdout(if piped { Stdio::piped() } else { Stdio::null() })
        .stderr(stderr)
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
    Ok(Proc { child })
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// One master of an etcd HA deployment.
struct HaMaster {
    addr: SocketAddr,
    proc: Option<Proc>,
    paused: bool,
    /// The epoch of a predecessor on this address that was leader when this process
    /// started: until its lease runs out the leader key names this address, but this
    /// process is not the leader.
    not_epoch: Option<u64>,
}

/// N masters campaigning on etcd.
pub struct HaMasters {
    etcd: LocalEtcd,
    client: Etcd,
    keys: ClusterKeys,
    masters: Vec<HaMaster>,
    ttl_s: u64,
    client_ttl_ms: u64,
    /// The etcd member SIGKILLed and not restarted yet (never more than one).
    etcd_down: Option<usize>,
}

impl HaMasters {
    /// Starts 3 etcd members and `n` masters; returns once a leader is published.
    pub fn start(bin: &Path, n: usize, ttl_s: u64, client_ttl_ms: u64) -> Result<Self, String> {
        let etcd = LocalEtcd::start(ETCD_MEMBERS).map_err(|e| format!("etcd: {e}"))?;
        let client = etcd.client().map_err(|e| format!("etcd client: {e}"))?;
        let keys = ClusterKeys::new(CLUSTER).map_err(|e| e.to_string())?;
        let mut masters = Vec::with_capacity(n);
        for _ in 0..n {
            let addr = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| format!("a free port: {e}"))?;
            masters.push(HaMaster {
                addr,
                proc: None,
                paused: false,
                not_epoch: None,
            });
        }
        let mut m = HaMasters {
            etcd,
            client,
            keys,
            masters,
            ttl_s,
            client_ttl_ms,
            etcd_down: None,
        };
        for i in 0..n {
            m.start_one(bin, i)?;
        }
        m.leader(Duration::from_secs(30))
            .ok_or("no master was elected in 30 s")?;
        Ok(m)
    }

    /// `etcd://a;b;c/chaos`: what nodes and clients are given.
    pub fn locator(&self) -> String {
        self.etcd.locator(CLUSTER)
    }

    fn start_one(&mut self, bin: &Path, i: usize) -> Result<(), String> {
        let m = &mut self.masters[i];
        let args = strings(&[
            "--role",
            "master",
            "--listen",
            &m.addr.to_string(),
            "--etcd",
            &self.etcd.endpoints(),
            "--cluster",
            CLUSTER,
            "--leader-ttl-s",
            &self.ttl_s.to_string(),
            "--client-ttl-ms",
            &self.client_ttl_ms.to_string(),
            "--lease-ms",
            "500",
        ]);
        // Read before the spawn: an epoch this process wins is created after it.
        m.not_epoch = match read_leader(&self.client, &self.keys) {
            Ok(Some(v)) if v.addr == Some(m.addr) => Some(v.epoch),
            _ => None,
        };
        let name = format!("master-{}", m.addr.port());
        m.proc = Some(spawn(bin, &args, false, &name)?);
        m.paused = false;
        Ok(())
    }

    /// The index of the published leader, waiting up to `limit` (a restarted master whose
    /// dead predecessor's epoch is still published is not the leader).
    pub fn leader(&self, limit: Duration) -> Option<usize> {
        let end = Instant::now() + limit;
        loop {
            if let Ok(Some(v)) = read_leader(&self.client, &self.keys)
                && let Some(a) = v.addr
                && let Some(i) = self.masters.iter().position(|m| m.addr == a)
                && self.masters[i].not_epoch != Some(v.epoch)
            {
                return Some(i);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The running, unpaused leader (none while an election is under way or the leader
    /// is dead or paused).
    pub fn live_leader(&self) -> Option<usize> {
        self.leader(Duration::ZERO)
            .filter(|&i| self.masters[i].proc.is_some() && !self.masters[i].paused)
    }

    /// Whether master `i` is the published leader now, running and not paused.
    pub fn is_live_leader(&self, i: usize) -> bool {
        self.live_leader() == Some(i)
    }

    /// SIGKILLs master `i`.
    pub fn kill(&mut self, i: usize) {
        self.masters[i].proc = None;
        self.masters[i].paused = false;
    }

    /// SIGSTOPs master `i`.
    pub fn pause(&mut self, i: usize) {
        if let Some(p) = &self.masters[i].proc {
            p.signal(libc::SIGSTOP);
            self.masters[i].paused = true;
        }
    }

    /// SIGCONTs master `i` if it is paused (a dead one stays dead).
    pub fn resume(&mut self, i: usize) {
        let m = &mut self.masters[i];
        if let Some(p) = &m.proc
            && m.paused
        {
            p.signal(libc::SIGCONT);
            m.paused = false;
        }
    }

    /// Every paused master resumed.
    pub fn resume_all(&mut self) {
        for i in 0..self.masters.len() {
            self.resume(i);
        }
    }

    /// Brings master `i` back: SIGCONT if paused (it then finds its lease gone and steps
    /// down by itself), a new process on the same address if dead.
    pub fn revive(&mut self, bin: &Path, i: usize) -> Result<(), String> {
        let m = &mut self.masters[i];
        match &m.proc {
            Some(p) => {
                p.signal(libc::SIGCONT);
                m.paused = false;
                Ok(())
            }
            None => self.start_one(bin, i),
        }
    }

    /// The etcd member that is raft leader now, if one answers.
    pub fn etcd_leader(&self) -> Option<usize> {
        self.etcd.leader()
    }

    /// SIGKILLs etcd member `i` unless one is down already; whether it did.
    pub fn kill_etcd(&mut self, i: usize) -> bool {
        if self.etcd_down.is_some() || i >= ETCD_MEMBERS {
            return false;
        }
        self.etcd.kill(i);
        self.etcd_down = Some(i);
        true
    }

    /// Restarts the etcd member that is down (same ports and data dir), if any.
    pub fn restart_etcd(&mut self) -> Result<(), String> {
        if let Some(i) = self.etcd_down {
            self.etcd
                .restart(i)
                .map_err(|e| format!("etcd member {i}: {e}"))?;
            self.etcd_down = None;
        }
        Ok(())
    }

    /// Every master down (SIGKILL).
    pub fn kill_all(&mut self) {
        for i in 0..self.masters.len() {
            self.kill(i);
        }
    }

    /// Every etcd member and master up (and resumed).
    pub fn revive_all(&mut self, bin: &Path) -> Result<(), String> {
        self.restart_etcd()?;
        for i in 0..self.masters.len() {
            self.revive(bin, i)?;
        }
        self.leader(Duration::from_secs(30))
            .map(|_| ())
            .ok_or_else(|| "no master was elected in 30 s after the restart".to_string())
    }
}

/// The single master with a state dir (the default deployment).
pub struct Single {
    pub proc: Option<Proc>,
    pub addr: SocketAddr,
    pub state_dir: PathBuf,
    pub client_ttl_ms: u64,
}

impl Single {
    pub fn start(&mut self, bin: &Path) -> Result<(), String> {
        let args = strings(&[
            "--role",
            "master",
            "--listen",
            &self.addr.to_string(),
            "--state-dir",
            &self.state_dir.display().to_string(),
            "--client-ttl-ms",
            &self.client_ttl_ms.to_string(),
            "--lease-ms",
            "500",
        ]);
        let mut p = spawn(bin, &args, true, "master")?;
        let out = p.child.stdout.take().ok_or("no stdout")?;
        let addr = kvtier_l3::cli::read_listening(out).map_err(|e| format!("{e} from {args:?}"))?;
        self.proc = Some(p);
        self.addr = addr;
        Ok(())
    }
}
