//! Per-tenant DRAM caps (`StoreConfig::tenant_quota_bytes`, `kvtier-l3 --tenant-quota`): a
//! tenant past its cap evicts its own least recently used objects, never another tenant's,
//! and a put that cannot fit (larger than the cap, or every object leased) fails with -200
//! leaving the store as it was. Engines that share one L3 (the vLLM tier's `tenant`) get a
//! share each instead of the busiest taking the whole cache.

use std::collections::BTreeMap;
use std::time::Duration;

mod common;

use common::procs::{args, eventually, master_in, node_with, spawn};
use common::{client, payload, t};
use kvtier_l3::{EmbeddedStore, L3Error, L3Store, StoreConfig};
use proptest::prelude::*;

const OBJ: usize = 256 << 10;

/// What `n` objects of OBJ bytes under two-byte keys ("a0" .. "a7") are charged: a quota
/// counts what the tenant's replicas cost the store (kvtier_l3::charge), keys and metadata
/// included.
fn objects(n: u64) -> u64 {
    n * kvtier_l3::charge(OBJ as u64, 2)
}

fn store(quota_a: u64) -> EmbeddedStore {
    EmbeddedStore::new(StoreConfig {
        local_segment_bytes: 64 << 20,
        loss_journal_keys: 1024,
        tenant_quota_bytes: BTreeMap::from([("a".to_string(), quota_a)]),
        ..StoreConfig::default()
    })
    .unwrap()
}

fn exists(s: &dyn L3Store, tenant: &str, key: &str) -> bool {
    s.is_exist(&t(tenant), key).unwrap()
}

/// Puts `n` objects of `OBJ` bytes, `{tenant}0` .. `{tenant}{n-1}`, into `tenant`.
fn put_objects(s: &dyn L3Store, tenant: &str, n: usize) {
    for i in 0..n {
        s.put(
            &t(tenant),
            &format!("{tenant}{i}"),
            &payload(i, OBJ),
            Default::default(),
        )
        .unwrap();
    }
}

/// What the cap must mean on any store (embedded, or a master of nodes): `a` keeps its four
/// newest objects, `b` (no cap, all older) keeps everything, a put larger than the cap and a
/// put that could only fit by evicting leased objects are -200 and change nothing.
fn check_caps(s: &dyn L3Store) {
    put_objects(s, "b", 8);
    put_objects(s, "a", 8);
    for i in 0..8 {
        assert!(
            exists(s, "b", &format!("b{i}")),
            "b{i}: another tenant evicted"
        );
        assert_eq!(exists(s, "a", &format!("a{i}")), i >= 4, "a{i}");
    }
    let big = s.put(
        &t("a"),
        "big",
        &payload(9, objects(4) as usize),
        Default::default(),
    );
    assert!(
        matches!(big, Err(L3Error::NoAvailableHandle { .. })),
        "{big:?}"
    );
    // Leases on everything `a` holds: nothing of it may be evicted, so no room.
    for i in 4..8 {
        s.get_replica_list(&t("a"), &format!("a{i}")).unwrap();
    }
    let leased = s.put(&t("a"), "late", &payload(10, OBJ), Default::default());
    assert!(
        matches!(leased, Err(L3Error::NoAvailableHandle { .. })),
        "{leased:?}"
    );
    for i in 4..8 {
        assert!(exists(s, "a", &format!("a{i}")));
    }
    assert!(!exists(s, "a", "big") && !exists(s, "a", "late"));
}

#[test]
fn a_tenant_past_its_cap_evicts_only_its_own_objects() {
    let s = store(objects(4));
    let cursor = s.losses_since(&t("a"), None).unwrap().next;
    check_caps(&s);
    // The engine is told: the loss journal names what the cap evicted.
    let l = s.losses_since(&t("a"), Some(cursor)).unwrap();
    for i in 0..4 {
        assert!(l.keys.contains(&format!("a{i}")), "{:?}", l.keys);
    }
}

#[test]
fn a_master_caps_tenants_across_its_nodes() {
    let state = tempfile::tempdir().unwrap();
    let quota = format!("a={}", objects(4));
    let master = master_in(
        "127.0.0.1:0",
        state.path(),
        &["--tenant-quota", &quota],
        None,
    );
    let _n1 = node_with(master.addr, 1, None, None, &["--segment-bytes", "33554432"]);
    let c = client(master.addr, None);
    assert!(eventually(Duration::from_secs(10), || c
        .put(&t("probe"), "p", b"x", Default::default())
        .is_ok()));
    check_caps(&c);
}

