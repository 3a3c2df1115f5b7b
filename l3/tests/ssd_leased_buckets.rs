//! SSD bucket eviction while the oldest buckets hold leased objects, on the real SSD tier
//! over real files: one object per bucket, all buckets the same size, the master's answer
//! to an eviction (refused while an object is leased) given by the test's hooks.
//!
//! Why: eviction walks the buckets oldest first and skips one holding a leased object. The
//! walk went on to newer buckets until usage was under the low watermark, so leases on the
//! oldest buckets (a reader's, for seconds) made a write that crossed the high watermark
//! evict the next-oldest unleased buckets, down to the newest (the hottest), though the
//! write fitted within the capacity; with more leased than the low watermark, every
//! unleased bucket went. Now buckets newer than a leased one are evicted only as far as the
//! write needs to fit within the capacity; once the leases end the oldest go first again.

use std::collections::HashSet;
use std::sync::Arc;

use kvtier_l3::master::DiskLoc;
use kvtier_l3::ssd::tier::{OffloadJob, SsdTier, TierHooks};
use kvtier_l3::ssd::{Registration, TierStats};
use kvtier_l3::{SsdConfig, Tenant};
use parking_lot::Mutex;
use proptest::prelude::*;

/// The master's side: every copy registered; an eviction refused while any of the bucket's
/// objects is leased.
#[derive(Default)]
struct Hooks {
    leased: Mutex<HashSet<String>>,
    evicted: Mutex<Vec<String>>,
}

impl TierHooks for Hooks {
    fn register(&self, items: &[(&OffloadJob, DiskLoc)]) -> Vec<Registration> {
        vec![Registration::Registered; items.len()]
    }
    fn write_failed(&self, _jobs: &[OffloadJob]) {}
    fn evict_disk(&self, recs: &[(Tenant, String, DiskLoc)]) -> bool {
        let leased = self.leased.lock();
        if recs.iter().any(|(_, k, _)| leased.contains(k)) {
            return false;
        }
        self.evicted
            .lock()
            .extend(recs.iter().map(|(_, k, _)| k.clone()));
        true
    }
}

/// Object `i`'s key (all keys the same length, so all buckets the same size).
fn key(i: usize) -> String {
    format!("b{i:03}")
}

fn job(i: usize) -> OffloadJob {
    OffloadJob {
        tenant: Tenant::new("a").unwrap(),
        key: key(i),
        token: i as u64 + 1,
        data: Arc::from(vec![i as u8; 4096]),
        staged: false,
        done: None,
    }
}

struct Tier {
    tier: SsdTier,
    hooks: Arc<Hooks>,
    _dir: tempfile::TempDir,
}

impl Tier {
    /// A tier of `capacity` bytes, one object per bucket.
    fn new(capacity: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = SsdConfig::new(dir.path());
        cfg.bucket_keys_limit = 1;
        cfg.capacity_bytes = capacity;
        let (tier, _) = SsdTier::open(cfg).unwrap();
        let hooks = Arc::new(Hooks::default());
        tier.start(hooks.clone()).unwrap();
        Tier {
            tier,
            hooks,
            _dir: dir,
        }
    }

    /// Writes object `i` in its own bucket and waits for it.
    fn write(&self, i: usize) {
        let j = job(i);
        self.tier.announce(&j.tenant, &j.key, j.token);
        self.tier.enqueue(j, true).unwrap();
        self.tier.flush();
    }

    /// The objects on the SSD, oldest first.
    fn live(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .tier
            .live_records()
            .into_iter()
            .map(|(_, k, _)| k)
            .collect();
        v.reverse();
        v
    }

    fn stats(&self) -> TierStats {
        self.tier.stats()
    }

    fn lease(&self, objects: impl IntoIterator<Item = usize>) {
        *self.hooks.leased.lock() = objects.into_iter().map(key).collect();
    }

    fn evicted(&self) -> Vec<String> {
        std::mem::take(&mut *self.hooks.evicted.lock())
    }
}

/// The bytes one bucket of one object takes.
fn bucket_size() -> u64 {
    let t = Tier::new(1 << 30);
    t.write(0);
    t.stats().used_bytes
}

fn keys(r: std::ops::Range<usize>) -> Vec<String> {
    r.map(key).collect()
}

