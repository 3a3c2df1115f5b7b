//! An etcd HA deployment of real processes: 3 etcd members, several `kvtier-l3 --role
//! master --etcd` (each on a port chosen here, so the leader's address names its process),
//! store nodes with SSD tiers following the leader through `etcd://`.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::ha::{ClusterKeys, Locator, read_leader};
use std::collections::BTreeMap;

use kvtier_l3::{ClientOptions, L3Error, L3Store, RemoteStore, Tenant};

use super::procs::{Proc, args, spawn};

pub const CLUSTER: &str = "t";

pub fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

pub struct HaMaster {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Drop for HaMaster {
    fn drop(&mut self) {
        signal(&self.child, libc::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `sig` to `c`. A SIGSTOP returns once every thread of `c` is stopped (at most 5 s):
/// kill(2) only starts the stop, and a node still running for a moment after it answered a
/// call the test issued next ("a paused node answered a get", about 1 run in 8 on a loaded
/// 2-core machine; its first `/proc` read after kill(2) showed it not yet stopped).
pub fn signal(c: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on a child we own.
    unsafe {
        libc::kill(c.id() as libc::pid_t, sig);
    }
    if sig == libc::SIGSTOP {
        let end = Instant::now() + Duration::from_secs(5);
        while !all_threads_stopped(c.id()) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Whether every thread of process `pid` is in state T (stopped), from `/proc`.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true; // gone: nothing runs
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .map(|s| s.rsplit(") ").next().is_some_and(|r| r.starts_with('T')))
            .unwrap_or(true)
    })
}

/// Flags of every master of the test cluster.
pub fn master_flags(etcd: &LocalEtcd, listen: SocketAddr, ttl_s: u64) -> Vec<String> {
    args(&[
        "--role",
        "master",
        "--listen",
        &listen.to_string(),
        "--etcd",
        &etcd.endpoints(),
        "--cluster",
        CLUSTER,
        "--leader-ttl-s",
        &ttl_s.to_string(),
        "--client-ttl-ms",
        "5000",
        "--rebuild-timeout-ms",
        "15000",
    ])
}

pub fn spawn_master(etcd: &LocalEtcd, listen: SocketAddr, ttl_s: u64) -> HaMaster {
    spawn_master_with(etcd, listen, ttl_s, &[])
}

/// A master with flags of its own besides [`master_flags`].
pub fn spawn_master_with(
    etcd: &LocalEtcd,
    listen: SocketAddr,
    ttl_s: u64,
    extra: &[&str],
) -> HaMaster {
    spawn_master_token(etcd, listen, ttl_s, extra, None)
}

/// A master given `token` through `KVTIER_L3_TOKEN` (None: no token at all).
pub fn spawn_master_token(
    etcd: &LocalEtcd,
    listen: SocketAddr,
    ttl_s: u64,
    extra: &[&str],
    token: Option<&str>,
) -> HaMaster {
    spawn_master_exe(
        std::path::Path::new(env!("CARGO_BIN_EXE_kvtier-l3")),
        etcd,
        listen,
        ttl_s,
        extra,
        token,
    )
}

/// A master run from the executable `exe` (a copy of the binary the test may replace).
pub fn spawn_master_exe(
    exe: &std::path::Path,
    etcd: &LocalEtcd,
    listen: SocketAddr,
    ttl_s: u64,
    extra: &[&str],
    token: Option<&str>,
) -> HaMaster {
    let mut cmd = Command::new(exe);
    cmd.args(master_flags(etcd, listen, ttl_s))
        .args(extra)
        .env_remove("KVTIER_L3_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(t) = token {
        cmd.env("KVTIER_L3_TOKEN", t);
    }
    let child = cmd.spawn().unwrap();
    HaMaster {
        child,
        addr: listen,
    }
}

/// The published leader (address, epoch), waiting up to `limit`.
pub fn leader(etcd: &LocalEtcd, limit: Duration) -> Option<(SocketAddr, u64)> {
    let c = etcd.client().ok()?;
    let keys = ClusterKeys::new(CLUSTER).unwrap();
    let end = Instant::now() + limit;
    loop {
        if let Ok(Some(v)) = read_leader(&c, &keys)
            && let Some(a) = v.addr
        {
            return Some((a, v.epoch));
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A store node following the leader.
pub fn ha_node(etcd: &LocalEtcd, id: u64, ssd: &Path) -> Proc {
    let mut a = ha_node_args(etcd, id, 100);
    a.extend(args(&["--ssd-dir", &ssd.display().to_string()]));
    spawn(&a, None)
}

/// A store node following the leader, without an SSD tier (its objects live in DRAM only),
/// pinging every `ping_ms`.
pub fn ha_dram_node(etcd: &LocalEtcd, id: u64, ping_ms: u64) -> Proc {
    ha_dram_node_token(etcd, id, ping_ms, None)
}

/// [`ha_dram_node`] presenting `token` to the master.
pub fn ha_dram_node_token(etcd: &LocalEtcd, id: u64, ping_ms: u64, token: Option<&str>) -> Proc {
    spawn(&ha_node_args(etcd, id, ping_ms), token)
}

fn ha_node_args(etcd: &LocalEtcd, id: u64, ping_ms: u64) -> Vec<String> {
    args(&[
        "--role",
        "node",
        "--listen",
        "127.0.0.1:0",
        "--segment-bytes",
        "16777216",
        "--ping-ms",
        &ping_ms.to_string(),
        "--master-timeout-ms",
        "1000",
        "--master",
        &etcd.locator(CLUSTER),
        "--node-id",
        &id.to_string(),
    ])
}

/// A client following the leader.
pub fn ha_client(etcd: &LocalEtcd) -> RemoteStore {
    ha_client_token(etcd, None).unwrap()
}

/// A client following the leader, presenting `token` in its hellos.
pub fn ha_client_token(etcd: &LocalEtcd, token: Option<&str>) -> Result<RemoteStore, L3Error> {
    RemoteStore::connect_to(
        Locator::parse(&etcd.locator(CLUSTER)).unwrap(),
        ClientOptions {
            failover_timeout: Duration::from_secs(30),
            leader_call_timeout: Duration::from_millis(1000),
            token: token.map(str::to_string),
            ..Default::default()
        },
    )
}

/// A running HA deployment: 3 etcd members, `masters` masters (1 s lease), 3 store nodes with
/// SSD tiers following the leader. Dropped in field order: processes first, etcd last.
pub struct HaCluster {
    pub masters: Vec<HaMaster>,
    pub nodes: Vec<Proc>,
    pub ssd: Vec<tempfile::TempDir>,
    pub etcd: LocalEtcd,
}

pub fn ha_cluster(masters: usize) -> HaCluster {
    let etcd = LocalEtcd::start(3).unwrap();
    let masters: Vec<HaMaster> = (0..masters)
        .map(|_| spawn_master(&etcd, free_addr(), 1))
        .collect();
    leader(&etcd, Duration::from_secs(20)).expect("a leader");
    let ssd: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let nodes = (0..3)
        .map(|i| ha_node(&etcd, i as u64 + 1, ssd[i].path()))
        .collect();
    HaCluster {
        masters,
        nodes,
        ssd,
        etcd,
    }
}

/// Every acknowledged put in `live` reads back with its bytes; no key in `removed` is back.
pub fn check_keys(
    c: &RemoteStore,
    tn: &Tenant,
    live: &BTreeMap<String, Vec<u8>>,
    removed: &[String],
) {
    for (k, v) in live {
        let got = c
            .get(tn, k)
            .unwrap_or_else(|e| panic!("acked put {k} lost: {e}"));
        assert_eq!(&got, v, "{k} read back other bytes");
    }
    for k in removed {
        match c.get(tn, k) {
            Ok(v) => panic!("removed {k} came back ({} bytes)", v.len()),
            Err(e) => assert_eq!(e, L3Error::ObjectNotFound, "{k}"),
        }
    }
}
