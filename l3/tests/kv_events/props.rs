//! The embedded store's KV events against its own listing (proptest): after any sequence of
//! puts (pages of two namespaces, each page under kvtier's keys of two ranks and kvtier.vllm's
//! keys of two KV groups and a shard, keys outside the grammars, objects large
//! enough that DRAM eviction drops others), removes and remove-alls, the snapshot the
//! store's replay socket answers (a real ZMQ DEALER, decoded) names exactly the pages some
//! key of which exists — with `parts_per_page` N, at least N keys of one namespace — once
//! each; keys outside the grammar and namespaces the stream does not carry are counted, never
//! published.

use std::collections::BTreeSet;

use crate::common::kv_events::{Ev, decode, key, wire};
use crate::common::t;
use kvtier_events::{Medium, WireEvent};
use kvtier_l3::kv_events::{KvEventsConfig, KvEventsError, KvEventsHandle};
use kvtier_l3::{EmbeddedStore, ExistOptions, L3Store, PutOptions, StoreConfig};
use kvtier_radix::PageHash;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Put {
        page: u8,
        rank: u8,
        ns: u8,
        big: bool,
    },
    Plain {
        i: u8,
    },
    Remove {
        page: u8,
        rank: u8,
        ns: u8,
    },
    RemoveAll,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..10, 0u8..PARTS, 0u8..3, any::<bool>())
            .prop_map(|(page, rank, ns, big)| Op::Put { page, rank, ns, big }),
        1 => (0u8..4).prop_map(|i| Op::Plain { i }),
        3 => (0u8..10, 0u8..PARTS, 0u8..3).prop_map(|(page, rank, ns)| Op::Remove { page, rank, ns }),
        1 => Just(Op::RemoveAll),
    ]
}

/// The keys a page has: `rank` 0 and 1 are kvtier's grammar (two tensor-parallel ranks), 2
/// to 4 kvtier.vllm's (vLLM's `OffloadKey` of the page's block hash: KV groups 0 and 1, and
/// group 0's shard 1) — every one of them the same block on the wire.
const PARTS: u8 = 5;

fn part_key(ns: &str, p: &PageHash, part: u8) -> String {
    match part {
        0 | 1 => key(ns, p, part.into()),
        2 | 3 => format!("{ns}:{}{:08x}", p.to_hex(), part - 2),
        _ => format!("{ns}:{}00000000:1", p.to_hex()),
    }
}

fn page(i: u8) -> PageHash {
    let mut h = [0u8; 32];
    h[0] = 0xa5;
    h[31] = i;
    PageHash(h)
}

/// Namespaces 0 and 1 are carried, 2 is not.
const NS: [&str; 3] = ["m1", "m2", "other"];

/// A small store (puts evict) whose stream carries namespaces 0 and 1.
fn store(mut ev: KvEventsConfig) -> (EmbeddedStore, KvEventsHandle) {
    ev.namespaces = vec![NS[0].into(), NS[1].into()];
    let s = EmbeddedStore::new(StoreConfig {
        local_segment_bytes: 256 << 10,
        kv_events: vec![ev],
        ..StoreConfig::default()
    })
    .unwrap();
    let h = s.kv_events().into_iter().next().unwrap();
    (s, h)
}

/// What an operation did, for the stream's skip counters.
enum Applied {
    /// A put of a key outside kvtier's grammar succeeded.
    Plain,
    /// A put of the namespace the stream does not carry succeeded.
    OtherNamespace,
    /// Anything else that succeeded.
    Carried,
    /// Refused (no room, no such key): the store is unchanged.
    Failed,
}

