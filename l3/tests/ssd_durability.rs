//! What a crash can leave in an SSD directory, recreated with real files, and what a restart
//! must make of it: bucket ids never reused, orphan tombstone sidecars removed, corrupt
//! tombstones never resurrecting removed keys, tombstone format checked.
//!
//! The SIGKILL test of the real server (`crash.rs`) finds these states at random; these tests
//! build each one on purpose so they are covered on every run.

use std::fs;
use std::path::Path;

mod common;

use common::{craft_bucket, payload, persisted, ssd_store_config, t};
use kvtier_l3::ssd::bucket;
use kvtier_l3::{EmbeddedStore, L3Error, L3Store, PutOptions};

fn files(dir: &Path, suffix: &str) -> Vec<u64> {
    let mut v: Vec<u64> = fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let n = e.unwrap().file_name().into_string().unwrap();
            n.strip_suffix(suffix)?.parse().ok()
        })
        .collect();
    v.sort_unstable();
    v
}

#[test]
fn bucket_ids_are_never_reused_across_restarts() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    {
        let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
        s.put(&a, "keep", &payload(1, 100), persisted()).unwrap();
        s.put(&a, "gone", &payload(2, 100), persisted()).unwrap();
        assert_eq!(files(d.path(), ".bkt"), vec![0, 1]);
        // Its only record removed: bucket 1 is deleted, and 1 is the highest id on disk.
        s.remove(&a, "gone", true).unwrap();
        assert_eq!(files(d.path(), ".bkt"), vec![0]);
    }
    let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
    s.put(&a, "new", &payload(3, 100), persisted()).unwrap();
    let ids = files(d.path(), ".bkt");
    assert_eq!(ids.len(), 2);
    assert!(ids[1] > 1, "bucket id 1 was handed out again: {ids:?}");
}

/// A crash between the two unlinks of a bucket deletion leaves its `.tomb`; a new bucket must
/// never inherit it.
#[test]
fn orphan_tombstones_never_kill_a_new_object() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    let orphan;
    craft_bucket(d.path(), 0, &[("base", 0)]);
    craft_bucket(d.path(), 1, &[("x", 1), ("y", 2)]);
    {
        let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
        let id = 1;
        s.remove(&a, "x", true).unwrap();
        let tomb = bucket::tomb_path(d.path(), id);
        orphan = (tomb.clone(), fs::read(&tomb).unwrap());
        s.remove(&a, "y", true).unwrap();
        assert!(!bucket::bucket_path(d.path(), id).exists());
    }
    // The crash left the sidecar behind.
    fs::write(&orphan.0, &orphan.1).unwrap();
    {
        let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
        assert!(!orphan.0.exists(), "orphan sidecar removed at startup");
        s.put(&a, "z", &payload(3, 100), persisted()).unwrap();
    }
    let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
    assert_eq!(s.get(&a, "z").unwrap(), payload(3, 100), "persisted z lost");
    assert_eq!(s.get(&a, "base").unwrap(), payload(0, 100));
    assert_eq!(s.get(&a, "x"), Err(L3Error::ObjectNotFound));
}

/// A tombstone whose bytes rotted may not name the record it removed: the removed key must
/// stay removed (the bucket is dropped whole, losing cached objects rather than
/// resurrecting one).
#[test]
fn corrupt_tombstone_never_resurrects_a_removed_key() {
    for flip in [0usize, 1, 2, 3] {
        let d = tempfile::tempdir().unwrap();
        let a = t("a");
        let id = 0;
        craft_bucket(d.path(), id, &[("p", 0), ("q", 1), ("r", 2)]);
        {
            let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
            s.remove(&a, "q", true).unwrap();
        }
        let tomb = bucket::tomb_path(d.path(), id);
        let mut b = fs::read(&tomb).unwrap();
        b[flip] ^= 0x01;
        fs::write(&tomb, &b).unwrap();
        let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
        assert_eq!(
            s.get(&a, "q"),
            Err(L3Error::ObjectNotFound),
            "flip of byte {flip}: removed key came back"
        );
        for (i, k) in ["p", "r"].iter().enumerate() {
            match s.get(&a, k) {
                Ok(v) => assert_eq!(v, payload(i * 2, 100), "{k}"),
                Err(e) => assert_eq!(e, L3Error::ObjectNotFound),
            }
        }
    }
}

/// A torn last tombstone (a crash inside the append, so never acknowledged) is ignored and
/// cut off: the tombstones before it hold, and later appends stay readable.
#[test]
fn torn_tombstone_tail_is_cut_and_later_tombstones_hold() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    let id = 0;
    craft_bucket(d.path(), id, &[("p", 0), ("q", 1), ("r", 2), ("s", 3)]);
    {
        let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
        s.remove(&a, "q", true).unwrap();
    }
    let tomb = bucket::tomb_path(d.path(), id);
    let mut b = fs::read(&tomb).unwrap();
    b.extend_from_slice(&[0xAB, 0xCD, 0xEF]);
    fs::write(&tomb, &b).unwrap();
    {
        let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
        assert_eq!(s.get(&a, "q"), Err(L3Error::ObjectNotFound));
        assert_eq!(s.get(&a, "p").unwrap(), payload(0, 100));
        s.remove(&a, "r", true).unwrap();
    }
    let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
    assert_eq!(s.get(&a, "q"), Err(L3Error::ObjectNotFound));
    assert_eq!(s.get(&a, "r"), Err(L3Error::ObjectNotFound));
    assert_eq!(s.get(&a, "p").unwrap(), payload(0, 100));
    assert_eq!(s.get(&a, "s").unwrap(), payload(3, 100));
}

/// A remove of an object whose write-through is still queued: the record is dead on disk
/// before it is ever visible (no crash window between publication and tombstone).
#[test]
fn remove_of_a_queued_write_is_dead_on_disk_before_publication() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
    for round in 0..50 {
        let k = format!("k{round}");
        s.put(&a, &k, &payload(round, 4096), PutOptions::default())
            .unwrap();
        s.remove(&a, &k, true).unwrap();
        // Whatever the writer did meanwhile, a scan of the directory as a restart would
        // see it never finds the key alive.
        for id in files(d.path(), ".bkt") {
            let (recs, _) = bucket::scan_bucket(&bucket::bucket_path(d.path(), id)).unwrap();
            let dead = bucket::read_tombstones(d.path(), id).unwrap();
            assert!(!dead.corrupt);
            for r in recs.iter().filter(|r| r.key == k) {
                assert!(
                    dead.dead.contains(&r.index),
                    "round {round}: {k} visible alive in bucket {id} after its remove"
                );
            }
        }
    }
}
