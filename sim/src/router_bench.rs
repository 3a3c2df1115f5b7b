//! `kvtier router-bench`: every router over the same workloads, instance counts and loads,
//! in one invocation, with a table, a JSON file and a plot.
//!
//! Why scale time and not the request count: a trace's sharing (which prompts repeat, in
//! which order) is what routers are judged on, so the requests stay the same and only their
//! arrival times are stretched or compressed.
//!
//! Why a measured capacity: the profile's prefill rate alone overstates what an instance
//! sustains, because decode steps share its forward passes and its device memory bounds the
//! batch (at "85 % of the prefill rate" the first 2,000 conversation requests queued for a
//! minute). So the capacity is measured: the workload runs once per instance count with
//! every request arriving at time 0 under round-robin (no cache awareness), and the prompt
//! tokens per simulated second it completes are the cluster's capacity. A load of 0.85 then
//! scales arrival times so that the workload offers 85 % of that (prompt tokens over the
//! arrival span).

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::config::SimConfig;
use crate::report::{Percentiles, Report};
use crate::ttft_floor::floor_percentiles;
use crate::workload::{ChatSpec, Routing, SimRequest, TraceReader, WorkloadError, synthetic_chat};

/// A workload of the benchmark.
#[derive(Clone, Debug)]
pub enum BenchWorkload {
    /// A Mooncake-format trace, its first `limit` requests.
    Trace { path: PathBuf, limit: Option<usize> },
    /// The built-in multi-turn chat.
    Chat(ChatSpec),
}

impl BenchWorkload {
    pub fn name(&self) -> String {
        match self {
            BenchWorkload::Trace { path, .. } => path.file_stem().map_or_else(
                || path.display().to_string(),
                |f| f.to_string_lossy().into(),
            ),
            BenchWorkload::Chat(_) => "chat".into(),
        }
    }

    /// The requests, as a stream (traces are not held in memory).
    fn stream(
        &self,
    ) -> Result<Box<dyn Iterator<Item = Result<SimRequest, WorkloadError>>>, String> {
        match self {
            BenchWorkload::Trace { path, limit } => {
                let f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
                Ok(Box::new(TraceReader::new(BufReader::new(f), *limit)))
            }
            BenchWorkload::Chat(spec) => Ok(Box::new(synthetic_chat(spec).into_iter().map(Ok))),
        }
    }

    /// The requests with their arrival times multiplied by `scale`.
    pub fn scaled(
        &self,
        scale: f64,
    ) -> Result<impl Iterator<Item = Result<SimRequest, WorkloadError>> + use<>, String> {
        Ok(self.stream()?.map(move |r| {
            r.map(|mut r| {
                r.arrival_ms = (r.arrival_ms as f64 * scale).round() as u64;
                r
            })
        }))
    }

    /// The TTFT no router can beat ([`crate::ttft_floor`]) when arrival times are multiplied
    /// by `scale`, under `base`'s model and chunking.
    pub fn floor(&self, base: &SimConfig, scale: f64) -> Result<Percentiles, String> {
        floor_percentiles(base, self.scaled(scale)?).map_err(|e| format!("{}: {e}", self.name()))
    }

