//! Hostile clients of the shared-memory path (issue 23): raw requests on the server's Unix
//! socket — unauthenticated, forged descriptors, unsealed or short memfds, unknown or
//! another connection's segment ids, ranges past a segment or overflowing, garbage frames —
//! each answered with a typed error, with nothing read or written outside a registration
//! and the server serving on. Plus a proptest of random ranges against the live server.

mod common;

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use common::procs::{Proc, args, spawn};
use common::shm::{Raw, SEG, all, filled, rng};
use common::{client, payload, t};
use kvtier_l3::rpc::shm::segment::{MAX_SEGMENT_BYTES, Mapping};
use kvtier_l3::rpc::shm::{
    MAX_MAPPED_PER_CONN, ShmOffer, ShmRange, ShmReply, ShmRequest, check_range,
};
use kvtier_l3::rpc::xfer::{read_frame, write_frame};
use kvtier_l3::{L3Error, L3Store, PutOptions, ReplicateConfig};
use proptest::prelude::*;

fn server(token: Option<&str>) -> (Proc, ShmOffer) {
    let p = spawn(
        &args(&["--listen", "127.0.0.1:0", "--segment-bytes", "67108864"]),
        token,
    );
    let c = kvtier_l3::RemoteStore::connect(
        p.addr,
        kvtier_l3::ClientOptions {
            token: token.map(str::to_string),
            ..Default::default()
        },
    )
    .unwrap();
    let offer = c.shm_offer().unwrap().expect("server offers shm");
    (p, offer)
}

impl Raw {
    fn put(&mut self, key: &str, r: ShmRange) -> Result<Vec<Result<(), L3Error>>, L3Error> {
        self.put_reply(&ShmRequest::Put {
            tenant: t("hostile"),
            keys: vec![key.to_string()],
            ranges: vec![r],
            opts: PutOptions::default(),
            cfg: ReplicateConfig::default(),
        })
    }
    fn get(
        &mut self,
        keys: &[&str],
        rs: Vec<ShmRange>,
    ) -> Result<Vec<Result<u64, L3Error>>, L3Error> {
        self.get_reply(&ShmRequest::Get {
            tenant: t("hostile"),
            keys: keys.iter().map(|k| k.to_string()).collect(),
            queries: None,
            ranges: rs,
        })
    }
}

