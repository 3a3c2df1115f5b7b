//! Embedded store semantics: two-phase put, first writer wins, put timeout, leases (-706,
//! -707), eviction order and watermarks, soft pins, tenant isolation, client liveness.

use std::time::Duration;

use proptest::prelude::*;

use kvtier_l3::{
    ClientId, ClientStatus, EmbeddedStore, ExistOptions, L3Error, L3Store, PutOptions, SegmentId,
    StoreConfig, Tenant, charge,
};

fn t(name: &str) -> Tenant {
    Tenant::new(name).unwrap()
}

fn store(seg: u64) -> EmbeddedStore {
    EmbeddedStore::new(StoreConfig {
        local_segment_bytes: seg,
        ..Default::default()
    })
    .unwrap()
}

fn keys(n: usize, p: &str) -> Vec<String> {
    (0..n).map(|i| format!("{p}{i}")).collect()
}

#[test]
fn two_phase_put_and_revoke() {
    let s = store(1 << 20);
    let a = t("a");
    let h = s.put_start(&a, "k", 4).unwrap();
    // Pending: not visible, second writer loses.
    assert!(!s.is_exist(&a, "k").unwrap());
    assert_eq!(s.put_start(&a, "k", 4).unwrap_err().code_i32(), -705);
    assert_eq!(s.get(&a, "k").unwrap_err(), L3Error::ReplicaIsNotReady);
    // PutEnd before the write: not ready.
    assert_eq!(
        s.put_end(&h, PutOptions::default()).unwrap_err().code_i32(),
        -703
    );
    s.put_write(&h, b"abcd").unwrap();
    s.put_end(&h, PutOptions::default()).unwrap();
    assert_eq!(s.get(&a, "k").unwrap(), b"abcd");
    assert_eq!(s.get_size(&a, "k").unwrap(), 4);
    // First writer wins over a completed object.
    assert_eq!(
        s.put(&a, "k", b"zzzz", PutOptions::default())
            .unwrap_err()
            .code_i32(),
        -705
    );
    assert_eq!(s.get(&a, "k").unwrap(), b"abcd");
    // Revoke frees the key.
    let h2 = s.put_start(&a, "r", 3).unwrap();
    s.put_revoke(&h2).unwrap();
    assert_eq!(s.get(&a, "r").unwrap_err().code_i32(), -704);
    // what "k" is charged: its 4 bytes, its key and its metadata
    assert_eq!(s.stats().unwrap().mem_used_bytes, charge(4, "k".len()));
    // A revoked handle can no longer end anything.
    assert!(s.put_end(&h2, PutOptions::default()).is_err());
}

#[test]
fn half_done_put_is_revoked_after_timeout_and_old_token_is_refused() {
    let s = store(1 << 20);
    let a = t("a");
    let stale = s.put_start(&a, "k", 2).unwrap();
    s.clock().advance(Duration::from_secs(31));
    // A new writer takes over the key; the stale writer can no longer end it.
    let fresh = s.put_start(&a, "k", 2).unwrap();
    assert_eq!(s.put_write(&stale, b"xx").unwrap_err().code_i32(), -601);
    s.put_write(&fresh, b"ok").unwrap();
    assert_eq!(
        s.put_end(&stale, PutOptions::default())
            .unwrap_err()
            .code_i32(),
        -601
    );
    s.put_end(&fresh, PutOptions::default()).unwrap();
    assert_eq!(s.get(&a, "k").unwrap(), b"ok");
    // The sweeper also revokes abandoned puts on its own.
    let _h = s.put_start(&a, "abandoned", 8).unwrap();
    s.clock().advance(Duration::from_secs(31));
    let (revoked, _) = s.sweep_now();
    assert_eq!(revoked, 1);
    assert_eq!(s.stats().unwrap().mem_used_bytes, charge(2, "k".len()));
}

