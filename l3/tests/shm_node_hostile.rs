//! Hostile clients of a store node's shared-memory socket (issue 23), with real processes
//! (a `--role master` and a `--role node` with a token): raw requests — unauthenticated,
//! forged segment ids, another connection's segment, ranges past a registration or
//! overflowing, another tenant's descriptor, a handle naming another node's memory, data of
//! the wrong size, the embedded store's requests, garbage — each answered with a typed
//! error, nothing read or written outside a registration, and the node serving on. (A
//! stale epoch over the node's shared memory: `tests/failover_put.rs`, whose client writes
//! through it.)

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;

use common::procs::{master, node_with};
use common::shm::{Raw, SEG, all, filled, rng};
use common::{client, payload, t};
use kvtier_l3::rpc::shm::{ShmOffer, ShmRange, ShmReply, ShmRequest};
use kvtier_l3::rpc::xfer::{XferClient, read_frame, write_frame};
use kvtier_l3::{
    L3Error, L3Store, PutHandle, PutOptions, ReplicaDescriptor, ReplicateConfig, SegmentId, Tenant,
};

const TOKEN: &str = "sesame";

impl Raw {
    fn node_read(
        &mut self,
        tenant: &Tenant,
        keys: &[&str],
        replicas: &[ReplicaDescriptor],
        ranges: Vec<ShmRange>,
    ) -> Result<Vec<Result<u64, L3Error>>, L3Error> {
        match self.call(&ShmRequest::NodeRead {
            tenant: tenant.clone(),
            keys: keys.iter().map(|k| k.to_string()).collect(),
            replicas: replicas.to_vec(),
            ranges,
        }) {
            ShmReply::Get(r) => r,
            other => panic!("node read: {other:?}"),
        }
    }

    fn node_put(
        &mut self,
        h: &PutHandle,
        r: ShmRange,
        end: bool,
    ) -> Result<Vec<Result<(), L3Error>>, L3Error> {
        match self.call(&ShmRequest::NodePut {
            handles: vec![h.clone()],
            ranges: vec![r],
            end: end.then(PutOptions::default),
        }) {
            ShmReply::Put(r) => r,
            other => panic!("node put: {other:?}"),
        }
    }
}

