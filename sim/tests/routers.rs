//! The routers of `--router`: every run routes every request, runs repeat for a seed, the
//! KV-aware routers receive every tier's events, least-loaded balances, and the benchmark's
//! load scaling hits its target.

use kvtier_sim::report::{Report, RequestTiming};
use kvtier_sim::router_bench::{BenchWorkload, WorkloadSize, time_scale};
use kvtier_sim::ttft_floor::{floor_percentiles, floors_us};
use kvtier_sim::workload::{ChatSpec, Routing, SimRequest, TraceReader, synthetic_chat};
use kvtier_sim::{SimConfig, simulate};
use proptest::prelude::*;

/// Small tiers so that pages move: host copies, evictions, L3 backups and prefetches.
fn small(instances: usize, router: Routing) -> SimConfig {
    let mut c = SimConfig {
        instances,
        routing: router,
        ..SimConfig::default()
    };
    c.scheduler.device_pages = 96;
    c.scheduler.host_pages = 192;
    c.l3_pages = 4096;
    c
}

fn chat(clients: u32, rounds: u32, seed: u64) -> Vec<kvtier_sim::workload::SimRequest> {
    synthetic_chat(&ChatSpec {
        clients,
        rounds,
        system_prompt_tokens: 512,
        turn_tokens: 256,
        answer_tokens: 32,
        think_ms: 300,
        client_interarrival_ms: 40,
        seed,
    })
}

#[test]
fn every_router_routes_every_request_and_the_oracle_holds() {
    let reqs = chat(10, 3, 1);
    for router in Routing::ALL {
        let r = simulate(&small(3, router), &reqs, |_| {}).unwrap();
        assert_eq!(
            r.routing.routed.iter().sum::<u64>(),
            reqs.len() as u64,
            "{router:?}"
        );
        assert_eq!(r.routing.router, router.name());
        assert_eq!(r.oracle.failures, 0, "{router:?}: {:?}", r.oracle);
        assert_eq!(r.routing.busy_s.len(), 3);
        assert!(r.routing.busy_s.iter().sum::<f64>() > 0.0);
    }
}

#[test]
fn the_kv_aware_routers_get_every_tiers_events() {
    let reqs = chat(12, 4, 2);
    let d = simulate(&small(2, Routing::Dynamo), &reqs, |_| {}).unwrap();
    let idx = &d.routing.index;
    // GPU, CPU and STORAGE events all reached Dynamo, none refused by its decoder.
    assert!(idx.events.iter().all(|&n| n > 0), "{idx:?}");
    assert_eq!(idx.rejected, 0, "{idx:?}");
    assert!(idx.pages > 0);
    let k = simulate(&small(2, Routing::Kvtier), &reqs, |_| {}).unwrap();
    let idx = &k.routing.index;
    assert_eq!(idx.rejected, 0, "{idx:?}");
    assert!(idx.pages > 0 && idx.bytes.is_some_and(|b| b > 0), "{idx:?}");
}

/// kvtier's router learns the shared store from the store's own stream: with a store small
/// enough to evict and objects lost on purpose, its view at the end is still exactly what
/// the store holds (the run's end-of-run check; an oracle failure otherwise).
#[test]
fn kvtiers_store_view_follows_evictions_and_losses() {
    let reqs = chat(12, 4, 3);
    for (l3_pages, lose_every) in [(96, 0), (160, 7), (4096, 3)] {
        let mut c = small(3, Routing::Kvtier);
        c.l3_pages = l3_pages;
        c.faults.lose_l3_every = lose_every;
        let r = simulate(&c, &reqs, |_| {}).unwrap();
        assert_eq!(
            r.oracle.failures, 0,
            "{l3_pages} {lose_every}: {:?}",
            r.oracle
        );
        assert_eq!(r.routing.index.rejected, 0);
        assert!(r.l3_objects > 0, "the store holds pages");
    }
}

#[test]
fn least_loaded_spreads_a_burst_evenly() {
    // 12 equal requests at once: each goes to the instance with the fewest waiting tokens.
    let mut reqs = chat(12, 1, 3);
    for r in &mut reqs {
        r.arrival_ms = 0;
    }
    let r = simulate(&small(4, Routing::LeastLoaded), &reqs, |_| {}).unwrap();
    assert_eq!(r.routing.routed, vec![3, 3, 3, 3]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4))]
    /// A fixed workload and seed give the same routing and the same TTFTs, run after run.
    #[test]
    fn runs_repeat_for_a_seed(seed in 0u64..1000, kvtier in any::<bool>()) {
        let router = if kvtier { Routing::Kvtier } else { Routing::Dynamo };
        let reqs = chat(6, 2, seed);
        let a = simulate(&small(2, router), &reqs, |_| {}).unwrap();
        let b = simulate(&small(2, router), &reqs, |_| {}).unwrap();
        prop_assert_eq!(&a.routing.routed, &b.routing.routed);
        prop_assert_eq!(a.ttft_ms.p99, b.ttft_ms.p99);
        prop_assert_eq!(a.routing.routed.iter().sum::<u64>(), reqs.len() as u64);
    }

    /// Scaling arrival times by `time_scale` makes the offered prefill load the target.
    #[test]
    fn the_time_scale_gives_the_target_load(
        tokens in 1u64..1_000_000_000,
        span_ms in 1u64..10_000_000,
        instances in 1usize..16,
        load in 0.05f64..2.0,
    ) {
        let size = WorkloadSize { requests: 1, prompt_tokens: tokens, span_ms };
        let capacity = 60_000.0 * instances as f64;
        let f = time_scale(&size, capacity, load);
        let offered = tokens as f64 / (span_ms as f64 * f / 1e3);
        prop_assert!((offered / capacity - load).abs() < 1e-9 * load.max(1.0));
    }
}

