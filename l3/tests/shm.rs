//! The shared-memory data path against a real `kvtier-l3` process on this host (issue 23):
//! chosen automatically, same results as TCP, zero-copy regions, the off switches, and a
//! SIGKILLed client leaving nothing behind in the server.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::procs::{args, eventually, kill9, spawn, test_child};
use common::shm::{mapped_memfds, status_kb};
use common::{payload, t};
use kvtier_l3::{L3Error, L3Store, PutOptions, ShmMode};

const CHILD_ENV: &str = "KVTIER_SHM_TEST_CHILD";

use common::shm::shm_client as connect;

fn server(extra: &[&str]) -> common::procs::Proc {
    let mut a = args(&["--listen", "127.0.0.1:0", "--segment-bytes", "268435456"]);
    a.extend(args(extra));
    spawn(&a, None)
}

#[test]
fn same_host_client_uses_shm_and_agrees_with_tcp() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let srv = server(&[]);
    // A 1 MiB staging segment: the 4 MiB object below cannot be staged (goes over TCP) and
    // the batch of 12 × 200 KiB needs several requests.
    let shm = connect(srv.addr, ShmMode::Auto, 1 << 20);
    let tcp = connect(srv.addr, ShmMode::Off, 1 << 20);
    assert!(shm.uses_shm(), "same host, shm on: the shared-memory path");
    assert!(!tcp.uses_shm());
    let tn = t("shm");
    let sizes = [1usize, 4095, 200 << 10, 200 << 10, 4 << 20];
    let mut keys = Vec::new();
    let mut data = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        keys.push(format!("one-{i}"));
        data.push(payload(i, n));
    }
    for i in 0..12 {
        keys.push(format!("many-{i}"));
        data.push(payload(100 + i, 200 << 10));
    }
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    // Written over shm, read over TCP; then the other way round.
    let half = keys.len() / 2;
    for r in shm
        .batch_put_from(&tn, &keys[..half], &refs[..half], PutOptions::default())
        .unwrap()
    {
        r.unwrap();
    }
    for r in tcp
        .batch_put_from(&tn, &keys[half..], &refs[half..], PutOptions::default())
        .unwrap()
    {
        r.unwrap();
    }
    for reader in [&shm, &tcp] {
        let mut bufs: Vec<Vec<u8>> = data.iter().map(|d| vec![0xEE; d.len() + 3]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        let got = reader.batch_get_into(&tn, &keys, &mut slices).unwrap();
        for ((g, b), d) in got.iter().zip(&bufs).zip(&data) {
            assert_eq!(*g.as_ref().unwrap(), d.len() as u64);
            assert_eq!(&b[..d.len()], &d[..]);
            assert_eq!(&b[d.len()..], &[0xEE; 3], "nothing written past the object");
        }
    }
    // Per-key errors are the same typed ones: a missing key, a buffer too small.
    let mut small = [0u8; 10];
    let mut none = [0u8; 10];
    let ks = ["one-3".to_string(), "absent".to_string()];
    for c in [&shm, &tcp] {
        let v = c
            .batch_get_into(&tn, &ks, &mut [&mut small[..], &mut none[..]])
            .unwrap();
        assert!(
            matches!(v[0], Err(L3Error::BufferOverflow { needed, have: 10 }) if needed == 200 << 10)
        );
        assert!(matches!(v[1], Err(L3Error::ObjectNotFound)));
    }
    // Queries: reads by query result go through shm too.
    let q = shm.batch_query(&tn, &keys[3..5]).unwrap();
    let q: Vec<_> = q.into_iter().map(Result::unwrap).collect();
    let mut b1 = vec![0u8; 200 << 10];
    let mut b2 = vec![0u8; 4 << 20];
    let v = shm
        .batch_get_with_query(&tn, &q, &mut [&mut b1[..], &mut b2[..]])
        .unwrap();
    assert_eq!(*v[0].as_ref().unwrap(), 200 << 10);
    assert_eq!(b1, data[3]);
    assert!(
        shm.uses_shm(),
        "still on shm after the TCP fallback of the big object"
    );
}

#[test]
fn shared_region_moves_in_place() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let srv = server(&[]);
    let c = connect(srv.addr, ShmMode::Auto, 1 << 16);
    let region = c.shared_region(8 << 20).unwrap();
    // SAFETY: the region is ours for its whole length while `region` lives.
    let mem = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), region.len()) };
    let obj = payload(7, 3 << 20); // bigger than the staging segment: only in place fits
    mem[..obj.len()].copy_from_slice(&obj);
    let tn = t("region");
    c.put(&tn, "r", &mem[..obj.len()], PutOptions::default())
        .unwrap();
    let (a, b) = mem.split_at_mut(4 << 20);
    let v = c
        .batch_get_into(&tn, &["r".to_string()], &mut [&mut b[..obj.len()]])
        .unwrap();
    assert_eq!(*v[0].as_ref().unwrap(), obj.len() as u64);
    assert_eq!(&b[..obj.len()], &obj[..]);
    assert_eq!(&a[..obj.len()], &obj[..]);
    // A TCP client sees the same object.
    let tcp = connect(srv.addr, ShmMode::Off, 1 << 16);
    assert_eq!(tcp.get(&tn, "r").unwrap(), obj);
    // Dropping the region unregisters it at the next call; memory elsewhere still works.
    drop(region);
    let mut out = vec![0u8; obj.len()];
    c.get_into(&tn, "r", &mut out).unwrap();
    assert_eq!(out, obj);
}

