//! Which requests stand between kvtier's router and a p99 goal against Dynamo's at one
//! `router-bench` point, and what the TTFT floor says of each.
//!
//! Why: the goal "p99 ≥ 1.3× lower than Dynamo's" is a count. With n requests, the p99 (nearest
//! rank) is under a target exactly when at most `n − 1 − round(0.99 (n − 1))` of them take
//! longer (20 of 2,000). Requests whose floor ([`kvtier_sim::ttft_floor`]) is already above the
//! target take longer under any router; the others are what a better router would have to
//! bring under it. For each of those this lists its prompt, its TTFT under both routers, its
//! floor, and the earlier request that offered the longest prefix of it (where that one ran,
//! and how long before), which is what the floor counts as free; and the TTFT it would have
//! alone on an idle instance if that prefix were loaded from host memory or from the L3 at
//! the links' bandwidth (the load and the compute of the rest one after the other, as
//! `kvtier-router`'s cost model counts them), to tell a prefix any cache tier would have
//! brought under the goal from one only the device could.
//!
//! Usage: `p99_anatomy TRACE INSTANCES LOAD [LIMIT] [GOAL] [L3_PAGES] [L3_LINK]` (the first
//! 2,000 requests, 1.3, the simulator's 131,072 L3 pages and its `shared` L3 link by default,
//! as `router-bench`); prints
//! a summary row and a row per such request.

use std::collections::HashMap;
use std::path::PathBuf;

use kvtier_events::HashFormat;
use kvtier_radix::page_hashes;
use kvtier_sim::SimConfig;
use kvtier_sim::profile::L3Link;
use kvtier_sim::report::{Report, RequestTiming};
use kvtier_sim::router_bench::{BenchWorkload, capacity, run_config, time_scale};
use kvtier_sim::ttft_floor::{floors_us, lone_prefill_us};
use kvtier_sim::workload::{Routing, SimRequest};

fn arg<T: std::str::FromStr>(args: &[String], i: usize, default: Option<T>) -> Result<T, String> {
    match args.get(i) {
        Some(s) => s
            .parse()
            .map_err(|_| format!("argument {i}: {s:?} is not valid")),
        None => default.ok_or_else(|| {
            "usage: p99_anatomy TRACE INSTANCES LOAD [LIMIT] [GOAL] [L3_PAGES] [L3_LINK]"
                .to_string()
        }),
    }
}