    /// Requests, prompt tokens and arrival span (ms) of the workload; a bad trace line is an
    /// error naming it.
    pub fn measure(&self) -> Result<WorkloadSize, String> {
        let mut size = WorkloadSize::default();
        let (mut first, mut last) = (u64::MAX, 0);
        for r in self.stream()? {
            let r = r.map_err(|e| format!("{}: {e}", self.name()))?;
            size.requests += 1;
            size.prompt_tokens += r.prompt.len() as u64;
            first = first.min(r.arrival_ms);
            last = last.max(r.arrival_ms);
        }
        if size.requests == 0 {
            return Err(format!("{}: {}", self.name(), WorkloadError::Empty));
        }
        size.span_ms = last.saturating_sub(first).max(1);
        Ok(size)
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WorkloadSize {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub span_ms: u64,
}

/// The factor arrival times are multiplied by so that `size` offers `load` of a cluster
/// capacity of `capacity_tokens_per_s` prompt tokens per second.
pub fn time_scale(size: &WorkloadSize, capacity_tokens_per_s: f64, load: f64) -> f64 {
    let offered = size.prompt_tokens as f64 / (size.span_ms as f64 / 1e3);
    offered / (load * capacity_tokens_per_s)
}

/// Prompt tokens per simulated second `instances` complete when every request of `w` arrives
/// at once under round-robin: the cluster's capacity for this workload.
pub fn capacity(w: &BenchWorkload, base: &SimConfig, instances: usize) -> Result<f64, String> {
    let cfg = run_config(base, instances, Routing::RoundRobin);
    let reqs = w.stream()?.map(|r| {
        r.map(|mut r| {
            r.arrival_ms = 0;
            r
        })
    });
    let r = crate::simulate_stream(&cfg, reqs, |_| {})?;
    if r.simulated_seconds > 0.0 && r.prompt_tokens > 0 {
        Ok(r.prompt_tokens as f64 / r.simulated_seconds)
    } else {
        Err(format!("{}: no prompt tokens completed", w.name()))
    }
}

/// What one invocation runs.
#[derive(Clone, Debug)]
pub struct BenchSpec {
    pub workloads: Vec<BenchWorkload>,
    pub instances: Vec<usize>,
    pub loads: Vec<f64>,
    pub routers: Vec<Routing>,
    /// Everything else (cache sizes, model, links) for every run.
    pub base: SimConfig,
}

/// One run's figures.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    pub workload: String,
    pub instances: usize,
    pub load: f64,
    /// The measured capacity the load is a fraction of (prompt tokens per second).
    pub capacity_tokens_per_s: f64,
    /// Arrival times were multiplied by this.
    pub time_scale: f64,
    pub router: String,
    pub requests: u64,
    /// Requests routed (all instances): equals `requests`.
    pub routed: u64,
    pub ttft_ms: Percentiles,
    /// TTFT no router can beat at this point ([`crate::ttft_floor`]): the same for every
    /// router.
    pub floor_ms: Percentiles,
    pub hit_device: f64,
    pub hit_host: f64,
    pub hit_l3: f64,
    pub busy_max_s: f64,
    pub busy_min_s: f64,
    pub index_pages: u64,
    pub index_bytes: Option<u64>,
    /// Index bytes per million entries.
    pub index_bytes_per_m_pages: Option<f64>,
    pub oracle_failures: u64,
}

impl BenchRow {
    fn new(
        w: &BenchWorkload,
        cfg: &SimConfig,
        load: f64,
        (capacity, scale): (f64, f64),
        size: &WorkloadSize,
        floor_ms: &Percentiles,
        r: &Report,
    ) -> Self {
        let (busy_max_s, busy_min_s) = r.routing.busy_max_min();
        let idx = &r.routing.index;
        BenchRow {
            workload: w.name(),
            instances: cfg.instances,
            load,
            capacity_tokens_per_s: capacity,
            time_scale: scale,
            router: cfg.routing.name().into(),
            requests: size.requests,
            routed: r.routing.routed.iter().sum(),
            ttft_ms: r.ttft_ms.clone(),
            floor_ms: floor_ms.clone(),
            hit_device: r.hits.device,
            hit_host: r.hits.host,
            hit_l3: r.hits.l3,
            busy_max_s,
            busy_min_s,
            index_pages: idx.pages,
            index_bytes: idx.bytes,
            index_bytes_per_m_pages: idx
                .bytes
                .filter(|_| idx.pages > 0)
                .map(|b| b as f64 * 1e6 / idx.pages as f64),
            oracle_failures: r.oracle.failures,
        }
    }
}

/// The configuration of one run.
pub fn run_config(base: &SimConfig, instances: usize, router: Routing) -> SimConfig {
    let mut c = base.clone();
    c.instances = instances.max(1);
    c.routing = router;
    c
}

/// Runs every combination; `progress` is told each row as it is done.
pub fn run(spec: &BenchSpec, mut progress: impl FnMut(&BenchRow)) -> Result<Vec<BenchRow>, String> {
    let mut rows = Vec::new();
    for w in &spec.workloads {
        let size = w.measure()?;
        for &n in &spec.instances {
            let cap = capacity(w, &spec.base, n)?;
            for &load in &spec.loads {
                let scale = time_scale(&size, cap, load);
                let floor = w.floor(&spec.base, scale)?;
                for &router in &spec.routers {
                    let cfg = run_config(&spec.base, n, router);
                    let report = crate::simulate_stream(&cfg, w.scaled(scale)?, |_| {})?;
                    let row = BenchRow::new(w, &cfg, load, (cap, scale), &size, &floor, &report);
                    progress(&row);
                    rows.push(row);
                }
            }
        }
    }
    Ok(rows)
}

fn fmt_bytes_per_m(b: Option<f64>) -> String {
    b.map_or_else(|| "n/a".into(), |b| format!("{:.1} MB", b / 1e6))
}

/// The rows as a Markdown table.
pub fn table(rows: &[BenchRow]) -> String {
    let mut s = String::from(
        "| workload | inst | load | router | TTFT p50 ms | p90 ms | p99 ms | hit GPU | hit host | hit L3 | busy max s | busy min s | index entries | index bytes | bytes / M entries |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        s += &format!(
            "| {} | {} | {:.2} | {} | {:.0} | {:.0} | {:.0} | {:.3} | {:.3} | {:.3} | {:.1} | {:.1} | {} | {} | {} |\n",
            r.workload,
            r.instances,
            r.load,
            r.router,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.hit_device,
            r.hit_host,
            r.hit_l3,
            r.busy_max_s,
            r.busy_min_s,
            r.index_pages,
            r.index_bytes
                .map_or_else(|| "n/a".into(), |b| b.to_string()),
            fmt_bytes_per_m(r.index_bytes_per_m_pages),
        );
    }
    s
}

