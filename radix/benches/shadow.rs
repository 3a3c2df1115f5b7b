//! The shadow selector's per-request cost and memory (figures in docs/benchmarks.md and
//! docs/sim/shadow.md).
//!
//! Stream: conversations under 4 shared 16-page system prompts, each turn the previous
//! prompt plus 24 pages (up to 16 turns, 400 pages), 3,000 conversations picked by a fixed
//! generator; the selector is warmed with 20,000 requests, then each iteration submits the
//! next of 4,000 precomputed requests (cycled). Cases: one fixed option's shadow (the unit of cost), the selector of the
//! four options full-size (10,240 and 65,536 pages of device + host), and sampled (327,680
//! pages: 1 prompt prefix in 5 on a fifth of the capacity).

use criterion::{Criterion, criterion_group, criterion_main};
use kvtier_radix::shadow::{ShadowCache, ShadowSelector};
use kvtier_radix::*;

const PS: usize = 64;

struct Stream {
    x: u64,
    sys: Vec<Vec<PageHash>>,
    convs: Vec<Vec<PageHash>>,
}

impl Stream {
    fn new() -> Stream {
        let sys = (0..4u32)
            .map(|s| page_hashes(&vec![s + 1; 16 * PS], PS, None))
            .collect();
        Stream {
            x: 0x9e37_79b9_7f4a_7c15,
            sys,
            convs: vec![Vec::new(); 3000],
        }
    }

    /// The next request's page hashes.
    fn next(&mut self) -> Vec<PageHash> {
        self.x ^= self.x << 13;
        self.x ^= self.x >> 7;
        self.x ^= self.x << 17;
        let c = (self.x >> 20) as usize % self.convs.len();
        let turn = self.convs[c].len();
        if turn == 0 || turn >= 400 {
            self.convs[c] = self.sys[c % 4].clone();
        }
        let prev = self.convs[c].clone();
        let toks: Vec<u32> = (0..24 * PS as u32)
            .map(|i| (self.x as u32).wrapping_add(i))
            .collect();
        let more = page_hashes(&toks, PS, prev.last());
        self.convs[c].extend(more);
        self.convs[c].clone()
    }
}

/// Warms with 20,000 requests; returns the next 4,000, precomputed (so that an iteration
/// measures the selector, not hashing), which the benchmark cycles through.
fn warm(observe: &mut dyn FnMut(&[PageHash]), s: &mut Stream) -> Vec<Vec<PageHash>> {
    for _ in 0..20_000 {
        observe(&s.next());
    }
    (0..4000).map(|_| s.next()).collect()
}

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("shadow");
    {
        let mut s = Stream::new();
        let cand = ShadowConfig::matrix_candidates()[0];
        let mut one = ShadowCache::new(cand, 2048, 8192).unwrap();
        let reqs = warm(
            &mut |h| {
                let _ = one.replay(h);
            },
            &mut s,
        );
        eprintln!("one shadow (lru, 10,240 pages): {} nodes", one.node_count());
        let mut i = 0;
        g.bench_function("one option's shadow, 10,240 pages", |b| {
            b.iter(|| {
                i = (i + 1) % reqs.len();
                one.replay(&reqs[i])
            })
        });
    }
    for (name, dev, host) in [
        ("selector of 4, full-size, 10,240 pages", 2048u32, 8192u32),
        ("selector of 4, full-size, 65,536 pages", 13_107, 52_429),
        ("selector of 4, sampled 1/5, 327,680 pages", 65_536, 262_144),
    ] {
        let mut s = Stream::new();
        let mut sel = ShadowSelector::new(ShadowConfig::default(), dev, host).unwrap();
        let reqs = warm(
            &mut |h| {
                let _ = sel.observe(h);
            },
            &mut s,
        );
        let snap = sel.snapshot();
        let nodes: usize = snap.shadows.iter().map(|x| x.nodes).sum();
        eprintln!(
            "{name}: sample 1/{}, {} of {} requests replayed, {nodes} nodes in the shadows, {} pages in the hot-prefix table",
            snap.sample, snap.replayed, snap.observed, snap.trunk_pages
        );
        let mut i = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % reqs.len();
                sel.observe(&reqs[i])
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = shadow;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(3));
    targets = benches
}
criterion_main!(shadow);
