//! Object placement: two-phase puts (start, write, end, revoke), replica placement,
//! allocation and eviction.
//!
//! Why apart: this is where memory is spent; eviction runs only from here, when a put (or a
//! promotion on hit) needs room.
//!
//! Replicas: a put asking for `n` replicas gets them in segments of distinct owners (store
//! nodes), most free space first, best effort like Mooncake's allocation strategy: fewer
//! owners with room means fewer replicas, at least one (-200 if none). A store node ends
//! its own replica ([`Master::end_replica`]); the object becomes visible when every replica
//! is ended. The embedded store and `--role both` ask for `replica_num` too: the owners are
//! then the store itself and the clients that mounted segments (Mooncake's model).

use super::*;

/// Which objects an eviction may choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Victims {
    /// Any complete, unleased object (pinned last, saved before unsaved).
    Any,
    /// Only objects whose eviction loses nothing: those with a registered SSD copy, and in
    /// offload-on-evict mode any other (eviction hands its bytes to the SSD writer, staged
    /// and readable until the copy is registered).
    Lossless,
}

impl Master {
    // ---- puts ------------------------------------------------------------------------------

    /// `PutStart`: reserve `replicas` memory replicas on distinct owners (evicting if
    /// needed; best effort, at least one) and register a pending object.
    pub fn put_start(
        &mut self,
        t: &Tenant,
        key: &str,
        size: u64,
        replicas: usize,
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
        let fp = Footprint::of(size, key);
        if self.segments.owners_fitting(fp) == 0 {
            // No segment can hold it, whatever is evicted (its charge passes every capacity):
            // refused before the tenant's or anyone's objects are evicted for it.
            return Err(L3Error::NoAvailableHandle {
                needed: fp.charge(),
            });
        }
        self.tenant_room(t, fp, replicas, now, out)?;
        let placed = self.allocate(fp, replicas.max(1), now, out)?;
        let descs: Vec<ReplicaDescriptor> = placed
            .iter()
            .map(|&(segment, alloc)| ReplicaDescriptor::Memory {
                segment,
                alloc,
                size,
                node: self
                    .segments
                    .get(segment)
                    .and_then(|s| self.node_ref(s.owner)),
            })
            .collect();
        let token = self.new_token();
        let last_access = self.touch();
        let writer = placed
            .first()
            .and_then(|(seg, _)| self.segments.get(*seg))
            .map_or(LOCAL_NODE, |s| s.owner);
        self.objects.insert(
            t,
            key.to_string(),
            Object {
                fp,
                token,
                state: ObjState::Pending { since_ms: now },
                mem: placed
                    .iter()
                    .map(|&(seg, alloc)| MemReplica {
                        seg,
                        alloc,
                        ended: false,
                    })
                    .collect(),
                disk: None,
                disk_node: LOCAL_NODE,
                writer,
                staged: None,
                copy_queued: false,
                lease_until_ms: 0,
                pin_until_ms: 0,
                last_access,
                ordered_as: None,
                freed_on: Vec::new(),
            },
        );
        let mut descs = descs.into_iter();
        let replica = descs.next().ok_or(L3Error::NoAvailableHandle {
            needed: fp.charge(),
        })?;
        Ok(PutHandle {
            tenant: t.clone(),
            key: key.to_string(),
            size,
            token,
            replica,
            epoch: self.epoch,
            extra_replicas: descs.collect(),
        })
    }

    /// Allocates `n` replicas of `fp` (best effort, at least one) on distinct owners,
    /// evicting first when usage would pass the high watermark or space is short. Only the
    /// replicas that can be placed are made room for: at most one per owner with a segment
    /// that can hold one (none: -200, nothing evicted).
    pub(super) fn allocate(
        &mut self,
        fp: Footprint,
        n: usize,
        now: u64,
        out: &mut EvictionOutcome,
    ) -> L3Result<Vec<(SegmentId, u64)>> {
        let cap = self.segments.capacity();
        let size = fp.charge();
        let n = n.min(self.segments.owners_fitting(fp));
        if n == 0 {
            return Err(L3Error::NoAvailableHandle { needed: size });
        }
        let total = size.saturating_mul(n as u64);
        let high = (cap as f64 * self.policy.high_watermark) as u64;
        let used = self.segments.used();
        if used.saturating_add(total) > high {
            let ratio_bytes = (cap as f64 * self.policy.eviction_ratio) as u64;
            let need = used
                .saturating_add(total)
                .saturating_sub(high)
                .max(ratio_bytes);
            self.evict(need, now, out);
        }
        let mut placed = self.segments.allocate_spread(fp, n, &[]);
        if placed.len() < n {
            // Fragmented across segments or still short: one more pass for what is missing,
            // on owners not used yet.
            self.evict(size.saturating_mul((n - placed.len()) as u64), now, out);
            let skip: Vec<ClientId> = placed
                .iter()
                .filter_map(|(s, _)| self.segments.get(*s).map(|i| i.owner))
                .collect();
            let more = self.segments.allocate_spread(fp, n - placed.len(), &skip);
            placed.extend(more);
        }
        if placed.is_empty() {
            return Err(L3Error::NoAvailableHandle { needed: size });
        }
        Ok(placed)
    }

