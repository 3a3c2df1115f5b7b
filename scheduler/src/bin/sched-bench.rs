//! `sched-bench`: the scheduler's issue-3 benchmark figures as latency percentiles.
//!
//! Run: `cargo run --release -p kvtier-scheduler --bin sched-bench [-- --quick]`.
//!
//! Why a binary beside criterion: the targets are stated as p50 (and the finish/load-back
//! cases need a fresh scheduler per sample), so this times every call on its own and prints
//! p50/p90/p99 next to the target and the C++ reference. The scenario (shared with
//! `benches/scheduler.rs`) is described in `benches/scenario/mod.rs`.

#[path = "../../benches/scenario/mod.rs"]
mod scenario;

use std::time::{Duration, Instant};

use scenario::*;

struct Row {
    name: &'static str,
    samples: Vec<Duration>,
    /// (target p50, C++ reference), µs; `None` for informational rows.
    goal: Option<(f64, f64)>,
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

impl Row {
    fn new(name: &'static str, samples: Vec<Duration>, goal: Option<(f64, f64)>) -> Row {
        Row {
            name,
            samples,
            goal,
        }
    }

    /// Prints the row; returns its p50 (µs).
    fn print(mut self) -> f64 {
        self.samples.sort();
        let s = &self.samples;
        let (p50, p90, p99) = (pct(s, 0.5), pct(s, 0.9), pct(s, 0.99));
        let goal = match self.goal {
            Some((target, reference)) => format!(
                "{target:>9.0} {reference:>9.0} {:>7.1}× {:>5}",
                reference / p50,
                if p50 <= target { "ok" } else { "MISS" }
            ),
            None => format!("{:>9} {:>9} {:>8} {:>5}", "-", "-", "-", ""),
        };
        println!(
            "{:<46} {:>6} {p50:>9.1} {p90:>9.1} {p99:>9.1} {goal}",
            self.name,
            s.len()
        );
        p50
    }
}

fn decode(n: usize, steps: usize, warmup: usize) -> (Vec<Duration>, Vec<Duration>, Duration) {
    let (mut plan, mut ingest) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
    let mut setup = Duration::ZERO;
    let mut d: Option<Driver> = None;
    let mut i = 0;
    while plan.len() < steps {
        if d.as_ref().is_none_or(|d| d.steps_left == 0) {
            let t = Instant::now();
            d = Some(decoding(n));
            setup = t.elapsed();
        }
        let (p, f) = timed_decode_step(d.as_mut().expect("driver"));
        i += 1;
        if i > warmup {
            plan.push(p);
            ingest.push(f);
        }
    }
    (plan, ingest, setup)
}

/// `--profile CASE [ROUNDS]`: run only one case (`decode256`, `decode1024`, `finish`,
/// `loadback`), for a profiler or an A/B comparison; prints its p10/p50/p90.
fn profile(case: &str, rounds: usize) {
    let mut t = match case {
        "decode256" | "decode1024" => {
            let n = if case == "decode256" { 256 } else { 1024 };
            let (plan, ingest, _) = decode(n, rounds * 100, 20);
            let mut ingest = ingest;
            ingest.sort();
            println!(
                "{case} ingest p10/p50/p90 µs: {:.1} {:.1} {:.1}",
                pct(&ingest, 0.1),
                pct(&ingest, 0.5),
                pct(&ingest, 0.9)
            );
            plan
        }
        "finish" => {
            let mut faults = 0;
            let t = (0..rounds)
                .map(|_| {
                    let (mut d, ev) = about_to_finish(256);
                    let f0 = minor_faults();
                    let t = timed_finish(&mut d, ev);
                    faults += minor_faults() - f0;
                    t
                })
                .collect();
            println!("minor page faults per finish: {}", faults / rounds as u64);
            t
        }
        "loadback" => {
            let mut faults = 0;
            let t = (0..rounds)
                .map(|_| {
                    let mut d = host_only(256, 2 * TOKEN_BUDGET);
                    let f0 = minor_faults();
                    let t = timed_loadback_plan(&mut d).0;
                    faults += minor_faults() - f0;
                    t
                })
                .collect::<Vec<_>>();
            println!("minor page faults per plan: {}", faults / rounds as u64);
            t
        }
        other => panic!("unknown case {other}"),
    };
    t.sort();
    println!(
        "{case} p10/p50/p90 µs: {:.1} {:.1} {:.1}",
        pct(&t, 0.1),
        pct(&t, 0.5),
        pct(&t, 0.9)
    );
}

/// Minor page faults of this process so far (Linux; 0 elsewhere).
fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 2..];
            rest.split(' ').nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    if let Some(i) = args.iter().position(|a| a == "--profile") {
        let rounds = args.get(i + 2).and_then(|r| r.parse().ok());
        profile(
            args.get(i + 1).map(String::as_str).unwrap_or("decode256"),
            rounds.unwrap_or(if quick { 2 } else { 20 }),
        );
        return;
    }
    let (steps, rounds) = if quick { (300, 8) } else { (3000, 40) };
    println!(
        "kvtier-scheduler: distinct 4,096-token prompts, page 64, budget 8,192, host = 2 × device, \
         ops acknowledged at once"
    );
    println!(
        "{:<46} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>5}",
        "case (µs)", "n", "p50", "p90", "p99", "target", "C++ ref", "ref/p50", ""
    );

    let (p256, f256, setup256) = decode(256, steps, 20);
    let d256 = Row::new(
        "decode step of 256: next_execution_plan",
        p256,
        Some((40.0, 205.0)),
    )
    .print();
    Row::new(
        "decode step of 256: ForwardDone (256 rows)",
        f256,
        Some((15.0, 58.0)),
    )
    .print();

    let mut fin = Vec::new();
    let mut fin_setup = Duration::ZERO;
    for _ in 0..rounds {
        let t = Instant::now();
        let (mut d, ev) = about_to_finish(256);
        fin_setup += t.elapsed();
        fin.push(timed_finish(&mut d, ev));
    }
    Row::new(
        "finish 256: ForwardDone + plan (256 WB ops)",
        fin,
        Some((1000.0, 6100.0)),
    )
    .print();

    let (mut lb, mut lb_half) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let mut d = host_only(256, 2 * TOKEN_BUDGET);
        let (t, n) = timed_loadback_plan(&mut d);
        assert_eq!(n, 256, "256 load-backs in the first plan");
        lb.push(t);
        let mut d = host_only(256, TOKEN_BUDGET);
        let (t, n) = timed_loadback_plan(&mut d);
        assert_eq!(n, 128, "budget 8,192 admits 128 one-page chunks");
        lb_half.push(t);
    }
    Row::new(
        "resubmit 256 host-only: first plan (256 LB)",
        lb,
        Some((500.0, 2000.0)),
    )
    .print();
    Row::new(
        "  same at budget 8,192 (128 admitted, 128 LB)",
        lb_half,
        None,
    )
    .print();

    let (p1024, f1024, setup1024) = decode(1024, steps, 20);
    let d1024 = Row::new(
        "decode step of 1,024: next_execution_plan",
        p1024,
        Some((160.0, 1228.0)),
    )
    .print();
    Row::new("decode step of 1,024: ForwardDone", f1024, None).print();
    println!(
        "decode plan p50, 1,024 / 256 = {:.2} (linear: 4.00; C++ reference 1,228 / 205 = {:.2})",
        d1024 / d256,
        1228.0 / 205.0
    );
    println!(
        "untimed setup: 256 decoding {:.0} ms, 1,024 decoding {:.0} ms, finish round {:.0} ms",
        setup256.as_secs_f64() * 1e3,
        setup1024.as_secs_f64() * 1e3,
        fin_setup.as_secs_f64() * 1e3 / rounds as f64
    );
}
