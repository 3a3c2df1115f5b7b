//! Locks: what keeps a page in use from being evicted.
//!
//! Why handles: a running request reads its prefix pages every step, an in-flight copy reads
//! or writes them; if any of these pages were evicted and reused, the engine would read another
//! prompt's KV. A lock is taken on a node for one tier and pins that node and all its
//! ancestors on that tier. The caller gets a [`LockHandle`] that is neither `Clone` nor `Copy`
//! and must be given back with [`RadixCache::unlock`]; every live lock is also recorded in the
//! cache, so [`RadixCache::outstanding_locks`] finds any that were never given back.
//!
//! A refused `unlock` or `relock` hands the handle back inside [`Refused`] (as Dynamo's
//! `stage(self) -> Result<_, BlockError<MutableBlock>>` does): a handle consumed by a failed
//! call could never be given back, and its path would stay pinned for the cache's lifetime.

use std::fmt;
use std::marker::PhantomData;

use slotmap::new_key_type;

use crate::cache::RadixCache;
use crate::error::{RadixError, Refused};
use crate::node::NodeId;
use crate::tier::{Tier, TierKind};

new_key_type! {
    /// Id of a live lock record.
    pub struct LockId;
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct LockRecord {
    pub node: NodeId,
    pub tier: TierKind,
}

/// Proof of one lock on tier `T` at a node. Give it back with [`RadixCache::unlock`].
#[must_use = "a lock that is never given back pins its pages forever"]
pub struct LockHandle<T: Tier> {
    id: LockId,
    cache: u64,
    node: NodeId,
    _tier: PhantomData<T>,
}

impl<T: Tier> LockHandle<T> {
    /// The locked node (its end depth is the locked prefix length).
    pub fn node(&self) -> NodeId {
        self.node
    }
}

impl<T: Tier> fmt::Debug for LockHandle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LockHandle<{}>({:?})", T::KIND, self.node)
    }
}

impl RadixCache {
    /// Locks `node` (and so its whole path) on tier `T`. The node must have a copy on `T`.
    pub fn lock<T: Tier>(&mut self, node: NodeId) -> Result<LockHandle<T>, RadixError> {
        if !self.node(node)?.has(T::KIND) {
            return Err(RadixError::NotResident { tier: T::KIND });
        }
        self.add_lock(node, T::KIND, 1);
        let id = self.locks.insert(LockRecord {
            node,
            tier: T::KIND,
        });
        Ok(LockHandle {
            id,
            cache: self.id,
            node,
            _tier: PhantomData,
        })
    }

    /// Gives a lock back. Returns the node it was held on; a handle of another cache or tier
    /// is refused and handed back.
    pub fn unlock<T: Tier>(
        &mut self,
        handle: LockHandle<T>,
    ) -> Result<NodeId, Refused<LockHandle<T>>> {
        match self.lock_record(&handle) {
            Ok(rec) => {
                self.release_record(handle.id, rec);
                Ok(rec.node)
            }
            Err(error) => Err(Refused { error, handle }),
        }
    }

    /// Moves a lock to another node (typically deeper, after inserting more pages): locks the
    /// new node first, then releases the old one, so the shared prefix is never unpinned. On
    /// refusal (a bad handle, or `node` not lockable on `T`) the old lock is handed back, still
    /// held.
    pub fn relock<T: Tier>(
        &mut self,
        handle: LockHandle<T>,
        node: NodeId,
    ) -> Result<LockHandle<T>, Refused<LockHandle<T>>> {
        let rec = match self.lock_record(&handle) {
            Ok(rec) => rec,
            Err(error) => return Err(Refused { error, handle }),
        };
        match self.lock::<T>(node) {
            Ok(new) => {
                self.release_record(handle.id, rec);
                Ok(new)
            }
            Err(error) => Err(Refused { error, handle }),
        }
    }

    /// The live record `handle` proves, if it is one of this cache's locks on `T`.
    fn lock_record<T: Tier>(&self, handle: &LockHandle<T>) -> Result<LockRecord, RadixError> {
        if handle.cache != self.id {
            return Err(RadixError::ForeignHandle);
        }
        let rec = *self.locks.get(handle.id).ok_or(RadixError::UnknownLock)?;
        if rec.tier != T::KIND || rec.node != handle.node {
            return Err(RadixError::WrongTier { tier: T::KIND });
        }
        Ok(rec)
    }

    /// Drops a checked lock record and its pin counts (cannot fail).
    fn release_record(&mut self, id: LockId, rec: LockRecord) {
        self.locks.remove(id);
        self.add_lock(rec.node, rec.tier, -1);
    }

    /// Number of locks taken and not yet given back, per tier `(device, host)`.
    pub fn outstanding_locks(&self) -> (usize, usize) {
        let dev = self
            .locks
            .values()
            .filter(|r| r.tier == TierKind::Device)
            .count();
        (dev, self.locks.len() - dev)
    }

    /// Adds `delta` (±1) to the lock count of `node` and every ancestor on tier `t`.
    fn add_lock(&mut self, node: NodeId, t: TierKind, delta: i32) {
        let mut cur = Some(node);
        while let Some(id) = cur {
            let n = &mut self.nodes[id];
            let len = n.len();
            let slot = n.slot_mut(t);
            let before = slot.lock;
            slot.lock = if delta > 0 {
                before + 1
            } else {
                before.saturating_sub(1)
            };
            let after = slot.lock;
            cur = n.parent;
            let book = &mut self.books[t as usize];
            if before == 0 && after > 0 {
                book.locked_pages += len;
                self.refresh_evictable(id, t);
            } else if before > 0 && after == 0 {
                book.locked_pages -= len;
                self.refresh_evictable(id, t);
            }
        }
    }
}
