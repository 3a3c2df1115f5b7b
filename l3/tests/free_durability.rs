//! Frees, settles and adoption across lost replies and failovers (issue 33, item 1), on the
//! real [`Master`] driven as store nodes drive it, with nodes simulated beside it: each node
//! holds the bytes of its allocations (tagged with their version) and the SSD records it
//! wrote, applies what ping and put-end replies tell it — unless the reply is lost on the way
//! — and, at a failover, mounts on a new master rebuilt from the old one's settle state (what
//! etcd holds) and reports what it kept.
//!
//! The invariant: a removed key, or a version older than the last acknowledged one, never
//! comes back. Every replica the master lists holds the version the model last
//! acknowledged, and a key the model saw removed (and not put again) is not listed at all.
//!
//! Before the fix, a free was told to its node exactly once: a lost ping reply left the
//! bytes of a removed key on a DRAM-only node, its cancel was acknowledged on the next ping,
//! and the next master adopted the removed key (the deterministic test below, and the
//! proptest within a few cases).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;

use kvtier_l3::master::{
    DiskLoc, EvictionOutcome, Master, MasterPolicy, NodeSync, RetainedObject, Settle,
};
use kvtier_l3::{ClientId, L3Error, ReplicaDescriptor, SegmentId, StoreConfig, Tenant};
use proptest::prelude::*;

const SIZE: u64 = 100;
const TTL_MS: u64 = 1_000;

fn tn() -> Tenant {
    Tenant::new("a").unwrap()
}

fn policy(capacity_objects: u64) -> (MasterPolicy, u64) {
    let cfg = StoreConfig {
        client_ttl: std::time::Duration::from_millis(TTL_MS),
        ..Default::default()
    };
    // objects of SIZE bytes under keys of up to 3 bytes, as charged (kvtier_l3::charge)
    (
        MasterPolicy::from_config(&cfg),
        capacity_objects * kvtier_l3::charge(SIZE, 3),
    )
}

/// One simulated store node.
#[derive(Debug, Default)]
struct Node {
    id: u64,
    /// Allocation → (key, version) of the bytes held, ended.
    held: BTreeMap<u64, (String, u64)>,
    /// SSD records by bucket (newest last): (location, key, version, live).
    records: BTreeMap<u64, (DiskLoc, String, u64, bool)>,
    next_bucket: u64,
    /// Every settle up to this one applied.
    settled: u64,
    /// Every free up to this one applied.
    freed: u64,
    /// Declared dead by the master and not mounted since (partitioned: keeps its bytes).
    away: bool,
    /// Its segment's capacity.
    capacity: u64,
}

impl Node {
    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 9000 + self.id as u16))
    }

    /// Applies a reply as `cluster/node/sync.rs` does: frees, then settles (durably), then
    /// moves its acknowledgements over the consecutive ones.
    fn apply(&mut self, s: &NodeSync) {
        let mut f = self.freed.max(s.frees_acked);
        for &(seq, a) in &s.freed {
            self.held.remove(&a);
            if seq == f + 1 {
                f = seq;
            }
        }
        self.freed = f;
        let mut a = self.settled.max(s.settled);
        for (seq, st) in &s.settles {
            match st {
                Settle::Tombstone(l) => {
                    if let Some(r) = self.records.get_mut(&l.bucket) {
                        r.3 = false;
                    }
                }
                Settle::Cancel { key, token, .. } => {
                    // Its DRAM copies of the version (and older ones) go before the ack.
                    self.held.retain(|_, (k, t)| !(k == key && *t <= *token));
                }
            }
            if *seq == a + 1 {
                a = *seq;
            }
        }
        self.settled = a;
    }

    fn ping(&mut self, m: &mut Master, now: u64, lost: bool) {
        let s = m.node_ping(ClientId(self.id), self.settled, self.freed, now);
        if lost {
            return;
        }
        if s.need_remount {
            self.mount(m, now);
        } else {
            self.apply(&s);
        }
    }

    /// Mounts (first time, after a failover, or after being declared dead): reports the DRAM
    /// replicas it kept and then its live SSD records, keeps what the master adopts.
    fn mount(&mut self, m: &mut Master, now: u64) {
        let cap = self.capacity;
        m.mount_node(ClientId(self.id), SegmentId(self.id), cap, self.addr(), now)
            .unwrap();
        self.away = false;
        self.settled = 0;
        self.freed = 0;
        let kept = std::mem::take(&mut self.held);
        let objects: Vec<RetainedObject> = kept
            .values()
            .map(|(k, tok)| RetainedObject {
                tenant: tn(),
                key: k.clone(),
                token: *tok,
                size: SIZE,
                crc: *tok as u32,
                disk: self
                    .records
                    .values()
                    .rev()
                    .find(|(_, rk, _, live)| rk == k && *live)
                    .filter(|(_, _, rt, _)| rt == tok)
                    .map(|(l, ..)| *l),
            })
            .collect();
        let got = m.adopt_all(ClientId(self.id), &objects);
        for ((_, (k, tok)), a) in kept.into_iter().zip(got) {
            if let Some(a) = a {
                self.held.insert(a, (k, tok));
            }
        }
        let live: Vec<(DiskLoc, String)> = (self.records.values())
            .filter(|r| r.3)
            .map(|r| (r.0, r.1.clone()))
            .collect();
        for (l, k) in live {
            if !m.register_rescanned(ClientId(self.id), &tn(), &k, l)
                && let Some(r) = self.records.get_mut(&l.bucket)
            {
                r.3 = false;
            }
        }
    }
}

