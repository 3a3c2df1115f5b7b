//! Radix cache benchmarks (figures recorded in docs/benchmarks.md).
//!
//! Tree: ~100,000 cached pages of 64 tokens (196 prompts of 512 pages sharing a 16-page
//! system prompt). Targets: `match_prefix` of a 32K-token (512-page) prompt ≤ 20 µs; page
//! hashing ≥ 1 GB/s of token bytes; insert + evict ≤ 1 µs per page amortised.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvtier_radix::*;

const PS: usize = 64;
const PAGES: usize = 512;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 16) as u32
    }
}

fn prompt(rng: &mut Rng, shared: &[u32]) -> Vec<u32> {
    let mut t = shared.to_vec();
    while t.len() < PAGES * PS {
        t.push(rng.next() % 128_000);
    }
    t
}

/// A prompt's tokens and page hashes.
type Prompt = (Vec<u32>, Vec<PageHash>);

fn build() -> (RadixCache, Vec<Prompt>) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let shared: Vec<u32> = (0..16 * PS).map(|_| rng.next() % 128_000).collect();
    let mut c = RadixCache::new(RadixConfig {
        page_size: PS,
        device_pages: 110_000,
        host_pages: 1,
        record_events: false,
    })
    .unwrap();
    let mut prompts = Vec::new();
    for _ in 0..196 {
        let t = prompt(&mut rng, &shared);
        let h = page_hashes(&t, PS, None);
        let m = c.match_prefix(&h);
        let pages = c.alloc::<Device>(PAGES - m.device_pages).unwrap();
        c.insert::<Device>(m.device_node, m.device_pages, &h, &t, &pages)
            .unwrap();
        prompts.push((t, h));
    }
    (c, prompts)
}

fn benches(c: &mut Criterion) {
    let (mut cache, prompts) = build();
    let cached = cache.usage(TierKind::Device).cached;
    eprintln!("tree: {cached} cached pages, {} nodes", cache.node_count());

    let mut g = c.benchmark_group("radix");
    let (_, h) = &prompts[97];
    g.bench_function("match_prefix_512_pages_of_100k", |b| {
        b.iter(|| {
            let m = cache.match_prefix(std::hint::black_box(h));
            assert_eq!(m.device_pages, PAGES);
        })
    });

    let (t, _) = &prompts[3];
    g.throughput(Throughput::Bytes((t.len() * 4) as u64));
    g.bench_function("page_hashes_32k_tokens", |b| {
        b.iter(|| page_hashes(std::hint::black_box(t), PS, None))
    });

    // Insert a fresh 512-page prompt, then evict 512 LRU pages: steady-state churn.
    let mut rng = Rng(7);
    let fresh: Vec<Prompt> = (0..64)
        .map(|_| {
            let t = prompt(&mut rng, &[]);
            let h = page_hashes(&t, PS, None);
            (t, h)
        })
        .collect();
    let mut i = 0;
    g.throughput(Throughput::Elements(PAGES as u64));
    churn(
        &mut g,
        &mut cache,
        &fresh,
        &mut i,
        "insert_then_evict_512_pages",
    );
    // The same churn under freq-depth, whose use memory remembers every evicted page and
    // recalls it when the prompt comes back (each of the 64 prompts does): its cost beside
    // LRU's above, in the same run.
    cache.set_eviction_policy(EvictionPolicy::CONVERSATION);
    churn(
        &mut g,
        &mut cache,
        &fresh,
        &mut i,
        "insert_then_evict_512_pages_freq_depth",
    );
    g.finish();
}

/// Inserts a fresh 512-page prompt, then evicts 512 pages: steady-state churn.
fn churn(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    cache: &mut RadixCache,
    fresh: &[Prompt],
    i: &mut usize,
    name: &str,
) {
    g.bench_function(name, |b| {
        b.iter_batched(
            || {
                *i = (*i + 1) % fresh.len();
                *i
            },
            |i| {
                let (t, h) = &fresh[i];
                let root = cache.root();
                let pages = cache.alloc_evicting::<Device>(PAGES).unwrap();
                let out = cache.insert::<Device>(root, 0, h, t, &pages).unwrap();
                if !out.duplicates.is_empty() {
                    let d: Vec<_> = out.duplicates.iter().map(|d| d.1).collect();
                    cache.free(&d).unwrap();
                }
                cache.evict::<Device>(PAGES)
            },
            BatchSize::SmallInput,
        )
    });
}

criterion_group! {
    name = radix;
    config = Criterion::default().sample_size(50).measurement_time(std::time::Duration::from_secs(3));
    targets = benches
}
criterion_main!(radix);
