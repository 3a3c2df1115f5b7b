//! Property tests of the simulator: random workloads, capacities, policies (eviction
//! included), instance counts and injected failures (failed prefetches, failed backups, lost
//! L3 objects). The integrity oracle never fails, every run ends quiescent (all locks
//! released, pools balanced: `simulate` returns an error otherwise), and no policy beats the
//! Belady ceiling.

use kvtier_radix::EvictionPolicy;
use kvtier_scheduler::{HostAdmission, PrefetchStopPolicy, RetractionPolicy, WritePolicy};
use kvtier_sim::workload::{ChatSpec, Routing, synthetic_chat};
use kvtier_sim::{Faults, SimConfig, simulate};
use proptest::prelude::*;

fn sim_config() -> impl Strategy<Value = SimConfig> {
    (
        prop_oneof![Just(16usize), Just(32)],
        (24u32..200, 0u32..400, 0u64..3000),
        1usize..4,
        (0u8..3, 0u8..3, 0u8..3, any::<bool>(), any::<bool>(), 0u8..5),
        (0u64..4, 0u64..4, 0u64..6),
        prop::option::of(1u32..48),
    )
        .prop_map(
            |(
                ps,
                (dev, host, l3),
                instances,
                (stop, write, retract, mixed, keep, evict),
                (fp, fb, lose),
                demote,
            )| {
                let mut c = SimConfig::default();
                let host_enabled = host >= 8;
                let write_back = write >= 2 && host_enabled;
                let s = &mut c.scheduler;
                s.page_size = ps;
                s.device_pages = dev;
                s.host_enabled = host_enabled;
                s.host_pages = if host_enabled { host } else { 0 };
                s.l3_enabled = l3 >= 16;
                s.max_batch_size = 16;
                s.token_budget = 512;
                s.chunked_prefill_size = 256;
                s.mixed_prefill_decode = mixed;
                s.keep_device_after_write_back = keep;
                s.eviction = [
                    EvictionPolicy::Lru,
                    EvictionPolicy::CONVERSATION,
                    EvictionPolicy::FrequencyDepth {
                        use_credit_pages: 8,
                        max_credited_uses: 3,
                        depth_debit_per_page: 2,
                    },
                    EvictionPolicy::Adaptive,
                    EvictionPolicy::Shadow,
                ][evict as usize];
                s.host_admission = match demote {
                    // The shadow selector chooses the admission too, on odd read-aheads.
                    Some(ahead_pages)
                        if host_enabled && !write_back && evict == 4 && ahead_pages % 2 == 1 =>
                    {
                        HostAdmission::Adaptive {
                            ahead_pages: ahead_pages.min(dev),
                        }
                    }
                    Some(ahead_pages) if host_enabled && !write_back => {
                        HostAdmission::OnDeviceEviction {
                            ahead_pages: ahead_pages.min(dev),
                        }
                    }
                    _ => HostAdmission::OnFinish,
                };
                s.prefetch_threshold = 1;
                s.max_context_tokens = (dev as usize * ps).min(4096);
                s.prefetch_stop = [
                    PrefetchStopPolicy::BestEffort,
                    PrefetchStopPolicy::WaitComplete,
                    PrefetchStopPolicy::Timeout {
                        base_ms: 2,
                        per_1k_tokens_ms: 5,
                    },
                ][stop as usize];
                s.write_policy = match write {
                    0 => WritePolicy::WriteThrough,
                    1 => WritePolicy::WriteThroughSelective { hit_threshold: 2 },
                    _ if host_enabled => WritePolicy::WriteBack,
                    _ => WritePolicy::WriteThrough,
                };
                s.retraction = [
                    RetractionPolicy::LatestArrival,
                    RetractionPolicy::FewestGenerated,
                    RetractionPolicy::MostPages,
                ][retract as usize];
                c.l3_pages = l3;
                c.instances = instances;
                c.routing = if instances % 2 == 0 {
                    Routing::Session
                } else {
                    Routing::RoundRobin
                };
                c.faults = Faults {
                    fail_prefetch_every: fp,
                    fail_backup_every: fb,
                    lose_l3_every: lose,
                };
                c
            },
        )
}