#[test]
fn a_malformed_quota_flag_is_refused_at_startup() {
    for bad in ["a", "a=lots", "=5", "a/b=5"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
            .args(args(&["--tenant-quota", bad]))
            .output()
            .unwrap();
        assert!(!out.status.success(), "{bad:?} accepted");
    }
    // A good one starts.
    let _p = spawn(
        &args(&["--listen", "127.0.0.1:0", "--tenant-quota", "a=1048576"]),
        None,
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Random puts of two tenants, one capped: the capped tenant never holds more than its
    /// cap, and the uncapped one never loses an object (the segment is large enough).
    #[test]
    fn a_capped_tenant_never_exceeds_its_cap(
        puts in proptest::collection::vec((any::<bool>(), 1usize..(3 * OBJ)), 1..40),
    ) {
        let cap = 4 * OBJ as u64;
        let s = store(cap);
        let mut b_keys = Vec::new();
        let mut sizes: Vec<(&str, String, u64)> = Vec::new();
        for (i, (is_a, len)) in puts.into_iter().enumerate() {
            let (tn, key) = if is_a { ("a", format!("a{i}")) } else { ("b", format!("b{i}")) };
            let r = s.put(&t(tn), &key, &payload(i, len), Default::default());
            prop_assert!(r.is_ok(), "{key}: {r:?}");
            sizes.push((tn, key.clone(), len as u64));
            if !is_a {
                b_keys.push(key);
            }
            prop_assert!(s.tenant_dram_bytes(&t("a")) <= cap);
            // the bytes a quota reads are kept at every change (the master's table.rs): they
            // equal the sizes of the tenant's keys still in memory (one replica each here)
            for tn in ["a", "b"] {
                let want: u64 = sizes.iter()
                    .filter(|(n, k, _)| *n == tn && s.residency(&t(tn), k).0)
                    .map(|(_, k, len)| kvtier_l3::charge(*len, k.len()))
                    .sum();
                prop_assert_eq!(s.tenant_dram_bytes(&t(tn)), want, "tenant {}", tn);
            }
        }
        for k in b_keys {
            prop_assert!(exists(&s, "b", &k), "{k} evicted");
        }
    }
}

/// A put refused by the cap (-200) "changes nothing": it evicted the tenant's objects it
/// could before finding it could not free enough (6 of 8 leased, a put needing 4 freed 2:
/// two objects gone, in the loss journal, for a put that never happened).
#[test]
fn a_put_the_cap_refuses_evicts_nothing() {
    let s = store(objects(8));
    put_objects(&s, "a", 8);
    for i in 0..6 {
        s.get_replica_list(&t("a"), &format!("a{i}")).unwrap(); // leased
    }
    let cursor = s.losses_since(&t("a"), None).unwrap().next;
    let r = s.put(&t("a"), "big", &payload(9, 4 * OBJ), Default::default());
    assert!(matches!(r, Err(L3Error::NoAvailableHandle { .. })), "{r:?}");
    for i in 0..8 {
        assert!(
            exists(&s, "a", &format!("a{i}")),
            "a{i} evicted by a refused put"
        );
    }
    assert!(
        s.losses_since(&t("a"), Some(cursor))
            .unwrap()
            .keys
            .is_empty()
    );
    assert_eq!(s.tenant_dram_bytes(&t("a")), objects(8));
}

/// A put is charged for the replicas it can get, not for `replica_num`: on a store with one
/// segment owner a put of 3 replicas gets one, and was refused under a cap of 2 objects.
#[test]
fn a_put_is_charged_for_the_replicas_it_gets() {
    let s = store(objects(2));
    let cfg = kvtier_l3::ReplicateConfig { replica_num: 3 };
    let r = s.batch_put_from_with(
        &t("a"),
        &["k".to_string()],
        &[&payload(1, OBJ)[..]],
        Default::default(),
        cfg,
    );
    assert!(matches!(r.as_deref(), Ok([Ok(())])), "{r:?}");
    assert_eq!(
        s.tenant_dram_bytes(&t("a")),
        kvtier_l3::charge(OBJ as u64, "k".len())
    );
}

/// A copy of a replica to another segment counts against the cap like a put: it took a
/// tenant at its cap to twice it.
#[test]
fn a_replica_copy_past_the_cap_is_refused() {
    use kvtier_l3::{ClientId, SegmentId};
    let s = store(objects(2));
    s.mount_segment(ClientId(7), SegmentId(1007), 16 << 20)
        .unwrap();
    put_objects(&s, "a", 2);
    let r = s.copy_replica(&t("a"), "a0", SegmentId(1007));
    let r2 = if r.as_ref().is_ok_and(|c| !c) {
        s.copy_replica(&t("a"), "a0", kvtier_l3::store::LOCAL_SEGMENT)
    } else {
        r
    };
    assert!(
        matches!(r2, Err(L3Error::NoAvailableHandle { .. })),
        "{r2:?}"
    );
    assert_eq!(s.tenant_dram_bytes(&t("a")), objects(2));
}

/// A promotion from SSD counts against the cap: one `exist(prefetch_to_memory)` over the
/// tenant's SSD-only objects took it to 4× its cap (and their leases then refused its puts).
#[test]
fn a_promotion_past_the_cap_is_skipped_and_the_object_still_reads() {
    let dir = tempfile::tempdir().unwrap();
    let s = EmbeddedStore::new(StoreConfig {
        local_segment_bytes: 64 << 20,
        tenant_quota_bytes: BTreeMap::from([("a".to_string(), objects(4))]),
        ssd: Some(kvtier_l3::SsdConfig::new(dir.path())),
        ..StoreConfig::default()
    })
    .unwrap();
    let keys: Vec<String> = (0..16).map(|i| format!("a{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        s.put(&t("a"), k, &payload(i, OBJ), Default::default())
            .unwrap();
    }
    s.flush().unwrap();
    assert!(s.tenant_dram_bytes(&t("a")) <= objects(4));
    let opts = kvtier_l3::ExistOptions {
        prefetch_to_memory: true,
    };
    let found = s.exist_many(&t("a"), &keys, opts).unwrap();
    assert!(found.iter().all(|r| matches!(r, Ok(true))));
    s.flush().unwrap();
    std::thread::sleep(Duration::from_millis(300)); // promotions run on their workers
    assert!(
        s.tenant_dram_bytes(&t("a")) <= objects(4),
        "{} bytes in DRAM under a cap of {}",
        s.tenant_dram_bytes(&t("a")),
        objects(4)
    );
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(s.get(&t("a"), k).unwrap(), payload(i, OBJ), "{k}");
    }
}
