//! The TTFT floor ([`kvtier_sim::ttft_floor`]) of every point of an existing `router-bench`
//! result, without running the routers again: for each (workload, instances, load) of the
//! JSON, the floor at that point's time scale, and each router's p99 over it (the most any
//! router could lower that router's p99).
//!
//! Run: `cargo run --release -p kvtier-sim --example ttft_floor -- docs/router/whole/router-bench.json 100000`
//! (the JSON, then the `--limit` the bench ran with; traces are read from `traces/<workload>.jsonl`,
//! the chat is the bench's default chat). Prints a Markdown table.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvtier_sim::SimConfig;
use kvtier_sim::router_bench::BenchWorkload;
use kvtier_sim::workload::ChatSpec;

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let json = args
        .next()
        .ok_or("usage: ttft_floor <router-bench.json> [limit]")?;
    let limit: usize = match args.next() {
        Some(l) => l.parse().map_err(|e| format!("limit {l}: {e}"))?,
        None => 2000,
    };
    let text = std::fs::read_to_string(&json).map_err(|e| format!("{json}: {e}"))?;
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&text).map_err(|e| format!("{json}: {e}"))?;
    // (workload, instances, load in thousandths) -> (time scale, router -> p99 ms)
    type Point = (String, u64, u64);
    let mut points: BTreeMap<Point, (f64, BTreeMap<String, f64>)> = BTreeMap::new();
    for r in &rows {
        let field = |k: &str| r.get(k).ok_or(format!("{json}: a row without `{k}`"));
        let num = |k: &str| {
            field(k)?
                .as_f64()
                .ok_or(format!("{json}: `{k}` is not a number"))
        };
        let text = |k: &str| {
            field(k)?
                .as_str()
                .map(str::to_owned)
                .ok_or(format!("{json}: `{k}` is not text"))
        };
        let p99 = field("ttft_ms")?
            .get("p99")
            .and_then(|v| v.as_f64())
            .ok_or(format!("{json}: a row without ttft_ms.p99"))?;
        let key = (
            text("workload")?,
            num("instances")? as u64,
            (num("load")? * 1000.0).round() as u64,
        );
        let e = points.entry(key).or_insert_with(|| (0.0, BTreeMap::new()));
        e.0 = num("time_scale")?;
        e.1.insert(text("router")?, p99);
    }
    let base = SimConfig::default();
    println!(
        "| workload | inst | load | floor p50 ms | floor p99 ms | router p99 / floor p99 |\n|---|---|---|---|---|---|"
    );
    for ((w, n, load), (scale, p99s)) in &points {
        let workload = if w == "chat" {
            BenchWorkload::Chat(ChatSpec::default())
        } else {
            BenchWorkload::Trace {
                path: PathBuf::from(format!("traces/{w}.jsonl")),
                limit: Some(limit),
            }
        };
        let f = workload.floor(&base, *scale)?;
        let ratios: Vec<String> = p99s
            .iter()
            .map(|(r, p)| format!("{r} {:.2}", p / f.p99))
            .collect();
        println!(
            "| {w} | {n} | {:.2} | {:.0} | {:.0} | {} |",
            *load as f64 / 1000.0,
            f.p50,
            f.p99,
            ratios.join(", ")
        );
    }
    Ok(())
}
