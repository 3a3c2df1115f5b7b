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
use std::sync::mpsc;
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

/// t3: directories named like buckets, tombstones and temporary files made startup fail
/// (-1101 "Is a directory"); they are skipped and left alone, and never collide with a new id.
#[test]
fn directories_named_like_buckets_are_skipped_and_left_alone() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    craft(d.path(), 0, "keep", 0);
    for name in ["3.bkt", "4.tomb", "0.tomb.x", "7.bkt.tmp"] {
        fs::create_dir(d.path().join(name)).unwrap();
        fs::write(d.path().join(name).join("inner"), b"x").unwrap();
    }
    // A directory as the tombstone of a bucket (bucket 1): its tombstones cannot be read.
    craft(d.path(), 1, "other", 1);
    fs::create_dir(d.path().join("1.tomb")).unwrap();
    {
        let s = EmbeddedStore::new(cfg(d.path())).expect("startup failed");
        assert_eq!(s.get(&a, "keep").unwrap(), payload(0, 100));
        s.put(&a, "new", &payload(9, 100), persisted()).unwrap();
    }
    let s = EmbeddedStore::new(cfg(d.path())).expect("restart failed");
    assert_eq!(s.get(&a, "keep").unwrap(), payload(0, 100));
    assert_eq!(s.get(&a, "new").unwrap(), payload(9, 100));
    for name in ["3.bkt", "4.tomb", "7.bkt.tmp"] {
        assert!(
            d.path().join(name).join("inner").is_file(),
            "{name} touched"
        );
    }
    assert!(d.path().join("1.tomb").is_dir(), "1.tomb touched");
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
}

/// t5: a FIFO named like a bucket hung startup forever (opened with no file-type check).
#[test]
fn fifos_named_like_buckets_never_hang_startup() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    craft(d.path(), 0, "keep", 0);
    craft(d.path(), 1, "other", 1);
    for name in ["5.bkt", "1.tomb", "next-bucket-id"] {
        mkfifo(&d.path().join(name));
    }
    let dir = d.path().to_path_buf();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = EmbeddedStore::new(cfg(&dir)).map(|s| {
            let ok = s.get(&t("a"), "keep");
            let put = s.put(&t("a"), "new", &payload(9, 100), persisted());
            (ok, put)
        });
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    let (got, put) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("startup hangs on a FIFO")
        .expect("startup failed");
    assert_eq!(got.unwrap(), payload(0, 100));
    put.unwrap();
    let s = EmbeddedStore::new(cfg(d.path())).unwrap();
    assert_eq!(s.get(&a, "new").unwrap(), payload(9, 100));
    for name in ["5.bkt", "1.tomb"] {
        let ty = fs::symlink_metadata(d.path().join(name))
            .unwrap()
            .file_type();
        assert!(!ty.is_file() && !ty.is_dir(), "{name} replaced");
    }
}

/// t3: a symlinked tombstone made the server truncate a file outside the directory; a
/// symlinked bucket or temporary file must not be read, served or followed either.
#[test]
fn symlinks_in_the_dir_are_never_followed() {
    let d = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let a = t("a");
    craft(d.path(), 0, "keep", 0);
    // Outside files: 11 bytes (a torn tombstone length), and a valid foreign bucket.
    let victim = out.path().join("victim.txt");
    fs::write(&victim, b"hello world").unwrap();
    craft(out.path(), 2, "foreign", 2);
    let foreign = bucket::bucket_path(out.path(), 2);
    let foreign_bytes = fs::read(&foreign).unwrap();
    std::os::unix::fs::symlink(&victim, d.path().join("0.tomb")).unwrap();
    std::os::unix::fs::symlink(&foreign, d.path().join("2.bkt")).unwrap();
    std::os::unix::fs::symlink(&victim, d.path().join("8.bkt.tmp")).unwrap();
    std::os::unix::fs::symlink(&victim, d.path().join("next-bucket-id.tmp")).unwrap();
    {
        let s = EmbeddedStore::new(cfg(d.path())).expect("startup failed");
        assert_eq!(s.get(&a, "foreign"), Err(L3Error::ObjectNotFound));
        s.put(&a, "new", &payload(9, 100), persisted()).unwrap();
    }
    assert_eq!(
        fs::read(&victim).unwrap(),
        b"hello world",
        "a file outside the directory was changed"
    );
    assert_eq!(fs::read(&foreign).unwrap(), foreign_bytes);
    for name in ["0.tomb", "2.bkt", "8.bkt.tmp"] {
        assert!(
            fs::symlink_metadata(d.path().join(name))
                .unwrap()
                .file_type()
                .is_symlink(),
            "{name} removed"
        );
    }
    let s = EmbeddedStore::new(cfg(d.path())).unwrap();
    assert_eq!(s.get(&a, "new").unwrap(), payload(9, 100));
    assert_eq!(s.get(&a, "foreign"), Err(L3Error::ObjectNotFound));
}
