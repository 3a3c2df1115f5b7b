//! Memory registered with `register_buffer`, and the one type that may touch raw addresses.
//!
//! Why a type: Mooncake's pointer calls (`put_from`, `get_into`, `get_into_ranges`, ...) take
//! integer addresses. Reading or writing through an integer is only sound inside memory the
//! caller registered (and promised to keep alive until `unregister_buffer`). A
//! [`RegisteredRange`] has private fields and is built only by [`RegionUse::check`] (or by
//! narrowing a range that was), so a raw range that skipped the registration check cannot
//! exist anywhere in the crate: every `unsafe` slice comes from a checked range. A region
//! is registered only while it is mapped readable and writable (`mapped.rs`); keeping it
//! mapped until `unregister_buffer` returns is the caller's part.
//!
//! Why a use: the pointer calls copy with the GIL released, so another thread can call
//! `unregister_buffer` (or `close`) in the middle of a copy and free the buffer as soon as it
//! returns, exactly as the contract allows. A call holds a [`RegionUse`] from before its
//! ranges are checked until its last byte is copied (ranges borrow it, so none outlives
//! it), and `unregister` / `clear` return only after every call that began before them has
//! ended (a grace period: the calls are counted by the parity of the epoch they began in,
//! so a stream of new calls never holds a teardown up). Before, a copy went on writing
//! into the freed buffer (SIGSEGV, or another allocation's bytes).

use std::collections::BTreeMap;
use std::marker::PhantomData;

use parking_lot::{Condvar, Mutex};

use super::INVALID_PARAMS;
use super::mapped::is_mapped_rw;
use crate::overlap::overlapping;

/// A byte range inside one registered region, valid while the [`RegionUse`] `'u` that
/// checked it lasts. `Send`: it is an address, not a borrow of the bytes, so the store call
/// that uses it can run with the GIL released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RegisteredRange<'u> {
    start: usize,
    len: usize,
    _use: PhantomData<&'u ()>,
}

impl<'u> RegisteredRange<'u> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// `(start address, length)`, for [`crate::overlap::overlapping`].
    pub(crate) fn span(&self) -> (usize, usize) {
        (self.start, self.len)
    }

    /// The bytes of the range.
    ///
    /// # Safety
    /// The registering caller keeps the region alive and unaliased by Rust references until
    /// `unregister_buffer` returns (Mooncake's contract for `register_buffer`), which it does
    /// only after the use `'u` ended; the range lies inside the region by construction.
    pub(crate) unsafe fn bytes(&self) -> &'u [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: see the function's contract; the range is inside a registered region.
        unsafe { std::slice::from_raw_parts(self.start as *const u8, self.len) }
    }

    /// The bytes of the range, writable.
    ///
    /// # Safety
    /// As [`RegisteredRange::bytes`], and no other live slice overlaps this range (callers
    /// refuse overlapping destinations with [`drop_overlapping`]).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self) -> &'u mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: see the function's contract.
        unsafe { std::slice::from_raw_parts_mut(self.start as *mut u8, self.len) }
    }
}

/// Pointer calls in flight, counted by the parity of the epoch they began in, in process
/// `pid`.
#[derive(Default)]
struct InFlight {
    epoch: u64,
    active: [u64; 2],
    pid: u32,
}

impl InFlight {
    /// The counts of this process. A child forked while calls of the parent's threads were in
    /// flight counts none of them: those threads are not in the child, and its `close` or
    /// `unregister_buffer` waited for them to end, for ever.
    fn here(&mut self) -> &mut Self {
        let me = std::process::id();
        if self.pid != me {
            *self = InFlight {
                pid: me,
                ..InFlight::default()
            };
        }
        self
    }
}

/// The registered regions of one client (start address → length) and the pointer calls
/// using them.
#[derive(Default)]
pub(crate) struct Regions {
    map: Mutex<BTreeMap<usize, usize>>,
    calls: Mutex<InFlight>,
    ended: Condvar,
    /// One grace period at a time: a second would wait on the slot new calls now enter.
    grace: Mutex<()>,
}

/// One pointer call, from before its ranges are checked until it is done with them: the
/// only way to check a range, and every range it checks borrows it.
pub(crate) struct RegionUse<'r> {
    regions: &'r Regions,
    slot: usize,
}

