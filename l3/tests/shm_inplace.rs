//! In-place copies on the shared-memory path (issue 23): a real `kvtier-l3` process reads
//! and writes plain caller buffers of this process with `process_vm_readv`/`writev`.
//! Byte-for-byte agreement with staging and TCP; hostile numbers (unmapped, overflowing,
//! half-mapped, read-only, unmapped mid-call) answered with typed errors and nothing made
//! visible; a client killed mid-batch leaks nothing; staging unless asked; the fallback when the
//! probe fails (for real: a server running as another uid).

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::procs::{Proc, args, kill9, spawn, test_child};
use common::shm::Raw;
use common::{payload, t};
use kvtier_l3::rpc::shm::{RemoteBuf, ShmReply, ShmRequest};
use kvtier_l3::{L3Error, L3Store, PutOptions, RemoteStore, ReplicateConfig, ShmMode};
use proptest::prelude::*;

const CHILD_ENV: &str = "KVTIER_INPLACE_TEST_CHILD";

fn connect(addr: SocketAddr, shm: ShmMode) -> RemoteStore {
    common::shm::shm_client(addr, shm, 1 << 20)
}

fn server() -> Proc {
    spawn(
        &args(&["--listen", "127.0.0.1:0", "--segment-bytes", "268435456"]),
        None,
    )
}

fn child() -> bool {
    std::env::var(CHILD_ENV).is_ok()
}

/// Reads every key with each client; all must agree with `data` (and with each other on
/// per-key results), nothing written past an object.
fn read_back(clients: &[&RemoteStore], tn: &kvtier_l3::Tenant, keys: &[String], data: &[Vec<u8>]) {
    let mut results = Vec::new();
    for c in clients {
        // Odd offsets inside one allocation: unaligned destinations.
        let total: usize = data.iter().map(|d| d.len() + 3).sum();
        let mut buf = vec![0xEEu8; total + 1];
        let mut rest = &mut buf[1..];
        let mut dsts = Vec::new();
        for d in data {
            let (a, b) = rest.split_at_mut(d.len() + 3);
            dsts.push(a);
            rest = b;
        }
        let got = c.batch_get_into(tn, keys, &mut dsts).unwrap();
        for ((g, dst), d) in got.iter().zip(&dsts).zip(data) {
            if d.is_empty() {
                // The store refuses empty objects (-600) on every path: never stored.
                assert!(matches!(g, Err(L3Error::ObjectNotFound)), "{g:?}");
                continue;
            }
            assert_eq!(*g.as_ref().unwrap(), d.len() as u64);
            assert_eq!(&dst[..d.len()], &d[..]);
            assert_eq!(&dst[d.len()..], &[0xEE; 3], "written past the object");
        }
        results.push(format!("{got:?}"));
    }
    assert!(results.windows(2).all(|w| w[0] == w[1]));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// Random batches (0 bytes, odd sizes, objects larger than the 1 MiB staging segment)
    /// written by one path and read by all three.
    #[test]
    fn plain_buffers_agree_in_place_staging_and_tcp(
        sizes in proptest::collection::vec(
            prop_oneof![Just(0usize), 1usize..5000, (1usize << 20)..(3 << 20)], 1..10),
        writer in 0usize..3,
        seed in any::<u16>(),
    ) {
        if child() {
            return Ok(());
        }
        let srv = server();
        let inplace = connect(srv.addr, ShmMode::InPlace);
        let staging = connect(srv.addr, ShmMode::Auto);
        let tcp = connect(srv.addr, ShmMode::Off);
        prop_assert!(inplace.uses_shm() && inplace.shm_in_place());
        prop_assert!(staging.uses_shm() && !staging.shm_in_place());
        prop_assert!(!tcp.uses_shm());
        let tn = t("agree");
        let data: Vec<Vec<u8>> = sizes.iter().enumerate()
            .map(|(i, &n)| payload(seed as usize + i, n)).collect();
        let keys: Vec<String> = (0..data.len()).map(|i| format!("k{i}")).collect();
        // Unaligned sources: each object one byte into its own allocation.
        let padded: Vec<Vec<u8>> = data.iter().map(|d| {
            let mut v = vec![0u8; d.len() + 1];
            v[1..].copy_from_slice(d);
            v
        }).collect();
        let srcs: Vec<&[u8]> = padded.iter().map(|v| &v[1..]).collect();
        let w = [&inplace, &staging, &tcp][writer];
        let put = w.batch_put_from(&tn, &keys, &srcs, PutOptions::default()).unwrap();
        for (r, d) in put.iter().zip(&data) {
            if d.is_empty() {
                prop_assert!(matches!(r, Err(L3Error::InvalidParams(_))), "{r:?}");
            } else {
                prop_assert!(r.is_ok(), "{r:?}");
            }
        }
        read_back(&[&inplace, &staging, &tcp], &tn, &keys, &data);
        // A too-small buffer and a missing key: the same typed errors on every path.
        let ks = vec![keys[0].clone(), "absent".to_string()];
        let mut out = Vec::new();
        for c in [&inplace, &staging, &tcp] {
            let mut a = vec![0u8; data[0].len().saturating_sub(1)];
            let mut b = [0u8; 4];
            out.push(format!("{:?}", c.batch_get_into(&tn, &ks, &mut [&mut a[..], &mut b[..]]).unwrap()));
        }
        prop_assert!(out.windows(2).all(|w| w[0] == w[1]), "{out:?}");
    }
}