#[test]
fn hostile_requests_get_typed_errors_and_touch_nothing() {
    let (srv, offer) = server(Some("sesame"));
    let store = client(srv.addr, Some("sesame"));
    let tn = t("hostile");
    store
        .put(&tn, "obj", &payload(1, 1000), PutOptions::default())
        .unwrap();

    // No hello, or a wrong token: refused, connection closed.
    let mut s = UnixStream::connect(&offer.path).unwrap();
    write_frame(&mut s, &ShmRequest::Unregister { seg: 1 }).unwrap();
    let r: ShmReply = read_frame(&mut s, 1 << 20).unwrap();
    assert!(matches!(r, ShmReply::Done(Err(L3Error::IllegalClient(_)))));
    let mut s = UnixStream::connect(&offer.path).unwrap();
    write_frame(
        &mut s,
        &ShmRequest::Hello {
            token: Some("nope".into()),
        },
    )
    .unwrap();
    let r: ShmReply = read_frame(&mut s, 1 << 20).unwrap();
    assert!(matches!(r, ShmReply::Hello(Err(L3Error::IllegalClient(_)))));

    let mut a = Raw::open(&offer, Some("sesame"));
    // Forged descriptors: a pipe, an unsealed memfd, a memfd shorter than announced.
    let mut fds = [0i32; 2];
    // SAFETY: pipe into a local array; both ends owned at once.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let (rd, _wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    assert!(matches!(
        a.register(4096, &rd),
        Err(L3Error::InvalidParams(_))
    ));
    // SAFETY: memfd_create with a static name; owned at once.
    let unsealed = unsafe {
        let fd = libc::memfd_create(c"kvtier-shm-unsealed".as_ptr(), libc::MFD_CLOEXEC);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, 4096), 0);
        OwnedFd::from_raw_fd(fd)
    };
    assert!(matches!(
        a.register(4096, &unsealed),
        Err(L3Error::InvalidParams(_))
    ));
    let seg_a = filled(0xAB);
    assert!(matches!(
        a.register(SEG as u64 + 1, seg_a.fd()),
        Err(L3Error::InvalidParams(_))
    ));
    assert!(matches!(
        a.register(0, seg_a.fd()),
        Err(L3Error::InvalidParams(_))
    ));
    let id_a = a.register(SEG as u64, seg_a.fd()).unwrap();

    // Ranges outside the segment, overflowing, or naming an unknown segment: typed errors,
    // the key not created.
    for (r, code) in [
        (rng(id_a, SEG as u64 - 10, 11), -600),
        (rng(id_a, u64::MAX - 4, 10), -600),
        (rng(id_a, SEG as u64, 1), -600),
        (rng(id_a + 77, 0, 10), -601),
    ] {
        let e = a.put("evil", r).unwrap_err();
        assert_eq!(e.code() as i64, code, "{r:?}: {e}");
    }
    assert!(matches!(
        store.get(&tn, "evil"),
        Err(L3Error::ObjectNotFound)
    ));

    // A get with one good and one bad range fails whole: nothing written into the segment.
    let e = a
        .get(
            &["obj", "obj"],
            vec![rng(id_a, 0, 1000), rng(id_a, SEG as u64 - 1, 1000)],
        )
        .unwrap_err();
    assert!(matches!(e, L3Error::InvalidParams(_)));
    assert!(all(&seg_a, 0xAB), "a refused get wrote into the segment");
    // A range too small for the object: -10 for that key, nothing written.
    let v = a.get(&["obj"], vec![rng(id_a, 0, 999)]).unwrap();
    assert!(matches!(
        v[0],
        Err(L3Error::BufferOverflow {
            needed: 1000,
            have: 999
        })
    ));
    assert!(all(&seg_a, 0xAB));

    // Another connection's segment id means nothing on this one.
    let mut b = Raw::open(&offer, Some("sesame"));
    let e = b.get(&["obj"], vec![rng(id_a, 0, 1000)]).unwrap_err();
    assert!(matches!(e, L3Error::IllegalClient(_)));
    assert!(all(&seg_a, 0xAB), "b reached a's segment");
    let e = b.put("evil", rng(id_a, 0, 10)).unwrap_err();
    assert!(matches!(e, L3Error::IllegalClient(_)));
    // Unregistering another connection's (or an unknown) segment: -101, a's still works.
    assert!(matches!(
        b.call(&ShmRequest::Unregister { seg: id_a }),
        ShmReply::Done(Err(L3Error::SegmentNotFound))
    ));
    // Registration without a descriptor: a plain byte where the descriptor should come.
    write_frame(&mut b.0, &ShmRequest::Register { len: 4096 }).unwrap();
    b.0.write_all(&[0]).unwrap();
    let r: ShmReply = read_frame(&mut b.0, 1 << 20).unwrap();
    assert!(matches!(
        r,
        ShmReply::Registered(Err(L3Error::InvalidParams(_)))
    ));

    // a's segment still serves: a get in range writes exactly the object.
    let v = a.get(&["obj"], vec![rng(id_a, 100, 2000)]).unwrap();
    assert_eq!(*v[0].as_ref().unwrap(), 1000);
    // SAFETY: our own mapping, no other reference alive.
    let bytes = unsafe { seg_a.bytes(0, SEG) };
    assert_eq!(&bytes[100..1100], &payload(1, 1000)[..]);
    assert!(
        bytes[..100]
            .iter()
            .chain(&bytes[1100..])
            .all(|&x| x == 0xAB)
    );

    // Address space: at most MAX_MAPPED_PER_CONN per connection (sparse memfds: no memory).
    let mut d = Raw::open(&offer, Some("sesame"));
    let big = MAX_SEGMENT_BYTES as usize;
    let bigs: Vec<Mapping> = (0..5)
        .map(|_| Mapping::create("kvtier-shm-big", big).unwrap())
        .collect();
    let fits = (MAX_MAPPED_PER_CONN / MAX_SEGMENT_BYTES) as usize;
    for (i, m) in bigs.iter().enumerate() {
        let r = d.register(big as u64, m.fd());
        assert_eq!(r.is_ok(), i < fits, "segment {i}: {r:?}");
    }
    drop(d);

    // A garbage frame: a typed error and this connection closes; the server serves on.
    let mut g = UnixStream::connect(&offer.path).unwrap();
    g.write_all(&[5, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF])
        .unwrap();
    let r: ShmReply = read_frame(&mut g, 1 << 20).unwrap();
    assert!(matches!(r, ShmReply::Done(Err(L3Error::InvalidParams(_)))));
    let mut c = Raw::open(&offer, Some("sesame"));
    let seg_c = filled(0);
    let id_c = c.register(SEG as u64, seg_c.fd()).unwrap();
    assert_eq!(
        c.get(&["obj"], vec![rng(id_c, 0, 1000)]).unwrap()[0]
            .as_ref()
            .unwrap(),
        &1000
    );
    assert_eq!(store.get(&tn, "obj").unwrap(), payload(1, 1000));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    /// Random (segment, offset, length) triples against the live server: accepted exactly
    /// when `check_range` accepts them, and a write never lands outside its range.
    #[test]
    fn random_ranges_never_escape(cases in prop::collection::vec((0u32..3, any::<u64>(), 0u64..2048, any::<bool>()), 12)) {
        let (srv, offer) = SERVER.with(|s| s.clone());
        let _ = srv;
        let mut a = Raw::open(&offer, None);
        let seg = filled(0x5A);
        let id = a.register(SEG as u64, seg.fd()).unwrap();
        for (which, off, len, near_end) in cases {
            let off = if near_end { SEG as u64 - (off % 4096) } else { off };
            let sid = if which == 0 { id + 1 } else { id };
            let want = if sid == id { check_range(SEG as u64, off, len).is_ok() } else { false };
            let r = a.get(&["small"], vec![rng(sid, off, len)]);
            prop_assert_eq!(r.is_ok(), want, "{} {} {}", sid, off, len);
            // SAFETY: our own mapping, no other reference alive.
            let bytes = unsafe { seg.bytes(0, SEG) };
            let written = match &r { Ok(v) => v[0].as_ref().map_or(0, |n| *n as usize), Err(_) => 0 };
            let start = if written > 0 { off as usize } else { 0 };
            for (i, &x) in bytes.iter().enumerate() {
                if !(written > 0 && i >= start && i < start + written) {
                    prop_assert_eq!(x, 0x5A, "byte {} changed", i);
                }
            }
            // SAFETY: as above.
            unsafe { seg.bytes_mut(0, SEG) }.fill(0x5A);
        }
    }
}