    /// DRAM bytes tenant `t` holds (memory replicas, pending puts included): kept at every
    /// change (`table.rs`), O(1).
    pub fn tenant_dram_bytes(&self, t: &Tenant) -> u64 {
        self.objects.dram_bytes(t)
    }

    /// Whether tenant `t` may hold `bytes` more DRAM without evicting anything (always, without
    /// a quota): what a promotion or a replica copy, which must not evict the tenant's objects
    /// for an optional copy, needs.
    pub(super) fn within_quota(&self, t: &Tenant, bytes: u64) -> bool {
        self.policy
            .tenant_quota_bytes
            .get(t.as_str())
            .is_none_or(|&cap| self.tenant_dram_bytes(t).saturating_add(bytes) <= cap)
    }

    /// Makes room under tenant `t`'s quota for a put charged `fp` × the replicas it can
    /// get (`replicas` asked for, at most one per segment owner: counted only for a capped
    /// tenant, not on every put), evicting its own objects (the others' are never touched);
    /// -200 when it cannot (leased, or larger than the cap).
    fn tenant_room(
        &mut self,
        t: &Tenant,
        fp: Footprint,
        replicas: usize,
        now: u64,
        out: &mut EvictionOutcome,
    ) -> L3Result<()> {
        let Some(&cap) = self.policy.tenant_quota_bytes.get(t.as_str()) else {
            return Ok(());
        };
        let copies = replicas.max(1).min(self.segments.owners_fitting(fp).max(1));
        let bytes = fp.charge().saturating_mul(copies as u64);
        let over = |used: u64| used.saturating_add(bytes).saturating_sub(cap);
        let need = over(self.tenant_dram_bytes(t));
        if need > 0 && bytes <= cap {
            // Only if the victims free enough: a put refused by the cap changes nothing (it
            // evicted what it could and then answered -200: objects lost for no put).
            let chosen = self.victims(need, now, Some(t), Victims::Any);
            if chosen.iter().map(|(_, _, size)| *size).sum::<u64>() >= need {
                self.evict_chosen(&chosen, out);
            }
        }
        if over(self.tenant_dram_bytes(t)) > 0 {
            return Err(L3Error::NoAvailableHandle { needed: bytes });
        }
        Ok(())
    }

    /// Evicts memory replicas (near-LRU, never leased, pinned last) to free `need` bytes.
    /// An object is evicted whole: all its memory replicas go.
    pub fn evict(&mut self, need: u64, now: u64, out: &mut EvictionOutcome) {
        self.evict_in(need, now, out, None);
    }

    /// [`Master::evict`] among the objects whose eviction loses nothing: those with a
    /// registered SSD copy and, in offload-on-evict mode, those it stages for the SSD writer
    /// (returned in `out.to_offload`). A promotion on hit makes room this way.
    pub fn evict_lossless(&mut self, need: u64, now: u64, out: &mut EvictionOutcome) {
        self.evict_where(need, now, out, None, Victims::Lossless);
    }

    /// [`Master::evict`] among tenant `only`'s objects (all tenants' when `None`).
    fn evict_in(&mut self, need: u64, now: u64, out: &mut EvictionOutcome, only: Option<&Tenant>) {
        self.evict_where(need, now, out, only, Victims::Any);
    }

    fn evict_where(
        &mut self,
        need: u64,
        now: u64,
        out: &mut EvictionOutcome,
        only: Option<&Tenant>,
        victims: Victims,
    ) {
        let chosen = self.victims(need, now, only, victims);
        self.evict_chosen(&chosen, out);
    }

    /// The objects [`Self::evict_where`] would evict to free `need` bytes, with the bytes
    /// each frees (all its memory replicas); nothing changes.
    fn victims(
        &mut self,
        need: u64,
        now: u64,
        only: Option<&Tenant>,
        victims: Victims,
    ) -> Vec<(Tenant, String, u64)> {
        // Walks the kept eviction order from its front (table.rs): the cost is the victims,
        // not every object. Lossless: only objects with an SSD copy (all ranked before those
        // without) or, in offload-on-evict mode, any (staged for the SSD writer).
        let saved_only = victims == Victims::Lossless && !self.policy.offload_on_evict;
        let objects = &mut self.objects;
        take_in_order(
            |visit| {
                objects.walk(
                    only,
                    |o| Candidate {
                        size: o.fp.charge().saturating_mul(o.mem.len() as u64),
                        leased: o.leased(now),
                        pinned: o.pin_until_ms > now,
                        unsaved: o.disk.is_none(),
                        last_access: o.last_access,
                    },
                    &mut |(t, k), c| {
                        // lossless: the unsaved rank after every saved one, none qualifies
                        !(saved_only && c.unsaved) && visit((t.clone(), k.to_string(), c.size), c)
                    },
                )
            },
            need,
        )
    }

