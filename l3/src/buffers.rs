//! Object buffers for memory replicas: recycled when possible, huge-page backed when fresh.
//!
//! Why: a put copies the caller's bytes into a new `Arc<[u8]>`. Measured on the put path
//! (`l3-bench --only put`, 64 × 8 MiB), a put into never-touched memory cost 7.5 × a memcpy
//! of the same bytes: the copy page-faults every 4 KiB page (the kernel zeroes each one and,
//! in a VM, the host backs it), while Mooncake copies into a segment it mapped at setup.
//! Two remedies, neither weakening an invariant:
//!
//! - **Recycling.** A freed replica's buffer that nobody else holds (`Arc` strong count 1, no
//!   weak) is kept by [`Recycler`] and handed to the next put of the same size, which
//!   overwrites it entirely — already faulted memory, no allocator round trip, no `munmap`
//!   under the master lock. The recycler holds at most the segments' free capacity, so
//!   allocated plus recycled bytes never exceed what the store was configured to hold.
//!   Buffers under [`KEEP_MIN`] (a page) are not kept: the allocator serves those from memory
//!   already faulted, so keeping them saves nothing, and each would cost its header and list
//!   slot besides its bytes (a 4 MiB store of one-byte objects held 2.4 MB of them, counted
//!   as a few hundred kilobytes).
//! - **Huge pages for fresh buffers.** Large fresh buffers are advised `MADV_HUGEPAGE` before
//!   the copy touches them, so they fault in 2 MiB steps instead of 4 KiB ones (where the
//!   kernel's transparent huge pages are in `madvise` or `always` mode).
//!
//! Safety: buffers are only ever written while uniquely owned (`Arc::get_mut`), and always
//! overwritten whole, so no reader can observe a recycled buffer's old bytes.
//!
//! **Giving memory back when idle.** Recycling keeps up to the free capacity, so after a
//! load the recycler may hold nearly a whole segment, and glibc's malloc keeps freed pages
//! of its arenas (buffers below its dynamic mmap threshold, up to 32 MiB, live there, and
//! so do decoded frames and per-connection state): measured on a `kvtier-l3` server with a
//! 1 GiB segment after 200 clients, about 1 GiB resident with an empty store. So once the
//! store has seen no operation for `StoreConfig::idle_trim_after` ([`IdleTrim`], driven by
//! the sweeper), the recycler is cut to `StoreConfig::recycle_idle_bytes` and
//! [`release_free_memory`] asks the allocator to return its free pages (`malloc_trim`), once
//! per idle period.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Buffers at least this large are advised to use huge pages.
const HUGE_MIN: usize = 4 << 20;
const HUGE_PAGE: usize = 2 << 20;

/// Smallest buffer a [`Recycler`] keeps (see the module docs).
pub const KEEP_MIN: usize = 4096;

/// Freed buffers by size, bounded by the caller-given free capacity.
#[derive(Debug, Default)]
pub struct Recycler {
    by_size: HashMap<usize, Vec<Arc<[u8]>>>,
    bytes: u64,
}

impl Recycler {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Keeps `buf` if it is at least [`KEEP_MIN`] bytes, nobody else holds it and `free`
    /// (capacity not allocated) leaves room. Returns the buffer when it is not kept, so the
    /// caller decides where it is dropped.
    pub fn keep(&mut self, mut buf: Arc<[u8]>, free: u64) -> Option<Arc<[u8]>> {
        let len = buf.len() as u64;
        if buf.len() < KEEP_MIN || Arc::get_mut(&mut buf).is_none() || self.bytes + len > free {
            return Some(buf);
        }
        self.bytes += len;
        self.by_size.entry(buf.len()).or_default().push(buf);
        None
    }

    /// A kept buffer of exactly `size` bytes.
    pub fn take(&mut self, size: usize) -> Option<Arc<[u8]>> {
        let v = self.by_size.get_mut(&size)?;
        let b = v.pop()?;
        if v.is_empty() {
            self.by_size.remove(&size);
        }
        self.bytes -= b.len() as u64;
        Some(b)
    }