fn apply(s: &EmbeddedStore, tn: &kvtier_l3::Tenant, o: &Op) -> Applied {
    let done = |ok: bool, then: Applied| if ok { then } else { Applied::Failed };
    match *o {
        Op::Put {
            page: p,
            rank,
            ns,
            big,
        } => {
            let len = if big { 60 << 10 } else { 1000 };
            let k = part_key(NS[ns as usize], &page(p), rank);
            let ok = s.put(tn, &k, &vec![1; len], PutOptions::default()).is_ok();
            done(
                ok,
                if ns == 2 {
                    Applied::OtherNamespace
                } else {
                    Applied::Carried
                },
            )
        }
        Op::Plain { i } => {
            let ok = s.put(tn, &format!("plain-{i}"), &[1; 100], PutOptions::default());
            done(ok.is_ok(), Applied::Plain)
        }
        Op::Remove { page: p, rank, ns } => {
            let k = part_key(NS[ns as usize], &page(p), rank);
            done(s.remove(tn, &k, false).is_ok(), Applied::Carried)
        }
        Op::RemoveAll => done(s.remove_all(tn, false).is_ok(), Applied::Carried),
    }
}

/// The published set, from a snapshot request on the replay socket.
fn snapshot(replay: &str) -> Vec<Ev> {
    let ctx = zmq::Context::new();
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvtimeo(5000).unwrap();
    d.set_linger(0).unwrap();
    d.connect(replay).unwrap();
    d.send_multipart([&b""[..], &(-2i64).to_be_bytes()], 0)
        .unwrap();
    let mut out = Vec::new();
    loop {
        // vLLM 0.32's replies: [empty, topic, seq, payload]
        let f = d.recv_multipart(0).expect("a snapshot answer");
        assert_eq!(f.len(), 4, "[empty, topic, seq, payload]");
        if f[2] == (-1i64).to_be_bytes() {
            return out;
        }
        out.extend(decode(&f[3]));
    }
}