    /// Evicts `chosen` (from [`Self::victims`]).
    fn evict_chosen(&mut self, chosen: &[(Tenant, String, u64)], out: &mut EvictionOutcome) {
        let on_evict = self.policy.offload_on_evict;
        for (t, k, _) in chosen {
            let Some(mut o) = self.obj_mut(t, k) else {
                continue;
            };
            let gone = std::mem::take(&mut o.mem);
            if gone.is_empty() {
                continue;
            }
            let charge = o.fp.charge();
            let token = o.token;
            let keep_disk = o.disk.is_some();
            let copy_queued = o.copy_queued;
            drop(o); // counted again (table.rs) before the master is used
            let data = gone.iter().find_map(|r| self.segments.data(r.alloc));
            // A store node that offloads its evictions keeps the bytes of this replica
            // until they are on its SSD (the first such replica; the others just go).
            let on_node = if keep_disk {
                None
            } else {
                gone.iter().find_map(|r| {
                    let owner = self.segments.get(r.seg)?.owner;
                    let st = self.nodes.get(&owner)?;
                    (st.offload_on_evict && st.addr.is_some()).then_some((owner, r.seg, r.alloc))
                })
            };
            for r in &gone {
                self.segments.free(r.alloc);
            }
            out.evicted += 1;
            out.freed += charge.saturating_mul(gone.len() as u64);
            self.evictions_total += 1;
            if keep_disk {
                // The version lives on in its SSD copy: the nodes that held these replicas
                // hear of its death too while their frees are unacknowledged (`frees`).
                self.note_freed(t, k, &gone);
                continue;
            }
            if let Some((node, seg, alloc)) = on_node {
                self.note_freed(t, k, &gone);
                if let Some(st) = self.nodes.get_mut(&node) {
                    st.offload.push(alloc);
                }
                if let Some(mut o) = self.obj_mut(t, k) {
                    o.staged = Some(Staged::OnNode { node, seg, alloc });
                }
                continue;
            }
            // Staged (readable meanwhile) until its SSD copy is registered or the write
            // gives up (`unstage`): written now in offload-on-evict mode, or already queued
            // as this version's write-through copy (the queued write holds these bytes).
            match (on_evict || copy_queued, data) {
                (true, Some(d)) => {
                    self.note_freed(t, k, &gone);
                    if let Some(mut o) = self.obj_mut(t, k) {
                        o.staged = Some(Staged::Bytes(d.clone()));
                    }
                    if !copy_queued {
                        out.to_offload.push(StagedOffload {
                            tenant: t.clone(),
                            key: k.clone(),
                            token,
                            data: d,
                        });
                    }
                }
                _ => {
                    // Gone: an SSD copy its node may still be writing is cancelled, and every
                    // node that held one of the replicas just taken is told the version is
                    // gone (it keeps its memory across a remount: `adopt`).
                    if let Some(o) = self.take_obj(t, k) {
                        let mut g = o.gone();
                        g.add_mem_segs(gone.iter().map(|r| r.seg));
                        self.settle_gone(t, k, g);
                    }
                }
            }
        }
    }

    /// A handle placed by another leader epoch names no put of this master.
    fn same_epoch(&self, h: &PutHandle) -> L3Result<()> {
        if h.epoch != self.epoch {
            return Err(L3Error::EpochFenced(format!(
                "the put of {:?} started under master epoch {}, the leader is now epoch {}: \
                 put it again",
                h.key, h.epoch, self.epoch
            )));
        }
        Ok(())
    }

    /// The pending object a handle names (token-checked).
    fn pending(&self, h: &PutHandle) -> L3Result<&Object> {
        self.same_epoch(h)?;
        let o = self.obj(&h.tenant, &h.key).ok_or(L3Error::ObjectNotFound)?;
        if o.token != h.token {
            return Err(L3Error::IllegalClient("put token does not match".into()));
        }
        if o.is_complete() {
            return Err(L3Error::ObjectAlreadyExists);
        }
        Ok(o)
    }

    /// Stores the bytes of a pending put in every replica this master holds the bytes of
    /// (token-checked).
    pub fn put_write(&mut self, h: &PutHandle, data: Arc<[u8]>) -> L3Result<()> {
        let allocs: Vec<u64> = self.pending(h)?.allocs().collect();
        if allocs.is_empty() {
            return Err(L3Error::ObjectNotFound);
        }
        for a in allocs {
            self.segments.write(a, data.clone())?;
        }
        Ok(())
    }