/// A cluster of simulated nodes around one master.
struct Sim {
    m: Master,
    policy: MasterPolicy,
    nodes: Vec<Node>,
    now: u64,
    /// Key → version last acknowledged (None: removed).
    model: HashMap<String, Option<u64>>,
}

impl Sim {
    fn new(nodes: u64, capacity_objects: u64) -> Self {
        let (policy, cap) = policy(capacity_objects);
        let mut m = Master::new(policy.clone());
        m.keep_settle_log();
        let mut nodes: Vec<Node> = (1..=nodes)
            .map(|id| Node {
                id,
                capacity: cap,
                ..Default::default()
            })
            .collect();
        for n in &mut nodes {
            n.mount(&mut m, 0);
        }
        Sim {
            m,
            policy,
            nodes,
            now: 0,
            model: HashMap::new(),
        }
    }

    fn node_of(&mut self, d: &ReplicaDescriptor) -> Option<&mut Node> {
        let ReplicaDescriptor::Memory { segment, .. } = d else {
            return None;
        };
        self.nodes.iter_mut().find(|n| n.id == segment.0)
    }

    /// Puts a new version of `key` (removing the current one first: a replace), `replicas`
    /// memory replicas, every node told of its replica's end at once.
    fn put(&mut self, key: &str, replicas: usize) {
        self.now += 1;
        if self.m.exists(&tn(), key) {
            self.remove(key);
        }
        let mut out = EvictionOutcome::default();
        let Ok(h) = self
            .m
            .put_start(&tn(), key, SIZE, replicas, self.now, &mut out)
        else {
            return;
        };
        let descs: Vec<ReplicaDescriptor> = h.replicas().cloned().collect();
        for d in &descs {
            let ReplicaDescriptor::Memory { alloc, .. } = d else {
                unreachable!()
            };
            let node = self.node_of(d).expect("placed on a known node");
            node.held.insert(*alloc, (key.to_string(), h.token));
        }
        for d in &descs {
            let id = self.node_of(d).map(|n| n.id).expect("known node");
            let mut hd = h.clone();
            hd.replica = d.clone();
            self.m
                .end_replica(ClientId(id), &hd, false, self.now)
                .unwrap();
        }
        self.model.insert(key.to_string(), Some(h.token));
    }

    fn remove(&mut self, key: &str) {
        self.now += 1;
        // "Not found" tells the client the key is gone as surely as a remove does.
        match self.m.remove(&tn(), key, true, self.now) {
            Ok(_) | Err(L3Error::ObjectNotFound) => {
                self.model.insert(key.to_string(), None);
            }
            Err(e) => panic!("remove {key}: {e}"),
        }
    }

