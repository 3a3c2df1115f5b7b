//! Promotion on probe: with an SSD tier, the `L3Query` probe asks the store to promote SSD-only
//! hits to DRAM, so the prefetch that follows reads DRAM instead of waiting for the SSD. The
//! simulator shows the effect on time to first token.

use kvtier_sim::workload::{ChatSpec, synthetic_chat};
use kvtier_sim::{SimConfig, simulate};

/// 160 chat clients over two instances: enough prefetches that the network link queues.
fn run(promote: bool, seed: u64) -> kvtier_sim::Report {
    run_with(promote, seed, 160, 2.0)
}

fn run_with(promote: bool, seed: u64, clients: u32, ssd: f64) -> kvtier_sim::Report {
    let mut c = SimConfig {
        instances: 2,
        l3_pages: 512, // small DRAM: most of L3 is on the SSD
        l3_ssd_pages: 20_000,
        l3_promote_on_probe: promote,
        ..SimConfig::default()
    };
    c.links.ssd_gb_per_s = ssd;
    c.links.l3_query_us = 2_000.0; // a slow probe: room to promote behind it
    c.scheduler.device_pages = 256;
    c.scheduler.host_pages = 256;
    let reqs = synthetic_chat(&ChatSpec {
        clients,
        rounds: 4,
        seed,
        ..ChatSpec::default()
    });
    let r = simulate(&c, &reqs, |_| {}).expect("simulates");
    assert_eq!(r.oracle.failures, 0);
    r
}

#[test]
fn promotion_on_probe_takes_ssd_reads_off_the_prefetch_path() {
    for seed in [1, 2] {
        let (on, off) = (run(true, seed), run(false, seed));
        assert!(off.ssd_read_bytes > 0, "the workload reads L3 from SSD");
        eprintln!(
            "seed {seed}: TTFT p50/p90/p99 {:.1}/{:.1}/{:.1} ms with promotion, {:.1}/{:.1}/{:.1} without; hits {:.3} vs {:.3}; SSD wait {:.0} vs {:.0} ms",
            on.ttft_ms.p50,
            on.ttft_ms.p90,
            on.ttft_ms.p99,
            off.ttft_ms.p50,
            off.ttft_ms.p90,
            off.ttft_ms.p99,
            on.hits.total,
            off.hits.total,
            on.prefetch_ssd_wait_ms,
            off.prefetch_ssd_wait_ms
        );
        // Prefetches wait less for the SSD: the promotion ran behind the probe.
        assert!(
            on.prefetch_ssd_wait_ms < off.prefetch_ssd_wait_ms,
            "seed {seed}: {} ms waited for SSD with promotion, {} without",
            on.prefetch_ssd_wait_ms,
            off.prefetch_ssd_wait_ms
        );
    }
}
