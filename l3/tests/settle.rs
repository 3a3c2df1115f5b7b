//! Settlement of removes with store nodes (split deployment), on a real in-process
//! [`ClusterMaster`] driven through its `cluster` requests exactly as a node drives it: a
//! removed or replaced object version must never come back through a node's restart rescan,
//! whatever the node had heard of it when it crashed.

use std::net::SocketAddr;
use std::sync::Arc;

use proptest::prelude::*;

mod common;

use common::t;
use kvtier_l3::master::{DiskLoc, NodeSync, Settle};
use kvtier_l3::rpc::service::{ClusterReply, ClusterRequest};
use kvtier_l3::{
    ClientId, ClusterMaster, L3Error, L3Store, PutHandle, ReplicaDescriptor, ReplicateConfig,
    SegmentId, StoreConfig, Tenant,
};

const N1: ClientId = ClientId(1);
const N2: ClientId = ClientId(2);
const SIZE: u64 = 4096;

fn cm() -> Arc<ClusterMaster> {
    ClusterMaster::new(StoreConfig {
        local_segment_bytes: 0,
        ..Default::default()
    })
    .unwrap()
}

/// A master keeping its settles in `dir` (replayed if the log is there).
fn cm_in(dir: &std::path::Path) -> Arc<ClusterMaster> {
    ClusterMaster::open(
        StoreConfig {
            local_segment_bytes: 0,
            ..Default::default()
        },
        Some(dir),
    )
    .unwrap()
}

/// A node (re)joins: its memory segment is empty (a restart).
fn mount(cm: &ClusterMaster, node: ClientId, capacity: u64) {
    let addr: SocketAddr = format!("127.0.0.1:{}", 40_000 + node.0).parse().unwrap();
    cm.handle(ClusterRequest::MountNode {
        node,
        segment: SegmentId(node.0),
        capacity,
        data_addr: addr,
        offload_on_evict: false,
    })
    .unwrap();
}

/// A complete put of `key`, its bytes held by `node` (write-through: its SSD copy pending).
fn put(cm: &ClusterMaster, node: ClientId, tn: &Tenant, key: &str) -> PutHandle {
    let h = cm
        .batch_put_start_with(tn, &[key.to_string()], &[SIZE], ReplicateConfig::default())
        .unwrap()
        .remove(0)
        .unwrap();
    let on = match &h.replica {
        ReplicaDescriptor::Memory { node: Some(n), .. } => n.id,
        other => panic!("{other:?}"),
    };
    assert_eq!(on, node, "placed on another node than the test meant");
    let reply = cm
        .handle(ClusterRequest::PutEndReplicas {
            node,
            handles: vec![h.clone()],
            soft_pin: false,
        })
        .unwrap();
    let ClusterReply::EndedReplicas(res, _) = reply else {
        panic!("{reply:?}")
    };
    let ended = res[0].as_ref().unwrap();
    assert!(ended.complete && ended.primary);
    h
}

fn register(cm: &ClusterMaster, node: ClientId, h: &PutHandle, loc: DiskLoc) -> bool {
    let reply = cm
        .handle(ClusterRequest::RegisterDisk {
            node,
            items: vec![(h.tenant.clone(), h.key.clone(), h.token, loc)],
        })
        .unwrap();
    let ClusterReply::Accepted(v) = reply else {
        panic!("{reply:?}")
    };
    v[0]
}

fn rescanned(cm: &ClusterMaster, node: ClientId, tn: &Tenant, key: &str, loc: DiskLoc) -> bool {
    let reply = cm
        .handle(ClusterRequest::Rescanned {
            node,
            disks: vec![(tn.clone(), key.to_string(), loc)],
        })
        .unwrap();
    let ClusterReply::Accepted(v) = reply else {
        panic!("{reply:?}")
    };
    v[0]
}

/// A ping acknowledging every settle up to `applied` (and no free: these nodes hold no
/// bytes).
fn ping(cm: &ClusterMaster, node: ClientId, applied: u64) -> NodeSync {
    match cm
        .handle(ClusterRequest::Ping {
            node,
            applied,
            freed: 0,
        })
        .unwrap()
    {
        ClusterReply::Sync(s) => s,
        other => panic!("{other:?}"),
    }
}

/// The sync a put-end reply carries (no handles).
fn put_end_sync(cm: &ClusterMaster, node: ClientId) -> NodeSync {
    match cm
        .handle(ClusterRequest::PutEndReplicas {
            node,
            handles: vec![],
            soft_pin: false,
        })
        .unwrap()
    {
        ClusterReply::EndedReplicas(_, s) => s,
        other => panic!("{other:?}"),
    }
}

