//! Memory segments: capacity accounting and the bytes of memory replicas.
//!
//! Why: in Mooncake a client *mounts* a segment (a region of its DRAM) and the master hands
//! out allocations inside it; the bytes live in the segment, the metadata in the master.
//! We keep that split: [`Segments`] knows capacities, owners and the allocation → bytes map;
//! the master only stores `(segment, alloc)` pairs. A [`crate::QueryResult`] names an
//! allocation, so a read that reuses a query result goes straight to the bytes here without
//! another key lookup.
//!
//! Invariant: `used` of a segment is the sum of `size` of its allocations (written or not).
//! Bytes are `Arc<[u8]>` so a reader copies them out *after* the metadata lock is released.
//! Freed buffers nobody else holds are recycled for later puts of the same size
//! ([`crate::buffers`]); recycled plus allocated bytes never exceed the total capacity.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::buffers::Recycler;
use crate::error::{L3Error, L3Result};
use crate::types::{ClientId, SegmentId};

/// One mounted segment.
#[derive(Debug, Clone)]
pub struct SegmentInfo {
    /// Client that mounted it (its liveness decides the segment's fate).
    pub owner: ClientId,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Bytes allocated.
    pub used: u64,
    /// Allocations freed since the owner last asked (only for segments whose bytes live in
    /// another process, a store node: it drops those bytes when told).
    pub freed: Option<Vec<u64>>,
}

/// One allocation inside a segment.
#[derive(Debug, Clone)]
pub struct Alloc {
    /// Segment holding it.
    pub segment: SegmentId,
    /// Size in bytes.
    pub size: u64,
    /// The bytes, once written (None between PutStart and the write).
    pub data: Option<Arc<[u8]>>,
}

/// All segments and allocations.
#[derive(Debug, Default)]
pub struct Segments {
    segs: BTreeMap<SegmentId, SegmentInfo>,
    allocs: HashMap<u64, Alloc>,
    next_alloc: u64,
    frees: u64,
    recycler: Recycler,
}

impl Segments {
    /// Mounts a segment; -102 if the id is taken.
    pub fn mount(&mut self, id: SegmentId, owner: ClientId, capacity: u64) -> L3Result<()> {
        self.mount_with(id, owner, capacity, false)
    }

    /// Mounts a segment whose bytes live on a store node: frees are recorded for
    /// [`Segments::take_freed`] so the node can drop the bytes.
    pub fn mount_remote(&mut self, id: SegmentId, owner: ClientId, capacity: u64) -> L3Result<()> {
        self.mount_with(id, owner, capacity, true)
    }

    fn mount_with(
        &mut self,
        id: SegmentId,
        owner: ClientId,
        capacity: u64,
        remote: bool,
    ) -> L3Result<()> {
        if capacity == 0 {
            return Err(L3Error::InvalidParams(
                "segment capacity must be > 0".into(),
            ));
        }
        if self.segs.contains_key(&id) {
            return Err(L3Error::SegmentAlreadyExists);
        }
        self.segs.insert(
            id,
            SegmentInfo {
                owner,
                capacity,
                used: 0,
                freed: remote.then(Vec::new),
            },
        );
        Ok(())
    }

    /// Removes a segment and returns the allocation ids it held (the master drops those replicas).
    pub fn unmount(&mut self, id: SegmentId) -> L3Result<Vec<u64>> {
        if self.segs.remove(&id).is_none() {
            return Err(L3Error::SegmentNotFound);
        }
        let gone: Vec<u64> = self
            .allocs
            .iter()
            .filter(|(_, a)| a.segment == id)
            .map(|(&k, _)| k)
            .collect();
        for k in &gone {
            self.allocs.remove(k);
        }
        Ok(gone)
    }

    /// Segment info.
    pub fn get(&self, id: SegmentId) -> Option<&SegmentInfo> {
        self.segs.get(&id)
    }

