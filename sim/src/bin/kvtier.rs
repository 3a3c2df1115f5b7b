//! `kvtier`: the simulator and the L3 server roles from one command.
//!
//! `kvtier sim` replays a workload (a built-in multi-turn chat by default, or `--trace FILE`
//! in Mooncake's format) through the real scheduler and L3 store and prints per-tier hit rates,
//! TTFT and traffic; `--sweep` sizes the cache against the offline optimum; `kvtier l3 ...`
//! starts the L3 store server (the `kvtier-l3` binary's roles).

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use kvtier_radix::EvictionPolicy;
use kvtier_scheduler::{HostAdmission, QueueProtection, SchedulerConfig};
use kvtier_sim::matching_capacity::match_lru;
use kvtier_sim::plot::{ComparedRate, SweepPoint, SweepTitle, write_sweep_plot};
use kvtier_sim::report::Summary;
use kvtier_sim::workload::{
    ChatSpec, SimRequest, TraceReader, TraceSummary, WorkloadError, scan_trace, synthetic_chat,
};
use kvtier_sim::{Report, SimConfig, simulate_stream};
use kvtier_sim::{sweep, sweep_table};

#[path = "kvtier/router_bench_cli.rs"]
mod router_bench_cli;
#[path = "kvtier/sim_args.rs"]
mod sim_args;

use sim_args::{SimArgs, config};

#[derive(Parser)]
#[command(
    name = "kvtier",
    version,
    about = "kvtier: KV-cache tiering simulator and L3 store"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Replay a workload through the real scheduler and L3 store.
    Sim(Box<SimArgs>),
    /// Every router over the traces, instance counts and loads (docs/router/benchmark.md).
    RouterBench(Box<router_bench_cli::RouterBenchArgs>),
    /// Run the L3 store server: roles both | master | node (try `kvtier l3 --help`).
    #[command(disable_help_flag = true)]
    L3 {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Sim(a) => match run_sim(*a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(e),
        },
        Cmd::RouterBench(a) => match router_bench_cli::run(*a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(e),
        },
        Cmd::L3 { args } => run_l3(&args),
    }
}

fn run_l3(args: &[String]) -> ExitCode {
    kvtier_l3::cli::main_with_args(
        std::iter::once("kvtier l3".to_string()).chain(args.iter().cloned()),
    )
}

/// The requests to replay: a trace file streamed from disk (checked once up front, so a bad
/// line fails before anything runs), or the synthetic chat held in memory.
enum Workload {
    Trace {
        path: PathBuf,
        limit: Option<usize>,
        summary: TraceSummary,
    },
    Chat(Vec<SimRequest>),
}

type RequestStream = Box<dyn Iterator<Item = Result<SimRequest, WorkloadError>>>;

impl Workload {
    fn len(&self) -> usize {
        match self {
            Workload::Trace { summary, .. } => summary.requests,
            Workload::Chat(r) => r.len(),
        }
    }

    fn name(&self) -> String {
        match self {
            Workload::Trace { path, .. } => path.file_name().map_or_else(
                || path.display().to_string(),
                |f| f.to_string_lossy().into(),
            ),
            Workload::Chat(r) => format!("synthetic chat ({} requests)", r.len()),
        }
    }

    /// The name and the number of requests, once (the chat's name already has it).
    fn name_with_count(&self) -> String {
        match self {
            Workload::Trace { .. } => format!("{} ({} requests)", self.name(), self.len()),
            Workload::Chat(_) => self.name(),
        }
    }

    fn stream(&self) -> Result<RequestStream, String> {
        match self {
            Workload::Trace { path, limit, .. } => {
                let f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
                Ok(Box::new(TraceReader::new(BufReader::new(f), *limit)))
            }
            Workload::Chat(r) => Ok(Box::new(r.clone().into_iter().map(Ok))),
        }
    }
}

/// The policies that ran: eviction, and host admission and queue protection where they are
/// not the defaults.
fn policy_name(s: &SchedulerConfig) -> String {
    let mut name = match s.host_admission {
        HostAdmission::OnFinish => s.eviction.to_string(),
        h => format!("{} + {h}", s.eviction),
    };
    if s.queue_protection != QueueProtection::default() {
        name.push_str(&format!(" + protect:{}", s.queue_protection));
    }
    name
}

