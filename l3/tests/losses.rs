//! The loss journal (`StoreConfig::loss_journal_keys`, `L3Store::losses_since`): an engine
//! that believes "this key is stored" after a successful put, and forgets the belief for
//! every key the journal reports, never believes in a key the store no longer has — whatever
//! evicted or removed it (DRAM eviction, SSD bucket eviction, removes). Readers keep their
//! own cursors (none takes entries from another), over the wire too. And a batch put never
//! evicts keys of its own batch (Mooncake allocates a whole batch before writing it): a key
//! the batch reports stored is there when the call returns.

use std::collections::HashSet;
use std::sync::Arc;

use kvtier_l3::rpc::server::ServerOptions;
use kvtier_l3::{
    ClientOptions, EmbeddedStore, ErrorCode, L3Store, LossCursor, Losses, OffloadMode, PutOptions,
    RemoteStore, SsdConfig, StoreConfig, Tenant, spawn_server,
};
use proptest::prelude::*;

const OBJ: usize = 1024;

fn tenant() -> Tenant {
    Tenant::new("losses").expect("valid tenant")
}

/// A segment holding `objects` objects of OBJ bytes under keys of up to 3 bytes ("k23").
fn segment(objects: u64) -> u64 {
    objects * kvtier_l3::charge(OBJ as u64, 3)
}

fn store(objects: u64, journal: usize, ssd: Option<&std::path::Path>) -> EmbeddedStore {
    EmbeddedStore::new(StoreConfig {
        local_segment_bytes: segment(objects),
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

fn exists(s: &dyn L3Store, k: &str) -> bool {
    s.is_exist(&tenant(), k).unwrap_or(false)
}

/// One engine's view of the journal: its own cursor.
struct Reader(Option<LossCursor>);

impl Reader {
    fn subscribe(s: &dyn L3Store) -> Reader {
        Reader(Some(
            s.losses_since(&tenant(), None).expect("journal on").next,
        ))
    }

    fn read(&mut self, s: &dyn L3Store) -> Losses {
        let l = s.losses_since(&tenant(), self.0).expect("journal on");
        self.0 = Some(l.next);
        l
    }
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

/// Evictions and removes are journaled; two readers each see every entry once.
fn journal_scenario(s: &dyn L3Store) {
    let t = tenant();
    let (mut r1, mut r2) = (Reader::subscribe(s), Reader::subscribe(s));
    let data = vec![7u8; OBJ];
    let first = keys(0..12);
    for k in &first {
        s.put(&t, k, &data, PutOptions::default()).expect("put");
    }
    assert_eq!(r1.read(s).keys, Vec::<String>::new());
    // Twelve more do not fit beside the first twelve: some of the first are evicted.
    let second = keys(12..24);
    for k in &second {
        s.put(&t, k, &data, PutOptions::default()).expect("put");
    }
    let lost = r1.read(s);
    assert!(!lost.overflowed);
    let lost: HashSet<String> = lost.keys.into_iter().collect();
    assert!(!lost.is_empty());
    for k in first.iter().chain(&second) {
        assert_eq!(lost.contains(k), !exists(s, k), "{k}");
    }
    let kept = second.iter().find(|k| exists(s, k)).expect("a kept key");
    s.remove(&t, kept, false).expect("remove");
    assert_eq!(r1.read(s).keys, vec![kept.clone()]);
    let n = s.remove_all(&t, false).expect("remove_all");
    assert_eq!(r1.read(s).keys.len() as u64, n);
    assert_eq!(r1.read(s).keys, Vec::<String>::new());
    // The second reader took nothing from the first, nor the first from it.
    let all: HashSet<String> = r2.read(s).keys.into_iter().collect();
    assert_eq!(all.len(), lost.len() + 1 + n as usize);
    // Another tenant's reader sees none of it.
    let other = Tenant::new("other").expect("tenant");
    let c = s.losses_since(&other, None).expect("journal").next;
    s.put(&t, "late", &data, PutOptions::default())
        .expect("put");
    s.remove(&t, "late", true).expect("remove");
    assert!(
        s.losses_since(&other, Some(c))
            .expect("journal")
            .keys
            .is_empty()
    );
}

#[test]
fn evictions_and_removes_are_journaled_for_every_reader() {
    journal_scenario(&store(16, 1024, None));
}

#[test]
fn the_journal_over_the_wire_and_after_a_restart() {
    let cfg = |journal| StoreConfig {
        local_segment_bytes: segment(16),
        loss_journal_keys: journal,
        ..StoreConfig::default()
    };
    let h = spawn_server(
        Arc::new(EmbeddedStore::new(cfg(1024)).expect("store")),
        ServerOptions::default(),
    )
    .expect("server on 127.0.0.1");
    let c = RemoteStore::connect(h.addr, ClientOptions::default()).expect("connect");
    journal_scenario(&c);
    // A cursor of this server's journal, shown to a new store: it is not that journal.
    let cursor = c.losses_since(&tenant(), None).expect("journal").next;
    let h2 = spawn_server(
        Arc::new(EmbeddedStore::new(cfg(1024)).expect("store")),
        ServerOptions::default(),
    )
    .expect("server");
    let c2 = RemoteStore::connect(h2.addr, ClientOptions::default()).expect("connect");
    assert!(
        c2.losses_since(&tenant(), Some(cursor))
            .expect("journal")
            .overflowed
    );
    let h3 = spawn_server(
        Arc::new(EmbeddedStore::new(cfg(0)).expect("store")),
        ServerOptions::default(),
    )
    .expect("server");
    let c3 = RemoteStore::connect(h3.addr, ClientOptions::default()).expect("connect");
    let e = c3.losses_since(&tenant(), None).expect_err("no journal");
    assert_eq!(e.code(), ErrorCode::UnavailableInCurrentMode);
}

#[test]
fn the_journal_is_off_by_default_and_bounded_when_on() {
    let s = store(4, 0, None);
    assert_eq!(
        s.losses_since(&tenant(), None).expect_err("off").code(),
        ErrorCode::UnavailableInCurrentMode
    );
    let s = store(4, 2, None);
    let mut r = Reader::subscribe(&s);
    for k in keys(0..12) {
        batch_put(&s, &[k]);
    }
    let l = r.read(&s);
    assert!(l.overflowed, "eight losses do not fit in two entries");
    assert_eq!(l.keys.len(), 2);
    assert!(!r.read(&s).overflowed, "caught up");
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
        let mut reader = Reader::subscribe(&s);
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
            let lost = reader.read(&s);
            prop_assert!(!lost.overflowed);
            for k in lost.keys {
                believed.remove(&k);
            }
            for k in &believed {
                prop_assert!(exists(&s, k), "believed {} stored, the store lost it unreported", k);
            }
        }
    }
}
