//! What else can be in an SSD directory, and what the tier must make of it (adversarial
//! tester, `/tmp/adv-ssd/`):
//! - a second process on the same directory is refused before it reads or changes anything
//!   in it (the directory lock), so the first one's buckets and in-flight writes are safe;
//! - bucket ids never wrap: a stray file or a `next-bucket-id` naming an id kvtier cannot
//!   have written is never used to pick the next id, and id exhaustion is a typed error;
//! - directories, FIFOs and symlinks named like buckets or tombstones are skipped and left
//!   alone: startup neither fails, nor hangs, nor writes through a link.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::procs::{args, kill9, spawn};
use common::{client, payload, persisted, t};
use kvtier_l3::ssd::bucket;
use kvtier_l3::{EmbeddedStore, L3Error, L3Store, SsdConfig, StoreConfig};

fn cfg(dir: &Path) -> StoreConfig {
    StoreConfig {
        local_segment_bytes: 16 << 20,
        ssd: Some(SsdConfig::new(dir)),
        ..Default::default()
    }
}

/// Bucket `id` holding `key` (tenant "a", payload `i`), written the way the writer does.
fn craft(dir: &Path, id: u64, key: &str, i: usize) {
    let data = payload(i, 100);
    let rec = bucket::NewRecord {
        tenant: "a",
        key,
        data: &data,
    };
    bucket::write_bucket(dir, id, &[rec]).unwrap();
}

/// Every entry of `dir` (not following links) with its type and, for regular files, bytes.
fn listing(dir: &Path) -> Vec<(String, String, Vec<u8>)> {
    let mut v: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let ty = e.file_type().unwrap();
            let bytes = if ty.is_file() {
                fs::read(e.path()).unwrap()
            } else {
                Vec::new()
            };
            (
                e.file_name().into_string().unwrap(),
                format!("{ty:?}"),
                bytes,
            )
        })
        .collect();
    v.sort();
    v
}

/// Runs `kvtier-l3` to its exit (at most 20 s: one still running then is killed and
/// reported as `None`); returns its exit code and stderr.
fn run_to_exit(a: &[String]) -> (Option<i32>, String) {
    let mut kid = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args(a)
        .env_remove("KVTIER_L3_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    let code = loop {
        if let Some(st) = kid.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() >= end {
            kill9(&mut kid);
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    use std::io::Read;
    kid.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (code, err)
}

fn server_args(dir: &Path, listen: &str) -> Vec<String> {
    let d = dir.display().to_string();
    args(&[
        "--listen",
        listen,
        "--segment-bytes",
        "16777216",
        "--no-shm",
        "--ssd-dir",
        &d,
    ])
}

/// t2/t10: a second server started on a directory a running server uses — whether it would
/// then fail to bind (same address) or not — exits with an error naming the directory, and
/// leaves every file there as it was (before: it rescanned the directory and deleted the
/// running server's `*.bkt.tmp`, or ran beside it and renamed buckets over its buckets).
#[test]
fn a_second_server_on_the_same_ssd_dir_is_refused_and_touches_nothing() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    let mut first = spawn(&server_args(d.path(), "127.0.0.1:0"), None);
    let c = client(first.addr, None);
    for i in 0..10 {
        c.put(&a, &format!("k{i}"), &payload(i, 300), persisted())
            .unwrap();
    }
    // A write of the running server in flight, as the second start finds it.
    fs::write(d.path().join("999.bkt.tmp"), b"in flight").unwrap();
    let before = listing(d.path());
    let same_addr = first.addr.to_string();
    for listen in [same_addr.as_str(), "127.0.0.1:0"] {
        let (code, err) = run_to_exit(&server_args(d.path(), listen));
        assert!(
            code.is_some_and(|c| c != 0),
            "second server on {listen}: exit {code:?}, stderr {err}"
        );
        assert!(
            err.contains(&d.path().display().to_string()) && err.contains("lock"),
            "the refusal names neither the directory nor the lock: {err}"
        );
        assert_eq!(
            listing(d.path()),
            before,
            "the second server ({listen}) changed the directory"
        );
    }
    fs::remove_file(d.path().join("999.bkt.tmp")).unwrap();
    for i in 10..20 {
        c.put(&a, &format!("k{i}"), &payload(i, 300), persisted())
            .unwrap();
    }
    // SIGKILL: the kernel releases the lock, and a restart finds every acknowledged put.
    kill9(&mut first.child);
    let second = spawn(&server_args(d.path(), "127.0.0.1:0"), None);
    let c = client(second.addr, None);
    for i in 0..20 {
        assert_eq!(
            c.get(&a, &format!("k{i}")).unwrap(),
            payload(i, 300),
            "k{i}"
        );
    }
}

/// In one process too: a second store on a directory in use is a typed error naming it; the
/// lock goes with the first store.
#[test]
fn a_second_store_in_process_is_refused_until_the_first_is_dropped() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    let s = EmbeddedStore::new(cfg(d.path())).unwrap();
    s.put(&a, "k", &payload(1, 100), persisted()).unwrap();
    let before = listing(d.path());
    match EmbeddedStore::new(cfg(d.path())) {
        Err(L3Error::FileOpenFail(m)) => {
            assert!(m.contains(&d.path().display().to_string()), "{m}");
        }
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("two stores opened one SSD directory"),
    }
    assert_eq!(listing(d.path()), before);
    drop(s);
    let s = EmbeddedStore::new(cfg(d.path())).unwrap();
    assert_eq!(s.get(&a, "k").unwrap(), payload(1, 100));
}