/// The in-place requests on a raw connection to the server's socket.
impl Raw {
    fn probe(&mut self, lie: bool) -> Result<(), L3Error> {
        let mut buf = [7u8; 32];
        let base = buf.as_mut_ptr() as u64;
        let nonce = if lie { [8u8; 16] } else { [7u8; 16] };
        let r = match self.call(&ShmRequest::Probe {
            addr: base,
            nonce,
            back: base + 16,
        }) {
            ShmReply::Done(r) => r,
            other => panic!("probe: {other:?}"),
        };
        // SAFETY: the server wrote these bytes (or not) before its reply.
        let back: [u8; 16] = unsafe { std::ptr::read_volatile(buf.as_ptr().add(16).cast()) };
        assert_eq!(
            r.is_ok(),
            back == [!7u8; 16],
            "complement written iff the probe passed"
        );
        r
    }
    fn put_at(
        &mut self,
        keys: &[&str],
        bufs: Vec<RemoteBuf>,
    ) -> Result<Vec<Result<(), L3Error>>, L3Error> {
        self.put_reply(&ShmRequest::PutAt {
            tenant: t("hostile"),
            keys: keys.iter().map(|k| k.to_string()).collect(),
            bufs,
            opts: PutOptions::default(),
            cfg: ReplicateConfig::default(),
        })
    }
    fn get_at(
        &mut self,
        keys: &[&str],
        bufs: Vec<RemoteBuf>,
    ) -> Result<Vec<Result<u64, L3Error>>, L3Error> {
        self.get_reply(&ShmRequest::GetAt {
            tenant: t("hostile"),
            keys: keys.iter().map(|k| k.to_string()).collect(),
            queries: None,
            bufs,
        })
    }
}

fn rb(p: *const u8, len: usize) -> RemoteBuf {
    RemoteBuf {
        addr: p as u64,
        len: len as u64,
    }
}

/// `len` bytes of fresh anonymous memory with protection `prot`.
fn map(len: usize, prot: libc::c_int) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p.cast()
}