fn loc(bucket: u64) -> DiskLoc {
    DiskLoc {
        bucket,
        offset: 64,
        size: SIZE,
        crc: 0xC0FFEE,
    }
}

fn disk_replicas(cm: &ClusterMaster, tn: &Tenant, key: &str) -> Vec<DiskLoc> {
    match cm.get_replica_list(tn, key) {
        Ok(q) => q
            .replicas
            .iter()
            .filter_map(DiskLoc::from_descriptor)
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Bug 1: the remove is acknowledged while the node's write-through copy is queued; the
/// node publishes the bucket and crashes before registering it. Its restart rescan must not
/// bring the key back.
#[test]
fn remove_while_ssd_write_pending_refuses_the_rescanned_record() {
    let cm = cm();
    let a = t("a");
    mount(&cm, N1, 64 << 20);
    put(&cm, N1, &a, "k");
    cm.remove(&a, "k", false).unwrap();
    // Crash after the rename, before `RegisterDisk`: restart, rescan.
    mount(&cm, N1, 64 << 20);
    assert!(
        !rescanned(&cm, N1, &a, "k", loc(1)),
        "removed key re-registered"
    );
    assert!(matches!(cm.get_size(&a, "k"), Err(L3Error::ObjectNotFound)));
}

/// Bug 1, worse: the key was replaced meanwhile by a newer version of the same size with no
/// disk copy (on another node). The old record must not become the new version's disk copy.
#[test]
fn replaced_version_never_adopts_the_old_record() {
    let cm = cm();
    let a = t("a");
    mount(&cm, N1, 64 << 20);
    put(&cm, N1, &a, "k");
    cm.remove(&a, "k", false).unwrap();
    mount(&cm, N2, 128 << 20);
    put(&cm, N2, &a, "k");
    mount(&cm, N1, 64 << 20);
    assert!(!rescanned(&cm, N1, &a, "k", loc(1)), "old record adopted");
    assert!(disk_replicas(&cm, &a, "k").is_empty());
    // The new version is still served from its memory replica.
    assert_eq!(cm.get_size(&a, "k").unwrap(), SIZE);
}

/// Bug 2: the tombstone of a removed object's registered SSD copy is delivered on a ping,
/// but the node crashes before its tombstone is durable: the master must still refuse.
#[test]
fn delivered_but_unacknowledged_tombstone_still_refuses() {
    let cm = cm();
    let a = t("a");
    mount(&cm, N1, 64 << 20);
    let h = put(&cm, N1, &a, "k");
    assert!(register(&cm, N1, &h, loc(1)));
    cm.remove(&a, "k", false).unwrap();
    let s = ping(&cm, N1, 0);
    assert!(!s.need_remount);
    // The tombstone of its SSD copy, and the cancel of its memory replica's version (the node
    // keeps memory across a remount; issue 22).
    let cancel = Settle::Cancel {
        tenant: a.clone(),
        key: "k".into(),
        token: h.token,
    };
    assert_eq!(s.settles, vec![(1, Settle::Tombstone(loc(1))), (2, cancel)]);
    // Crash before the tombstone is durable; restart, rescan.
    mount(&cm, N1, 64 << 20);
    assert!(
        !rescanned(&cm, N1, &a, "k", loc(1)),
        "removed key re-registered"
    );
    assert!(matches!(cm.get_size(&a, "k"), Err(L3Error::ObjectNotFound)));
}

/// The same with a cancel that *was* acknowledged (so the master no longer knows the old
/// version): the old record is still never attached to the newer version, because nothing
/// proves which version a rescanned record holds.
#[test]
fn acknowledged_cancel_still_never_adopts_the_old_record() {
    let cm = cm();
    let a = t("a");
    mount(&cm, N1, 64 << 20);
    let old = put(&cm, N1, &a, "k");
    cm.remove(&a, "k", false).unwrap();
    let s = ping(&cm, N1, 0);
    let cancel = Settle::Cancel {
        tenant: a.clone(),
        key: "k".into(),
        token: old.token,
    };
    assert_eq!(s.settles, vec![(1, cancel)]);
    assert!(ping(&cm, N1, 1).settles.is_empty());
    assert_eq!(cm.unsettled(N1), 0);
    mount(&cm, N2, 128 << 20);
    put(&cm, N2, &a, "k");
    mount(&cm, N1, 64 << 20);
    assert!(!rescanned(&cm, N1, &a, "k", loc(1)), "old record adopted");
    assert!(disk_replicas(&cm, &a, "k").is_empty());
}

/// Settles stay until acknowledged: every ping repeats the unacknowledged ones, a put-end
/// reply carries only new ones, a remount hands all of them out again, an acknowledgement
/// drops exactly those up to its number (one past what was issued is ignored), and once
/// they are gone a re-put key's fresh record registers (and re-registers) normally.
#[test]
fn settles_repeat_until_acknowledged_then_go() {
    let cm = cm();
    let a = t("a");
    mount(&cm, N1, 64 << 20);
    let h1 = put(&cm, N1, &a, "k1");
    assert!(register(&cm, N1, &h1, loc(1)));
    let h2 = put(&cm, N1, &a, "k2");
    cm.remove(&a, "k1", false).unwrap();
    cm.remove(&a, "k2", false).unwrap();
    // k1: its SSD copy's tombstone and its memory replica's cancel (issue 22); k2: the
    // cancel of its write and of its memory replica (one order: the same node).
    let want = vec![
        (1, Settle::Tombstone(loc(1))),
        (
            2,
            Settle::Cancel {
                tenant: a.clone(),
                key: "k1".into(),
                token: h1.token,
            },
        ),
        (
            3,
            Settle::Cancel {
                tenant: a.clone(),
                key: "k2".into(),
                token: h2.token,
            },
        ),
    ];
    assert_eq!(ping(&cm, N1, 0).settles, want);
    assert_eq!(ping(&cm, N1, 0).settles, want, "a ping repeats them");
    // A put end's reply carries only what was not handed out yet.
    assert!(put_end_sync(&cm, N1).settles.is_empty());
    // Remount: all again, even on a put end.
    mount(&cm, N1, 64 << 20);
    assert_eq!(put_end_sync(&cm, N1).settles, want);
    // An acknowledgement past what was issued is ignored; a partial one drops the first.
    assert_eq!(ping(&cm, N1, 4).settles, want);
    let s = ping(&cm, N1, 1);
    assert_eq!(s.settles, want[1..].to_vec());
    assert_eq!(s.settled, 1);
    assert!(
        !rescanned(&cm, N1, &a, "k2", loc(2)),
        "cancel not acknowledged yet"
    );
    let s = ping(&cm, N1, 3);
    assert!(s.settles.is_empty());
    assert_eq!(s.settled, 3);
    assert_eq!(cm.unsettled(N1), 0);
    // Re-put: its fresh record registers, and after a restart re-registers.
    let h = put(&cm, N1, &a, "k2");
    assert!(register(&cm, N1, &h, loc(3)));
    mount(&cm, N1, 64 << 20);
    assert!(rescanned(&cm, N1, &a, "k2", loc(3)));
    assert_eq!(disk_replicas(&cm, &a, "k2"), vec![loc(3)]);
    // And a record of a key unknown to the master with nothing to settle is adopted.
    assert!(rescanned(&cm, N1, &a, "fresh", loc(4)));
}

// ---- property: a simulated node against the real master ----------------------------------

/// What a store node does, reduced to what settlement depends on.
#[derive(Debug, Clone)]
enum Op {
    /// Put a key (its write-through copy announced before the end reaches the master).
    Put(usize),
    /// Remove a key.
    Remove(usize),
    /// Remove, then put a newer version of the same size.
    Replace(usize),
    /// The writer publishes the oldest queued write of a key, then registers it.
    Write(usize),
    /// The writer publishes it, and the node crashes before registering it.
    WriteThenCrash(usize),
    /// A ping: acknowledge what was applied, apply what the reply carries.
    Ping,
    /// The node crashes (queued writes and unacknowledged progress lost) and restarts:
    /// mount, rescan every live record.
    Crash,
    /// The master is restarted on its state dir; the node is told to remount (cancelling
    /// the writes it announced before, rescanning its live records), then pings.
    MasterRestart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..KEYS).prop_map(Op::Put),
        (0..KEYS).prop_map(Op::Remove),
        (0..KEYS).prop_map(Op::Replace),
        (0..KEYS).prop_map(Op::Write),
        (0..KEYS).prop_map(Op::WriteThenCrash),
        Just(Op::Ping),
        Just(Op::Crash),
        Just(Op::MasterRestart),
    ]
}

