//! A shared-memory call that timed out leaves its request with the server, which may still
//! serve it: the staging segment the request named must not be what the client's next
//! connection writes other keys' bytes into.
//!
//! Real parts: an `EmbeddedStore` served by a real `ShmServer` on a Unix socket, a real
//! `ShmClient` with memfd segments. The store is wrapped in a handler that holds the first
//! put back (a server busy with it past the client's timeout: a paused or overloaded
//! process) until the test lets it go.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvtier_l3::rpc::shm::{
    SegTable, ShmClient, ShmHandler, ShmOutcome, ShmReply, ShmRequest, ShmServer,
};
use kvtier_l3::{
    EmbeddedStore, L3Error, L3Store, PutOptions, ReplicateConfig, ShmMode, StoreConfig, Tenant,
};

/// The embedded store, with its first put (or first get: `gets`) held until
/// [`Gated::release`].
struct Gated {
    store: EmbeddedStore,
    first: AtomicBool,
    /// Hold the first get rather than the first put.
    gets: bool,
    /// (released, the held put is served)
    state: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl Gated {
    fn release(&self) {
        self.state.lock().unwrap().0 = true;
        self.cv.notify_all();
    }

    /// Waits (at most 30 s) until the held put was served.
    fn wait_served(&self) -> bool {
        let g = self.state.lock().unwrap();
        let (g, _) = self
            .cv
            .wait_timeout_while(g, Duration::from_secs(30), |s| !s.1)
            .unwrap();
        g.1
    }
}

impl ShmHandler for Gated {
    fn handle(&self, req: ShmRequest, segs: &SegTable) -> ShmReply {
        let held = match req {
            ShmRequest::Put { .. } | ShmRequest::PutAt { .. } => !self.gets,
            ShmRequest::Get { .. } | ShmRequest::GetAt { .. } => self.gets,
            _ => false,
        } && self.first.swap(false, Ordering::AcqRel);
        if held {
            let g = self.state.lock().unwrap();
            drop(
                self.cv
                    .wait_timeout_while(g, Duration::from_secs(30), |s| !s.0)
                    .unwrap(),
            );
        }
        let reply = self.store.handle(req, segs);
        if held {
            self.state.lock().unwrap().1 = true;
            self.cv.notify_all();
        }
        reply
    }
}

/// The client's timeout on a call: the held put outlives it.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

fn done<T: std::fmt::Debug>(o: ShmOutcome<T>) -> Result<T, L3Error> {
    match o {
        ShmOutcome::Done(r) => r,
        ShmOutcome::UseTcp => panic!("the shared-memory path refused the call"),
    }
}

/// A gated embedded store served over shared memory in a temporary directory, and a client
/// of it whose calls time out after [`CALL_TIMEOUT`].
fn setup() -> (tempfile::TempDir, Arc<Gated>, ShmServer, ShmClient) {
    setup_holding(false)
}

/// [`setup`], holding the first get instead (`gets`).
fn setup_holding(gets: bool) -> (tempfile::TempDir, Arc<Gated>, ShmServer, ShmClient) {
    let dir = tempfile::tempdir().unwrap();
    let gated = Arc::new(Gated {
        store: EmbeddedStore::new(StoreConfig::default()).unwrap(),
        first: AtomicBool::new(true),
        gets,
        state: Mutex::new((false, false)),
        cv: Condvar::new(),
    });
    let server = ShmServer::start(gated.clone(), dir.path(), None, 64 << 20).unwrap();
    let c = ShmClient::new(
        server.offer.clone(),
        None,
        64 << 20,
        1024,
        1 << 20,
        CALL_TIMEOUT,
    )
    .expect("same host");
    (dir, gated, server, c)
}

fn put(
    c: &mut ShmClient,
    tn: &Tenant,
    k: &str,
    v: &[u8],
) -> Result<Vec<Result<(), L3Error>>, L3Error> {
    done(c.put(
        tn,
        &[k.to_string()],
        &[v],
        PutOptions::default(),
        ReplicateConfig::default(),
    ))
}

/// After the held put of "a" timed out: puts `b` under "b" until one is answered (each try a
/// new connection, on a machine too loaded to answer within the timeout), lets the held put
/// go, and checks that "a" holds `a` or nothing, never other bytes, and "b" holds `b`.
fn put_b_then_check_a(c: &mut ShmClient, gated: &Gated, tn: &Tenant, b: &[u8], a: &[u8]) {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        match put(c, tn, "b", b) {
            Ok(r) if r.iter().all(Result::is_ok) => break,
            r => assert!(Instant::now() < end, "no put of \"b\" for 30 s: {r:?}"),
        }
    }
    gated.release();
    assert!(gated.wait_served(), "the held put was never served");
    match gated.store.get(tn, "a") {
        Ok(v) => assert!(
            v == a,
            "\"a\" was stored with other bytes: {:02x?}",
            &v[..4]
        ),
        Err(e) => assert_eq!(e, L3Error::ObjectNotFound),
    }
    assert_eq!(gated.store.get(tn, "b").unwrap(), b);
}