    /// Segments owned by a client.
    pub fn owned_by(&self, owner: ClientId) -> Vec<SegmentId> {
        self.segs
            .iter()
            .filter(|(_, s)| s.owner == owner)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Capacity of the segments whose bytes this process holds (not a store node's) and
    /// whose owner `counts`.
    pub fn held_capacity(&self, counts: impl Fn(ClientId) -> bool) -> u64 {
        self.segs
            .values()
            .filter(|s| s.freed.is_none() && counts(s.owner))
            .map(|s| s.capacity)
            .fold(0, u64::saturating_add)
    }

    /// Total capacity of all segments.
    pub fn capacity(&self) -> u64 {
        self.segs.values().map(|s| s.capacity).sum()
    }

    /// Total bytes allocated.
    pub fn used(&self) -> u64 {
        self.segs.values().map(|s| s.used).sum()
    }

    /// Allocates `size` bytes in the segment with the most free space that fits.
    pub fn allocate(&mut self, size: u64) -> Option<(SegmentId, u64)> {
        self.allocate_spread(size, 1, &[]).pop()
    }

    /// Allocates `size` bytes in each of up to `n` segments with distinct owners, none of
    /// them in `skip`, the segments with the most free space first (ties: lowest id).
    /// Returns what it placed: fewer than `n` (maybe none) when fewer owners have room.
    /// Distinct owners with a segment that could hold an object of `size` (the most replicas
    /// [`Self::allocate_spread`] can place).
    pub fn owners_fitting(&self, size: u64) -> usize {
        let mut owners: Vec<ClientId> = self
            .segs
            .values()
            .filter(|s| s.capacity >= size)
            .map(|s| s.owner)
            .collect();
        owners.sort_unstable();
        owners.dedup();
        owners.len()
    }

    pub fn allocate_spread(
        &mut self,
        size: u64,
        n: usize,
        skip: &[ClientId],
    ) -> Vec<(SegmentId, u64)> {
        let mut fits: Vec<(u64, SegmentId, ClientId)> = self
            .segs
            .iter()
            .filter(|(_, s)| s.capacity - s.used >= size && !skip.contains(&s.owner))
            .map(|(&id, s)| (s.capacity - s.used, id, s.owner))
            .collect();
        fits.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut owners: Vec<ClientId> = Vec::new();
        let mut out = Vec::new();
        for (_, sid, owner) in fits {
            if out.len() >= n {
                break;
            }
            if owners.contains(&owner) {
                continue;
            }
            owners.push(owner);
            if let Some(a) = self.allocate_in(sid, size) {
                out.push((sid, a));
            }
        }
        out
    }

    /// Allocates `size` bytes in segment `sid` if it has room.
    pub fn allocate_on(&mut self, sid: SegmentId, size: u64) -> Option<u64> {
        let s = self.segs.get(&sid)?;
        if s.capacity.saturating_sub(s.used) < size {
            return None;
        }
        self.allocate_in(sid, size)
    }

    fn allocate_in(&mut self, sid: SegmentId, size: u64) -> Option<u64> {
        let seg = self.segs.get_mut(&sid)?;
        seg.used += size;
        let free = self.capacity().saturating_sub(self.used());
        if self.recycler.bytes() > free {
            // Kept buffers must fit in what is not allocated.
            drop(self.recycler.trim(free));
        }
        self.next_alloc += 1;
        let id = self.next_alloc;
        self.allocs.insert(
            id,
            Alloc {
                segment: sid,
                size,
                data: None,
            },
        );
        Some(id)
    }

    /// Frees an allocation (no-op if already gone).
    pub fn free(&mut self, alloc: u64) {
        self.frees = self.frees.wrapping_add(1);
        if let Some(a) = self.allocs.remove(&alloc)
            && let Some(s) = self.segs.get_mut(&a.segment)
        {
            s.used = s.used.saturating_sub(a.size);
            if let Some(f) = &mut s.freed {
                f.push(alloc);
            }
            if let Some(d) = a.data {
                let free = self.capacity().saturating_sub(self.used());
                drop(self.recycler.keep(d, free));
            }
        }
    }

    /// A recycled buffer of `size` bytes for a put's bytes (see [`crate::buffers`]).
    pub fn take_buffer(&mut self, size: u64) -> Option<Arc<[u8]>> {
        self.recycler.take(usize::try_from(size).ok()?)
    }

    /// Cuts the recycled buffers to at most `limit` bytes (an idle store gives memory
    /// back); returns the others for the caller to drop outside its lock.
    pub fn trim_recycled(&mut self, limit: u64) -> Vec<Arc<[u8]>> {
        self.recycler.trim(limit)
    }

    /// Bytes of recycled buffers held.
    pub fn recycled_bytes(&self) -> u64 {
        self.recycler.bytes()
    }

    /// Moves with every allocation and free (the sweeper's idle test).
    pub fn activity(&self) -> u64 {
        self.next_alloc.wrapping_add(self.frees)
    }

    /// Allocations of a remote segment freed since the last call (its node drops them).
    pub fn take_freed(&mut self, id: SegmentId) -> Vec<u64> {
        self.segs
            .get_mut(&id)
            .and_then(|s| s.freed.as_mut())
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Whether `alloc` was freed in remote segment `id` since the last [`Segments::take_freed`].
    pub fn freed_not_taken(&self, id: SegmentId, alloc: u64) -> bool {
        self.segs
            .get(&id)
            .and_then(|s| s.freed.as_ref())
            .is_some_and(|f| f.contains(&alloc))
    }

    /// Stores the bytes of an allocation. The length must equal the allocation's size.
    pub fn write(&mut self, alloc: u64, data: Arc<[u8]>) -> L3Result<()> {
        let a = self.allocs.get_mut(&alloc).ok_or(L3Error::ObjectNotFound)?;
        if data.len() as u64 != a.size {
            return Err(L3Error::InvalidParams(format!(
                "write of {} bytes into a {}-byte allocation",
                data.len(),
                a.size
            )));
        }
        a.data = Some(data);
        Ok(())
    }

    /// Bytes of an allocation, if written.
    pub fn data(&self, alloc: u64) -> Option<Arc<[u8]>> {
        self.allocs.get(&alloc).and_then(|a| a.data.clone())
    }

    /// Whether the allocation exists and has been written.
    pub fn is_written(&self, alloc: u64) -> bool {
        self.allocs.get(&alloc).is_some_and(|a| a.data.is_some())
    }
}