/// How kvtier's router compares with another at each (workload, instances, load): p99 and
/// p50 ratios (other / kvtier; above 1 means kvtier's is lower), and the other's p99 over the
/// floor's: the most any router could lower it.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub workload: String,
    pub instances: usize,
    pub load: f64,
    pub against: String,
    pub p99_ratio: f64,
    pub p50_ratio: f64,
    /// The other router's p99 over the floor's p99: no router's p99 ratio can exceed it.
    pub p99_over_floor: f64,
    /// The floor's p99 (ms).
    pub floor_p99_ms: f64,
}

pub fn compare(rows: &[BenchRow], against: Routing) -> Vec<Comparison> {
    let find = |w: &str, n: usize, l: f64, router: Routing| {
        rows.iter().find(|r| {
            r.workload == w && r.instances == n && r.load == l && r.router == router.name()
        })
    };
    rows.iter()
        .filter(|r| r.router == Routing::Kvtier.name())
        .filter_map(|k| {
            let o = find(&k.workload, k.instances, k.load, against)?;
            let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::INFINITY };
            Some(Comparison {
                workload: k.workload.clone(),
                instances: k.instances,
                load: k.load,
                against: against.name().into(),
                p99_ratio: ratio(o.ttft_ms.p99, k.ttft_ms.p99),
                p50_ratio: ratio(o.ttft_ms.p50, k.ttft_ms.p50),
                p99_over_floor: ratio(o.ttft_ms.p99, k.floor_ms.p99),
                floor_p99_ms: k.floor_ms.p99,
            })
        })
        .collect()
}

/// Writes `router-bench.json`, `router-bench.md` (the table) and the plot into `dir`.
pub fn write_outputs(dir: &Path, rows: &[BenchRow]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let json = serde_json::to_string_pretty(rows).map_err(|e| e.to_string())?;
    let w = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))
    };
    w("router-bench.json", &json)?;
    let mut md = table(rows);
    for against in [Routing::Dynamo, Routing::RoundRobin] {
        md += &format!(
            "\n| workload | inst | load | {0} p99 / kvtier p99 | {0} p50 / kvtier p50 | floor p99 ms | {0} p99 / floor p99 (the most any router can gain) |\n|---|---|---|---|---|---|---|\n",
            against.name()
        );
        for c in compare(rows, against) {
            md += &format!(
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.0} | {:.2} |\n",
                c.workload,
                c.instances,
                c.load,
                c.p99_ratio,
                c.p50_ratio,
                c.floor_p99_ms,
                c.p99_over_floor
            );
        }
    }
    w("router-bench.md", &md)?;
    crate::router_plot::write_router_plot(dir, rows)
}
