//! Master metadata: key → replicas, two-phase puts, leases, soft pins, eviction, liveness.
//!
//! Why: this is Mooncake's master service, minus the network. It owns *what is where*; it
//! does no I/O, so every operation runs under one short lock in the caller
//! ([`crate::EmbeddedStore`]) and bytes are copied after the lock is dropped.
//!
//! Invariants kept in this file:
//! - Tenant isolation: objects are stored in `tenants[tenant][key]`; every entry point takes
//!   a tenant and only looks inside that tenant's map.
//! - First writer wins: `put_start` on a key that is complete or has a live pending put
//!   fails with -705; a pending put older than `put_timeout` is revoked first.
//! - A put's token must match for `put_end`/`put_revoke`, so a writer whose put was revoked
//!   can never end somebody else's newer put.
//! - A leased object is never evicted and never removed without `force`.
//! - Existence probes take no lease and do not touch recency, so they cannot starve eviction.
//! - Removing a segment (unmount, dead client) drops memory replicas only; disk replicas stay.
//! - Split deployment (`--role master`): segments and SSD buckets live on store nodes. The
//!   master then holds no bytes: it records which node holds each replica, queues the frees
//!   and tombstones a node must apply ([`NodeSync`], delivered on its pings and put ends), and
//!   never hands out a replica whose node is down.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{L3Error, L3Result};
use crate::eviction::{Candidate, select_victims};
use crate::segment::Segments;
use crate::types::{
    ClientId, ClientStatus, NodeRef, PutHandle, QueryResult, ReplicaDescriptor, SegmentId,
    StoreStats, Tenant,
};

/// The client id under which the serving process itself holds segments and SSD buckets
/// (embedded store and `--role both`).
pub const LOCAL_NODE: ClientId = ClientId(0);

/// Where an SSD copy lives (node-local bucket file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DiskLoc {
    /// Bucket id.
    pub bucket: u64,
    /// Payload offset in the bucket file.
    pub offset: u64,
    /// Payload size.
    pub size: u64,
    /// CRC32C of the payload.
    pub crc: u32,
}

impl DiskLoc {
    /// As a wire descriptor (held by the serving process).
    pub fn descriptor(&self) -> ReplicaDescriptor {
        self.descriptor_on(None)
    }

    /// As a wire descriptor held by `node`.
    pub fn descriptor_on(&self, node: Option<NodeRef>) -> ReplicaDescriptor {
        ReplicaDescriptor::Disk {
            bucket: self.bucket,
            offset: self.offset,
            size: self.size,
            crc: self.crc,
            node,
        }
    }

    /// The location a disk descriptor names (None for a memory descriptor).
    pub fn from_descriptor(d: &ReplicaDescriptor) -> Option<DiskLoc> {
        match *d {
            ReplicaDescriptor::Disk {
                bucket,
                offset,
                size,
                crc,
                ..
            } => Some(DiskLoc {
                bucket,
                offset,
                size,
                crc,
            }),
            ReplicaDescriptor::Memory { .. } => None,
        }
    }
}

/// What a store node must apply to its own state, handed to it with every ping reply and
/// put-end reply.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSync {
    /// `Ok`, or `NeedRemount` when the master does not know the node (declared dead, or the
    /// master restarted): the node drops its memory bytes and mounts again.
    pub need_remount: bool,
    /// Allocations of its segment the master freed (evicted, removed, revoked): drop the bytes.
    pub freed: Vec<u64>,
    /// SSD records whose objects were removed: tombstone them.
    pub tombstones: Vec<DiskLoc>,
}

/// What a remove took away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    /// The key.
    pub key: String,
    /// The removed version's put token.
    pub token: u64,
    /// Its SSD copy and the node holding it.
    pub disk: Option<(ClientId, DiskLoc)>,
}

#[derive(Debug, Default)]
struct NodeState {
    /// Data-channel address while the node is alive; None once declared dead.
    addr: Option<SocketAddr>,
    /// Its segment.
    segment: Option<SegmentId>,
    /// Removed objects' SSD records it has not been told about yet (kept across its death,
    /// so a restart rescan does not bring removed keys back).
    tombstones: Vec<DiskLoc>,
}

#[derive(Debug, Clone)]
enum ObjState {
    Pending { since_ms: u64 },
    Complete,
}

#[derive(Debug, Clone)]
struct Object {
    size: u64,
    token: u64,
    state: ObjState,
    mem: Option<(SegmentId, u64)>,
    disk: Option<DiskLoc>,
    /// Node holding the bucket of `disk` ([`LOCAL_NODE`] when this process holds it).
    disk_node: ClientId,
    /// Evicted in offload-on-evict mode and waiting for its SSD write: readable from here.
    staged: Option<Arc<[u8]>>,
    lease_until_ms: u64,
    pin_until_ms: u64,
    last_access: u64,
}