/// The same run under the simulator's other online policies (LRU and the conversation
/// setting of freq-depth, whichever did not run), for the side-by-side comparison. Beside the
/// adaptive policy, both fixed ones also run with demotion (`on-device-eviction:256`) where
/// the configuration allows it, so that the best fixed option is in the report.
fn compare(a: &SimArgs, cfg: &SimConfig, w: &Workload) -> Result<Vec<Summary>, String> {
    if a.no_compare {
        return Ok(Vec::new());
    }
    let mut settings = Vec::new();
    for p in [EvictionPolicy::Lru, EvictionPolicy::CONVERSATION] {
        if p == cfg.scheduler.eviction {
            continue;
        }
        settings.push((p, cfg.scheduler.host_admission));
    }
    if matches!(
        cfg.scheduler.eviction,
        EvictionPolicy::Adaptive | EvictionPolicy::Shadow
    ) {
        let demote = HostAdmission::OnDeviceEviction { ahead_pages: 256 };
        for p in [EvictionPolicy::Lru, EvictionPolicy::CONVERSATION] {
            for h in [HostAdmission::OnFinish, demote] {
                if !settings.contains(&(p, h)) {
                    settings.push((p, h));
                }
            }
        }
    }
    let mut out = Vec::new();
    for (p, h) in settings {
        let mut c = cfg.clone();
        c.scheduler.eviction = p;
        c.scheduler.host_admission = h;
        if c.effective_scheduler().validate().is_err() {
            continue;
        }
        let mut r = run_one(&c, w, |_| {})?;
        r.policy = policy_name(&c.scheduler);
        out.push(r.summary());
    }
    Ok(out)
}

fn workload(a: &SimArgs) -> Result<Workload, String> {
    if a.limit == Some(0) {
        return Err("--limit 0: no requests (at least 1)".into());
    }
    match &a.trace {
        Some(p) => {
            let f = File::open(p).map_err(|e| format!("{}: {e}", p.display()))?;
            let summary = scan_trace(BufReader::new(f), a.limit)
                .map_err(|e| format!("{}: {e}", p.display()))?;
            Ok(Workload::Trace {
                path: p.clone(),
                limit: a.limit,
                summary,
            })
        }
        None => {
            let mut spec = ChatSpec::default();
            if let Some(c) = a.clients {
                spec.clients = c;
            }
            if let Some(r) = a.rounds {
                spec.rounds = r;
            }
            spec.check()
                .map_err(|e| format!("--clients {} --rounds {}: {e}", spec.clients, spec.rounds))?;
            Ok(Workload::Chat(synthetic_chat(&spec)))
        }
    }
}

fn run_one(cfg: &SimConfig, w: &Workload, progress: impl FnMut(u64)) -> Result<Report, String> {
    simulate_stream(cfg, w.stream()?, progress)
}

/// `--sweep-out` must be a directory or a path one can be made at: the nearest part of it
/// that exists is a directory. Checked (writing nothing, so dry runs too) before a sweep
/// runs, since its files are written only after every point ran.
fn check_sweep_out(out: &Path) -> Result<(), String> {
    let here = Path::new(".");
    let existing = out
        .ancestors()
        .map(|p| if p.as_os_str().is_empty() { here } else { p })
        .find(|p| p.exists())
        .unwrap_or(here);
    if existing.is_dir() {
        return Ok(());
    }
    Err(if existing == out {
        format!("--sweep-out {}: not a directory", out.display())
    } else {
        format!(
            "--sweep-out {}: {} is not a directory",
            out.display(),
            existing.display()
        )
    })
}

fn sweep_out_error(out: &Path, e: std::io::Error) -> String {
    format!("--sweep-out {}: {e}", out.display())
}

/// Writes one of the sweep's files, the error naming it.
fn write_out(path: &Path, text: String) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

