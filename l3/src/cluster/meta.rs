//! [`ClusterMaster`]: the master of a split deployment — Mooncake's master service over
//! the network, holding metadata only.
//!
//! Why: a master process that holds no bytes can serve many store nodes and survive any of
//! them. It runs the same [`Master`] as the embedded store (placement, two-phase puts,
//! leases, pins, eviction, liveness), with segments mounted by nodes instead of by itself.
//!
//! Invariants:
//! - No object bytes ever live here: data calls of [`L3Store`] (`put_write`, `put_end`,
//!   `get*`, `batch_put_from`) fail with -1010 naming the node role; clients that saw
//!   `ServerLimits::cluster` send bytes to the nodes instead.
//! - Every segment belongs to a node that pings; the sweeper declares silent nodes dead, which
//!   drops their memory replicas and keeps their SSD ones registered.
//! - Frees a node must apply are queued here and handed over with its next ping or put end
//!   ([`crate::master::NodeSync`]); tombstones and write cancels of dropped versions stay
//!   queued until the node acknowledges them on a ping (`master::settle`), so a node that
//!   crashes before they reach its disk is refused those records at its restart rescan.
//! - With a state dir ([`ClusterMaster::open`]), every settle is durable before any reply
//!   leaves the master ([`super::durable`]), and a restart replays them before serving: a
//!   master SIGKILLed between a remove and the node's next ping does not bring it back.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::durable::{Durability, DurableMaster, MasterGuard, open_log};
use crate::api::{BatchResult, L3Store};
use crate::clock::{Clock, Periodic};
use crate::config::StoreConfig;
use crate::error::{L3Error, L3Result};
use crate::ha::LeaderLease;
use crate::master::{EvictionOutcome, LossCursor, Losses, Master, MasterPolicy};
use crate::metrics::{Metrics, Op};
use crate::pattern::KeyPattern;
use crate::rpc::server::Backend;
use crate::rpc::service::{ClusterReply, ClusterRequest};
use crate::rpc::xfer::XferHandler;
use crate::types::{
    Blob, ClientId, ClientStatus, ExistOptions, PutHandle, PutOptions, QueryResult,
    ReplicateConfig, SegmentId, StoreStats, Tenant, validate_key,
};

fn on_nodes() -> L3Error {
    L3Error::Unavailable(
        "this is a metadata-only master: object bytes are read and written on the store \
         node named by the replica descriptor (RemoteStore does this)"
            .into(),
    )
}

/// The metadata-only master.
pub struct ClusterMaster {
    cfg: StoreConfig,
    clock: Arc<Clock>,
    master: DurableMaster,
    metrics: Metrics,
    sweeper: Mutex<Option<Periodic>>,
    /// etcd HA: this leader's lease (every call is gated on it).
    lease: Option<Arc<LeaderLease>>,
}

impl ClusterMaster {
    /// Builds a master (no segment of its own; `cfg.ssd` must be None) and starts its
    /// sweeper. Its settles live in memory only: a restart forgets them (see
    /// [`ClusterMaster::open`]).
    pub fn new(cfg: StoreConfig) -> L3Result<Arc<Self>> {
        Self::open(cfg, None)
    }

    /// [`ClusterMaster::new`] keeping its settles in `state_dir` (created if missing): the
    /// log there is replayed first, and every settle is durable before a reply leaves.
    pub fn open(cfg: StoreConfig, state_dir: Option<&Path>) -> L3Result<Arc<Self>> {
        Self::build(cfg, state_dir.map_or(Durability::Memory, Durability::Dir))
    }

    /// The master of a leader elected on etcd ([`crate::ha`]): replays the settle state the
    /// previous leaders left in etcd, keeps it there (every write fenced on `lease`'s epoch),
    /// stamps its epoch on put handles, and answers nothing once the lease may have run out.
    /// Clients' key calls wait (-1010) until every member node has mounted again.
    pub fn open_ha(cfg: StoreConfig, lease: Arc<LeaderLease>) -> L3Result<Arc<Self>> {
        Self::build(cfg, Durability::Etcd(lease))
    }

