//! `l3-chaos`: a split deployment (one master, or several on etcd; store nodes with SSD
//! tiers or DRAM only) driven by client threads while its processes are SIGKILLed,
//! SIGSTOPped and restarted (and etcd members killed), checked against a model of what the
//! store acknowledged. Exits 1 if any wrong bytes, stale version, resurrected remove,
//! unreported loss or lost persisted put was seen (or if the run did no work).
//!
//! Why a binary: the faults are real process deaths and pauses (the master's settle log,
//! etcd, and the nodes' SSD records on real files are what is under test), and the run is
//! meant to last minutes (`--seconds`); `tests/chaos.rs` runs it briefly in CI, docs/l3/chaos.md
//! gives the long commands. The faults are in `faults`.
//!
//! Checks (see `oracle`): every read is compared with the key's model; "not found" where a
//! version was acknowledged must be named by the loss journal (or an `overflowed` report)
//! after the acknowledgement; at the end every process is restarted twice over and every
//! key read again, and a put acknowledged with `wait_persisted` on an all-write-through
//! cluster must still be there (with DRAM-only nodes the restart loses everything: each
//! miss must then be reported, and a removed or replaced version must still never be read).

mod cluster;
mod faults;
mod ha;
mod oracle;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};

use cluster::Cluster;
use faults::{Faults, Plan, Tally};
use oracle::{Shared, Violation};
use workload::{Conn, Counts, Keys, Worker};

/// How store nodes write SSD copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Every node writes every put through to SSD.
    WriteThrough,
    /// Every node writes objects to SSD when DRAM eviction drops them.
    OnEvict,
    /// Half the nodes each way.
    Mixed,
    /// No node has an SSD tier (no `--ssd-dir`): a node's death or restart loses its
    /// replicas, and no put is durable, `wait_persisted` or not.
    DramOnly,
}

/// Whether an `overflowed` loss report explains a miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Journal {
    /// Yes: some losses are unknown to the store (a restart, a failover that lost a node).
    Overflow,
    /// No: every loss before the final restart must be named by key (with etcd masters
    /// and no node faults, the loss journal is carried over every failover).
    Named,
}

#[derive(Parser, Debug)]
#[command(about = "SIGKILL a kvtier-l3 split deployment under load and check every answer")]
struct Args {
    /// How long the chaos lasts.
    #[arg(long, default_value_t = 120)]
    seconds: u64,
    #[arg(long, value_enum, default_value = "write-through")]
    mode: Mode,
    /// Which faults, comma-separated (e.g. `both,node-pause,paused-free,etcd`), dealt
    /// from a shuffled deck (`paused-free` twice as often as the others).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "both")]
    faults: Vec<Faults>,
    /// Store nodes.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Client threads (each owns its keys).
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// Keys per client thread.
    #[arg(long, default_value_t = 48)]
    keys: u32,
    /// Largest object in bytes (objects are 64 B ..= this).
    #[arg(long, default_value_t = 96 << 10)]
    max_bytes: usize,
    /// Each node's DRAM segment (small, so that eviction happens).
    #[arg(long, default_value_t = 4 << 20)]
    segment_bytes: u64,
    /// Mean time between faults in milliseconds.
    #[arg(long, default_value_t = 1_500)]
    fault_every_ms: u64,
    /// Masters: 0 runs one `--state-dir` master; 2 or 3 run that many `--etcd` masters on
    /// a 3-member etcd cluster started here (needs `etcd` on PATH), and master faults hit
    /// the leader: SIGKILL, or SIGSTOP then SIGCONT.
    #[arg(long, default_value_t = 0)]
    masters: usize,
    /// With --masters: the leader lease TTL in seconds.
    #[arg(long, default_value_t = 1)]
    leader_ttl_s: u64,
    /// What explains a read that found nothing where a version was acknowledged.
    #[arg(long, value_enum, default_value = "overflow")]
    journal: Journal,
    /// How often the loss-journal reader reads (an engine reads it once per scheduling
    /// step or less often: a failover must not make it miss what was recorded before).
    #[arg(long, default_value_t = 20)]
    loss_poll_ms: u64,
    /// The master's node liveness TTL in milliseconds.
    #[arg(long, default_value_t = 1_000)]
    ttl_ms: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The kvtier-l3 binary (default: next to this one).
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Working directory (state and SSD dirs); a fresh temporary one by default.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep each server process's stderr in DIR/NAME.log (`RUST_LOG` applies to them too;
    /// `RUST_LOG=l3_chaos=info` logs each fault and violation here with its time).
    #[arg(long)]
    logs: Option<PathBuf>,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if let Some(d) = &args.logs
        && let Err(e) = ha::log_to(d)
    {
        eprintln!("l3-chaos: --logs: {e}");
        std::process::exit(2);
    }
    match run(&args) {
        Ok(0) => {}
        Ok(_) => std::process::exit(1),
        Err(e) => {
            eprintln!("l3-chaos: {e}");
            std::process::exit(2);
        }
    }
}