#[test]
fn a_workload_is_measured_and_a_bad_one_is_an_error() {
    let w = BenchWorkload::Chat(ChatSpec {
        clients: 3,
        rounds: 2,
        ..ChatSpec::default()
    });
    let s = w.measure().unwrap();
    assert_eq!(s.requests, 6);
    assert!(s.prompt_tokens > 0 && s.span_ms > 0);
    let missing = BenchWorkload::Trace {
        path: "no/such/trace.jsonl".into(),
        limit: None,
    };
    assert!(
        missing
            .measure()
            .unwrap_err()
            .contains("no/such/trace.jsonl")
    );
}

/// The floor holds `r`'s TTFTs from below: with every request finished, each one at or above
/// its own floor puts every percentile at or above the floor's.
fn assert_above_floor(cfg: &SimConfig, reqs: &[SimRequest], r: &Report, what: &str) {
    assert_eq!(
        r.finished,
        reqs.len() as u64,
        "{what}: every request finishes"
    );
    let f = floor_percentiles(cfg, reqs.iter().cloned().map(Ok)).unwrap();
    assert!(f.p50 > 0.0, "{what}: a prefill takes time");
    // Request by request (the report's timings, one per request, where it ran): each TTFT
    // is at or above that request's own floor.
    let floors = floors_us(cfg, reqs.iter().cloned().map(Ok)).unwrap();
    assert_eq!(
        r.timings.len(),
        reqs.len(),
        "{what}: one timing per request"
    );
    let by_id: std::collections::HashMap<u64, &RequestTiming> =
        r.timings.iter().map(|t| (t.id, t)).collect();
    assert_eq!(by_id.len(), reqs.len(), "{what}: every request timed once");
    for (q, floor) in reqs.iter().zip(&floors) {
        let t = by_id[&q.id];
        assert!(
            t.instance < cfg.instances,
            "{what}: request {} on instance {}",
            q.id,
            t.instance
        );
        assert_eq!(
            t.arrival_us,
            q.arrival_ms * 1000,
            "{what}: request {}",
            q.id
        );
        assert_eq!(t.prompt_tokens, q.prompt.len(), "{what}: request {}", q.id);
        assert!(
            t.ttft_us >= *floor,
            "{what}: request {} took {} µs, under its floor {floor} µs",
            q.id,
            t.ttft_us
        );
    }
    for (m, fl, p) in [
        (r.ttft_ms.p50, f.p50, "p50"),
        (r.ttft_ms.p90, f.p90, "p90"),
        (r.ttft_ms.p99, f.p99, "p99"),
    ] {
        assert!(
            m >= fl,
            "{what}: measured {p} {m} ms under the floor's {fl} ms"
        );
    }
}

fn trace_head(n: usize) -> Vec<SimRequest> {
    let f = std::fs::File::open(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../traces/conversation_trace.jsonl"
    ))
    .unwrap();
    TraceReader::new(std::io::BufReader::new(f), Some(n))
        .collect::<Result<_, _>>()
        .unwrap()
}

/// No router beats the floor, on the chat (whose next turns re-read the answers) and on the
/// conversation trace, at the benchmark's sizes and at small tiers where pages move.
#[test]
fn no_router_beats_the_ttft_floor() {
    let chat_reqs = chat(12, 4, 5);
    let mut burst = trace_head(120);
    for r in &mut burst {
        r.arrival_ms /= 50; // a burst: queues form
    }
    for router in Routing::ALL {
        let mut bench = SimConfig {
            instances: 2,
            routing: router,
            ..SimConfig::default()
        };
        bench.l3_pages = 16_384;
        for (cfg, reqs, what) in [
            (small(3, router), &chat_reqs, "chat, small tiers"),
            (bench, &burst, "trace burst"),
        ] {
            let r = simulate(&cfg, reqs, |_| {}).unwrap();
            assert_above_floor(&cfg, reqs, &r, &format!("{what}, {router:?}"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]
    /// The floor is a lower bound whatever the workload's pace and shape.
    #[test]
    fn the_floor_is_a_lower_bound(
        seed in 0u64..1000,
        clients in 2u32..10,
        rounds in 1u32..4,
        think_ms in 1u64..400,
        kvtier in any::<bool>(),
    ) {
        let router = if kvtier { Routing::Kvtier } else { Routing::RoundRobin };
        let reqs = synthetic_chat(&ChatSpec {
            clients,
            rounds,
            system_prompt_tokens: 256,
            turn_tokens: 192,
            answer_tokens: 16,
            think_ms,
            client_interarrival_ms: 5,
            seed,
        });
        let cfg = small(2, router);
        let r = simulate(&cfg, &reqs, |_| {}).unwrap();
        assert_above_floor(&cfg, &reqs, &r, "chat");
    }
}