    fn build(cfg: StoreConfig, durability: Durability<'_>) -> L3Result<Arc<Self>> {
        cfg.validate()?;
        if cfg.ssd.is_some() {
            return Err(L3Error::InvalidParams(
                "a master holds no SSD tier: give --ssd-dir to the nodes".into(),
            ));
        }
        let period = cfg
            .put_timeout
            .min(cfg.client_ttl)
            .div_f64(4.0)
            .clamp(Duration::from_millis(10), Duration::from_secs(1));
        let clock = Arc::new(Clock::new());
        let mut master = Master::new(MasterPolicy::from_config(&cfg));
        // Bound here, once this process serves the master. With etcd HA, once elected, and
        // retried while a deposed leader (paused, not yet restarted) still holds the
        // address: the events must never keep a leader from serving.
        let binding = match durability {
            Durability::Etcd(_) => crate::kv_events::Binding::Retry,
            _ => crate::kv_events::Binding::AtStart,
        };
        for ev in &cfg.kv_events {
            master.attach_events(crate::kv_events::StorageEvents::start(ev, binding)?);
        }
        let rebuild_deadline = clock
            .now_ms()
            .saturating_add(crate::clock::ms(cfg.rebuild_timeout));
        let (log, lease) = open_log(&mut master, durability, rebuild_deadline)?;
        let me = Arc::new(ClusterMaster {
            master: DurableMaster::new(master, log),
            cfg,
            clock,
            metrics: Metrics::default(),
            sweeper: Mutex::new(None),
            lease,
        });
        let weak = Arc::downgrade(&me);
        let p = Periodic::spawn("kvtier-l3-master-sweeper", period, move || {
            let Some(m) = weak.upgrade() else {
                return false;
            };
            let now = m.clock.now_ms();
            let (_, dead) = {
                let mut g = m.master.lock();
                g.rebuild_deadline(now);
                g.sweep(now)
            };
            if dead > 0 {
                tracing::warn!(dead, "store nodes declared dead; memory replicas dropped");
            }
            true
        })?;
        *me.sweeper.lock() = Some(p);
        Ok(me)
    }

    /// Tombstones and write cancels `node` has not acknowledged yet (tests, metrics).
    pub fn unsettled(&self, node: ClientId) -> usize {
        self.master.lock().unsettled(node)
    }

    /// The master's clock (lease deadlines in query results are on it).
    pub fn clock(&self) -> &Arc<Clock> {
        &self.clock
    }

    /// The residency event streams, in `StoreConfig::kv_events`' order (empty: none).
    pub fn kv_events(&self) -> Vec<crate::kv_events::KvEventsHandle> {
        self.master.lock().event_handles()
    }

    /// Stops the sweeper and gives the state dir up (its lock released, nothing more
    /// written to its settle log), so a restart can open it.
    pub fn shutdown(&self) {
        let sweeper = self.sweeper.lock().take();
        if let Some(mut p) = sweeper {
            p.stop();
        }
        self.master.close_log();
    }

    fn put_start_one(
        &self,
        t: &Tenant,
        key: &str,
        size: u64,
        cfg: ReplicateConfig,
    ) -> L3Result<PutHandle> {
        self.cfg.check_put(key, size)?;
        let now = self.clock.now_ms();
        // The master holds no bytes: evictions on offloading nodes are staged there (told
        // with `NodeSync::offload`), so the outcome has nothing to stage here.
        let mut out = EvictionOutcome::default();
        self.client_lock()?
            .put_start(t, key, size, cfg.replica_num as usize, now, &mut out)
    }

