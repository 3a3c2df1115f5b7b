//! The SSD tier of a real `kvtier-l3` process under the limits a host sets: a file size
//! limit (`RLIMIT_FSIZE`) and a descriptor limit (`RLIMIT_NOFILE`). Real files in temporary
//! directories, real processes (the limits set between fork and exec).
//!
//! Why (found by an adversarial tester): a bucket written past `RLIMIT_FSIZE` raised
//! SIGXFSZ, whose default action killed the server (and left its `.bkt.tmp`); the tier kept
//! a descriptor open for every bucket it had read until the bucket was deleted, so under
//! `nofile` 256 with 400 buckets read back the server sat at 255 descriptors, a quarter of
//! the reads failed on every pass and new clients could not connect.

use std::time::Duration;

mod common;

use common::raw::{Server, TOKEN};
use common::{payload, persisted, t};
use kvtier_l3::{ClientOptions, L3Error, L3Store, PutOptions, RemoteStore, ShmMode};

fn client(s: &Server) -> RemoteStore {
    RemoteStore::connect(
        s.addr,
        ClientOptions {
            token: Some(TOKEN.into()),
            rpc_timeout: Duration::from_secs(60),
            shm: ShmMode::Off,
            ..Default::default()
        },
    )
    .unwrap()
}

/// The temporary bucket files left in `dir`.
fn tmp_files(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".tmp"))
        .collect()
}

#[test]
fn a_bucket_past_the_file_size_limit_fails_and_the_server_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let mut s = Server::spawn_limited(
        &["--ssd-dir", &d],
        false,
        &[(libc::RLIMIT_FSIZE, 1_000_000)],
    );
    let c = client(&s);
    let a = t("a");
    c.put(&a, "small", &payload(0, 1000), persisted()).unwrap();
    // One object of 1.5 MiB: its bucket passes the 1,000,000-byte limit.
    let big = payload(1, 3 << 19);
    let r = c.put(&a, "big", &big, persisted());
    assert!(
        s.child.try_wait().unwrap().is_none(),
        "the server died writing a bucket past RLIMIT_FSIZE: {:?} (put: {r:?})",
        s.child.try_wait()
    );
    assert!(matches!(r, Err(L3Error::FileWriteFail(_))), "{r:?}");
    // Nothing of the failed bucket is left, the DRAM copy is served, the tier still works.
    assert_eq!(tmp_files(dir.path()), Vec::<String>::new());
    assert_eq!(c.get(&a, "big").unwrap(), big);
    c.put(&a, "after", &payload(2, 1000), persisted()).unwrap();
    assert_eq!(c.get(&a, "small").unwrap(), payload(0, 1000));
    c.put(&a, "dram", &payload(3, 10), PutOptions::default())
        .unwrap();
}

#[test]
fn reading_back_more_buckets_than_descriptors_keeps_few_open() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let nofile = 256;
    let s = Server::spawn_limited(
        &["--ssd-dir", &d, "--segment-bytes", "4194304"],
        false,
        &[(libc::RLIMIT_NOFILE, nofile)],
    );
    let c = client(&s);
    let a = t("a");
    // One bucket per object (each put waits for its own), 64 KiB each: a 4 MiB segment
    // keeps the last few dozen, the rest are read from SSD.
    let n = 500;
    for i in 0..n {
        c.put(&a, &format!("k{i}"), &payload(i, 64 << 10), persisted())
            .unwrap();
    }
    let base = s.fds();
    let mut most = base;
    for pass in 0..2 {
        for i in 0..n {
            let got = c.get(&a, &format!("k{i}"));
            let ok = matches!(&got, Ok(b) if *b == payload(i, 64 << 10));
            assert!(
                ok,
                "pass {pass}, k{i}: {} with {} descriptors open",
                got.as_ref()
                    .err()
                    .map_or("wrong bytes".into(), |e| e.to_string()),
                s.fds()
            );
            if i % 50 == 0 {
                most = most.max(s.fds());
            }
        }
    }
    most = most.max(s.fds());
    assert!(
        most < (nofile / 2) as usize,
        "{most} descriptors open reading {n} buckets (limit {nofile}, {base} before)"
    );
    // A new client still connects and reads.
    let c2 = client(&s);
    assert_eq!(c2.get(&a, "k0").unwrap(), payload(0, 64 << 10));
}