#[test]
fn batch_put_forms() {
    let s = store(1 << 20);
    let a = t("a");
    let ks = keys(3, "b");
    let hs: Vec<_> = s
        .batch_put_start(&a, &ks, &[1, 2, 3])
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    for (i, h) in hs.iter().enumerate() {
        s.put_write(h, &vec![i as u8; i + 1]).unwrap();
    }
    let r = s.batch_put_end(&hs[..2], PutOptions::default()).unwrap();
    assert!(r.iter().all(Result::is_ok));
    assert!(s.batch_put_revoke(&hs[2..]).unwrap()[0].is_ok());
    let ex = s.batch_is_exist(&a, &ks).unwrap();
    assert_eq!(
        ex.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        vec![true, true, false]
    );
    assert_eq!(
        s.batch_put_start(&a, &ks, &[1]).unwrap_err().code_i32(),
        -600
    );
}

#[test]
fn leases_block_remove_unless_forced_and_probes_take_none() {
    let s = store(1 << 20);
    let a = t("a");
    s.put(&a, "k", b"v", PutOptions::default()).unwrap();
    // Probes take no lease.
    for _ in 0..100 {
        assert!(s.exist_key(&a, "k", ExistOptions::default()).unwrap());
    }
    assert!(!s.is_leased(&a, "k"));
    s.get(&a, "k").unwrap();
    assert!(s.is_leased(&a, "k"));
    assert_eq!(
        s.remove(&a, "k", false).unwrap_err(),
        L3Error::ObjectHasLease
    );
    assert_eq!(L3Error::ObjectHasLease.code_i32(), -706);
    // Default lease is 10 s.
    s.clock().advance(Duration::from_millis(9_900));
    assert!(s.is_leased(&a, "k"));
    s.clock().advance(Duration::from_millis(200));
    s.remove(&a, "k", false).unwrap();
    // Forced removal ignores the lease.
    s.put(&a, "f", b"v", PutOptions::default()).unwrap();
    s.get(&a, "f").unwrap();
    s.remove(&a, "f", true).unwrap();
    assert_eq!(s.remove(&a, "f", true).unwrap_err().code_i32(), -704);
}

#[test]
fn batch_query_then_get_reuses_results_and_rejects_expired_per_key() {
    let s = store(1 << 20);
    let a = t("a");
    let ks = keys(4, "q");
    for k in &ks {
        s.put(&a, k, k.as_bytes(), PutOptions::default()).unwrap();
    }
    let qs: Vec<_> = s
        .batch_query(&a, &ks)
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(
        qs.iter()
            .all(|q| q.lease_deadline_ms >= 10_000 && !q.replicas.is_empty())
    );
    let mut data = [0u8; 4 * 8];
    let mut bufs: Vec<&mut [u8]> = data.chunks_mut(8).collect();
    let r = s.batch_get_with_query(&a, &qs, &mut bufs).unwrap();
    for (i, x) in r.iter().enumerate() {
        assert_eq!(*x.as_ref().unwrap(), ks[i].len() as u64);
        assert_eq!(&bufs[i][..ks[i].len()], ks[i].as_bytes());
    }
    // Re-query one key after the others' leases expire: only that one is served.
    s.clock().advance(Duration::from_secs(6));
    let fresh = s
        .batch_query(&a, &ks[1..2])
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    s.clock().advance(Duration::from_secs(5));
    let mut mixed = qs.clone();
    mixed[1] = fresh;
    let r = s.batch_get_with_query(&a, &mixed, &mut bufs).unwrap();
    assert_eq!(r[0], Err(L3Error::LeaseExpired));
    assert_eq!(r[0].as_ref().unwrap_err().code_i32(), -707);
    assert_eq!(r[1], Ok(2));
    assert_eq!(r[2], Err(L3Error::LeaseExpired));
    // Another tenant replaying these query results gets misses, never bytes.
    let qs2: Vec<_> = s
        .batch_query(&a, &ks)
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let r = s.batch_get_with_query(&t("b"), &qs2, &mut bufs).unwrap();
    assert!(r.iter().all(|x| *x == Err(L3Error::ObjectNotFound)));
}

