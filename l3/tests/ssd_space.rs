//! An SSD tier whose configured capacity is larger than its filesystem (the default 64 GiB
//! on a small disk). Real files in a temporary directory; the filesystem's size is
//! simulated by the tier's free-space function (`SsdConfig::free_space`): `FS` bytes minus
//! what the directory's files take, in 4 KiB blocks — so the test runs the same on any
//! disk and needs no mount.
//!
//! Why (found by an adversarial tester): the tier compared only its own use with
//! `--ssd-capacity`. On a 2 MiB tmpfs with the default capacity every write failed with
//! ENOSPC after the first 30 objects and no bucket was ever evicted: the tier was dead for
//! good.

use std::path::Path;

use kvtier_l3::config::FreeSpace;
use kvtier_l3::{EmbeddedStore, L3Store, SsdConfig, StoreConfig, Tenant};

mod common;

use common::{payload, persisted};

/// The simulated filesystem's size.
const FS: u64 = 2 << 20;

/// Bytes the files of `dir` take, in 4 KiB blocks.
fn on_disk(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len().div_ceil(4096) * 4096)
        .sum()
}

fn store(dir: &Path) -> EmbeddedStore {
    EmbeddedStore::new(StoreConfig {
        local_segment_bytes: 64 << 20,
        ssd: Some(SsdConfig {
            free_space: FreeSpace::given(|d| Ok(FS.saturating_sub(on_disk(d)))),
            ..SsdConfig::new(dir)
        }),
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn a_capacity_larger_than_the_filesystem_evicts_within_the_filesystem() {
    let d = tempfile::tempdir().unwrap();
    let s = store(d.path());
    let cap = s.ssd_stats().unwrap().capacity_bytes;
    assert!(
        cap <= FS,
        "the tier counts on {cap} bytes on a {FS}-byte filesystem"
    );
    let a = Tenant::new("a").unwrap();
    // 120 objects of 64 KiB (7.5 MiB) written through, each acknowledged once on disk.
    for round in 0..4 {
        for i in 0..30 {
            let k = format!("r{round}-{i}");
            s.put(&a, &k, &payload(round * 30 + i, 64 << 10), persisted())
                .unwrap_or_else(|e| panic!("{k}: {e}"));
            let used = on_disk(d.path());
            assert!(
                used <= FS,
                "{k}: {used} bytes on a {FS}-byte filesystem (the writes would fail from here)"
            );
            assert_eq!(s.residency(&a, &k), (true, true), "{k} has no SSD copy");
        }
    }
    let st = s.ssd_stats().unwrap();
    assert!(st.evicted_buckets > 0, "{st:?}");
    assert_eq!(st.write_failures, 0, "{st:?}");
    // The newest objects are on SSD and read back from it after a restart.
    drop(s);
    let s = store(d.path());
    let k = "r3-29";
    assert_eq!(s.residency(&a, k), (false, true));
    assert_eq!(s.get(&a, k).unwrap(), payload(119, 64 << 10));
}
