//! The master's eviction walks an order it keeps at every change (`master/order.rs`) instead
//! of sorting every object each time, and lets reads leave stale entries behind (a walk fixes
//! them). What that must keep, on any sequence of puts, reads, SSD copies and removes over
//! several tenants, one with a DRAM quota:
//!
//! - the kept order satisfies its invariant (`check_census`);
//! - a put that evicts takes memory replicas in rank order: objects with an SSD copy before
//!   those without, least recently used first within each — every object it evicted ranks
//!   before every candidate it left (across tenants for the store's capacity, within the
//!   tenant for a quota), and a quota's eviction never takes another tenant's object.

use std::collections::{BTreeMap, HashMap};

use kvtier_l3::master::{DiskLoc, EvictionOutcome, Master, MasterPolicy};
use kvtier_l3::{ClientId, SegmentId, StoreConfig, Tenant};
use proptest::prelude::*;

const SIZE: u64 = 64;
const NODE: ClientId = ClientId(1);
const TENANTS: [&str; 3] = ["a", "b", "q"];
/// `q`'s DRAM quota: 6 objects.
const QUOTA: u64 = 6 * SIZE;

#[derive(Debug, Clone)]
enum Op {
    Put(usize, u8),
    Read(usize, u8),
    Persist(usize, u8),
    Remove(usize, u8),
}

fn op() -> impl Strategy<Value = Op> {
    let tk = || (0..TENANTS.len(), 0u8..24);
    prop_oneof![
        4 => tk().prop_map(|(t, k)| Op::Put(t, k)),
        3 => tk().prop_map(|(t, k)| Op::Read(t, k)),
        2 => tk().prop_map(|(t, k)| Op::Persist(t, k)),
        1 => tk().prop_map(|(t, k)| Op::Remove(t, k)),
    ]
}

fn master() -> (Master, u64) {
    let cfg = StoreConfig {
        tenant_quota_bytes: BTreeMap::from([("q".to_string(), QUOTA)]),
        ..StoreConfig::default()
    };
    let lease = cfg.lease_ttl.as_millis() as u64;
    let mut m = Master::new(MasterPolicy::from_config(&cfg));
    let addr = "127.0.0.1:9".parse().expect("addr");
    // 20 objects: past the high watermark (90 %) after 18.
    m.mount_node(NODE, SegmentId(1), 20 * SIZE, addr, 0)
        .expect("mount");
    (m, lease)
}

/// Where an object in memory ranks for eviction: (no SSD copy, last used).
type Rank = (bool, usize);

fn in_memory(m: &Master, t: &Tenant, k: &str) -> bool {
    m.current_replicas(t, k)
        .is_ok_and(|(allocs, _)| !allocs.is_empty())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    #[test]
    fn evictions_take_memory_in_rank_order_and_the_order_stays_exact(
        ops in proptest::collection::vec(op(), 1..160),
    ) {
        let (mut m, lease) = master();
        let tenants: Vec<Tenant> = TENANTS.iter().map(|n| Tenant::new(*n).expect("tenant")).collect();
        // The model: every object with a memory replica, its rank; every object's version.
        let mut mem: HashMap<(usize, String), Rank> = HashMap::new();
        let mut token: HashMap<(usize, String), u64> = HashMap::new();
        for (step, op) in ops.iter().enumerate() {
            // Each op later than every lease an earlier read took: leases never block here.
            let now = (step as u64 + 1) * (lease + 1);
            match op {
                Op::Put(ti, k) => {
                    let key = format!("k{k}");
                    let mut out = EvictionOutcome::default();
                    let before = mem.clone();
                    let Ok(h) = m.put_start(&tenants[*ti], &key, SIZE, 1, now, &mut out) else {
                        continue;
                    };
                    for r in h.replicas() {
                        m.end_replica(NODE, &h.for_replica(r), false, now).expect("end_replica");
                    }
                    token.insert((*ti, key.clone()), h.token);
                    mem.retain(|(t, k), _| in_memory(&m, &tenants[*t], k));
                    mem.insert((*ti, key.clone()), (true, step));
                    let evicted: Vec<_> = before
                        .iter()
                        .filter(|(id, _)| !mem.contains_key(*id) && **id != (*ti, key.clone()))
                        .collect();
                    prop_assert_eq!(evicted.len() as u64, out.evicted, "{:?}", evicted);
                    let quota_only = evicted.iter().all(|((t, _), _)| TENANTS[*t] == "q")
                        && TENANTS[*ti] == "q";
                    for ((t, k), at) in &evicted {
                        for ((t2, k2), at2) in &mem {
                            if (*t2, k2) == (*ti, &key) {
                                continue; // the put itself
                            }
                            // A quota's eviction is within the tenant; the capacity's is global.
                            if quota_only && *t2 != *t {
                                continue;
                            }
                            prop_assert!(
                                at < &at2,
                                "evicted {}/{} (rank {:?}) but kept {}/{} (rank {:?})",
                                TENANTS[*t], k, at, TENANTS[*t2], k2, at2
                            );
                        }
                    }
                    prop_assert!(m.tenant_dram_bytes(&tenants[2]) <= QUOTA);
                }
                Op::Read(ti, k) => {
                    let key = format!("k{k}");
                    if m.query(&tenants[*ti], &key, now).is_ok()
                        && let Some(r) = mem.get_mut(&(*ti, key))
                    {
                        r.1 = step;
                    }
                }
                Op::Persist(ti, k) => {
                    let key = format!("k{k}");
                    let Some(&tok) = token.get(&(*ti, key.clone())) else { continue };
                    let loc = DiskLoc { bucket: step as u64, offset: 0, size: SIZE, crc: 0 };
                    if m.register_disk(NODE, &tenants[*ti], &key, tok, loc)
                        && let Some(r) = mem.get_mut(&(*ti, key))
                    {
                        r.0 = false; // saved: it goes before every unsaved one
                    }
                }
                Op::Remove(ti, k) => {
                    let key = format!("k{k}");
                    if m.remove(&tenants[*ti], &key, true, now).is_ok() {
                        mem.remove(&(*ti, key.clone()));
                        token.remove(&(*ti, key));
                    }
                }
            }
            prop_assert!(m.check_census().is_ok(), "{:?}", m.check_census());
            for (t, k) in mem.keys() {
                prop_assert!(in_memory(&m, &tenants[*t], k), "{}/{} left memory", TENANTS[*t], k);
            }
        }
    }
}