const KEYS: usize = 3;

struct Record {
    key: String,
    version: u64,
    alive: bool,
}

/// The simulated node and what the test knows.
struct Sim {
    cm: Arc<ClusterMaster>,
    /// The master's state dir.
    state: std::path::PathBuf,
    tn: Tenant,
    /// Announced writes not cancelled: (key, token, version).
    queued: Vec<(String, u64, u64)>,
    /// Bucket id → its one record.
    disk: std::collections::BTreeMap<u64, Record>,
    applied: u64,
    next_version: u64,
    /// Memory allocation → version.
    mem: std::collections::HashMap<u64, u64>,
    /// The only version each key may show (None: removed).
    current: Vec<Option<u64>>,
    /// Versions removed or replaced: never readable again.
    dead: std::collections::HashSet<u64>,
}

impl Sim {
    fn key(i: usize) -> String {
        format!("k{i}")
    }

    fn apply(&mut self, s: &NodeSync) {
        for (_, st) in &s.settles {
            match st {
                Settle::Tombstone(l) => {
                    if let Some(r) = self.disk.get_mut(&l.bucket) {
                        r.alive = false;
                    }
                }
                Settle::Cancel { key, token, .. } => {
                    self.queued.retain(|(k, t, _)| !(k == key && t <= token));
                }
            }
        }
        let mut a = self.applied.max(s.settled);
        for (n, _) in &s.settles {
            if *n == a + 1 {
                a = *n;
            }
        }
        self.applied = a;
    }