fn chat() -> impl Strategy<Value = ChatSpec> {
    (
        1u32..10,
        1u32..5,
        0u32..300,
        1u32..200,
        1u32..60,
        0u64..3000,
        any::<u64>(),
    )
        .prop_map(
            |(clients, rounds, sys, turn, answer, think, seed)| ChatSpec {
                clients,
                rounds,
                system_prompt_tokens: sys,
                turn_tokens: turn,
                answer_tokens: answer,
                think_ms: think,
                client_interarrival_ms: 50,
                seed,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn simulations_are_correct_quiescent_and_below_belady(cfg in sim_config(), spec in chat()) {
        let mut reqs = synthetic_chat(&spec);
        let max = cfg.scheduler.max_context_tokens;
        reqs.retain(|r| r.prompt.len() + r.output_len as usize <= max);
        prop_assume!(!reqs.is_empty());
        let r = simulate(&cfg, &reqs, |_| {}).map_err(TestCaseError::fail)?;
        if std::env::var_os("KVTIER_PROP_VERBOSE").is_some() {
            eprintln!("{} reqs, {} pages checked, hit {:.2} belady {:.2}, retracted {}, ops {:?}", reqs.len(), r.oracle.pages_checked, r.hits.total, r.belady.as_ref().unwrap().hit_rate, r.retracted, r.ops.iter().map(|o| (o.issued, o.failed)).collect::<Vec<_>>());
        }
        prop_assert_eq!(r.oracle.failures, 0, "{:?}", r.oracle.first_failures);
        prop_assert_eq!(r.finished + r.aborted + r.failed, reqs.len() as u64);
        let b = r.belady.as_ref().unwrap();
        prop_assert!(r.hits.total <= b.hit_rate + 1e-9, "policy {} beats Belady {}", r.hits.total, b.hit_rate);
    }
}

/// L3 residency is a hint: with L3 objects disappearing after every few backups (and the
/// store's reports passed to the schedulers), write-back never drops a host page that is in
/// no other tier. The oracle checks every host drop (`check_host_drops`); without the reports
/// (`Scheduler::l3_lost`) stale "in L3" flags make this fail.
#[test]
fn write_back_with_lost_l3_objects_loses_no_page() {
    for (lose, seed) in [(1u64, 1u64), (2, 2), (3, 3), (1, 4), (2, 5)] {
        let mut c = SimConfig::default();
        let s = &mut c.scheduler;
        s.page_size = 16;
        s.device_pages = 48;
        s.host_pages = 64;
        s.l3_enabled = true;
        s.max_batch_size = 16;
        s.token_budget = 512;
        s.chunked_prefill_size = 256;
        s.prefetch_threshold = 1;
        s.max_context_tokens = 768;
        s.write_policy = WritePolicy::WriteBack;
        c.l3_pages = 2000;
        c.faults.lose_l3_every = lose;
        let spec = ChatSpec {
            clients: 6,
            rounds: 4,
            system_prompt_tokens: 100,
            turn_tokens: 60,
            answer_tokens: 20,
            think_ms: 500,
            client_interarrival_ms: 50,
            seed,
        };
        let mut reqs = synthetic_chat(&spec);
        reqs.retain(|r| r.prompt.len() + r.output_len as usize <= 768);
        let r = simulate(&c, &reqs, |_| {}).expect("simulates");
        assert_eq!(r.oracle.failures, 0, "{:?}", r.oracle.first_failures);
        assert_eq!(r.finished, reqs.len() as u64);
    }
}

/// A configuration for the regression cases below: `SimConfig::default()` with the
/// proptest's fixed batch shape and the given capacities (pages) and faults.
fn base_config(dev: u32, host: u32, l3: u64, faults: Faults) -> SimConfig {
    let mut c = SimConfig::default();
    let s = &mut c.scheduler;
    s.page_size = 16;
    s.device_pages = dev;
    s.host_enabled = host > 0;
    s.host_pages = host;
    s.l3_enabled = l3 > 0;
    s.max_batch_size = 16;
    s.token_budget = 512;
    s.chunked_prefill_size = 256;
    s.prefetch_threshold = 1;
    s.max_context_tokens = (dev as usize * 16).min(4096);
    c.l3_pages = l3;
    c.faults = faults;
    c
}

/// Runs `spec` (requests longer than the context limit dropped) and checks what the
/// proptest checks: the oracle, and every request ended (`simulate` fails on a stall).
fn assert_correct(c: &SimConfig, spec: &ChatSpec) {
    let max = c.scheduler.max_context_tokens;
    let mut reqs = synthetic_chat(spec);
    reqs.retain(|r| r.prompt.len() + r.output_len as usize <= max);
    assert!(!reqs.is_empty());
    let r = simulate(c, &reqs, |_| {}).expect("simulates");
    assert_eq!(r.oracle.failures, 0, "{:?}", r.oracle.first_failures);
    assert_eq!(r.finished + r.aborted + r.failed, reqs.len() as u64);
}

/// Found by `simulations_are_correct_quiescent_and_below_belady` in CI (its minimal input):
/// write-back with every second backup failing and a small L3 (16 pages) dropped a host page
/// that was in no other tier: a backup of 22 pages evicted its own first pages to store its
/// last ones and was reported a success, and later backups evicted earlier ones unreported.
#[test]
fn write_back_with_failing_backups_and_a_small_l3_loses_no_page() {
    let mut c = base_config(
        58,
        55,
        16,
        Faults {
            fail_prefetch_every: 0,
            fail_backup_every: 2,
            lose_l3_every: 0,
        },
    );
    c.scheduler.write_policy = WritePolicy::WriteBack;
    c.scheduler.max_context_tokens = 928;
    let spec = ChatSpec {
        clients: 3,
        rounds: 3,
        system_prompt_tokens: 58,
        turn_tokens: 90,
        answer_tokens: 25,
        think_ms: 787,
        client_interarrival_ms: 50,
        seed: 1091783315141372569,
    };
    assert_correct(&c, &spec);
}

/// Found by the proptest: device only (no host) with L3, mixed prefill/decode, every
/// prefetch failing, every second backup failing and every backup losing an L3 object.
#[test]
fn failing_prefetches_and_lost_l3_objects_do_not_stall() {
    let mut c = base_config(
        49,
        0,
        128,
        Faults {
            fail_prefetch_every: 1,
            fail_backup_every: 2,
            lose_l3_every: 1,
        },
    );
    c.scheduler.mixed_prefill_decode = true;
    let spec = ChatSpec {
        clients: 8,
        rounds: 4,
        system_prompt_tokens: 110,
        turn_tokens: 86,
        answer_tokens: 52,
        think_ms: 302,
        client_interarrival_ms: 50,
        seed: 15069893878901060071,
    };
    assert_correct(&c, &spec);
}

/// Write-back over an L3 with a small SSD tier: the SSD writer evicts buckets on its own
/// thread, so an object a backup stored can be gone by the next plan. The loss journal reports
/// it (read after the writer settled) and the oracle checks each host drop right after the
/// scheduler call that made it. `kvtier sim --write-policy write-back --l3-pages 500
/// --l3-ssd-pages 1000` failed its oracle before.
#[test]
fn write_back_over_a_small_ssd_tier_loses_no_page() {
    for seed in [1u64, 2, 3] {
        let mut c = base_config(
            48,
            64,
            24,
            Faults {
                fail_prefetch_every: 0,
                fail_backup_every: 0,
                lose_l3_every: 0,
            },
        );
        c.scheduler.write_policy = WritePolicy::WriteBack;
        c.l3_ssd_pages = 48;
        let spec = ChatSpec {
            clients: 8,
            rounds: 4,
            system_prompt_tokens: 120,
            turn_tokens: 60,
            answer_tokens: 20,
            think_ms: 400,
            client_interarrival_ms: 50,
            seed,
        };
        assert_correct(&c, &spec);
    }
}