#[test]
fn eviction_watermark_lru_leases_and_pins() {
    // 100 objects of 1 KiB (each charged its key and metadata too) fill the segment; high
    // watermark 0.90 → eviction past 90 of them.
    let each = charge(1024, 3);
    let s = store(100 * each);
    let a = t("a");
    let obj = vec![1u8; 1024];
    for i in 0..90 {
        let pin = PutOptions {
            soft_pin: i < 5,
            ..Default::default()
        };
        s.put(&a, &format!("k{i:02}"), &obj, pin).unwrap();
    }
    assert_eq!(s.stats().unwrap().mem_objects, 90);
    // Lease k5..k9 (the oldest unpinned) and touch k10 so it is recent.
    for i in 5..10 {
        s.get(&a, &format!("k{i:02}")).unwrap();
    }
    s.put(&a, "k90", &obj, PutOptions::default()).unwrap();
    let st = s.stats().unwrap();
    // Passing 90% evicts 5% of capacity (5 objects).
    assert_eq!(st.mem_objects, 86, "{st:?}");
    for i in 0..10 {
        assert!(
            s.is_exist(&a, &format!("k{i:02}")).unwrap(),
            "pinned or leased k{i} evicted"
        );
    }
    for i in 10..15 {
        assert!(
            !s.is_exist(&a, &format!("k{i:02}")).unwrap(),
            "k{i} should be LRU victim"
        );
    }
    assert!(st.mem_used_bytes <= 90 * each);
    // Leases expire; pins hold: next victims are unpinned ones before pinned.
    s.clock().advance(Duration::from_secs(11));
    for i in 91..96 {
        s.put(&a, &format!("k{i:02}"), &obj, PutOptions::default())
            .unwrap();
    }
    for i in 0..5 {
        assert!(
            s.is_exist(&a, &format!("k{i:02}")).unwrap(),
            "pinned k{i} evicted early"
        );
    }
}

#[test]
fn no_space_when_everything_is_leased() {
    let s = store(10 * charge(1024, "k0".len()));
    let a = t("a");
    for i in 0..9 {
        s.put(&a, &format!("k{i}"), &[0u8; 1024], PutOptions::default())
            .unwrap();
        s.get(&a, &format!("k{i}")).unwrap();
    }
    let e = s
        .put(&a, "big", &[0u8; 2048], PutOptions::default())
        .unwrap_err();
    assert_eq!(e.code_i32(), -200);
    assert_eq!(s.stats().unwrap().mem_objects, 9);
    assert_eq!(
        s.put(&a, "huge", &vec![0u8; 20 * 1024], PutOptions::default())
            .unwrap_err()
            .code_i32(),
        -200
    );
}

/// A put whose charge no segment can hold is -200 before anything is evicted: it fits none of
/// them however much is evicted. Since values are charged their key and metadata
/// (`kvtier_l3::charge`), a value of exactly a segment's size is such a put; with two 1 MiB
/// segments (2 MiB in all) it evicted 1 MiB of other objects — every one here, and under a
/// tenant quota the tenant's own — and was then refused.
#[test]
fn a_put_no_segment_can_hold_is_refused_without_evicting() {
    use std::collections::BTreeMap;
    const SEG: u64 = 1 << 20;
    for quota in [None, Some(3 * SEG / 2)] {
        let s = EmbeddedStore::new(StoreConfig {
            local_segment_bytes: SEG,
            tenant_quota_bytes: quota
                .map(|q| BTreeMap::from([("a".to_string(), q)]))
                .unwrap_or_default(),
            ..Default::default()
        })
        .unwrap();
        s.mount_segment(ClientId(7), SegmentId(7), SEG).unwrap();
        let a = t("a");
        let objs = keys(10, "k");
        for k in &objs {
            s.put(&a, k, &[1u8; 64 << 10], PutOptions::default())
                .unwrap();
        }
        let before = s.stats().unwrap();
        let e = s
            .put(&a, "seg", &vec![2u8; SEG as usize], PutOptions::default())
            .unwrap_err();
        assert!(
            matches!(e, L3Error::NoAvailableHandle { needed } if needed == charge(SEG, 3)),
            "{e:?}"
        );
        for k in &objs {
            assert!(
                s.is_exist(&a, k).unwrap(),
                "{k} evicted for a refused put (quota {quota:?})"
            );
        }
        assert_eq!(s.stats().unwrap(), before);
    }
}

