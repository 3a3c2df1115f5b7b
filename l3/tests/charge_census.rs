//! Charges stay exact (`segment.rs`: each memory replica is charged its value, its key twice
//! and `OBJECT_OVERHEAD_BYTES`), on any sequence of what moves DRAM: puts (ended, left
//! pending, revoked by the sweeper), removes, evictions (by puts, by quotas, asked for,
//! staged in offload-on-evict mode), SSD copies registered and dropped, promotions, replica
//! copies, moves and clears, segments unmounted and mounted again, store nodes leaving,
//! dying and joining, and a master restart that adopts what the nodes kept — with keys of 1
//! byte to 4 KB and values of 1 byte to 48 KiB, over two tenants, one under a DRAM quota.
//!
//! After every operation:
//! - `check_census`: every segment's `used` is the sum of its allocations' charges, every
//!   memory replica is an allocation of its own charged as its object's footprint, nothing
//!   else is allocated, and every tenant's DRAM bytes are its objects' charges × memory
//!   replicas;
//! - the same counted from outside: Σ `kvtier_l3::charge(size, key length)` × memory
//!   replicas over the keys the test put is each tenant's DRAM bytes, and over both tenants
//!   the store's `mem_used_bytes`, never above its capacity;
//! - the capped tenant never holds more than its quota.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use kvtier_l3::master::{
    DiskLoc, EvictionOutcome, LOCAL_NODE, Master, MasterPolicy, RetainedObject,
};
use kvtier_l3::promotion::Room;
use kvtier_l3::{ClientId, PutHandle, ReplicaDescriptor, SegmentId, StoreConfig, Tenant, charge};
use proptest::prelude::*;

const TENANTS: [&str; 2] = ["a", "q"];
const KEYS: usize = 12;
/// `q`'s DRAM quota.
const QUOTA: u64 = 160 << 10;

#[derive(Debug, Clone)]
enum Op {
    Put {
        t: usize,
        k: usize,
        size: u64,
        replicas: usize,
        end: bool,
    },
    Remove {
        t: usize,
        k: usize,
        force: bool,
    },
    RemoveAll(usize),
    Read(usize, usize),
    Persist(usize, usize),
    DropDisk(usize, usize),
    Unstage(usize, usize),
    Evict(u64),
    Promote {
        t: usize,
        k: usize,
        evict: bool,
    },
    Copy(usize, usize, u64),
    Move(usize, usize, u64, u64),
    Clear(usize, usize, u64),
    /// A client's segment (or a store node) goes: unmounted, or left / declared dead.
    Gone(u64),
    /// ... and comes back (mounted again, empty).
    Back(u64),
    /// Time passes (ms): leases and pending puts expire, the sweeper runs.
    Tick(u64),
    /// The master restarts: the nodes report what they kept (split deployment).
    Restart,
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![1u64..64, 64u64..(48 << 10)]
}

fn key_len() -> impl Strategy<Value = usize> {
    prop_oneof![1usize..40, 40usize..=4096]
}

fn op(owners: u64) -> impl Strategy<Value = Op> {
    let tk = || (0..TENANTS.len(), 0..KEYS);
    let owner = move || 1..=owners;
    prop_oneof![
        8 => (tk(), size(), 1usize..4, prop::bool::weighted(0.85))
            .prop_map(|((t, k), size, replicas, end)| Op::Put { t, k, size, replicas, end }),
        2 => (tk(), any::<bool>()).prop_map(|((t, k), force)| Op::Remove { t, k, force }),
        1 => (0..TENANTS.len()).prop_map(Op::RemoveAll),
        2 => tk().prop_map(|(t, k)| Op::Read(t, k)),
        3 => tk().prop_map(|(t, k)| Op::Persist(t, k)),
        1 => tk().prop_map(|(t, k)| Op::DropDisk(t, k)),
        1 => tk().prop_map(|(t, k)| Op::Unstage(t, k)),
        1 => (1u64..200_000).prop_map(Op::Evict),
        3 => (tk(), any::<bool>()).prop_map(|((t, k), evict)| Op::Promote { t, k, evict }),
        2 => (tk(), 0..=owners).prop_map(|((t, k), s)| Op::Copy(t, k, s)),
        1 => (tk(), 0..=owners, 0..=owners).prop_map(|((t, k), a, b)| Op::Move(t, k, a, b)),
        1 => (tk(), 0..=owners).prop_map(|((t, k), s)| Op::Clear(t, k, s)),
        1 => owner().prop_map(Op::Gone),
        1 => owner().prop_map(Op::Back),
        1 => (0u64..40_000).prop_map(Op::Tick),
        1 => Just(Op::Restart),
    ]
}

