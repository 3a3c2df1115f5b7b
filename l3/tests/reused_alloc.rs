//! A late write of a put placed by a master since restarted must never store its bytes as
//! another put's, nor make another put's answer untruthful.
//!
//! Why it can happen: a master restarted on its `--state-dir` (no etcd) keeps epoch 0, so
//! the puts the old master placed are not fenced by epoch, and the new master counts its
//! allocation ids from 1 again: it gives an id the old one gave out to another put on the
//! same node. Put tokens do grow across such restarts (`TokensBelow` in the settle log), so
//! the later put's token is always the higher one.
//!
//! The interleaving: P1 (key "k") is placed by master M1 with allocation `a` on the node;
//! its writer (this process's client, holding the handle) pauses before writing. M1 is
//! SIGKILLed and restarted on its state dir as M2; the node remounts. M2 places P2 (key "k"
//! too, new bytes) and gives out `a` again on the same node (the loop below revokes its
//! placements until it does). P2 writes its bytes; P1's late write reaches the node; then
//! P2 ends (and P1 tries to).
//!
//! The same with a master run `--no-state-dir`: nothing durable, so before its tokens
//! started above the clock (unix µs) M2 counted them from M1's adopted ones again and gave
//! P2 P1's very token (2 and 2): same token, key and allocation, the node took P1's late
//! write for P2's own, "k" was read with P1's bytes after P2 was answered Ok (first two
//! interleavings), or P1 was answered Ok and P2 -705 (third).
//!
//! Real parts: a `--role master` (SIGKILLed, restarted on its state dir or without one; SIGSTOPped to
//! hold P2's end) and a `--role node` process on 127.0.0.1 (ephemeral ports), clients on
//! TCP (no shared memory).
//!
//! What must hold: "k" is read only as P2's bytes (or missed), never P1's; P2's put is
//! answered Ok only if "k" then reads P2's bytes; P1's late put is never answered Ok (its
//! master is gone) nor -705 ("another writer's object: no effect") when its bytes are stored.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::ha::signal;
use common::procs::{Proc, eventually, kill9, master_at, master_in, node_with};
use common::t;
use kvtier_l3::{
    ClientOptions, L3Error, L3Store, PutHandle, PutOptions, RemoteStore, ReplicaDescriptor, ShmMode,
};

const SIZE: usize = 4096;

fn client(addr: std::net::SocketAddr) -> RemoteStore {
    RemoteStore::connect(
        addr,
        ClientOptions {
            rpc_timeout: Duration::from_secs(20),
            shm: ShmMode::Off,
            ..Default::default()
        },
    )
    .unwrap()
}

fn alloc_of(h: &PutHandle) -> u64 {
    match h.replica {
        ReplicaDescriptor::Memory { alloc, .. } => alloc,
        _ => panic!("a put placed on disk: {h:?}"),
    }
}

/// The cluster once P2 is placed on P1's allocation, neither's bytes written.
struct Reused {
    _state: tempfile::TempDir,
    m2: Proc,
    _node: Proc,
    /// P1's writer (a client of M1, now dead) and its handle.
    c1: RemoteStore,
    h1: PutHandle,
    /// P2's writer (a client of M2) and its handle (the same allocation as `h1`).
    c2: Arc<RemoteStore>,
    h2: PutHandle,
}

/// How the master keeps its state across the restart.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Durable {
    /// `--state-dir`: put tokens reserved in the settle log (`TokensBelow`).
    StateDir,
    /// `--no-state-dir`: nothing survives the restart but the clock.
    None,
}

fn start_master(listen: &str, state: &std::path::Path, durable: Durable) -> Proc {
    match durable {
        Durable::StateDir => master_in(listen, state, &["--rebuild-timeout-ms", "1000"], None),
        Durable::None => master_at(listen, &["--no-state-dir"], None),
    }
}

