//! `kvtier router-bench`: the flags of the router benchmark (`kvtier_sim::router_bench`).

use std::path::PathBuf;

use clap::Parser;

use kvtier_sim::SimConfig;
use kvtier_sim::router_bench::{self, BenchSpec, BenchWorkload};
use kvtier_sim::workload::{ChatSpec, Routing};

#[derive(Parser, Debug)]
pub struct RouterBenchArgs {
    /// Workloads: Mooncake trace files, or `chat` for the built-in multi-turn chat.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "traces/conversation_trace.jsonl,traces/synthetic_trace.jsonl,chat"
    )]
    workloads: Vec<String>,
    /// Use only the first N requests of each trace.
    #[arg(long, default_value_t = 2000)]
    limit: usize,
    /// Chat workload: clients and rounds.
    #[arg(long)]
    clients: Option<u32>,
    #[arg(long)]
    rounds: Option<u32>,
    /// Instance counts (all sharing one L3).
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    instances: Vec<usize>,
    /// Offered prefill loads, as fractions of the instances' prefill capacity.
    #[arg(long, value_delimiter = ',', default_value = "0.5,0.85")]
    loads: Vec<f64>,
    /// Routers to compare.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "round-robin,least-loaded,session,dynamo,kvtier"
    )]
    routers: Vec<Routing>,
    /// TOML file with a SimConfig for every run (cache sizes, model, links).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Where router-bench.{json,md,svg,png} go.
    #[arg(long, default_value = "router-bench")]
    out: PathBuf,
    /// No line per run.
    #[arg(long)]
    quiet: bool,
    /// Check the flags and workloads, say what would run, run nothing.
    #[arg(long)]
    dry_run: bool,
}

fn spec(a: &RouterBenchArgs) -> Result<BenchSpec, String> {
    let base = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
            SimConfig::from_toml(&text).map_err(|e| format!("{}: {e}", p.display()))?
        }
        None => SimConfig::default(),
    };
    base.effective_scheduler()
        .validate()
        .map_err(|e| format!("configuration: {e}"))?;
    if a.instances.contains(&0) {
        return Err("--instances: counts must be positive".into());
    }
    // what `kvtier sim` refuses, for every instance count the bench runs (it ran unchecked:
    // payload_bytes 7 panicked in the oracle, 5,000 instances ran past the cap)
    for &n in &a.instances {
        router_bench::run_config(&base, n, Routing::RoundRobin)
            .check()
            .map_err(|e| format!("configuration: {e}"))?;
    }
    if a.loads.iter().any(|&l| !(l > 0.0 && l.is_finite())) {
        return Err("--loads: loads must be positive fractions".into());
    }
    if a.limit == 0 {
        return Err("--limit must be positive".into());
    }
    let workloads = a
        .workloads
        .iter()
        .map(|w| {
            if w == "chat" {
                let d = ChatSpec::default();
                let spec = ChatSpec {
                    clients: a.clients.unwrap_or(d.clients),
                    rounds: a.rounds.unwrap_or(d.rounds),
                    ..d
                };
                spec.check().map_err(|e| {
                    format!("--clients {} --rounds {}: {e}", spec.clients, spec.rounds)
                })?;
                Ok(BenchWorkload::Chat(spec))
            } else {
                Ok(BenchWorkload::Trace {
                    path: PathBuf::from(w),
                    limit: Some(a.limit),
                })
            }
        })
        .collect::<Result<_, String>>()?;
    Ok(BenchSpec {
        workloads,
        instances: a.instances.clone(),
        loads: a.loads.clone(),
        routers: a.routers.clone(),
        base,
    })
}

pub fn run(a: RouterBenchArgs) -> Result<(), String> {
    let spec = spec(&a)?;
    if a.dry_run {
        let mut names = Vec::new();
        for w in &spec.workloads {
            let size = w.measure()?;
            names.push(format!("{} ({} requests)", w.name(), size.requests));
        }
        println!(
            "dry run: router bench, {}; instances {:?}, loads {:?}, {} routers: {} runs",
            names.join(", "),
            spec.instances,
            spec.loads,
            spec.routers.len(),
            spec.workloads.len() * spec.instances.len() * spec.loads.len() * spec.routers.len()
        );
        return Ok(());
    }
    let rows = router_bench::run(&spec, |r| {
        if !a.quiet {
            eprintln!(
                "{} {}x load {:.2} {}: TTFT p50/p99 {:.0}/{:.0} ms (floor {:.0}/{:.0})",
                r.workload,
                r.instances,
                r.load,
                r.router,
                r.ttft_ms.p50,
                r.ttft_ms.p99,
                r.floor_ms.p50,
                r.floor_ms.p99
            );
        }
    })?;
    router_bench::write_outputs(&a.out, &rows)?;
    print!("{}", router_bench::table(&rows));
    println!(
        "written: {}/router-bench.{{json,md,svg,png}}",
        a.out.display()
    );
    Ok(())
}
