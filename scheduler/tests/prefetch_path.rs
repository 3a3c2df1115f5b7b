//! The prefetch path: prefetched pages stay pinned until their request is admitted; a prefetch
//! asks only for keys its probe answered; write-through-selective counts requests, not match
//! attempts.

mod common;
use common::*;
use kvtier_scheduler::*;

fn l3_cfg() -> SchedulerConfig {
    SchedulerConfig {
        l3_enabled: true,
        prefetch_threshold: 1,
        prefetch_stop: PrefetchStopPolicy::WaitComplete,
        ..cfg()
    }
}

/// Runs `p` to completion on a fresh scheduler and returns its engine, whose L3 then holds
/// every page of `p`.
fn seeded(c: &SchedulerConfig, p: Vec<u32>) -> Engine {
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(c);
    e.submit(&mut s, 900, p, 1);
    e.run_to_idle(&mut s, 300);
    e
}

/// A's pages arrive from L3 while A cannot be admitted (R holds the device); R then finishes
/// and writes its pages back to host. A's prefetched pages must survive that host pressure.
#[test]
fn prefetched_pages_stay_pinned_until_admission() {
    let c = SchedulerConfig {
        device_pages: 16,
        host_pages: 16,
        max_context_tokens: 64,
        ..l3_cfg()
    };
    let pa = prompt(1, 41);
    let mut e = Engine::new(&c);
    e.l3 = seeded(&c, pa.clone()).l3;
    let mut s = Scheduler::new(c.clone()).unwrap();
    e.submit(&mut s, 1, prompt(2, 45), 8); // R: 12 prompt pages, grows to 13
    e.submit(&mut s, 2, pa, 2); // A: 10 usable pages, all in L3
    e.run_to_idle(&mut s, 400);
    assert_quiescent(&s);
    let st = s.stats();
    assert_eq!(st.op(OpKind::Prefetch).succeeded, 1);
    assert_eq!(
        st.l3_hit_pages, 10,
        "A used every page it prefetched: {st:?}"
    );
}

/// Runs requests over prompts sharing prefixes with small tiers and a seeded L3, checking that
/// every prefetch asks only for keys a probe of its request answered as hits.
fn prefetches_ask_only_probed_keys(seeds: &[(u32, usize)], host_pages: u32) -> Result<(), String> {
    use std::collections::{HashMap, HashSet};
    let c = SchedulerConfig {
        device_pages: 24,
        host_pages,
        max_context_tokens: 96,
        prefetch_stop: PrefetchStopPolicy::BestEffort,
        ..l3_cfg()
    };
    let mut e = Engine::new(&c);
    for s in 0..4 {
        let mut l3 = seeded(&c, prompt(s, 61)).l3;
        e.l3.extend(l3.drain());
    }
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut probed: HashMap<RequestId, HashSet<String>> = HashMap::new();
    let mut err = None;
    for (i, &(seed, len)) in seeds.iter().enumerate() {
        e.submit(&mut s, i as u64, prompt(seed, len), 3);
    }
    let l3 = e.l3.clone();
    e.run_watching(&mut s, 2000, |plan| {
        for op in &plan.ops {
            let Some(r) = op.req else { continue };
            match &op.spec {
                OpSpec::L3Query { keys } => probed
                    .entry(r)
                    .or_default()
                    .extend(keys.iter().take_while(|k| l3.contains_key(*k)).cloned()),
                OpSpec::Prefetch { keys, .. } => {
                    let p = probed.get(&r).cloned().unwrap_or_default();
                    if let Some(k) = keys.iter().find(|k| !p.contains(*k)) {
                        err.get_or_insert(format!("{r:?} prefetches unprobed key {k}"));
                    }
                }
                _ => {}
            }
        }
    });
    assert_quiescent(&s);
    err.map_or(Ok(()), Err)
}

#[test]
fn prefetches_ask_only_for_probed_keys() {
    // Requests whose prefixes sit on host when probed and are evicted by host pressure (other
    // requests' write-backs and prefetches) before their prefetch is planned.
    for k in 0..60u32 {
        let seeds: Vec<(u32, usize)> = (0..10)
            .map(|i| ((i * 3 + k) % 4, 21 + ((i + k) as usize * 8) % 41))
            .collect();
        for host in [12, 16, 24] {
            prefetches_ask_only_probed_keys(&seeds, host)
                .unwrap_or_else(|e| panic!("k={k} host={host}: {e}"));
        }
    }
}