impl Drop for RegionUse<'_> {
    fn drop(&mut self) {
        let mut c = self.regions.calls.lock();
        let c = c.here();
        c.active[self.slot] = c.active[self.slot].saturating_sub(1);
        if c.active[self.slot] == 0 {
            self.regions.ended.notify_all();
        }
    }
}

impl RegionUse<'_> {
    /// The range `[ptr, ptr + size)` if it lies inside one registered region: the only
    /// constructor of [`RegisteredRange`].
    pub(crate) fn check(&self, ptr: u64, size: i64) -> Option<RegisteredRange<'_>> {
        let p = usize::try_from(ptr).ok()?;
        let n = usize::try_from(size).ok()?;
        let end = p.checked_add(n)?;
        if p == 0 {
            return None;
        }
        let r = self.regions.map.lock();
        let (&start, &len) = r.range(..=p).next_back()?;
        (end <= start + len).then_some(RegisteredRange {
            start: p,
            len: n,
            _use: PhantomData,
        })
    }

    /// [`RegionUse::check`] for each pair.
    pub(crate) fn check_all(
        &self,
        ptrs: &[u64],
        sizes: &[i64],
    ) -> Vec<Option<RegisteredRange<'_>>> {
        ptrs.iter()
            .zip(sizes)
            .map(|(p, n)| self.check(*p, *n))
            .collect()
    }
}

impl Regions {
    /// Begins a pointer call (see [`RegionUse`]).
    pub(crate) fn enter(&self) -> RegionUse<'_> {
        let mut g = self.calls.lock();
        let c = g.here();
        let slot = (c.epoch % 2) as usize;
        c.active[slot] += 1;
        RegionUse {
            regions: self,
            slot,
        }
    }

    /// Returns once every pointer call that began before it has ended. Called without the
    /// GIL: a call ends (drops its use) after taking the GIL back.
    fn wait_for_calls(&self) {
        let _one = self.grace.lock();
        let mut c = self.calls.lock();
        let slot = (c.here().epoch % 2) as usize;
        c.epoch += 1;
        while c.here().active[slot] > 0 {
            self.ended.wait(&mut c);
        }
    }

    /// Registers `[ptr, ptr + size)`; 0, or INVALID_PARAMS for a null, empty, wrapping or
    /// overlapping region (Mooncake refuses double registration too), and for one that is
    /// not mapped readable and writable in this process right now ([`is_mapped_rw`]: a
    /// wild integer must never become a [`RegisteredRange`]).
    pub(crate) fn register(&self, ptr: u64, size: i64) -> i64 {
        let (Ok(p), Ok(n)) = (usize::try_from(ptr), usize::try_from(size)) else {
            return INVALID_PARAMS;
        };
        if p == 0 || n == 0 || p.checked_add(n).is_none() || !is_mapped_rw(p, n) {
            return INVALID_PARAMS;
        }
        let mut r = self.map.lock();
        if let Some((&s, &l)) = r.range(..p + n).next_back()
            && s + l > p
        {
            return INVALID_PARAMS;
        }
        r.insert(p, n);
        0
    }

    /// Unregisters the region at `ptr` and returns once no call can still touch it (every
    /// call that began before has ended; later ones find it unregistered). Call it with
    /// the GIL released.
    pub(crate) fn unregister(&self, ptr: u64) -> i64 {
        let Ok(p) = usize::try_from(ptr) else {
            return INVALID_PARAMS;
        };
        if self.map.lock().remove(&p).is_none() {
            return INVALID_PARAMS;
        }
        self.wait_for_calls();
        0
    }

    /// Unregisters everything, returning as [`Regions::unregister`] does.
    pub(crate) fn clear(&self) {
        self.map.lock().clear();
        self.wait_for_calls();
    }
}

/// Marks as unusable (None) every range that overlaps another one: destinations written in
/// one call must not alias.
pub(crate) fn drop_overlapping(ranges: &mut [Option<RegisteredRange<'_>>]) {
    let spans: Vec<(usize, usize)> = ranges
        .iter()
        .map(|r| r.map_or((0, 0), |r| r.span()))
        .collect();
    for (r, bad) in ranges.iter_mut().zip(overlapping(&spans)) {
        if bad {
            *r = None;
        }
    }
}