/// Key `k` at length `len`: its own first byte, padded (lengths 1 to 4096, all distinct).
fn key(k: usize, len: usize) -> String {
    let mut s = String::with_capacity(len);
    s.push((b'a' + k as u8) as char);
    while s.len() < len {
        s.push('k');
    }
    s
}

fn policy(offload_on_evict: bool) -> MasterPolicy {
    let mut p = MasterPolicy::from_config(&StoreConfig {
        tenant_quota_bytes: BTreeMap::from([("q".to_string(), QUOTA)]),
        loss_journal_keys: 256,
        ..StoreConfig::default()
    });
    p.offload_on_evict = offload_on_evict;
    p
}

/// The keys, their sizes (of the last put started), put tokens and writers (the node of the
/// first replica, which writes the SSD copy; [`LOCAL_NODE`] in one process), as the test
/// knows them.
struct Model {
    tenants: Vec<Tenant>,
    keys: Vec<String>,
    size: HashMap<(usize, usize), u64>,
    token: HashMap<(usize, usize), u64>,
    writer: HashMap<(usize, usize), ClientId>,
}

impl Model {
    fn new(lens: &[usize]) -> Self {
        Model {
            tenants: TENANTS.iter().map(|n| Tenant::new(*n).unwrap()).collect(),
            keys: lens.iter().enumerate().map(|(k, &l)| key(k, l)).collect(),
            size: HashMap::new(),
            token: HashMap::new(),
            writer: HashMap::new(),
        }
    }

    /// The invariants of the module docs.
    fn check(&self, m: &Master) -> Result<(), TestCaseError> {
        if let Err(e) = m.check_census() {
            return Err(TestCaseError::fail(e));
        }
        let mut total = 0u64;
        for (ti, t) in self.tenants.iter().enumerate() {
            let mut sum = 0u64;
            for (ki, k) in self.keys.iter().enumerate() {
                let n = m.mem_replicas(t, k) as u64;
                if n > 0 {
                    sum += charge(self.size[&(ti, ki)], k.len()) * n;
                }
            }
            prop_assert_eq!(m.tenant_dram_bytes(t), sum, "tenant {}", TENANTS[ti]);
            total += sum;
        }
        let s = m.stats();
        prop_assert_eq!(s.mem_used_bytes, total);
        prop_assert!(s.mem_used_bytes <= s.mem_capacity_bytes);
        prop_assert!(m.tenant_dram_bytes(&self.tenants[1]) <= QUOTA);
        Ok(())
    }

    /// The first of tenant `t`'s keys from `k` on (cyclically) that `pick` takes (`k` if
    /// none): ops on objects that qualify are not left to chance.
    fn pick(&self, t: usize, k: usize, pick: impl Fn(&Tenant, &str) -> bool) -> usize {
        (0..KEYS)
            .map(|i| (k + i) % KEYS)
            .find(|&i| pick(&self.tenants[t], &self.keys[i]))
            .unwrap_or(k)
    }

    /// A put of key `k` of tenant `t` started: its size, token and writer from now on.
    fn started(&mut self, t: usize, k: usize, h: &PutHandle) {
        self.size.insert((t, k), h.size);
        self.token.insert((t, k), h.token);
        let writer = h.replica.node().map_or(LOCAL_NODE, |n| n.id);
        self.writer.insert((t, k), writer);
    }
}

/// Pings every owner that is up (`up[i]`: client or node `i`).
fn ping(m: &mut Master, up: &[bool], now: u64) {
    for (i, _) in up.iter().enumerate().filter(|(_, up)| **up) {
        m.ping(ClientId(i as u64), now);
    }
}