thread_local! {
    static SERVER: (std::sync::Arc<Proc>, ShmOffer) = {
        let (p, o) = server(None);
        let c = client(p.addr, None);
        c.put(&t("hostile"), "small", &payload(3, 700), PutOptions::default()).unwrap();
        (std::sync::Arc::new(p), o)
    };
}

/// `ShmRequest`'s first variants as a hostile client can frame them: the same encoding,
/// with the tenant any string.
#[derive(serde::Serialize)]
#[allow(dead_code)]
enum Forged {
    Hello {
        token: Option<String>,
    },
    Register {
        len: u64,
    },
    Unregister {
        seg: u32,
    },
    Put {
        tenant: String,
        keys: Vec<String>,
        ranges: Vec<ShmRange>,
        opts: PutOptions,
        cfg: ReplicateConfig,
    },
}

fn ssd_server(dir: &std::path::Path) -> (Proc, ShmOffer) {
    let p = spawn(
        &args(&[
            "--listen",
            "127.0.0.1:0",
            "--segment-bytes",
            "67108864",
            "--ssd-dir",
            &dir.display().to_string(),
        ]),
        None,
    );
    let offer = client(p.addr, None)
        .shm_offer()
        .unwrap()
        .expect("server offers shm");
    (p, offer)
}

/// Issue 33: a raw `Put` on the shared-memory socket named any tenant — empty, with '/',
/// or 70,000 bytes, which the SSD record header cut to 16 bits: the bucket it landed in
/// was corrupt, and at the next restart another tenant's SSD copies dropped from 120 to
/// 16. Each is refused with a typed -600 now, nothing is stored, and every copy of the
/// other tenant comes back after a restart.
#[test]
fn a_bad_tenant_name_is_refused_and_no_other_tenant_loses_ssd_data() {
    let dir = tempfile::tempdir().unwrap();
    let (mut srv, offer) = ssd_server(dir.path());
    let victim = t("victim");
    let store = client(srv.addr, None);
    let put_batch = |from: usize| {
        let keys: Vec<String> = (from..from + 60).map(|i| format!("k{i}")).collect();
        let data: Vec<Vec<u8>> = (from..from + 60).map(|i| payload(i, 3000)).collect();
        let bufs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        for r in store
            .batch_put_from(&victim, &keys, &bufs, PutOptions::default())
            .unwrap()
        {
            r.unwrap();
        }
    };
    put_batch(0);
    let seg = filled(0x33);
    let mut replies = Vec::new();
    for bad in [
        String::new(),
        "a/b".to_string(),
        "nul\0".to_string(),
        "line\nbreak=1".to_string(),
        "x".repeat(70_000),
    ] {
        let mut raw = Raw::open(&offer, None);
        let id = raw.register(SEG as u64, seg.fd()).unwrap();
        write_frame(
            &mut raw.0,
            &Forged::Put {
                tenant: bad.clone(),
                keys: vec!["evil".into()],
                ranges: vec![rng(id, 0, 4096)],
                opts: PutOptions::default(),
                cfg: ReplicateConfig::default(),
            },
        )
        .unwrap();
        let r: ShmReply = read_frame(&mut raw.0, 1 << 20).unwrap();
        replies.push((bad.chars().take(16).collect::<String>(), r));
    }
    put_batch(60);
    // SIGTERM flushes every queued SSD write; the restart rescans the buckets.
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(srv.child.id() as libc::pid_t, libc::SIGTERM) };
    assert!(srv.child.wait().unwrap().success());
    drop(srv);
    let (srv, _) = ssd_server(dir.path());
    let store = client(srv.addr, None);
    let back = (0..120)
        .filter(|&i| store.get(&victim, &format!("k{i}")).ok() == Some(payload(i, 3000)))
        .count();
    assert_eq!(back, 120, "the victim's SSD copies after a restart");
    for (bad, r) in replies {
        let e = match r {
            ShmReply::Done(Err(e)) | ShmReply::Put(Err(e)) => e,
            other => panic!("tenant {bad:?}: accepted: {other:?}"),
        };
        assert!(
            matches!(&e, L3Error::InvalidParams(m) if m.contains("tenant name")),
            "tenant {bad:?}: {e}"
        );
    }
}
