//! Promotion on hit (`PromotionConfig::on_hit`, `kvtier-l3 --promotion-on-hit`; Mooncake's
//! `--promotion_on_hit`) on the real embedded store with a real SSD tier in offload-on-evict
//! mode, as Mooncake's test_promotion_on_hit runs it: after a DRAM flood turned objects into
//! SSD-only ones, reads of one bring it back to DRAM once they pass the admission threshold,
//! making room by evicting objects to the SSD writer (nothing lost: every object reads back
//! its bytes); without the flag, reads never promote. (Before, kvtier promoted only on an
//! `exist(prefetch_to_memory)` probe, and after such a flood DRAM sat right under the high
//! watermark, so even that promotion was refused.)

use std::time::{Duration, Instant};

use kvtier_l3::{
    EmbeddedStore, L3Store, OffloadMode, PromotionConfig, PutOptions, SsdConfig, StoreConfig,
    Tenant,
};

const OBJ: usize = 1 << 20;
const KEYS: usize = 24;

fn store(dir: &std::path::Path, on_hit: bool, threshold: u32) -> EmbeddedStore {
    let mut ssd = SsdConfig::new(dir);
    ssd.mode = OffloadMode::OnEvict;
    ssd.bucket_keys_limit = 4;
    EmbeddedStore::new(StoreConfig {
        local_segment_bytes: 8 << 20,
        lease_ttl: Duration::from_millis(50),
        ssd: Some(ssd),
        promotion: PromotionConfig {
            on_hit,
            admission_threshold: threshold,
            ..PromotionConfig::default()
        },
        ..StoreConfig::default()
    })
    .unwrap()
}

fn value(i: usize) -> Vec<u8> {
    (0..OBJ).map(|j| (i * 31 + j * 7) as u8).collect()
}

/// Floods DRAM (24 MiB into 8 MiB) and returns an SSD-only key.
fn flood(s: &EmbeddedStore, t: &Tenant) -> String {
    for i in 0..KEYS {
        s.put(t, &format!("k{i}"), &value(i), PutOptions::default())
            .unwrap();
    }
    s.flush().unwrap();
    (0..KEYS)
        .map(|i| format!("k{i}"))
        .find(|k| s.residency(t, k) == (false, true))
        .expect("an SSD-only key after the flood")
}

fn in_memory_within(s: &EmbeddedStore, t: &Tenant, k: &str, wait: Duration) -> bool {
    let end = Instant::now() + wait;
    loop {
        if s.residency(t, k).0 {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn all_read_back(s: &EmbeddedStore, t: &Tenant) {
    s.flush().unwrap();
    for i in 0..KEYS {
        assert_eq!(
            s.get(t, &format!("k{i}")).unwrap(),
            value(i),
            "k{i} lost or torn"
        );
    }
}

#[test]
fn reads_past_the_threshold_promote_an_ssd_only_object() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path(), true, 2);
    let t = Tenant::new("t").unwrap();
    let cold = flood(&s, &t);
    let i: usize = cold[1..].parse().unwrap();
    assert_eq!(s.get(&t, &cold).unwrap(), value(i));
    assert!(
        !in_memory_within(&s, &t, &cold, Duration::from_millis(200)),
        "one read is below the threshold of 2"
    );
    assert_eq!(s.get(&t, &cold).unwrap(), value(i));
    assert!(
        in_memory_within(&s, &t, &cold, Duration::from_secs(5)),
        "the second read promotes it, making room under the high watermark"
    );
    let st = s.stats().unwrap();
    assert!(st.mem_used_bytes <= (st.mem_capacity_bytes as f64 * 0.9) as u64);
    assert_eq!(s.get(&t, &cold).unwrap(), value(i));
    all_read_back(&s, &t);
}

#[test]
fn without_the_flag_reads_never_promote() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path(), false, 1);
    let t = Tenant::new("t").unwrap();
    let cold = flood(&s, &t);
    for _ in 0..4 {
        s.get(&t, &cold).unwrap();
    }
    assert!(!in_memory_within(&s, &t, &cold, Duration::from_millis(300)));
    all_read_back(&s, &t);
}