/// Puts "warm", places P1 ("k") at M1 and pauses its writer; restarts the master; places
/// P2 ("k") at M2 on P1's allocation. P1's bytes are [0x11; SIZE], P2's [0x22; SIZE].
fn reused(durable: Durable) -> Reused {
    let state = tempfile::tempdir().unwrap();
    let mut m1 = start_master("127.0.0.1:0", state.path(), durable);
    let addr = m1.addr;
    let node = node_with(addr, 1, None, None, &[]);
    let tn = t("reused");
    let c1 = client(addr);
    assert!(
        eventually(Duration::from_secs(20), || c1
            .put(&tn, "warm", &[7u8; SIZE], PutOptions::default())
            .is_ok()),
        "no put succeeded"
    );
    let h1 = c1.put_start(&tn, "k", SIZE as u64).unwrap();
    let a = alloc_of(&h1);
    // P1's writer pauses here (it holds h1); its master dies and restarts on its state dir.
    kill9(&mut m1.child);
    let m2 = start_master(&addr.to_string(), state.path(), durable);
    let c2 = Arc::new(client(addr));
    assert!(
        eventually(Duration::from_secs(20), || c2
            .get(&tn, "warm")
            .is_ok_and(|v| v == [7u8; SIZE])),
        "the node did not remount at the restarted master"
    );
    // M2 counts allocation ids from 1 again: place "k" until it gets P1's id.
    let mut h2 = None;
    for _ in 0..64 {
        let h = c2.put_start(&tn, "k", SIZE as u64).unwrap();
        let b = alloc_of(&h);
        if b == a {
            h2 = Some(h);
            break;
        }
        assert!(
            b < a,
            "M2 gave out ids past P1's ({b} > {a}) without reusing it"
        );
        c2.put_revoke(&h).unwrap();
    }
    let h2 = h2.expect("M2 never gave out P1's allocation id again");
    assert_eq!(h1.replica.node(), h2.replica.node(), "not the same node");
    eprintln!(
        "{durable:?}: P1's token {}, P2's token {}",
        h1.token, h2.token
    );
    assert!(
        h2.token > h1.token,
        "put tokens do not grow across a restart ({durable:?}): {} then {}",
        h1.token,
        h2.token
    );
    assert_eq!(h1.epoch, h2.epoch, "the restart fenced P1 by epoch");
    Reused {
        _state: state,
        m2,
        _node: node,
        c1,
        h1,
        c2,
        h2,
    }
}