    /// Drops kept buffers until at most `limit` bytes are held (an allocation took free
    /// capacity). Returns them for the caller to drop outside its lock.
    pub fn trim(&mut self, limit: u64) -> Vec<Arc<[u8]>> {
        let mut out = Vec::new();
        while self.bytes > limit {
            let Some(&size) = self.by_size.keys().next() else {
                break;
            };
            match self.take(size) {
                Some(b) => out.push(b),
                None => break,
            }
        }
        out
    }
}

/// When an idle store gives memory back: after `after` without activity (a counter that
/// moves with every operation), once per idle period.
#[derive(Debug)]
pub struct IdleTrim {
    after: Duration,
    seen: Option<u64>,
    since: Instant,
    done: bool,
}

impl IdleTrim {
    /// Idle after `after` without activity.
    pub fn new(after: Duration) -> Self {
        IdleTrim {
            after,
            seen: None,
            since: Instant::now(),
            done: false,
        }
    }

    /// Whether to give memory back now, given the activity counter's current value: true
    /// once when it has not moved for `after`, then not again until it moved.
    pub fn due(&mut self, activity: u64, now: Instant) -> bool {
        if self.seen != Some(activity) {
            self.seen = Some(activity);
            self.since = now;
            self.done = false;
            return false;
        }
        if self.done || now.saturating_duration_since(self.since) < self.after {
            return false;
        }
        self.done = true;
        true
    }
}

/// Asks the allocator to return free heap pages to the system (glibc's `malloc_trim`,
/// which releases free pages inside every arena, not only at the heap's top). Elsewhere a
/// no-op: other allocators decide themselves.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases memory the allocator holds free; no pointer the
    // program holds is affected.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The caller's bytes in a buffer for a memory replica: `recycled` (overwritten whole) when
/// given, of the right size and not shared, else a fresh one (huge-page backed when large).
pub fn fill(recycled: Option<Arc<[u8]>>, src: &[u8]) -> Arc<[u8]> {
    if let Some(mut b) = recycled
        && b.len() == src.len()
        && let Some(dst) = Arc::get_mut(&mut b)
    {
        dst.copy_from_slice(src);
        return b;
    }
    fresh(src)
}

/// A buffer of `len` bytes for a memory replica, written by `write` in place (no
/// intermediate copy): `recycled` when it has that size and is not shared, else a fresh one
/// (huge-page backed when large). A `write` that fails drops the buffer.
///
/// Why: the shared-memory path's in-place mode copies a client's bytes with one
/// `process_vm_readv` straight into the buffer that becomes the replica (see
/// `rpc::shm::inplace`); [`fill`] would need them in this process first.
///
/// # Safety
/// `write` must initialise every byte of the slice it is given when it returns `Ok` (the
/// buffer is then read as `[u8]`).
pub unsafe fn fill_with<E>(
    recycled: Option<Arc<[u8]>>,
    len: usize,
    write: impl FnOnce(&mut [MaybeUninit<u8>]) -> Result<(), E>,
) -> Result<Arc<[u8]>, E> {
    if let Some(mut b) = recycled
        && b.len() == len
        && let Some(dst) = Arc::get_mut(&mut b)
    {
        // SAFETY: `[u8]` and `[MaybeUninit<u8>]` have the same layout; the caller's `write`
        // leaves every byte initialised when it succeeds, and a failed buffer is dropped.
        let dst = unsafe { &mut *(dst as *mut [u8] as *mut [MaybeUninit<u8>]) };
        write(dst)?;
        return Ok(b);
    }
    let mut a: Arc<[MaybeUninit<u8>]> = Arc::new_uninit_slice(len);
    let Some(dst) = Arc::get_mut(&mut a) else {
        unreachable!("a fresh Arc is unique");
    };
    if len >= HUGE_MIN {
        advise_huge(dst);
    }
    write(dst)?;
    // SAFETY: `write` succeeded, so (by this function's contract) every byte is initialised.
    Ok(unsafe { a.assume_init() })
}