/// t4: a stray bucket named with the highest u64 made the next id u64::MAX, and the one after
/// it wrapped to 0: the new bucket was renamed over bucket 0 and its acknowledged key lost.
#[test]
fn a_stray_bucket_with_the_highest_id_never_makes_ids_wrap() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    craft(d.path(), 0, "keep", 0);
    craft(d.path(), 5, "stray", 5);
    let stray = d.path().join(format!("{}.bkt", u64::MAX));
    fs::rename(bucket::bucket_path(d.path(), 5), &stray).unwrap();
    let stray_bytes = fs::read(&stray).unwrap();
    let mut acked = Vec::new();
    {
        let s = EmbeddedStore::new(cfg(d.path())).unwrap();
        assert_eq!(s.get(&a, "stray"), Err(L3Error::ObjectNotFound));
        for i in 1..5 {
            let k = format!("n{i}");
            if s.put(&a, &k, &payload(i, 100), persisted()).is_ok() {
                acked.push((k, i));
            }
        }
        assert_eq!(acked.len(), 4, "the stray file stopped every write");
    }
    let s = EmbeddedStore::new(cfg(d.path())).unwrap();
    assert_eq!(s.get(&a, "keep").unwrap(), payload(0, 100), "keep lost");
    for (k, i) in &acked {
        assert_eq!(
            s.get(&a, k).unwrap(),
            payload(*i, 100),
            "acknowledged {k} lost"
        );
    }
    assert_eq!(
        fs::read(&stray).unwrap(),
        stray_bytes,
        "the stray file changed"
    );
}

/// A `next-bucket-id` near u64::MAX (kvtier never writes one): ids never wrap onto existing
/// buckets; writes fail typed (ids exhausted) and nothing acknowledged is lost.
#[test]
fn a_next_bucket_id_near_the_top_never_makes_ids_wrap() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    craft(d.path(), 0, "keep", 0);
    bucket::write_next_id(d.path(), u64::MAX - 1).unwrap();
    let mut acked = Vec::new();
    {
        let s = EmbeddedStore::new(cfg(d.path())).unwrap();
        for i in 1..5 {
            let k = format!("n{i}");
            match s.put(&a, &k, &payload(i, 100), persisted()) {
                Ok(()) => acked.push((k, i)),
                Err(L3Error::FileWriteFail(m)) => assert!(m.contains("exhausted"), "{m}"),
                Err(e) => panic!("untyped failure {e}"),
            }
        }
        assert_eq!(s.get(&a, "keep").unwrap(), payload(0, 100), "keep lost");
    }
    let s = EmbeddedStore::new(cfg(d.path())).unwrap();
    assert_eq!(s.get(&a, "keep").unwrap(), payload(0, 100), "keep lost");
    for (k, i) in &acked {
        assert_eq!(
            s.get(&a, k).unwrap(),
            payload(*i, 100),
            "acknowledged {k} lost"
        );
    }
}