    /// The master, for a client's call: -1010 while a restarted master waits for its store
    /// nodes to report their records (`master::rebuild`). Nodes' own calls are not gated.
    fn client_lock(&self) -> L3Result<MasterGuard<'_>> {
        Backend::gate(self)?;
        let g = self.master.lock();
        g.serving()?;
        Ok(g)
    }

    /// Serves the `cluster` call.
    pub fn handle(&self, req: ClusterRequest) -> L3Result<ClusterReply> {
        let now = self.clock.now_ms();
        match req {
            ClusterRequest::Mount {
                node,
                segment,
                capacity,
                data_addr,
            } => {
                self.master
                    .lock()
                    .mount_node(node, segment, capacity, data_addr, now)?;
                tracing::info!(node = node.0, %data_addr, capacity, "store node mounted");
                Ok(ClusterReply::Accepted(Vec::new()))
            }
            ClusterRequest::Rescanned { node, disks } => {
                let mut m = self.master.lock();
                Ok(ClusterReply::Accepted(
                    disks
                        .iter()
                        .map(|(t, k, loc)| m.register_rescanned(node, t, k, *loc))
                        .collect(),
                ))
            }
            ClusterRequest::Ping {
                node,
                applied,
                freed,
            } => Ok(ClusterReply::Sync(
                self.master.lock().node_ping(node, applied, freed, now),
            )),
            ClusterRequest::PutEnd {
                node,
                handles,
                soft_pin,
            } => {
                self.cfg.check_batch(handles.len())?;
                let mut m = self.master.lock();
                let res = handles
                    .iter()
                    .map(|h| m.end_replica(node, h, soft_pin, now).map(|_| ()))
                    .collect();
                Ok(ClusterReply::Ended(res, m.node_sync(node)))
            }
            ClusterRequest::PutEndReplicas {
                node,
                handles,
                soft_pin,
            } => {
                self.cfg.check_batch(handles.len())?;
                let mut m = self.master.lock();
                let res = handles
                    .iter()
                    .map(|h| m.end_replica(node, h, soft_pin, now))
                    .collect();
                Ok(ClusterReply::EndedReplicas(res, m.node_sync(node)))
            }
            ClusterRequest::RegisterDisk { node, items } => {
                let mut m = self.master.lock();
                Ok(ClusterReply::Accepted(
                    items
                        .iter()
                        .map(|(t, k, token, loc)| m.register_disk(node, t, k, *token, *loc))
                        .collect(),
                ))
            }
            ClusterRequest::EvictDisk { node, recs } => {
                let mut m = self.master.lock();
                if !recs
                    .iter()
                    .all(|(t, k, l)| m.disk_evictable(node, t, k, l, now))
                {
                    return Ok(ClusterReply::Evictable(false));
                }
                for (t, k, l) in &recs {
                    m.drop_disk(node, t, k, l);
                }
                Ok(ClusterReply::Evictable(true))
            }
            ClusterRequest::DropDisk {
                node,
                tenant,
                key,
                loc,
            } => {
                self.master.lock().drop_disk(node, &tenant, &key, &loc);
                Ok(ClusterReply::Done)
            }
            ClusterRequest::Leave { node } => {
                let mut m = self.master.lock();
                m.leave_node(node);
                tracing::info!(node = node.0, "store node left");
                Ok(ClusterReply::Done)
            }
            ClusterRequest::CheckQueries { tenant, queries } => {
                self.cfg.check_batch(queries.len())?;
                let m = self.master.lock();
                let res: Vec<L3Result<()>> = queries
                    .iter()
                    .map(|q| m.check_query(&tenant, q, now))
                    .collect();
                drop(m);
                let expired = res
                    .iter()
                    .filter(|r| matches!(r, Err(L3Error::LeaseExpired)))
                    .count();
                Metrics::add(&self.metrics.lease_rejections, expired as u64);
                Ok(ClusterReply::Checked(res))
            }
            ClusterRequest::Nodes => Ok(ClusterReply::Nodes(self.master.lock().live_nodes())),
            ClusterRequest::MountNode {
                node,
                segment,
                capacity,
                data_addr,
                offload_on_evict,
            } => {
                let mut m = self.master.lock();
                m.mount_node(node, segment, capacity, data_addr, now)?;
                m.set_node_offload(node, offload_on_evict);
                drop(m);
                tracing::info!(
                    node = node.0,
                    %data_addr,
                    capacity,
                    offload_on_evict,
                    "store node mounted"
                );
                Ok(ClusterReply::Accepted(Vec::new()))
            }
            ClusterRequest::Promote { node, items } => {
                self.cfg.check_batch(items.len())?;
                let mut m = self.master.lock();
                Ok(ClusterReply::Promoted(
                    items
                        .iter()
                        .map(|(t, k, loc)| m.promote_on_node(node, t, k, *loc, now))
                        .collect(),
                ))
            }
            ClusterRequest::Retained { node, objects } => {
                self.cfg.check_batch(objects.len())?;
                Ok(ClusterReply::Adopted(
                    self.master.lock().adopt_all(node, &objects),
                ))
            }
            ClusterRequest::Unstage { node: _, items } => {
                self.cfg.check_batch(items.len())?;
                let mut m = self.master.lock();
                for (t, k, token) in &items {
                    m.unstage(t, k, *token);
                }
                Ok(ClusterReply::Done)
            }
        }
    }
}

impl Drop for ClusterMaster {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Replica copy/move in a split deployment would need a node-to-node transfer of the bytes
/// (the master holds none): not implemented, so -1011 (UNAVAILABLE_IN_CURRENT_MODE).
fn split_replica_tasks() -> L3Error {
    L3Error::UnavailableInMode(
        "replica copy/move tasks need node-to-node transfers in a split deployment".into(),
    )
}

impl L3Store for ClusterMaster {
    fn put_start(&self, tenant: &Tenant, key: &str, size: u64) -> L3Result<PutHandle> {
        self.put_start_one(tenant, key, size, ReplicateConfig::default())
    }