/// A fresh buffer holding a copy of `src`.
pub fn fresh(src: &[u8]) -> Arc<[u8]> {
    if src.len() < HUGE_MIN {
        return Arc::from(src);
    }
    let mut a: Arc<[MaybeUninit<u8>]> = Arc::new_uninit_slice(src.len());
    let Some(dst) = Arc::get_mut(&mut a) else {
        return Arc::from(src);
    };
    advise_huge(dst);
    // SAFETY: `dst` is `src.len()` bytes of uniquely owned, writable memory that does not
    // overlap `src` (it was just allocated); after the copy every byte is initialised.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), src.len());
        a.assume_init()
    }
}

/// `MADV_HUGEPAGE` on the 2 MiB-aligned interior of `buf` (advice only: errors ignored).
fn advise_huge(buf: &mut [MaybeUninit<u8>]) {
    let start = buf.as_mut_ptr() as usize;
    let end = start + buf.len();
    let a = start.next_multiple_of(HUGE_PAGE);
    let b = end / HUGE_PAGE * HUGE_PAGE;
    if b > a {
        // SAFETY: [a, b) lies inside `buf`, which this thread owns; madvise only changes how
        // the kernel backs the pages (no memory is unmapped or its contents changed).
        unsafe {
            libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_buffers_are_not_kept_and_kept_ones_are_bounded() {
        const N: usize = KEEP_MIN;
        let mut r = Recycler::default();
        let a: Arc<[u8]> = Arc::from(vec![1u8; N]);
        let reader = a.clone();
        assert!(
            r.keep(a, 10 * N as u64).is_some(),
            "a buffer a reader holds is never reused"
        );
        drop(reader);
        assert!(r.keep(Arc::from(vec![2u8; N]), 3 * N as u64 / 2).is_none());
        assert!(
            r.keep(Arc::from(vec![3u8; N]), 3 * N as u64 / 2).is_some(),
            "bound"
        );
        assert_eq!(r.bytes(), N as u64);
        assert!(r.take(N - 1).is_none());
        let b = r.take(N).unwrap();
        assert_eq!(r.bytes(), 0);
        let src = vec![9u8; N];
        let f = fill(Some(b), &src);
        assert_eq!(&f[..], &src[..]);
    }

    #[test]
    fn fresh_large_buffers_copy_every_byte() {
        let src: Vec<u8> = (0..(9 << 20) + 13).map(|i| (i * 7 % 251) as u8).collect();
        assert_eq!(&fresh(&src)[..], &src[..]);
        assert_eq!(&fill(None, &src[..5])[..], &src[..5]);
    }

    #[test]
    fn idle_trim_fires_once_per_idle_period() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut it = IdleTrim::new(Duration::from_millis(100));
        assert!(!it.due(5, ms(0)), "first sight starts the period");
        assert!(!it.due(5, ms(99)));
        assert!(it.due(5, ms(100)));
        assert!(!it.due(5, ms(500)), "once per idle period");
        assert!(!it.due(6, ms(600)), "activity restarts it");
        assert!(!it.due(6, ms(650)));
        assert!(it.due(6, ms(700)));
        release_free_memory();
    }

    #[test]
    fn buffers_under_a_page_are_not_kept() {
        let mut r = Recycler::default();
        for n in [1usize, 17, 100, KEEP_MIN - 1] {
            assert!(r.keep(Arc::from(vec![0u8; n]), 1 << 30).is_some(), "{n}");
        }
        assert_eq!(r.bytes(), 0);
        assert!(r.keep(Arc::from(vec![0u8; KEEP_MIN]), 1 << 30).is_none());
    }

    #[test]
    fn trim_releases_down_to_the_limit() {
        const N: u64 = KEEP_MIN as u64;
        let mut r = Recycler::default();
        for n in [N, 2 * N, 3 * N] {
            assert!(r.keep(Arc::from(vec![0u8; n as usize]), 100 * N).is_none());
        }
        let out = r.trim(5 * N / 2);
        assert!(r.bytes() <= 5 * N / 2);
        assert_eq!(
            out.iter().map(|b| b.len() as u64).sum::<u64>() + r.bytes(),
            6 * N
        );
    }
}
