//! Scenario `failover`: master failover on etcd. Real processes: 3 etcd members, 3
//! `kvtier-l3 --role master --etcd` (lease TTL `--leader-ttl-s`), 3 store nodes with SSD
//! tiers, 2 clients following the leader through `etcd://`. The leader is SIGKILLed
//! `--kills` times (restarted as a standby after each); per kill: time to a new leader
//! published in etcd, and to each client's first successful call (a get of a persisted key);
//! after each, every acknowledged put is read back (a miss is a loss), those acknowledged
//! with `wait_persisted` and those acknowledged from DRAM alone (the nodes keep their DRAM
//! replicas across the remount and the new leader adopts them) counted apart. Put and get
//! throughput of 64 KiB objects before the first kill and after the last, as a ratio.
//!
//! Why these clocks: "published" is when a client *can* find the new leader; "first success"
//! includes the rebuild gate (every node remounted and reported) and the client's own
//! re-resolution — what an engine sees. Goal: first success within 2 × TTL, nothing lost.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::ha::{ClusterKeys, Locator, read_leader};
use kvtier_l3::{ClientOptions, L3Store, PutOptions, RemoteStore};

use super::{R, payload, row, serde_row, start_proc, tenant};

const OBJ: usize = 64 << 10;
const KEYS: usize = 64;
const CLUSTER: &str = "bench";

struct Master {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Master {
    fn drop(&mut self) {
        kvtier_l3::error::best_effort("kill a process", self.child.kill());
        kvtier_l3::error::best_effort("reap a process", self.child.wait());
    }
}

fn free_addr() -> R<SocketAddr> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())
}