    /// `PutEnd` where this master holds the bytes (embedded, `--role both`): every replica
    /// must be written (-703 if not); the object becomes visible. Returns its bytes (for
    /// write-through offload).
    pub fn put_end(
        &mut self,
        h: &PutHandle,
        soft_pin: bool,
        now: u64,
    ) -> L3Result<Option<Arc<[u8]>>> {
        let o = self.pending(h)?;
        let allocs: Vec<u64> = o.allocs().collect();
        if allocs.is_empty() {
            return Err(L3Error::ObjectNotFound);
        }
        if !allocs.iter().all(|&a| self.segments.is_written(a)) {
            return Err(L3Error::ReplicaIsNotReady);
        }
        let data = self.segments.data(allocs[0]);
        self.complete(h, soft_pin, now)?;
        Ok(data)
    }

    /// `PutEnd` of one replica by the store node holding its bytes (split deployment): the
    /// replica named by the handle is marked ended; the object becomes visible when every
    /// replica is. The node writes the write-through SSD copy when `primary` is true.
    pub fn end_replica(
        &mut self,
        node: ClientId,
        h: &PutHandle,
        soft_pin: bool,
        now: u64,
    ) -> L3Result<ReplicaEnded> {
        let alloc = match h.replica {
            ReplicaDescriptor::Memory { alloc, .. } => alloc,
            ReplicaDescriptor::Disk { .. } => {
                return Err(L3Error::InvalidParams(
                    "a put handle names a memory replica".into(),
                ));
            }
        };
        let o = self.pending(h)?;
        let i = o
            .mem
            .iter()
            .position(|r| r.alloc == alloc)
            .ok_or(L3Error::ObjectNotFound)?;
        if self.segments.get(o.mem[i].seg).map(|s| s.owner) != Some(node) {
            return Err(L3Error::IllegalClient(
                "the replica lives on another node".into(),
            ));
        }
        let mut o = self
            .obj_mut(&h.tenant, &h.key)
            .ok_or(L3Error::ObjectNotFound)?;
        o.mem[i].ended = true;
        let complete = o.mem.iter().all(|r| r.ended);
        drop(o);
        if complete {
            self.complete(h, soft_pin, now)?;
        }
        Ok(ReplicaEnded {
            complete,
            primary: i == 0,
        })
    }

    fn complete(&mut self, h: &PutHandle, soft_pin: bool, now: u64) -> L3Result<()> {
        let pin_ttl = self.policy.soft_pin_ttl_ms;
        let tick = self.touch();
        let mut o = self
            .obj_mut(&h.tenant, &h.key)
            .ok_or(L3Error::ObjectNotFound)?;
        o.state = ObjState::Complete;
        o.last_access = tick;
        if soft_pin {
            o.pin_until_ms = now.saturating_add(pin_ttl);
        }
        drop(o);
        self.readable(&h.tenant, &h.key);
        Ok(())
    }

    /// `PutRevoke`: drops a pending put (token-checked).
    pub fn put_revoke(&mut self, h: &PutHandle) -> L3Result<()> {
        self.same_epoch(h)?;
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

    /// Drops an object with all its memory replicas; an SSD copy already registered (the
    /// first replica's node writes it as soon as its replica ended) is tombstoned, one
    /// still being written is cancelled.
    pub(super) fn revoke_object(&mut self, t: &Tenant, key: &str) {
        if let Some(o) = self.take_obj(t, key) {
            for a in o.allocs() {
                self.segments.free(a);
            }
            self.settle_gone(t, key, o.gone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StoreConfig;
    use crate::master::MasterPolicy;

    /// A put placed by one leader epoch cannot be ended or revoked under another: the
    /// writer gets a typed `EpochFenced` (put it again), never a silent success.
    #[test]
    fn a_handle_of_another_epoch_is_fenced() {
        let mut m = Master::new(MasterPolicy::from_config(&StoreConfig::default()));
        m.mount_segment(ClientId(1), SegmentId(1), 1 << 20, 0)
            .unwrap();
        m.set_epoch(7);
        let t = Tenant::new("t").unwrap();
        let mut out = EvictionOutcome::default();
        let h = m.put_start(&t, "k", 10, 1, 0, &mut out).unwrap();
        assert_eq!(h.epoch, 7);
        for other in [6, 8] {
            let mut stale = h.clone();
            stale.epoch = other;
            assert!(matches!(
                m.end_replica(ClientId(1), &stale, false, 0),
                Err(L3Error::EpochFenced(_))
            ));
            assert!(matches!(m.put_revoke(&stale), Err(L3Error::EpochFenced(_))));
        }
        // The put of this epoch is untouched by the refused ones.
        assert!(m.put_revoke(&h).is_ok());
    }
}
