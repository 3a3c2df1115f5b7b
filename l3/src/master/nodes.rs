//! Node sync (split deployment): store nodes joining, pinging and leaving, the frees and
//! settles queued for them ([`NodeSync`]; settles in `settle`), and the SSD records nodes
//! register.
//!
//! Why apart: this is the master's side of the node protocol (`cluster` RPC); the embedded
//! store uses only the SSD registration half, with [`LOCAL_NODE`] as the node.

use super::*;

impl Master {
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
        // It reports what it kept now and drops whatever this master does not adopt.
        if let Some(st) = self.nodes.get_mut(&node) {
            st.frees.mounted();
        }
        for old in self.segments.owned_by(node) {
            if let Ok(gone) = self.segments.unmount(old) {
                self.drop_allocs(&gone, Some(node));
            }
        }
        self.drop_node_memory_state(node);
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
        st.adopts = !st.seen_mounted;
        st.seen_mounted = true;
        // A new process (or one that dropped its state): whatever it had not acknowledged
        // may never have reached its disk.
        self.redeliver_settles(node);
        self.member_mounted(node);
        Ok(())
    }

    /// A node's ping: renews its liveness, takes its acknowledgements (`applied`: every
    /// settle up to it is durable there; `freed`: it dropped the bytes of every free up to
    /// it) and hands it what it must apply, with every settle and every free it has not
    /// acknowledged. The acknowledgements of a node that must remount are ignored (they
    /// may count from before a master restart).
    pub fn node_ping(&mut self, node: ClientId, applied: u64, freed: u64, now: u64) -> NodeSync {
        let need_remount = self.ping(node, now) == ClientStatus::NeedRemount
            || self.nodes.get(&node).is_none_or(|n| n.addr.is_none());
        if !need_remount {
            self.node_ack(node, applied);
            self.frees_acked(node, freed);
            self.member_pinged(node);
        }
        let mut sync = self.node_sync_with(node, settle::Deliver::Unacked);
        sync.need_remount = need_remount;
        sync
    }

    /// A node leaves gracefully: like a death, without waiting for the TTL.
    pub fn leave_node(&mut self, node: ClientId) {
        self.clients.remove(&node);
        self.orphan_node_memory(node);
        for seg in self.segments.owned_by(node) {
            if let Ok(gone) = self.segments.unmount(seg) {
                self.drop_allocs(&gone, Some(node));
            }
        }
        if let Some(n) = self.nodes.get_mut(&node) {
            n.addr = None;
            n.segment = None;
        }
        self.drop_node_memory_state(node);
    }

    /// Sets whether a node writes its DRAM evictions to its SSD (`--offload on-evict`).
    pub fn set_node_offload(&mut self, node: ClientId, on_evict: bool) {
        if let Some(n) = self.nodes.get_mut(&node) {
            n.offload_on_evict = on_evict;
        }
    }

    /// A node's memory is gone (death, leave, remount): bytes staged on it for an SSD write
    /// are lost (an object with nothing else goes; the write, if it was published before a
    /// crash, is cancelled), and orders it was not told yet are moot.
    pub(super) fn drop_node_memory_state(&mut self, node: ClientId) {
        if let Some(n) = self.nodes.get_mut(&node) {
            n.offload.clear();
            n.promote.clear();
        }
        let mut gone = Vec::new();
        self.objects.retain(|t, k, o| {
            if matches!(o.staged, Some(Staged::OnNode { node: s, .. }) if s == node) {
                let g = o.gone();
                o.staged = None;
                if !o.has_data() {
                    gone.push((t.clone(), k.to_string(), g));
                    return false;
                }
            }
            true
        });
        for (t, k, g) in gone {
            // Only evicted (complete) objects are staged.
            self.lose(&t, &k);
            self.settle_gone(&t, &k, g);
        }
    }

    /// Prefetching probe (split deployment): queues SSD-only keys for promotion on the
    /// node holding their SSD copy, told on its next ping or put end. Skipped (like the
    /// embedded promoter under DRAM pressure) when that node's segment is at or above the
    /// high watermark, and once per key while queued. Returns how many were queued.
    pub fn queue_promotions<K: AsRef<str>>(&mut self, t: &Tenant, keys: &[K]) -> usize {
        const MAX_QUEUED: usize = 65_536;
        let Some(m) = self.objects.tenant(t) else {
            return 0;
        };
        let mut todo: Vec<(ClientId, String, DiskLoc)> = Vec::new();
        for k in keys {
            let k = k.as_ref();
            if let Some(o) = m.get(k)
                && o.is_complete()
                && o.mem.is_empty()
                && o.staged.is_none()
                && o.disk_node != LOCAL_NODE
                && let Some(d) = o.disk
            {
                todo.push((o.disk_node, k.to_string(), d));
            }
        }
        let high = self.policy.high_watermark;
        let mut queued = 0;
        for (node, key, loc) in todo {
            let Some(seg) = self.nodes.get(&node).and_then(|n| n.segment) else {
                continue;
            };
            let charge = Footprint::of(loc.size, &key).charge();
            let pressure = self
                .segments
                .get(seg)
                .is_none_or(|s| s.used.saturating_add(charge) as f64 > s.capacity as f64 * high);
            if pressure {
                continue;
            }
            if let Some(n) = self.nodes.get_mut(&node)
                && n.promote.len() < MAX_QUEUED
                && n.promote.insert((t.clone(), key), loc).is_none()
            {
                queued += 1;
            }
        }
        queued
    }

    /// A node read the SSD copy `loc` of an object it was asked to promote: adds a memory
    /// replica in the node's own segment (never evicting; -200 at or above the high
    /// watermark) and returns its allocation and the object's put token, under which the node keeps the bytes. The
    /// replica is listed first from now on; until the node holds the bytes a read of it
    /// misses there and falls back to the SSD copy listed after it.
    pub fn promote_on_node(
        &mut self,
        node: ClientId,
        t: &Tenant,
        key: &str,
        loc: DiskLoc,
        now: u64,
    ) -> L3Result<(u64, u64)> {
        let token = match self.obj(t, key) {
            Some(o)
                if o.is_complete()
                    && o.disk == Some(loc)
                    && o.disk_node == node
                    && o.mem.is_empty()
                    && o.staged.is_none() =>
            {
                o.token
            }
            _ => return Err(L3Error::ObjectNotFound),
        };
        let seg = self
            .nodes
            .get(&node)
            .and_then(|n| n.segment)
            .ok_or(L3Error::ObjectNotFound)?;
        let fp = Footprint::of(loc.size, key);
        let needed = fp.charge();
        if !self.within_quota(t, needed) {
            return Err(L3Error::NoAvailableHandle { needed });
        }
        let high = self.policy.high_watermark;
        let fits = self
            .segments
            .get(seg)
            .is_some_and(|s| s.used.saturating_add(needed) as f64 <= s.capacity as f64 * high);
        if !fits {
            return Err(L3Error::NoAvailableHandle { needed });
        }
        let alloc = self
            .segments
            .allocate_on(seg, fp)
            .ok_or(L3Error::NoAvailableHandle { needed })?;
        let lease = now.saturating_add(self.policy.lease_ttl_ms);
        let tick = self.touch();
        if let Some(mut o) = self.obj_mut(t, key) {
            o.mem.push(MemReplica {
                seg,
                alloc,
                ended: true,
            });
            // As in the embedded promoter: one normal lease for the get the probe anticipated.
            o.lease_until_ms = o.lease_until_ms.max(lease);
            o.last_access = tick;
        }
        Ok((alloc, token))
    }

    /// Frees and promotions queued for a node (drained), the offloads whose frees it has not
    /// acknowledged, and the settles not handed out yet (a put-end reply; pings carry every
    /// unacknowledged one).
    pub fn node_sync(&mut self, node: ClientId) -> NodeSync {
        self.node_sync_with(node, settle::Deliver::New)
    }

    fn node_sync_with(&mut self, node: ClientId, d: settle::Deliver) -> NodeSync {
        let (settles, settled) = self.take_settles(node, d);
        let (freed, frees_acked) = self.take_frees(node, d);
        let Some(st) = self.nodes.get_mut(&node) else {
            return NodeSync {
                need_remount: true,
                ..Default::default()
            };
        };
        // Repeated with every reply while its free is unacknowledged: the node applies ping
        // and put-end replies on different threads, in either order, and one that applied
        // a bare free first would drop bytes this master still serves from it.
        st.offload.retain(|a| st.frees.may_hold(*a));
        let offload = st.offload.clone();
        let promote = std::mem::take(&mut st.promote)
            .into_iter()
            .map(|((t, k), loc)| (t, k, loc))
            .collect();
        NodeSync {
            need_remount: false,
            freed,
            frees_acked,
            settles,
            settled,
            offload,
            promote,
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

    pub(super) fn node_ref(&self, node: ClientId) -> Option<NodeRef> {
        self.nodes
            .get(&node)
            .and_then(|n| n.addr)
            .map(|addr| NodeRef { id: node, addr })
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
        // A pending replicated put too: its first replica's node writes the SSD copy as
        // soon as that replica ended (a revoke tombstones it).
        let written = match self.obj_mut(t, key) {
            Some(mut o) if o.token == token && o.disk.is_none() => {
                o.disk = Some(loc);
                o.disk_node = node;
                o.staged = None;
                o.copy_queued = false;
                true
            }
            _ => false,
        };
        if written {
            self.note_written(node, t, key, token, loc);
        }
        written
    }

    /// An SSD write of this version failed or was skipped (offload-on-evict, or a queued
    /// write-through copy): drop the staged copy (and the object if nothing else holds it).
    pub fn unstage(&mut self, t: &Tenant, key: &str, token: u64) {
        let drop_it = match self.obj_mut(t, key) {
            Some(mut o) if o.token == token => {
                o.staged = None;
                o.copy_queued = false;
                !o.has_data()
            }
            _ => false,
        };
        if drop_it {
            self.take_obj(t, key);
        }
    }

    /// This process queued the write-through SSD copy of this version (called in the
    /// critical section that ends the put, before the write is enqueued; [`Master::unstage`]
    /// withdraws it if the enqueue or the write fails).
    pub fn mark_copy_queued(&mut self, t: &Tenant, key: &str, token: u64) {
        if let Some(mut o) = self.obj_mut(t, key)
            && o.token == token
        {
            o.copy_queued = true;
        }
    }

    /// Re-registers an SSD copy found by a restart rescan. A node re-registering the record
    /// the master still has for it is accepted as is; an unknown key becomes an SSD-only
    /// object. Refused (the caller tombstones it): a record the node has an unacknowledged
    /// tombstone for, any record of a key it has an unacknowledged cancel for (a version
    /// dropped while its write may have been in flight), and any record of a key the master
    /// knows with another copy or none — a record carries no version, so it is never
    /// attached to a version it cannot be proven to belong to (losing a cached copy is
    /// acceptable, serving an old version's bytes is not) — and every record of a fenced
    /// node (`rebuild`).
    pub fn register_rescanned(
        &mut self,
        node: ClientId,
        t: &Tenant,
        key: &str,
        loc: DiskLoc,
    ) -> bool {
        if self.member_fenced(node) || self.settle_refuses(node, t, key, &loc) {
            return self
                .obj(t, key)
                .is_some_and(|o| o.disk == Some(loc) && o.disk_node == node);
        }
        if let Some(o) = self.obj(t, key) {
            if o.disk == Some(loc) && o.disk_node == node {
                return true;
            }
            // A version adopted from another node's DRAM, with these very bytes (`adopt`,
            // rule 6): this record is its SSD copy.
            let attach = o.disk.is_none()
                && o.is_complete()
                && o.fp.bytes() == loc.size
                && self.members.same_bytes(t, key, o.token, &loc);
            if attach && let Some(mut o) = self.obj_mut(t, key) {
                o.disk = Some(loc);
                o.disk_node = node;
            }
            return attach;
        }
        let tick = self.touch();
        let token = self.new_token();
        let mut o = Object::found(Footprint::of(loc.size, key), token, node, tick);
        o.disk = Some(loc);
        self.objects.insert(t, key.to_string(), o);
        self.readable(t, key);
        true
    }

    /// Drops an SSD copy (corrupt read, bucket evicted). The object goes if nothing is left.
    pub fn drop_disk(&mut self, node: ClientId, t: &Tenant, key: &str, loc: &DiskLoc) {
        let drop_it = match self.obj_mut(t, key) {
            Some(mut o) if o.disk.as_ref() == Some(loc) && o.disk_node == node => {
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
}
