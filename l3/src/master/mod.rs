//! Master metadata: key → replicas, two-phase puts, leases, soft pins, eviction, liveness.
//!
//! Why: this is Mooncake's master service, minus the network. It owns *what is where*; it
//! does no I/O, so every operation runs under one short lock in the caller
//! ([`crate::EmbeddedStore`]) and bytes are copied after the lock is dropped.
//!
//! Invariants kept in this file:
//! - Tenant isolation: objects are stored in `objects[tenant][key]`; every entry point takes
//!   a tenant and only looks inside that tenant's map.
//! - First writer wins: `put_start` on a key that is complete or has a live pending put
//!   fails with -705; a pending put older than `put_timeout` is revoked first.
//! - A put's token must match for `put_end`/`put_revoke`, so a writer whose put was revoked
//!   can never end somebody else's newer put.
//! - A leased object is never evicted and never removed without `force`.
//! - Existence probes take no lease and do not touch recency, so they cannot starve eviction.
//! - Removing a segment (unmount, dead client) drops memory replicas only; disk replicas stay.
//!   A complete object keeps its other replicas; a pending put that lost one is dropped.
//! - The memory replicas of one object live in segments of distinct owners (nodes).
//! - Split deployment (`--role master`): segments and SSD buckets live on store nodes. The
//!   master then holds no bytes: it records which node holds each replica, queues the frees
//!   a node must apply ([`NodeSync`], delivered on its pings and put ends, repeated until
//!   acknowledged: `frees`), keeps the
//!   tombstones and write cancels of dropped versions until the node acknowledges them
//!   (`settle`), and never hands out a replica whose node is down.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{L3Error, L3Result};
use crate::eviction::{Candidate, take_in_order};
use crate::segment::{Footprint, Segments};
pub use settle::SettleLogEntry;

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
    /// Allocations of its segment the master freed (evicted, removed, revoked), with their
    /// sequence numbers: drop the bytes, then acknowledge (`Ping::freed`). Ping replies
    /// repeat every unacknowledged one (`frees`).
    pub freed: Vec<(u64, u64)>,
    /// Every free up to this sequence number is acknowledged already (a node that mounted
    /// again counts on from here).
    pub frees_acked: u64,
    /// Orders about dropped object versions (tombstone a record, cancel a write), with
    /// their sequence numbers: applied durably, then acknowledged by the next `Ping`.
    /// Repeated until acknowledged ([`settle`](self::Settle)).
    pub settles: Vec<(u64, Settle)>,
    /// Every settle up to this sequence number is acknowledged already (a restarted node
    /// counts on from here).
    pub settled: u64,
    /// Allocations (also in `freed`) evicted from DRAM whose bytes the node writes to its
    /// SSD before dropping them (offload-on-evict nodes); applied before `freed`, and
    /// repeated in every reply until those frees are acknowledged (staging twice is a no-op).
    pub offload: Vec<u64>,
    /// SSD-only objects a prefetching probe asked to bring back into the node's DRAM.
    pub promote: Vec<(Tenant, String, DiskLoc)>,
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
    /// Frees it has not acknowledged yet (`frees`).
    frees: frees::FreeLog,
    /// Tombstones and cancels it has not acknowledged yet (kept across its death, so a
    /// restart rescan does not bring dropped versions back).
    settle: settle::Settlement,
    /// The node writes its DRAM evictions to its SSD (`--offload on-evict`).
    offload_on_evict: bool,
    /// Evicted allocations to write to its SSD, told with every reply until their frees
    /// are acknowledged (a reply carrying the free must carry the offload too).
    offload: Vec<u64>,
    /// Promotions asked for, not yet told (one per key).
    promote: HashMap<(Tenant, String), DiskLoc>,
    /// The node mounted here at least once (its memory, if dropped since, was dropped by
    /// this master without telling it).
    seen_mounted: bool,
    /// Its DRAM replicas may be adopted (`adopt`): its first mount on this master.
    adopts: bool,
}

#[derive(Debug, Clone)]
enum ObjState {
    Pending { since_ms: u64 },
    Complete,
}

/// One memory replica of an object.
#[derive(Debug, Clone, Copy)]
struct MemReplica {
    seg: SegmentId,
    alloc: u64,
    /// A store node ended this replica (its bytes are held there). A replicated put becomes
    /// complete when every replica is ended.
    ended: bool,
}

