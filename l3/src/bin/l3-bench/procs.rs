//! Scenario `shm`: 1, 4 and 8 client *processes* on this host doing batch put/get of 1 MiB
//! and 8 MiB objects (64 MiB per process per batch), four ways in one run:
//! - `embedded`: each process its own embedded store (the reference: no second process);
//! - `shm`: one `kvtier-l3` server, clients on its shared-memory path, plain caller buffers
//!   (staged: one memcpy in the client, one in the server);
//! - `shm-region`: the same with the buffers inside a shared region (a Mooncake dummy
//!   client's `alloc_from_mem_pool` memory: no copy in the client);
//! - `tcp`: the same server with the shared-memory path off (the transfer channel).
//!
//! Why processes: the deployment is 8 engine processes per node sharing one L3, and
//! what limits them (the server's copies, its threads, the kernel) only shows with real
//! processes. Each worker is this binary re-run with `--worker`; all of one configuration
//! start together on "GO", and the aggregate throughput of a phase is the bytes of every
//! worker over the slowest worker's time. Goal: `shm` ≥ 60 % of `embedded` at 8 processes.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use kvtier_l3::{
    ClientOptions, EmbeddedStore, L3Store, PutOptions, RemoteStore, ShmMode, StoreConfig, Tenant,
};

use super::{R, Server, median, payload, row, serde_row, start_proc};

const BATCH_BYTES: usize = 64 << 20;
const MODES: [&str; 4] = ["embedded", "shm", "shm-region", "tcp"];

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Where a worker's buffers live: its own heap, or a region shared with the server.
enum Bufs {
    Heap(Vec<u8>, Vec<u8>),
    Shared(std::sync::Arc<kvtier_l3::SharedRegion>),
}

impl Bufs {
    fn halves(&mut self) -> (&mut [u8], &mut [u8]) {
        match self {
            Bufs::Heap(a, b) => (a, b),
            Bufs::Shared(r) => {
                // SAFETY: the region is this worker's alone for its whole length while
                // `r` lives, and only these two halves are handed out.
                let all = unsafe { std::slice::from_raw_parts_mut(r.as_ptr(), r.len()) };
                all.split_at_mut(BATCH_BYTES)
            }
        }
    }
}

/// A worker: `mode,addr,size,reps,id`. Prints READY, waits for a line, runs a warm-up
/// round and `reps` timed rounds of (put batch, get batch, remove), prints
/// `RESULT put_s get_s`.
pub fn worker(spec: &str) -> R<()> {
    let f: Vec<&str> = spec.split(',').collect();
    let [mode, addr, size, reps, id] = f[..] else {
        return Err(format!("bad worker spec {spec}"));
    };
    let size: usize = size.parse().map_err(err)?;
    let reps: usize = reps.parse().map_err(err)?;
    let n = BATCH_BYTES / size;
    if mode == "embedded" {
        let s = EmbeddedStore::new(StoreConfig {
            local_segment_bytes: 2 * BATCH_BYTES as u64,
            ..Default::default()
        })
        .map_err(err)?;
        let heap = Bufs::Heap(vec![0u8; BATCH_BYTES], vec![0u8; BATCH_BYTES]);
        return run(&s, heap, n, size, reps, id);
    }
    let c = RemoteStore::connect(
        addr.parse().map_err(err)?,
        ClientOptions {
            shm: if mode == "tcp" {
                ShmMode::Off
            } else {
                ShmMode::Auto
            },
            ..Default::default()
        },
    )
    .map_err(err)?;
    if (mode != "tcp") != c.uses_shm() {
        return Err(format!("{mode}: shared memory in use = {}", c.uses_shm()));
    }
    let bufs = if mode == "shm-region" {
        Bufs::Shared(c.shared_region(2 * BATCH_BYTES).map_err(err)?)
    } else {
        Bufs::Heap(vec![0u8; BATCH_BYTES], vec![0u8; BATCH_BYTES])
    };
    run(&c, bufs, n, size, reps, id)
}