    fn put(&mut self, i: usize) {
        let key = Self::key(i);
        let h = match self
            .cm
            .batch_put_start_with(
                &self.tn,
                std::slice::from_ref(&key),
                &[SIZE],
                ReplicateConfig::default(),
            )
            .unwrap()
            .remove(0)
        {
            Ok(h) => h,
            Err(L3Error::ObjectAlreadyExists) => return,
            Err(e) => panic!("{e:?}"),
        };
        self.next_version += 1;
        let v = self.next_version;
        if let Some(old) = self.current[i].replace(v) {
            // Lost meanwhile (memory only, node restarted): superseded.
            self.dead.insert(old);
        }
        if let ReplicaDescriptor::Memory { alloc, .. } = h.replica {
            self.mem.insert(alloc, v);
        }
        self.queued.push((key, h.token, v));
        let reply = self
            .cm
            .handle(ClusterRequest::PutEndReplicas {
                node: N1,
                handles: vec![h],
                soft_pin: false,
            })
            .unwrap();
        let ClusterReply::EndedReplicas(res, s) = reply else {
            panic!("{reply:?}")
        };
        assert!(res[0].is_ok());
        self.apply(&s);
    }

    fn remove(&mut self, i: usize) {
        if self.cm.remove(&self.tn, &Self::key(i), true).is_ok() {
            let v = self.current[i]
                .take()
                .expect("removed a key the model lost");
            self.dead.insert(v);
        }
    }

    /// Publishes the oldest queued write of key `i` in a new bucket; returns its location.
    fn publish(&mut self, i: usize) -> Option<(u64, DiskLoc)> {
        let key = Self::key(i);
        let at = self.queued.iter().position(|(k, _, _)| *k == key)?;
        let (key, token, version) = self.queued.remove(at);
        let bucket = self.disk.keys().next_back().map_or(1, |b| b + 1);
        self.disk.insert(
            bucket,
            Record {
                key,
                version,
                alive: true,
            },
        );
        Some((token, loc(bucket)))
    }

    fn write(&mut self, i: usize) {
        let Some((token, l)) = self.publish(i) else {
            return;
        };
        let reply = self
            .cm
            .handle(ClusterRequest::RegisterDisk {
                node: N1,
                items: vec![(self.tn.clone(), Self::key(i), token, l)],
            })
            .unwrap();
        let ClusterReply::Accepted(v) = reply else {
            panic!("{reply:?}")
        };
        if !v[0] {
            self.disk.get_mut(&l.bucket).unwrap().alive = false;
        }
    }

    fn ping(&mut self) {
        let s = ping(&self.cm, N1, self.applied);
        assert!(!s.need_remount);
        self.apply(&s);
    }

    /// The master restarts: memory-only versions are gone, versions with a live record the
    /// master re-adopts stay current, and the node's writes announced before its remount
    /// are cancelled by it (`SsdTier::cancel_before_mount`).
    fn restart_master(&mut self) {
        self.cm.shutdown();
        self.cm = cm_in(&self.state);
        let s = ping(&self.cm, N1, self.applied);
        assert!(s.need_remount);
        self.crash();
        self.ping();
        for i in 0..KEYS {
            let Some(v) = self.current[i] else { continue };
            let on_disk = self.disk.values().any(|r| r.alive && r.version == v);
            if !on_disk {
                self.current[i] = None;
                self.dead.insert(v);
            }
        }
    }

