//! One routing decision for a 4K-token prompt over 8 instances (issue 35: <= 20 us): each
//! instance holds a different share of the prompt on GPU and 2,000 other pages, the store
//! 16,000 pages; the prompt's page hashing (SHA-256 per 16-token page) included.

use criterion::{Criterion, criterion_group, criterion_main};
use kvtier_events::{HashFormat, Medium};
use kvtier_radix::{HashScope, page_hashes};
use kvtier_router::{CostModel, IndexEvent, Occupancy, Router};

fn bench(c: &mut Criterion) {
    let model = CostModel::h100_llama8b();
    let mut r = Router::new(8, model, 10_000_000).expect("the H100 model is valid");
    let prompt: Vec<u32> = (0..4096).collect();
    let hs: Vec<u64> = page_hashes(&prompt, model.page_size, None)
        .iter()
        .map(HashFormat::int64)
        .collect();
    for i in 0..8usize {
        let mut mine: Vec<u64> = hs[..i * 32].to_vec();
        mine.extend((0..2000u64).map(|k| ((i as u64 + 1) << 40) | k));
        r.apply(
            i,
            &IndexEvent::Stored {
                medium: Medium::Gpu,
                hashes: mine,
            },
        )
        .expect("instance");
    }
    let store: Vec<u64> = hs
        .iter()
        .copied()
        .chain((0..16_000u64).map(|k| (99 << 40) | k))
        .collect();
    r.apply(
        0,
        &IndexEvent::Stored {
            medium: Medium::Storage,
            hashes: store,
        },
    )
    .expect("instance");
    let scope = HashScope::new(None, None, Vec::new());
    c.bench_function("route_4k_tokens_8_instances", |b| {
        let mut t = 0.0;
        b.iter(|| {
            t += 1.0; // a second apart: queues drain, every decision sees the same prices
            r.route(&prompt, &scope, t).map(|x| x.0)
        })
    });
    c.bench_function("route_hashes_4k_tokens_8_instances", |b| {
        let mut t = 0.0;
        b.iter(|| {
            t += 1.0;
            r.route_hashes(&hs, prompt.len(), t).map(|x| x.0)
        })
    });
    // Closed-loop routing as the simulator does it: 8 running requests of 4K tokens booked
    // on each instance (sharing their first 1K tokens), then per iteration one request
    // routed, its first token and its end reported (the running set stays the same).
    r.set_occupancy(Some(Occupancy {
        device_tokens: 131_072.0,
        decode_step_s: 0.01,
    }))
    .expect("a finite occupancy");
    let mut id = 0u64;
    for k in 0..64u64 {
        let mut other: Vec<u64> = hs[..64].to_vec();
        other.extend((64..256u64).map(|p| ((k + 1000) << 40) | p));
        r.route_tracked(k, &other, prompt.len(), 128, 0.0)
            .expect("route");
        r.first_token(k, 0.01);
        id = k + 1;
    }
    c.bench_function("route_tracked_4k_tokens_8_instances", |b| {
        let mut t = 1.0;
        b.iter(|| {
            t += 0.001;
            id += 1;
            let x = r.route_tracked(id, &hs, prompt.len(), 128, t).map(|x| x.0);
            r.first_token(id, t + 0.02);
            r.finished(id, t + 0.5);
            x
        })
    });
    c.bench_function("hash_4k_tokens", |b| {
        b.iter(|| page_hashes(&prompt, model.page_size, None).len())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
