//! Object metadata: reads (descriptors, leases, read sources), probes, removal, promotion
//! and stats.
//!
//! Why apart: these calls look objects up and hand out what is where; they never place
//! anything (promotion adds a replica, evicting only copies that are also on SSD when its
//! [`Room`] allows).

use super::*;
use crate::pattern::KeyPattern;
use crate::promotion::Room;

impl Master {
    // ---- reads -----------------------------------------------------------------------------

    /// `GetReplicaList` / one key of `BatchQuery`: descriptors plus a fresh lease.
    pub fn query(&mut self, t: &Tenant, key: &str, now: u64) -> L3Result<QueryResult> {
        let lease = now.saturating_add(self.policy.lease_ttl_ms);
        let tick = self.touch();
        let mut o = self.obj_mut(t, key).ok_or(L3Error::ObjectNotFound)?;
        if !o.is_complete() {
            return Err(L3Error::ReplicaIsNotReady);
        }
        if !o.has_data() {
            return Err(L3Error::ObjectNotFound);
        }
        o.lease_until_ms = o.lease_until_ms.max(lease);
        o.last_access = tick;
        let (size, disk, disk_node, deadline) =
            (o.fp.bytes(), o.disk, o.disk_node, o.lease_until_ms);
        let mut mem: Vec<(SegmentId, u64)> = o.mem.iter().map(|r| (r.seg, r.alloc)).collect();
        if let Some(Staged::OnNode { seg, alloc, .. }) = o.staged {
            // Evicted on an offloading node that still holds the bytes (until its SSD copy
            // is registered): read from there.
            mem.push((seg, alloc));
        }
        drop(o); // counted again (table.rs) before the master is read
        let mut replicas = Vec::with_capacity(mem.len() + 1);
        for (seg, alloc) in mem {
            let node = self.segments.get(seg).and_then(|s| self.node_ref(s.owner));
            replicas.push(ReplicaDescriptor::Memory {
                segment: seg,
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
        let mut o = self.obj_mut(t, key).ok_or(L3Error::ObjectNotFound)?;
        if !o.is_complete() {
            return Err(L3Error::ReplicaIsNotReady);
        }
        o.lease_until_ms = o.lease_until_ms.max(lease);
        o.last_access = tick;
        let size = o.fp.bytes();
        let first = o.mem.first().map(|r| r.alloc);
        let staged = o.staged.clone();
        let disk = o.disk;
        drop(o);
        if let Some(a) = first
            && let Some(d) = self.segments.data(a)
        {
            return Ok((size, ReadSource::Memory(d)));
        }
        if let Some(Staged::Bytes(d)) = staged {
            return Ok((size, ReadSource::Memory(d)));
        }
        match disk {
            Some(d) => Ok((size, ReadSource::Disk(d))),
            None => Err(L3Error::ObjectNotFound),
        }
    }

    /// Current (memory allocs, disk location) of a complete object of this tenant.
    pub fn current_replicas(&self, t: &Tenant, key: &str) -> L3Result<(Vec<u64>, Option<DiskLoc>)> {
        let o = self.obj(t, key).ok_or(L3Error::ObjectNotFound)?;
        if !o.is_complete() {
            return Err(L3Error::ReplicaIsNotReady);
        }
        Ok((o.allocs().collect(), o.disk))
    }

    /// Checks a query result handed back for a read on a store node: its lease must still
    /// hold (-707), and the replicas it names must be this tenant's current ones, each by
    /// its node's segment *and* allocation: none of them current is -704, only some of them
    /// -707 (out of date: query again).
    ///
    /// Why every replica, segment included: the client reads the replicas in the result's
    /// order, and a master numbers its allocations from 1 (a new leader after a failover, a
    /// restarted `--state-dir` master), so an older master's `(segment, alloc)` can name an
    /// allocation this one gave to another version of the key. Vouching for a result when
    /// any one allocation id matched, whatever its segment, let a read return a removed
    /// version still held by a node that had not heard of the free yet
    /// (`tests/dram_failover.rs`). A replica this master placed is named by no other version
    /// while it lives, so a result whose replicas are all current reads the current bytes.
    pub fn check_query(&self, t: &Tenant, q: &QueryResult, now: u64) -> L3Result<()> {
        if now >= q.lease_deadline_ms {
            return Err(L3Error::LeaseExpired);
        }
        crate::types::validate_key(&q.key)?;
        let o = self.obj(t, &q.key).ok_or(L3Error::ObjectNotFound)?;
        if !o.is_complete() {
            return Err(L3Error::ReplicaIsNotReady);
        }
        let is_current = |r: &ReplicaDescriptor| match r {
            ReplicaDescriptor::Memory { segment, alloc, .. } => {
                o.mem.iter().any(|m| m.seg == *segment && m.alloc == *alloc)
                    || matches!(o.staged, Some(Staged::OnNode { seg, alloc: s, .. })
                        if seg == *segment && s == *alloc)
            }
            d => {
                DiskLoc::from_descriptor(d).is_some_and(|l| o.disk == Some(l))
                    && d.node().map_or(LOCAL_NODE, |n| n.id) == o.disk_node
            }
        };
        let current = q.replicas.iter().filter(|r| is_current(r)).count();
        if current == 0 {
            Err(L3Error::ObjectNotFound)
        } else if current < q.replicas.len() {
            Err(L3Error::LeaseExpired)
        } else {
            Ok(())
        }
    }

    /// A recycled buffer for a put's bytes ([`crate::buffers`]).
    pub fn take_buffer(&mut self, size: u64) -> Option<Arc<[u8]>> {
        self.segments.take_buffer(size)
    }

    /// The segments' recycled buffers cut to `limit` bytes (see [`crate::buffers`]); the
    /// others are returned, to be dropped outside the lock.
    pub fn trim_recycled(&mut self, limit: u64) -> Vec<Arc<[u8]>> {
        self.segments.trim_recycled(limit)
    }

    /// Moves with every allocation and free in the segments.
    pub fn segment_activity(&self) -> u64 {
        self.segments.activity()
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
        let m = self.objects.tenant(t);
        keys.iter()
            .map(|k| {
                let k = k.as_ref();
                crate::types::validate_key(k)?;
                let Some(o) = m.and_then(|m| m.get(k)) else {
                    return Ok(false);
                };
                let e = o.is_complete() && o.has_data();
                if e && o.mem.is_empty()
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

    /// One `query` per key of a `BatchQuery`; a bad key fails alone. Touched last to first:
    /// the first key ranks most recent (`batch_order`).
    pub fn query_many(
        &mut self,
        t: &Tenant,
        keys: &[String],
        now: u64,
    ) -> Vec<L3Result<QueryResult>> {
        crate::batch_order::last_to_first(keys.len(), |i| {
            crate::types::validate_key(&keys[i])?;
            self.query(t, &keys[i], now)
        })
    }

    /// Whether the object is on SSD only (candidate for promotion); returns its disk location.
    pub fn ssd_only(&self, t: &Tenant, key: &str) -> Option<(u64, DiskLoc)> {
        let o = self.obj(t, key)?;
        if o.is_complete() && o.mem.is_empty() && o.staged.is_none() {
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
        Ok(o.fp.bytes())
    }

    // ---- removal -----------------------------------------------------------------------------

    /// `Remove`: -706 if leased (unless `force`). Returns the removed version's token (its
    /// queued SSD write is cancelled with it) and the disk copy to tombstone with the node
    /// holding it; for a store node both are queued as settles here.
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
        for a in o.allocs() {
            self.segments.free(a);
        }
        // Store nodes are told (and told again until they acknowledge); the embedded store
        // cancels and tombstones with what is returned.
        self.settle_gone(t, key, o.gone());
        Ok(Removed {
            key: key.to_string(),
            token: o.token,
            disk: o.disk.map(|d| (o.disk_node, d)),
        })
    }

    /// `RemoveAll` for one tenant: removes every complete object without a lease (all with
    /// `force`). Returns what was removed.
    pub fn remove_all(&mut self, t: &Tenant, force: bool, now: u64) -> Vec<Removed> {
        self.remove_where(t, |_| true, force, now)
    }

    /// `RemoveByRegex` for one tenant: as [`Self::remove_all`], for the keys in which
    /// `pattern` is found (Mooncake's `regex_search`).
    pub fn remove_matching(
        &mut self,
        t: &Tenant,
        pattern: &KeyPattern,
        force: bool,
        now: u64,
    ) -> Vec<Removed> {
        self.remove_where(t, |k| pattern.is_found_in(k), force, now)
    }

    /// Removes the tenant's keys selected by `select` that are complete and unleased (all
    /// selected ones with `force`).
    fn remove_where(
        &mut self,
        t: &Tenant,
        select: impl Fn(&str) -> bool,
        force: bool,
        now: u64,
    ) -> Vec<Removed> {
        let keys = self.removable(t, select, force, now);
        keys.iter()
            .filter_map(|(k, _)| self.remove(t, k, true, now).ok())
            .collect()
    }

    /// The tenant's keys selected by `select` that a remove would take: complete and
    /// unleased ones (every selected one with `force`), and each one's SSD copy. The
    /// embedded store tombstones those copies before it removes the keys, so a copy whose
    /// tombstone fails keeps its key (`store/tier.rs`).
    pub fn removable(
        &self,
        t: &Tenant,
        select: impl Fn(&str) -> bool,
        force: bool,
        now: u64,
    ) -> Vec<(String, Option<DiskLoc>)> {
        let Some(m) = self.objects.tenant(t) else {
            return Vec::new();
        };
        m.iter()
            .filter(|(k, o)| select(k) && (force || (o.is_complete() && !o.leased(now))))
            .map(|(k, o)| (k.clone(), o.disk))
            .collect()
    }

    // ---- promotion ----------------------------------------------------------------------------

    /// Whether DRAM use is at or above the high watermark (promotion cools down then).
    pub fn under_pressure(&self, extra: u64) -> bool {
        let cap = self.segments.capacity();
        let high = (cap as f64 * self.policy.high_watermark) as u64;
        self.segments.used() + extra > high
    }

    /// Adds a memory replica to an SSD-only object (promotion). A promotion that does not
    /// fit under the high watermark fails with -200 (DRAM pressure), after, with
    /// [`Room::EvictSaved`], evicting cold objects whose eviction loses nothing
    /// ([`Master::evict_lossless`]; those staged for the SSD writer are in `out`).
    #[allow(clippy::too_many_arguments)] // the object's identity, its bytes, the time, the room rule
    pub fn promote(
        &mut self,
        t: &Tenant,
        key: &str,
        token: u64,
        data: Arc<[u8]>,
        now: u64,
        room: Room,
        out: &mut EvictionOutcome,
    ) -> L3Result<()> {
        let fp = Footprint::of(data.len() as u64, key);
        let (size, charge) = (fp.bytes(), fp.charge());
        let lease = now.saturating_add(self.policy.lease_ttl_ms);
        match self.obj(t, key) {
            Some(o) if o.token == token && o.is_complete() && o.fp.bytes() == size => {
                if !o.mem.is_empty() {
                    return Ok(());
                }
            }
            _ => return Err(L3Error::ObjectNotFound),
        }
        // an optional copy: never past the tenant's cap (it took a tenant to 4× its cap, and
        // the promotions' leases then refused its puts); none where no segment can hold it
        // (the one it was put in is gone), before anything is evicted for it
        if !self.within_quota(t, charge) || self.segments.owners_fitting(fp) == 0 {
            return Err(L3Error::NoAvailableHandle { needed: charge });
        }
        if room == Room::EvictSaved && self.under_pressure(charge) {
            let cap = self.segments.capacity();
            let high = (cap as f64 * self.policy.high_watermark) as u64;
            let ratio_bytes = (cap as f64 * self.policy.eviction_ratio) as u64;
            let need = (self.segments.used() + charge)
                .saturating_sub(high)
                .max(ratio_bytes);
            self.evict_lossless(need, now, out);
        }
        if self.under_pressure(charge) {
            return Err(L3Error::NoAvailableHandle { needed: charge });
        }
        let (seg, alloc) = self
            .segments
            .allocate(fp)
            .ok_or(L3Error::NoAvailableHandle { needed: charge })?;
        if let Err(e) = self.segments.write(alloc, data) {
            self.segments.free(alloc);
            return Err(e);
        }
        let tick = self.touch();
        if let Some(mut o) = self.obj_mut(t, key) {
            o.mem.push(MemReplica {
                seg,
                alloc,
                ended: true,
            });
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
        // O(1): the census kept at every change (table.rs), not a walk under the lock
        let c = self.objects.census();
        StoreStats {
            objects: c.objects,
            mem_objects: c.mem_objects,
            disk_objects: c.disk_objects,
            // the object bytes; a process holding the SSD tier itself reports its bucket
            // files' bytes instead (store/api.rs)
            disk_used_bytes: c.disk_bytes,
            mem_used_bytes: self.segments.used(),
            mem_capacity_bytes: self.segments.capacity(),
        }
    }

    /// Whether the census `stats()` reads, every tenant's DRAM bytes (what quotas read),
    /// every segment's use (what placement and eviction read) and every tenant's eviction
    /// order (what evictions walk) equal what is counted from every object (the invariant
    /// the tests check after their operations); what differs otherwise. The charges:
    /// each segment's `used` is the sum of its allocations' charges (`segment.rs`); each
    /// memory replica names an allocation of its own in its segment, charged (and sized) as
    /// its object's footprint under its own key, and no other allocation exists; so each
    /// tenant's DRAM bytes (its objects' charges × their memory replicas) sum to the
    /// segments' use.
    pub fn check_census(&self) -> Result<(), String> {
        let (kept, scanned) = (self.objects.census(), self.objects.census_by_scan());
        if kept != scanned {
            return Err(format!("census kept {kept:?}, counted {scanned:?}"));
        }
        if let Some((t, kept, sum)) = self.objects.dram_mismatch() {
            return Err(format!(
                "tenant {}: DRAM bytes kept {kept}, summed {sum}",
                t.as_str()
            ));
        }
        if let Some(e) = self.segments.mismatch() {
            return Err(e);
        }
        let mut replicas = std::collections::HashSet::new();
        for (t, m) in self.objects.iter() {
            for (k, o) in m {
                if o.fp != Footprint::of(o.fp.bytes(), k) {
                    return Err(format!("{}/{k}: footprint {:?}", t.as_str(), o.fp));
                }
                for r in &o.mem {
                    let ok = self.segments.alloc(r.alloc).is_some_and(|a| {
                        a.segment == r.seg && a.charge == o.fp.charge() && a.size == o.fp.bytes()
                    });
                    if !ok || !replicas.insert(r.alloc) {
                        let a = self.segments.alloc(r.alloc);
                        return Err(format!(
                            "{}/{k}: replica {r:?} of {:?} is allocation {:?} (or another's)",
                            t.as_str(),
                            o.fp,
                            a.map(|a| (a.segment, a.size, a.charge))
                        ));
                    }
                }
            }
        }
        if replicas.len() != self.segments.allocations() {
            return Err(format!(
                "{} allocations, {} of them memory replicas",
                self.segments.allocations(),
                replicas.len()
            ));
        }
        match self.objects.order_mismatch() {
            Some((t, what)) => Err(format!("tenant {}: eviction order {what}", t.as_str())),
            None => Ok(()),
        }
    }

    /// Whether the lease of a complete object is still held (tests).
    pub fn is_leased(&self, t: &Tenant, key: &str, now: u64) -> bool {
        self.obj(t, key).is_some_and(|o| o.leased(now))
    }

    /// Whether an object has a memory replica (tests, metrics).
    pub fn in_memory(&self, t: &Tenant, key: &str) -> bool {
        self.obj(t, key).is_some_and(|o| !o.mem.is_empty())
    }

    /// Memory replicas of an object (tests, metrics).
    pub fn mem_replicas(&self, t: &Tenant, key: &str) -> usize {
        self.obj(t, key).map_or(0, |o| o.mem.len())
    }

    /// Whether an object has a disk replica (tests, metrics).
    pub fn on_disk(&self, t: &Tenant, key: &str) -> bool {
        self.obj(t, key).is_some_and(|o| o.disk.is_some())
    }
}