/// A put asking for more replicas than there are segment owners gets one per owner, and
/// evicts nothing for the others: on a store with one owner a put of 2 replicas evicted an
/// object at every put, with DRAM nearly empty.
#[test]
fn replicas_beyond_the_owners_evict_nothing() {
    let s = store(16 << 20);
    let a = t("a");
    let objs = keys(8, "k");
    for k in &objs {
        s.put(&a, k, &[1u8; 64 << 10], PutOptions::default())
            .unwrap();
    }
    for (i, n) in [2u32, 3, 8].into_iter().enumerate() {
        s.put_with(
            &a,
            &format!("r{i}"),
            &[3u8; 64 << 10],
            PutOptions::default(),
            kvtier_l3::ReplicateConfig::replicas(n),
        )
        .unwrap();
    }
    for k in objs.iter().chain(&keys(3, "r")) {
        assert!(
            s.is_exist(&a, k).unwrap(),
            "{k} evicted at 3 % of the segment"
        );
    }
    assert_eq!(s.stats().unwrap().mem_objects, 11);
}

#[test]
fn tenants_are_isolated() {
    let s = store(1 << 20);
    let (a, b) = (t("a"), t("b"));
    s.put(&a, "k", b"secret", PutOptions::default()).unwrap();
    assert!(!s.is_exist(&b, "k").unwrap());
    assert_eq!(s.get(&b, "k").unwrap_err().code_i32(), -704);
    assert_eq!(s.get_size(&b, "k").unwrap_err().code_i32(), -704);
    assert_eq!(s.remove(&b, "k", true).unwrap_err().code_i32(), -704);
    assert_eq!(s.remove_all(&b, true).unwrap(), 0);
    assert!(s.get_replica_list(&b, "k").is_err());
    // b may write its own "k" independently.
    s.put(&b, "k", b"other", PutOptions::default()).unwrap();
    assert_eq!(s.get(&a, "k").unwrap(), b"secret");
    // a's "k" was just read, so it is leased: RemoveAll skips it unless forced.
    assert_eq!(s.remove_all(&a, false).unwrap(), 0);
    assert_eq!(s.remove_all(&a, true).unwrap(), 1);
    assert_eq!(s.get(&b, "k").unwrap(), b"other");
}

