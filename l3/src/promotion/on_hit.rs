//! Promotion on hit: reads of an SSD-only object bring it back to DRAM (Mooncake's master
//! flag `--promotion_on_hit`, with its `--promotion_admission_threshold`).
//!
//! Why: an offload-on-evict store turns warm objects into SSD-only ones under DRAM pressure;
//! without promotion every later read of them pays an SSD read. Prefetch-on-exist (the
//! probe, [`super`]) covers engines that probe before they read; Mooncake's clients just
//! read, and its master promotes a key whose reads pass an admission count. Mooncake's rule
//! (master_service.cpp, `GetReplicaList`/`BatchGetReplicaList` → `TryPushPromotionQueue`):
//! a read that finds *no memory replica and a local-disk one* bumps the key's count (a
//! count-min sketch there, saturating at 255); at `promotion_admission_threshold` (default 2,
//! clamped to 1 ..= 255) a promotion is queued, unless DRAM use is at the high watermark.
//!
//! How kvtier differs, on purpose: Mooncake's background eviction keeps DRAM a margin
//! below the high watermark, so its promotion finds room; kvtier evicts only when a put needs
//! room, so after a DRAM flood it sits right under the mark and a refused promotion would
//! never be retried. A promotion on hit therefore makes room ([`Room::EvictSaved`]):
//! it evicts cold objects (least recently used, unleased, unpinned and SSD-backed first) whose
//! eviction loses nothing — those that already have a registered SSD copy, and in
//! offload-on-evict mode the others too, whose bytes eviction hands to the SSD writer (staged,
//! readable until the copy is registered, as any eviction in that mode) — and is refused
//! (-200, starting the promoter's cool-down) when those do not free enough. In write-through
//! mode it never evicts an object whose only copy is in DRAM, and it never passes the high
//! watermark. A probe's promotion keeps the old rule ([`Room::Refuse`]): probes must not churn
//! DRAM. A read admitted again replaces a finished promotion of its key (the key was evicted
//! since); the probe's dedup TTL does not hold it back.
//!
//! Counts live in a bounded map (at most [`MAX_TRACKED`] keys; when full, it starts over,
//! as a sketch forgets), and a key's count restarts once it is admitted.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::types::Tenant;

type Key = (Tenant, String);

/// Keys whose read counts are kept at most.
pub const MAX_TRACKED: usize = 1 << 16;

/// What a promotion may do when DRAM lacks room under the high watermark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// Refuse (-200): a probe's prefetch never evicts.
    Refuse,
    /// Evict cold objects whose eviction loses nothing (registered SSD copy, or staged for
    /// the SSD writer in offload-on-evict mode), then refuse if that was not enough: a
    /// promotion on hit.
    EvictSaved,
}

/// Read counts of SSD-only keys, for the admission threshold.
#[derive(Debug)]
pub struct HitCounter {
    threshold: u32,
    counts: Mutex<HashMap<Key, u32>>,
}

impl HitCounter {
    /// A counter admitting a key at its `threshold`-th read (clamped to 1 ..= 255, as
    /// Mooncake clamps its flag).
    pub fn new(threshold: u32) -> Self {
        HitCounter {
            threshold: threshold.clamp(1, 255),
            counts: Mutex::new(HashMap::new()),
        }
    }

    /// The threshold in force.
    pub fn threshold(&self) -> u32 {
        self.threshold
    }

    /// Counts one read of each key (each an SSD-only hit); returns those whose count reached
    /// the threshold now (their counts restart).
    pub fn admit(&self, keys: Vec<Key>) -> Vec<Key> {
        let mut counts = self.counts.lock();
        let mut out = Vec::new();
        for k in keys {
            if counts.len() >= MAX_TRACKED && !counts.contains_key(&k) {
                counts.clear();
            }
            let c = counts.entry(k.clone()).or_insert(0);
            *c = c.saturating_add(1);
            if *c >= self.threshold {
                counts.remove(&k);
                out.push(k);
            }
        }
        out
    }

    /// Keys with a count (tests).
    pub fn tracked(&self) -> usize {
        self.counts.lock().len()
    }
}

#[cfg(test)]
mod tests {
    //! The counter's rule, and the master's promotion under both [`Room`]s: on a real
    //! `Master` with real segments, a property test that promotion never drops the last copy
    //! of any object, never passes the high watermark, and never exceeds capacity.
    use super::*;
    use std::sync::Arc;

    use proptest::prelude::*;

    use crate::config::StoreConfig;
    use crate::error::L3Error;
    use crate::master::{DiskLoc, EvictionOutcome, LOCAL_NODE, Master, MasterPolicy};
    use crate::types::{ClientId, SegmentId};

