//! A dummy client's pool (`setup_dummy`'s `mem_pool_size`, handed out by
//! `alloc_from_mem_pool`).
//!
//! Why shared memory when it can be: a Mooncake dummy client's pool is the real client's
//! shared memory, so puts from and gets into it cost no copy in the dummy process. Here, on a
//! `kvtier-l3` server of the same host, the pool is a region of the client's shared-memory
//! path (a memfd the server maps too): the server reads and writes pool memory in place.
//! Against a split deployment's master, the region is mapped by every store node of this
//! host. Elsewhere (an embedded store, a server on another host, `KVTIER_L3_SHM=off`) it is
//! this process's heap, with the same results through the ordinary paths.

use std::sync::Arc;

use kvtier_l3::{RemoteStore, SharedRegion};

use crate::fork::Owner;

/// `n` zeroed bytes (n > 0) on the heap, or None when the allocator cannot give them
/// (zero pages from the allocator, not written here: a large pool costs no time up front).
fn zeroed(n: usize) -> Option<Box<[u8]>> {
    if n == 0 {
        return None;
    }
    let layout = std::alloc::Layout::array::<u8>(n).ok()?;
    // SAFETY: a layout of n > 0 bytes; the pointer, when not null, is a fresh allocation of
    // that layout handed to the Box, which frees it with the same layout (n bytes, align 1).
    unsafe {
        let p = std::alloc::alloc_zeroed(layout);
        (!p.is_null()).then(|| Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n)))
    }
}

/// Where the pool's bytes live.
enum Mem {
    Shared(Arc<SharedRegion>),
    Heap(Box<[u8]>),
}

/// The pool and how much of it is handed out.
pub struct Pool {
    mem: Mem,
    used: usize,
    /// A child forked after gets none of it: shared memory is the parent's, not a copy, and
    /// the child's allocator state would hand out the parent's next addresses (`fork.rs`).
    owner: Owner,
}

impl Pool {
    /// `n` bytes (n > 0), shared with `remote`'s server when it has a shared-memory path;
    /// None when the host cannot give them (an infallible allocation aborted the process on
    /// a `mem_pool_size` past what the host holds).
    pub fn new(remote: Option<&RemoteStore>, n: usize) -> Option<Self> {
        let shared = remote
            .filter(|r| r.uses_shm())
            .and_then(|r| r.shared_region(n).ok());
        let mem = match shared {
            Some(r) => Mem::Shared(r),
            None => Mem::Heap(zeroed(n)?),
        };
        Some(Pool {
            mem,
            used: 0,
            owner: Owner::here(),
        })
    }

    /// Whether the pool is memory the server maps.
    pub fn is_shared(&self) -> bool {
        matches!(self.mem, Mem::Shared(_))
    }

    fn base_len(&self) -> (u64, usize) {
        match &self.mem {
            Mem::Shared(r) => (r.as_ptr() as u64, r.len()),
            Mem::Heap(b) => (b.as_ptr() as u64, b.len()),
        }
    }

    /// The address of the next `n` bytes (64-byte aligned), handed out once `register`
    /// accepts them; None when the pool is exhausted or `register` refuses, and in a child
    /// forked after the pool was made.
    pub fn alloc(&mut self, n: usize, register: impl FnOnce(u64) -> bool) -> Option<u64> {
        if !self.owner.is_here() {
            return None;
        }
        let (base, len) = self.base_len();
        let start = self.used.div_ceil(64) * 64;
        let end = start.checked_add(n).filter(|&e| n > 0 && e <= len)?;
        let addr = base + start as u64;
        if !register(addr) {
            return None;
        }
        self.used = end;
        Some(addr)
    }
}
