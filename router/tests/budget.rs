//! The index's byte budget, checked against the allocator itself.
//!
//! A budget is only as good as the memory count behind it, so this test binary counts every
//! byte its threads hold (a counting `#[global_allocator]`, per thread so that tests running
//! side by side do not see each other's) and checks that `memory_bytes()` of the index and of
//! a key table is exactly what they hold on the heap, through growth, removals and clears.
//! Then, for any event stream and any budget: the index never counts more than its budget,
//! what it keeps is a subset of what an unbounded index keeps, a budget at least the
//! unbounded index's peak changes nothing, and routing never fails for lack of room.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvtier_events::{HashFormat, Medium, WireEvent, encode_batch};
use kvtier_radix::PageHash;
use kvtier_router::cluster::{Cluster, Keys, Target};
use kvtier_router::index::Budget;
use kvtier_router::keys::Translator;
use kvtier_router::launch::{ByteSize, ByteSizeError};
use kvtier_router::stream::Apply;
use kvtier_router::{ClusterIndex, CostModel, IndexEvent, Router};
use proptest::prelude::*;

struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

fn count(d: isize) {
    let _ = LIVE.try_with(|l| l.set(l.get() + d));
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count(l.size() as isize);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        count(-(l.size() as isize));
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        count(l.size() as isize);
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        count(new as isize - l.size() as isize);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Bytes this thread holds on the heap.
fn live() -> isize {
    LIVE.with(Cell::get)
}

/// A deterministic pseudo-random sequence (no allocation while it runs).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

fn medium(k: u64) -> Medium {
    match k {
        0 => Medium::Gpu,
        1 => Medium::Cpu,
        _ => Medium::Storage,
    }
}

/// Stores in growing runs, removals of earlier runs and a few clears: every table grows
/// through several doublings and holds tombstones.
fn index_events(n: usize, seed: u64) -> Vec<(usize, IndexEvent)> {
    let mut r = Lcg(seed);
    let mut out = Vec::with_capacity(n);
    let mut next = 0u64;
    for _ in 0..n {
        let inst = r.next(3) as usize;
        let m = medium(r.next(3));
        let e = match r.next(20) {
            0 => IndexEvent::Cleared,
            1..=6 => {
                let from = r.next(next.max(1));
                let len = 1 + r.next(64);
                IndexEvent::Removed {
                    medium: m,
                    hashes: (from..from + len).collect(),
                }
            }
            _ => {
                let len = 1 + r.next(64);
                next += len;
                IndexEvent::Stored {
                    medium: m,
                    hashes: (next - len..next).collect(),
                }
            }
        };
        out.push((inst, e));
    }
    out
}

#[test]
fn the_index_counts_exactly_the_bytes_it_holds() {
    let events = index_events(4_000, 7);
    let before = live();
    let mut idx = ClusterIndex::new(3, usize::MAX);
    assert_eq!(live() - before, idx.memory_bytes() as isize);
    let mut grew = 0;
    let mut last = idx.memory_bytes();
    for (i, e) in &events {
        idx.apply(*i, e);
        assert_eq!(
            live() - before,
            idx.memory_bytes() as isize,
            "after {e:?} with {} entries",
            idx.pages()
        );
        grew += usize::from(idx.memory_bytes() > last);
        last = idx.memory_bytes();
    }
    assert!(grew > 20, "the tables grew {grew} times");
    assert!(idx.pages() > 10_000, "{} entries", idx.pages());
    drop(idx);
    assert_eq!(live(), before);
}

/// The bytes of a burst come back when it goes: one instance filled a 1 MiB budget and then
/// cleared or removed every page, and its emptied table kept its allocation, so another
/// instance could index only 28,672 of 50,000 pages for good (an adversarial tester's case).
/// Tables that empty or fall under an eighth of their load are rebuilt smaller, and the
/// allocator agrees with the count.
#[test]
fn a_burst_that_goes_returns_its_bytes_to_the_budget() {
    for how in ["clear", "remove", "remove most"] {
        let mut r = Lcg(11);
        let burst: Vec<u64> = (0..200_000).map(|_| r.next(u64::MAX)).collect();
        let mut other: Vec<u64> = (0..50_000).map(|_| r.next(u64::MAX)).collect();
        other.sort_unstable();
        other.dedup();
        let n = other.len();
        let before = live();
        let mut idx = ClusterIndex::with_budget(2, Budget::bytes(1 << 20));
        idx.apply(
            0,
            &IndexEvent::Stored {
                medium: Medium::Gpu,
                hashes: burst.clone(),
            },
        );
        assert!(idx.dropped() > 0, "the burst did not fill the budget");
        let kept = match how {
            "clear" => {
                idx.apply(0, &IndexEvent::Cleared);
                0
            }
            "remove" => {
                idx.apply(
                    0,
                    &IndexEvent::Removed {
                        medium: Medium::Gpu,
                        hashes: burst.clone(),
                    },
                );
                0
            }
            _ => {
                idx.apply(
                    0,
                    &IndexEvent::Removed {
                        medium: Medium::Gpu,
                        hashes: burst[100..].to_vec(),
                    },
                );
                100
            }
        };
        assert_eq!(idx.pages(), kept, "{how}");
        assert_eq!(
            live() - before,
            idx.memory_bytes() as isize,
            "{how}: the count is the heap's"
        );
        let dropped = idx.dropped();
        idx.apply(
            1,
            &IndexEvent::Stored {
                medium: Medium::Gpu,
                hashes: other.clone(),
            },
        );
        assert_eq!(
            idx.dropped(),
            dropped,
            "{how}: the other instance was under-indexed"
        );
        assert_eq!(idx.pages(), kept + n);
        assert!(idx.memory_bytes() <= 1 << 20);
        assert_eq!(live() - before, idx.memory_bytes() as isize, "{how}");
    }
}

/// Removals leave tombstones in a table at high load; once they use up its free slots, an
/// insert rehashes it in place (fewer than half its slots hold items) and allocates nothing.
/// So an index whose budget is exactly what it holds still takes such churn, drops nothing
/// and holds the same bytes, as the allocator sees.
#[test]
fn churn_at_a_full_budget_rehashes_in_place_and_drops_nothing() {
    let gpu = |hashes: Vec<u64>| IndexEvent::Stored {
        medium: Medium::Gpu,
        hashes,
    };
    let gone = |hashes: Vec<u64>| IndexEvent::Removed {
        medium: Medium::Gpu,
        hashes,
    };
    // 896 keys fill a table of 1,024 slots to its 7/8 (random: sequential keys hash to
    // evenly spaced slots, whose removal never leaves a tombstone)
    let mut r = Lcg(3);
    let keys: Vec<u64> = (0..20_896).map(|_| r.next(u64::MAX)).collect();
    let fill = gpu(keys[..896].to_vec());
    let mut free = ClusterIndex::new(1, usize::MAX);
    free.apply(0, &fill);
    let full = free.memory_bytes();
    let mut idx = ClusterIndex::with_budget(1, Budget::bytes(full));
    idx.apply(0, &fill);
    assert_eq!((idx.memory_bytes(), idx.dropped()), (full, 0));
    // keep 440 keys, under half the 896, oldest out and a new one in
    let out = gone(keys[..456].to_vec());
    idx.apply(0, &out);
    free.apply(0, &out);
    let churn: Vec<(IndexEvent, IndexEvent)> = (456..20_456)
        .map(|k| (gone(vec![keys[k]]), gpu(vec![keys[k + 440]])))
        .collect();
    let before = live();
    for (out, new) in &churn {
        for e in [out, new] {
            idx.apply(0, e);
            free.apply(0, e);
        }
        assert_eq!(idx.dropped(), 0, "{} entries", idx.pages());
        assert_eq!(idx.memory_bytes(), full);
    }
    assert_eq!(live(), before, "no table grew");
    assert_eq!(idx.entries(), free.entries());
    assert_eq!(idx.pages(), 440);
}

fn hash(n: u64) -> PageHash {
    let mut h = [0u8; 32];
    h[24..].copy_from_slice(&n.to_be_bytes());
    PageHash(h)
}

const BS: usize = 4;

/// vLLM-format batches for a key table: chains of stored blocks with their tokens, removals
/// of earlier blocks, and a clear now and then.
fn payloads(n: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut r = Lcg(seed);
    let mut next = 1u64;
    (0..n)
        .map(|_| {
            let m = medium(r.next(3));
            let e = match r.next(20) {
                0 => WireEvent::AllBlocksCleared,
                1..=6 => {
                    let from = 1 + r.next(next);
                    WireEvent::BlockRemoved {
                        block_hashes: (from..from + 1 + r.next(32)).map(hash).collect(),
                        medium: m,
                        locality: None,
                    }
                }
                _ => {
                    let len = 1 + r.next(32);
                    next += len;
                    WireEvent::BlockStored {
                        block_hashes: (next - len..next).map(hash).collect(),
                        parent_block_hash: None,
                        token_ids: (0..len as u32 * BS as u32)
                            .map(|t| t + next as u32)
                            .collect(),
                        block_size: BS as u32,
                        medium: m,
                        lora_name: None,
                        locality: None,
                    }
                }
            };
            encode_batch(0.0, &[e], 0, HashFormat::Int64).expect("encode")
        })
        .collect()
}

#[test]
fn the_key_table_counts_exactly_the_bytes_it_holds() {
    let batches = payloads(3_000, 11);
    let before = live();
    let mut t = Translator::new(usize::MAX);
    let mut last = 0;
    let mut grew = 0;
    for p in &batches {
        drop(t.translate(p).expect("translate"));
        assert_eq!(
            live() - before,
            t.memory_bytes() as isize,
            "{} keys",
            t.entries()
        );
        grew += usize::from(t.memory_bytes() > last);
        last = t.memory_bytes();
    }
    assert!(grew > 8, "the table grew {grew} times");
    assert!(t.entries() > 5_000, "{} keys", t.entries());
}

#[test]
fn a_key_table_never_exceeds_its_bytes() {
    let batches = payloads(2_000, 5);
    for max_bytes in [0, 1, 200, 1 << 12, 100_000, 1 << 20] {
        let mut t = Translator::new(usize::MAX);
        t.set_max_bytes(max_bytes);
        for p in &batches {
            let events = t.translate(p).expect("translate");
            assert!(
                t.memory_bytes() <= max_bytes,
                "{} > {max_bytes}",
                t.memory_bytes()
            );
            // a block not remembered is still keyed for the index: only its removal is lost
            drop(events);
        }
        if max_bytes < 1 << 20 {
            assert!(t.unkeyed > 0, "{max_bytes}: nothing refused");
        }
    }
}

fn event() -> impl Strategy<Value = (usize, IndexEvent)> {
    let medium = prop_oneof![Just(Medium::Gpu), Just(Medium::Cpu), Just(Medium::Storage)];
    let hashes = proptest::collection::vec(0u64..400, 0..40);
    (
        0usize..3,
        prop_oneof![
            6 => (medium.clone(), hashes.clone())
                .prop_map(|(medium, hashes)| IndexEvent::Stored { medium, hashes }),
            3 => (medium, hashes)
                .prop_map(|(medium, hashes)| IndexEvent::Removed { medium, hashes }),
            1 => Just(IndexEvent::Cleared),
        ],
    )
}

proptest! {
    #[test]
    fn the_index_never_exceeds_its_budget_and_keeps_a_subset(
        events in proptest::collection::vec(event(), 1..80),
        extra in 0usize..6_000,
        max_pages in prop_oneof![Just(usize::MAX), 1usize..300],
    ) {
        let budget = Budget { max_bytes: ClusterIndex::min_bytes(3) + extra, max_pages };
        let mut bounded = ClusterIndex::with_budget(3, budget);
        let mut free = ClusterIndex::new(3, usize::MAX);
        let mut peak = free.memory_bytes();
        for (i, e) in &events {
            let before = bounded.entries();
            let dropped = bounded.dropped();
            bounded.apply(*i, e);
            free.apply(*i, e);
            peak = peak.max(free.memory_bytes());
            prop_assert!(bounded.memory_bytes() <= budget.max_bytes,
                "{} > {}", bounded.memory_bytes(), budget.max_bytes);
            prop_assert!(bounded.pages() <= max_pages);
            let kept = bounded.entries();
            let all = free.entries();
            prop_assert!(kept.iter().all(|k| all.binary_search(k).is_ok()));
            // every store not kept is counted, once per hash sent
            let mut refused = 0;
            if let IndexEvent::Stored { medium, hashes } = e {
                let (who, name) = match medium {
                    Medium::Gpu => (*i, "GPU"),
                    Medium::Cpu => (*i, "CPU"),
                    Medium::Storage => (usize::MAX, "STORAGE"),
                };
                for h in hashes {
                    let k = (who, name, *h);
                    if before.binary_search(&k).is_err() && kept.binary_search(&k).is_err() {
                        refused += 1;
                    }
                }
            }
            prop_assert_eq!(bounded.dropped() - dropped, refused);
        }
        if bounded.dropped() == 0 {
            // nothing refused: the same index
            prop_assert_eq!(bounded.entries(), free.entries());
        }
        if max_pages == usize::MAX && peak <= budget.max_bytes {
            // a budget the unbounded index never passed changes nothing
            prop_assert_eq!(bounded.dropped(), 0);
            prop_assert_eq!(bounded.entries(), free.entries());
            prop_assert_eq!(bounded.memory_bytes(), free.memory_bytes());
        }
    }
}

fn model() -> CostModel {
    CostModel {
        page_size: BS,
        page_bytes: 1 << 20,
        prefill_tokens_per_s: 1000.0,
        host_bytes_per_s: 1e9,
        l3_bytes_per_s: 2.5e8,
    }
}

#[test]
fn a_full_index_still_routes_and_prices_missing_pages_as_computed() {
    let budget = Budget::bytes(ClusterIndex::min_bytes(2) + 200);
    let mut r = Router::with_budget(2, model(), budget).expect("model");
    let hashes: Vec<u64> = (0..1_000).collect();
    let e = IndexEvent::Stored {
        medium: Medium::Gpu,
        hashes: hashes.clone(),
    };
    r.apply(1, &e).expect("apply");
    let idx = r.index();
    assert!(idx.memory_bytes() <= budget.max_bytes);
    let kept = idx.pages();
    assert!(kept > 0 && kept < 1_000, "{kept} kept");
    assert_eq!(idx.dropped(), (1_000 - kept) as u64);
    let est = r.estimates_of(&hashes, hashes.len() * BS);
    assert_eq!(est[1].gpu_pages, kept, "the kept prefix is priced as a hit");
    assert_eq!(est[0].gpu_pages, 0);
    let (best, _) = r
        .route_hashes(&hashes, hashes.len() * BS, 0.0)
        .expect("routes");
    assert_eq!(best, 1);
}

/// A stream of `keys tokens` batches whose pages the index and the key table share one
/// budget: their sum never passes it, and `/stats` says what was dropped.
#[test]
fn the_budget_covers_the_key_tables_too() {
    let batches = payloads(1_500, 3);
    for extra in [0usize, 3_000, 40_000, 500_000] {
        let budget = Budget::bytes(ClusterIndex::min_bytes(2) + extra);
        let mut c = Cluster::with_budget(2, model(), budget, Keys::Tokens).expect("model");
        let a = c.add_stream("a", "mem", Target::Instance(0));
        let b = c.add_stream("b", "mem", Target::Instance(1));
        for (n, p) in batches.iter().enumerate() {
            assert!(c.apply(if n % 2 == 0 { a } else { b }, Apply::Batch(p)));
            assert!(
                c.memory_bytes() <= budget.max_bytes,
                "{} > {}",
                c.memory_bytes(),
                budget.max_bytes
            );
        }
        let stats = c.stats();
        assert_eq!(stats["max_index_bytes"], budget.max_bytes, "{stats}");
        assert_eq!(stats["memory_bytes"], c.memory_bytes(), "{stats}");
        let dropped = stats["dropped_stores"].as_u64().expect("dropped_stores");
        let unkeyed: u64 = stats["streams"]
            .as_array()
            .expect("streams")
            .iter()
            .map(|s| s["unkeyed"].as_u64().expect("unkeyed"))
            .sum();
        if extra < 500_000 {
            assert!(dropped > 0 && unkeyed > 0, "{extra}: {stats}");
        } else {
            assert_eq!((dropped, unkeyed), (0, 0), "{stats}");
        }
    }
}

#[test]
fn byte_sizes_parse_or_are_typed_errors() {
    let ok = |s: &str| s.parse::<ByteSize>().map(|b| b.0);
    assert_eq!(ok("4096"), Ok(4096));
    assert_eq!(ok("64KiB"), Ok(64 << 10));
    assert_eq!(ok("256MiB"), Ok(256 << 20));
    assert_eq!(ok("2GiB"), Ok(2 << 30));
    assert_eq!(ok("1GB"), Ok(1_000_000_000));
    assert_eq!(ok("300 MB"), Ok(300_000_000));
    assert_eq!(ok("5k"), Ok(5_000));
    assert_eq!(ok("0"), Err(ByteSizeError::Zero));
    assert_eq!(ok("0MiB"), Err(ByteSizeError::Zero));
    for bad in ["", "MiB", "lots", "-5", "1.5GiB", "12 XB", "1e9"] {
        assert!(
            matches!(ok(bad), Err(ByteSizeError::Invalid(_))),
            "{bad}: {:?}",
            ok(bad)
        );
    }
    assert_eq!(
        ok("99999999999999999999GiB"),
        Err(ByteSizeError::Invalid("99999999999999999999GiB".into()))
    );
    assert_eq!(ok("20000000000GiB"), Err(ByteSizeError::TooLarge));
}