fn run(a: &Args) -> Result<u64, String> {
    let bin = match &a.server_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .with_file_name("kvtier-l3"),
    };
    let tmp = std::env::temp_dir().join(format!("kvtier-l3-chaos-{}", std::process::id()));
    let dir = a.dir.clone().unwrap_or(tmp);
    if dir.exists() {
        return Err(format!("{} exists; give a fresh --dir", dir.display()));
    }
    let result = chaos(a, &bin, &dir);
    if a.dir.is_none()
        && let Err(e) = std::fs::remove_dir_all(&dir)
    {
        eprintln!("l3-chaos: could not remove {}: {e}", dir.display());
    }
    result
}

fn chaos(a: &Args, bin: &std::path::Path, dir: &std::path::Path) -> Result<u64, String> {
    if a.nodes < 2 || a.workers == 0 || a.keys == 0 {
        return Err("need at least 2 nodes, 1 worker and 1 key".into());
    }
    if a.masters == 1 || a.masters > 5 || a.leader_ttl_s == 0 {
        return Err("--masters is 0 (one state-dir master) or 2..=5; --leader-ttl-s > 0".into());
    }
    if a.faults.is_empty() {
        return Err("--faults needs at least one kind".into());
    }
    if a.masters == 0
        && let Some(f) = a.faults.iter().find(|f| f.needs_etcd())
    {
        return Err(format!(
            "--faults {f:?} needs etcd masters (--masters 2 or 3)"
        ));
    }
    let ha = (a.masters > 0).then_some((a.masters, a.leader_ttl_s));
    let mut c = Cluster::start(bin, dir, a.mode, a.nodes, a.segment_bytes, a.ttl_ms, ha)?;
    let addr = c.locator()?;
    let shared = Arc::new(Shared::default());
    let counts = Arc::new(Counts::default());
    let stop = Arc::new(AtomicBool::new(false));
    let stop_reader = Arc::new(AtomicBool::new(false));
    let burst = Arc::new(AtomicBool::new(false));
    let reader = {
        let (s, st, addr) = (shared.clone(), stop_reader.clone(), addr.clone());
        let co = counts.clone();
        let poll = Duration::from_millis(a.loss_poll_ms);
        std::thread::spawn(move || workload::read_losses(addr, poll, st, s, co))
    };
    // Let the nodes mount before the first put.
    std::thread::sleep(Duration::from_millis(500));
    let workers: Vec<_> = (0..a.workers)
        .map(|i| {
            let w = Worker {
                addr: addr.clone(),
                first_key: i * a.keys,
                keys: a.keys,
                max_bytes: a.max_bytes,
                persisted_is_durable: a.mode == Mode::WriteThrough,
                seed: a.seed.wrapping_mul(1_000_003).wrapping_add(i as u64),
                burst: burst.clone(),
            };
            let (st, sh, co) = (stop.clone(), shared.clone(), counts.clone());
            std::thread::spawn(move || workload::run(w, st, sh, co))
        })
        .collect();

    let mut kinds: Vec<Faults> = Vec::new();
    for f in &a.faults {
        if !kinds.contains(f) {
            kinds.push(*f);
        }
    }
    let plan = Plan {
        faults: kinds,
        seconds: a.seconds,
        fault_every_ms: a.fault_every_ms,
        ttl_ms: a.ttl_ms,
        seed: a.seed,
        burst,
        counts: counts.clone(),
    };
    let kills = faults::inject(&mut c, &plan)?;
    // A worker may wait on a paused node for as long as it is paused: resume everything
    // before waiting for them.
    c.resume_all();
    stop.store(true, Ordering::Relaxed);
    let mut keys: Keys = Vec::new();
    for w in workers {
        keys.extend(w.join().map_err(|_| "a worker panicked")?);
    }

    // Every process up, then read every key; then all of them killed and restarted at once
    // (every node rescans, the master replays its log), and every key read again.
    let mut restarted_at = None;
    for round in 0..2 {
        if round == 1 {
            // Its `overflowed` report covers every loss: losses seen before it must have
            // been reported before it.
            restarted_at = Some(Instant::now());
            c.kill_masters();
            for i in 0..c.nodes() {
                c.kill_node(i);
            }
        }
        c.revive_all()?;
        std::thread::sleep(Duration::from_millis(a.ttl_ms + 1_500));
        final_reads(&addr, &keys, &shared, &counts);
    }
    std::thread::sleep(Duration::from_millis(300));
    stop_reader.store(true, Ordering::Relaxed);
    reader.join().map_err(|_| "the loss reader panicked")?;
    Ok(report(a, &kills, &keys, &shared, &counts, restarted_at))
}

