//! A read right after a store node's quick restart (issue 19, item 5): real `kvtier-l3`
//! master and node processes on 127.0.0.1.
//!
//! Why: a node SIGKILLed and restarted at once on the same address serves its data channel
//! before the master has processed its remount. Until then the master still hands out the
//! previous incarnation's memory descriptors, and the new process, which never held those
//! bytes, answered -704 (not found) for a live object — `is_exist` said true, and the loss
//! journal named the key only ~50 ms later. A miss must be definitive only when it is: the
//! node answers -900 (the transport-level "retry") until it is mounted; once the master has
//! processed the remount the object is gone there too (-704, `is_exist` false, and the loss
//! journal names it).
//!
//! The window is held open on purpose: the restarted node is pointed at a "master" that
//! accepts its connection and never answers, so its mount stays in flight while the test
//! reads through the real master.

use std::net::{TcpListener, TcpStream};
use std::time::Duration;

mod common;

use common::procs::{args, eventually, kill9, master, node, spawn_unready};
use common::{client, payload, t};
use kvtier_l3::{L3Error, L3Store, PutOptions};

#[test]
fn a_read_before_the_remount_is_processed_is_not_a_definitive_miss() {
    // A long TTL: the master must not declare the node dead during the test on its own.
    let m = master(&["--client-ttl-ms", "20000"], None);
    let mut n = node(m.addr, 1, None, None);
    let data_addr = n.addr;
    let c = client(m.addr, None);
    let a = t("a");
    let keys: Vec<String> = (0..8).map(|i| format!("quick-restart-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        c.put(&a, k, &payload(i, 4096), PutOptions::default())
            .unwrap();
    }
    let mut cursor = Some(c.losses_since(&a, None).unwrap().next);

    // SIGKILL, then a new process on the same data address whose mount is never answered.
    kill9(&mut n.child);
    let hole = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut restarted = spawn_unready(&args(&[
        "--role",
        "node",
        "--listen",
        &data_addr.to_string(),
        "--master",
        &hole.local_addr().unwrap().to_string(),
        "--node-id",
        "1",
        "--segment-bytes",
        "16777216",
    ]));
    assert!(
        eventually(Duration::from_secs(10), || TcpStream::connect(data_addr)
            .is_ok()),
        "the restarted node never bound its data channel"
    );
    let (_held, _) = hole.accept().unwrap();
    for k in &keys {
        let got = c.get(&a, k);
        let exists = c.is_exist(&a, k).unwrap();
        assert!(exists, "{k}: the master has not processed any remount yet");
        assert!(
            matches!(got, Err(L3Error::RpcFail(_))),
            "{k}: read from the unmounted new incarnation answered {got:?} while is_exist is \
             true (a miss must be definitive only when it is: -900)"
        );
    }

    // The real remount: the previous incarnation's memory is gone at the master, reads are
    // definitive misses, and the loss journal names every key.
    kill9(&mut restarted);
    let _n2 = node(m.addr, 1, None, None);
    let mut lost = Vec::new();
    assert!(eventually(Duration::from_secs(5), || {
        let l = c.losses_since(&a, cursor).unwrap();
        cursor = Some(l.next);
        lost.extend(l.keys);
        keys.iter().all(|k| lost.contains(k))
    }));
    for k in &keys {
        assert!(matches!(c.get(&a, k), Err(L3Error::ObjectNotFound)));
        assert!(!c.is_exist(&a, k).unwrap());
    }
}