fn run_sim(a: SimArgs) -> Result<(), String> {
    let cfg = config(&a)?;
    let reqs = workload(&a)?;
    // every point checked before anything runs (or a dry run says it would)
    let plan = if a.sweep {
        check_sweep_out(&a.sweep_out)?;
        Some(sweep::plan(&cfg).map_err(|e| e.to_string())?)
    } else {
        None
    };
    if a.dry_run {
        println!(
            "dry run: {}, eviction {}, {}",
            reqs.name_with_count(),
            policy_name(&cfg.scheduler),
            match &plan {
                Some(p) => format!("capacity sweep of {} points", p.points.len()),
                None => "one run".into(),
            }
        );
        for l in plan.iter().flat_map(|p| &p.left_out) {
            println!("left out: {l}");
        }
        return Ok(());
    }
    let bar = |n: u64| {
        if a.quiet || a.json {
            ProgressBar::hidden()
        } else {
            let b = ProgressBar::new(n);
            b.set_style(
                ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:40}] {pos}/{len} requests ({eta})",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b
        }
    };
    let Some(plan) = plan else {
        let pb = bar(reqs.len() as u64);
        let mut report = run_one(&cfg, &reqs, |n| pb.set_position(n))?;
        pb.finish_and_clear();
        report.policy = policy_name(&cfg.scheduler);
        report.compared = compare(&a, &cfg, &reqs)?;
        if a.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
            );
        } else {
            println!(
                "kvtier sim: {} requests, profile {}, page {} tokens, device {} / host {} / L3 {} (+{} SSD) pages, {} instance(s)",
                reqs.len(),
                cfg.profile.name,
                cfg.scheduler.page_size,
                cfg.scheduler.device_pages,
                if cfg.scheduler.host_enabled {
                    cfg.scheduler.host_pages
                } else {
                    0
                },
                if cfg.scheduler.l3_enabled {
                    cfg.l3_pages
                } else {
                    0
                },
                if cfg.scheduler.l3_enabled {
                    cfg.l3_ssd_pages
                } else {
                    0
                },
                cfg.instances
            );
            print!("{}", report.table());
        }
        if report.oracle.failures > 0 {
            return Err(format!(
                "integrity oracle failed: {:?}",
                report.oracle.first_failures
            ));
        }
        return Ok(());
    };
    // made before the points run: a path that cannot be made fails now, not after them
    std::fs::create_dir_all(&a.sweep_out).map_err(|e| sweep_out_error(&a.sweep_out, e))?;
    let mut pts = Vec::new();
    let pb = bar(plan.points.len() as u64);
    let page_gb = (cfg.profile.kv_bytes_per_token * cfg.scheduler.page_size as u64) as f64 / 1e9;
    for (_, c) in plan.points {
        let r = run_one(&c, &reqs, |_| {})?;
        let compared = compare(&a, &c, &reqs)?;
        let cap = (c.scheduler.device_pages as u64
            + if c.scheduler.host_enabled {
                c.scheduler.host_pages as u64
            } else {
                0
            })
            * c.instances.max(1) as u64;
        let belady = r.belady_local.as_ref().or(r.belady.as_ref());
        pts.push(SweepPoint {
            capacity_pages: cap,
            capacity_gb: cap as f64 * page_gb,
            hit_rate: r.hits.total,
            device: r.hits.device,
            ttft_ms: r.ttft_ms.clone(),
            belady: belady.map_or(0.0, |b| b.hit_rate),
            compared: compared
                .into_iter()
                .map(|s| ComparedRate {
                    policy: s.policy,
                    hit_rate: s.hit_rate,
                    ttft_ms: s.ttft_ms,
                })
                .collect(),
            requests: r.requests,
            prompt_tokens: r.prompt_tokens,
            rejected: r.rejected,
            rejected_prompt_tokens: r.rejected_prompt_tokens,
        });
        pb.inc(1);
    }
    pb.finish_and_clear();
    write_out(
        &a.sweep_out.join("sweep.json"),
        serde_json::to_string_pretty(&pts).map_err(|e| e.to_string())?,
    )?;
    let s = &cfg.scheduler;
    let title = SweepTitle {
        workload: reqs.name(),
        host_per_device: if s.host_enabled {
            s.host_pages as f64 / s.device_pages.max(1) as f64
        } else {
            0.0
        },
        l3_pages: s.l3_enabled.then_some(cfg.l3_pages + cfg.l3_ssd_pages),
        model: cfg.profile.name.clone(),
        policy: policy_name(s),
    };
    write_sweep_plot(&a.sweep_out, "sweep", &title, &pts)?;
    let matched = match_lru(&title.policy, &pts);
    if let Some(m) = &matched {
        write_out(
            &a.sweep_out.join("match-lru.json"),
            serde_json::to_string_pretty(m).map_err(|e| e.to_string())?,
        )?;
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&pts).map_err(|e| e.to_string())?
        );
        for l in &plan.left_out {
            eprintln!("note: --sweep left out {l}");
        }
    } else {
        print!("{}", sweep_table::table(&title.policy, &pts));
        for l in &plan.left_out {
            println!("left out: {l}");
        }
        print!(
            "{}",
            sweep_table::match_lines(&title.policy, &pts, matched.as_ref())
        );
        println!("plot: {}/sweep.svg and sweep.png", a.sweep_out.display());
    }
    Ok(())
}
