//! Scenario `shm`: 1, 4 and 8 client *processes* on this host doing batch put/get of 1 MiB
//! and 8 MiB objects (64 MiB per process per batch), six ways in one run:
//! - `embedded`: each process its own embedded store (the reference: no second process);
//! - `shm`: one `kvtier-l3` server, clients on its shared-memory path, plain caller buffers
//!   (the default, `ShmMode::Auto`: staged, one memcpy in the client, one in the server);
//! - `shm-inplace`: the same with `ShmMode::InPlace`: copied in place by the server
//!   (`process_vm_readv`/`writev`: one copy);
//! - `shm-inplace-huge`: as `shm-inplace`, with the caller's buffers advised
//!   `MADV_HUGEPAGE` before first touch (as a long-lived engine pool may be): the kernel pins
//!   a caller's pages for each in-place copy, and huge pages make that cheap;
//! - `shm-region`: the same with the buffers inside a shared region (a Mooncake dummy
//!   client's `alloc_from_mem_pool` memory: no copy in the client);
//! - `tcp`: the same server with the shared-memory path off (the transfer channel);
//! - `cluster-shm`: a split deployment (a `--role master`, one `--role node`), clients
//!   moving bytes through the node's shared-memory path (plain caller buffers);
//! - `cluster-shm-region`: as `cluster-shm`, with the buffers inside a shared region (the
//!   region is registered with the node: no copy in the client);
//! - `cluster-tcp`: the same deployment over the node's TCP data channel.
//!
//! Why processes: the deployment is 8 engine processes per node sharing one L3, and
//! what limits them (the server's copies, its threads, the kernel) only shows with real
//! processes. Each worker is this binary re-run with `--worker`; the parent starts each
//! phase (put, get, remove) in all workers at once, and the aggregate throughput of a phase
//! is the bytes of every worker over the phase's wall time (a warm-up round first, not
//! counted). Goal: `shm` ≥ 60 % of `embedded` at 8 processes.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use kvtier_l3::{
    ClientOptions, EmbeddedStore, L3Store, PutOptions, RemoteStore, ShmMode, StoreConfig, Tenant,
};

use super::{R, Server, median, payload, row, serde_row, start_proc};

const BATCH_BYTES: usize = 64 << 20;
pub const MODES: [&str; 9] = [
    "embedded",
    "shm",
    "shm-inplace",
    "shm-inplace-huge",
    "shm-region",
    "tcp",
    "cluster-shm",
    "cluster-shm-region",
    "cluster-tcp",
];

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

/// A worker: `mode,addr,size,id`. Prints READY, then serves the parent's commands.
pub fn worker(spec: &str) -> R<()> {
    let f: Vec<&str> = spec.split(',').collect();
    let [mode, addr, size, id] = f[..] else {
        return Err(format!("bad worker spec {spec}"));
    };
    let size: usize = size.parse().map_err(err)?;
    let n = BATCH_BYTES / size;
    if mode == "embedded" {
        let s = EmbeddedStore::new(StoreConfig {
            local_segment_bytes: 2 * BATCH_BYTES as u64,
            ..Default::default()
        })
        .map_err(err)?;
        let heap = Bufs::Heap(vec![0u8; BATCH_BYTES], vec![0u8; BATCH_BYTES]);
        return run(&s, heap, n, size, id);
    }
    let c = RemoteStore::connect(
        addr.parse().map_err(err)?,
        ClientOptions {
            shm: match mode {
                "tcp" | "cluster-tcp" => ShmMode::Off,
                "shm-inplace" | "shm-inplace-huge" => ShmMode::InPlace,
                _ => ShmMode::Auto,
            },
            ..Default::default()
        },
    )
    .map_err(err)?;
    if mode.ends_with("tcp") == c.uses_shm() {
        return Err(format!("{mode}: shared memory in use = {}", c.uses_shm()));
    }
    if mode.starts_with("shm-inplace") != c.shm_in_place() {
        return Err(format!("{mode}: in-place copies = {}", c.shm_in_place()));
    }
    let bufs = if mode.ends_with("shm-region") {
        Bufs::Shared(c.shared_region(2 * BATCH_BYTES).map_err(err)?)
    } else if mode == "shm-inplace-huge" {
        Bufs::Heap(huge_vec(BATCH_BYTES), huge_vec(BATCH_BYTES))
    } else {
        Bufs::Heap(vec![0u8; BATCH_BYTES], vec![0u8; BATCH_BYTES])
    };
    run(&c, bufs, n, size, id)
}

