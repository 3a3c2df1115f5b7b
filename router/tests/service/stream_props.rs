//! Invariants of one stream's recovery (sans I/O, against an in-memory publisher that keeps
//! a bounded replay buffer and answers snapshots from kvtier-events' `Mirror`, as the real
//! one does): whatever the network does to the live batches (drops, duplicates, reordering),
//! the tracker followed by one catch-up gives exactly the clean stream's index; the index
//! never holds more than its cap.

use crate::common::*;
use kvtier_events::{HashFormat, Medium, Mirror, WireEvent, encode_batch};
use kvtier_router::cluster::{Cluster, Keys, Target};
use kvtier_router::stream::{Apply, History, Replayed, SNAPSHOT, Tracker};
use kvtier_router::{ClusterIndex, decode_batch};
use proptest::prelude::*;

/// The publisher's side, after it published every batch.
struct Memory {
    payloads: Vec<Vec<u8>>,
    keep: usize,
    snapshot: Vec<u8>,
}

impl Memory {
    fn new(batches: &[Vec<WireEvent>], keep: usize) -> Memory {
        let mut m = Mirror::new();
        let payloads = batches
            .iter()
            .map(|b| {
                b.iter().for_each(|e| m.apply(e));
                encode_batch(0.0, b, 0, HashFormat::Int64).expect("encode")
            })
            .collect();
        let snapshot = encode_batch(0.0, &m.snapshot(), 0, HashFormat::Int64).expect("encode");
        Memory {
            payloads,
            keep,
            snapshot,
        }
    }
}

impl History for Memory {
    fn replay(&mut self, from: i64) -> Replayed {
        let n = self.payloads.len();
        if from == SNAPSHOT {
            return Some(match n {
                0 => Vec::new(),
                _ => vec![((n - 1) as i64, self.snapshot.clone())],
            });
        }
        let first = n.saturating_sub(self.keep);
        Some(
            (first..n)
                .filter(|&s| s as i64 >= from)
                .map(|s| (s as i64, self.payloads[s].clone()))
                .collect(),
        )
    }
}

fn event() -> impl Strategy<Value = WireEvent> {
    let medium = prop_oneof![Just(Medium::Gpu), Just(Medium::Cpu)];
    (0u32..6, 1usize..5, medium, any::<bool>()).prop_map(|(seed, pages, m, store)| {
        let t = tokens(seed, pages);
        if store { stored(&t, m) } else { removed(&t, m) }
    })
}

/// What happens to each live batch: 0 delivered, 1 dropped, 2 delivered twice.
fn fates(n: usize) -> impl Strategy<Value = (Vec<u8>, Vec<(usize, usize)>)> {
    (
        proptest::collection::vec(0u8..3, n),
        proptest::collection::vec((0..n.max(1), 0..n.max(1)), 0..4),
    )
}

fn run(
    batches: &[Vec<WireEvent>],
    keep: usize,
    fate: &[u8],
    swaps: &[(usize, usize)],
) -> Vec<(usize, &'static str, u64)> {
    let mut mem = Memory::new(batches, keep);
    let mut deliveries: Vec<usize> = Vec::new();
    for (s, f) in fate.iter().enumerate().take(batches.len()) {
        match f {
            0 => deliveries.push(s),
            2 => deliveries.extend([s, s]),
            _ => {}
        }
    }
    for &(a, b) in swaps {
        if a < deliveries.len() && b < deliveries.len() {
            deliveries.swap(a, b);
        }
    }
    let mut c = Cluster::new(1, model(), 1 << 20, Keys::Engine).expect("model");
    let st = c.add_stream("s", "mem", Target::Instance(0));
    let mut t = Tracker::new();
    let mut sink = |a: Apply<'_>| c.apply(st, a);
    // the router started before the first batch: its snapshot is the empty answer
    let mut empty = Memory::new(&[], keep);
    t.sync(&mut empty, &mut sink);
    for s in deliveries {
        let p = mem.payloads[s].clone();
        t.on_live(s as u64, &p, &mut mem, &mut sink);
    }
    t.catch_up(&mut mem, &mut sink);
    c.router().index().entries()
}

