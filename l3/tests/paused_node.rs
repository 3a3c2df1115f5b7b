//! A paused store node (SIGSTOP: a stuck process, a VM paused, a long GC-like stall) must
//! not block its clients: a call to it fails within the client's `rpc_timeout`, over the
//! shared-memory path and over TCP. Found by `l3-chaos --faults node-pause` (issue 33's
//! chaos work): client reads and puts over shared memory waited in `read_frame` until the
//! node was resumed — the data sockets had no timeout, so `rpc_timeout` bounded nothing.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::ha::signal;
use common::procs::{eventually, master, node_with};
use common::{payload, t};
use kvtier_l3::{ClientOptions, L3Store, PutOptions, RemoteStore, ShmMode};

fn paused_node_fails_calls_within_the_timeout(shm: ShmMode) {
    let m = master(&[], None);
    let n = node_with(m.addr, 1, None, None, &[]);
    let opts = ClientOptions {
        rpc_timeout: Duration::from_secs(2),
        shm,
        ..Default::default()
    };
    let c = RemoteStore::connect(m.addr, opts).unwrap();
    let tn = t("p");
    let v = payload(1, 64 << 10);
    assert!(
        eventually(Duration::from_secs(10), || c
            .put(&tn, "k", &v, PutOptions::default())
            .is_ok()),
        "no put succeeded"
    );
    assert_eq!(c.get(&tn, "k").unwrap(), v);
    assert_eq!(c.uses_shm(), shm != ShmMode::Off, "{shm:?}");

    signal(&n.child, libc::SIGSTOP);
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = c.get(&tn, "k");
        // The caller hears back (an error) while the node is still paused.
        let _ = tx.send((r.map(|b| b.len()), t0.elapsed()));
        c
    });
    let got = rx.recv_timeout(Duration::from_secs(20));
    signal(&n.child, libc::SIGCONT);
    let c = reader.join().unwrap();
    match got {
        Err(_) => panic!("{shm:?}: a get from a paused node still blocks after 20 s"),
        Ok((Ok(len), _)) => panic!("{shm:?}: a paused node answered a get ({len} bytes)"),
        Ok((Err(e), took)) => {
            eprintln!("{shm:?}: get from a paused node: {e} after {took:?}");
            // One rpc_timeout, not one per try: a timed-out try was retried (and shared
            // memory then fell back to TCP), 2-3 × the timeout, 4-6 minutes with the
            // Python client's default of 120 s.
            assert!(
                took < Duration::from_millis(3500),
                "{shm:?}: a get from a paused node took {took:?} with rpc_timeout 2 s"
            );
        }
    }
    // Once the node is back, the next calls are served again.
    assert!(
        eventually(Duration::from_secs(10), || c
            .get(&t("p"), "k")
            .is_ok_and(|b| b == v)),
        "{shm:?}: reads do not recover after the node resumed"
    );
}

#[test]
fn a_paused_node_fails_shared_memory_calls_within_the_rpc_timeout() {
    paused_node_fails_calls_within_the_timeout(ShmMode::Auto);
}

#[test]
fn a_paused_node_fails_tcp_calls_within_the_rpc_timeout() {
    paused_node_fails_calls_within_the_timeout(ShmMode::Off);
}
