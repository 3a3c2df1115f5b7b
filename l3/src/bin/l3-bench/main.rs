//! `l3-bench`: measures the L3 targets and prints figures next to Mooncake's.
//!
//! Why a binary and not criterion: three of the four targets need a second *process* (the
//! `kvtier-l3` server) or a dropped page cache, and the output must be ratios against fixed
//! reference figures measured on this machine kind (../shared/anchors/mooncake/results).
//!
//! Scenarios (each repeated, medians reported):
//! 1. embedded `batch_get_into` 1,024 × 64 KiB (target ≥ 1.5 × Mooncake same-process 4.543 GB/s);
//! 2. `batch_get_into` 256 × 1 MiB from a `kvtier-l3` process over loopback TCP
//!    (≥ 1.5 × Mooncake TCP 1.362 GB/s and ≥ 80 % of iperf3's single stream 2.42 GB/s);
//! 3. `batch_is_exist` of 1,024 keys across processes, p50 ≤ 150 µs (Mooncake 555 µs);
//! 4. cold SSD `batch_get_into` 256 × 1 MiB after dropping the page cache (≥ 80 % of the
//!    disk's O_DIRECT read bandwidth, measured here with dd; Mooncake 0.305 of 0.63 GB/s;
//!    `ssd.rs`);
//! 5. `replicas`: a split deployment (a `--role master` and three `--role node` processes on
//!    loopback), put and get of 128 × 1 MiB with `replica_num` 1, 2 and 3, interleaved per
//!    repetition; each figure also as a ratio to `replica_num` 1 of the same run
//!    (`replicas.rs`);
//! 6. `put`: the embedded put path, 64 × 8 MiB, as a ratio to a memcpy of the same bytes
//!    measured in the same run (`put.rs`);
//! 7. `failover` (only when named: it needs Debian's `etcd`): the leader of an etcd HA
//!    master set is SIGKILLed `--kills` times; time to a new leader and to every client's
//!    first success, losses, throughput after / before (`failover.rs`).
//! 7. `shm`: 1, 4 and 8 client processes doing batch put/get of 1 MiB and 8 MiB objects
//!    through a server over shared memory (in place, staged, shared regions) and over TCP,
//!    against embedded stores, in one run (`procs.rs`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod failover;
mod procs;
mod put;
mod replicas;
mod ssd;

use clap::Parser;
use kvtier_l3::{
    ClientOptions, EmbeddedStore, L3Store, PutOptions, RemoteStore, ShmMode, StoreConfig, Tenant,
};

const MOONCAKE_LOCAL_GBPS: f64 = 4.543;
const MOONCAKE_TCP_GBPS: f64 = 1.362;
const IPERF3_GBPS: f64 = 2.42;
const MOONCAKE_EXIST_P50_US: f64 = 554.85;

#[derive(Parser, Debug)]
#[command(about = "kvtier-l3 benchmarks vs Mooncake reference figures")]
struct Args {
    /// Repetitions per throughput scenario.
    #[arg(long, default_value_t = 9)]
    reps: usize,
    /// Path of the kvtier-l3 server binary (default: next to this binary).
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Directory for SSD buckets (must be on the disk under test, not tmpfs).
    #[arg(long, default_value = "/var/tmp/kvtier-l3-bench")]
    ssd_dir: PathBuf,
    /// Only these scenarios (embedded, remote, exist, ssd, replicas, put, shm, failover);
    /// default all but failover.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// `failover`: leader kills.
    #[arg(long, default_value_t = 20)]
    kills: usize,
    /// `failover`: the masters' leader lease TTL in seconds.
    #[arg(long, default_value_t = 1)]
    leader_ttl_s: u64,
    /// `shm`: only these modes (see `procs::MODES`; `embedded`, the reference, always runs).
    #[arg(long, value_delimiter = ',')]
    shm_modes: Vec<String>,
    /// Internal: run as a worker process of the `shm` scenario.
    #[arg(long, hide = true)]
    worker: Option<String>,
    /// Write results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn payload(i: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (j, b) in v.iter_mut().enumerate().step_by(4096) {
        *b = (i + j) as u8;
    }
    v
}

fn tenant() -> Tenant {
    Tenant::new("bench").unwrap_or_else(|_| unreachable!())
}

type R<T> = Result<T, String>;

fn fill(store: &dyn L3Store, n: usize, size: usize, opts: PutOptions) -> R<Vec<String>> {
    let keys: Vec<String> = (0..n).map(|i| format!("obj-{size}-{i}")).collect();
    let objs: Vec<Vec<u8>> = (0..n).map(|i| payload(i, size)).collect();
    for (ks, os) in keys.chunks(64).zip(objs.chunks(64)) {
        let refs: Vec<&[u8]> = os.iter().map(|v| v.as_slice()).collect();
        for r in store
            .batch_put_from(&tenant(), ks, &refs, opts)
            .map_err(|e| e.to_string())?
        {
            r.map_err(|e| e.to_string())?;
        }
    }
    Ok(keys)
}