fn clean(batches: &[Vec<WireEvent>]) -> Vec<(usize, &'static str, u64)> {
    reference(&[batches.to_vec()], 1 << 20).entries()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn drops_duplicates_and_reordering_then_catch_up_give_the_clean_index(
        (batches, keep, (fate, swaps)) in proptest::collection::vec(proptest::collection::vec(event(), 1..4), 1..12)
            .prop_flat_map(|b| { let n = b.len(); (Just(b), 1..=n, fates(n)) })
    ) {
        prop_assert_eq!(run(&batches, keep, &fate, &swaps), clean(&batches));
    }

    #[test]
    fn the_index_never_exceeds_its_cap(
        batches in proptest::collection::vec(proptest::collection::vec(event(), 1..4), 1..20),
        cap in 1usize..40,
    ) {
        let mut idx = ClusterIndex::new(2, cap);
        for (i, b) in batches.iter().enumerate() {
            let p = encode_batch(0.0, b, 0, HashFormat::Int64).expect("encode");
            for e in decode_batch(&p).expect("decode") {
                idx.apply(i % 2, &e);
                prop_assert!(idx.pages() <= cap);
            }
        }
    }
}

/// A stream that followed `old` to its end, then sees its publisher's next incarnation
/// `new`, whose batches before `seen` went out before the subscriber joined again (told
/// of the reconnect if `reconnect`), and receives batch `seen` live: the index's entries
/// and the stream's counters.
fn incarnations(
    old: &[Vec<WireEvent>],
    new: &[Vec<WireEvent>],
    seen: usize,
    reconnect: bool,
) -> (
    Vec<(usize, &'static str, u64)>,
    kvtier_router::stream::StreamCounters,
) {
    let mut c = Cluster::new(1, model(), 1 << 20, Keys::Engine).expect("model");
    let st = c.add_stream("s", "mem", Target::Instance(0));
    let mut t = Tracker::new();
    let mut sink = |a: Apply<'_>| c.apply(st, a);
    let mut h = Memory::new(old, 10);
    t.sync(&mut Memory::new(&[], 10), &mut sink);
    for (s, p) in h.payloads.clone().iter().enumerate() {
        t.on_live(s as u64, p, &mut h, &mut sink);
    }
    if reconnect {
        t.reconnected(&mut Memory::new(&new[..seen], 10), &mut sink);
    }
    let mut h2 = Memory::new(new, 10);
    let p = h2.payloads[seen].clone();
    t.on_live(seen as u64, &p, &mut h2, &mut sink);
    (c.router().index().entries(), t.counters)
}

#[test]
fn a_publisher_that_restarts_from_zero_replaces_its_pages() {
    let old = vec![
        vec![stored(&tokens(1, 4), Medium::Gpu)],
        vec![stored(&tokens(2, 4), Medium::Gpu)],
    ];
    let new = vec![vec![stored(&tokens(3, 2), Medium::Gpu)]];
    let (entries, counters) = incarnations(&old, &new, 0, false);
    assert_eq!(counters.restarts, 1);
    assert_eq!(entries, clean(&new));
}

/// A new publisher incarnation on the same address (a new L3 leader, an engine restarted
/// on its port) that published more batches than the old one before this subscriber
/// joined: its first batch seen is numbered past the old stream's last, so the numbers
/// alone read it as a gap. The reconnect (the SUB's monitor) resyncs from its snapshot.
#[test]
fn a_reconnect_to_a_new_incarnation_resyncs_even_when_its_numbers_run_past_ours() {
    let old = vec![
        vec![stored(&tokens(1, 4), Medium::Gpu)],
        vec![stored(&tokens(2, 4), Medium::Gpu)],
    ];
    let new = vec![
        vec![WireEvent::AllBlocksCleared],
        vec![stored(&tokens(3, 2), Medium::Gpu)],
        vec![stored(&tokens(4, 2), Medium::Gpu)],
        vec![stored(&tokens(5, 2), Medium::Gpu)],
    ];
    let follow = |reconnect: bool| {
        let (entries, counters) = incarnations(&old, &new, 3, reconnect);
        (entries, counters.reconnects)
    };
    assert_eq!(follow(true), (clean(&new), 1));
    // without the reconnect the numbers read a gap, and the old pages stay (the hole the
    // monitor closes)
    assert_ne!(follow(false).0, clean(&new));
}

/// A replay socket whose numbers are not the live stream's (a hostile or misconfigured one:
/// another publisher's, or one that renumbered): it answers every request with one batch
/// numbered far past anything live.
struct Renumbered(Vec<u8>);

impl History for Renumbered {
    fn replay(&mut self, _from: i64) -> Replayed {
        Some(vec![(1 << 62, self.0.clone())])
    }
}

/// The snapshot said 2^62; the live stream numbers from 0. Every live batch was then a
/// "duplicate" and dropped: the stream's index froze for good. A live number behind the
/// expected one by more than the subscriber can have queued is not a duplicate: the stream
/// is taken from the live batch on (the index ends as the live stream's).
#[test]
fn a_replay_numbered_far_past_the_live_stream_does_not_freeze_it() {
    let live: Vec<Vec<WireEvent>> = (0..20)
        .map(|i| vec![stored(&tokens(10 + i, 2), Medium::Gpu)])
        .collect();
    let mut c = Cluster::new(1, model(), 1 << 20, Keys::Engine).expect("model");
    let st = c.add_stream("s", "mem", Target::Instance(0));
    let mut t = Tracker::new();
    let mut sink = |a: Apply<'_>| c.apply(st, a);
    let snap = vec![stored(&tokens(1, 2), Medium::Gpu)];
    let mut h = Renumbered(encode_batch(0.0, &snap, 0, HashFormat::Int64).expect("encode"));
    t.sync(&mut h, &mut sink);
    let m = Memory::new(&live, 20);
    for (s, p) in m.payloads.iter().enumerate() {
        t.on_live(s as u64, p, &mut h, &mut sink);
    }
    assert_eq!(t.next(), Some(20));
    assert!(t.counters.duplicates == 0, "{:?}", t.counters);
    assert_eq!(c.router().index().entries(), clean(&live));
}

/// One live batch whose number is far past the stream's (a corrupt frame, a relay's bug, a
/// hostile peer: 2^63 here) among a publisher's batches 0..10. The bug: the stream took the
/// next real batch for a renumbered stream and reset the instance there, so every page of
/// the batches before it was gone for good (only 5..10 were indexed). The stream now syncs
/// afresh when it meets a live number that far behind, and the publisher's snapshot (which
/// holds every batch) restores the index; a replay socket numbering another stream (the
/// test above) still leaves the stream to its live batches.
#[test]
fn one_live_batch_numbered_far_ahead_costs_the_index_nothing() {
    let live: Vec<Vec<WireEvent>> = (0..10)
        .map(|i| vec![stored(&tokens(30 + i, 2), Medium::Gpu)])
        .collect();
    let mut c = Cluster::new(1, model(), 1 << 20, Keys::Engine).expect("model");
    let st = c.add_stream("s", "mem", Target::Instance(0));
    let mut t = Tracker::new();
    let mut sink = |a: Apply<'_>| c.apply(st, a);
    t.sync(&mut Memory::new(&[], 10), &mut sink);
    let mut h = Memory::new(&live, 20);
    let payloads = h.payloads.clone();
    for (s, p) in payloads.iter().enumerate() {
        if s == 5 {
            t.on_live(1 << 63, b"not a batch", &mut h, &mut sink);
        }
        t.on_live(s as u64, p, &mut h, &mut sink);
    }
    assert_eq!(t.next(), Some(10), "{:?}", t.counters);
    assert_eq!(
        c.router().index().entries(),
        clean(&live),
        "{:?}",
        t.counters
    );
}

/// A hostile replay socket whose snapshots disagree with each other (numbered 0, then far
/// past anything live, in turn) and whose replays are empty: a live batch far behind syncs
/// once, never again within itself (each sync could send it behind again: a recursion a
/// peer would drive until the stack overflowed), and the stream goes on from the live
/// batches.
struct Fickle(u64, Vec<u8>);

impl History for Fickle {
    fn replay(&mut self, from: i64) -> Replayed {
        if from != SNAPSHOT {
            return Some(Vec::new());
        }
        self.0 += 1;
        let seq = if self.0.is_multiple_of(2) { 0 } else { 1 << 62 };
        Some(vec![(seq, self.1.clone())])
    }
}

#[test]
fn a_history_whose_snapshots_disagree_cannot_make_the_stream_recurse() {
    let live: Vec<Vec<WireEvent>> = (0..10)
        .map(|i| vec![stored(&tokens(50 + i, 1), Medium::Gpu)])
        .collect();
    let m = Memory::new(&live, 10);
    let mut c = Cluster::new(1, model(), 1 << 20, Keys::Engine).expect("model");
    let st = c.add_stream("s", "mem", Target::Instance(0));
    let mut t = Tracker::new();
    let mut sink = |a: Apply<'_>| c.apply(st, a);
    let snap = encode_batch(
        0.0,
        &[stored(&tokens(1, 1), Medium::Gpu)],
        0,
        HashFormat::Int64,
    )
    .expect("encode");
    let mut h = Fickle(0, snap);
    t.sync(&mut h, &mut sink);
    for (s, p) in m.payloads.iter().enumerate().skip(3) {
        t.on_live(s as u64, p, &mut h, &mut sink);
    }
    assert_eq!(t.next(), Some(10), "{:?}", t.counters);
    assert_eq!(
        c.router().index().entries(),
        clean(&live[3..]),
        "{:?}",
        t.counters
    );
}

/// A batch longer than the stream's `max_batch_bytes` is skipped undecoded (decoding takes
/// up to ~50 times a payload: a 30 MB batch of one-byte hashes took 1.4 GB), counted
/// `oversized` and lost; the batches after it apply.
#[test]
fn a_batch_past_the_size_limit_is_skipped_undecoded_and_the_stream_goes_on() {
    let live: Vec<Vec<WireEvent>> = vec![
        vec![stored(&tokens(1, 2), Medium::Gpu)],
        vec![stored(&tokens(2, 64), Medium::Gpu)],
        vec![stored(&tokens(3, 2), Medium::Gpu)],
    ];
    let m = Memory::new(&live, 10);
    let limit = m.payloads[0].len().max(m.payloads[2].len());
    assert!(m.payloads[1].len() > limit);
    let mut c = Cluster::new(1, model(), 1 << 20, Keys::Engine).expect("model");
    let st = c.add_stream("s", "mem", Target::Instance(0));
    let mut t = Tracker::with_max_batch_bytes(limit);
    let mut sink = |a: Apply<'_>| c.apply(st, a);
    t.sync(&mut Memory::new(&[], 10), &mut sink);
    let mut h = Memory::new(&live, 10);
    for (s, p) in m.payloads.iter().enumerate() {
        t.on_live(s as u64, p, &mut h, &mut sink);
    }
    assert_eq!(
        (t.counters.oversized, t.counters.applied, t.next()),
        (1, 2, Some(3))
    );
    let kept = vec![live[0].clone(), live[2].clone()];
    assert_eq!(c.router().index().entries(), clean(&kept));
}

/// vLLM's replay socket: no snapshots (-2 is answered with the end marker alone) and a
/// buffer of the last `keep` batches.
struct NoSnapshots(Memory);

impl History for NoSnapshots {
    fn replay(&mut self, from: i64) -> Replayed {
        if from == SNAPSHOT {
            return Some(Vec::new());
        }
        self.0.replay(from)
    }
}

/// A live batch delivered again (a relay's retransmit, a reordering) was read as the
/// publisher restarting: its instance was reset and, from a publisher without snapshots
/// whose buffer no longer starts at 0, never rebuilt (10 pages became 1). A number at or
/// below the last is a duplicate unless it is 0 after a higher one, or comes after a
/// reconnect: then it is still a restart.
#[test]
fn a_repeated_live_batch_is_a_duplicate_and_a_real_restart_still_resets() {
    let live: Vec<Vec<WireEvent>> = (0..10)
        .map(|i| vec![stored(&tokens(20 + i, 1), Medium::Gpu)])
        .collect();
    let follow = |c: &mut Cluster, t: &mut Tracker, h: &mut NoSnapshots| {
        let st = 0;
        let mut sink = |a: Apply<'_>| c.apply(st, a);
        t.sync(h, &mut sink);
        for (s, p) in h.0.payloads.clone().iter().enumerate() {
            t.on_live(s as u64, p, h, &mut sink);
        }
    };
    let new_cluster = || {
        let mut c = Cluster::new(1, model(), 1 << 20, Keys::Engine).expect("model");
        c.add_stream("s", "mem", Target::Instance(0));
        c
    };
    // the last batch again, and an earlier one: dropped, the index stays whole
    let mut c = new_cluster();
    let mut t = Tracker::new();
    let mut h = NoSnapshots(Memory::new(&live, 3));
    follow(&mut c, &mut t, &mut h);
    for s in [9usize, 7] {
        let p = h.0.payloads[s].clone();
        t.on_live(s as u64, &p, &mut h, &mut |a| c.apply(0, a));
    }
    assert_eq!(c.router().index().entries(), clean(&live));
    assert_eq!((t.counters.duplicates, t.counters.restarts), (2, 0));
    assert_eq!(t.next(), Some(10));
    // a publisher that numbers from 0 again restarted: its pages replace the old
    let new = vec![vec![stored(&tokens(40, 2), Medium::Gpu)]];
    let mut h2 = NoSnapshots(Memory::new(&new, 3));
    let p = h2.0.payloads[0].clone();
    t.on_live(0, &p, &mut h2, &mut |a| c.apply(0, a));
    assert_eq!(c.router().index().entries(), clean(&new));
    assert_eq!(t.counters.restarts, 1);
    // after a reconnect, a number at or below the last is a new incarnation's too
    let mut c = new_cluster();
    let mut t = Tracker::new();
    let mut h = NoSnapshots(Memory::new(&live, 3));
    follow(&mut c, &mut t, &mut h);
    let new: Vec<Vec<WireEvent>> = (0..4)
        .map(|i| vec![stored(&tokens(60 + i, 1), Medium::Gpu)])
        .collect();
    let mut h2 = NoSnapshots(Memory::new(&new, 10));
    t.reconnected(&mut h2, &mut |a| c.apply(0, a));
    let p = h2.0.payloads[3].clone();
    t.on_live(3, &p, &mut h2, &mut |a| c.apply(0, a));
    assert_eq!(t.counters.restarts, 1);
    assert_eq!(c.router().index().entries(), clean(&new));
}

/// A replay socket that has lost its history and answers snapshots with garbage (a corrupt
/// or truncated answer, another protocol on the port).
struct GarbageSnapshot;

impl History for GarbageSnapshot {
    fn replay(&mut self, from: i64) -> Replayed {
        Some(match from {
            SNAPSHOT => vec![(12, b"not a batch".to_vec())],
            _ => Vec::new(),
        })
    }
}

/// A gap the replay socket cannot fill asks for a snapshot; the snapshot did not decode. The
/// bug: the stream forgot its pages before it decoded the snapshot's first batch, so the
/// instance was left with the live batches after the gap alone (its 10 earlier pages gone,
/// priced as recompute everywhere). A snapshot whose first batch does not decode now
/// replaces nothing (counted garbage, as unanswered); the stream keeps what it had and goes
/// on from the live batch. A snapshot that decodes still replaces the pages, in one step.
#[test]
fn a_snapshot_that_does_not_decode_leaves_the_stream_its_pages() {
    let live: Vec<Vec<WireEvent>> = (0..13)
        .map(|i| vec![stored(&tokens(70 + i, 1), Medium::Gpu)])
        .collect();
    let m = Memory::new(&live, 13);
    let mut c = Cluster::new(1, model(), 1 << 20, Keys::Engine).expect("model");
    let st = c.add_stream("s", "mem", Target::Instance(0));
    let mut t = Tracker::new();
    let mut sink = |a: Apply<'_>| c.apply(st, a);
    t.sync(&mut Memory::new(&[], 13), &mut sink);
    let mut h = Memory::new(&live[..10], 13);
    for (s, p) in m.payloads.iter().enumerate().take(10) {
        t.on_live(s as u64, p, &mut h, &mut sink);
    }
    // batches 10 and 11 lost on the way; 12 arrives
    t.on_live(12, &m.payloads[12], &mut GarbageSnapshot, &mut sink);
    assert_eq!(t.next(), Some(13), "{:?}", t.counters);
    assert_eq!(
        (t.counters.garbage, t.counters.lost),
        (1, 1),
        "{:?}",
        t.counters
    );
    let kept: Vec<Vec<WireEvent>> = live[..10].iter().chain(&live[12..]).cloned().collect();
    assert_eq!(
        c.router().index().entries(),
        clean(&kept),
        "{:?}",
        t.counters
    );
    // a reconnect answered by the garbage snapshot changes nothing either
    t.reconnected(&mut GarbageSnapshot, &mut |a| c.apply(st, a));
    assert_eq!(c.router().index().entries(), clean(&kept));
}