#[test]
fn hostile_requests_to_a_nodes_socket_get_typed_errors_and_touch_nothing() {
    let m = master(&[], Some(TOKEN));
    let n = node_with(m.addr, 1, None, Some(TOKEN), &[]);
    let store = client(m.addr, Some(TOKEN));
    let (ta, tb) = (t("alice"), t("bob"));
    store
        .put(&ta, "obj", &payload(1, 1000), PutOptions::default())
        .unwrap();
    store
        .put(&tb, "secret", &payload(2, 1000), PutOptions::default())
        .unwrap();
    let desc = |tn: &Tenant, k: &str| store.get_replica_list(tn, k).unwrap().replicas[0].clone();
    let (obj, secret) = (desc(&ta, "obj"), desc(&tb, "secret"));
    let offer: ShmOffer = XferClient::connect(
        n.addr,
        Some(TOKEN.into()),
        1 << 20,
        std::time::Duration::from_secs(30),
    )
    .unwrap()
    .shm_offer()
    .unwrap()
    .expect("the node offers shared memory");

    // No hello, or a wrong token: refused, connection closed.
    let mut s = UnixStream::connect(&offer.path).unwrap();
    write_frame(&mut s, &ShmRequest::Unregister { seg: 1 }).unwrap();
    let r: ShmReply = read_frame(&mut s, 1 << 20).unwrap();
    assert!(matches!(r, ShmReply::Done(Err(L3Error::IllegalClient(_)))));
    let mut s = UnixStream::connect(&offer.path).unwrap();
    let bad = ShmRequest::Hello {
        token: Some("nope".into()),
    };
    write_frame(&mut s, &bad).unwrap();
    let r: ShmReply = read_frame(&mut s, 1 << 20).unwrap();
    assert!(matches!(r, ShmReply::Hello(Err(L3Error::IllegalClient(_)))));

    let mut a = Raw::open(&offer, Some(TOKEN));
    let seg = filled(0xAB);
    let id = a.register(SEG as u64, seg.fd()).unwrap();
    // The control: a read by a descriptor of the caller's tenant lands in its range.
    let v = a.node_read(
        &ta,
        &["obj"],
        std::slice::from_ref(&obj),
        vec![rng(id, 0, 1000)],
    );
    assert_eq!(v.unwrap()[0].as_ref().unwrap(), &1000);
    // SAFETY: our own mapping, no other reference alive.
    assert_eq!(unsafe { seg.bytes(0, 1000) }, &payload(1, 1000)[..]);
    // SAFETY: as above.
    unsafe { seg.bytes_mut(0, SEG) }.fill(0xAB);

    // Another tenant's descriptor (with its key, or with ours): a miss, nothing written.
    for (tn, key, d) in [
        (&ta, "secret", &secret),
        (&ta, "obj", &secret),
        (&tb, "obj", &obj),
    ] {
        let v = a.node_read(tn, &[key], std::slice::from_ref(d), vec![rng(id, 0, 1000)]);
        assert!(
            matches!(v.unwrap()[0], Err(L3Error::ObjectNotFound)),
            "{key}"
        );
        assert!(all(&seg, 0xAB), "another tenant's bytes were written");
    }
    // Ranges past the registration, overflowing, or naming an unknown segment: the whole
    // read fails typed (-600 / -601) with nothing written.
    for (r, code) in [
        (rng(id, SEG as u64 - 10, 1000), -600),
        (rng(id, u64::MAX - 4, 1000), -600),
        (rng(id + 77, 0, 1000), -601),
    ] {
        let two = [obj.clone(), obj.clone()];
        let e = a
            .node_read(&ta, &["obj", "obj"], &two, vec![rng(id, 0, 1000), r])
            .unwrap_err();
        assert_eq!(e.code() as i64, code, "{r:?}: {e}");
        assert!(all(&seg, 0xAB), "a refused read wrote into the segment");
    }
    // A range too small for the object: -10 for that key, nothing written.
    let v = a.node_read(
        &ta,
        &["obj"],
        std::slice::from_ref(&obj),
        vec![rng(id, 0, 999)],
    );
    assert!(matches!(
        v.unwrap()[0],
        Err(L3Error::BufferOverflow {
            needed: 1000,
            have: 999
        })
    ));
    assert!(all(&seg, 0xAB));
    // Another connection's segment id means nothing on this one.
    let mut b = Raw::open(&offer, Some(TOKEN));
    let e = b
        .node_read(
            &ta,
            &["obj"],
            std::slice::from_ref(&obj),
            vec![rng(id, 0, 1000)],
        )
        .unwrap_err();
    assert!(matches!(e, L3Error::IllegalClient(_)));
    assert!(all(&seg, 0xAB), "b reached a's segment");

    // Puts: a handle the master gave, with bytes from ranges that are wrong in every way.
    let h = store.put_start(&ta, "evil", 100).unwrap();
    // SAFETY: our own mapping, no other reference alive.
    unsafe { seg.bytes_mut(0, 100) }.copy_from_slice(&payload(5, 100));
    for (r, code) in [
        (rng(id, SEG as u64 - 50, 100), -600),
        (rng(id, u64::MAX, 100), -600),
        (rng(id + 1, 0, 100), -601),
    ] {
        let e = a.node_put(&h, r, true).unwrap_err();
        assert_eq!(e.code() as i64, code, "{r:?}: {e}");
        assert_eq!(
            b.node_put(&h, rng(id, 0, 100), true)
                .unwrap_err()
                .code_i32(),
            -601
        );
    }
    // Bytes of the wrong size, or a handle forged to name another node's segment: refused
    // for that key, nothing held.
    let v = a.node_put(&h, rng(id, 0, 99), true).unwrap();
    assert!(matches!(v[0], Err(L3Error::InvalidParams(_))), "{v:?}");
    let mut forged = h.clone();
    if let ReplicaDescriptor::Memory { segment, .. } = &mut forged.replica {
        *segment = SegmentId(99);
    }
    let v = a.node_put(&forged, rng(id, 0, 100), true).unwrap();
    assert!(matches!(v[0], Err(L3Error::InvalidParams(_))), "{v:?}");
    assert!(store.get(&ta, "evil").is_err(), "a refused put is readable");
    // The same handle with a valid range: written and ended, readable by anyone of alice.
    let v = a.node_put(&h, rng(id, 0, 100), true).unwrap();
    assert!(v[0].is_ok(), "{v:?}");
    assert_eq!(store.get(&ta, "evil").unwrap(), payload(5, 100));

    // The embedded store's requests are not a node's: a typed -1010.
    let r = a.call(&ShmRequest::Put {
        tenant: ta.clone(),
        keys: vec!["x".into()],
        ranges: vec![rng(id, 0, 10)],
        opts: PutOptions::default(),
        cfg: ReplicateConfig::default(),
    });
    assert!(
        matches!(r, ShmReply::Put(Err(L3Error::Unavailable(_)))),
        "{r:?}"
    );
    let r = a.call(&ShmRequest::Get {
        tenant: ta.clone(),
        keys: vec!["obj".into()],
        queries: None,
        ranges: vec![rng(id, 0, 1000)],
    });
    assert!(
        matches!(r, ShmReply::Get(Err(L3Error::Unavailable(_)))),
        "{r:?}"
    );

    // A garbage frame: a typed error, that connection closes; the node serves on.
    let mut g = UnixStream::connect(&offer.path).unwrap();
    g.write_all(&[5, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF])
        .unwrap();
    let r: ShmReply = read_frame(&mut g, 1 << 20).unwrap();
    assert!(matches!(r, ShmReply::Done(Err(L3Error::InvalidParams(_)))));
    // SAFETY: our own mapping, no other reference alive.
    unsafe { seg.bytes_mut(0, SEG) }.fill(0);
    let v = a.node_read(
        &ta,
        &["obj"],
        std::slice::from_ref(&obj),
        vec![rng(id, 0, 1000)],
    );
    assert_eq!(v.unwrap()[0].as_ref().unwrap(), &1000);
    // SAFETY: as above.
    assert_eq!(unsafe { seg.bytes(0, 1000) }, &payload(1, 1000)[..]);
    assert_eq!(store.get(&tb, "secret").unwrap(), payload(2, 1000));
}