    fn put_write(&self, _handle: &PutHandle, _data: &[u8]) -> L3Result<()> {
        Err(on_nodes())
    }

    fn put_end(&self, _handle: &PutHandle, _opts: PutOptions) -> L3Result<()> {
        Err(on_nodes())
    }

    fn put_revoke(&self, handle: &PutHandle) -> L3Result<()> {
        self.master.lock().put_revoke(handle)
    }

    fn batch_put_start_with(
        &self,
        tenant: &Tenant,
        keys: &[String],
        sizes: &[u64],
        cfg: ReplicateConfig,
    ) -> BatchResult<PutHandle> {
        cfg.validate()?;
        self.cfg.check_batch(keys.len())?;
        if keys.len() != sizes.len() {
            return Err(L3Error::InvalidParams(
                "keys and sizes differ in length".into(),
            ));
        }
        let t0 = Instant::now();
        let out = keys
            .iter()
            .zip(sizes)
            .map(|(k, &s)| self.put_start_one(tenant, k, s, cfg))
            .collect();
        self.metrics.observe(Op::Put, t0.elapsed());
        Ok(out)
    }

    fn batch_put_end(&self, _handles: &[PutHandle], _opts: PutOptions) -> BatchResult<()> {
        Err(on_nodes())
    }

    fn batch_put_revoke(&self, handles: &[PutHandle]) -> BatchResult<()> {
        self.cfg.check_batch(handles.len())?;
        let mut m = self.master.lock();
        Ok(handles.iter().map(|h| m.put_revoke(h)).collect())
    }

    fn get_replica_list(&self, tenant: &Tenant, key: &str) -> L3Result<QueryResult> {
        validate_key(key)?;
        let now = self.clock.now_ms();
        self.client_lock()?.query(tenant, key, now)
    }

    fn batch_exist_key(
        &self,
        tenant: &Tenant,
        keys: &[String],
        opts: ExistOptions,
    ) -> BatchResult<bool> {
        // Promotion (prefetch_to_memory) needs the node holding the SSD copy to read it: the
        // keys are queued for that node, which hears of them on its next ping (or put end),
        // reads its SSD and asks for a replica in its own segment (`Promote`).
        self.cfg.check_batch(keys.len())?;
        let t0 = Instant::now();
        let out = {
            let mut m = self.client_lock()?;
            let out = m.exists_many(tenant, keys, None);
            if opts.prefetch_to_memory {
                m.queue_promotions(tenant, keys);
            }
            out
        };
        self.metrics.observe(Op::Exist, t0.elapsed());
        Ok(out)
    }

    fn batch_query(&self, tenant: &Tenant, keys: &[String]) -> BatchResult<QueryResult> {
        self.cfg.check_batch(keys.len())?;
        let t0 = Instant::now();
        let now = self.clock.now_ms();
        let out = self.client_lock()?.query_many(tenant, keys, now);
        Metrics::add(
            &self.metrics.misses,
            out.iter().filter(|r| r.is_err()).count() as u64,
        );
        self.metrics.observe(Op::Query, t0.elapsed());
        Ok(out)
    }

    fn batch_get_with_query(
        &self,
        _tenant: &Tenant,
        _queries: &[QueryResult],
        _bufs: &mut [&mut [u8]],
    ) -> BatchResult<u64> {
        Err(on_nodes())
    }

    fn remove(&self, tenant: &Tenant, key: &str, force: bool) -> L3Result<()> {
        validate_key(key)?;
        let now = self.clock.now_ms();
        // The master queues the settles (tombstone, or cancel of a write in flight) for the
        // node holding the copy, until it acknowledges them.
        self.client_lock()?.remove(tenant, key, force, now)?;
        Ok(())
    }

    fn remove_all(&self, tenant: &Tenant, force: bool) -> L3Result<u64> {
        let now = self.clock.now_ms();
        let removed = self.client_lock()?.remove_all(tenant, force, now);
        Ok(removed.len() as u64)
    }

    fn remove_by_regex(&self, tenant: &Tenant, pattern: &str, force: bool) -> L3Result<u64> {
        let pattern = KeyPattern::new(pattern)?;
        let now = self.clock.now_ms();
        let removed = self
            .client_lock()?
            .remove_matching(tenant, &pattern, force, now);
        Ok(removed.len() as u64)
    }

    fn copy_replica(&self, _tenant: &Tenant, _key: &str, _target: SegmentId) -> L3Result<bool> {
        Err(split_replica_tasks())
    }