#[test]
fn hostile_addresses_get_typed_errors_and_change_nothing() {
    if child() {
        return;
    }
    let srv = server();
    let c = connect(srv.addr, ShmMode::Off);
    let offer = c.shm_offer().unwrap().unwrap();
    let tn = t("hostile");
    c.put(&tn, "kept", b"original", PutOptions::default())
        .unwrap();
    let good = payload(1, 4096);

    // Without a probe, or after a failed one, in-place requests are refused.
    let mut r = Raw::open(&offer, None);
    assert!(matches!(
        r.put_at(&["x"], vec![rb(good.as_ptr(), good.len())]),
        Err(L3Error::IllegalClient(_))
    ));
    assert!(
        matches!(r.probe(true), Err(L3Error::Unavailable(_))),
        "a wrong nonce"
    );
    assert!(matches!(
        r.put_at(&["x"], vec![rb(good.as_ptr(), good.len())]),
        Err(L3Error::IllegalClient(_))
    ));
    r.probe(false).unwrap();

    // Overflowing ranges and mismatched lengths: the whole call, before the store.
    for b in [
        RemoteBuf {
            addr: u64::MAX - 10,
            len: 100,
        },
        RemoteBuf {
            addr: 1 << 63,
            len: 1,
        },
    ] {
        assert!(matches!(
            r.put_at(&["x"], vec![b]),
            Err(L3Error::InvalidParams(_))
        ));
        assert!(matches!(
            r.get_at(&["kept"], vec![b]),
            Err(L3Error::InvalidParams(_))
        ));
    }
    assert!(matches!(
        r.put_at(&["x", "y"], vec![rb(good.as_ptr(), 1)]),
        Err(L3Error::InvalidParams(_))
    ));

    // Unmapped, half-mapped (a guard page in the middle) and read-only memory: that key
    // fails with -600, the others in the batch succeed, nothing partial is visible.
    let page = 4096;
    let half = map(2 * page, libc::PROT_READ | libc::PROT_WRITE);
    // SAFETY: the second page of our own mapping.
    assert_eq!(
        unsafe { libc::mprotect(half.add(page).cast(), page, libc::PROT_NONE) },
        0
    );
    let v = r
        .put_at(
            &["unmapped", "halfmapped", "fine"],
            vec![
                rb(16 as *const u8, 100),
                rb(half, 2 * page),
                rb(good.as_ptr(), good.len()),
            ],
        )
        .unwrap();
    assert!(matches!(v[0], Err(L3Error::InvalidParams(_))), "{v:?}");
    assert!(matches!(v[1], Err(L3Error::InvalidParams(_))), "{v:?}");
    v[2].as_ref().unwrap();
    for k in ["unmapped", "halfmapped"] {
        assert!(
            matches!(c.get(&tn, k), Err(L3Error::ObjectNotFound)),
            "{k} visible"
        );
    }
    assert_eq!(c.get(&tn, "fine").unwrap(), good);
    let ro = map(page, libc::PROT_READ);
    let mut ok = vec![0u8; 8];
    let v = r
        .get_at(
            &["kept", "kept", "kept"],
            vec![rb(ro, 8), rb(24 as *const u8, 8), rb(ok.as_mut_ptr(), 8)],
        )
        .unwrap();
    assert!(matches!(v[0], Err(L3Error::InvalidParams(_))), "{v:?}");
    assert!(matches!(v[1], Err(L3Error::InvalidParams(_))), "{v:?}");
    assert_eq!(*v[2].as_ref().unwrap(), 8);
    assert_eq!(ok, b"original");

    // Memory unmapped while the server reads it: the key is whole or absent, never partial.
    let big = 64 << 20;
    for round in 0..4 {
        let m = map(big, libc::PROT_READ | libc::PROT_WRITE);
        let src = payload(round, big);
        // SAFETY: our own fresh mapping of `big` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), m, big) };
        let key = format!("racy{round}");
        let addr = m as usize;
        let unmapper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_micros(500 * round as u64));
            // SAFETY: unmaps the second half of the mapping made above (nothing in this
            // process reads it after; the server's copy gets EFAULT or is already done).
            unsafe { libc::munmap((addr + big / 2) as *mut libc::c_void, big / 2) };
        });
        let v = r.put_at(&[key.as_str()], vec![rb(m, big)]).unwrap();
        unmapper.join().unwrap();
        match &v[0] {
            Ok(()) => assert_eq!(c.get(&tn, &key).unwrap(), src, "round {round}"),
            Err(L3Error::InvalidParams(_)) => {
                assert!(matches!(c.get(&tn, &key), Err(L3Error::ObjectNotFound)))
            }
            other => panic!("round {round}: {other:?}"),
        }
        // SAFETY: the first half is still ours.
        unsafe { libc::munmap(m.cast(), big / 2) };
    }
    // Served on, store unchanged where nothing succeeded, no put left pending.
    assert_eq!(c.get(&tn, "kept").unwrap(), b"original");
    let fresh = connect(srv.addr, ShmMode::InPlace);
    assert!(fresh.shm_in_place());
    fresh
        .put(&tn, "after", &good, PutOptions::default())
        .unwrap();
    assert_eq!(fresh.get(&tn, "after").unwrap(), good);
}

