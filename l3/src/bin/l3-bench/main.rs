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
//!    disk's O_DIRECT read bandwidth, measured here with dd; Mooncake 0.305 of 0.63 GB/s);
//! 5. `replicas`: a split deployment (a `--role master` and three `--role node` processes on
//!    loopback), put and get of 128 × 1 MiB with `replica_num` 1, 2 and 3, interleaved per
//!    repetition; each figure also as a ratio to `replica_num` 1 of the same run;
//! 6. `put`: the embedded put path, 64 × 8 MiB, as a ratio to a memcpy of the same bytes
//!    measured in the same run (`put.rs`).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod put;

use clap::Parser;
use kvtier_l3::{
    ClientOptions, EmbeddedStore, L3Store, PutOptions, RemoteStore, ReplicateConfig, SsdConfig,
    StoreConfig, Tenant,
};

const MOONCAKE_LOCAL_GBPS: f64 = 4.543;
const MOONCAKE_TCP_GBPS: f64 = 1.362;
const IPERF3_GBPS: f64 = 2.42;
const MOONCAKE_EXIST_P50_US: f64 = 554.85;
const MOONCAKE_SSD_COLD_GBPS: f64 = 0.305;

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
    /// Only these scenarios (embedded, remote, exist, ssd, replicas, put); default all.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
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
        let _ = self.child.kill();
        let _ = self.child.wait();
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
    let mut line = String::new();
    BufReader::new(out)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    let addr = line
        .trim()
        .strip_prefix("LISTENING ")
        .ok_or_else(|| format!("unexpected server output {line:?}"))?
        .parse()
        .map_err(|e| format!("{e}"))?;
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
    let c = RemoteStore::connect(srv.addr, ClientOptions::default()).map_err(|e| e.to_string())?;
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

fn drop_caches(dir: &Path) -> &'static str {
    if std::fs::write("/proc/sys/vm/drop_caches", b"3").is_ok() {
        return "drop_caches";
    }
    // Unprivileged fallback: evict each bucket file's clean pages.
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if let Ok(f) = std::fs::File::open(e.path()) {
                use std::os::fd::AsRawFd;
                // SAFETY: valid fd for the duration of the call.
                unsafe {
                    libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
                }
            }
        }
    }
    "posix_fadvise(DONTNEED)"
}

/// O_DIRECT sequential read bandwidth of `file` measured with dd (GB/s).
fn dd_direct(file: &Path) -> R<f64> {
    let out = Command::new("dd")
        .arg(format!("if={}", file.display()))
        .args(["of=/dev/null", "bs=1M", "iflag=direct"])
        .output()
        .map_err(|e| format!("dd: {e}"))?;
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    // "... bytes (...) copied, 0.4 s, 630 MB/s"
    let last = text.lines().last().unwrap_or("").to_string();
    let parts: Vec<&str> = last.split(',').collect();
    let bytes: f64 = last
        .split_whitespace()
        .next()
        .and_then(|b| b.parse().ok())
        .ok_or_else(|| format!("cannot parse dd output {text:?}"))?;
    let secs: f64 = parts
        .get(parts.len().saturating_sub(2))
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("cannot parse dd output {text:?}"))?;
    Ok(bytes / secs / 1e9)
}

