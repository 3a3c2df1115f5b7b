//! The loss journal (`StoreConfig::loss_journal_keys`, `EmbeddedStore::drain_losses`): an
//! engine that believes "this key is stored" after a successful put, and forgets the belief
//! for every key the journal reports, never believes in a key the store no longer has —
//! whatever evicted or removed it (DRAM eviction, SSD bucket eviction, removes). And a batch
//! put never evicts keys of its own batch (Mooncake allocates a whole batch before writing
//! it): a key the batch reports stored is there when the call returns.

use std::collections::HashSet;

use kvtier_l3::{EmbeddedStore, L3Store, OffloadMode, PutOptions, SsdConfig, StoreConfig, Tenant};
use proptest::prelude::*;

const OBJ: usize = 1024;

fn tenant() -> Tenant {
    Tenant::new("losses").expect("valid tenant")
}

fn store(objects: u64, journal: usize, ssd: Option<&std::path::Path>) -> EmbeddedStore {
    EmbeddedStore::new(StoreConfig {
        local_segment_bytes: objects * OBJ as u64,
        loss_journal_keys: journal,
        ssd: ssd.map(|d| {
            let mut s = SsdConfig::new(d);
            s.mode = OffloadMode::OnEvict;
            s.capacity_bytes = 8 * OBJ as u64;
            s.bucket_keys_limit = 2;
            s.bucket_bytes_limit = 2 * OBJ as u64;
            s
        }),
        ..StoreConfig::default()
    })
    .expect("store")
}

fn keys(range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("k{i}")).collect()
}

fn batch_put(s: &EmbeddedStore, ks: &[String]) -> Vec<bool> {
    let data = vec![7u8; OBJ];
    let bufs: Vec<&[u8]> = ks.iter().map(|_| data.as_slice()).collect();
    match s.batch_put_from(&tenant(), ks, &bufs, PutOptions::default()) {
        Ok(rs) => rs.iter().map(|r| r.is_ok()).collect(),
        Err(_) => vec![false; ks.len()],
    }
}

fn exists(s: &EmbeddedStore, k: &str) -> bool {
    s.is_exist(&tenant(), k).unwrap_or(false)
}

#[test]
fn a_batch_put_never_evicts_its_own_keys() {
    let s = store(16, 0, None);
    let ks = keys(0..22);
    let ok = batch_put(&s, &ks);
    let stored: Vec<&String> = ks
        .iter()
        .zip(&ok)
        .filter(|(_, o)| **o)
        .map(|(k, _)| k)
        .collect();
    assert!(!stored.is_empty());
    let missing: Vec<&&String> = stored.iter().filter(|k| !exists(&s, k)).collect();
    assert!(
        missing.is_empty(),
        "reported stored but evicted by their own batch: {missing:?}"
    );
    assert!(ok.iter().any(|o| !o), "22 objects cannot all fit in 16");
}

#[test]
fn evictions_and_removes_are_journaled_once() {
    let s = store(16, 1024, None);
    let t = tenant();
    let first = keys(0..12);
    assert!(batch_put(&s, &first).iter().all(|o| *o));
    assert_eq!(s.drain_losses().keys, vec![]);
    // Twelve more do not fit beside the first twelve: some of the first are evicted.
    let second = keys(12..24);
    assert!(batch_put(&s, &second).iter().all(|o| *o));
    let lost = s.drain_losses();
    assert!(!lost.overflowed);
    let lost: HashSet<String> = lost.keys.into_iter().map(|(_, k)| k).collect();
    assert!(!lost.is_empty());
    for k in first.iter().chain(&second) {
        assert_eq!(lost.contains(k), !exists(&s, k), "{k}");
    }
    let kept = second.iter().find(|k| exists(&s, k)).expect("a kept key");
    s.remove(&t, kept, false).expect("remove");
    let lost = s.drain_losses();
    assert_eq!(lost.keys, vec![(t.clone(), kept.clone())]);
    let n = s.remove_all(&t, false).expect("remove_all");
    assert_eq!(s.drain_losses().keys.len() as u64, n);
    assert_eq!(s.drain_losses(), Default::default());
}

#[test]
fn the_journal_is_off_by_default_and_bounded_when_on() {
    let s = store(4, 0, None);
    batch_put(&s, &keys(0..8));
    assert_eq!(s.drain_losses(), Default::default());
    let s = store(4, 2, None);
    for k in keys(0..12) {
        batch_put(&s, &[k]);
    }
    let l = s.drain_losses();
    assert!(l.overflowed, "eight losses do not fit in two entries");
    assert_eq!(l.keys.len(), 2);
}

#[derive(Debug, Clone)]
enum Op {
    Batch(u8, u8),
    Remove(u8),
    RemoveAll,
    Get(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..40, 1u8..12).prop_map(|(k, n)| Op::Batch(k, n)),
        1 => (0u8..40).prop_map(Op::Remove),
        1 => Just(Op::RemoveAll),
        2 => (0u8..40).prop_map(Op::Get),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// What an engine believes stored (a put answered Ok, no loss reported since) is stored,
    /// with DRAM only and with an SSD tier that evicts buckets.
    #[test]
    fn believed_keys_are_stored(ops in prop::collection::vec(op(), 1..60), with_ssd in any::<bool>()) {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = store(10, 1 << 16, with_ssd.then(|| dir.path()));
        let t = tenant();
        let mut believed: HashSet<String> = HashSet::new();
        for op in ops {
            match op {
                Op::Batch(k, n) => {
                    let ks = keys(k as usize..k as usize + n as usize);
                    for (k, ok) in ks.iter().zip(batch_put(&s, &ks)) {
                        if ok {
                            believed.insert(k.clone());
                        }
                    }
                }
                Op::Remove(k) => {
                    // A forced remove is the store's to make; the journal reports it too.
                    let _ = s.remove(&t, &format!("k{k}"), true);
                }
                Op::RemoveAll => {
                    let _ = s.remove_all(&t, true);
                }
                Op::Get(k) => {
                    let _ = s.get(&t, &format!("k{k}"));
                }
            }
            s.flush().expect("flush");
            let lost = s.drain_losses();
            prop_assert!(!lost.overflowed);
            for (_, k) in lost.keys {
                believed.remove(&k);
            }
            for k in &believed {
                prop_assert!(exists(&s, k), "believed {} stored, the store lost it unreported", k);
            }
        }
    }
}
