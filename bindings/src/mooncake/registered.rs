//! Memory registered with `register_buffer`, and the one type that may touch raw addresses.
//!
//! Why a type: Mooncake's pointer calls (`put_from`, `get_into`, `get_into_ranges`, ...) take
//! integer addresses. Reading or writing through an integer is only sound inside memory the
//! caller registered (and promised to keep alive until `unregister_buffer`). A
//! [`RegisteredRange`] has private fields and is built only by [`Regions::check`] (or by
//! narrowing a range that was), so a raw range that skipped the registration check cannot
//! exist anywhere in the crate: every `unsafe` slice comes from a checked range. A region
//! is registered only while it is mapped readable and writable (`mapped.rs`); keeping it
//! mapped until `unregister_buffer` is the caller's part.

use std::collections::BTreeMap;

use parking_lot::Mutex;

use super::INVALID_PARAMS;
use super::mapped::is_mapped_rw;
use crate::overlap::overlapping;

/// A byte range inside one registered region. `Send`: it is an address, not a borrow, so the
/// store call that uses it can run with the GIL released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RegisteredRange {
    start: usize,
    len: usize,
}

impl RegisteredRange {
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
    /// The registering caller keeps the region alive and unaliased by Rust references while
    /// it is registered (Mooncake's contract for `register_buffer`); the range itself lies
    /// inside it by construction.
    pub(crate) unsafe fn bytes<'a>(&self) -> &'a [u8] {
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
    /// refuse overlapping destinations with [`RegisteredRange::overlaps`]).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut<'a>(&self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: see the function's contract.
        unsafe { std::slice::from_raw_parts_mut(self.start as *mut u8, self.len) }
    }
}

/// The registered regions of one client: start address → length.
#[derive(Default)]
pub(crate) struct Regions {
    map: Mutex<BTreeMap<usize, usize>>,
}

impl Regions {
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

    pub(crate) fn unregister(&self, ptr: u64) -> i64 {
        let Ok(p) = usize::try_from(ptr) else {
            return INVALID_PARAMS;
        };
        match self.map.lock().remove(&p) {
            Some(_) => 0,
            None => INVALID_PARAMS,
        }
    }

    pub(crate) fn clear(&self) {
        self.map.lock().clear();
    }

    /// The range `[ptr, ptr + size)` if it lies inside one registered region: the only
    /// constructor of [`RegisteredRange`].
    pub(crate) fn check(&self, ptr: u64, size: i64) -> Option<RegisteredRange> {
        let p = usize::try_from(ptr).ok()?;
        let n = usize::try_from(size).ok()?;
        let end = p.checked_add(n)?;
        if p == 0 {
            return None;
        }
        let r = self.map.lock();
        let (&start, &len) = r.range(..=p).next_back()?;
        (end <= start + len).then_some(RegisteredRange { start: p, len: n })
    }

    /// [`Regions::check`] for each pair.
    pub(crate) fn check_all(&self, ptrs: &[u64], sizes: &[i64]) -> Vec<Option<RegisteredRange>> {
        ptrs.iter()
            .zip(sizes)
            .map(|(p, n)| self.check(*p, *n))
            .collect()
    }
}

/// Marks as unusable (None) every range that overlaps another one: destinations written in
/// one call must not alias.
pub(crate) fn drop_overlapping(ranges: &mut [Option<RegisteredRange>]) {
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