/// Per request (by position in `reqs`): the earlier request whose prompt offered the longest
/// prefix of its prompt, and that prefix in pages (page hashes chain over the prefix, so the
/// deepest page seen before is the whole shared prefix).
fn offered_prefixes(reqs: &[SimRequest], page_size: usize) -> Vec<Option<(usize, usize)>> {
    let mut first_offer: HashMap<u64, usize> = HashMap::new();
    let mut out = Vec::with_capacity(reqs.len());
    for (i, r) in reqs.iter().enumerate() {
        let hashes: Vec<u64> = page_hashes(&r.prompt, page_size, None)
            .iter()
            .map(HashFormat::int64)
            .collect();
        let deepest = hashes
            .iter()
            .enumerate()
            .rev()
            .find_map(|(d, h)| first_offer.get(h).map(|&j| (j, d + 1)));
        out.push(deepest);
        for h in hashes {
            first_offer.entry(h).or_insert(i);
        }
    }
    out
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let path: PathBuf = arg(&args, 1, None)?;
    let instances: usize = arg(&args, 2, None)?;
    let load: f64 = arg(&args, 3, None)?;
    let limit: usize = arg(&args, 4, Some(2000))?;
    let goal: f64 = arg(&args, 5, Some(1.3))?;
    let mut base = SimConfig::default();
    base.l3_pages = arg(&args, 6, Some(base.l3_pages))?;
    if let Some(link) = args.get(7) {
        base.links.l3_link = <L3Link as clap::ValueEnum>::from_str(link, false)
            .map_err(|e| format!("argument 7: {e}"))?;
    }
    let w = BenchWorkload::Trace {
        path,
        limit: Some(limit),
    };
    let size = w.measure()?;
    let cap = capacity(&w, &base, instances)?;
    let scale = time_scale(&size, cap, load);
    let reqs: Vec<SimRequest> = w
        .scaled(scale)?
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let floors = floors_us(&base, reqs.iter().cloned().map(Ok)).map_err(|e| e.to_string())?;
    let page_size = base.scheduler.page_size.max(1);
    let page_bytes = (page_size as u64 * base.profile.kv_bytes_per_token) as f64;
    let offered = offered_prefixes(&reqs, page_size);
    let position: HashMap<u64, usize> = reqs.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
    let sim = |router| -> Result<Report, String> {
        let cfg = run_config(&base, instances, router);
        kvtier_sim::simulate_stream(&cfg, reqs.iter().cloned().map(Ok), |_| {})
    };
    let dynamo = sim(Routing::Dynamo)?;
    let kvtier = sim(Routing::Kvtier)?;
    let by_id = |r: &Report| -> HashMap<u64, RequestTiming> {
        r.timings.iter().map(|t| (t.id, *t)).collect()
    };
    let (dyn_t, kv_t) = (by_id(&dynamo), by_id(&kvtier));
    let target_us = dynamo.ttft_ms.p99 * 1000.0 / goal;
    let n = kvtier.timings.len();
    let may_exceed = n.saturating_sub(1) - ((n.saturating_sub(1) as f64) * 0.99).round() as usize;
    let floor_over = floors.iter().filter(|&&f| f as f64 > target_us).count();
    let mut over: Vec<&RequestTiming> = kvtier
        .timings
        .iter()
        .filter(|t| t.ttft_us as f64 > target_us)
        .collect();
    let kv_over = over.len();
    over.retain(|t| {
        position
            .get(&t.id)
            .is_some_and(|&i| floors[i] as f64 <= target_us)
    });
    over.sort_by_key(|t| std::cmp::Reverse(t.ttft_us));
    let name = w.name();
    println!(
        "| workload | inst | load | Dynamo p99 ms | goal: kvtier p99 at most (ms) | requests that may take longer | whose floor takes longer | that take longer under kvtier | of those, the floor does not (listed below) | kvtier p99 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {name} | {instances} | {load:.2} | {:.0} | {:.0} | {may_exceed} | {floor_over} | {kv_over} | {} | {:.0} |",
        dynamo.ttft_ms.p99,
        target_us / 1000.0,
        over.len(),
        kvtier.ttft_ms.p99
    );
    println!();
    println!(
        "| workload | request | instance | prompt tokens | kvtier TTFT ms | Dynamo TTFT ms | floor ms | prefix pages offered earlier | offered by (request, its instance, seconds before) | alone, prefix from host ms | alone, prefix from L3 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for t in over {
        let i = position[&t.id];
        let dyn_ms = dyn_t.get(&t.id).map_or("-".to_string(), |d| {
            format!("{:.0}", d.ttft_us as f64 / 1000.0)
        });
        let (pages, by) = match offered[i] {
            Some((j, pages)) => {
                let earlier = &reqs[j];
                let by = match kv_t.get(&earlier.id) {
                    Some(e) => format!(
                        "{}, {}, {:.1}",
                        earlier.id,
                        e.instance,
                        (t.arrival_us as f64 - e.arrival_us as f64) / 1e6
                    ),
                    None => format!("{}, -, -", earlier.id),
                };
                (pages, by)
            }
            None => (0, "-".to_string()),
        };
        let rest_us =
            lone_prefill_us(&base, t.prompt_tokens.saturating_sub(pages * page_size)) as f64;
        let load_ms =
            |gb_per_s: f64| (pages as f64 * page_bytes / (gb_per_s * 1e9) * 1e6 + rest_us) / 1000.0;
        println!(
            "| {name} | {} | {} | {} | {:.0} | {dyn_ms} | {:.0} | {pages} | {by} | {:.0} | {:.0} |",
            t.id,
            t.instance,
            t.prompt_tokens,
            t.ttft_us as f64 / 1000.0,
            floors[i] as f64 / 1000.0,
            load_ms(base.links.pcie_gb_per_s),
            load_ms(base.links.l3_gb_per_s)
        );
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("p99_anatomy: {e}");
        std::process::exit(2);
    }
}