    fn move_replica(
        &self,
        _tenant: &Tenant,
        _key: &str,
        _source: SegmentId,
        _target: SegmentId,
    ) -> L3Result<()> {
        Err(split_replica_tasks())
    }

    fn mount_segment(&self, _client: ClientId, _segment: SegmentId, _cap: u64) -> L3Result<()> {
        Err(L3Error::Unavailable(
            "segments are mounted by store nodes (`kvtier-l3 --role node`), which hold their bytes"
                .into(),
        ))
    }

    fn unmount_segment(&self, client: ClientId, segment: SegmentId) -> L3Result<()> {
        self.master
            .lock()
            .unmount_segment(client, segment)
            .map(|_| ())
    }

    fn ping(&self, client: ClientId) -> L3Result<ClientStatus> {
        let now = self.clock.now_ms();
        Ok(self.master.lock().ping(client, now))
    }

    fn put(&self, _t: &Tenant, _key: &str, _data: &[u8], _opts: PutOptions) -> L3Result<()> {
        Err(on_nodes())
    }

    fn get(&self, _tenant: &Tenant, _key: &str) -> L3Result<Vec<u8>> {
        Err(on_nodes())
    }

    fn batch_put_from_with(
        &self,
        _tenant: &Tenant,
        _keys: &[String],
        _bufs: &[&[u8]],
        _opts: PutOptions,
        _cfg: ReplicateConfig,
    ) -> BatchResult<()> {
        Err(on_nodes())
    }

    fn batch_get_into(
        &self,
        _tenant: &Tenant,
        _keys: &[String],
        _bufs: &mut [&mut [u8]],
    ) -> BatchResult<u64> {
        Err(on_nodes())
    }

    fn get_size(&self, tenant: &Tenant, key: &str) -> L3Result<u64> {
        validate_key(key)?;
        self.client_lock()?.size_of(tenant, key)
    }

    fn flush(&self) -> L3Result<()> {
        // SSD queues live on the nodes (RemoteStore::flush asks each live node).
        Ok(())
    }

    fn stats(&self) -> L3Result<StoreStats> {
        Ok(self.master.lock().stats())
    }

    fn losses_since(&self, tenant: &Tenant, cursor: Option<LossCursor>) -> L3Result<Losses> {
        self.master.lock().losses_since(tenant, cursor)
    }

    fn max_object_bytes(&self) -> u64 {
        self.cfg.max_object_bytes
    }

    fn batch_keys_limit(&self) -> usize {
        self.cfg.max_batch_keys
    }
}

impl Backend for ClusterMaster {
    fn max_batch_keys(&self) -> usize {
        self.cfg.max_batch_keys
    }
    fn epoch(&self) -> u64 {
        self.lease.as_ref().map_or(0, |l| l.epoch())
    }

    fn gate(&self) -> L3Result<()> {
        match &self.lease {
            Some(l) => l.check(),
            None => Ok(()),
        }
    }

    fn is_cluster_master(&self) -> bool {
        true
    }
    fn get_blobs(&self, _tenant: &Tenant, _keys: &[String]) -> BatchResult<Blob> {
        Err(on_nodes())
    }
    fn get_with_query_blobs(&self, _t: &Tenant, _queries: &[QueryResult]) -> BatchResult<Blob> {
        Err(on_nodes())
    }
    fn render_metrics(&self) -> String {
        let stats = self.master.lock().stats();
        let evictions = self.master.lock().evictions_total;
        self.metrics
            .evictions
            .store(evictions, std::sync::atomic::Ordering::Relaxed);
        let nodes = self.master.lock().live_nodes().len();
        let unsettled = self.master.lock().unsettled_total();
        let events = self.master.lock().event_handles();
        let mut text = self.metrics.render(&stats, &[]);
        text.push_str(&crate::kv_events::render_metrics(&events));
        text.push_str(&format!(
            "# HELP kvtier_l3_live_nodes Live store nodes\n# TYPE kvtier_l3_live_nodes gauge\nkvtier_l3_live_nodes {nodes}\n"
        ));
        text.push_str(&format!(
            "# HELP kvtier_l3_unsettled Tombstones and write cancels not yet acknowledged by their store node\n# TYPE kvtier_l3_unsettled gauge\nkvtier_l3_unsettled {unsettled}\n"
        ));
        text
    }
    fn xfer_handler(self: Arc<Self>) -> Option<Arc<dyn XferHandler>> {
        None
    }
    fn cluster(&self, req: ClusterRequest) -> L3Result<ClusterReply> {
        ClusterMaster::handle(self, req)
    }
}
