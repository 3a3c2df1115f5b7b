//! The adoption rules for DRAM replicas a store node reports after a remount (issue 22,
//! `master::adopt`), on the real `Master` against a model: a version some node was told is
//! gone (removed, or replaced by a newer one) is never adopted, duplicates resolve to the
//! newest version (an older report is refused, a newer one replaces what was adopted),
//! the same version adds a replica on another node, and a node whose memory this master
//! dropped itself (a second mount) has nothing adopted.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use kvtier_l3::master::{Master, MasterPolicy, Refusal, RetainedObject};
use kvtier_l3::{ClientId, SegmentId, StoreConfig, Tenant};
use proptest::prelude::*;

const SIZE: u64 = 100;

fn tn() -> Tenant {
    Tenant::new("a").unwrap()
}

fn master(nodes: u64) -> Master {
    let mut m = Master::new(MasterPolicy::from_config(&StoreConfig::default()));
    for n in 1..=nodes {
        mount(&mut m, n);
    }
    m
}

fn mount(m: &mut Master, n: u64) {
    let addr = SocketAddr::from(([127, 0, 0, 1], 9000 + n as u16));
    m.mount_node(ClientId(n), SegmentId(n), 1 << 20, addr, 0)
        .unwrap();
}

fn report(m: &mut Master, node: u64, key: &str, token: u64) -> Result<u64, Refusal> {
    let r = RetainedObject {
        tenant: tn(),
        key: key.into(),
        token,
        size: SIZE,
        crc: 0,
        disk: None,
    };
    m.adopt_retained(ClientId(node), &r)
}

#[test]
fn two_versions_on_two_nodes_resolve_to_the_newest_in_either_order() {
    for newest_first in [true, false] {
        let mut m = master(2);
        let (old, new) = ((1, 5), (2, 7));
        let (first, second) = if newest_first { (new, old) } else { (old, new) };
        report(&mut m, first.0, "k", first.1).unwrap();
        let r = report(&mut m, second.0, "k", second.1);
        assert_eq!(r.is_ok(), !newest_first, "{newest_first}");
        let (allocs, _) = m.current_replicas(&tn(), "k").unwrap();
        assert_eq!(allocs.len(), 1, "only the newest version's replica");
        // The older version, reported again by any node, is refused (settled when it had
        // been adopted first).
        let want = if newest_first {
            Refusal::Older
        } else {
            Refusal::Settled
        };
        assert_eq!(report(&mut m, 1, "k", 5), Err(want));
    }
}

#[test]
fn a_removed_version_is_not_adopted_but_a_newer_one_is() {
    let mut m = master(2);
    report(&mut m, 1, "k", 5).unwrap();
    m.remove(&tn(), "k", true, 0).unwrap();
    // Node 2 held a replica of version 5 too and had not heard of the remove.
    assert_eq!(report(&mut m, 2, "k", 5), Err(Refusal::Settled));
    assert_eq!(report(&mut m, 2, "k", 4), Err(Refusal::Settled));
    assert!(!m.exists(&tn(), "k"));
    report(&mut m, 2, "k", 6).unwrap();
    assert!(m.exists(&tn(), "k"));
}

#[test]
fn a_node_this_master_dropped_has_nothing_adopted() {
    let mut m = master(1);
    report(&mut m, 1, "a", 3).unwrap();
    // Remounting here: this master dropped its memory (and told it nothing since).
    mount(&mut m, 1);
    assert_eq!(report(&mut m, 1, "b", 4), Err(Refusal::NotMounted));
    assert!(!m.exists(&tn(), "b"));
    // Bad input: an empty object, an unknown node.
    let mut m = master(1);
    assert!(report(&mut m, 1, "z", 0).is_ok());
    let empty = RetainedObject {
        tenant: tn(),
        key: "e".into(),
        token: 9,
        size: 0,
        crc: 0,
        disk: None,
    };
    assert!(m.adopt_retained(ClientId(1), &empty).is_err());
    assert_eq!(report(&mut m, 7, "x", 1), Err(Refusal::NotMounted));
}

#[derive(Debug, Clone)]
enum Op {
    Report { node: u64, key: u8, token: u64 },
    Remove { key: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..=3, 0u8..3, 1u64..12).prop_map(|(node, key, token)| Op::Report { node, key, token }),
        1 => (0u8..3).prop_map(|key| Op::Remove { key }),
    ]
}

proptest! {
    #[test]
    fn adoption_matches_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        let mut m = master(3);
        // key → (adopted version, nodes holding it); key → newest version told gone.
        let mut cur: BTreeMap<u8, (u64, BTreeSet<u64>)> = BTreeMap::new();
        let mut gone: BTreeMap<u8, u64> = BTreeMap::new();
        for o in ops {
            match o {
                Op::Report { node, key, token } => {
                    let k = format!("k{key}");
                    let got = report(&mut m, node, &k, token);
                    let want = if gone.get(&key).is_some_and(|g| token <= *g) {
                        Err(Refusal::Settled)
                    } else {
                        match cur.get_mut(&key) {
                            Some((v, _)) if token < *v => Err(Refusal::Older),
                            Some((v, ns)) if token == *v => {
                                if ns.insert(node) { Ok(()) } else { Err(Refusal::NoRoom) }
                            }
                            Some((v, ns)) => {
                                let g = gone.entry(key).or_default();
                                *g = (*g).max(*v);
                                *v = token;
                                *ns = BTreeSet::from([node]);
                                Ok(())
                            }
                            None => {
                                cur.insert(key, (token, BTreeSet::from([node])));
                                Ok(())
                            }
                        }
                    };
                    prop_assert_eq!(got.map(|_| ()), want);
                }
                Op::Remove { key } => {
                    let k = format!("k{key}");
                    let r = m.remove(&tn(), &k, true, 0);
                    prop_assert_eq!(r.is_ok(), cur.contains_key(&key));
                    if let Some((v, _)) = cur.remove(&key) {
                        let g = gone.entry(key).or_default();
                        *g = (*g).max(v);
                    }
                }
            }
            for key in 0u8..3 {
                let k = format!("k{key}");
                let n = m.current_replicas(&tn(), &k).map(|(a, _)| a.len()).unwrap_or(0);
                prop_assert_eq!(n, cur.get(&key).map_or(0, |(_, ns)| ns.len()));
            }
        }
    }
}
