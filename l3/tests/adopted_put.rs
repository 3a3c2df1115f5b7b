//! A replicated put whose own version is stored is answered Ok, never -705 (l3-chaos,
//! `--mode write-through --faults nodes,node-pause,master --seed 505`: stale-version reads of
//! a key whose put was answered -705, "another writer's object: no effect").
//!
//! The path: a put with 2 replicas, on nodes A and B. A writes and ends its replica at the
//! master; B is paused (SIGSTOP) with the put's request unread. The master is SIGKILLed and
//! restarted (same address and state dir); A remounts and reports its ended replica, which
//! the new master adopts as a complete object under the put's token (`adopt_retained`). B
//! resumes, writes and ends its replica: the master answers -705 (the token matches, the
//! object is complete). The client took a node's -705 for another writer's object and
//! returned -705 for a put whose version is stored and read afterwards.
//!
//! Real parts: a `--role master` and two `--role node` processes on 127.0.0.1 (ephemeral
//! ports), real SIGSTOP / SIGCONT / SIGKILL, a `RemoteStore` on TCP (no shared memory).
//!
//! Ordering: B's connection to the master broke while B was paused, and B's first call to
//! the master after it resumes fails on it (then the next one dials the new master). So the
//! client puts two keys, "x" then "k": the client sends one call at a time to a node, so B
//! serves x's request (or its ping fails) before it is sent k's, whose end then reaches the
//! new master. x's answer is Ok or a transport error (-900), never -705; k's must be Ok.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::ha::signal;
use common::procs::{eventually, kill9, master_in, node_with};
use common::t;
use kvtier_l3::{
    ClientOptions, L3Error, L3Store, PutOptions, RemoteStore, ReplicateConfig, ShmMode,
};

/// The client's call timeout: outlasts B's pause (the master's restart and rebuild).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

fn bytes(key: &str) -> Vec<u8> {
    let seed = key.bytes().map(u32::from).sum::<u32>();
    (0..4096u32).map(|i| (i * 7 + seed) as u8).collect()
}

#[test]
fn a_replicated_put_completed_by_an_adopted_replica_is_answered_ok() {
    let state = tempfile::tempdir().unwrap();
    let mut m = master_in("127.0.0.1:0", state.path(), &[], None);
    let addr = m.addr;
    let _a = node_with(addr, 1, None, None, &[]);
    let b = node_with(addr, 2, None, None, &[]);
    let tn = t("adopted");
    let two = ReplicateConfig::replicas(2);
    let c = Arc::new(
        RemoteStore::connect(
            addr,
            ClientOptions {
                rpc_timeout: CALL_TIMEOUT,
                shm: ShmMode::Off,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    // Both nodes mounted and reached: a warm put has a replica on each.
    assert!(
        eventually(Duration::from_secs(20), || c
            .put_with(&tn, "warm", &bytes("warm"), PutOptions::default(), two)
            .is_ok()),
        "no replicated put succeeded"
    );
    assert_eq!(
        c.get_replica_list(&tn, "warm").unwrap().replicas.len(),
        2,
        "the warm put did not get a replica on each node"
    );

    signal(&b.child, libc::SIGSTOP);
    let put = |key: &'static str| {
        let (c, tn) = (c.clone(), tn.clone());
        std::thread::spawn(move || c.put_with(&tn, key, &bytes(key), PutOptions::default(), two))
    };
    // x first: it holds the client's connection to B while B is paused; k's request to B
    // waits for it. Each ends its replica on A at once.
    let x = put("x");
    std::thread::sleep(Duration::from_millis(500));
    let k = put("k");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !x.is_finished() && !k.is_finished(),
        "a put returned while one of its nodes was paused"
    );

    // The master dies with both puts half ended; the restarted one adopts A's replicas
    // (complete objects under the puts' tokens). B, still paused, is fenced after 1 s.
    kill9(&mut m.child);
    let _m2 = master_in(
        &addr.to_string(),
        state.path(),
        &["--rebuild-timeout-ms", "1000"],
        None,
    );
    let direct = RemoteStore::connect(addr, ClientOptions::default()).unwrap();
    assert!(
        eventually(Duration::from_secs(20), || ["x", "k"]
            .iter()
            .all(|key| direct.get(&tn, key).is_ok_and(|v| v == bytes(key)))),
        "the restarted master did not adopt A's replicas of x and k"
    );

    signal(&b.child, libc::SIGCONT);
    let rx = x.join().unwrap();
    let rk = k.join().unwrap();
    eprintln!("x: {rx:?}; k: {rk:?}");
    assert!(
        !matches!(rx, Err(L3Error::ObjectAlreadyExists)),
        "x's own version is stored, and its put was answered -705"
    );
    assert_eq!(
        rk,
        Ok(()),
        "k's own version is stored (read from the restarted master), and its put failed"
    );
    assert_eq!(direct.get(&tn, "k").unwrap(), bytes("k"));
}