/// `n` zero bytes whose 2 MiB-aligned interior is advised `MADV_HUGEPAGE` before anything
/// touches it (a fresh `calloc` of this size is an untouched mapping).
fn huge_vec(n: usize) -> Vec<u8> {
    let v = vec![0u8; n];
    let start = (v.as_ptr() as usize).next_multiple_of(2 << 20);
    let end = (v.as_ptr() as usize + n) / (2 << 20) * (2 << 20);
    if end > start {
        // SAFETY: advice on whole pages inside `v`'s allocation; contents are unchanged.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    v
}

/// The worker's loop: one command per line from the parent (`put`, `get`, `rm`, `quit`),
/// `OK` once done, so the parent times each phase across all workers at once.
fn run(store: &dyn L3Store, mut bufs: Bufs, n: usize, size: usize, id: &str) -> R<()> {
    let tn = Tenant::new(format!("w{id}")).map_err(err)?;
    let (src, dst) = bufs.halves();
    for (i, c) in src.chunks_mut(size).enumerate() {
        c.copy_from_slice(&payload(i, size));
    }
    println!("READY");
    let keys: Vec<String> = (0..n).map(|i| format!("o-{i}")).collect();
    for line in std::io::stdin().lines() {
        match line.map_err(err)?.as_str() {
            "put" => {
                let srcs: Vec<&[u8]> = src.chunks(size).collect();
                let r = store
                    .batch_put_from(&tn, &keys, &srcs, PutOptions::default())
                    .map_err(err)?;
                r.into_iter().collect::<Result<Vec<()>, _>>().map_err(err)?;
            }
            "get" => {
                dst[..size].fill(0);
                let mut dsts: Vec<&mut [u8]> = dst.chunks_mut(size).collect();
                let r = store.batch_get_into(&tn, &keys, &mut dsts).map_err(err)?;
                r.into_iter()
                    .collect::<Result<Vec<u64>, _>>()
                    .map_err(err)?;
                if dst[..size] != src[..size] {
                    return Err("read back differs".into());
                }
            }
            "rm" => {
                store.remove_all(&tn, true).map_err(err)?;
            }
            _ => return Ok(()),
        }
        println!("OK");
    }
    Ok(())
}

/// A started worker: its stdin, its stdout lines.
struct Worker {
    child: Child,
    out: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Worker {
    fn send(&mut self, cmd: &str) -> R<()> {
        let stdin = self.child.stdin.as_mut().ok_or("no stdin")?;
        writeln!(stdin, "{cmd}").map_err(err)
    }
    fn wait_ok(&mut self, what: &str) -> R<()> {
        match self.out.next() {
            Some(Ok(l)) if l == what => Ok(()),
            other => Err(format!("worker: {other:?} where {what} was expected")),
        }
    }
}

/// All workers do `cmd`; the wall time until the last is done.
fn phase(ws: &mut [Worker], cmd: &str) -> R<f64> {
    let t0 = Instant::now();
    for w in ws.iter_mut() {
        w.send(cmd)?;
    }
    for w in ws.iter_mut() {
        w.wait_ok("OK")?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// Runs one configuration: `procs` workers in `mode` against `addr`; aggregate put and
/// get GB/s (all workers' bytes over the wall time of the phase, after a warm-up round).
fn config(mode: &str, addr: &str, procs: usize, size: usize, reps: usize) -> R<(f64, f64)> {
    let exe = std::env::current_exe().map_err(err)?;
    let mut ws = Vec::new();
    for id in 0..procs {
        let mut child = Command::new(&exe)
            .args(["--worker", &format!("{mode},{addr},{size},{id}")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(err)?;
        let out = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
        let mut w = Worker { child, out };
        w.wait_ok("READY")?;
        ws.push(w);
    }
    let (mut put_s, mut get_s) = (0.0, 0.0);
    for rep in 0..=reps {
        let p = phase(&mut ws, "put")?;
        let g = phase(&mut ws, "get")?;
        phase(&mut ws, "rm")?;
        if rep > 0 {
            put_s += p;
            get_s += g;
        }
    }
    for w in &mut ws {
        w.send("quit")?;
        kvtier_l3::error::best_effort("reap a worker", w.child.wait());
    }
    let bytes = (procs * reps * BATCH_BYTES) as f64;
    Ok((bytes / put_s / 1e9, bytes / get_s / 1e9))
}

/// `only`: the modes to run (empty: all); `embedded`, the reference, always runs.
pub fn shm(bin: &Path, reps: usize, only: &[String], rows: &mut Vec<serde_row::Row>) -> R<()> {
    if let Some(m) = only.iter().find(|m| !MODES.contains(&m.as_str())) {
        return Err(format!(
            "--shm-modes: unknown mode {m:?} (known: {MODES:?})"
        ));
    }
    let modes: Vec<&str> = MODES
        .into_iter()
        .filter(|m| *m == "embedded" || only.is_empty() || only.iter().any(|o| o == m))
        .collect();
    let reps = reps.clamp(1, 5);
    let seg = (8 * 2 * BATCH_BYTES + (64 << 20)).to_string();
    let srv: Server = start_proc(bin, &["--listen", "127.0.0.1:0", "--segment-bytes", &seg])?;
    let addr = srv.addr.to_string();
    let master: Server = start_proc(
        bin,
        &[
            "--role",
            "master",
            "--listen",
            "127.0.0.1:0",
            "--no-state-dir",
        ],
    )?;
    let maddr = master.addr.to_string();
    let _node: Server = start_proc(
        bin,
        &[
            "--role",
            "node",
            "--master",
            &maddr,
            "--node-id",
            "1",
            "--listen",
            "127.0.0.1:0",
            "--segment-bytes",
            &seg,
        ],
    )?;
    for size in [1usize << 20, 8 << 20] {
        for procs in [1usize, 4, 8] {
            let mut got = Vec::new();
            for &mode in &modes {
                // Interleaved three times; the median of each mode.
                let mut puts = Vec::new();
                let mut gets = Vec::new();
                for _ in 0..3 {
                    let at = if mode.starts_with("cluster") {
                        &maddr
                    } else {
                        &addr
                    };
                    let (p, g) = config(mode, at, procs, size, reps)?;
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
