//! Object placement: two-phase puts (start, write, end, revoke), allocation and eviction.
//!
//! Why apart: this is where memory is spent; eviction runs only from here, when a put needs
//! room.

use super::*;

impl Master {
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
    pub(super) fn allocate(
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

    pub(super) fn revoke_object(&mut self, t: &Tenant, key: &str) {
        if let Some(o) = self.take_obj(t, key)
            && let Some((_, a)) = o.mem
        {
            self.segments.free(a);
        }
    }
}