    fn key(k: &str) -> Key {
        (Tenant::new("t").unwrap(), k.to_string())
    }

    #[test]
    fn a_key_is_admitted_at_the_threshold_and_starts_over() {
        let c = HitCounter::new(2);
        assert!(c.admit(vec![key("a")]).is_empty());
        assert_eq!(c.admit(vec![key("a"), key("b")]), vec![key("a")]);
        assert_eq!(c.tracked(), 1, "a's count restarted, b's is kept");
        assert!(c.admit(vec![key("a")]).is_empty());
        assert_eq!(HitCounter::new(0).threshold(), 1);
        assert_eq!(HitCounter::new(1).admit(vec![key("x")]), vec![key("x")]);
        assert_eq!(HitCounter::new(9999).threshold(), 255);
    }

    #[test]
    fn the_counts_are_bounded() {
        let c = HitCounter::new(255);
        let keys: Vec<Key> = (0..MAX_TRACKED + 10)
            .map(|i| key(&format!("k{i}")))
            .collect();
        c.admit(keys);
        assert!(c.tracked() <= MAX_TRACKED);
    }

    const CAP: u64 = 64 << 10;

    fn master() -> Master {
        master_with(false)
    }

    /// A master over one 64 KiB segment; `on_evict`: offload-on-evict mode.
    fn master_with(on_evict: bool) -> Master {
        let mut cfg = StoreConfig {
            local_segment_bytes: 0,
            ..StoreConfig::default()
        };
        if on_evict {
            let mut ssd = crate::config::SsdConfig::new(std::env::temp_dir());
            ssd.mode = crate::config::OffloadMode::OnEvict;
            cfg.ssd = Some(ssd);
        }
        let mut m = Master::new(MasterPolicy::from_config(&cfg));
        m.mount_segment(ClientId(1), SegmentId(1), CAP, 0).unwrap();
        m
    }

    /// Puts `key` (`size` bytes); with `saved`, registers an SSD copy for it.
    fn put(m: &mut Master, t: &Tenant, key: &str, size: u64, saved: bool, now: u64) -> bool {
        let mut out = EvictionOutcome::default();
        let Ok(h) = m.put_start(t, key, size, 1, now, &mut out) else {
            return false;
        };
        let data: Arc<[u8]> = vec![1u8; size as usize].into();
        m.put_write(&h, data).unwrap();
        m.put_end(&h, false, now).unwrap();
        if saved {
            let loc = DiskLoc {
                bucket: 1,
                offset: 0,
                size,
                crc: 0,
            };
            assert!(m.register_disk(LOCAL_NODE, t, key, h.token, loc));
        }
        true
    }

    /// The keys that exist, with whether each still holds data somewhere (DRAM, SSD, or
    /// staged for the SSD writer).
    fn copies(m: &Master, t: &Tenant, keys: &[String]) -> Vec<(String, bool)> {
        keys.iter()
            .filter(|k| m.size_of(t, k).is_ok() || m.on_disk(t, k) || m.in_memory(t, k))
            .map(|k| (k.clone(), m.size_of(t, k).is_ok()))
            .collect()
    }

    /// A promotion whose charge no segment can hold (the segment it was put in is gone) is
    /// -200 before it evicts anything: it evicted every object with an SSD copy from DRAM,
    /// for a promotion that could not fit whatever was evicted.
    #[test]
    fn a_promotion_no_segment_can_hold_evicts_nothing() {
        let t = Tenant::new("t").unwrap();
        let mut m = master();
        m.mount_segment(ClientId(2), SegmentId(2), 4 * CAP, 0)
            .unwrap();
        assert!(put(&mut m, &t, "big", 2 * CAP, true, 0));
        m.unmount_segment(ClientId(2), SegmentId(2)).unwrap();
        let (token, _) = m.ssd_only(&t, "big").unwrap();
        let keys: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
        for k in &keys {
            assert!(put(&mut m, &t, k, 4 << 10, true, 0));
        }
        let data: Arc<[u8]> = vec![1u8; 2 * CAP as usize].into();
        let mut out = EvictionOutcome::default();
        let r = m.promote(&t, "big", token, data, 1, Room::EvictSaved, &mut out);
        assert!(
            matches!(r, Err(L3Error::NoAvailableHandle { needed }) if needed == crate::charge(2 * CAP, 3)),
            "{r:?}"
        );
        assert_eq!(out.evicted, 0);
        for k in &keys {
            assert!(
                m.in_memory(&t, k),
                "{k} evicted for a promotion that cannot fit"
            );
        }
    }