/// Capacity 20.5 buckets (high watermark 18.45, low 16.4): 18 buckets written, the 10
/// oldest leased. The 19th and 20th fit within the capacity: nothing is evicted (before, the
/// 19th evicted buckets 10, 11 and 12, the oldest unleased, to reach the low watermark).
/// The 21st does not fit: the oldest unleased bucket alone goes. Leases ended, the next
/// write evicts from the oldest down to the low watermark.
#[test]
fn leased_oldest_buckets_do_not_make_a_write_evict_newer_ones_it_fits_without() {
    let fs = bucket_size();
    let t = Tier::new(20 * fs + fs / 2);
    for i in 0..18 {
        t.write(i);
    }
    assert_eq!(t.stats().used_bytes, 18 * fs);
    assert!(t.evicted().is_empty());
    t.lease(0..10);
    t.write(18);
    t.write(19);
    assert_eq!(
        t.evicted(),
        Vec::<String>::new(),
        "buckets newer than the leased ones were evicted for writes that fit"
    );
    assert_eq!(t.live(), keys(0..20));
    t.write(20);
    assert_eq!(t.evicted(), keys(10..11));
    assert_eq!(t.stats().used_bytes, 20 * fs);
    // The readers are done: the oldest go first, down to the low watermark.
    t.lease([]);
    t.write(21);
    assert_eq!(t.evicted(), keys(0..5));
    let mut live = keys(5..10);
    live.extend(keys(11..22));
    assert_eq!(t.live(), live);
    assert_eq!(t.stats().used_bytes, 16 * fs);
}

/// More leased than the low watermark: before, a write past the high watermark evicted
/// every unleased bucket, the newest included (the low watermark out of reach). Now none
/// while the write fits within the capacity.
#[test]
fn leases_past_the_low_watermark_never_empty_the_rest_of_the_tier() {
    let fs = bucket_size();
    let t = Tier::new(20 * fs + fs / 2);
    for i in 0..18 {
        t.write(i);
    }
    t.lease(0..17);
    t.write(18);
    assert_eq!(t.evicted(), Vec::<String>::new());
    assert_eq!(t.live(), keys(0..19));
}

/// What the tier should evict for one write, from its buckets (oldest first, all `fs` bytes)
/// and which are leased: nothing unless the write passes the high watermark; then the
/// oldest unleased down to the low watermark, but past a leased bucket only as far as the
/// write needs to fit within the capacity.
fn model(live: &[usize], leased: &HashSet<usize>, fs: u64, cap: u64) -> Vec<usize> {
    let high = (cap as f64 * 0.90) as u64;
    let low = (cap as f64 * 0.80) as u64;
    let mut used = live.len() as u64 * fs;
    if used + fs <= high {
        return Vec::new();
    }
    let mut target = low;
    let mut out = Vec::new();
    for b in live {
        if used + fs <= target {
            break;
        }
        if leased.contains(b) {
            target = cap;
            continue;
        }
        out.push(*b);
        used -= fs;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Whatever objects are leased when each bucket is written: each write evicts what the
    /// policy says (oldest first, down to the low watermark, buckets newer than a leased
    /// one only as far as the write needs to fit), and the tier never passes its capacity
    /// while its unleased buckets could make room.
    #[test]
    fn eviction_past_leased_buckets_only_makes_room_for_the_write(
        leases in proptest::collection::vec(proptest::collection::vec(0usize..40, 0..12), 40),
    ) {
        let fs = bucket_size();
        let cap = 12 * fs + fs / 2;
        let t = Tier::new(cap);
        let mut live: Vec<usize> = Vec::new();
        for (i, leased) in leases.into_iter().enumerate() {
            let leased: HashSet<usize> = leased.into_iter().filter(|b| *b < i).collect();
            t.lease(leased.iter().copied());
            let want = model(&live, &leased, fs, cap);
            t.write(i);
            prop_assert_eq!(t.evicted(), want.iter().map(|b| key(*b)).collect::<Vec<_>>());
            live.retain(|b| !want.contains(b));
            live.push(i);
            prop_assert_eq!(t.live(), live.iter().map(|b| key(*b)).collect::<Vec<_>>());
            let used = t.stats().used_bytes;
            prop_assert_eq!(used, live.len() as u64 * fs);
            let older = &live[..live.len() - 1];
            prop_assert!(used <= cap || older.iter().all(|b| leased.contains(b)));
        }
    }
}