/// Deterministic case: A's probe starts after X's 5 pages on host; before the probe's answer
/// is used, Y's write-back evicts X's pages from host (and Y's growth from device). The
/// prefetch must not ask for pages 0..5, which the probe never looked at.
#[test]
fn regression_prefetch_after_the_match_shrank_asks_only_probed_keys() {
    let c = SchedulerConfig {
        device_pages: 16,
        host_pages: 12,
        max_context_tokens: 64,
        ..l3_cfg()
    };
    let p = prompt(1, 41);
    let mut e = Engine::new(&c);
    e.l3 = seeded(&c, p.clone()).l3;
    let mut s = Scheduler::new(c.clone()).unwrap();
    e.submit(&mut s, 1, p[..21].to_vec(), 1); // X: pages 0..5 of p, on device and host
    e.run_to_idle(&mut s, 300);
    let x_hits = s.stats().l3_hit_pages; // X found its 5 pages in L3 too
    e.submit(&mut s, 2, p.clone(), 2); // A
    let plan = s.next_execution_plan(1000);
    let probe: Vec<String> = plan
        .ops
        .iter()
        .find_map(|o| match &o.spec {
            OpSpec::L3Query { keys } => Some(keys.clone()),
            _ => None,
        })
        .expect("A is probed");
    assert_eq!(probe.len(), 5, "probed from the local match (page 5)");
    e.take_plan(plan);
    e.submit(&mut s, 3, prompt(9, 41), 8); // Y: evicts X's pages from device and host
    e.run_to_idle_except(&mut s, 300, RequestId(2));
    let mut probed = probe.clone();
    let mut unprobed = Vec::new();
    let mut reprobes = 0;
    e.run_watching(&mut s, 300, |plan| {
        for o in &plan.ops {
            match &o.spec {
                OpSpec::L3Query { keys } => {
                    reprobes += 1;
                    probed.extend(keys.clone());
                }
                OpSpec::Prefetch { keys, .. } => {
                    unprobed.extend(keys.iter().filter(|k| !probed.contains(k)).cloned())
                }
                _ => {}
            }
        }
    });
    assert_quiescent(&s);
    assert_eq!(
        unprobed,
        Vec::<String>::new(),
        "prefetched keys no probe answered"
    );
    assert_eq!(reprobes, 1, "A probed again from its shrunken match");
    assert_eq!(
        s.stats().l3_hit_pages - x_hits,
        10,
        "and got every page from L3"
    );
}

/// `write_through_selective { hit_threshold: 2 }` backs up prefixes that two requests reused.
/// B's probe and its admission both match A's pages: that is one request, not two.
#[test]
fn write_through_selective_counts_requests_not_match_attempts() {
    let c = SchedulerConfig {
        write_policy: WritePolicy::WriteThroughSelective { hit_threshold: 2 },
        ..l3_cfg()
    };
    let p = prompt(1, 41);
    let a_keys = c
        .namespace
        .keys_for(c.page_size, c.rank)
        .keys(&kvtier_radix::page_hashes(&p[..20], c.page_size, None));
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, p[..21].to_vec(), 1); // A computes pages 0..5
    e.run_to_idle(&mut s, 300);
    e.submit(&mut s, 2, p.clone(), 1); // B reuses them (probing L3 for the rest first)
    e.run_to_idle(&mut s, 300);
    assert_eq!(
        s.stats().op(OpKind::L3Query).issued,
        2,
        "B probed L3 past A's pages"
    );
    assert!(
        a_keys.iter().all(|k| !e.l3.contains_key(k)),
        "one reusing request is below the threshold of 2"
    );
    e.submit(&mut s, 3, p, 1); // C reuses them too: now two requests did
    e.run_to_idle(&mut s, 300);
    assert!(a_keys.iter().all(|k| e.l3.contains_key(k)));
    assert_quiescent(&s);
}

/// Multi-turn-like requests over shared prefixes, prefetches held until the scheduler stops
/// them (best effort: at the next plan), small host pool so freed prefetch pages are reused
/// at once. Returns whether the page oracle caught a forward reading wrong KV.
fn oracle_fails_with(termination: Termination, k: u32) -> bool {
    let c = SchedulerConfig {
        device_pages: 20,
        host_pages: 16,
        max_context_tokens: 80,
        prefetch_stop: PrefetchStopPolicy::BestEffort,
        ..l3_cfg()
    };
    let mut e = Engine::new(&c);
    for p in 0..2 {
        let mut l3 = seeded(&c, prompt(p, 61)).l3;
        e.l3.extend(l3.drain());
    }
    e.hold_prefetches = true;
    e.termination = termination;
    let mut s = Scheduler::new(c.clone()).unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // Prompts 0 and 1 come from L3 (prefetched, terminated); 2..5 are computed and
        // written back to host, into pages a terminated prefetch just gave up; turns repeat
        // prompts so host pages are loaded back and read.
        let mut x = k.wrapping_mul(2_654_435_761) | 1;
        for i in 0..24u32 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            e.submit(
                &mut s,
                i as u64,
                prompt(x % 6, 21 + (x / 6 % 5) as usize * 10),
                2,
            );
            for t in 0..(x / 30 % 3) {
                e.step(&mut s, (i * 10 + t) as u64);
            }
        }
        for t in 0..400 {
            if s.is_idle() {
                break;
            }
            e.step(&mut s, 1000 + t);
        }
    }));
    match r {
        Ok(()) => {
            assert_quiescent(&s);
            false
        }
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            // A forward reading it, or a backup storing it under its key: both are the oracle.
            assert!(
                msg.contains("wrong KV") || msg.contains("other content"),
                "failed otherwise: {msg}"
            );
            true
        }
    }
}

/// The termination contract: `PrefetchDone` after `terminate_prefetch` is reported only once
/// every write into the prefetch's pages has landed. An engine that keeps it never serves
/// wrong KV; one that reports early is caught by the oracle (so the test can fail).
#[test]
fn terminated_prefetches_are_reported_after_their_writes_land() {
    let early = (0..60)
        .filter(|&k| oracle_fails_with(Termination::ReportEarly, k))
        .count();
    let landed = (0..60)
        .filter(|&k| oracle_fails_with(Termination::Landed, k))
        .count();
    assert_eq!(landed, 0);
    assert!(
        early > 0,
        "no workload exposed the early report: the oracle is blind to it"
    );
}
