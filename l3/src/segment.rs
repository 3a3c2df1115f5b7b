//! Memory segments: capacity accounting and the bytes of memory replicas.
//!
//! Why: in Mooncake a client *mounts* a segment (a region of its DRAM) and the master hands
//! out allocations inside it; the bytes live in the segment, the metadata in the master.
//! We keep that split: [`Segments`] knows capacities, owners and the allocation → bytes map;
//! the master only stores `(segment, alloc)` pairs. A [`crate::QueryResult`] names an
//! allocation, so a read that reuses a query result goes straight to the bytes here without
//! another key lookup.
//!
//! **What a replica costs.** A segment's capacity bounds the DRAM its replicas take, not only
//! their values: each allocation is charged its value, its key twice (the master's object
//! table and its eviction order each hold one) and [`OBJECT_OVERHEAD_BYTES`] for the metadata
//! the store keeps per object (the object record and its hash-table slot, the eviction-order
//! entry, the allocation record, the value's buffer header, the allocator's own headers).
//! Counting values alone let a 4 MiB segment hold 3.28 million one-byte objects in 1.8 GiB.
//! [`Footprint`] carries both numbers, so no caller can allocate a value without its charge.
//! The constant is measured, not guessed: `tests/dram_accounting.rs` counts the heap a store
//! grows by per object (a counting allocator) and fails when it passes the charge.
//!
//! Invariant: `used` of a segment is the sum of the charges of its allocations (written or
//! not).
//! Bytes are `Arc<[u8]>` so a reader copies them out *after* the metadata lock is released.
//! Freed buffers nobody else holds are recycled for later puts of the same size
//! ([`crate::buffers`]); recycled plus allocated bytes never exceed the total capacity.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::buffers::Recycler;
use crate::error::{L3Error, L3Result};
use crate::types::{ClientId, SegmentId};

/// Bytes of metadata a memory replica is charged besides its value and key: the heap the
/// store grows by per object at its worst, a churned hash table at a fifth of its capacity
/// (about 700 bytes with a one-byte value and a 16-byte key; 560 in fresh tables just after
/// they doubled: `tests/dram_accounting.rs`), plus the system allocator's headers of its
/// allocations (the object's box, two keys, its replica list, its value).
pub const OBJECT_OVERHEAD_BYTES: u64 = 832;

/// Copies of a key the store keeps per object (object table, eviction order).
pub const KEY_COPIES: u64 = 2;

/// What a memory replica of a `value_bytes` value under a `key_len`-byte key is charged in
/// its segment (see the module docs).
pub fn charge(value_bytes: u64, key_len: usize) -> u64 {
    value_bytes
        .saturating_add((key_len as u64).saturating_mul(KEY_COPIES))
        .saturating_add(OBJECT_OVERHEAD_BYTES)
}

/// A memory replica's value size and its charge against a segment's capacity; made only by
/// [`Footprint::of`], so a charge always goes with its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    bytes: u64,
    charge: u64,
}

impl Footprint {
    /// The footprint of a `bytes`-byte value under `key`.
    pub fn of(bytes: u64, key: &str) -> Self {
        Footprint {
            bytes,
            charge: charge(bytes, key.len()),
        }
    }

    /// Bytes of the value (what a write must bring).
    pub fn bytes(self) -> u64 {
        self.bytes
    }

    /// Bytes counted against the segment.
    pub fn charge(self) -> u64 {
        self.charge
    }
}

/// One mounted segment.
#[derive(Debug, Clone)]
pub struct SegmentInfo {
    /// Client that mounted it (its liveness decides the segment's fate).
    pub owner: ClientId,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Bytes charged to its allocations (values, keys, metadata: [`charge`]).
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
    /// Size of the value in bytes.
    pub size: u64,
    /// What it is charged against its segment ([`charge`]).
    pub charge: u64,
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
        // Kept buffers must fit in what is not allocated of the capacity left.
        let free = self.capacity().saturating_sub(self.used());
        drop(self.recycler.trim(free));
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

    /// Total bytes charged to allocations.
    pub fn used(&self) -> u64 {
        self.segs.values().map(|s| s.used).sum()
    }

    /// Allocates a replica in the segment with the most free space that fits it.
    pub fn allocate(&mut self, fp: Footprint) -> Option<(SegmentId, u64)> {
        self.allocate_spread(fp, 1, &[]).pop()
    }

