//! # kvtier-sim — replay workloads through kvtier's real scheduler and L3 store
//!
//! Users size their device, host and L3 tiers and choose policies before buying hardware; we
//! prove the scheduler never serves wrong KV. Both need a simulator that drives the real
//! [`kvtier_scheduler::Scheduler`] and the real embedded [`kvtier_l3::EmbeddedStore`] (no
//! re-implementation of either) with a modelled engine in between: a simulated clock, forward
//! and copy costs from a model profile, and an integrity oracle on every page read.
//!
//! - [`workload`]: Mooncake trace parsing, synthetic multi-turn chat, routing to instances;
//! - [`profile`]: model and link cost models;
//! - [`engine`]: the discrete-event loop and the oracle;
//! - [`belady`]: the offline-optimal (MIN) ceiling;
//! - [`report`]: hit rates per tier, TTFT percentiles, traffic, ops;
//! - [`routing`]: which instance serves each request (round-robin … Dynamo's and kvtier's
//!   KV-aware routers); [`router_bench`]: the routers compared over traces and loads, against
//!   [`ttft_floor`], the TTFT no router can beat;
//! - [`sweep`]: the capacity sweep's points; [`plot`]: hit rate against capacity (SVG and
//!   PNG).

pub mod belady;
pub mod config;
pub mod engine;
pub mod matching_capacity;
pub mod plot;
pub mod profile;
pub mod report;
pub mod router_bench;
pub mod router_plot;
pub mod routing;
pub mod sweep;
pub mod sweep_table;
pub mod ttft_floor;
pub mod workload;

pub use config::{Faults, SimConfig};
pub use engine::Simulation;
pub use report::Report;

/// Runs `reqs` under `cfg` and adds the Belady ceiling for the same total capacity
/// (every instance's device + host pages, plus L3 when enabled).
pub fn simulate(
    cfg: &SimConfig,
    reqs: &[workload::SimRequest],
    progress: impl FnMut(u64),
) -> Result<Report, String> {
    simulate_stream(cfg, reqs.iter().cloned().map(Ok), progress)
}

/// [`simulate`] over a stream of requests (e.g. a [`workload::TraceReader`]): requests are
/// pulled as the simulated clock reaches them, so memory does not grow with the workload.
pub fn simulate_stream(
    cfg: &SimConfig,
    reqs: impl IntoIterator<Item = Result<workload::SimRequest, workload::WorkloadError>>,
    progress: impl FnMut(u64),
) -> Result<Report, String> {
    let sim = Simulation::new(cfg.clone())?;
    let mut report = sim.run(reqs, progress)?;
    let s = &cfg.scheduler;
    let local = (s.device_pages as u64
        + if s.host_enabled {
            s.host_pages as u64
        } else {
            0
        })
        * cfg.instances.max(1) as u64;
    let l3 = if s.l3_enabled {
        cfg.l3_pages + cfg.l3_ssd_pages
    } else {
        0
    };
    let accesses = std::mem::take(&mut report.accesses);
    let bound = |capacity: u64| {
        accesses
            .belady_hits(capacity)
            .map(|hit_pages| report::BeladyBound {
                capacity_pages: capacity,
                hit_rate: if report.prompt_tokens == 0 {
                    0.0
                } else {
                    (hit_pages * s.page_size as u64) as f64 / report.prompt_tokens as f64
                },
                hit_pages,
            })
    };
    report.belady = bound(local + l3);
    if l3 > 0 {
        report.belady_local = bound(local);
    }
    Ok(report)
}