fn ssd(dir: &Path, reps: usize, rows: &mut Vec<serde_row::Row>) -> R<()> {
    let _ = std::fs::remove_dir_all(dir);
    let mk = |seg: u64| {
        let mut ssd = SsdConfig::new(dir);
        ssd.bucket_bytes_limit = 64 << 20;
        EmbeddedStore::new(StoreConfig {
            local_segment_bytes: seg,
            ssd: Some(ssd),
            ..Default::default()
        })
        .map_err(|e| e.to_string())
    };
    let keys = {
        let s = mk(1 << 30)?;
        let k = fill(&s, 256, 1 << 20, PutOptions::default())?;
        s.flush().map_err(|e| e.to_string())?;
        k
    };
    // Restarted store: DRAM empty, every object SSD-only.
    let s = mk(1 << 30)?;
    let mut cold = Vec::new();
    let mut how = "";
    let mut data = vec![0u8; 256 << 20];
    for _ in 0..reps.clamp(3, 5) {
        how = drop_caches(dir);
        let mut bufs: Vec<&mut [u8]> = data.chunks_mut(1 << 20).collect();
        let t0 = Instant::now();
        let r = s
            .batch_get_into(&tenant(), &keys, &mut bufs)
            .map_err(|e| e.to_string())?;
        let dt = t0.elapsed().as_secs_f64();
        if r.iter().any(|x| x.is_err()) {
            return Err("ssd read failed".into());
        }
        cold.push((256 << 20) as f64 / dt / 1e9);
    }
    let m = median(&mut cold);
    // The disk's direct-read bandwidth on the same files.
    let mut dd = Vec::new();
    let mut biggest: Option<(u64, PathBuf)> = None;
    for e in std::fs::read_dir(dir).map_err(|e| e.to_string())?.flatten() {
        let len = e.metadata().map(|m| m.len()).unwrap_or(0);
        if biggest.as_ref().is_none_or(|(l, _)| len > *l) {
            biggest = Some((len, e.path()));
        }
    }
    if let Some((_, p)) = &biggest {
        for _ in 0..3 {
            drop_caches(dir);
            dd.push(dd_direct(p)?);
        }
    }
    let disk = median(&mut dd);
    rows.push(row(
        &format!("cold SSD batch_get_into 256x1MiB ({how})"),
        m,
        "GB/s",
        &format!("Mooncake {MOONCAKE_SSD_COLD_GBPS} of 0.63"),
        &format!(">= {:.3} (0.8 x dd {:.3})", 0.8 * disk, disk),
        m >= 0.8 * disk,
    ));
    rows.push(row(
        "  disk O_DIRECT read (dd bs=1M iflag=direct)",
        disk,
        "GB/s",
        "0.63 (Mooncake run)",
        "(info)",
        true,
    ));
    drop(s);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

/// Objects and size of the replicated case.
const REPL_OBJECTS: usize = 128;
const REPL_SIZE: usize = 1 << 20;

fn replicas(bin: &Path, reps: usize, rows: &mut Vec<serde_row::Row>) -> R<()> {
    let master = start_proc(bin, &["--role", "master", "--listen", "127.0.0.1:0"])?;
    let maddr = master.addr.to_string();
    let seg = (1u64 << 30).to_string();
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let id = id.to_string();
        nodes.push(start_proc(
            bin,
            &[
                "--role",
                "node",
                "--master",
                &maddr,
                "--node-id",
                &id,
                "--listen",
                "127.0.0.1:0",
                "--segment-bytes",
                &seg,
                "--ping-ms",
                "100",
            ],
        )?);
    }
    let c =
        RemoteStore::connect(master.addr, ClientOptions::default()).map_err(|e| e.to_string())?;
    let t = tenant();
    let objs: Vec<Vec<u8>> = (0..REPL_OBJECTS).map(|i| payload(i, REPL_SIZE)).collect();
    let bytes = (REPL_OBJECTS * REPL_SIZE) as f64;
    let ns = [1u32, 2, 3];
    let mut put: Vec<Vec<f64>> = vec![Vec::new(); ns.len()];
    let mut get: Vec<Vec<f64>> = vec![Vec::new(); ns.len()];
    let mut data = vec![0u8; REPL_OBJECTS * REPL_SIZE];
    // Repetition 0 warms up; the replica counts are interleaved so that load drifts on the
    // shared machine hit all three alike.
    for rep in 0..=reps {
        for (j, &n) in ns.iter().enumerate() {
            let keys: Vec<String> = (0..REPL_OBJECTS).map(|i| format!("repl-{n}-{i}")).collect();
            let cfg = ReplicateConfig::replicas(n);
            let t0 = Instant::now();
            for (ks, os) in keys.chunks(32).zip(objs.chunks(32)) {
                let refs: Vec<&[u8]> = os.iter().map(|v| v.as_slice()).collect();
                for r in c
                    .batch_put_from_with(&t, ks, &refs, PutOptions::default(), cfg)
                    .map_err(|e| e.to_string())?
                {
                    r.map_err(|e| e.to_string())?;
                }
            }
            let dput = t0.elapsed().as_secs_f64();
            let q = c
                .get_replica_list(&t, &keys[0])
                .map_err(|e| e.to_string())?;
            if q.replicas.len() != n as usize {
                return Err(format!("{} replicas placed, {n} asked", q.replicas.len()));
            }
            let mut bufs: Vec<&mut [u8]> = data.chunks_mut(REPL_SIZE).collect();
            let t0 = Instant::now();
            for r in c
                .batch_get_into(&t, &keys, &mut bufs)
                .map_err(|e| e.to_string())?
            {
                r.map_err(|e| e.to_string())?;
            }
            let dget = t0.elapsed().as_secs_f64();
            if data[REPL_SIZE..2 * REPL_SIZE] != objs[1][..] {
                return Err("read data mismatch".into());
            }
            c.remove_all(&t, true).map_err(|e| e.to_string())?;
            if rep > 0 {
                put[j].push(bytes / dput / 1e9);
                get[j].push(bytes / dget / 1e9);
            }
        }
        // Let the nodes hear of the frees (ping period 100 ms) before the next round.
        std::thread::sleep(Duration::from_millis(250));
    }
    let p1 = median(&mut put[0].clone());
    let g1 = median(&mut get[0].clone());
    for (j, &n) in ns.iter().enumerate() {
        let p = median(&mut put[j]);
        let g = median(&mut get[j]);
        rows.push(row(
            &format!("split 3 nodes put 128x1MiB replica_num {n}"),
            p,
            "GB/s",
            &format!("x{:.2} of replica_num 1", p / p1),
            "(info)",
            true,
        ));
        rows.push(row(
            &format!("split 3 nodes get 128x1MiB replica_num {n}"),
            g,
            "GB/s",
            &format!("x{:.2} of replica_num 1", g / g1),
            "(info)",
            true,
        ));
    }
    drop(nodes);
    drop(master);
    Ok(())
}

fn main() {
    let args = Args::parse();
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
        report(ssd(&args.ssd_dir, args.reps, &mut rows), "ssd");
    }
    if want("replicas") {
        report(replicas(&bin, args.reps, &mut rows), "replicas");
    }
    if want("put") {
        report(put::put(args.reps, &mut rows), "put");
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