impl Object {
    fn leased(&self, now: u64) -> bool {
        self.lease_until_ms > now
    }
    fn is_complete(&self) -> bool {
        matches!(self.state, ObjState::Complete)
    }
    fn has_data(&self) -> bool {
        self.mem.is_some() || self.disk.is_some() || self.staged.is_some()
    }
}

/// Timing and policy knobs of the master (milliseconds).
#[derive(Debug, Clone)]
pub struct MasterPolicy {
    /// Lease length.
    pub lease_ttl_ms: u64,
    /// Soft pin length.
    pub soft_pin_ttl_ms: u64,
    /// Evict above this fraction of DRAM capacity.
    pub high_watermark: f64,
    /// Free this fraction of capacity per pass.
    pub eviction_ratio: f64,
    /// Revoke pending puts older than this.
    pub put_timeout_ms: u64,
    /// Declare a client dead after this long without a ping.
    pub client_ttl_ms: u64,
    /// Keep evicted objects staged for an SSD write (offload-on-evict mode).
    pub offload_on_evict: bool,
}

impl MasterPolicy {
    /// The policy a store configuration asks for.
    pub fn from_config(cfg: &crate::config::StoreConfig) -> Self {
        use crate::clock::ms;
        MasterPolicy {
            lease_ttl_ms: ms(cfg.lease_ttl),
            soft_pin_ttl_ms: ms(cfg.soft_pin_ttl),
            high_watermark: cfg.high_watermark,
            eviction_ratio: cfg.eviction_ratio,
            put_timeout_ms: ms(cfg.put_timeout),
            client_ttl_ms: ms(cfg.client_ttl),
            offload_on_evict: cfg
                .ssd
                .as_ref()
                .is_some_and(|s| s.mode == crate::config::OffloadMode::OnEvict),
        }
    }
}

/// What a memory read resolved to.
#[derive(Debug, Clone)]
pub enum ReadSource {
    /// Bytes in DRAM (or staged for offload).
    Memory(Arc<[u8]>),
    /// An SSD copy to read.
    Disk(DiskLoc),
}

/// An object written to SSD after eviction, identified by the put token it belongs to.
#[derive(Debug, Clone)]
pub struct StagedOffload {
    /// Tenant.
    pub tenant: Tenant,
    /// Key.
    pub key: String,
    /// Put token (version) of the object.
    pub token: u64,
    /// Bytes.
    pub data: Arc<[u8]>,
}

/// Outcome of an eviction pass.
#[derive(Debug, Default)]
pub struct EvictionOutcome {
    /// Memory replicas dropped.
    pub evicted: u64,
    /// Bytes freed.
    pub freed: u64,
    /// Objects to write to SSD (offload-on-evict).
    pub to_offload: Vec<StagedOffload>,
}

#[derive(Debug)]
struct ClientInfo {
    last_ping_ms: u64,
    /// Never declared dead (the embedded store's own client).
    immortal: bool,
}

/// The master's state. All methods take `now` (ms on [`crate::clock::Clock`]).
#[derive(Debug)]
pub struct Master {
    policy: MasterPolicy,
    tenants: HashMap<Tenant, HashMap<String, Object>>,
    segments: Segments,
    clients: HashMap<ClientId, ClientInfo>,
    nodes: HashMap<ClientId, NodeState>,
    next_token: u64,
    tick: u64,
    /// Memory replicas dropped by eviction (for metrics).
    pub evictions_total: u64,
}

impl Master {
    /// An empty master.
    pub fn new(policy: MasterPolicy) -> Self {
        Master {
            policy,
            tenants: HashMap::new(),
            segments: Segments::default(),
            clients: HashMap::new(),
            nodes: HashMap::new(),
            next_token: 0,
            tick: 0,
            evictions_total: 0,
        }
    }