#[derive(Debug, Clone)]
struct Object {
    /// Its value's size and what each memory replica is charged in its segment.
    fp: Footprint,
    token: u64,
    state: ObjState,
    /// Memory replicas, the first placed first; in a split deployment each on another node.
    mem: Vec<MemReplica>,
    disk: Option<DiskLoc>,
    /// Node holding the bucket of `disk` ([`LOCAL_NODE`] when this process holds it).
    disk_node: ClientId,
    /// Node that writes this version's write-through SSD copy: the owner of its first
    /// placed replica ([`LOCAL_NODE`] in the single process).
    writer: ClientId,
    /// Evicted in offload-on-evict mode and waiting for its SSD write: readable meanwhile.
    staged: Option<Staged>,
    /// This process queued this version's write-through SSD copy (embedded, `--role
    /// both`): evicting it stages the bytes the queued write holds anyway instead of
    /// dropping the object, so a DRAM flood cannot lose what the SSD writer is about to
    /// make durable (a `wait_persisted` put found its object gone: issue 19).
    copy_queued: bool,
    lease_until_ms: u64,
    pin_until_ms: u64,
    last_access: u64,
    /// Where this object's entry is in its tenant's eviction order (`order.rs`; `None`:
    /// none), kept by the object table.
    ordered_as: Option<order::EvictRank>,
    /// Memory replicas of this version dropped while it lived on (evicted to its SSD copy,
    /// or on a node declared dead), by node and allocation: while the node has not
    /// acknowledged their free it may still hold the bytes, so the version's cancel goes
    /// to it too (`frees`). Pruned when the object is touched by such a drop again.
    freed_on: Vec<(ClientId, u64)>,
}

impl Object {
    /// A complete object a node reported after a remount (its copy added by the caller),
    /// with no lease or pin.
    fn found(fp: Footprint, token: u64, node: ClientId, tick: u64) -> Self {
        Object {
            fp,
            token,
            state: ObjState::Complete,
            mem: Vec::new(),
            disk: None,
            disk_node: node,
            writer: node,
            staged: None,
            copy_queued: false,
            lease_until_ms: 0,
            pin_until_ms: 0,
            last_access: tick,
            ordered_as: None,
            freed_on: Vec::new(),
        }
    }

    fn leased(&self, now: u64) -> bool {
        self.lease_until_ms > now
    }
    fn is_complete(&self) -> bool {
        matches!(self.state, ObjState::Complete)
    }
    fn has_data(&self) -> bool {
        !self.mem.is_empty() || self.disk.is_some() || self.staged.is_some()
    }
    fn allocs(&self) -> impl Iterator<Item = u64> + '_ {
        self.mem.iter().map(|r| r.alloc)
    }
}

/// Where the bytes of an object evicted in offload-on-evict mode wait for their SSD write.
#[derive(Debug, Clone)]
enum Staged {
    /// Held by this process (embedded, `--role both`).
    Bytes(Arc<[u8]>),
    /// Still held by the store node whose DRAM replica was evicted, under the evicted
    /// allocation's id (ids are never reused): the node writes them to its SSD, then drops
    /// them. Readable there meanwhile.
    OnNode {
        node: ClientId,
        seg: SegmentId,
        alloc: u64,
    },
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
    /// Capacity of the loss journal (0 = off; see [`Losses`]).
    pub loss_journal_keys: usize,
    /// DRAM cap per tenant name (`StoreConfig::tenant_quota_bytes`).
    pub tenant_quota_bytes: std::collections::BTreeMap<String, u64>,
    /// Cap on the capacity mortal clients mount (`StoreConfig::client_segments_max_bytes`).
    pub client_segments_max_bytes: Option<u64>,
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
            loss_journal_keys: cfg.loss_journal_keys,
            tenant_quota_bytes: cfg.tenant_quota_bytes.clone(),
            client_segments_max_bytes: cfg.client_segments_max_bytes,
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

/// What ending one replica of a put did ([`Master::end_replica`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaEnded {
    /// Every replica is ended: the object is visible.
    pub complete: bool,
    /// This is the object's first replica: its node writes the write-through SSD copy (one
    /// SSD copy per object, not one per replica).
    pub primary: bool,
}