/// The pages the store lists with at least `parts` of their keys in one carried namespace.
fn listed(s: &EmbeddedStore, tn: &kvtier_l3::Tenant, parts: u32) -> Vec<PageHash> {
    let mut out = Vec::new();
    for p in 0..10u8 {
        let held = NS[..2].iter().any(|ns| {
            let keys: Vec<String> = (0..PARTS).map(|r| part_key(ns, &page(p), r)).collect();
            let exist = s
                .batch_exist_key(tn, &keys, ExistOptions::default())
                .unwrap();
            exist.iter().filter(|e| **e == Ok(true)).count() >= parts as usize
        });
        if held {
            out.push(page(p));
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn the_published_set_is_the_stores_listing(ops in proptest::collection::vec(op(), 1..60), parts in 1u32..4) {
        let mut ev = KvEventsConfig::new("tcp://127.0.0.1:*");
        ev.replay_endpoint = Some("tcp://127.0.0.1:*".into());
        ev.parts_per_page = parts;
        let (s, h) = store(ev);
        let tn = t("a");
        let (mut plain, mut other) = (0u64, 0u64);
        for o in &ops {
            match apply(&s, &tn, o) {
                Applied::Plain => plain += 1,
                Applied::OtherNamespace => other += 1,
                Applied::Carried | Applied::Failed => {}
            }
        }
        h.flush();
        let want: BTreeSet<u64> = listed(&s, &tn, parts).iter().map(wire).collect();
        let snap = snapshot(&h.replay_endpoint().unwrap());
        prop_assert_eq!(snap.first(), Some(&Ev::Cleared));
        let got: Vec<u64> = snap.iter().filter_map(|e| match e { Ev::Stored(h) => Some(*h), _ => None }).collect();
        prop_assert_eq!(got.len(), snap.len() - 1, "a snapshot is Cleared then stores");
        prop_assert_eq!(got.iter().copied().collect::<BTreeSet<u64>>(), want.clone());
        prop_assert_eq!(got.len(), want.len(), "each page once");
        let st = h.stats();
        prop_assert_eq!(st.resident_pages, want.len() as u64);
        prop_assert_eq!(st.unparsed_keys, plain);
        prop_assert_eq!(st.other_namespace_keys, other);
        let line = format!("kvtier_l3_kv_events_resident_pages {}", want.len());
        prop_assert!(s.render_metrics().contains(&line), "metrics lack {}", line);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// `Delivery::Pull` (the simulator's): the batches its owner takes, at random points,
    /// fold to the store's listing, stored once per page, as a subscriber's would.
    #[test]
    fn pulled_batches_fold_to_the_stores_listing(
        ops in proptest::collection::vec((op(), any::<bool>()), 1..60),
        parts in 1u32..4,
    ) {
        let (s, h) = store(KvEventsConfig { parts_per_page: parts, ..KvEventsConfig::pull() });
        let tn = t("a");
        let mut folded: BTreeSet<[u8; 32]> = BTreeSet::new();
        let mut batches = 0u64;
        let mut take = |folded: &mut BTreeSet<[u8; 32]>| -> Result<(), TestCaseError> {
            let b = h.take_batch().unwrap();
            if !b.is_empty() {
                batches += 1;
            }
            for e in b {
                match e {
                    WireEvent::AllBlocksCleared => folded.clear(),
                    WireEvent::BlockStored { block_hashes, medium, .. } => {
                        prop_assert_eq!(medium, Medium::Storage);
                        for p in block_hashes {
                            prop_assert!(folded.insert(p.0), "stored twice");
                        }
                    }
                    WireEvent::BlockRemoved { block_hashes, medium, .. } => {
                        prop_assert_eq!(medium, Medium::Storage);
                        for p in block_hashes {
                            prop_assert!(folded.remove(&p.0), "removed without a store");
                        }
                    }
                }
            }
            Ok(())
        };
        for (o, take_now) in &ops {
            apply(&s, &tn, o);
            if *take_now {
                take(&mut folded)?;
            }
        }
        take(&mut folded)?;
        let want: BTreeSet<[u8; 32]> = listed(&s, &tn, parts).iter().map(|p| p.0).collect();
        prop_assert_eq!(&folded, &want);
        let st = h.stats();
        prop_assert_eq!(st.resident_pages, want.len() as u64);
        prop_assert_eq!(st.batches, batches);
        // nothing is pending: a second take is empty
        prop_assert!(h.take_batch().unwrap().is_empty());
    }
}

/// Pull delivery has no sockets: a pull config naming one is refused, and a socket stream's
/// batches are not handed to the store's owner.
#[test]
fn pull_and_sockets_do_not_mix() {
    let mut c = KvEventsConfig::pull();
    c.replay_endpoint = Some("tcp://127.0.0.1:*".into());
    let r = EmbeddedStore::new(StoreConfig {
        kv_events: vec![c],
        ..StoreConfig::default()
    });
    assert!(
        matches!(r, Err(kvtier_l3::L3Error::InvalidParams(_))),
        "{:?}",
        r.err()
    );
    let s = EmbeddedStore::new(StoreConfig {
        kv_events: vec![KvEventsConfig::new("tcp://127.0.0.1:*")],
        ..StoreConfig::default()
    })
    .unwrap();
    let h = s.kv_events().into_iter().next().unwrap();
    assert_eq!(h.take_batch(), Err(KvEventsError::NotPull));
    // the first pulled batch of a pull stream opens with AllBlocksCleared
    let p = EmbeddedStore::new(StoreConfig {
        kv_events: vec![KvEventsConfig::pull()],
        ..StoreConfig::default()
    })
    .unwrap();
    let first = p
        .kv_events()
        .into_iter()
        .next()
        .unwrap()
        .take_batch()
        .unwrap();
    assert_eq!(first, vec![WireEvent::AllBlocksCleared]);
}

#[test]
fn a_bad_endpoint_or_part_count_in_the_config_is_a_typed_error() {
    for bad in ["tcp://127.0.0.1", "udp://x:1"] {
        let r = EmbeddedStore::new(StoreConfig {
            kv_events: vec![KvEventsConfig::new(bad)],
            ..StoreConfig::default()
        });
        match r {
            Err(kvtier_l3::L3Error::InvalidParams(m)) => assert!(m.contains("ZMQ endpoint"), "{m}"),
            other => panic!("{bad}: {:?}", other.err()),
        }
    }
    // a page needs at least one part
    let r = EmbeddedStore::new(StoreConfig {
        kv_events: vec![KvEventsConfig {
            parts_per_page: 0,
            ..KvEventsConfig::pull()
        }],
        ..StoreConfig::default()
    });
    match r {
        Err(kvtier_l3::L3Error::InvalidParams(m)) => assert!(m.contains("parts_per_page"), "{m}"),
        other => panic!("parts_per_page 0: {:?}", other.err()),
    }
}

/// An HA leader's stream binds once the address is free (a deposed leader, paused, may hold
/// it): meanwhile the master serves and its changes are kept; the first batch once bound
/// holds them all. A single master's busy address is a typed error instead.
#[test]
fn a_busy_address_is_retried_under_ha_and_an_error_otherwise() {
    use kvtier_l3::kv_events::{Binding, Residency, StorageEvents};
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ep = format!("tcp://{}", busy.local_addr().unwrap());
    let mut cfg = KvEventsConfig::new(ep.clone());
    cfg.replay_endpoint = Some(crate::common::kv_events::free_endpoint());
    match StorageEvents::start(&cfg, Binding::AtStart) {
        Err(kvtier_l3::KvEventsError::Bind(m)) => assert!(m.contains(&ep), "{m}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    let ev = StorageEvents::start(&cfg, Binding::Retry).expect("a leader serves meanwhile");
    let h = ev.handle();
    assert!(!h.bound());
    let (p0, p1) = (page(1), page(2));
    ev.note(Residency::Readable, &t("a"), &key("m1", &p0, 0));
    ev.note(Residency::Readable, &t("a"), &key("m1", &p1, 0));
    ev.note(Residency::Gone, &t("a"), &key("m1", &p1, 0));
    h.flush();
    assert_eq!(h.stats().batches, 0, "nothing goes out unbound");
    drop(busy);
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !h.bound() {
        assert!(std::time::Instant::now() < end, "never bound");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    h.flush();
    assert_eq!(h.endpoint(), ep);
    let snap = snapshot(&h.replay_endpoint().unwrap());
    assert_eq!(snap, vec![Ev::Cleared, Ev::Stored(wire(&p0))]);
    let s = h.stats();
    assert_eq!((s.batches, s.stored, s.removed), (1, 1, 0));
}

/// Several streams on one store: each takes only its namespace's pages, by its own count,
/// and the metrics name each stream (a single stream's stay unlabelled).
#[test]
fn each_stream_of_a_store_carries_its_own_namespace_and_metrics() {
    let per_ns = |ns: &str, parts: u32| KvEventsConfig {
        namespaces: vec![ns.into()],
        parts_per_page: parts,
        ..KvEventsConfig::pull()
    };
    let s = EmbeddedStore::new(StoreConfig {
        local_segment_bytes: 256 << 10,
        kv_events: vec![per_ns("m1", 1), per_ns("m2", 2)],
        ..StoreConfig::default()
    })
    .unwrap();
    let tn = t("a");
    for (ns, parts) in [("m1", 1u8), ("m2", 1), ("other", 2)] {
        for part in 0..parts {
            s.put(
                &tn,
                &part_key(ns, &page(0), part),
                &[1; 64],
                PutOptions::default(),
            )
            .unwrap();
        }
    }
    s.put(
        &tn,
        &part_key("m2", &page(1), 0),
        &[1; 64],
        PutOptions::default(),
    )
    .unwrap();
    s.put(
        &tn,
        &part_key("m2", &page(1), 1),
        &[1; 64],
        PutOptions::default(),
    )
    .unwrap();
    let hs = s.kv_events();
    assert_eq!(
        hs.iter().map(KvEventsHandle::topic).collect::<Vec<_>>(),
        ["m1", "m2"]
    );
    let stored = |h: &KvEventsHandle| -> Vec<u64> {
        let mut out = Vec::new();
        for e in h.take_batch().unwrap() {
            if let WireEvent::BlockStored { block_hashes, .. } = e {
                out.extend(block_hashes.iter().map(wire));
            }
        }
        out
    };
    // m1: page 0 (its one part); m2: page 1 only (page 0 has one of its two parts)
    assert_eq!(stored(&hs[0]), vec![wire(&page(0))]);
    assert_eq!(stored(&hs[1]), vec![wire(&page(1))]);
    let m = s.render_metrics();
    assert!(
        m.contains("kvtier_l3_kv_events_resident_pages{stream=\"0\",topic=\"m1\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("kvtier_l3_kv_events_resident_pages{stream=\"1\",topic=\"m2\"} 1"),
        "{m}"
    );
    assert_eq!(
        m.matches("# TYPE kvtier_l3_kv_events_resident_pages")
            .count(),
        1
    );
}

/// The pages the store lists with at least `parts` of their keys in namespace `ns`.
fn listed_in(s: &EmbeddedStore, tn: &kvtier_l3::Tenant, ns: &str, parts: u32) -> BTreeSet<u64> {
    (0..10u8)
        .filter(|&p| {
            let keys: Vec<String> = (0..PARTS).map(|r| part_key(ns, &page(p), r)).collect();
            let exist = s
                .batch_exist_key(tn, &keys, ExistOptions::default())
                .unwrap();
            exist.iter().filter(|e| **e == Ok(true)).count() >= parts as usize
        })
        .map(|p| wire(&page(p)))
        .collect()
}

/// Folds pulled batches into the resident set a subscriber holds.
fn fold(into: &mut BTreeSet<u64>, batch: &[WireEvent]) {
    for e in batch {
        match e {
            WireEvent::AllBlocksCleared => into.clear(),
            WireEvent::BlockStored { block_hashes, .. } => {
                into.extend(block_hashes.iter().map(wire))
            }
            WireEvent::BlockRemoved { block_hashes, .. } => {
                for h in block_hashes {
                    into.remove(&wire(h));
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// A stream per namespace, each with its own part count, taken at random points: each
    /// folds to the store's listing of its own namespace, whatever the others carry.
    #[test]
    fn each_namespaces_stream_folds_to_its_own_listing(
        ops in proptest::collection::vec((op(), any::<bool>()), 1..60),
        parts in proptest::collection::vec(1u32..4, 2),
    ) {
        let streams: Vec<KvEventsConfig> = (0..2)
            .map(|i| KvEventsConfig {
                namespaces: vec![NS[i].into()],
                parts_per_page: parts[i],
                ..KvEventsConfig::pull()
            })
            .collect();
        let s = EmbeddedStore::new(StoreConfig {
            local_segment_bytes: 256 << 10,
            kv_events: streams,
            ..StoreConfig::default()
        })
        .unwrap();
        let hs = s.kv_events();
        let tn = t("a");
        let mut seen = vec![BTreeSet::new(); 2];
        for (o, take) in &ops {
            apply(&s, &tn, o);
            if *take {
                for (h, into) in hs.iter().zip(&mut seen) {
                    fold(into, &h.take_batch().unwrap());
                }
            }
        }
        for (i, (h, into)) in hs.iter().zip(&mut seen).enumerate() {
            fold(into, &h.take_batch().unwrap());
            prop_assert_eq!(&*into, &listed_in(&s, &tn, NS[i], parts[i]), "stream {}", NS[i]);
            prop_assert_eq!(h.stats().resident_pages, into.len() as u64);
            prop_assert_eq!(h.topic(), NS[i]);
        }
    }
}
