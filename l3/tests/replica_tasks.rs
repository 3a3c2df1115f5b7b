//! Replica copy and move (Mooncake's `CreateCopyTask` / `CreateMoveTask`) with Mooncake
//! 0.3.13's codes (checked side by side in bindings/tests/test_mooncake_real.py): a missing
//! key is -704; an unmounted segment, a move onto its own source or from a segment holding
//! no replica is -600; a copy to a segment that already holds one succeeds and changes
//! nothing. Run on the embedded store and over the tarpc server on 127.0.0.1; a split
//! master (real processes) answers -1011 and changes nothing. A property test drives random
//! copies and moves (good and bad) against a model of which segments hold the object.

use std::collections::BTreeSet;
use std::sync::Arc;

mod common;

use common::procs::{eventually, master, node};
use common::{client, t};
use kvtier_l3::rpc::server::ServerOptions;
use kvtier_l3::store::LOCAL_SEGMENT;
use kvtier_l3::{
    ClientId, EmbeddedStore, L3Store, PutOptions, ReplicaDescriptor, SegmentId, StoreConfig,
    spawn_server,
};
use proptest::prelude::*;

const B: SegmentId = SegmentId(7);
const C: SegmentId = SegmentId(8);
const NOWHERE: SegmentId = SegmentId(99);

use common::memory_segments as segs;

fn code<T: std::fmt::Debug>(r: kvtier_l3::L3Result<T>) -> i32 {
    r.unwrap_err().code_i32()
}

/// An embedded store with its own segment and two client segments (B, C).
fn three_segments() -> EmbeddedStore {
    let s = EmbeddedStore::new(StoreConfig {
        local_segment_bytes: 8 << 20,
        ..Default::default()
    })
    .unwrap();
    s.mount_segment(ClientId(7), B, 8 << 20).unwrap();
    s.mount_segment(ClientId(8), C, 8 << 20).unwrap();
    s
}

/// The same sequence on any store holding segments LOCAL_SEGMENT, B and C.
fn scenario(s: &dyn L3Store) {
    let (a, b) = (t("a"), t("b"));
    let data: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
    s.put(&a, "k", &data, PutOptions::default()).unwrap();
    let first = segs(s, &a, "k");
    assert_eq!(first.len(), 1);
    let others: Vec<SegmentId> = [LOCAL_SEGMENT, B, C]
        .into_iter()
        .filter(|g| *g != first[0])
        .collect();
    let (x, y) = (others[0], others[1]);

    // Bad input: codes, nothing changes.
    assert_eq!(code(s.copy_replica(&a, "nope", x)), -704);
    assert_eq!(code(s.copy_replica(&b, "k", x)), -704); // another tenant's key
    assert_eq!(code(s.copy_replica(&a, "k", NOWHERE)), -600);
    assert_eq!(code(s.move_replica(&a, "k", first[0], first[0])), -600);
    assert_eq!(code(s.move_replica(&a, "k", NOWHERE, x)), -600);
    assert_eq!(code(s.move_replica(&a, "k", first[0], NOWHERE)), -600);
    assert_eq!(code(s.move_replica(&a, "k", x, y)), -600); // x holds none
    assert_eq!(code(s.move_replica(&a, "nope", first[0], x)), -704);
    assert_eq!(segs(s, &a, "k"), first);

    // Copy: a second replica; again to a holder: no change.
    assert!(s.copy_replica(&a, "k", x).unwrap());
    assert!(!s.copy_replica(&a, "k", x).unwrap());
    assert!(!s.copy_replica(&a, "k", first[0]).unwrap());
    let mut two = vec![first[0], x];
    two.sort();
    assert_eq!(segs(s, &a, "k"), two);

    // Move the first replica to y: still two, now on x and y; the bytes read back.
    s.move_replica(&a, "k", first[0], y).unwrap();
    let mut moved = vec![x, y];
    moved.sort();
    assert_eq!(segs(s, &a, "k"), moved);
    assert_eq!(s.get(&a, "k").unwrap(), data);
    // Move onto a segment that already holds one: the source replica goes.
    s.move_replica(&a, "k", x, y).unwrap();
    assert_eq!(segs(s, &a, "k"), vec![y]);
    assert_eq!(s.get(&a, "k").unwrap(), data);
    // The segments' space follows the replicas: removing frees it all.
    s.remove(&a, "k", true).unwrap();
    assert_eq!(s.stats().unwrap().mem_used_bytes, 0);
}

#[test]
fn embedded_store() {
    scenario(&three_segments());
}

#[test]
fn over_the_server() {
    let h = spawn_server(Arc::new(three_segments()), ServerOptions::default()).unwrap();
    scenario(&client(h.addr, None));
}

#[test]
fn a_split_master_answers_unavailable_in_mode() {
    let m = master(&[], None);
    let _n1 = node(m.addr, 1, None, None);
    let _n2 = node(m.addr, 2, None, None);
    let c = client(m.addr, None);
    let a = t("a");
    assert!(eventually(std::time::Duration::from_secs(10), || c
        .put(&a, "k", b"abc", PutOptions::default())
        .is_ok()));
    let before = c.get_replica_list(&a, "k").unwrap().replicas;
    let seg = match before[0] {
        ReplicaDescriptor::Memory { segment, .. } => segment,
        _ => panic!("a memory replica"),
    };
    assert_eq!(code(c.copy_replica(&a, "k", SegmentId(2))), -1011);
    assert_eq!(code(c.move_replica(&a, "k", seg, SegmentId(2))), -1011);
    assert_eq!(c.get_replica_list(&a, "k").unwrap().replicas, before);
    assert_eq!(c.get(&a, "k").unwrap(), b"abc");
}

#[derive(Debug, Clone)]
enum Op {
    Copy(usize),
    Move(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..4usize).prop_map(Op::Copy),
        (0..4usize, 0..4usize).prop_map(|(a, b)| Op::Move(a, b)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Any sequence of copies and moves (index 3 is no segment) keeps the replica set equal
    /// to the model's, the bytes intact, and refused calls change nothing.
    #[test]
    fn copies_and_moves_follow_the_model(ops in proptest::collection::vec(op(), 1..24)) {
        let s = three_segments();
        let all = [LOCAL_SEGMENT, B, C, NOWHERE];
        let a = t("a");
        let data = vec![5u8; 3000];
        s.put(&a, "k", &data, PutOptions::default()).unwrap();
        let mut model: BTreeSet<SegmentId> = segs(&s, &a, "k").into_iter().collect();
        for o in ops {
            match o {
                Op::Copy(i) => {
                    let r = s.copy_replica(&a, "k", all[i]);
                    if i == 3 {
                        prop_assert_eq!(code(r), -600);
                    } else {
                        prop_assert_eq!(r.unwrap(), model.insert(all[i]));
                    }
                }
                Op::Move(i, j) => {
                    let r = s.move_replica(&a, "k", all[i], all[j]);
                    if i == j || i == 3 || j == 3 || !model.contains(&all[i]) {
                        prop_assert_eq!(code(r), -600);
                    } else {
                        r.unwrap();
                        model.remove(&all[i]);
                        model.insert(all[j]);
                    }
                }
            }
            prop_assert_eq!(segs(&s, &a, "k"), model.iter().copied().collect::<Vec<_>>());
            prop_assert_eq!(
                s.stats().unwrap().mem_used_bytes,
                kvtier_l3::charge(3000, "k".len()) * model.len() as u64
            );
        }
        prop_assert_eq!(s.get(&a, "k").unwrap(), data);
    }
}