    /// Distinct owners with a segment that could hold a replica of `fp` (the most replicas
    /// [`Self::allocate_spread`] can place).
    pub fn owners_fitting(&self, fp: Footprint) -> usize {
        let mut owners: Vec<ClientId> = self
            .segs
            .values()
            .filter(|s| s.capacity >= fp.charge)
            .map(|s| s.owner)
            .collect();
        owners.sort_unstable();
        owners.dedup();
        owners.len()
    }

    /// Allocates a replica of `fp` in each of up to `n` segments with distinct owners, none
    /// of them in `skip`, the segments with the most free space first (ties: lowest id).
    /// Returns what it placed: fewer than `n` (maybe none) when fewer owners have room.
    pub fn allocate_spread(
        &mut self,
        fp: Footprint,
        n: usize,
        skip: &[ClientId],
    ) -> Vec<(SegmentId, u64)> {
        let mut fits: Vec<(u64, SegmentId, ClientId)> = self
            .segs
            .iter()
            .filter(|(_, s)| s.capacity - s.used >= fp.charge && !skip.contains(&s.owner))
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
            if let Some(a) = self.allocate_in(sid, fp) {
                out.push((sid, a));
            }
        }
        out
    }

    /// Allocates a replica of `fp` in segment `sid` if it has room.
    pub fn allocate_on(&mut self, sid: SegmentId, fp: Footprint) -> Option<u64> {
        let s = self.segs.get(&sid)?;
        if s.capacity.saturating_sub(s.used) < fp.charge {
            return None;
        }
        self.allocate_in(sid, fp)
    }

    fn allocate_in(&mut self, sid: SegmentId, fp: Footprint) -> Option<u64> {
        let seg = self.segs.get_mut(&sid)?;
        seg.used += fp.charge;
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
                size: fp.bytes,
                charge: fp.charge,
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
            s.used = s.used.saturating_sub(a.charge);
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

    /// An allocation (its segment, value size and charge), if it exists.
    pub fn alloc(&self, alloc: u64) -> Option<&Alloc> {
        self.allocs.get(&alloc)
    }

    /// Allocations held, in every segment.
    pub fn allocations(&self) -> usize {
        self.allocs.len()
    }

    /// What breaks the module invariants, if anything: a segment whose `used` is not the sum
    /// of its allocations' charges, one used past its capacity, an allocation in no mounted
    /// segment, written bytes of another length than its value, or recycled buffers past
    /// the capacity not allocated.
    pub fn mismatch(&self) -> Option<String> {
        let free = self.capacity().saturating_sub(self.used());
        if self.recycler.bytes() > free {
            return Some(format!(
                "{} bytes of recycled buffers, {free} bytes not allocated",
                self.recycler.bytes()
            ));
        }
        let mut sums: BTreeMap<SegmentId, u64> = BTreeMap::new();
        for (id, a) in &self.allocs {
            if !self.segs.contains_key(&a.segment) {
                return Some(format!(
                    "allocation {id} in unmounted segment {}",
                    a.segment.0
                ));
            }
            if let Some(d) = &a.data
                && d.len() as u64 != a.size
            {
                return Some(format!(
                    "allocation {id}: {} bytes written, size {}",
                    d.len(),
                    a.size
                ));
            }
            let s = sums.entry(a.segment).or_default();
            *s = s.saturating_add(a.charge);
        }
        self.segs.iter().find_map(|(id, s)| {
            let sum = sums.get(id).copied().unwrap_or(0);
            (s.used != sum || s.used > s.capacity).then(|| {
                format!(
                    "segment {}: used {}, its allocations charged {sum}, capacity {}",
                    id.0, s.used, s.capacity
                )
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recycled buffers stay within the capacity not allocated when a segment is unmounted:
    /// they were bounded by the free space of every segment, the unmounted one's included,
    /// and kept that much past its unmount (until the next allocation trimmed them).
    #[test]
    fn an_unmount_trims_what_is_recycled_to_the_capacity_left() {
        let mut s = Segments::default();
        s.mount(SegmentId(1), ClientId(1), 16 << 10).unwrap();
        s.mount(SegmentId(2), ClientId(2), 1 << 20).unwrap();
        let fp = Footprint::of(64 << 10, "k");
        let a = s.allocate_on(SegmentId(2), fp).unwrap();
        s.write(a, Arc::from(vec![1u8; 64 << 10])).unwrap();
        s.free(a);
        assert_eq!(s.recycled_bytes(), 64 << 10);
        s.unmount(SegmentId(2)).unwrap();
        assert_eq!(s.mismatch(), None);
        assert!(s.recycled_bytes() <= 16 << 10, "{}", s.recycled_bytes());
    }
}