/// The put that timed out is served after the client reconnected and staged another key's
/// bytes: the held put must store its own bytes (or nothing), never the other key's. Before,
/// the client registered its one staging segment again on the new connection, so the held
/// request read the next put's bytes and stored "a" with "b"'s bytes.
#[test]
fn a_timed_out_put_served_late_never_stores_the_next_calls_bytes() {
    let (_dir, gated, mut server, mut c) = setup();
    let tn = Tenant::new("t").unwrap();
    let (a, b) = (vec![0xaa_u8; 4096], vec![0xbb_u8; 4096]);
    // Held past the client's timeout: the call fails, its request stays with the server.
    let t0 = Instant::now();
    assert!(put(&mut c, &tn, "a", &a).is_err(), "the held put answered");
    assert!(t0.elapsed() < Duration::from_secs(10));
    // The next call connects again and stages its bytes (again on a machine too loaded to
    // answer within the timeout: each try is a new connection).
    put_b_then_check_a(&mut c, &gated, &tn, &b, &a);
    server.stop();
}

/// As above with the bytes in memory the client shares itself (a `SharedRegion`, named in
/// place, no staging): the held put, served after the caller reused that memory for the
/// next put, must not store the reused bytes under its key.
#[test]
fn a_timed_out_put_from_a_region_served_late_never_stores_the_reused_bytes() {
    let (_dir, gated, mut server, mut c) = setup();
    let region = c.alloc(4096).unwrap();
    // SAFETY: the region is 4096 bytes this test owns; the server reads it only during a
    // put, and this thread writes it only between calls.
    let mem = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), region.len()) };
    let tn = Tenant::new("t").unwrap();
    mem.fill(0xaa);
    assert!(put(&mut c, &tn, "a", mem).is_err(), "the held put answered");
    // The caller's memory is its own again: the next put's bytes go there.
    mem.fill(0xbb);
    put_b_then_check_a(&mut c, &gated, &tn, mem, &[0xaa; 4096]);
    server.stop();
}

/// As above with a plain buffer the server copies in place (`ShmMode::InPlace`, where the
/// host allows it; otherwise staged): the held put, served after the caller reused its
/// buffer, must not store the reused bytes under its key.
#[test]
fn a_timed_out_put_copied_in_place_served_late_never_stores_the_reused_bytes() {
    let (_dir, gated, mut server, c) = setup();
    let mut c = c.with_mode(ShmMode::InPlace);
    let tn = Tenant::new("t").unwrap();
    let mut mem = vec![0xaa_u8; 4096];
    assert!(
        put(&mut c, &tn, "a", &mem).is_err(),
        "the held put answered"
    );
    mem.fill(0xbb);
    put_b_then_check_a(&mut c, &gated, &tn, &mem, &[0xaa; 4096]);
    server.stop();
}

/// A get into memory the caller shares (`mem`: a region, or a plain buffer copied in place)
/// held past the client's timeout: once the call failed, the caller reuses `mem` (0xcc);
/// the held get, served after that, must not write "a"'s bytes over it.
fn late_get_never_writes_the_reused_memory(c: &mut ShmClient, gated: &Gated, mem: &mut [u8]) {
    let tn = Tenant::new("t").unwrap();
    gated
        .store
        .put(&tn, "a", &[0xaa; 4096], PutOptions::default())
        .unwrap();
    let r = done(c.get(&tn, &["a".to_string()], None, &mut [&mut *mem]));
    assert!(r.is_err(), "the held get answered: {r:?}");
    // The caller's memory is its own again.
    mem.fill(0xcc);
    gated.release();
    assert!(gated.wait_served(), "the held get was never served");
    assert!(
        mem.iter().all(|&b| b == 0xcc),
        "the late get wrote into the caller's reused memory: {:02x?}",
        &mem[..4]
    );
}

/// A get into a `SharedRegion` that timed out: served late, it must not write into the
/// region the caller has reused. Before, it wrote "a"'s 0xaa over the caller's 0xcc.
#[test]
fn a_timed_out_get_into_a_region_served_late_never_writes_the_reused_memory() {
    let (_dir, gated, mut server, mut c) = setup_holding(true);
    let region = c.alloc(4096).unwrap();
    // SAFETY: the region is 4096 bytes this test owns; the server writes it only during a
    // get, and this thread touches it only between calls.
    let mem = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), region.len()) };
    late_get_never_writes_the_reused_memory(&mut c, &gated, mem);
    server.stop();
}

/// As above with a plain buffer the server copies in place (`ShmMode::InPlace`, where the
/// host allows it; otherwise staged, and the late write goes to the old staging segment).
#[test]
fn a_timed_out_get_copied_in_place_served_late_never_writes_the_reused_memory() {
    let (_dir, gated, mut server, c) = setup_holding(true);
    let mut c = c.with_mode(ShmMode::InPlace);
    let mut mem = vec![0u8; 4096];
    late_get_never_writes_the_reused_memory(&mut c, &gated, &mut mem);
    server.stop();
}
