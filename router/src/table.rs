//! The bytes a hash table holds, and what its next insert would add.
//!
//! Why the router counts its tables itself: the index is bounded by a byte budget
//! (`--max-index-bytes`) that must hold whatever the event streams send, so the count must
//! be what the allocator gave, not a guess per entry, and an insert that would grow a table
//! past the budget must be refused before it allocates.
//!
//! How: std's `HashMap` and `HashSet` (hashbrown) hold one allocation per table: `buckets`
//! slots of the element, padded to the control bytes' alignment, then one control byte per
//! bucket and one SIMD group more. `buckets` is a power of two, at least 4, of which at most
//! 7/8 hold items (all but one below 8 buckets). A table grows only when an insert finds no
//! free slot and more than half its full capacity holds items, and then to twice its buckets;
//! with fewer items it rehashes in place and allocates nothing. It never shrinks by itself
//! (`clear`, `remove` and `retain` keep the allocation): the index rebuilds a table that
//! fell to an eighth of its load ([`Table::shrunk`]), so the budget a burst took returns. `capacity()` is items plus free
//! slots, so it equals the full capacity right after a growth and is less while removed
//! slots wait for a rehash; the bucket count is therefore tracked, not read back.
//! `router/tests/budget.rs` checks these counts against a counting allocator.

use std::mem::{align_of, size_of};

/// Control bytes per SIMD group: SSE2's 16 on x86, 8 with NEON or 64-bit words.
const GROUP: usize = if cfg!(all(
    any(target_arch = "x86", target_arch = "x86_64"),
    target_feature = "sse2"
)) {
    16
} else if cfg!(target_pointer_width = "64") {
    8
} else {
    4
};

/// Items a table of `buckets` buckets holds before it must grow or rehash.
fn full_capacity(buckets: usize) -> usize {
    if buckets <= 8 {
        buckets.saturating_sub(1)
    } else {
        buckets / 8 * 7
    }
}

/// The bucket count whose full capacity is `capacity` (a power of two).
fn buckets_of(capacity: usize) -> usize {
    match capacity {
        0 => 0,
        1..=3 => 4,
        4..=7 => 8,
        8..=14 => 16,
        c => (c.saturating_mul(8) / 7).next_power_of_two(),
    }
}

/// Bytes of a table of `buckets` buckets of `T`.
fn alloc_bytes<T>(buckets: usize) -> usize {
    if buckets == 0 {
        return 0;
    }
    let align = align_of::<T>().max(GROUP);
    let slots = (size_of::<T>() * buckets).next_multiple_of(align);
    slots + buckets + GROUP
}

/// One table's allocation, for elements `T` (a set's key, a map's `(key, value)`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Table {
    buckets: usize,
}

impl Table {
    /// Bytes the table holds.
    pub(crate) fn bytes<T>(self) -> usize {
        alloc_bytes::<T>(self.buckets)
    }

    /// Bytes the next insert of a new key adds to the table (0: it fits as it is), from the
    /// table's `len()` and `capacity()`.
    pub(crate) fn growth<T>(self, len: usize, capacity: usize) -> usize {
        if len < capacity || (self.buckets > 0 && len < full_capacity(self.buckets) / 2) {
            return 0;
        }
        let next = if self.buckets == 0 {
            4
        } else {
            self.buckets * 2
        };
        alloc_bytes::<T>(next) - alloc_bytes::<T>(self.buckets)
    }

    /// Records an insert; `capacity`: the table's `capacity()` after it.
    pub(crate) fn inserted(&mut self, capacity: usize) {
        self.buckets = self.buckets.max(buckets_of(capacity));
    }

    /// Whether a table holding `len` items is worth rebuilding smaller: empty with an
    /// allocation, or past 64 buckets and under an eighth of its full capacity.
    pub(crate) fn oversized(self, len: usize) -> bool {
        (len == 0 && self.buckets > 0)
            || (self.buckets > 64 && len < full_capacity(self.buckets) / 8)
    }

    /// The table a rebuild allocated: `capacity`, its `capacity()` (0: none).
    pub(crate) fn shrunk(capacity: usize) -> Table {
        Table {
            buckets: buckets_of(capacity),
        }
    }
}
