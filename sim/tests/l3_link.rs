//! The L3 link's two models (`LinkProfile::l3_link`): with `shared`, an instance's prefetch
//! waits behind the backups it issued before; with `duplex`, only behind earlier reads.

use kvtier_scheduler::PrefetchStopPolicy;
use kvtier_sim::profile::L3Link;
use kvtier_sim::report::Report;
use kvtier_sim::workload::{Routing, SimRequest};
use kvtier_sim::{SimConfig, simulate};

const PAGE: usize = 64;

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 1000 + seed * 100_000 + i).collect()
}

fn req(id: u64, arrival_ms: u64, prompt: Vec<u32>) -> SimRequest {
    SimRequest {
        id,
        arrival_ms,
        prompt,
        output_len: 2,
        session: id,
    }
}

/// Two instances, round-robin, requests waiting for their prefetches, a slow L3 link (1 GB/s: a page's backup, 8 MiB,
/// takes 8.4 ms, longer than computing it). Instance 0 computes prefix X (16 pages), backed
/// up when it finishes, within about 150 ms; instance 1 computes an unrelated 128-page prompt, whose backups
/// keep its link busy for about a second. At 400 ms X plus a suffix reaches instance 1,
/// which holds none of X on any tier: it prefetches X's 16 pages from the L3.
fn run(link: L3Link) -> (Report, u64) {
    let mut cfg = SimConfig {
        instances: 2,
        routing: Routing::RoundRobin,
        ..SimConfig::default()
    };
    cfg.links.l3_gb_per_s = 1.0;
    // The request waits for its prefetch (the default gives up after 50 ms + 10 ms per 1K
    // tokens and recomputes, which hides how long the prefetch took).
    cfg.scheduler.prefetch_stop = PrefetchStopPolicy::WaitComplete;
    cfg.links.l3_link = link;
    let x = tokens(1, 16 * PAGE);
    let mut x_again = x.clone();
    x_again.extend(tokens(3, PAGE));
    let reqs = vec![
        req(0, 0, x),
        req(1, 0, tokens(2, 128 * PAGE)),
        req(2, 1, tokens(4, 8)),
        req(3, 400, x_again),
    ];
    let r = simulate(&cfg, &reqs, |_| {}).unwrap();
    assert_eq!(r.oracle.failures, 0, "{:?}", r.oracle.first_failures);
    assert_eq!(r.finished, 4);
    let t = r
        .timings
        .iter()
        .find(|t| t.id == 3)
        .expect("request 3 timed");
    assert_eq!(
        t.instance, 1,
        "round-robin sends the fourth request to instance 1"
    );
    let ttft = t.ttft_us;
    (r, ttft)
}

#[test]
fn a_prefetch_waits_behind_backups_only_on_a_shared_link() {
    let (shared, shared_us) = run(L3Link::Shared);
    let (duplex, duplex_us) = run(L3Link::Duplex);
    // X came from the L3 in both runs (instance 1 never computed it).
    for (r, what) in [(&shared, "shared"), (&duplex, "duplex")] {
        assert!(
            r.hits.l3_tokens >= (16 * PAGE) as u64,
            "{what}: {:?}",
            r.hits
        );
    }
    // The 16 pages' own transfer at 1 GB/s is the least either can take.
    let pages_us = (16 * PAGE as u64 * 131_072) as f64 / 1e9 * 1e6;
    assert!(
        duplex_us as f64 >= pages_us,
        "duplex {duplex_us} µs under the transfer {pages_us:.0} µs"
    );
    // On the shared link it waited for the big prompt's backups still queued at 400 ms.
    assert!(
        shared_us >= duplex_us + 300_000,
        "shared {shared_us} µs, duplex {duplex_us} µs"
    );
}

#[test]
fn the_l3_link_is_read_from_the_config_and_defaults_to_shared() {
    assert_eq!(SimConfig::default().links.l3_link, L3Link::Shared);
    let c = SimConfig::from_toml("[links]\nl3_link = \"duplex\"\n").unwrap();
    assert_eq!(c.links.l3_link, L3Link::Duplex);
    assert!(SimConfig::from_toml("[links]\nl3_link = \"both\"\n").is_err());
}
