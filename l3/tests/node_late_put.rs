//! A put to a store node that timed out leaves its request with the node, which may still
//! serve it once it runs again: by then the caller has its memory back and may have put
//! other bytes there. The node must not store the put from that memory, nor write a late
//! read's bytes into it.
//!
//! Real parts: a `--role master` and a `--role node` process on 127.0.0.1 (ephemeral
//! ports), the node paused and resumed with real SIGSTOP / SIGCONT, and a `RemoteStore` in
//! this process reaching the node through shared memory from a `SharedRegion` (plain
//! buffers are staged in a fresh segment per connection: the late request reads the old
//! one). The client reaches the master through a loopback relay the test holds while the
//! put fails, so the client's revoke of the placement does not reach the master before the
//! node's late end (a master stalled or unreachable for that client: with the master
//! SIGSTOPped instead, the node's end was served before the revoke in 1 run of 6).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::ha::signal;
use common::procs::{eventually, master, node_with};
use common::t;
use kvtier_l3::{ClientOptions, L3Error, L3Store, PutOptions, RemoteStore, ShmMode};

/// The client's timeout on a call: the paused node and the held relay outlive it.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// A loopback relay to `to`: every connection forwarded both ways, the client's bytes held
/// (not forwarded) while `held` is set.
fn relay(to: SocketAddr, held: Arc<AtomicBool>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { return };
            let Ok(s) = TcpStream::connect(to) else {
                return;
            };
            let (c2, s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
            let h = held.clone();
            std::thread::spawn(move || pump(c, s, Some(h)));
            std::thread::spawn(move || pump(s2, c2, None));
        }
    });
    addr
}

/// Copies `from` to `to` until either ends, waiting while `held` is set.
fn pump(mut from: TcpStream, mut to: TcpStream, held: Option<Arc<AtomicBool>>) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        while held.as_ref().is_some_and(|h| h.load(Ordering::Acquire)) {
            std::thread::sleep(Duration::from_millis(5));
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    // Closing both ways ends the other pump.
    if let Err(e) = to.shutdown(std::net::Shutdown::Both) {
        eprintln!("relay: {e}");
    }
}

/// A client of `addr` (the master, or a relay to it) whose calls time out after
/// [`CALL_TIMEOUT`], once a put of `key` (`v`) succeeded and the node is reached through
/// shared memory.
fn client(addr: SocketAddr, key: &str, v: &[u8]) -> RemoteStore {
    let c = RemoteStore::connect(
        addr,
        ClientOptions {
            rpc_timeout: CALL_TIMEOUT,
            shm: ShmMode::Auto,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(20), || c
            .put(&t("late"), key, v, PutOptions::default())
            .is_ok()),
        "no put succeeded"
    );
    assert!(
        c.uses_shm(),
        "the node is not reached through shared memory"
    );
    c
}

/// Puts `mem` (0xaa) under "a" from a client of the master behind a relay while the node
/// is paused, holding the relay once the put is placed so the client's revoke does not
/// reach the master; once the put failed, fills `mem` with 0xbb (the caller's next bytes)
/// and resumes the node, which serves the late request. "a" must never be read with 0xbb.
#[test]
fn a_timed_out_node_put_from_a_region_never_stores_the_reused_bytes() {
    let m = master(&[], None);
    let n = node_with(m.addr, 1, None, None, &[]);
    let held = Arc::new(AtomicBool::new(false));
    let c = client(relay(m.addr, held.clone()), "warm", &[1u8; 64]);
    let tn = t("late");
    let region = c.shared_region(4096).unwrap();
    // SAFETY: the region is 4096 bytes alive until the test ends; the node reads it only
    // during a put, and this thread writes it only while no put runs.
    let mem = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), region.len()) };
    mem.fill(0xaa);
    signal(&n.child, libc::SIGSTOP);
    let c = Arc::new(c);
    let (c2, tn2) = (c.clone(), tn.clone());
    let (addr, len) = (mem.as_ptr() as usize, mem.len());
    let putter = std::thread::spawn(move || {
        // SAFETY: as above; nothing writes the region until this thread is joined.
        let buf = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
        let t0 = Instant::now();
        (c2.put(&tn2, "a", buf, PutOptions::default()), t0.elapsed())
    });
    // The placement is answered at once; the write waits on the paused node.
    std::thread::sleep(Duration::from_millis(400));
    held.store(true, Ordering::Release);
    let (r, took) = putter.join().unwrap();
    eprintln!("put of \"a\": {r:?} after {took:?}");
    if r.is_ok() {
        signal(&n.child, libc::SIGCONT);
        panic!("the put to a paused node succeeded");
    }
    // The caller's memory is its own again: its next bytes go there.
    mem.fill(0xbb);
    signal(&n.child, libc::SIGCONT);
    // The node serves the late request (and ends it at the master, which never heard the
    // revoke). Read through a client of the master itself.
    let direct = RemoteStore::connect(m.addr, ClientOptions::default()).unwrap();
    let end = Instant::now() + Duration::from_secs(3);
    let mut seen = Vec::new();
    while Instant::now() < end {
        match direct.get(&tn, "a") {
            Ok(v) => {
                assert!(
                    v.iter().all(|&b| b == 0xaa),
                    "\"a\" was stored with the caller's next bytes: {:02x?}",
                    &v[..4]
                );
                seen.push("aa");
            }
            Err(L3Error::ObjectNotFound) => seen.push("missing"),
            Err(_) => seen.push("error"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    seen.dedup();
    eprintln!("reads of \"a\": {seen:?}");
    held.store(false, Ordering::Release);
    drop(region);
}

/// A read from a paused node into a `SharedRegion` times out; the caller reuses the region
/// (0xcc); the node, resumed, serves the late read, and must not write the object's bytes
/// over the caller's. Before, the region held the object's 0x5a bytes afterwards.
#[test]
fn a_timed_out_node_get_into_a_region_never_writes_the_reused_memory() {
    let m = master(&[], None);
    let n = node_with(m.addr, 1, None, None, &[]);
    let c = client(m.addr, "a", &[0x5a; 4096]);
    let tn = t("late");
    let region = c.shared_region(4096).unwrap();
    // SAFETY: the region is 4096 bytes alive until the test ends; the node writes it only
    // during a get, and this thread touches it only between calls.
    let mem = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), region.len()) };
    signal(&n.child, libc::SIGSTOP);
    let r = c.get_into(&tn, "a", mem);
    if r.is_ok() {
        signal(&n.child, libc::SIGCONT);
        panic!("a paused node answered a get: {r:?}");
    }
    mem.fill(0xcc);
    signal(&n.child, libc::SIGCONT);
    // The node serves the late read; a read of it afterwards is the proof it runs again.
    assert!(
        eventually(Duration::from_secs(10), || c
            .get(&tn, "a")
            .is_ok_and(|v| v == [0x5a; 4096])),
        "the node does not serve reads again"
    );
    assert!(
        mem.iter().all(|&b| b == 0xcc),
        "the late read wrote into the caller's reused memory: {:02x?}",
        &mem[..4]
    );
    drop(region);
}