#[test]
fn bad_input_is_typed_and_leaves_state_untouched() {
    let s = store(1 << 20);
    let a = t("a");
    assert!(Tenant::new("").is_err());
    assert_eq!(
        s.put(&a, "", b"x", PutOptions::default())
            .unwrap_err()
            .code_i32(),
        -400
    );
    assert_eq!(
        s.put(&a, "k", b"", PutOptions::default())
            .unwrap_err()
            .code_i32(),
        -600
    );
    let mut small = [0u8; 2];
    s.put(&a, "k", b"abcd", PutOptions::default()).unwrap();
    assert_eq!(s.get_into(&a, "k", &mut small).unwrap_err().code_i32(), -10);
    let mut b1 = [0u8; 4];
    let mut bufs: Vec<&mut [u8]> = vec![&mut b1];
    assert_eq!(
        s.batch_get_into(&a, &keys(2, "x"), &mut bufs)
            .unwrap_err()
            .code_i32(),
        -600
    );
    let big = EmbeddedStore::new(StoreConfig {
        max_batch_keys: 2,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(
        big.batch_is_exist(&a, &keys(3, "x"))
            .unwrap_err()
            .code_i32(),
        -600
    );
    assert!(
        EmbeddedStore::new(StoreConfig {
            high_watermark: 1.5,
            ..Default::default()
        })
        .is_err()
    );
    assert_eq!(s.stats().unwrap().objects, 1);
}

/// A read lease of zero expires as it is granted: every query-then-get (the path kvtier's
/// prefetches take) would be refused with -707 while plain gets work, so no L3 page would
/// ever load. Refused when the store is made.
#[test]
fn a_zero_read_lease_is_refused_at_config() {
    let e = EmbeddedStore::new(StoreConfig {
        lease_ttl: Duration::ZERO,
        ..Default::default()
    })
    .err()
    .expect("a zero lease must be refused");
    assert_eq!(e.code_i32(), -600, "{e}");
    assert!(e.to_string().contains("lease"), "{e}");
    let one_ms = EmbeddedStore::new(StoreConfig {
        lease_ttl: Duration::from_millis(1),
        ..Default::default()
    });
    assert!(one_ms.is_ok(), "the least positive lease is taken");
}

#[test]
fn dead_client_loses_memory_replicas() {
    let s = store(0);
    let a = t("a");
    let c = ClientId(7);
    s.mount_segment(c, SegmentId(7), 1 << 20).unwrap();
    assert_eq!(
        s.mount_segment(c, SegmentId(7), 1 << 20)
            .unwrap_err()
            .code_i32(),
        -102
    );
    s.put(&a, "k", b"v", PutOptions::default()).unwrap();
    s.clock().advance(Duration::from_secs(5));
    assert_eq!(s.ping(c).unwrap(), ClientStatus::Ok);
    s.clock().advance(Duration::from_secs(8));
    s.sweep_now();
    assert!(s.is_exist(&a, "k").unwrap(), "pinged within ttl");
    s.clock().advance(Duration::from_secs(11));
    let (_, dead) = s.sweep_now();
    assert_eq!(dead, 1);
    assert!(!s.is_exist(&a, "k").unwrap());
    assert_eq!(s.ping(c).unwrap(), ClientStatus::NeedRemount);
    assert_eq!(
        s.put(&a, "k2", b"v", PutOptions::default())
            .unwrap_err()
            .code_i32(),
        -200
    );
    s.mount_segment(c, SegmentId(8), 1 << 20).unwrap();
    s.put(&a, "k2", b"v", PutOptions::default()).unwrap();
    s.unmount_segment(c, SegmentId(8)).unwrap();
    assert!(!s.is_exist(&a, "k2").unwrap());
}

#[test]
fn batch_get_into_large_parallel_copy() {
    let s = store(256 << 20);
    let a = t("a");
    let ks = keys(256, "big");
    let objs: Vec<Vec<u8>> = (0..256).map(|i| vec![i as u8; 64 * 1024]).collect();
    let refs: Vec<&[u8]> = objs.iter().map(|v| v.as_slice()).collect();
    assert!(
        s.batch_put_from(&a, &ks, &refs, PutOptions::default())
            .unwrap()
            .iter()
            .all(Result::is_ok)
    );
    let mut data = vec![0u8; 256 * 64 * 1024];
    let mut bufs: Vec<&mut [u8]> = data.chunks_mut(64 * 1024).collect();
    let r = s.batch_get_into(&a, &ks, &mut bufs).unwrap();
    assert!(r.iter().all(|x| *x == Ok(65536)));
    for (i, b) in bufs.iter().enumerate() {
        assert!(b.iter().all(|&x| x == i as u8));
    }
    assert!(
        s.render_metrics()
            .contains("kvtier_l3_hits_total{tier=\"memory\"} 256")
    );
}

/// Chains of `len` keys `c{j}/{i}`, head (`i = 0`) first, as engines list a prefix's pages.
fn chain(j: usize, len: usize) -> Vec<String> {
    (0..len).map(|i| format!("c{j}/{i}")).collect()
}

/// Which keys of chain `j` are still in the store.
fn survivors(s: &EmbeddedStore, a: &Tenant, j: usize, len: usize) -> Vec<usize> {
    (0..len)
        .filter(|&i| s.is_exist(a, &format!("c{j}/{i}")).unwrap())
        .collect()
}

/// A batch ranks its first key as the most recent, its last as the least: engines (vLLM,
/// SGLang, kvtier's own) list a prefix's pages head first, and a page is reusable only with
/// every page before it, so LRU must take a prefix's tail before its head. Before, a batch
/// ranked its keys in list order and an eviction took the heads of the oldest prefixes,
/// leaving tails no lookup can reach (vLLM suite: an evicting store under concurrent
/// stores kept no prefix at all).
#[test]
fn a_batch_ranks_its_first_key_most_recent() {
    // 100 objects of 1 KiB (as charged under keys "c{j}/{i}"); past 90 % an eviction
    // frees 5 % (5 objects).
    let s = store(100 * charge(1024, "c0/0".len()));
    let a = t("a");
    let obj = vec![7u8; 1024];
    for j in 0..9 {
        let ks = chain(j, 10);
        let bufs: Vec<&[u8]> = ks.iter().map(|_| obj.as_slice()).collect();
        let put = s
            .batch_put_from(&a, &ks, &bufs, PutOptions::default())
            .unwrap();
        assert!(put.iter().all(|r| r.is_ok()), "{put:?}");
    }
    s.put(&a, "x0", &obj, PutOptions::default()).unwrap();
    assert_eq!(
        survivors(&s, &a, 0, 10),
        vec![0, 1, 2, 3, 4],
        "the oldest chain's tail goes first"
    );
    for j in 1..9 {
        assert_eq!(survivors(&s, &a, j, 10).len(), 10);
    }

    // Reads: chain 1 is read whole (batch_get_into), then chain 2 (batch_query); both are
    // then older than everything put after them, and lose their tails first.
    for j in [1, 2] {
        let ks = chain(j, 10);
        if j == 1 {
            let mut bufs = vec![vec![0u8; 1024]; 10];
            let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            let got = s.batch_get_into(&a, &ks, &mut views).unwrap();
            assert!(got.iter().all(|r| r.is_ok()), "{got:?}");
        } else {
            let q = s.batch_query(&a, &ks).unwrap();
            assert!(q.iter().all(|r| r.is_ok()), "{q:?}");
        }
    }
    s.clock().advance(Duration::from_secs(11)); // the reads' leases expire
    // Remove everything but chains 1 and 2: the next eviction takes chain 1's tail (read
    // first) before anything of chain 2.
    for j in 3..9 {
        for i in 0..10 {
            s.remove(&a, &format!("c{j}/{i}"), true).unwrap();
        }
    }
    for i in 0..5 {
        s.remove(&a, &format!("c0/{i}"), true).unwrap();
    }
    s.remove(&a, "x0", true).unwrap();
    // 20 objects now; fill to just past 90 with fresh singles, which evicts 5.
    for i in 1..72 {
        s.put(&a, &format!("x{i}"), &obj, PutOptions::default())
            .unwrap();
    }
    assert_eq!(
        survivors(&s, &a, 1, 10),
        vec![0, 1, 2, 3, 4],
        "the read chain's tail goes first"
    );
    assert_eq!(survivors(&s, &a, 2, 10).len(), 10);
}

#[derive(Debug, Clone)]
enum ChainOp {
    /// Puts a new chain of this many keys in one batch.
    Put(usize),
    /// Reads what is left of an earlier chain (index modulo the chains so far) in one batch.
    Read(usize),
    /// Lets this many seconds pass (leases expire after 10).
    Wait(u64),
}

proptest! {
    /// Whatever mix of whole-prefix batch puts and reads, and however much eviction, what is
    /// left of every chain is a prefix of it: a batch's tail always goes before its head.
    #[test]
    fn what_eviction_leaves_of_a_chain_is_a_prefix(ops in proptest::collection::vec(
        prop_oneof![
            3 => (1usize..8).prop_map(ChainOp::Put),
            2 => (0usize..64).prop_map(ChainOp::Read),
            1 => (1u64..15).prop_map(ChainOp::Wait),
        ],
        1..60,
    )) {
        let s = store(24 * 1024);
        let a = t("a");
        let obj = vec![3u8; 1024];
        // Six chains of five keys first: 30 objects in room for 24, so every case evicts.
        let mut chains: Vec<usize> = Vec::new();
        let start = std::iter::repeat_n(ChainOp::Put(5), 6);
        for op in start.chain(ops) {
            match op {
                ChainOp::Put(len) => {
                    let ks = chain(chains.len(), len);
                    let bufs: Vec<&[u8]> = ks.iter().map(|_| obj.as_slice()).collect();
                    s.batch_put_from(&a, &ks, &bufs, PutOptions::default()).unwrap();
                    chains.push(len);
                }
                ChainOp::Read(j) if !chains.is_empty() => {
                    let j = j % chains.len();
                    let left = survivors(&s, &a, j, chains[j]);
                    let ks: Vec<String> = left.iter().map(|i| format!("c{j}/{i}")).collect();
                    let mut bufs = vec![vec![0u8; 1024]; ks.len()];
                    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
                    let got = s.batch_get_into(&a, &ks, &mut views).unwrap();
                    prop_assert!(got.iter().all(|r| r.is_ok()), "{got:?}");
                }
                ChainOp::Read(_) => {}
                ChainOp::Wait(secs) => s.clock().advance(Duration::from_secs(secs)),
            }
            for (j, &len) in chains.iter().enumerate() {
                let left = survivors(&s, &a, j, len);
                prop_assert_eq!(&left, &(0..left.len()).collect::<Vec<_>>(), "chain {} of {}", j, len);
            }
        }
    }
}
