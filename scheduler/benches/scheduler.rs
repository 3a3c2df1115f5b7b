//! Scheduler benchmarks (issue 3; figures in docs/benchmarks.md, percentiles from the
//! `sched-bench` binary).
//!
//! Scenario (`scenario/mod.rs`): 256 (or 1,024) requests with distinct 4,096-token prompts,
//! page size 64, token budget 8,192, host = 2 × device pages, no memory pressure, every op
//! acknowledged at once, one token per decode row. Targets (C++ reference in brackets):
//! decode-step plan of 256 ≤ 40 µs [205]; ingesting 256 decode results ≤ 15 µs [58];
//! finishing all 256, write-back planning included ≤ 1 ms [6.1 ms]; first plan after
//! resubmitting 256 host-only prompts (256 load-backs) ≤ 0.5 ms [2.0 ms]; decode-step plan of
//! 1,024 ≤ 160 µs [1,228], linear in the batch.
//!
//! Only the measured calls are timed (`iter_custom`): bringing the requests into decoding, or
//! to the state before the finish / the resubmission, is setup.

mod scenario;

use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, criterion_group, criterion_main};
use scenario::*;

/// Decode steps of `n` requests: `plan` times `next_execution_plan`, otherwise the
/// `ForwardDone` of the step. One setup serves ~1,500 steps; it is rebuilt when used up.
fn decode_bench(g: &mut BenchmarkGroup<'_, WallTime>, name: &str, n: usize, plan: bool) {
    let mut d = decoding(n);
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                if d.steps_left == 0 {
                    d = decoding(n);
                }
                let (p, f) = timed_decode_step(&mut d);
                total += if plan { p } else { f };
            }
            total
        })
    });
}

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler");
    g.sample_size(30)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    decode_bench(&mut g, "decode_plan_256", 256, true);
    decode_bench(&mut g, "decode_forward_done_256", 256, false);
    decode_bench(&mut g, "decode_plan_1024", 1024, true);
    g.finish();

    // A fresh scheduler per sample (15-25 ms of untimed setup each): few, short samples.
    let mut g = c.benchmark_group("scheduler");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(20))
        .measurement_time(Duration::from_millis(300));
    g.bench_function("finish_all_256", |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| {
                    let (mut d, ev) = about_to_finish(256);
                    timed_finish(&mut d, ev)
                })
                .sum()
        })
    });
    g.bench_function("first_plan_256_load_backs", |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| {
                    let mut d = host_only(256, 2 * TOKEN_BUDGET);
                    let (t, lb) = timed_loadback_plan(&mut d);
                    assert_eq!(lb, 256);
                    t
                })
                .sum()
        })
    });
    g.finish();
}

criterion_group!(scheduler, benches);
criterion_main!(scheduler);