    #[test]
    fn evict_saved_makes_room_only_from_objects_with_an_ssd_copy() {
        let t = Tenant::new("t").unwrap();
        let mut m = master();
        // An SSD-only object to promote: put first (the least recently used), then evicted.
        assert!(put(&mut m, &t, "cold", 4 << 10, true, 0));
        m.evict(4 << 10, 0, &mut EvictionOutcome::default());
        let (token, _) = m.ssd_only(&t, "cold").unwrap();
        // 14 objects of 4 KiB fill 87.5 % (the high watermark is 90 %); the odd ones have
        // an SSD copy.
        for i in 0..14 {
            assert!(put(&mut m, &t, &format!("k{i}"), 4 << 10, i % 2 == 1, 0));
        }
        let keys: Vec<String> = (0..14).map(|i| format!("k{i}")).collect();
        let before = copies(&m, &t, &keys);
        let data: Arc<[u8]> = vec![1u8; 4 << 10].into();
        let mut out = EvictionOutcome::default();
        let refused = m.promote(&t, "cold", token, data.clone(), 1, Room::Refuse, &mut out);
        assert!(matches!(refused, Err(L3Error::NoAvailableHandle { .. })));
        assert!(!m.in_memory(&t, "cold"));
        m.promote(&t, "cold", token, data, 1, Room::EvictSaved, &mut out)
            .unwrap();
        assert!(
            out.to_offload.is_empty(),
            "write-through mode stages nothing"
        );
        assert!(m.in_memory(&t, "cold"));
        assert!(m.stats().mem_used_bytes <= (CAP as f64 * 0.9) as u64);
        assert_eq!(copies(&m, &t, &keys), before, "no object lost a copy");
        for (i, k) in keys.iter().enumerate() {
            if i % 2 == 0 {
                assert!(m.in_memory(&t, k), "{k} has no SSD copy: never evicted");
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put { size_kib: u64, saved: bool },
        Evict { kib: u64 },
        Promote { pick: usize, room: bool },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u64..=12, any::<bool>()).prop_map(|(size_kib, saved)| Op::Put { size_kib, saved }),
            (1u64..=24).prop_map(|kib| Op::Evict { kib }),
            (any::<usize>(), any::<bool>()).prop_map(|(pick, room)| Op::Promote { pick, room }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// Whatever the sequence, a promotion (either `Room`) removes no object, leaves
        /// every object with a copy, keeps DRAM within capacity, and, when it succeeds,
        /// leaves DRAM at or under the high watermark.
        #[test]
        fn promotion_never_drops_the_last_copy_nor_overfills(
            ops in proptest::collection::vec(op(), 1..60),
            on_evict in any::<bool>(),
        ) {
            let t = Tenant::new("t").unwrap();
            let mut m = master_with(on_evict);
            let mut keys: Vec<String> = Vec::new();
            let high = (CAP as f64 * 0.9) as u64;
            for (now, o) in ops.into_iter().enumerate() {
                let now = now as u64;
                match o {
                    Op::Put { size_kib, saved } => {
                        let k = format!("k{}", keys.len());
                        if put(&mut m, &t, &k, size_kib << 10, saved, now) {
                            keys.push(k);
                        }
                    }
                    Op::Evict { kib } => m.evict(kib << 10, now, &mut EvictionOutcome::default()),
                    Op::Promote { pick, room } => {
                        let cold: Vec<&String> =
                            keys.iter().filter(|k| m.ssd_only(&t, k).is_some()).collect();
                        if cold.is_empty() {
                            continue;
                        }
                        let k = cold[pick % cold.len()].clone();
                        let Some((token, loc)) = m.ssd_only(&t, &k) else { continue };
                        let before = copies(&m, &t, &keys);
                        let room = if room { Room::EvictSaved } else { Room::Refuse };
                        let data: Arc<[u8]> = vec![1u8; loc.size as usize].into();
                        let mut out = EvictionOutcome::default();
                        let r = m.promote(&t, &k, token, data, now, room, &mut out);
                        let after = copies(&m, &t, &keys);
                        prop_assert_eq!(&after, &before, "an object or a copy went");
                        if !on_evict {
                            prop_assert!(out.to_offload.is_empty());
                        }
                        prop_assert!(after.iter().all(|(_, has)| *has));
                        let used = m.stats().mem_used_bytes;
                        prop_assert!(used <= CAP);
                        match r {
                            Ok(()) => {
                                prop_assert!(m.in_memory(&t, &k));
                                prop_assert!(used <= high, "used {} > high {}", used, high);
                            }
                            Err(e) => {
                                let pressure = matches!(e, L3Error::NoAvailableHandle { .. });
                                prop_assert!(pressure, "unexpected error {:?}", e);
                            }
                        }
                    }
                }
            }
        }
    }
}