fn master(bin: &Path, etcd: &LocalEtcd, addr: SocketAddr, ttl_s: u64) -> R<Master> {
    let child = Command::new(bin)
        .args(["--role", "master", "--listen", &addr.to_string()])
        .args(["--etcd", &etcd.endpoints(), "--cluster", CLUSTER])
        .args([
            "--leader-ttl-s",
            &ttl_s.to_string(),
            "--client-ttl-ms",
            "5000",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
    Ok(Master { child, addr })
}

fn leader(etcd: &LocalEtcd, after: u64, limit: Duration) -> R<(SocketAddr, u64)> {
    let c = etcd.client().map_err(|e| e.to_string())?;
    let keys = ClusterKeys::new(CLUSTER).map_err(|e| e.to_string())?;
    let end = Instant::now() + limit;
    loop {
        if let Ok(Some(v)) = read_leader(&c, &keys)
            && let Some(a) = v.addr
            && v.epoch > after
        {
            return Ok((a, v.epoch));
        }
        if Instant::now() >= end {
            return Err(format!("no leader after epoch {after}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The `p` quantile (NaN for no sample: `--kills 0` measures only the throughput drift).
fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Put then get throughput (objects/s) of `KEYS` × 64 KiB under fresh keys: the median of
/// `TP_PASSES` passes (one pass is tens of milliseconds: a single one is noise here).
fn throughput(c: &RemoteStore, tag: &str) -> R<(f64, f64)> {
    let (mut puts, mut gets) = (Vec::new(), Vec::new());
    for pass in 0..TP_PASSES {
        let (p, g) = throughput_pass(c, &format!("{tag}-{pass}"))?;
        puts.push(p);
        gets.push(g);
    }
    Ok((pct(&mut puts, 0.5), pct(&mut gets, 0.5)))
}

const TP_PASSES: usize = 9;

fn throughput_pass(c: &RemoteStore, tag: &str) -> R<(f64, f64)> {
    // Each pass starts with the nodes' SSD queues drained: the write-through copies of the
    // previous pass must not slow this one (without this, "after" ran at 0.3 x "before"
    // even with no kill at all).
    c.flush().map_err(|e| e.to_string())?;
    let t = tenant();
    let keys: Vec<String> = (0..KEYS).map(|i| format!("tp-{tag}-{i}")).collect();
    let data = payload(7, OBJ);
    let t0 = Instant::now();
    for k in &keys {
        c.put(&t, k, &data, PutOptions::default())
            .map_err(|e| e.to_string())?;
    }
    let put = KEYS as f64 / t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for k in &keys {
        if c.get(&t, k).map_err(|e| e.to_string())? != data {
            return Err(format!("{k}: other bytes"));
        }
    }
    Ok((put, KEYS as f64 / t0.elapsed().as_secs_f64()))
}

pub fn failover(bin: &Path, kills: usize, ttl_s: u64, rows: &mut Vec<serde_row::Row>) -> R<()> {
    let etcd = LocalEtcd::start(3).map_err(|e| e.to_string())?;
    let mut masters = Vec::new();
    for _ in 0..3 {
        masters.push(master(bin, &etcd, free_addr()?, ttl_s)?);
    }
    let (_, mut epoch) = leader(&etcd, 0, Duration::from_secs(30))?;
    let ssd = std::env::temp_dir().join(format!("kvtier-l3-bench-ha-{}", std::process::id()));
    let _cleanup = super::replicas::RemoveOnDrop(ssd.clone());
    let locator = etcd.locator(CLUSTER);
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let dir = ssd.join(id.to_string()).display().to_string();
        let id = id.to_string();
        nodes.push(start_proc(
            bin,
            &[
                "--role",
                "node",
                "--master",
                &locator,
                "--node-id",
                &id,
                "--listen",
                "127.0.0.1:0",
                "--segment-bytes",
                "268435456",
                "--ping-ms",
                "100",
                "--master-timeout-ms",
                "1000",
                "--ssd-dir",
                &dir,
            ],
        )?);
    }
    let opts = ClientOptions {
        failover_timeout: Duration::from_secs(60),
        leader_call_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let connect = || -> R<Arc<RemoteStore>> {
        let loc = Locator::parse(&locator).map_err(|e| e.to_string())?;
        Ok(Arc::new(
            RemoteStore::connect_to(loc, opts.clone()).map_err(|e| e.to_string())?,
        ))
    };
    let clients = [connect()?, connect()?];
    let t = tenant();
    let persisted = PutOptions {
        wait_persisted: true,
        ..Default::default()
    };
    let mut acked = Vec::new();
    for i in 0..KEYS {
        let k = format!("kept-{i}");
        clients[0]
            .put(&t, &k, &payload(i, OBJ), persisted)
            .map_err(|e| e.to_string())?;
        acked.push((k, payload(i, OBJ)));
    }
    // Acknowledged once in DRAM (their SSD copies may still be queued at a kill).
    let mut unpersisted = Vec::new();
    for i in 0..KEYS {
        let k = format!("dram-{i}");
        let d = payload(KEYS + i, OBJ);
        clients[0]
            .put(&t, &k, &d, PutOptions::default())
            .map_err(|e| e.to_string())?;
        unpersisted.push((k, d));
    }
    let before = throughput(&clients[0], "before")?;
    let (mut to_leader, mut to_first) = (Vec::new(), Vec::new());
    let (mut lost, mut lost_unpersisted) = (0usize, 0usize);
    for kill in 0..kills {
        let (laddr, _) = leader(&etcd, epoch - 1, Duration::from_secs(5))?;
        let v = masters
            .iter()
            .position(|m| m.addr == laddr)
            .ok_or("the leader is no master of ours")?;
        let t0 = Instant::now();
        kvtier_l3::error::best_effort("kill the leader", masters[v].child.kill());
        kvtier_l3::error::best_effort("reap the leader", masters[v].child.wait());
        let probes: Vec<_> = clients
            .iter()
            .map(|c| {
                let c = c.clone();
                let key = acked[kill % KEYS].0.clone();
                std::thread::spawn(move || {
                    let r = c.get(&tenant(), &key);
                    (r.is_ok(), t0.elapsed())
                })
            })
            .collect();
        let (_, e) = leader(&etcd, epoch, Duration::from_secs(60))?;
        to_leader.push(t0.elapsed().as_secs_f64() * 1e3);
        epoch = e;
        for p in probes {
            let (ok, dt) = p.join().map_err(|_| "probe thread panicked")?;
            if !ok {
                return Err(format!("kill {kill}: a client found no leader in 60 s"));
            }
            to_first.push(dt.as_secs_f64() * 1e3);
        }
        masters[v] = master(bin, &etcd, laddr, ttl_s)?;
        for (list, n) in [(&acked, &mut lost), (&unpersisted, &mut lost_unpersisted)] {
            for (k, d) in list {
                match clients[1].get(&t, k) {
                    Ok(got) if &got == d => {}
                    _ => *n += 1,
                }
            }
        }
    }
    let after = throughput(&clients[0], "after")?;
    let goal = 2.0 * ttl_s as f64 * 1e3;
    let n = format!("{kills} kills, TTL {ttl_s} s");
    let (l50, lmax) = (pct(&mut to_leader, 0.5), pct(&mut to_leader, 1.0));
    let (f50, fmax) = (pct(&mut to_first, 0.5), pct(&mut to_first, 1.0));
    rows.push(row(
        "failover: kill -> new leader published p50",
        l50,
        "ms",
        &n,
        "(info)",
        true,
    ));
    rows.push(row(
        "failover: kill -> new leader published max",
        lmax,
        "ms",
        &n,
        "(info)",
        true,
    ));
    rows.push(row(
        "failover: kill -> each client's 1st success p50",
        f50,
        "ms",
        &n,
        "<= 2 x TTL",
        f50 <= goal,
    ));
    rows.push(row(
        "failover: kill -> each client's 1st success max",
        fmax,
        "ms",
        &n,
        "<= 2 x TTL",
        fmax <= goal,
    ));
    rows.push(row(
        "failover: persisted puts lost",
        lost as f64,
        "keys",
        &format!("{} keys x {kills} checks", KEYS),
        "0",
        lost == 0,
    ));
    rows.push(row(
        "failover: puts acked from DRAM lost",
        lost_unpersisted as f64,
        "keys",
        &format!("{} keys x {kills} checks", KEYS),
        "0",
        lost_unpersisted == 0,
    ));
    rows.push(row(
        "failover: put 64 KiB before",
        before.0,
        "obj/s",
        "same run",
        "(info)",
        true,
    ));
    rows.push(row(
        "failover: put after / before",
        after.0 / before.0,
        "x",
        "same run",
        ">= 0.8",
        after.0 / before.0 >= 0.8,
    ));
    rows.push(row(
        "failover: get 64 KiB before",
        before.1,
        "obj/s",
        "same run",
        "(info)",
        true,
    ));
    rows.push(row(
        "failover: get after / before",
        after.1 / before.1,
        "x",
        "same run",
        ">= 0.8",
        after.1 / before.1 >= 0.8,
    ));
    drop(nodes);
    Ok(())
}