fn get_gbps(store: &dyn L3Store, keys: &[String], size: usize, reps: usize) -> R<Vec<f64>> {
    let mut data = vec![0u8; keys.len() * size];
    let mut out = Vec::new();
    for rep in 0..=reps {
        let mut bufs: Vec<&mut [u8]> = data.chunks_mut(size).collect();
        let t0 = Instant::now();
        let r = store
            .batch_get_into(&tenant(), keys, &mut bufs)
            .map_err(|e| e.to_string())?;
        let dt = t0.elapsed().as_secs_f64();
        for x in r {
            x.map_err(|e| e.to_string())?;
        }
        if rep > 0 {
            out.push((keys.len() * size) as f64 / dt / 1e9);
        }
    }
    if data[size] != payload(1, size)[0] {
        return Err("read data mismatch".into());
    }
    Ok(out)
}

struct Server {
    child: std::process::Child,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        kvtier_l3::error::best_effort("kill the server", self.child.kill());
        kvtier_l3::error::best_effort("reap the server", self.child.wait());
    }
}

fn start_server(bin: &Path) -> R<Server> {
    let seg = (2u64 << 30).to_string();
    start_proc(bin, &["--listen", "127.0.0.1:0", "--segment-bytes", &seg])
}

/// Starts a `kvtier-l3` process and waits for its `LISTENING` line.
fn start_proc(bin: &Path, args: &[&str]) -> R<Server> {
    let mut child = Command::new(bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
    let out = child.stdout.take().ok_or("no stdout")?;
    let addr = kvtier_l3::cli::read_listening(out)?;
    Ok(Server { child, addr })
}

fn row(
    name: &str,
    got: f64,
    unit: &str,
    reference: &str,
    target: &str,
    pass: bool,
) -> serde_row::Row {
    println!(
        "{name:<48} {got:>10.3} {unit:<5} | ref {reference:<28} | target {target:<24} {}",
        if pass { "PASS" } else { "MISS" }
    );
    serde_row::Row {
        name: name.into(),
        value: got,
        unit: unit.into(),
        reference: reference.into(),
        target: target.into(),
        pass,
    }
}

mod serde_row {
    /// One line of results.
    #[derive(serde::Serialize)]
    pub struct Row {
        pub name: String,
        pub value: f64,
        pub unit: String,
        pub reference: String,
        pub target: String,
        pub pass: bool,
    }
}

fn embedded(reps: usize, rows: &mut Vec<serde_row::Row>) -> R<()> {
    let s = EmbeddedStore::new(StoreConfig {
        local_segment_bytes: 1 << 30,
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let keys = fill(&s, 1024, 64 << 10, PutOptions::default())?;
    let mut g = get_gbps(&s, &keys, 64 << 10, reps)?;
    let m = median(&mut g);
    rows.push(row(
        "embedded batch_get_into 1024x64KiB",
        m,
        "GB/s",
        &format!("Mooncake local {MOONCAKE_LOCAL_GBPS}"),
        &format!(">= {:.2} (1.5x)", 1.5 * MOONCAKE_LOCAL_GBPS),
        m >= 1.5 * MOONCAKE_LOCAL_GBPS,
    ));
    let keys = fill(&s, 256, 1 << 20, PutOptions::default())?;
    let mut g = get_gbps(&s, &keys, 1 << 20, reps)?;
    let m = median(&mut g);
    rows.push(row(
        "embedded batch_get_into 256x1MiB",
        m,
        "GB/s",
        "Mooncake local 7.902",
        "(info)",
        true,
    ));
    Ok(())
}

fn remote(bin: &Path, reps: usize, rows: &mut Vec<serde_row::Row>, which: &[String]) -> R<()> {
    let srv = start_server(bin)?;
    // TCP on purpose (the transfer channel vs Mooncake's TCP); `--only shm` measures the
    // shared-memory path.
    let opts = ClientOptions {
        shm: ShmMode::Off,
        ..Default::default()
    };
    let c = RemoteStore::connect(srv.addr, opts).map_err(|e| e.to_string())?;
    if which.is_empty() || which.iter().any(|w| w == "remote") {
        let keys = fill(&c, 256, 1 << 20, PutOptions::default())?;
        let mut g = get_gbps(&c, &keys, 1 << 20, reps)?;
        let m = median(&mut g);
        rows.push(row(
            "tcp batch_get_into 256x1MiB (2 processes)",
            m,
            "GB/s",
            &format!("Mooncake TCP {MOONCAKE_TCP_GBPS}"),
            &format!(">= {:.2} (1.5x)", 1.5 * MOONCAKE_TCP_GBPS),
            m >= 1.5 * MOONCAKE_TCP_GBPS,
        ));
        rows.push(row(
            "  ... as fraction of iperf3 single stream",
            m / IPERF3_GBPS,
            "x",
            &format!("iperf3 {IPERF3_GBPS} GB/s"),
            ">= 0.80",
            m / IPERF3_GBPS >= 0.8,
        ));
        let keys64 = fill(&c, 1024, 64 << 10, PutOptions::default())?;
        let mut g = get_gbps(&c, &keys64, 64 << 10, reps)?;
        let m = median(&mut g);
        rows.push(row(
            "tcp batch_get_into 1024x64KiB (2 processes)",
            m,
            "GB/s",
            "Mooncake TCP 0.633",
            "(info)",
            true,
        ));
    }
    if which.is_empty() || which.iter().any(|w| w == "exist") {
        let keys: Vec<String> = (0..1024).map(|i| format!("exist-{i}")).collect();
        let objs: Vec<Vec<u8>> = vec![vec![7u8; 64]; 1024];
        let refs: Vec<&[u8]> = objs.iter().map(|v| v.as_slice()).collect();
        c.batch_put_from(&tenant(), &keys, &refs, PutOptions::default())
            .map_err(|e| e.to_string())?;
        let mut lat = Vec::new();
        for i in 0..220 {
            let t0 = Instant::now();
            let r = c
                .batch_is_exist(&tenant(), &keys)
                .map_err(|e| e.to_string())?;
            let us = t0.elapsed().as_secs_f64() * 1e6;
            if !r.iter().all(|x| *x == Ok(true)) {
                return Err("exist returned a miss".into());
            }
            if i >= 20 {
                lat.push(us);
            }
        }
        let p50 = pct(&mut lat, 0.5);
        let p99 = pct(&mut lat, 0.99);
        let mut one = Vec::new();
        for i in 0..520 {
            let t0 = Instant::now();
            let r = c
                .is_exist(&tenant(), &keys[i % 1024])
                .map_err(|e| e.to_string())?;
            if i >= 20 && r {
                one.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        let p50_one = pct(&mut one, 0.5);
        rows.push(row(
            "tcp is_exist 1 key p50",
            p50_one,
            "us",
            "Mooncake 72.7",
            "(info)",
            true,
        ));
        rows.push(row(
            "tcp batch_is_exist 1024 keys p50",
            p50,
            "us",
            &format!("Mooncake {MOONCAKE_EXIST_P50_US}"),
            "<= 150",
            p50 <= 150.0,
        ));
        rows.push(row(
            "tcp batch_is_exist 1024 keys p99",
            p99,
            "us",
            "Mooncake 718",
            "(info)",
            true,
        ));
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    if let Some(spec) = &args.worker {
        if let Err(e) = procs::worker(spec) {
            eprintln!("worker {spec}: {e}");
            std::process::exit(1);
        }
        return;
    }
    let want = |w: &str| args.only.is_empty() || args.only.iter().any(|o| o == w);
    let bin = args.server_bin.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.join("kvtier-l3")))
            .unwrap_or_else(|| PathBuf::from("kvtier-l3"))
    });
    let mut rows = Vec::new();
    println!(
        "kvtier-l3 bench (reps {}), references from shared/anchors/mooncake/results",
        args.reps
    );
    let mut failed = false;
    let mut report = |r: R<()>, what: &str| {
        if let Err(e) = r {
            eprintln!("{what}: {e}");
            failed = true;
        }
    };
    if want("embedded") {
        report(embedded(args.reps, &mut rows), "embedded");
    }
    if want("remote") || want("exist") {
        let which: Vec<String> = args.only.clone();
        report(remote(&bin, args.reps, &mut rows, &which), "remote");
    }
    if want("ssd") {
        report(ssd::ssd(&args.ssd_dir, args.reps, &mut rows), "ssd");
    }
    if want("replicas") {
        report(replicas::replicas(&bin, args.reps, &mut rows), "replicas");
    }
    if want("put") {
        report(put::put(args.reps, &mut rows), "put");
    }
    if args.only.iter().any(|o| o == "failover") {
        report(
            failover::failover(&bin, args.kills, args.leader_ttl_s, &mut rows),
            "failover",
        );
    }
    if want("shm") {
        report(
            procs::shm(&bin, args.reps, &args.shm_modes, &mut rows),
            "shm",
        );
    }
    if let Some(p) = &args.json {
        let text = format!(
            "[\n{}\n]\n",
            rows.iter()
                .map(|r| format!(
                    "  {{\"name\": {:?}, \"value\": {:.4}, \"unit\": {:?}, \"reference\": {:?}, \"target\": {:?}, \"pass\": {}}}",
                    r.name, r.value, r.unit, r.reference, r.target, r.pass
                ))
                .collect::<Vec<_>>()
                .join(",\n")
        );
        if let Err(e) = std::fs::write(p, text) {
            eprintln!("write {}: {e}", p.display());
        }
    }
    std::thread::sleep(Duration::from_millis(10));
    if failed {
        std::process::exit(1);
    }
}