/// The client of [`killed_client_leaks_nothing`]: batches of 16 × 1 MiB plain buffers put
/// and read in place until it is killed.
#[test]
fn child_inplace_client() {
    let Ok(addr) = std::env::var(CHILD_ENV) else {
        return;
    };
    let c = connect(addr.parse().unwrap(), ShmMode::InPlace);
    assert!(c.shm_in_place());
    let tn = t("killed");
    let data: Vec<Vec<u8>> = (0..16).map(|i| payload(i, 1 << 20)).collect();
    let srcs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let mut out: Vec<Vec<u8>> = (0..16).map(|_| vec![0u8; 1 << 20]).collect();
    let mut i = 0u64;
    loop {
        let keys: Vec<String> = (0..16).map(|j| format!("k{}-{j}", i % 4)).collect();
        let _ = c.batch_put_from(&tn, &keys, &srcs, PutOptions::default());
        let mut dsts: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
        let _ = c.batch_get_into(&tn, &keys, &mut dsts);
        let _ = c.remove_all(&tn, true);
        if i == 2 {
            println!("KVTIER-CHILD READY");
        }
        i += 1;
    }
}

#[test]
fn killed_client_leaks_nothing() {
    if child() {
        return;
    }
    let srv = spawn(
        &args(&[
            "--listen",
            "127.0.0.1:0",
            "--segment-bytes",
            "268435456",
            "--lease-ms",
            "200",
        ]),
        None,
    );
    let watcher = connect(srv.addr, ShmMode::Off);
    for round in 0..3 {
        let mut kid = test_child("child_inplace_client", CHILD_ENV, &srv.addr.to_string());
        std::thread::sleep(Duration::from_millis(20 + 35 * round));
        kill9(&mut kid); // mid-batch
    }
    // No put left pending and no lease held: after the lease time every key goes without
    // force, and no memory of the store stays allocated.
    // Waited for, bounded: the lease runs from the killed client's last read, and the server
    // may be slow to reap on a loaded machine.
    let tn = t("killed");
    let start = std::time::Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let removed = watcher.remove_all(&tn, false);
        let s = watcher.stats().unwrap();
        if removed.is_ok() && (s.objects, s.mem_used_bytes) == (0, 0) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "still held 10 s after the kill: {removed:?} {s:?}"
        );
    }
    for j in 0..16 {
        watcher
            .put(&tn, &format!("k0-{j}"), b"again", PutOptions::default())
            .unwrap();
    }
}

#[test]
fn staging_by_default_and_a_server_of_another_uid_falls_back_to_staging() {
    if child() {
        return;
    }
    let srv = server();
    let staged = connect(srv.addr, ShmMode::Auto);
    assert!(
        staged.uses_shm() && !staged.shm_in_place(),
        "in place only when asked"
    );
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: the other-uid server is not tested here");
        return;
    }
    // A real refusal: the server runs as `nobody`, this client as root. Its probe fails
    // (the uid check; the kernel would also refuse nobody reading root's memory) and the
    // client stages, with every byte right.
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    // A copy of the binary in that directory: `nobody` may not traverse the checkout's path
    // (a fresh clone under a 0700 `mktemp -d`).
    let bin = dir.path().join("kvtier-l3");
    std::fs::copy(env!("CARGO_BIN_EXE_kvtier-l3"), &bin).unwrap();
    std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut cmd = Command::new(&bin);
    cmd.current_dir(dir.path())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--segment-bytes",
            "67108864",
            "--shm-dir",
        ])
        .arg(dir.path())
        .env_remove("KVTIER_L3_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    std::os::unix::process::CommandExt::uid(&mut cmd, 65534);
    std::os::unix::process::CommandExt::gid(&mut cmd, 65534);
    let mut nobody = cmd.spawn().unwrap();
    let addr = kvtier_l3::cli::read_listening(nobody.stdout.take().unwrap()).unwrap();
    let c = connect(addr, ShmMode::InPlace);
    assert!(c.uses_shm(), "on the shared-memory path");
    assert!(!c.shm_in_place(), "no in-place copies for another uid");
    let tn = t("nobody");
    let data: Vec<Vec<u8>> = [1usize, 17, 300 << 10]
        .iter()
        .map(|&n| payload(n, n))
        .collect();
    let keys: Vec<String> = (0..3).map(|i| format!("n{i}")).collect();
    let srcs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    for r in c
        .batch_put_from(&tn, &keys, &srcs, PutOptions::default())
        .unwrap()
    {
        r.unwrap();
    }
    let tcp = connect(addr, ShmMode::Off);
    read_back(&[&c, &tcp], &tn, &keys, &data);
    kill9(&mut nobody);
}
