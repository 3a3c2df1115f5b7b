//! `Master::stats()` and `Master::tenant_dram_bytes()` on a master of 100,000 complete objects
//! of one tenant, against the walks of every object they did before (`check_census` counts
//! from scratch and compares: both walks), measured in the same run. Both run under the
//! master lock, so a walk stalled every put and get while `/metrics` or a tier's gauges were
//! read, and a quota'd tenant's put walked its objects twice.

use criterion::{Criterion, criterion_group, criterion_main};
use kvtier_l3::master::{EvictionOutcome, Master, MasterPolicy};
use kvtier_l3::{ClientId, SegmentId, StoreConfig, Tenant};

const OBJECTS: usize = 100_000;

/// A split deployment's master (one store node; the master holds no bytes).
fn master() -> Master {
    let mut m = Master::new(MasterPolicy::from_config(&StoreConfig::default()));
    let node = ClientId(1);
    let addr = "127.0.0.1:9".parse().expect("addr");
    // room for every object as charged (value, key, metadata), twice over
    let each = kvtier_l3::charge(64, "k99999".len());
    m.mount_node(node, SegmentId(1), (OBJECTS as u64) * each * 2, addr, 0)
        .expect("mount");
    let t = Tenant::new("bench").expect("tenant");
    for i in 0..OBJECTS {
        let mut out = EvictionOutcome::default();
        let h = m
            .put_start(&t, &format!("k{i}"), 64, 1, 0, &mut out)
            .expect("put_start");
        for r in h.replicas() {
            m.end_replica(node, &h.for_replica(r), false, 0)
                .expect("end_replica");
        }
    }
    assert_eq!(m.stats().objects, OBJECTS as u64);
    m
}

fn bench(c: &mut Criterion) {
    let m = master();
    let t = Tenant::new("bench").expect("tenant");
    c.bench_function("stats_100k_objects", |b| b.iter(|| m.stats()));
    c.bench_function("tenant_dram_bytes_100k_objects", |b| {
        b.iter(|| m.tenant_dram_bytes(&t))
    });
    c.bench_function("check_census_100k_objects (both walks)", |b| {
        b.iter(|| m.check_census().expect("census"))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