#[test]
fn off_switches_keep_clients_on_tcp() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let srv = server(&["--no-shm"]);
    let c = connect(srv.addr, ShmMode::Auto, 1 << 20);
    assert_eq!(c.shm_offer().unwrap(), None);
    assert!(!c.uses_shm());
    assert!(matches!(
        c.shared_region(4096),
        Err(L3Error::Unavailable(_))
    ));
    c.put(&t("off"), "k", b"v", PutOptions::default()).unwrap();
    assert_eq!(c.get(&t("off"), "k").unwrap(), b"v");
    // The environment variable turns it off for a server started with it.
    let mut a = args(&["--listen", "127.0.0.1:0"]);
    a.extend(args(&["--segment-bytes", "1048576"]));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"));
    cmd.args(&a)
        .env("KVTIER_L3_SHM", "off")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let addr = kvtier_l3::cli::read_listening(child.stdout.take().unwrap()).unwrap();
    let c = connect(addr, ShmMode::Auto, 1 << 20);
    assert_eq!(c.shm_offer().unwrap(), None);
    kill9(&mut child);
}

/// The client process of [`killed_client_leaks_nothing`]: puts and reads 4 MiB objects
/// over shm (staged and from a shared region) until it is killed.
#[test]
fn child_shm_client() {
    let Ok(addr) = std::env::var(CHILD_ENV) else {
        return;
    };
    let c = connect(addr.parse().unwrap(), ShmMode::Auto, 16 << 20);
    assert!(c.uses_shm());
    let region = c.shared_region(16 << 20).unwrap();
    // SAFETY: the region is ours while `region` lives (the whole loop).
    let mem = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), region.len()) };
    let tn = t("killed");
    let obj = payload(1, 4 << 20);
    mem[..obj.len()].copy_from_slice(&obj);
    let mut i = 0u64;
    loop {
        let k = format!("k{}", i % 8);
        let _ = c.remove(&tn, &k, true);
        let _ = c.put(&tn, &k, &obj, PutOptions::default());
        let _ = c.put(
            &tn,
            &format!("r{}", i % 8),
            &mem[..obj.len()],
            PutOptions::default(),
        );
        let mut buf = vec![0u8; obj.len()];
        let _ = c.get_into(&tn, &k, &mut buf);
        let _ = c.get_into(&tn, &k, &mut mem[8 << 20..12 << 20]);
        if i == 2 {
            println!("KVTIER-CHILD READY");
        }
        i += 1;
    }
}

#[test]
fn killed_client_leaks_nothing() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let srv = server(&["--lease-ms", "200"]);
    let pid = srv.child.id();
    let watcher = connect(srv.addr, ShmMode::Off, 1 << 20);
    std::thread::sleep(Duration::from_millis(200));
    let base_shmem = status_kb(pid, "RssShmem:");
    assert_eq!(mapped_memfds(pid), 0);
    for round in 0..3 {
        let mut kid = test_child("child_shm_client", CHILD_ENV, &srv.addr.to_string());
        // Mapped while it runs: staging and region (the check below can fail).
        assert_eq!(mapped_memfds(pid), 2, "round {round}: segments mapped");
        std::thread::sleep(Duration::from_millis(30 + 40 * round));
        kill9(&mut kid); // mid-transfer
        assert!(
            eventually(Duration::from_secs(5), || mapped_memfds(pid) == 0),
            "round {round}: the server still maps the dead client's segments"
        );
    }
    // The segments' pages leave the server's resident set (waited for: the kernel drops a
    // VMA from `/proc/<pid>/maps` before it has zapped its pages and updated RssShmem).
    let freed = eventually(Duration::from_secs(5), || {
        status_kb(pid, "RssShmem:") <= base_shmem + 1024
    });
    let shmem = status_kb(pid, "RssShmem:");
    assert!(freed, "RssShmem {shmem} kB vs baseline {base_shmem} kB");
    // No put left pending, no lease left held: every key can be removed without force
    // (after the lease time) and written again.
    let tn = t("killed");
    std::thread::sleep(Duration::from_millis(300));
    watcher.remove_all(&tn, false).unwrap();
    assert_eq!(watcher.stats().unwrap().objects, 0);
    for i in 0..8 {
        watcher
            .put(&tn, &format!("k{i}"), b"again", PutOptions::default())
            .unwrap();
        watcher
            .put(&tn, &format!("r{i}"), b"again", PutOptions::default())
            .unwrap();
    }
}