fn run(store: &dyn L3Store, mut bufs: Bufs, n: usize, size: usize, reps: usize, id: &str) -> R<()> {
    let tn = Tenant::new(format!("w{id}")).map_err(err)?;
    let (src, dst) = bufs.halves();
    for (i, c) in src.chunks_mut(size).enumerate() {
        c.copy_from_slice(&payload(i, size));
    }
    println!("READY");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(err)?;
    let (mut put_s, mut get_s) = (0.0, 0.0);
    // Round 0 warms up (first touch of the staging segment and of fresh store memory) and
    // is not counted.
    for rep in 0..=reps {
        let keys: Vec<String> = (0..n).map(|i| format!("{rep}-{i}")).collect();
        let srcs: Vec<&[u8]> = src.chunks(size).collect();
        let t0 = Instant::now();
        let r = store
            .batch_put_from(&tn, &keys, &srcs, PutOptions::default())
            .map_err(err)?;
        if rep > 0 {
            put_s += t0.elapsed().as_secs_f64();
        }
        r.into_iter().collect::<Result<Vec<()>, _>>().map_err(err)?;
        let mut dsts: Vec<&mut [u8]> = dst.chunks_mut(size).collect();
        let t0 = Instant::now();
        let r = store.batch_get_into(&tn, &keys, &mut dsts).map_err(err)?;
        if rep > 0 {
            get_s += t0.elapsed().as_secs_f64();
        }
        r.into_iter()
            .collect::<Result<Vec<u64>, _>>()
            .map_err(err)?;
        if dst[..size] != src[..size] {
            return Err("read back differs".into());
        }
        store.remove_all(&tn, true).map_err(err)?;
    }
    println!("RESULT {put_s} {get_s}");
    Ok(())
}

/// Runs one configuration: `procs` workers in `mode` against `addr`; aggregate put and
/// get GB/s.
fn config(mode: &str, addr: &str, procs: usize, size: usize, reps: usize) -> R<(f64, f64)> {
    let exe = std::env::current_exe().map_err(err)?;
    let mut kids: Vec<Child> = Vec::new();
    let mut outs = Vec::new();
    for id in 0..procs {
        let mut k = Command::new(&exe)
            .args(["--worker", &format!("{mode},{addr},{size},{reps},{id}")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(err)?;
        let mut lines = BufReader::new(k.stdout.take().ok_or("no stdout")?).lines();
        match lines.next() {
            Some(Ok(l)) if l == "READY" => {}
            other => return Err(format!("worker {id}: {other:?}")),
        }
        outs.push(lines);
        kids.push(k);
    }
    for k in &mut kids {
        let stdin = k.stdin.as_mut().ok_or("no stdin")?;
        writeln!(stdin, "GO").map_err(err)?;
    }
    let (mut put_max, mut get_max) = (0.0f64, 0.0f64);
    for (k, lines) in kids.iter_mut().zip(outs) {
        let res = lines
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix("RESULT ").map(str::to_string))
            .ok_or("a worker failed")?;
        let v: Vec<f64> = res.split(' ').filter_map(|x| x.parse().ok()).collect();
        put_max = put_max.max(v.first().copied().unwrap_or(f64::INFINITY));
        get_max = get_max.max(v.get(1).copied().unwrap_or(f64::INFINITY));
        let _ = k.wait();
    }
    let bytes = (procs * reps * BATCH_BYTES) as f64;
    Ok((bytes / put_max / 1e9, bytes / get_max / 1e9))
}

pub fn shm(bin: &Path, reps: usize, rows: &mut Vec<serde_row::Row>) -> R<()> {
    let reps = reps.clamp(1, 5);
    let seg = (8 * 2 * BATCH_BYTES + (64 << 20)).to_string();
    let srv: Server = start_proc(bin, &["--listen", "127.0.0.1:0", "--segment-bytes", &seg])?;
    let addr = srv.addr.to_string();
    for size in [1usize << 20, 8 << 20] {
        for procs in [1usize, 4, 8] {
            let mut got = Vec::new();
            for mode in MODES {
                // Interleaved three times; the median of each mode.
                let mut puts = Vec::new();
                let mut gets = Vec::new();
                for _ in 0..3 {
                    let (p, g) = config(mode, &addr, procs, size, reps)?;
                    puts.push(p);
                    gets.push(g);
                }
                got.push((mode, median(&mut puts), median(&mut gets)));
            }
            let (ep, eg) = (got[0].1, got[0].2);
            for (mode, p, g) in got {
                let name = format!("{mode} {procs}p batch {}MiB put/get", size >> 20);
                let pass = mode != "shm" || procs != 8 || (p >= 0.6 * ep && g >= 0.6 * eg);
                rows.push(row(
                    &format!("{name} put"),
                    p,
                    "GB/s",
                    &format!("{:.2}x embedded", p / ep),
                    if mode == "shm" && procs == 8 {
                        ">= 0.60x embedded"
                    } else {
                        "(info)"
                    },
                    pass,
                ));
                rows.push(row(
                    &format!("{name} get"),
                    g,
                    "GB/s",
                    &format!("{:.2}x embedded", g / eg),
                    if mode == "shm" && procs == 8 {
                        ">= 0.60x embedded"
                    } else {
                        "(info)"
                    },
                    pass,
                ));
            }
        }
    }
    Ok(())
}