    fn touch(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn obj(&self, t: &Tenant, key: &str) -> Option<&Object> {
        self.tenants.get(t).and_then(|m| m.get(key))
    }

    fn obj_mut(&mut self, t: &Tenant, key: &str) -> Option<&mut Object> {
        self.tenants.get_mut(t).and_then(|m| m.get_mut(key))
    }

    fn take_obj(&mut self, t: &Tenant, key: &str) -> Option<Object> {
        let m = self.tenants.get_mut(t)?;
        let o = m.remove(key);
        if m.is_empty() {
            self.tenants.remove(t);
        }
        o
    }

    // ---- clients and segments ------------------------------------------------------------

    /// Registers a client that is never declared dead (the embedded store itself).
    pub fn register_immortal_client(&mut self, c: ClientId, now: u64) {
        self.clients.insert(
            c,
            ClientInfo {
                last_ping_ms: now,
                immortal: true,
            },
        );
    }

    /// `MountSegment`: the client becomes known (alive) and its segment usable.
    pub fn mount_segment(
        &mut self,
        client: ClientId,
        seg: SegmentId,
        capacity: u64,
        now: u64,
    ) -> L3Result<()> {
        self.segments.mount(seg, client, capacity)?;
        self.clients
            .entry(client)
            .and_modify(|c| c.last_ping_ms = now)
            .or_insert(ClientInfo {
                last_ping_ms: now,
                immortal: false,
            });
        Ok(())
    }

    /// `UnmountSegment`: memory replicas in it are dropped; disk replicas stay.
    pub fn unmount_segment(&mut self, client: ClientId, seg: SegmentId) -> L3Result<u64> {
        match self.segments.get(seg) {
            None => return Err(L3Error::SegmentNotFound),
            Some(s) if s.owner != client => {
                return Err(L3Error::IllegalClient(
                    "segment owned by another client".into(),
                ));
            }
            Some(_) => {}
        }
        let gone = self.segments.unmount(seg)?;
        Ok(self.drop_allocs(&gone))
    }

    /// Drops every replica living in the given allocations; returns how many objects lost one.
    fn drop_allocs(&mut self, allocs: &[u64]) -> u64 {
        if allocs.is_empty() {
            return 0;
        }
        let set: std::collections::HashSet<u64> = allocs.iter().copied().collect();
        let mut n = 0;
        for m in self.tenants.values_mut() {
            m.retain(|_, o| {
                if let Some((_, a)) = o.mem
                    && set.contains(&a)
                {
                    n += 1;
                    o.mem = None;
                    // A pending put whose target vanished can never end: drop it.
                    return o.is_complete() && o.has_data();
                }
                true
            });
        }
        self.tenants.retain(|_, m| !m.is_empty());
        n
    }

    /// `Ping`: renews liveness. Unknown (or declared-dead) clients must remount.
    pub fn ping(&mut self, client: ClientId, now: u64) -> ClientStatus {
        match self.clients.get_mut(&client) {
            Some(c) => {
                c.last_ping_ms = now;
                ClientStatus::Ok
            }
            None => ClientStatus::NeedRemount,
        }
    }

    /// A store node joins (or rejoins after a restart or after being declared dead) with an
    /// empty memory segment: whatever segment it had is unmounted first (its memory replicas
    /// are gone with its old process), then `seg` is mounted with frees tracked for the node.
    pub fn mount_node(
        &mut self,
        node: ClientId,
        seg: SegmentId,
        capacity: u64,
        addr: SocketAddr,
        now: u64,
    ) -> L3Result<()> {
        if node == LOCAL_NODE {
            return Err(L3Error::InvalidParams("node id 0 is reserved".into()));
        }
        if let Some(s) = self.segments.get(seg)
            && s.owner != node
        {
            return Err(L3Error::SegmentAlreadyExists);
        }
        for old in self.segments.owned_by(node) {
            if let Ok(gone) = self.segments.unmount(old) {
                self.drop_allocs(&gone);
            }
        }
        self.segments.mount_remote(seg, node, capacity)?;
        self.clients.insert(
            node,
            ClientInfo {
                last_ping_ms: now,
                immortal: false,
            },
        );
        let st = self.nodes.entry(node).or_default();
        st.addr = Some(addr);
        st.segment = Some(seg);
        Ok(())
    }

    /// A node's ping: renews its liveness and hands it what it must apply.
    pub fn node_ping(&mut self, node: ClientId, now: u64) -> NodeSync {
        let need_remount = self.ping(node, now) == ClientStatus::NeedRemount
            || self.nodes.get(&node).is_none_or(|n| n.addr.is_none());
        let mut sync = self.node_sync(node);
        sync.need_remount = need_remount;
        sync
    }

    /// A node leaves gracefully: like a death, without waiting for the TTL.
    pub fn leave_node(&mut self, node: ClientId) {
        self.clients.remove(&node);
        for seg in self.segments.owned_by(node) {
            if let Ok(gone) = self.segments.unmount(seg) {
                self.drop_allocs(&gone);
            }
        }
        if let Some(n) = self.nodes.get_mut(&node) {
            n.addr = None;
            n.segment = None;
        }
    }

    /// Frees and tombstones queued for a node (drained).
    pub fn node_sync(&mut self, node: ClientId) -> NodeSync {
        let Some(st) = self.nodes.get_mut(&node) else {
            return NodeSync {
                need_remount: true,
                ..Default::default()
            };
        };
        let tombstones = std::mem::take(&mut st.tombstones);
        let freed = match st.segment {
            Some(seg) => self.segments.take_freed(seg),
            None => Vec::new(),
        };
        NodeSync {
            need_remount: false,
            freed,
            tombstones,
        }
    }

    /// Live store nodes (split deployment).
    pub fn live_nodes(&self) -> Vec<NodeRef> {
        let mut v: Vec<NodeRef> = self
            .nodes
            .iter()
            .filter_map(|(&id, n)| n.addr.map(|addr| NodeRef { id, addr }))
            .collect();
        v.sort_by_key(|n| n.id);
        v
    }

    fn node_ref(&self, node: ClientId) -> Option<NodeRef> {
        self.nodes
            .get(&node)
            .and_then(|n| n.addr)
            .map(|addr| NodeRef { id: node, addr })
    }

    /// Queues the tombstone of a removed object's SSD record for the node holding it (a
    /// no-op for [`LOCAL_NODE`], whose caller tombstones directly).
    pub fn queue_tombstone(&mut self, node: ClientId, loc: DiskLoc) {
        if node != LOCAL_NODE {
            self.nodes.entry(node).or_default().tombstones.push(loc);
        }
    }

    /// Revokes timed-out puts and declares silent clients dead (their memory replicas go,
    /// their SSD replicas stay). Returns (puts revoked, clients expired).
    pub fn sweep(&mut self, now: u64) -> (u64, u64) {
        let timeout = self.policy.put_timeout_ms;
        let mut stale = Vec::new();
        for (t, m) in &self.tenants {
            for (k, o) in m {
                if let ObjState::Pending { since_ms } = o.state
                    && now.saturating_sub(since_ms) >= timeout
                {
                    stale.push((t.clone(), k.clone()));
                }
            }
        }
        let revoked = stale.len() as u64;
        for (t, k) in stale {
            self.revoke_object(&t, &k);
        }
        let ttl = self.policy.client_ttl_ms;
        let dead: Vec<ClientId> = self
            .clients
            .iter()
            .filter(|(_, c)| !c.immortal && now.saturating_sub(c.last_ping_ms) >= ttl)
            .map(|(&id, _)| id)
            .collect();
        for c in &dead {
            self.clients.remove(c);
            if let Some(n) = self.nodes.get_mut(c) {
                // Its SSD replicas stay registered (readable again when it comes back).
                n.addr = None;
                n.segment = None;
            }
            for seg in self.segments.owned_by(*c) {
                if let Ok(gone) = self.segments.unmount(seg) {
                    self.drop_allocs(&gone);
                }
            }
        }
        (revoked, dead.len() as u64)
    }

    // ---- puts ------------------------------------------------------------------------------

    /// `PutStart`: reserve space (evicting if needed) and register a pending object.
    pub fn put_start(
        &mut self,
        t: &Tenant,
        key: &str,
        size: u64,
        now: u64,
        out: &mut EvictionOutcome,
    ) -> L3Result<PutHandle> {
        if size == 0 {
            return Err(L3Error::InvalidParams("object size must be > 0".into()));
        }
        if let Some(o) = self.obj(t, key) {
            match o.state {
                ObjState::Complete => return Err(L3Error::ObjectAlreadyExists),
                ObjState::Pending { since_ms } => {
                    if now.saturating_sub(since_ms) < self.policy.put_timeout_ms {
                        return Err(L3Error::ObjectAlreadyExists);
                    }
                    // Half-done put past its timeout: revoke it, the new writer proceeds.
                    self.revoke_object(t, key);
                }
            }
        }
        let (seg, alloc) = self.allocate(size, now, out)?;
        let node = self.segments.get(seg).and_then(|s| self.node_ref(s.owner));
        self.next_token += 1;
        let token = self.next_token;
        let last_access = self.touch();
        self.tenants.entry(t.clone()).or_default().insert(
            key.to_string(),
            Object {
                size,
                token,
                state: ObjState::Pending { since_ms: now },
                mem: Some((seg, alloc)),
                disk: None,
                disk_node: LOCAL_NODE,
                staged: None,
                lease_until_ms: 0,
                pin_until_ms: 0,
                last_access,
            },
        );
        Ok(PutHandle {
            tenant: t.clone(),
            key: key.to_string(),
            size,
            token,
            replica: ReplicaDescriptor::Memory {
                segment: seg,
                alloc,
                size,
                node,
            },
        })
    }

    /// Allocates, evicting first when usage would pass the high watermark or space is short.
    fn allocate(
        &mut self,
        size: u64,
        now: u64,
        out: &mut EvictionOutcome,
    ) -> L3Result<(SegmentId, u64)> {
        let cap = self.segments.capacity();
        if size > cap {
            return Err(L3Error::NoAvailableHandle { needed: size });
        }
        let high = (cap as f64 * self.policy.high_watermark) as u64;
        let used = self.segments.used();
        if used + size > high {
            let ratio_bytes = (cap as f64 * self.policy.eviction_ratio) as u64;
            let need = (used + size).saturating_sub(high).max(ratio_bytes);
            self.evict(need, now, out);
        }
        if let Some(a) = self.segments.allocate(size) {
            return Ok(a);
        }
        // Fragmented across segments or still short: one more pass for exactly this size.
        self.evict(size, now, out);
        self.segments
            .allocate(size)
            .ok_or(L3Error::NoAvailableHandle { needed: size })
    }

    /// Evicts memory replicas (near-LRU, never leased, pinned last) to free `need` bytes.
    pub fn evict(&mut self, need: u64, now: u64, out: &mut EvictionOutcome) {
        let mut refs: Vec<(Tenant, String)> = Vec::new();
        let mut cands: Vec<Candidate> = Vec::new();
        for (t, m) in &self.tenants {
            for (k, o) in m {
                if o.mem.is_none() || !o.is_complete() {
                    continue;
                }
                refs.push((t.clone(), k.clone()));
                cands.push(Candidate {
                    size: o.size,
                    leased: o.leased(now),
                    pinned: o.pin_until_ms > now,
                    last_access: o.last_access,
                });
            }
        }
        let victims = select_victims(&cands, need);
        let on_evict = self.policy.offload_on_evict;
        for i in victims {
            let (t, k) = &refs[i];
            let Some(o) = self.obj_mut(t, k) else {
                continue;
            };
            let Some((_, alloc)) = o.mem.take() else {
                continue;
            };
            let size = o.size;
            let token = o.token;
            let keep_disk = o.disk.is_some();
            let data = self.segments.data(alloc);
            self.segments.free(alloc);
            out.evicted += 1;
            out.freed += size;
            self.evictions_total += 1;
            if keep_disk {
                continue;
            }
            match (on_evict, data) {
                (true, Some(d)) => {
                    if let Some(o) = self.obj_mut(t, k) {
                        o.staged = Some(d.clone());
                    }
                    out.to_offload.push(StagedOffload {
                        tenant: t.clone(),
                        key: k.clone(),
                        token,
                        data: d,
                    });
                }
                _ => {
                    self.take_obj(t, k);
                }
            }
        }
    }

    /// Stores the bytes of a pending put (token-checked).
    pub fn put_write(&mut self, h: &PutHandle, data: Arc<[u8]>) -> L3Result<()> {
        let o = self.obj(&h.tenant, &h.key).ok_or(L3Error::ObjectNotFound)?;
        if o.token != h.token {
            return Err(L3Error::IllegalClient("put token does not match".into()));
        }
        if o.is_complete() {
            return Err(L3Error::ObjectAlreadyExists);
        }
        let (_, alloc) = o.mem.ok_or(L3Error::ObjectNotFound)?;
        self.segments.write(alloc, data)
    }

    /// `PutEnd`: the object becomes visible. Returns its bytes (for write-through offload).
    /// With `bytes_checked` the caller (a store node holding the bytes) has verified the
    /// write itself; otherwise the bytes must be in this master's segment (-703 if not).
    pub fn put_end(
        &mut self,
        h: &PutHandle,
        soft_pin: bool,
        bytes_checked: bool,
        now: u64,
    ) -> L3Result<Option<Arc<[u8]>>> {
        let pin_ttl = self.policy.soft_pin_ttl_ms;
        let tick = self.touch();
        let o = self.obj(&h.tenant, &h.key).ok_or(L3Error::ObjectNotFound)?;
        if o.token != h.token {
            return Err(L3Error::IllegalClient("put token does not match".into()));
        }
        if o.is_complete() {
            return Err(L3Error::ObjectAlreadyExists);
        }
        let (_, alloc) = o.mem.ok_or(L3Error::ObjectNotFound)?;
        if !bytes_checked && !self.segments.is_written(alloc) {
            return Err(L3Error::ReplicaIsNotReady);
        }
        let data = self.segments.data(alloc);
        let o = self
            .obj_mut(&h.tenant, &h.key)
            .ok_or(L3Error::ObjectNotFound)?;
        o.state = ObjState::Complete;
        o.last_access = tick;
        if soft_pin {
            o.pin_until_ms = now.saturating_add(pin_ttl);
        }
        Ok(data)
    }

    /// `PutRevoke`: drops a pending put (token-checked).
    pub fn put_revoke(&mut self, h: &PutHandle) -> L3Result<()> {
        let o = self.obj(&h.tenant, &h.key).ok_or(L3Error::ObjectNotFound)?;
        if o.token != h.token {
            return Err(L3Error::IllegalClient("put token does not match".into()));
        }
        if o.is_complete() {
            return Err(L3Error::InvalidParams(
                "cannot revoke a completed put".into(),
            ));
        }
        self.revoke_object(&h.tenant, &h.key);
        Ok(())
    }

    fn revoke_object(&mut self, t: &Tenant, key: &str) {
        if let Some(o) = self.take_obj(t, key)
            && let Some((_, a)) = o.mem
        {
            self.segments.free(a);
        }
    }

    // ---- reads -----------------------------------------------------------------------------

    /// `GetReplicaList` / one key of `BatchQuery`: descriptors plus a fresh lease.
    pub fn query(&mut self, t: &Tenant, key: &str, now: u64) -> L3Result<QueryResult> {
        let lease = now.saturating_add(self.policy.lease_ttl_ms);
        let tick = self.touch();
        let o = self.obj_mut(t, key).ok_or(L3Error::ObjectNotFound)?;
        if !o.is_complete() {
            return Err(L3Error::ReplicaIsNotReady);
        }
        if !o.has_data() {
            return Err(L3Error::ObjectNotFound);
        }
        o.lease_until_ms = o.lease_until_ms.max(lease);
        o.last_access = tick;
        let (size, mem, disk, disk_node, deadline) =
            (o.size, o.mem, o.disk, o.disk_node, o.lease_until_ms);
        let mut replicas = Vec::with_capacity(2);
        if let Some((segment, alloc)) = mem {
            let node = self
                .segments
                .get(segment)
                .and_then(|s| self.node_ref(s.owner));
            replicas.push(ReplicaDescriptor::Memory {
                segment,
                alloc,
                size,
                node,
            });
        }
        if let Some(d) = disk {
            if disk_node == LOCAL_NODE {
                replicas.push(d.descriptor());
            } else if let Some(n) = self.node_ref(disk_node) {
                replicas.push(d.descriptor_on(Some(n)));
            }
        }
        if replicas.is_empty() && disk.is_some() {
            // Registered on a node that is down: readable again once it is back.
            return Err(L3Error::Unavailable(format!(
                "the node holding this object ({}) is down",
                disk_node.0
            )));
        }
        Ok(QueryResult {
            key: key.to_string(),
            size,
            replicas,
            lease_deadline_ms: deadline,
        })
    }

    /// Resolves a key to the best source (memory first) and takes a lease.
    pub fn read_source(&mut self, t: &Tenant, key: &str, now: u64) -> L3Result<(u64, ReadSource)> {
        let lease = now.saturating_add(self.policy.lease_ttl_ms);
        let tick = self.touch();
        let o = self.obj_mut(t, key).ok_or(L3Error::ObjectNotFound)?;
        if !o.is_complete() {
            return Err(L3Error::ReplicaIsNotReady);
        }
        o.lease_until_ms = o.lease_until_ms.max(lease);
        o.last_access = tick;
        let size = o.size;
        let mem = o.mem;
        let staged = o.staged.clone();
        let disk = o.disk;
        if let Some((_, a)) = mem
            && let Some(d) = self.segments.data(a)
        {
            return Ok((size, ReadSource::Memory(d)));
        }
        if let Some(d) = staged {
            return Ok((size, ReadSource::Memory(d)));
        }
        match disk {
            Some(d) => Ok((size, ReadSource::Disk(d))),
            None => Err(L3Error::ObjectNotFound),
        }
    }

    /// Current (memory alloc, disk location) of a complete object of this tenant.
    pub fn current_replicas(
        &self,
        t: &Tenant,
        key: &str,
    ) -> L3Result<(Option<u64>, Option<DiskLoc>)> {
        let o = self.obj(t, key).ok_or(L3Error::ObjectNotFound)?;
        if !o.is_complete() {
            return Err(L3Error::ReplicaIsNotReady);
        }
        Ok((o.mem.map(|(_, a)| a), o.disk))
    }

    /// Checks a query result handed back for a read on a store node: its lease must still
    /// hold (-707) and one of its replicas must still be this tenant's current one (-704).
    pub fn check_query(&self, t: &Tenant, q: &QueryResult, now: u64) -> L3Result<()> {
        if now >= q.lease_deadline_ms {
            return Err(L3Error::LeaseExpired);
        }
        crate::types::validate_key(&q.key)?;
        let o = self.obj(t, &q.key).ok_or(L3Error::ObjectNotFound)?;
        if !o.is_complete() {
            return Err(L3Error::ReplicaIsNotReady);
        }
        let current = q.replicas.iter().any(|r| match r {
            ReplicaDescriptor::Memory { alloc, .. } => o.mem.is_some_and(|(_, a)| a == *alloc),
            d => {
                DiskLoc::from_descriptor(d).is_some_and(|l| o.disk == Some(l))
                    && d.node().map_or(LOCAL_NODE, |n| n.id) == o.disk_node
            }
        });
        if current {
            Ok(())
        } else {
            Err(L3Error::ObjectNotFound)
        }
    }

    /// Bytes of a memory allocation named by a query result.
    pub fn alloc_data(&self, alloc: u64) -> Option<Arc<[u8]>> {
        self.segments.data(alloc)
    }

    /// `ExistKey`: complete and holding data. Takes no lease and does not touch recency.
    pub fn exists(&self, t: &Tenant, key: &str) -> bool {
        self.obj(t, key)
            .is_some_and(|o| o.is_complete() && o.has_data())
    }

    /// `BatchExistKey` for one tenant: one tenant lookup, then one lookup per key. With
    /// `ssd_only` given, keys that exist only on SSD are appended to it (promotion candidates).
    pub fn exists_many<K: AsRef<str>>(
        &self,
        t: &Tenant,
        keys: &[K],
        mut ssd_only: Option<&mut Vec<String>>,
    ) -> Vec<L3Result<bool>> {
        let m = self.tenants.get(t);
        keys.iter()
            .map(|k| {
                let k = k.as_ref();
                crate::types::validate_key(k)?;
                let Some(o) = m.and_then(|m| m.get(k)) else {
                    return Ok(false);
                };
                let e = o.is_complete() && o.has_data();
                if e && o.mem.is_none()
                    && o.staged.is_none()
                    && o.disk.is_some()
                    && let Some(v) = ssd_only.as_deref_mut()
                {
                    v.push(k.to_string());
                }
                Ok(e)
            })
            .collect()
    }

    /// One `query` per key of a `BatchQuery`; a bad key fails alone.
    pub fn query_many(
        &mut self,
        t: &Tenant,
        keys: &[String],
        now: u64,
    ) -> Vec<L3Result<QueryResult>> {
        keys.iter()
            .map(|k| {
                crate::types::validate_key(k)?;
                self.query(t, k, now)
            })
            .collect()
    }

    /// Whether the object is on SSD only (candidate for promotion); returns its disk location.
    pub fn ssd_only(&self, t: &Tenant, key: &str) -> Option<(u64, DiskLoc)> {
        let o = self.obj(t, key)?;
        if o.is_complete() && o.mem.is_none() && o.staged.is_none() {
            o.disk.map(|d| (o.token, d))
        } else {
            None
        }
    }

    /// Size of a complete object.
    pub fn size_of(&self, t: &Tenant, key: &str) -> L3Result<u64> {
        let o = self.obj(t, key).ok_or(L3Error::ObjectNotFound)?;
        if !o.is_complete() {
            return Err(L3Error::ReplicaIsNotReady);
        }
        if !o.has_data() {
            return Err(L3Error::ObjectNotFound);
        }
        Ok(o.size)
    }

    // ---- removal -----------------------------------------------------------------------------

    /// `Remove`: -706 if leased (unless `force`). Returns the removed version's token (its
    /// queued SSD write is cancelled with it) and the disk copy to tombstone with the node
    /// holding it.
    pub fn remove(&mut self, t: &Tenant, key: &str, force: bool, now: u64) -> L3Result<Removed> {
        let o = self.obj(t, key).ok_or(L3Error::ObjectNotFound)?;
        if !force {
            if !o.is_complete() {
                return Err(L3Error::ReplicaIsNotReady);
            }
            if o.leased(now) {
                return Err(L3Error::ObjectHasLease);
            }
        }
        let o = self.take_obj(t, key).ok_or(L3Error::ObjectNotFound)?;
        if let Some((_, a)) = o.mem {
            self.segments.free(a);
        }
        Ok(Removed {
            key: key.to_string(),
            token: o.token,
            disk: o.disk.map(|d| (o.disk_node, d)),
        })
    }

    /// `RemoveAll` for one tenant: removes every complete object without a lease (all with
    /// `force`). Returns what was removed.
    pub fn remove_all(&mut self, t: &Tenant, force: bool, now: u64) -> Vec<Removed> {
        let Some(m) = self.tenants.get(t) else {
            return Vec::new();
        };
        let keys: Vec<String> = m
            .iter()
            .filter(|(_, o)| force || (o.is_complete() && !o.leased(now)))
            .map(|(k, _)| k.clone())
            .collect();
        keys.iter()
            .filter_map(|k| self.remove(t, k, true, now).ok())
            .collect()
    }

    // ---- SSD registration ---------------------------------------------------------------------

    /// Registers a freshly written SSD copy, if the object is still the same version.
    /// Returns false when the object is gone or was replaced (the caller tombstones the record).
    pub fn register_disk(
        &mut self,
        node: ClientId,
        t: &Tenant,
        key: &str,
        token: u64,
        loc: DiskLoc,
    ) -> bool {
        match self.obj_mut(t, key) {
            Some(o) if o.token == token && o.is_complete() && o.disk.is_none() => {
                o.disk = Some(loc);
                o.disk_node = node;
                o.staged = None;
                true
            }
            _ => false,
        }
    }

    /// An offload-on-evict write failed or was skipped: drop the staged copy (and the object
    /// if nothing else holds it).
    pub fn unstage(&mut self, t: &Tenant, key: &str, token: u64) {
        let drop_it = match self.obj_mut(t, key) {
            Some(o) if o.token == token => {
                o.staged = None;
                !o.has_data()
            }
            _ => false,
        };
        if drop_it {
            self.take_obj(t, key);
        }
    }

    /// Re-registers an SSD copy found by a restart rescan. An object already known keeps its
    /// memory copy and gains the disk one; an unknown key becomes an SSD-only object.
    /// A record the master has a queued tombstone for (removed while its node was down) is
    /// refused, and so is one whose key now has another version: the caller tombstones it.
    /// A node re-registering a record the master still has for it is accepted as is.
    pub fn register_rescanned(
        &mut self,
        node: ClientId,
        t: &Tenant,
        key: &str,
        loc: DiskLoc,
    ) -> bool {
        if let Some(st) = self.nodes.get_mut(&node)
            && let Some(i) = st.tombstones.iter().position(|l| *l == loc)
        {
            st.tombstones.swap_remove(i);
            return false;
        }
        let tick = self.touch();
        if let Some(o) = self.obj_mut(t, key) {
            if o.disk == Some(loc) && o.disk_node == node {
                return true;
            }
            if o.is_complete() && o.disk.is_none() && o.size == loc.size {
                o.disk = Some(loc);
                o.disk_node = node;
                return true;
            }
            return false;
        }
        self.next_token += 1;
        let token = self.next_token;
        self.tenants.entry(t.clone()).or_default().insert(
            key.to_string(),
            Object {
                size: loc.size,
                token,
                state: ObjState::Complete,
                mem: None,
                disk: Some(loc),
                disk_node: node,
                staged: None,
                lease_until_ms: 0,
                pin_until_ms: 0,
                last_access: tick,
            },
        );
        true
    }

    /// Drops an SSD copy (corrupt read, bucket evicted). The object goes if nothing is left.
    pub fn drop_disk(&mut self, node: ClientId, t: &Tenant, key: &str, loc: &DiskLoc) {
        let drop_it = match self.obj_mut(t, key) {
            Some(o) if o.disk.as_ref() == Some(loc) && o.disk_node == node => {
                o.disk = None;
                !o.has_data()
            }
            _ => false,
        };
        if drop_it {
            self.take_obj(t, key);
        }
    }

    /// Whether an SSD copy may be dropped by SSD eviction now (not leased).
    pub fn disk_evictable(
        &self,
        node: ClientId,
        t: &Tenant,
        key: &str,
        loc: &DiskLoc,
        now: u64,
    ) -> bool {
        match self.obj(t, key) {
            Some(o) if o.disk.as_ref() == Some(loc) && o.disk_node == node => !o.leased(now),
            _ => true,
        }
    }

    // ---- promotion ----------------------------------------------------------------------------

    /// Whether DRAM use is at or above the high watermark (promotion cools down then).
    pub fn under_pressure(&self, extra: u64) -> bool {
        let cap = self.segments.capacity();
        let high = (cap as f64 * self.policy.high_watermark) as u64;
        self.segments.used() + extra > high
    }

    /// Adds a memory replica to an SSD-only object (promotion). Never evicts: a promotion
    /// that does not fit under the high watermark fails with -200 (DRAM pressure).
    pub fn promote(
        &mut self,
        t: &Tenant,
        key: &str,
        token: u64,
        data: Arc<[u8]>,
        now: u64,
    ) -> L3Result<()> {
        let size = data.len() as u64;
        let lease = now.saturating_add(self.policy.lease_ttl_ms);
        match self.obj(t, key) {
            Some(o) if o.token == token && o.is_complete() && o.size == size => {
                if o.mem.is_some() {
                    return Ok(());
                }
            }
            _ => return Err(L3Error::ObjectNotFound),
        }
        if self.under_pressure(size) {
            return Err(L3Error::NoAvailableHandle { needed: size });
        }
        let (seg, alloc) = self
            .segments
            .allocate(size)
            .ok_or(L3Error::NoAvailableHandle { needed: size })?;
        if let Err(e) = self.segments.write(alloc, data) {
            self.segments.free(alloc);
            return Err(e);
        }
        let tick = self.touch();
        if let Some(o) = self.obj_mut(t, key) {
            o.mem = Some((seg, alloc));
            // Like Mooncake's NotifyPromotionSuccess(from_prefetch): a normal KV lease so the
            // promoted copy survives until the get that the prefetch anticipated.
            o.lease_until_ms = o.lease_until_ms.max(lease);
            o.last_access = tick;
        }
        Ok(())
    }

    // ---- stats ---------------------------------------------------------------------------------

    /// Current numbers.
    pub fn stats(&self) -> StoreStats {
        let mut s = StoreStats {
            mem_used_bytes: self.segments.used(),
            mem_capacity_bytes: self.segments.capacity(),
            ..Default::default()
        };
        for m in self.tenants.values() {
            for o in m.values() {
                if !o.is_complete() {
                    continue;
                }
                s.objects += 1;
                if o.mem.is_some() {
                    s.mem_objects += 1;
                }
                if o.disk.is_some() {
                    s.disk_objects += 1;
                }
            }
        }
        s
    }

    /// Whether the lease of a complete object is still held (tests).
    pub fn is_leased(&self, t: &Tenant, key: &str, now: u64) -> bool {
        self.obj(t, key).is_some_and(|o| o.leased(now))
    }

    /// Whether an object has a memory replica (tests, metrics).
    pub fn in_memory(&self, t: &Tenant, key: &str) -> bool {
        self.obj(t, key).is_some_and(|o| o.mem.is_some())
    }

    /// Whether an object has a disk replica (tests, metrics).
    pub fn on_disk(&self, t: &Tenant, key: &str) -> bool {
        self.obj(t, key).is_some_and(|o| o.disk.is_some())
    }
}