/// Outcome of an eviction pass.
#[derive(Debug, Default)]
pub struct EvictionOutcome {
    /// Objects whose memory replicas were all dropped.
    pub evicted: u64,
    /// Bytes freed, as charged ([`crate::charge`]: values, keys, metadata).
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
    /// `tenant → key → object`, with the census `stats()` reads (`table.rs`).
    objects: table::ObjectTable,
    segments: Segments,
    clients: HashMap<ClientId, ClientInfo>,
    nodes: HashMap<ClientId, NodeState>,
    next_token: u64,
    /// With a settle log: tokens below this are reserved durably (a restarted master starts
    /// at it, so no put token of the previous incarnation is ever reused — a queued SSD
    /// write of an old version must never be registered as a new version's copy).
    token_floor: Option<u64>,
    tick: u64,
    /// Memory replicas dropped by eviction (for metrics).
    pub evictions_total: u64,
    /// Keys that stopped existing, for the engine (off unless configured).
    losses: losses::LossJournal,
    /// Settle changes not yet handed to the durable log (`Some` when the master keeps one:
    /// `--role master --state-dir`); see [`Master::take_settle_log`].
    settle_log: Option<Vec<SettleLogEntry>>,
    /// Store nodes a restart waits for (`rebuild`).
    members: rebuild::Membership,
    /// Leader epoch (etcd HA; 0 otherwise): stamped on put handles.
    epoch: u64,
    /// The residency event streams (`StoreConfig::kv_events`): each told of every object
    /// that becomes readable and of every one that stops existing (what the loss journal
    /// names), and each keeps the namespaces it carries.
    events: Vec<crate::kv_events::StorageEvents>,
}

impl Master {
    /// An empty master.
    pub fn new(policy: MasterPolicy) -> Self {
        Master {
            objects: table::ObjectTable::default(),
            segments: Segments::default(),
            clients: HashMap::new(),
            nodes: HashMap::new(),
            next_token: 0,
            token_floor: None,
            settle_log: None,
            members: rebuild::Membership::default(),
            epoch: 0,
            events: Vec::new(),
            tick: 0,
            evictions_total: 0,
            losses: losses::LossJournal::new(policy.loss_journal_keys),
            policy,
        }
    }

    /// Publishes this master's residency from now on (objects already here are not
    /// announced: attach before any object is registered).
    pub fn attach_events(&mut self, events: crate::kv_events::StorageEvents) {
        self.events.push(events);
    }

    /// A handle on each stream, in order (for use without the master's lock).
    pub fn event_handles(&self) -> Vec<crate::kv_events::KvEventsHandle> {
        self.events.iter().map(|e| e.handle()).collect()
    }

    /// An object of `t` became readable (put ended, or found again by a rescan or remount).
    pub(super) fn readable(&self, t: &Tenant, key: &str) {
        for ev in &self.events {
            ev.note(crate::kv_events::Residency::Readable, t, key);
        }
    }

    /// Sets the leader epoch stamped on put handles (etcd HA).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The leader epoch (0 without etcd HA).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    fn touch(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn obj(&self, t: &Tenant, key: &str) -> Option<&Object> {
        self.objects.get(t, key)
    }

    fn obj_mut<'a>(&'a mut self, t: &Tenant, key: &'a str) -> Option<table::ObjMut<'a>> {
        self.objects.get_mut(t, key)
    }

    /// Takes an object out of the store: the one place an object stops existing, apart from
    /// the bulk drops of dead replicas (`drop_allocs`, `drop_node_memory_state`), which
    /// record their losses themselves. A complete object's key goes to the loss journal.
    fn take_obj(&mut self, t: &Tenant, key: &str) -> Option<Object> {
        let o = self.objects.remove(t, key);
        if o.as_ref().is_some_and(|o| o.is_complete()) {
            self.lose(t, key);
        }
        o
    }

    /// Records in the loss journal (and its durable log) that `key` of `t` is gone.
    pub(super) fn lose(&mut self, t: &Tenant, key: &str) {
        for ev in &self.events {
            ev.note(crate::kv_events::Residency::Gone, t, key);
        }
        if let Some(e) = self.losses.record(t, key)
            && let Some(log) = &mut self.settle_log
        {
            log.push(e);
        }
    }

    /// Records in the loss journal (and its durable log) that some losses are not named.
    pub(super) fn losses_unknown(&mut self) {
        if let Some(e) = self.losses.unknown()
            && let Some(log) = &mut self.settle_log
        {
            log.push(e);
        }
    }

    /// Tenant `t`'s keys that stopped existing from `cursor` on (`None`: subscribe, see
    /// [`Losses`]). -1011 when the journal is off: an engine must not take silence for
    /// "nothing lost".
    pub fn losses_since(&self, t: &Tenant, cursor: Option<LossCursor>) -> L3Result<Losses> {
        if !self.losses.is_on() {
            return Err(L3Error::UnavailableInMode(
                "the loss journal is off (loss_journal_keys = 0)".into(),
            ));
        }
        Ok(self.losses.since(t, cursor))
    }
}

mod adopt;
mod clients;
mod frees;
mod losses;
mod nodes;
mod objects;
mod order;
mod placement;
mod rebuild;
mod replicas;
mod sequenced;
mod settle;
mod table;

pub use adopt::{Refusal, RetainedObject};
pub use losses::{LossCursor, Losses};
pub use replicas::Cleared;
pub use settle::Settle;