/// Reads every key once more, retrying transport errors for up to 30 s; a persisted put
/// that is not found now (everything is up) is lost.
fn final_reads(addr: &kvtier_l3::ha::Locator, keys: &Keys, shared: &Shared, counts: &Arc<Counts>) {
    let mut conn = Conn::new(addr.clone(), counts.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut todo: Vec<&(u32, oracle::KeyState)> = keys.iter().collect();
    while !todo.is_empty() && Instant::now() < deadline {
        todo.retain(|(id, st)| {
            let before = workload::lock(&shared.findings).misses.len();
            if workload::read_and_check(&mut conn, *id, st, shared, counts).is_err() {
                return true;
            }
            let missing = workload::lock(&shared.findings).misses.len() > before;
            if missing && st.persisted {
                workload::record(
                    shared,
                    Violation::LostPersisted,
                    *id,
                    format!(
                        "{}: version {:?} acknowledged as persisted",
                        workload::key_name(*id),
                        st.present
                    ),
                );
            }
            false
        });
        if !todo.is_empty() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    for (id, _) in todo {
        eprintln!(
            "l3-chaos: {} could not be read at the end",
            workload::key_name(*id)
        );
    }
}

/// `label: wrong bytes N, stale versions N, …`, each kind's figure from `of`.
fn by_kind(label: &str, of: impl Fn(Violation) -> u64) -> String {
    const KINDS: [(Violation, &str); 5] = [
        (Violation::WrongBytes, "wrong bytes"),
        (Violation::StaleVersion, "stale versions"),
        (Violation::ResurrectedRemove, "resurrected removes"),
        (Violation::UnreportedLoss, "unreported losses"),
        (Violation::LostPersisted, "lost persisted puts"),
    ];
    let figures: Vec<String> = KINDS
        .iter()
        .map(|(v, name)| format!("{name} {}", of(*v)))
        .collect();
    format!("{label}: {}", figures.join(", "))
}

/// Prints the figures and returns the number of violations (0 for a clean, useful run).
fn report(
    a: &Args,
    kills: &Tally,
    keys: &Keys,
    shared: &Shared,
    counts: &Counts,
    restarted_at: Option<Instant>,
) -> u64 {
    let far = Instant::now() + Duration::from_secs(3_600);
    let mut f = workload::lock(&shared.findings);
    let reports = workload::lock(&shared.reports);
    let misses = std::mem::take(&mut f.misses);
    let mut explained = 0u64;
    for m in &misses {
        let k = workload::key_name(m.key_id);
        let until = match restarted_at {
            Some(r) if m.seen_at < r => r,
            _ => far,
        };
        // Losses seen after the final restart of everything: its overflow covers them.
        let overflow =
            a.journal == Journal::Overflow || restarted_at.is_some_and(|r| m.seen_at >= r);
        if reports.explains(&k, m, until, overflow) {
            explained += 1;
        } else {
            f.record(
                Violation::UnreportedLoss,
                m.key_id,
                format!(
                    "{k}: version {} not found and never reported lost ({})",
                    m.version,
                    reports.timeline(&k, m)
                ),
            );
        }
    }
    let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    println!(
        "l3-chaos: mode {:?}, faults {:?}, {} s, seed {}, {} nodes, {} workers x {} keys, \
         masters {}, journal {:?}",
        a.mode, a.faults, a.seconds, a.seed, a.nodes, a.workers, a.keys, a.masters, a.journal
    );
    println!("{}", kills.line());
    println!(
        "puts acked {} (persisted {}), failed {}; removes acked {}; reads checked {} (failed {}); \
         misses {} (explained by the loss journal {}); loss reports {} keys, {} overflows",
        n(&counts.puts_acked),
        n(&counts.puts_persisted),
        n(&counts.puts_failed),
        n(&counts.removes_acked),
        n(&counts.reads_checked),
        n(&counts.reads_failed),
        misses.len(),
        explained,
        reports.keys.values().map(Vec::len).sum::<usize>(),
        reports.overflows.len(),
    );
    println!("longest call: {} ms", n(&counts.longest_call_ms));
    println!(
        "{}",
        by_kind("violations", |v| f.counts.get(&v).copied().unwrap_or(0))
    );
    if f.total() > 0 {
        let keys_of = |v| f.keys.get(&v).map_or(0, |s| s.len() as u64);
        println!("{}", by_kind("keys with violations", keys_of));
    }
    for e in &f.examples {
        println!("  {e}");
    }
    let still_present = keys.iter().filter(|(_, s)| s.present.is_some()).count();
    println!(
        "keys: {} ({} present at the end)",
        keys.len(),
        still_present
    );
    let idle = n(&counts.puts_acked) == 0
        || n(&counts.reads_checked) == 0
        || (a.seconds > 0 && kills.total() == 0);
    if idle {
        println!("the run did no useful work (no acknowledged put, checked read or fault)");
        return f.total().max(1);
    }
    f.total()
}