    fn crash(&mut self) {
        self.queued.clear();
        self.applied = 0;
        self.mem.clear();
        mount(&self.cm, N1, 64 << 20);
        let live: Vec<u64> = self
            .disk
            .iter()
            .filter(|(_, r)| r.alive)
            .map(|(b, _)| *b)
            .collect();
        for b in live.into_iter().rev() {
            let key = self.disk[&b].key.clone();
            if !rescanned(&self.cm, N1, &self.tn, &key, loc(b)) {
                self.disk.get_mut(&b).unwrap().alive = false;
            }
        }
    }

    /// What each key reads as must be its current version, never a dead one.
    fn check(&self) -> Result<(), TestCaseError> {
        for i in 0..KEYS {
            let key = Self::key(i);
            let q = match self.cm.get_replica_list(&self.tn, &key) {
                Ok(q) => q,
                Err(L3Error::ObjectNotFound) => continue,
                Err(e) => return Err(TestCaseError::fail(format!("{key}: {e:?}"))),
            };
            let seen = match &q.replicas[0] {
                ReplicaDescriptor::Memory { alloc, .. } => self.mem[alloc],
                d => {
                    let l = DiskLoc::from_descriptor(d).unwrap();
                    let r = &self.disk[&l.bucket];
                    prop_assert!(
                        r.alive && r.key == key,
                        "{key} names a dead or foreign record"
                    );
                    r.version
                }
            };
            prop_assert!(
                !self.dead.contains(&seen),
                "{key}: dropped version {seen} is back"
            );
            prop_assert_eq!(self.current[i], Some(seen), "{}", key);
        }
        Ok(())
    }
}

/// Put tokens are never reused across a restart of a master with a state dir: a write of
/// the previous incarnation's version still queued on the node must not be registered as
/// the copy of a new version that happens to get the same token (found by a proptest with
/// master restarts: tokens restarted at 1, and the old bytes became the new version's copy).
#[test]
fn a_restarted_master_never_reuses_a_put_token() {
    let state = tempfile::tempdir().unwrap();
    let tn = t("tok");
    let old = {
        let cm = cm_in(state.path());
        mount(&cm, N1, 64 << 20);
        let h = put(&cm, N1, &tn, "k");
        cm.shutdown();
        h
    };
    let cm = cm_in(state.path());
    mount(&cm, N1, 64 << 20);
    // Its first ping after the mount: the rescan is done, the restarted master serves.
    ping(&cm, N1, 0);
    let new = put(&cm, N1, &tn, "k");
    assert!(
        new.token > old.token,
        "token {} reused after the restart (previous incarnation handed out {})",
        new.token,
        old.token
    );
    // The old version's queued write reaches the new master: refused, not adopted.
    let reply = cm
        .handle(ClusterRequest::RegisterDisk {
            node: N1,
            items: vec![(tn.clone(), "k".into(), old.token, loc(77))],
        })
        .unwrap();
    let ClusterReply::Accepted(v) = reply else {
        panic!("{reply:?}")
    };
    assert!(
        !v[0],
        "the previous incarnation's write became the new version's copy"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    /// Random puts, removes, replacements, SSD writes (some cut by a crash before their
    /// registration), pings, node crashes and master restarts: a removed or replaced version is never readable
    /// again, and once the node has pinged twice without crashing every settle is
    /// acknowledged and gone.
    #[test]
    fn dropped_versions_never_return_and_settles_drain(ops in proptest::collection::vec(op(), 1..48)) {
        let state = tempfile::tempdir().unwrap();
        let cm = cm_in(state.path());
        mount(&cm, N1, 64 << 20);
        let mut sim = Sim {
            cm,
            state: state.path().to_path_buf(),
            tn: t("p"),
            queued: Vec::new(),
            disk: Default::default(),
            applied: 0,
            next_version: 0,
            mem: Default::default(),
            current: vec![None; KEYS],
            dead: Default::default(),
        };
        for op in ops {
            match op {
                Op::Put(i) => sim.put(i),
                Op::Remove(i) => sim.remove(i),
                Op::Replace(i) => {
                    sim.remove(i);
                    sim.put(i);
                }
                Op::Write(i) => sim.write(i),
                Op::WriteThenCrash(i) => {
                    sim.publish(i);
                    sim.crash();
                }
                Op::Ping => sim.ping(),
                Op::Crash => sim.crash(),
                Op::MasterRestart => sim.restart_master(),
            }
            sim.check()?;
        }
        sim.ping();
        sim.ping();
        prop_assert_eq!(sim.cm.unsettled(N1), 0);
        prop_assert!(ping(&sim.cm, N1, sim.applied).settles.is_empty());
    }
}
