//! The DRAM a store holds for its memory replicas stays within its segment capacity, whatever
//! the objects' sizes and keys: each replica is charged its value, its key and the metadata
//! the store keeps for it (`kvtier_l3::charge`), and that charge is measured here against the
//! heap the store really grows by (a counting global allocator).
//!
//! Why: an adversarial tester filled a 4 MiB segment with 3.28 million one-byte objects
//! (1.8 GiB of RSS) and 4 KB keys grew ~9 KB each: the segment counted only values, so the
//! store's memory had no bound a user could set.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};

use kvtier_l3::{EmbeddedStore, L3Store, PutOptions, StoreConfig, Tenant};

/// Bytes live on the heap (all threads), from the allocator's own requests.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

// SAFETY: forwards to the system allocator; only counts the sizes it is asked for.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as i64, Ordering::Relaxed);
        // SAFETY: same layout as asked.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as i64, Ordering::Relaxed);
        // SAFETY: p was allocated by System with l.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as i64, Ordering::Relaxed);
        // SAFETY: same layout as asked.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as i64 - l.size() as i64, Ordering::Relaxed);
        // SAFETY: p was allocated by System with l.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// The tests measure one heap: they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn live() -> i64 {
    LIVE.load(Ordering::Relaxed)
}

/// An embedded store with one segment of `seg` bytes, DRAM only, no loss journal.
fn store(seg: u64) -> EmbeddedStore {
    EmbeddedStore::new(StoreConfig {
        local_segment_bytes: seg,
        recycle_idle_bytes: 0,
        ..Default::default()
    })
    .expect("store")
}

/// Puts `n` objects of `value` bytes under keys of `key_len` bytes (distinct), into `s`.
fn fill(s: &EmbeddedStore, n: usize, key_len: usize, value: usize) {
    let t = Tenant::new("t").expect("tenant");
    let v = vec![7u8; value];
    for i in 0..n {
        let mut k = format!("k{i:09}-");
        while k.len() < key_len {
            k.push('x');
        }
        s.put(&t, &k, &v, PutOptions::default()).expect("put");
    }
}

/// Heap grown by a store of `seg` bytes after `n` puts (the store itself included).
fn grown(seg: u64, n: usize, key_len: usize, value: usize) -> (i64, EmbeddedStore) {
    let before = live();
    let s = store(seg);
    fill(&s, n, key_len, value);
    (live() - before, s)
}

/// Fixed cost of a store with nothing in it (threads, maps, the sweeper), measured.
fn empty_store_heap() -> i64 {
    let before = live();
    let s = store(1 << 20);
    let after = live();
    drop(s);
    after - before
}

const SEG: u64 = 4 << 20;

#[test]
fn tiny_objects_stay_within_the_segment() {
    let _one = serial();
    let base = empty_store_heap();
    // 200,000 one-byte objects: far past what 4 MiB can hold once each costs its metadata.
    let (heap, s) = grown(SEG, 200_000, 16, 1);
    let st = s.stats().expect("stats");
    assert!(
        st.mem_used_bytes <= SEG,
        "charged {} of {SEG}",
        st.mem_used_bytes
    );
    // The heap above an empty store's: at most the segment, with a tenth of slack for hash
    // tables between resizes and the eviction order's spare room.
    let over = heap - base;
    assert!(
        over <= (SEG + SEG / 10) as i64,
        "{} objects held {over} heap bytes in a {SEG}-byte segment",
        st.mem_objects
    );
}

#[test]
fn long_keys_are_charged() {
    let _one = serial();
    let base = empty_store_heap();
    // 4 KB keys, one-byte values: 3,000 of them would be ~27 MB of metadata.
    let (heap, s) = grown(SEG, 3_000, 4096, 1);
    let over = heap - base;
    assert!(
        over <= (SEG + SEG / 10) as i64,
        "{} objects with 4 KB keys held {over} heap bytes in a {SEG}-byte segment",
        s.stats().expect("stats").mem_objects
    );
}

#[test]
fn the_charge_covers_what_an_object_costs() {
    let _one = serial();
    // Below capacity (nothing evicted), each object's heap is at most its charge: the
    // constant is measured, not guessed, and a new per-object field that outgrows it fails
    // here. And it is not wildly above (a charge of twice the cost wastes the segment).
    for (key_len, value) in [(8, 1), (40, 1), (200, 64), (1024, 8), (4096, 1)] {
        let n = 2_000;
        let charge = kvtier_l3::charge(value as u64, key_len);
        let big = charge * n as u64 * 4;
        let base = empty_store_heap();
        let (heap, s) = grown(big, n, key_len, value);
        assert_eq!(
            s.stats().expect("stats").mem_objects,
            n as u64,
            "none evicted"
        );
        let per = (heap - base) as f64 / n as f64;
        assert!(
            per <= charge as f64,
            "key {key_len} B, value {value} B: {per:.0} heap bytes an object, charged {charge}"
        );
        assert!(
            per >= charge as f64 / 3.0,
            "key {key_len} B, value {value} B: {per:.0} heap bytes an object, charged {charge}"
        );
    }
}