    /// The node holding the key's first DRAM replica writes and registers an SSD copy.
    fn persist(&mut self, key: &str) {
        let Ok((allocs, None)) = self.m.current_replicas(&tn(), key) else {
            return;
        };
        let Some(Some(tok)) = self.model.get(key).copied() else {
            return;
        };
        let Some(&a) = allocs.first() else {
            return;
        };
        let Some(n) = self.nodes.iter_mut().find(|n| n.held.contains_key(&a)) else {
            return;
        };
        n.next_bucket += 1;
        let loc = DiskLoc {
            bucket: n.next_bucket + 1000 * n.id,
            offset: 0,
            size: SIZE,
            crc: tok as u32,
        };
        let live = self.m.register_disk(ClientId(n.id), &tn(), key, tok, loc);
        n.records
            .insert(loc.bucket, (loc, key.to_string(), tok, live));
    }

    /// A put-end reply (no handles) to `node`, maybe lost.
    fn put_end_sync(&mut self, node: usize, lost: bool) {
        let n = &mut self.nodes[node];
        if n.away {
            return;
        }
        let s = self.m.node_sync(ClientId(n.id));
        if !lost {
            n.apply(&s);
        }
    }

    fn ping(&mut self, node: usize, lost: bool) {
        self.now += 1;
        self.nodes[node].ping(&mut self.m, self.now, lost);
    }

    /// `node` stops pinging past the TTL (partitioned, it keeps its memory) while the
    /// others ping: the master declares it dead.
    fn declare_dead(&mut self, node: usize) {
        self.now += TTL_MS + 1;
        for i in 0..self.nodes.len() {
            if i != node && !self.nodes[i].away {
                self.nodes[i].ping(&mut self.m, self.now, false);
            }
        }
        self.m.sweep(self.now);
        self.nodes[node].away = true;
    }

    /// The master dies; a new one starts from its settle state (what etcd holds) and every
    /// node mounts on it, reporting what it kept.
    fn failover(&mut self) {
        self.now += 1;
        let state = self.m.settle_snapshot();
        let mut m = Master::new(self.policy.clone());
        m.keep_settle_log();
        m.restore_settles(state);
        self.m = m;
        for n in &mut self.nodes {
            n.mount(&mut self.m, self.now);
        }
    }

