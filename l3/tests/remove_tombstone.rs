//! A remove whose SSD tombstone cannot be written is refused and changes nothing: the key
//! stays readable, and a restart never serves a version that was removed (adversarial
//! tester: the key was dropped from memory before the tombstone write failed, its record
//! stayed live, and after a newer version was put and removed a restart served the old one).
//!
//! The failure is real: a directory stands where the bucket's `.tomb` sidecar goes, so the
//! append fails (EISDIR) whatever the user's rights; the stores are real, on real files, and
//! the "restart" reopens the directory as a new process would.

use std::fs;
use std::path::Path;

mod common;

use common::{craft_bucket, payload, persisted, ssd_store_config, t};
use kvtier_l3::ssd::bucket;
use kvtier_l3::{EmbeddedStore, L3Error, L3Store};

fn block_tombstones(dir: &Path, id: u64) {
    fs::create_dir(bucket::tomb_path(dir, id)).unwrap();
}

fn unblock_tombstones(dir: &Path, id: u64) {
    fs::remove_dir(bucket::tomb_path(dir, id)).unwrap();
}

fn missing(s: &EmbeddedStore, key: &str) -> bool {
    matches!(s.get(&t("a"), key), Err(L3Error::ObjectNotFound))
}

#[test]
fn a_remove_whose_tombstone_fails_keeps_the_key_and_a_restart_never_serves_it() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    // Two records in one bucket, so removing one appends a tombstone (not a delete).
    craft_bucket(d.path(), 0, &[("k", 1), ("other", 2)]);
    {
        let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
        assert_eq!(s.get(&a, "k").unwrap(), payload(1, 100));
        block_tombstones(d.path(), 0);
        let r = s.remove(&a, "k", true);
        assert!(
            matches!(r, Err(L3Error::FileWriteFail(_))),
            "remove answered {r:?}"
        );
        // Refused: nothing changed.
        assert_eq!(
            s.get(&a, "k").unwrap(),
            payload(1, 100),
            "refused remove dropped the key"
        );
        // A non-forced remove is refused the same way.
        assert!(s.remove(&a, "k", false).is_err());
        assert_eq!(s.get(&a, "k").unwrap(), payload(1, 100));
        unblock_tombstones(d.path(), 0);
        // The retry succeeds; a newer version, persisted, then removed (acknowledged).
        s.remove(&a, "k", true).unwrap();
        assert!(missing(&s, "k"));
        s.put(&a, "k", &payload(9, 100), persisted()).unwrap();
        assert_eq!(s.get(&a, "k").unwrap(), payload(9, 100));
        s.remove(&a, "k", true).unwrap();
        assert!(missing(&s, "k"));
    }
    let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
    let got = s.get(&a, "k");
    assert!(
        matches!(got, Err(L3Error::ObjectNotFound)),
        "a removed key came back after a restart: {:?}",
        got.map(|v| v[..4].to_vec())
    );
    assert_eq!(s.get(&a, "other").unwrap(), payload(2, 100));
}

/// A refused remove followed by a restart (no retry): the key is still there, its bytes.
#[test]
fn a_refused_remove_survives_a_restart_as_not_removed() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    craft_bucket(d.path(), 0, &[("k", 1), ("other", 2)]);
    {
        let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
        block_tombstones(d.path(), 0);
        assert!(s.remove(&a, "k", true).is_err());
        unblock_tombstones(d.path(), 0);
        assert_eq!(s.get(&a, "k").unwrap(), payload(1, 100));
    }
    let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
    assert_eq!(s.get(&a, "k").unwrap(), payload(1, 100));
}

/// remove_by_regex / remove_all with one bucket's tombstones failing: the keys whose
/// tombstone failed stay (readable), every other selected key is removed, and the answer is
/// an error that says so. After a restart the removed ones stay removed.
#[test]
fn batch_removes_keep_exactly_the_keys_whose_tombstone_failed() {
    for all in [false, true] {
        let d = tempfile::tempdir().unwrap();
        let a = t("a");
        craft_bucket(d.path(), 0, &[("x1", 1), ("keep0", 2)]);
        craft_bucket(d.path(), 1, &[("x2", 3), ("keep1", 4)]);
        {
            let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
            s.put(&a, "xmem", &payload(5, 100), Default::default())
                .unwrap();
            block_tombstones(d.path(), 0);
            let r = if all {
                s.remove_all(&a, true)
            } else {
                s.remove_by_regex(&a, "^x", true)
            };
            match &r {
                Err(L3Error::FileWriteFail(m)) => assert!(m.contains("x1"), "{m}"),
                other => panic!("answered {other:?}"),
            }
            assert_eq!(s.get(&a, "x1").unwrap(), payload(1, 100), "all={all}");
            assert!(missing(&s, "x2"), "all={all}");
            assert!(missing(&s, "xmem"), "all={all}");
            if all {
                assert_eq!(s.get(&a, "keep0").unwrap(), payload(2, 100));
                assert!(missing(&s, "keep1"));
            } else {
                assert_eq!(s.get(&a, "keep0").unwrap(), payload(2, 100));
                assert_eq!(s.get(&a, "keep1").unwrap(), payload(4, 100));
            }
            unblock_tombstones(d.path(), 0);
        }
        let s = EmbeddedStore::new(ssd_store_config(d.path())).unwrap();
        assert_eq!(s.get(&a, "x1").unwrap(), payload(1, 100), "all={all}");
        assert!(
            missing(&s, "x2"),
            "x2 came back after a restart (all={all})"
        );
        assert_eq!(s.get(&a, "keep0").unwrap(), payload(2, 100));
        if !all {
            assert_eq!(s.get(&a, "keep1").unwrap(), payload(4, 100));
        } else {
            assert!(missing(&s, "keep1"), "keep1 came back after a restart");
        }
    }
}
