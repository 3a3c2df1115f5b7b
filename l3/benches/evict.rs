//! A put that must evict, on a master of 100,000 complete objects, measured in the same run
//! at 1,000 objects: the walk of every candidate the eviction used to make shows as a
//! cost growing with the objects; an ordered index keeps it flat.
//!
//! - `quota_put`: a tenant at its DRAM quota puts one more object (its oldest goes): every
//!   such put evicts (a quota frees exactly what the put needs, no batch);
//! - `full_put`: the store past its high watermark: one put in `1 / eviction_ratio` frees a
//!   batch (5 % of the capacity), the others place at once; the mean per put.
//!
//! - `query_hit`: a read of a resident object (it moves to the back of the eviction order:
//!   what keeping the order costs every read).
//!
//! All run under the master lock, where every other client's put and get waits.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvtier_l3::master::{EvictionOutcome, Master, MasterPolicy};
use kvtier_l3::{ClientId, SegmentId, StoreConfig, Tenant};

const SIZE: u64 = 64;
const NODE: ClientId = ClientId(1);

fn put(m: &mut Master, t: &Tenant, key: &str) {
    let mut out = EvictionOutcome::default();
    let h = m
        .put_start(t, key, SIZE, 1, 0, &mut out)
        .expect("put_start");
    for r in h.replicas() {
        m.end_replica(NODE, &h.for_replica(r), false, 0)
            .expect("end_replica");
    }
}

/// A master with `objects` complete objects of tenant `bench`; `quota`: the tenant's DRAM
/// cap is exactly those objects (the segment has room for 4×), else the segment holds
/// them at the high watermark.
fn master(objects: usize, quota: bool) -> Master {
    let mut cfg = StoreConfig::default();
    // what each object is charged (value, keys "k{i:08}" of 9 bytes here, metadata)
    let bytes = objects as u64 * kvtier_l3::charge(SIZE, 9);
    let segment = if quota {
        cfg.tenant_quota_bytes.insert("bench".into(), bytes);
        bytes * 4
    } else {
        (bytes as f64 / cfg.high_watermark).ceil() as u64
    };
    let mut m = Master::new(MasterPolicy::from_config(&cfg));
    let addr = "127.0.0.1:9".parse().expect("addr");
    m.mount_node(NODE, SegmentId(1), segment, addr, 0)
        .expect("mount");
    let t = Tenant::new("bench").expect("tenant");
    for i in 0..objects {
        put(&mut m, &t, &format!("k{i:08}"));
    }
    m
}

fn bench(c: &mut Criterion) {
    let t = Tenant::new("bench").expect("tenant");
    for (name, quota) in [("quota_put", true), ("full_put", false)] {
        let mut g = c.benchmark_group(name);
        for objects in [1_000usize, 100_000] {
            let mut m = master(objects, quota);
            let mut i = objects;
            g.bench_with_input(BenchmarkId::from_parameter(objects), &objects, |b, _| {
                b.iter(|| {
                    i += 1;
                    put(&mut m, &t, &format!("k{i:08}"));
                })
            });
            assert!(
                m.stats().objects <= objects as u64 + 1,
                "{name}: nothing was evicted"
            );
        }
        g.finish();
    }
    let mut g = c.benchmark_group("query_hit");
    for objects in [1_000usize, 100_000] {
        let mut m = master(objects, true);
        let keys: Vec<String> = (0..objects).map(|i| format!("k{i:08}")).collect();
        let mut i = 0;
        g.bench_with_input(BenchmarkId::from_parameter(objects), &objects, |b, _| {
            b.iter(|| {
                i = (i + 7919) % objects;
                m.query(&t, &keys[i], 0).expect("query")
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