/// Sets a file's modification time `secs` into the past.
fn age(path: &std::path::Path, secs: i64) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let t = libc::timespec {
        tv_sec: now - secs,
        tv_nsec: 0,
    };
    // SAFETY: a valid C path and two timespecs.
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), [t, t].as_ptr(), 0) };
    assert_eq!(rc, 0);
}

#[test]
fn a_starting_server_removes_only_dead_servers_sockets() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("kvtier-l3-1-dead.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead).unwrap()); // file stays, nobody listens
    let live_path = dir.path().join("kvtier-l3-2-live.sock");
    let _live = std::os::unix::net::UnixListener::bind(&live_path).unwrap();
    let young = dir.path().join("kvtier-l3-3-young.sock");
    drop(std::os::unix::net::UnixListener::bind(&young).unwrap());
    let other = dir.path().join("not-ours.sock");
    drop(std::os::unix::net::UnixListener::bind(&other).unwrap());
    for p in [&dead, &live_path, &other] {
        age(p, 3600);
    }
    let d = dir.path().display().to_string();
    let srv = server(&["--shm-dir", &d]);
    assert!(!dead.exists(), "a dead server's socket stays");
    assert!(live_path.exists() && young.exists() && other.exists());
    let c = connect(srv.addr, ShmMode::Auto, 1 << 20);
    assert!(c.uses_shm());
    let offer = c.shm_offer().unwrap().unwrap();
    assert!(offer.path.starts_with(&d));
    drop(c);
    drop(srv); // SIGKILL: its socket file stays behind
    assert!(std::path::Path::new(&offer.path).exists());
}

/// Many requests per batch (a 256 KiB staging segment: 128 KiB halves, one or two objects
/// per request, alternating halves, pipelined): every byte and every per-key result equals
/// what a TCP client gets, mixed with in-place buffers of a shared region.
#[test]
fn pipelined_chunks_agree_with_tcp() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let srv = server(&[]);
    let shm = connect(srv.addr, ShmMode::Auto, 256 << 10);
    let tcp = connect(srv.addr, ShmMode::Off, 256 << 10);
    let region = shm.shared_region(1 << 20).unwrap();
    // SAFETY: the region is ours for its whole length while `region` lives.
    let mem = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), region.len()) };
    let tn = t("pipe");
    let sizes: Vec<usize> = (0..24).map(|i| 1 + (i * 37_813) % (120 << 10)).collect();
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| payload(i, n))
        .collect();
    let keys: Vec<String> = (0..sizes.len()).map(|i| format!("p{i}")).collect();
    // Every third object is put from the region (in place), the rest staged.
    let mut at = 0;
    let mut srcs: Vec<&[u8]> = Vec::new();
    let (reg, _) = mem.split_at_mut(1 << 20);
    let mut placed = Vec::new();
    for (i, d) in data.iter().enumerate() {
        if i % 3 == 0 && at + d.len() <= reg.len() {
            reg[at..at + d.len()].copy_from_slice(d);
            placed.push(Some(at));
            at += d.len();
        } else {
            placed.push(None);
        }
    }
    for (i, d) in data.iter().enumerate() {
        srcs.push(match placed[i] {
            // SAFETY: a part of the region written above, read only while the put runs.
            Some(a) => unsafe { std::slice::from_raw_parts(region.as_ptr().add(a), d.len()) },
            None => d,
        });
    }
    for r in shm
        .batch_put_from(&tn, &keys, &srcs, PutOptions::default())
        .unwrap()
    {
        r.unwrap();
    }
    // Reads with a missing key and a too-small buffer in the middle.
    let mut ks = keys.clone();
    ks[7] = "missing".into();
    let caps: Vec<usize> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| if i == 11 { n - 1 } else { n })
        .collect();
    let mut a: Vec<Vec<u8>> = caps.iter().map(|&n| vec![0u8; n]).collect();
    let mut b: Vec<Vec<u8>> = caps.iter().map(|&n| vec![0u8; n]).collect();
    let ra = shm
        .batch_get_into(
            &tn,
            &ks,
            &mut a.iter_mut().map(|v| &mut v[..]).collect::<Vec<_>>(),
        )
        .unwrap();
    let rb = tcp
        .batch_get_into(
            &tn,
            &ks,
            &mut b.iter_mut().map(|v| &mut v[..]).collect::<Vec<_>>(),
        )
        .unwrap();
    assert_eq!(format!("{ra:?}"), format!("{rb:?}"));
    assert!(matches!(ra[7], Err(L3Error::ObjectNotFound)));
    assert!(matches!(ra[11], Err(L3Error::BufferOverflow { .. })));
    for i in (0..keys.len()).filter(|&i| i != 7 && i != 11) {
        assert_eq!(a[i], data[i], "object {i}");
        assert_eq!(b[i], data[i]);
    }
    assert!(shm.uses_shm());
}