/// Reads "k" from M2 for a while: never P1's bytes; P2's bytes if P2 was answered Ok.
fn check_reads(addr: std::net::SocketAddr, p2: &Result<(), L3Error>) {
    let direct = client(addr);
    let tn = t("reused");
    let mut seen = Vec::new();
    for _ in 0..10 {
        match direct.get(&tn, "k") {
            Ok(v) => {
                assert!(
                    v != [0x11; SIZE],
                    "\"k\" read with the bytes of P1, a put placed by the dead master \
                     (P2 was answered {p2:?})"
                );
                assert_eq!(v, [0x22; SIZE], "\"k\" read with bytes nobody put");
                seen.push("P2");
            }
            Err(e) => {
                assert!(
                    p2.is_err(),
                    "P2 was answered Ok and \"k\" is not read: {e:?}"
                );
                seen.push("miss");
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    seen.dedup();
    eprintln!("reads of \"k\": {seen:?}");
}

/// The interleaving as found by reading: P2 written, P1's late write lands, P2 ends, P1
/// ends. P2's end must not be answered Ok with P1's bytes held; neither put serves P1's
/// bytes.
fn a_late_write_to_a_reused_allocation_before_its_end(durable: Durable) {
    let r = reused(durable);
    r.c2.put_write(&r.h2, &[0x22; SIZE]).unwrap();
    let late = r.c1.put_write(&r.h1, &[0x11; SIZE]);
    eprintln!("P1's late write: {late:?}");
    let p2 = r.c2.put_end(&r.h2, PutOptions::default());
    eprintln!("P2's end: {p2:?}");
    let p1 = r.c1.put_end(&r.h1, PutOptions::default());
    eprintln!("P1's end: {p1:?}");
    assert!(
        p1.is_err(),
        "P1 was placed by a dead master and was answered Ok"
    );
    check_reads(r.m2.addr, &p2);
    assert!(
        !matches!(p1, Err(L3Error::ObjectAlreadyExists)),
        "P1 answered -705"
    );
}

/// The same, P1's late write landing while P2's end is at the master (SIGSTOPped): the
/// node had checked P2's bytes were held and marks the allocation ended on the master's
/// answer.
fn a_late_write_to_a_reused_allocation_while_its_end_is_at_the_master(durable: Durable) {
    let r = reused(durable);
    r.c2.put_write(&r.h2, &[0x22; SIZE]).unwrap();
    signal(&r.m2.child, libc::SIGSTOP);
    let (c2, h2) = (r.c2.clone(), r.h2.clone());
    let end = std::thread::spawn(move || c2.put_end(&h2, PutOptions::default()));
    // The node checks P2's bytes and sends its end to the stopped master.
    std::thread::sleep(Duration::from_millis(500));
    let late = r.c1.put_write(&r.h1, &[0x11; SIZE]);
    eprintln!("P1's late write: {late:?}");
    signal(&r.m2.child, libc::SIGCONT);
    let p2 = end.join().unwrap();
    eprintln!("P2's end: {p2:?}");
    let p1 = r.c1.put_end(&r.h1, PutOptions::default());
    eprintln!("P1's end: {p1:?}");
    check_reads(r.m2.addr, &p2);
    assert!(
        p1.is_err(),
        "P1 was placed by a dead master and was answered Ok"
    );
    assert!(
        !matches!(p1, Err(L3Error::ObjectAlreadyExists)),
        "P1 answered -705 (\"another writer's object: no effect\")"
    );
}

/// P1's late write lands first (the allocation is empty at the node) and its end waits at
/// the master (SIGSTOPped); P2 writes its bytes and ends too. The master refuses P1's end
/// (token mismatch) and accepts P2's: the node must neither drop P2's bytes on P1's refusal
/// nor answer P2 Ok without them. Before: "k" complete at the master, its bytes dropped at
/// the node, P2 answered Ok.
fn a_late_put_ending_at_the_master_while_a_reused_allocation_is_written(durable: Durable) {
    let r = reused(durable);
    let late = r.c1.put_write(&r.h1, &[0x11; SIZE]);
    eprintln!("P1's late write: {late:?}");
    signal(&r.m2.child, libc::SIGSTOP);
    let (c1, h1) = (Arc::new(r.c1), r.h1.clone());
    let p1_end = std::thread::spawn(move || c1.put_end(&h1, PutOptions::default()));
    std::thread::sleep(Duration::from_millis(500));
    let w2 = r.c2.put_write(&r.h2, &[0x22; SIZE]);
    eprintln!("P2's write: {w2:?}");
    let (c2, h2) = (r.c2.clone(), r.h2.clone());
    let p2_end = std::thread::spawn(move || c2.put_end(&h2, PutOptions::default()));
    std::thread::sleep(Duration::from_millis(500));
    signal(&r.m2.child, libc::SIGCONT);
    let p1 = p1_end.join().unwrap();
    let p2 = p2_end.join().unwrap();
    eprintln!("P1's end: {p1:?}; P2's end: {p2:?}");
    assert!(
        p1.is_err(),
        "P1 was placed by a dead master and was answered Ok"
    );
    check_reads(r.m2.addr, &p2);
}

#[test]
fn state_dir_a_late_write_to_a_reused_allocation_before_its_end() {
    a_late_write_to_a_reused_allocation_before_its_end(Durable::StateDir);
}

#[test]
fn state_dir_a_late_write_to_a_reused_allocation_while_its_end_is_at_the_master() {
    a_late_write_to_a_reused_allocation_while_its_end_is_at_the_master(Durable::StateDir);
}

#[test]
fn state_dir_a_late_put_ending_at_the_master_while_a_reused_allocation_is_written() {
    a_late_put_ending_at_the_master_while_a_reused_allocation_is_written(Durable::StateDir);
}

#[test]
fn no_state_dir_a_late_write_to_a_reused_allocation_before_its_end() {
    a_late_write_to_a_reused_allocation_before_its_end(Durable::None);
}

#[test]
fn no_state_dir_a_late_write_to_a_reused_allocation_while_its_end_is_at_the_master() {
    a_late_write_to_a_reused_allocation_while_its_end_is_at_the_master(Durable::None);
}

#[test]
fn no_state_dir_a_late_put_ending_at_the_master_while_a_reused_allocation_is_written() {
    a_late_put_ending_at_the_master_while_a_reused_allocation_is_written(Durable::None);
}
