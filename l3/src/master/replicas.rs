//! Replica copy, move and clear (Mooncake's `CreateCopyTask` / `CreateMoveTask`, and
//! `BatchReplicaClear` with a segment name).
//!
//! Why: Mooncake lets a client ask for another replica of a key on a named segment (copy),
//! or for a replica to change segment (move: copy, then free the source replica), e.g. to
//! drain a segment before unmounting it. Mooncake runs these as tasks a client executes;
//! kvtier's master holds the bytes of every memory replica in this process (embedded store,
//! single server), so a copy is an allocation in the target segment sharing the source's
//! immutable bytes, done under the master lock: the task is complete when the call returns.
//!
//! Codes (checked against Mooncake 0.3.13): a missing key is -704; a target or source
//! segment that is not mounted, a move onto its own source, or a move from a segment that
//! holds no replica of the key is -600; a copy to a segment that already holds a replica
//! succeeds and changes nothing. Every check runs before any change, so a refused call
//! leaves the object as it was.
//!
//! Clear (master_service.cpp `BatchReplicaClear`, segment given): a key whose lease has
//! expired loses its memory replica in that segment; the object goes only when no copy is
//! left, so a replica in another segment keeps it readable. A missing key, a leased or
//! unfinished object, or one with no replica there is skipped (not an error).

use super::*;

/// What clearing one key's replica in a segment did.
#[derive(Debug)]
pub enum Cleared {
    /// Nothing: missing key, leased or unfinished object, or no replica in the segment.
    Skipped,
    /// The replica went; other copies keep the object.
    Replica,
    /// The replica was the last copy: the object went with it.
    Object(Removed),
}

impl Master {
    /// Adds a memory replica of `key` in segment `target` (nothing if one is there already).
    /// Returns whether a replica was added.
    pub fn copy_replica(&mut self, t: &Tenant, key: &str, target: SegmentId) -> L3Result<bool> {
        let (fp, src) = self.replica_source(t, key)?;
        let charge = fp.charge();
        let tgt = self.local_segment(target)?;
        let o = self.obj(t, key).ok_or(L3Error::ObjectNotFound)?;
        let owner_has = o.mem.iter().any(|r| {
            r.seg == target
                || self
                    .segments
                    .get(r.seg)
                    .is_some_and(|s| s.owner == tgt.owner)
        });
        if owner_has {
            return Ok(false);
        }
        // a copy counts against the tenant's cap like a put (-200 past it)
        if !self.within_quota(t, charge) {
            return Err(L3Error::NoAvailableHandle { needed: charge });
        }
        let alloc = self
            .segments
            .allocate_on(target, fp)
            .ok_or(L3Error::NoAvailableHandle { needed: charge })?;
        if let Err(e) = self.segments.write(alloc, src) {
            self.segments.free(alloc);
            return Err(e);
        }
        let tick = self.touch();
        if let Some(mut o) = self.obj_mut(t, key) {
            o.mem.push(MemReplica {
                seg: target,
                alloc,
                ended: true,
            });
            o.last_access = tick;
        }
        Ok(true)
    }

    /// Moves the memory replica of `key` in segment `source` to segment `target` (a copy,
    /// then the source replica is freed).
    pub fn move_replica(
        &mut self,
        t: &Tenant,
        key: &str,
        source: SegmentId,
        target: SegmentId,
    ) -> L3Result<()> {
        self.replica_source(t, key)?;
        if source == target {
            return Err(L3Error::InvalidParams(
                "move source and target are the same segment".into(),
            ));
        }
        self.local_segment(source)?;
        self.local_segment(target)?;
        let o = self.obj(t, key).ok_or(L3Error::ObjectNotFound)?;
        let Some(src_alloc) = o.mem.iter().find(|r| r.seg == source).map(|r| r.alloc) else {
            return Err(L3Error::InvalidParams(format!(
                "segment {} holds no replica of this key",
                source.0
            )));
        };
        if o.mem.iter().all(|r| r.seg != target) {
            // Copied straight into the target segment (not through `copy_replica`, which
            // would count the source replica's owner as already holding it).
            let fp = o.fp;
            let data = self
                .segments
                .data(src_alloc)
                .ok_or(L3Error::ObjectNotFound)?;
            let alloc =
                self.segments
                    .allocate_on(target, fp)
                    .ok_or(L3Error::NoAvailableHandle {
                        needed: fp.charge(),
                    })?;
            if let Err(e) = self.segments.write(alloc, data) {
                self.segments.free(alloc);
                return Err(e);
            }
            if let Some(mut o) = self.obj_mut(t, key) {
                o.mem.push(MemReplica {
                    seg: target,
                    alloc,
                    ended: true,
                });
            }
        }
        let tick = self.touch();
        if let Some(mut o) = self.obj_mut(t, key) {
            o.mem.retain(|r| r.alloc != src_alloc);
            o.last_access = tick;
        }
        self.segments.free(src_alloc);
        Ok(())
    }

    /// `BatchReplicaClear` of `key`'s memory replica in `segment` (see the module doc).
    /// -1011 for a store node's segment, whose bytes live in that node.
    pub fn clear_replica(
        &mut self,
        t: &Tenant,
        key: &str,
        segment: SegmentId,
        now: u64,
    ) -> L3Result<Cleared> {
        if self.segments.get(segment).is_some() {
            self.local_segment(segment)?;
        }
        let Some(o) = self.obj(t, key) else {
            return Ok(Cleared::Skipped);
        };
        if !o.is_complete() || o.leased(now) {
            return Ok(Cleared::Skipped);
        }
        let Some(alloc) = o.mem.iter().find(|r| r.seg == segment).map(|r| r.alloc) else {
            return Ok(Cleared::Skipped);
        };
        // A write-through copy still queued is no copy yet: the object goes, the store
        // cancels that write with what `remove` returns.
        let last = o.mem.len() == 1 && o.disk.is_none() && o.staged.is_none();
        if last {
            return self.remove(t, key, true, now).map(Cleared::Object);
        }
        if let Some(mut o) = self.obj_mut(t, key) {
            o.mem.retain(|r| r.alloc != alloc);
        }
        self.segments.free(alloc);
        Ok(Cleared::Replica)
    }

    /// The footprint and bytes of a complete object's first memory replica held in this
    /// process (-704 when the key is missing or has no memory replica here).
    fn replica_source(&self, t: &Tenant, key: &str) -> L3Result<(Footprint, Arc<[u8]>)> {
        let o = self.obj(t, key).ok_or(L3Error::ObjectNotFound)?;
        if !o.is_complete() {
            return Err(L3Error::ReplicaIsNotReady);
        }
        let data = o
            .mem
            .iter()
            .find_map(|r| self.segments.data(r.alloc))
            .ok_or(L3Error::ObjectNotFound)?;
        Ok((o.fp, data))
    }

    /// A mounted segment whose bytes this process holds (-600 if not mounted; -1011 for a
    /// store node's segment, whose bytes live in that node).
    fn local_segment(&self, id: SegmentId) -> L3Result<crate::segment::SegmentInfo> {
        let s = self
            .segments
            .get(id)
            .ok_or_else(|| L3Error::InvalidParams(format!("segment {} is not mounted", id.0)))?;
        if s.freed.is_some() {
            return Err(L3Error::UnavailableInMode(
                "replica copy/move of a store node's segment".into(),
            ));
        }
        Ok(s.clone())
    }
}