    /// Every replica the master lists holds the model's version; a removed key is absent.
    fn check(&self) -> Result<(), String> {
        self.m.check_census()?;
        for (key, want) in &self.model {
            let Ok((allocs, disk)) = self.m.current_replicas(&tn(), key) else {
                continue;
            };
            let Some(want) = want else {
                return Err(format!("{key}: removed, but listed ({allocs:?}, {disk:?})"));
            };
            for a in &allocs {
                let got = self.nodes.iter().find_map(|n| n.held.get(a));
                match got {
                    Some((k, t)) if k == key && t == want => {}
                    other => {
                        return Err(format!(
                            "{key}: replica {a} holds {other:?}, want version {want}"
                        ));
                    }
                }
            }
            if let Some(l) = disk {
                let got = self.nodes.iter().find_map(|n| n.records.get(&l.bucket));
                match got {
                    Some((gl, k, t, true)) if *gl == l && k == key && t == want => {}
                    other => {
                        return Err(format!(
                            "{key}: SSD copy {l:?} holds {other:?}, want version {want}"
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Issue 33's reproduction, in-process: a DRAM-only node misses the reply carrying the free
/// of a removed key (its ping timed out at a paused leader), acknowledges the cancel on its
/// next ping, and the next leader adopts the key it kept. Failed before: the free was
/// handed out once, so the node kept the bytes and the new master listed the removed key.
#[test]
fn a_remove_whose_free_reply_was_lost_does_not_come_back_after_a_failover() {
    let mut s = Sim::new(1, 16);
    for i in 0..6 {
        s.put(&format!("k{i}"), 1);
    }
    for i in 0..6 {
        s.remove(&format!("k{i}"));
    }
    s.ping(0, true);
    for _ in 0..3 {
        s.ping(0, false);
    }
    assert_eq!(
        s.m.unsettled(ClientId(1)),
        0,
        "the cancels were acknowledged"
    );
    assert!(
        s.nodes[0].held.is_empty(),
        "the node still holds removed bytes: {:?}",
        s.nodes[0].held
    );
    s.failover();
    for i in 0..6 {
        assert!(!s.m.exists(&tn(), &format!("k{i}")), "k{i} came back");
    }
    s.check().unwrap();
}

/// The same with a version that stays alive when its DRAM replica goes (evicted to its SSD
/// copy): the free of that replica is lost, the key is removed later (a tombstone to the
/// SSD node only), and the next master must not adopt the DRAM bytes the node kept.
#[test]
fn an_evicted_replica_whose_free_was_lost_does_not_bring_a_removed_key_back() {
    let mut s = Sim::new(1, 4);
    s.put("old", 1);
    s.persist("old");
    // Fill DRAM: "old" (least recently used) loses its DRAM replica, keeps its SSD copy.
    for i in 0..8 {
        s.put(&format!("f{i}"), 1);
    }
    assert!(s.m.mem_replicas(&tn(), "old") == 0 && s.m.on_disk(&tn(), "old"));
    s.ping(0, true);
    s.remove("old");
    for _ in 0..3 {
        s.ping(0, false);
    }
    s.failover();
    assert!(!s.m.exists(&tn(), "old"), "the removed key came back");
    s.check().unwrap();
}

/// The documented dead-node gap, closed: a node declared dead while only partitioned keeps
/// its memory; a key it held is removed while it is away (its other holder acknowledges
/// the cancel); at the next master the away node reports the key and must be refused.
#[test]
fn a_node_declared_dead_while_partitioned_does_not_bring_a_removed_key_back() {
    let mut s = Sim::new(2, 16);
    s.put("k", 2);
    // The second replica's node: the first one's (the put's writer) is sent a cancel anyway.
    s.declare_dead(1);
    assert!(s.nodes[1].held.values().any(|(k, _)| k == "k"));
    s.remove("k");
    for _ in 0..3 {
        s.ping(0, false);
    }
    s.failover();
    assert!(!s.m.exists(&tn(), "k"), "the removed key came back");
    s.check().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Put { key: u8, replicas: usize },
    Remove { key: u8 },
    Persist { key: u8 },
    Ping { node: usize, lost: bool },
    PutEndSync { node: usize, lost: bool },
    DeclareDead { node: usize },
    Failover,
}

fn op(nodes: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..8, 1usize..=2).prop_map(|(key, replicas)| Op::Put { key, replicas }),
        3 => (0u8..8).prop_map(|key| Op::Remove { key }),
        2 => (0u8..8).prop_map(|key| Op::Persist { key }),
        6 => (0..nodes, any::<bool>()).prop_map(|(node, lost)| Op::Ping { node, lost }),
        2 => (0..nodes, any::<bool>()).prop_map(|(node, lost)| Op::PutEndSync { node, lost }),
        1 => (0..nodes).prop_map(|node| Op::DeclareDead { node }),
        1 => Just(Op::Failover),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random puts (1–2 replicas, small segments so DRAM eviction runs), removes, SSD copies,
    /// pings and put-end replies that are lost or applied, nodes declared dead while
    /// partitioned, and failovers: no removed key and no old version ever comes back, on the
    /// live master or on the next one.
    #[test]
    fn no_removed_key_or_old_version_comes_back(ops in proptest::collection::vec(op(3), 1..80)) {
        let mut s = Sim::new(3, 5);
        for o in ops {
            match o {
                Op::Put { key, replicas } => s.put(&format!("k{key}"), replicas),
                Op::Remove { key } => s.remove(&format!("k{key}")),
                Op::Persist { key } => s.persist(&format!("k{key}")),
                Op::Ping { node, lost } => s.ping(node, lost),
                Op::PutEndSync { node, lost } => s.put_end_sync(node, lost),
                Op::DeclareDead { node } => s.declare_dead(node),
                Op::Failover => s.failover(),
            }
            prop_assert!(s.check().is_ok(), "{:?}", s.check());
        }
        s.failover();
        prop_assert!(s.check().is_ok(), "after the last failover: {:?}", s.check());
    }
}

// ---- offload-on-evict: orders that ride with their frees ---------------------------------------

/// A node applies ping replies and put-end replies on different threads, in either order.
/// Every reply that frees an allocation staged on the node for its SSD write must therefore
/// also carry the order to stage it (`offload`): a node that applies a bare free first drops
/// bytes the master goes on serving from it. Checked over every reply handed out.
fn offloads_ride_with_their_frees(replies: &[NodeSync]) -> Result<(), String> {
    let staged: HashSet<u64> = replies
        .iter()
        .flat_map(|r| r.offload.iter().copied())
        .collect();
    for (i, r) in replies.iter().enumerate() {
        for (_, a) in &r.freed {
            if staged.contains(a) && !r.offload.contains(a) {
                return Err(format!(
                    "reply {i} frees allocation {a}, staged for offload, without staging it: {r:?}"
                ));
            }
        }
    }
    Ok(())
}

/// The CI failure of `node_tiers`' on-evict test (an object read back as ObjectNotFound right
/// after it was evicted): the put-end reply carried the free and the offload of an evicted
/// replica, the next ping reply the free alone; the node applied the ping reply first and
/// dropped the bytes. Failed before: the offload order went out once.
#[test]
fn a_ping_reply_freeing_a_staged_replica_also_stages_it() {
    let mut s = Sim::new(1, 4);
    s.m.set_node_offload(ClientId(1), true);
    for i in 0..6 {
        s.put(&format!("k{i}"), 1);
    }
    let put_end = s.m.node_sync(ClientId(1));
    assert!(
        !put_end.offload.is_empty(),
        "nothing was evicted: {put_end:?}"
    );
    s.now += 1;
    let (applied, freed) = (s.nodes[0].settled, s.nodes[0].freed);
    let ping = s.m.node_ping(ClientId(1), applied, freed, s.now);
    assert!(
        put_end
            .offload
            .iter()
            .all(|a| ping.freed.iter().any(|(_, f)| f == a)),
        "the ping reply repeats the unacknowledged frees: {ping:?}"
    );
    offloads_ride_with_their_frees(&[put_end, ping]).unwrap();
}

#[derive(Debug, Clone)]
enum OffloadOp {
    Put {
        key: u8,
    },
    Remove {
        key: u8,
    },
    /// A ping whose reply is applied (acknowledging what it freed) or lost.
    Ping {
        applied: bool,
    },
    PutEndSync,
}

fn offload_op() -> impl Strategy<Value = OffloadOp> {
    prop_oneof![
        6 => (0u8..12).prop_map(|key| OffloadOp::Put { key }),
        2 => (0u8..12).prop_map(|key| OffloadOp::Remove { key }),
        3 => any::<bool>().prop_map(|applied| OffloadOp::Ping { applied }),
        3 => Just(OffloadOp::PutEndSync),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random puts past capacity (evictions staged on an offload-on-evict node), removes,
    /// pings (applied or lost) and put-end replies: every reply that frees a staged
    /// allocation also orders it staged, so the order the node applies them in cannot
    /// lose the bytes.
    #[test]
    fn every_reply_freeing_a_staged_replica_stages_it(
        ops in proptest::collection::vec(offload_op(), 1..80),
    ) {
        let mut s = Sim::new(1, 4);
        s.m.set_node_offload(ClientId(1), true);
        let mut replies = Vec::new();
        for o in ops {
            match o {
                OffloadOp::Put { key } => s.put(&format!("k{key}"), 1),
                OffloadOp::Remove { key } => s.remove(&format!("k{key}")),
                OffloadOp::Ping { applied } => {
                    s.now += 1;
                    let n = &s.nodes[0];
                    let r = s.m.node_ping(ClientId(1), n.settled, n.freed, s.now);
                    if applied {
                        s.nodes[0].apply(&r);
                    }
                    replies.push(r);
                }
                OffloadOp::PutEndSync => replies.push(s.m.node_sync(ClientId(1))),
            }
        }
        prop_assert!(offloads_ride_with_their_frees(&replies).is_ok(), "{:?}",
            offloads_ride_with_their_frees(&replies));
    }
}