/// Runs `ops` on `m`, checking the invariants after each: a put's start, ticks and the ops
/// both deployments do alike here, the end of each put `end` asks for (`end`: the bytes
/// written and the put ended, as the deployment does it), the others `own` (`up`: which
/// owners ping; `own` may move the clock).
fn drive(
    m: &mut Master,
    md: &mut Model,
    up: &mut [bool],
    ops: &[Op],
    mut end: impl FnMut(&mut Master, &PutHandle, u64, u64),
    mut own: impl FnMut(&mut Master, &Model, &Op, u64, &mut u64, &mut [bool]),
) -> Result<(), TestCaseError> {
    let mut now = 0u64;
    for (step, op) in ops.iter().enumerate() {
        let step = step as u64;
        now += 1;
        ping(m, up, now);
        let mut out = EvictionOutcome::default();
        match *op {
            Op::Put {
                t,
                k,
                size,
                replicas,
                end: ends,
            } => {
                let (tn, key) = (&md.tenants[t], &md.keys[k]);
                if let Ok(h) = m.put_start(tn, key, size, replicas, now, &mut out) {
                    md.started(t, k, &h);
                    if ends {
                        end(m, &h, step, now);
                    }
                }
            }
            Op::Tick(ms) => {
                now += ms;
                ping(m, up, now);
                m.sweep(now);
            }
            Op::Remove { t, k, force } => {
                let _ = m.remove(&md.tenants[t], &md.keys[k], force, now);
            }
            Op::RemoveAll(t) => {
                m.remove_all(&md.tenants[t], false, now);
            }
            Op::Read(t, k) => {
                let _ = m.query(&md.tenants[t], &md.keys[k], now);
            }
            Op::Persist(t, k) => {
                let k = md.pick(t, k, |tn, key| m.in_memory(tn, key) && !m.on_disk(tn, key));
                if let (Some(&tok), Some(&w)) = (md.token.get(&(t, k)), md.writer.get(&(t, k))) {
                    let size = md.size[&(t, k)];
                    let loc = DiskLoc {
                        bucket: step,
                        offset: 0,
                        size,
                        crc: 0,
                    };
                    m.register_disk(w, &md.tenants[t], &md.keys[k], tok, loc);
                }
            }
            Op::DropDisk(t, k) => {
                let k = md.pick(t, k, |tn, key| m.on_disk(tn, key));
                if let Ok((_, Some(loc))) = m.current_replicas(&md.tenants[t], &md.keys[k]) {
                    for node in 0..4 {
                        m.drop_disk(ClientId(node), &md.tenants[t], &md.keys[k], &loc);
                    }
                }
            }
            Op::Unstage(t, k) => {
                if let Some(&tok) = md.token.get(&(t, k)) {
                    m.unstage(&md.tenants[t], &md.keys[k], tok);
                }
            }
            Op::Evict(need) => m.evict(need, now, &mut out),
            // Refused on a store node's segment (-1011), which must change nothing.
            Op::Copy(t, k, s) => {
                let k = md.pick(t, k, |tn, key| m.in_memory(tn, key));
                let _ = m.copy_replica(&md.tenants[t], &md.keys[k], SegmentId(s));
            }
            Op::Move(t, k, a, b) => {
                let k = md.pick(t, k, |tn, key| m.in_memory(tn, key));
                let (from, to) = (SegmentId(a), SegmentId(b));
                let _ = m.move_replica(&md.tenants[t], &md.keys[k], from, to);
            }
            Op::Clear(t, k, s) => {
                let k = md.pick(t, k, |tn, key| m.in_memory(tn, key));
                let _ = m.clear_replica(&md.tenants[t], &md.keys[k], SegmentId(s), now);
            }
            Op::Promote { .. } | Op::Gone(_) | Op::Back(_) | Op::Restart => {
                own(m, md, op, step, &mut now, up)
            }
        }
        md.check(m)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// One process holding the bytes (embedded store, `--role both`): its own segment and
    /// two clients' segments.
    #[test]
    fn charges_stay_exact_in_one_process(
        lens in proptest::collection::vec(key_len(), KEYS),
        on_evict in any::<bool>(),
        ops in proptest::collection::vec(op(2), 1..120),
    ) {
        let mut md = Model::new(&lens);
        let mut m = Master::new(policy(on_evict));
        m.register_immortal_client(ClientId(0), 0);
        let caps = [256u64 << 10, 128 << 10, 96 << 10];
        for c in 0..3u64 {
            m.mount_segment(ClientId(c), SegmentId(c), caps[c as usize], 0).unwrap();
        }
        let end = |m: &mut Master, h: &PutHandle, step: u64, now: u64| {
            let data: Arc<[u8]> = vec![7u8; h.size as usize].into();
            m.put_write(h, data).unwrap();
            m.put_end(h, step.is_multiple_of(5), now).unwrap();
            if on_evict && step.is_multiple_of(3) {
                m.mark_copy_queued(&h.tenant, &h.key, h.token);
            }
        };
        let own = |m: &mut Master, md: &Model, op: &Op, _: u64, now: &mut u64, up: &mut [bool]| {
            match *op {
                Op::Promote { t, k, evict } => {
                    let k = md.pick(t, k, |tn, key| m.ssd_only(tn, key).is_some());
                    let (tn, key) = (&md.tenants[t], &md.keys[k]);
                    if let Some((tok, loc)) = m.ssd_only(tn, key) {
                        let data: Arc<[u8]> = vec![7u8; loc.size as usize].into();
                        let room = if evict { Room::EvictSaved } else { Room::Refuse };
                        let mut out = EvictionOutcome::default();
                        let _ = m.promote(tn, key, tok, data, *now, room, &mut out);
                    }
                }
                Op::Gone(c) if up[c as usize] => {
                    m.unmount_segment(ClientId(c), SegmentId(c)).unwrap();
                    up[c as usize] = false;
                }
                Op::Back(c) if !up[c as usize] => {
                    m.mount_segment(ClientId(c), SegmentId(c), caps[c as usize], *now).unwrap();
                    up[c as usize] = true;
                }
                _ => {}
            }
        };
        drive(&mut m, &mut md, &mut [true; 3], &ops, end, own)?;
    }

    /// A master of store nodes (split deployment): the nodes hold the bytes, the master
    /// charges their segments; nodes leave, die and join, one offloads its evictions, and
    /// the master restarts and adopts what they kept.
    #[test]
    fn charges_stay_exact_in_a_split_deployment(
        lens in proptest::collection::vec(key_len(), KEYS),
        ops in proptest::collection::vec(op(3), 1..120),
    ) {
        const CAP: u64 = 128 << 10;
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mut md = Model::new(&lens);
        let mut m = Master::new(policy(false));
        for n in 1..=3u64 {
            m.mount_node(ClientId(n), SegmentId(n), CAP, addr, 0).unwrap();
        }
        m.set_node_offload(ClientId(1), true);
        let end = |m: &mut Master, h: &PutHandle, _: u64, now: u64| {
            for r in h.replicas() {
                let node = r.node().unwrap().id;
                m.end_replica(node, &h.for_replica(r), false, now).unwrap();
            }
        };
        let own = |m: &mut Master, md: &Model, op: &Op, step: u64, now: &mut u64, up: &mut [bool]| {
            match *op {
                Op::Promote { t, k, evict } => {
                    let k = md.pick(t, k, |tn, key| m.ssd_only(tn, key).is_some());
                    let (tn, key) = (md.tenants[t].clone(), md.keys[k].clone());
                    if let (Some((_, loc)), Some(&n)) = (m.ssd_only(&tn, &key), md.writer.get(&(t, k))) {
                        if evict {
                            let _ = m.promote_on_node(n, &tn, &key, loc, *now);
                        } else if m.queue_promotions(&tn, &[&key]) > 0 {
                            for (pt, pk, ploc) in m.node_sync(n).promote {
                                let _ = m.promote_on_node(n, &pt, &pk, ploc, *now);
                            }
                        }
                    }
                }
                Op::Gone(n) if up[n as usize] => {
                    up[n as usize] = false;
                    if step.is_multiple_of(2) {
                        m.leave_node(ClientId(n));
                    } else {
                        // Silent past its TTL: declared dead by the sweeper.
                        *now += 10_001;
                        ping(m, up, *now);
                        m.sweep(*now);
                    }
                }
                Op::Back(n) => {
                    m.mount_node(ClientId(n), SegmentId(n), CAP, addr, *now).unwrap();
                    up[n as usize] = true;
                }
                Op::Restart => {
                    // What each live node kept: its ended replicas (read off the old
                    // master's descriptors; not bytes staged for an SSD write, which a node
                    // drops), each with the key's size.
                    let mut kept: HashMap<u64, Vec<RetainedObject>> = HashMap::new();
                    for (ti, tn) in md.tenants.iter().enumerate() {
                        for (ki, key) in md.keys.iter().enumerate() {
                            let Ok(q) = m.query(tn, key, *now) else { continue };
                            let Ok((allocs, _)) = m.current_replicas(tn, key) else { continue };
                            for r in &q.replicas {
                                if let ReplicaDescriptor::Memory { segment, alloc, .. } = r
                                    && allocs.contains(alloc)
                                {
                                    kept.entry(segment.0).or_default().push(RetainedObject {
                                        tenant: tn.clone(),
                                        key: key.clone(),
                                        token: md.token[&(ti, ki)],
                                        size: md.size[&(ti, ki)],
                                        crc: 0,
                                        disk: None,
                                    });
                                }
                            }
                        }
                    }
                    *m = Master::new(policy(false));
                    for n in (1..=3u64).filter(|n| up[*n as usize]) {
                        m.mount_node(ClientId(n), SegmentId(n), CAP, addr, *now).unwrap();
                        m.adopt_all(ClientId(n), kept.get(&n).map_or(&[][..], |v| &v[..]));
                    }
                    m.set_node_offload(ClientId(1), true);
                }
                _ => {}
            }
        };
        drive(&mut m, &mut md, &mut [false, true, true, true], &ops, end, own)?;
    }
}
