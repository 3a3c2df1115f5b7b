//! A paused server (SIGSTOP: a stopped container, a long swap or GC stall) must not hold a
//! client's calls past their `rpc_timeout`, however many threads share the client. Found by
//! an adversarial tester running vLLM with kvtier: with the server paused, threads sharing
//! one client (puts, gets and loss-journal reads, as the vLLM tier's I/O threads do) stayed
//! blocked in native calls for good, so the engine could never exit. tarpc expires a request
//! only once it is written: one queued behind a request the socket cannot take (a paused
//! server's full receive buffer) waited for ever, its deadline never checked.

mod common;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::ha::signal;
use common::procs::{args, spawn};
use common::{payload, t};
use kvtier_l3::{ClientOptions, L3Store, PutOptions, RemoteStore, ShmMode};

fn threads_sharing_a_client_hear_back_from_a_paused_server(shm: ShmMode) {
    let srv = spawn(
        &args(&["--listen", "127.0.0.1:0", "--segment-bytes", "268435456"]),
        None,
    );
    let timeout = Duration::from_secs(2);
    let opts = ClientOptions {
        rpc_timeout: timeout,
        shm,
        ..Default::default()
    };
    let c = Arc::new(RemoteStore::connect(srv.addr, opts).unwrap());
    let tn = t("paused");
    let page = payload(7, 512 << 10);
    let keys: Vec<String> = (0..8).map(|i| format!("a{i}")).collect();
    let bufs: Vec<&[u8]> = keys.iter().map(|_| page.as_slice()).collect();
    let stored = c
        .batch_put_from(&tn, &keys, &bufs, PutOptions::default())
        .unwrap();
    assert!(stored.iter().all(Result::is_ok));
    c.losses_since(&tn, None).unwrap();

    signal(&srv.child, libc::SIGSTOP);
    let until = Instant::now() + Duration::from_secs(8);
    let (tx, rx) = mpsc::channel();
    for w in 0..4usize {
        let (c, tn, tx, page) = (c.clone(), tn.clone(), tx.clone(), page.clone());
        std::thread::spawn(move || {
            let mut longest = Duration::ZERO;
            let mut calls = 0u32;
            while Instant::now() < until {
                let t0 = Instant::now();
                match w % 4 {
                    0 | 1 => {
                        let keys: Vec<String> =
                            (0..8).map(|i| format!("w{w}-{calls}-{i}")).collect();
                        let bufs: Vec<&[u8]> = keys.iter().map(|_| page.as_slice()).collect();
                        let _ = c.batch_put_from(&tn, &keys, &bufs, PutOptions::default());
                    }
                    2 => {
                        let _ = c.get(&tn, "a0");
                    }
                    _ => {
                        let _ = c.losses_since(&tn, None);
                    }
                }
                longest = longest.max(t0.elapsed());
                calls += 1;
            }
            let _ = tx.send((w, calls, longest));
        });
    }
    drop(tx);
    let mut heard = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(40);
    while heard.len() < 4 {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(r) => heard.push(r),
            Err(_) => break,
        }
    }
    signal(&srv.child, libc::SIGCONT);
    assert_eq!(
        heard.len(),
        4,
        "{shm:?}: {} of 4 threads still blocked in a call 32 s after they stopped calling \
         ({heard:?})",
        4 - heard.len()
    );
    for (w, calls, longest) in &heard {
        // A call is one RPC timeout and a grace, at most a few (a put's chunks run together).
        assert!(
            *longest < timeout * 4,
            "{shm:?}: thread {w} waited {longest:?} in one call ({calls} calls)"
        );
    }
    // The server answers again: the same client serves.
    let ok = (0..50).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        c.get(&tn, "a0").is_ok_and(|b| b == page)
    });
    assert!(ok, "{shm:?}: the client did not serve again after SIGCONT");
}

#[test]
fn over_tcp() {
    threads_sharing_a_client_hear_back_from_a_paused_server(ShmMode::Off);
}

#[test]
fn over_shared_memory() {
    threads_sharing_a_client_hear_back_from_a_paused_server(ShmMode::Auto);
}
