//! A fixed-capacity page pool for one tier.
//!
//! Why: the engine pre-allocates its KV buffers; kvtier hands out indices into them. The pool
//! knows, for every index, who owns it — nobody (free), a caller such as a running request
//! (held), or the radix tree (cached) — so a double free, a free of a page the tree owns, or an
//! insert of a page that is already cached is caught instead of putting one page in two places.
//!
//! Invariant: `free.len() + held + cached == capacity`; `state[i] == Free` exactly for the
//! indices in `free`. The pool is untyped inside the crate (the cache handles both tiers with
//! one code path); [`crate::RadixCache`] wraps it with typed [`crate::PageId`]s.

use crate::error::RadixError;
use crate::tier::TierKind;

/// Who owns a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageState {
    Free,
    /// Handed out by `alloc`, owned by the caller until freed or inserted into the tree.
    Held,
    /// Owned by a node of the radix tree; returns to `Free` only by eviction.
    Cached,
}

#[derive(Debug, Clone)]
pub(crate) struct PagePool {
    kind: TierKind,
    /// Free indices; allocation pops from the back. Initialised in descending order so the
    /// first allocations return 0, 1, 2, … (deterministic across tensor-parallel ranks).
    free: Vec<u32>,
    state: Vec<PageState>,
    held: usize,
    cached: usize,
}

impl PagePool {
    pub(crate) fn new(kind: TierKind, capacity: u32) -> Self {
        PagePool {
            kind,
            free: (0..capacity).rev().collect(),
            state: vec![PageState::Free; capacity as usize],
            held: 0,
            cached: 0,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.state.len()
    }
    pub(crate) fn free_count(&self) -> usize {
        self.free.len()
    }
    pub(crate) fn held_count(&self) -> usize {
        self.held
    }
    pub(crate) fn cached_count(&self) -> usize {
        self.cached
    }
    pub(crate) fn state(&self, page: u32) -> Option<PageState> {
        self.state.get(page as usize).copied()
    }

    /// Takes `n` pages for a caller, or none at all if fewer than `n` are free.
    pub(crate) fn alloc(&mut self, n: usize) -> Result<Vec<u32>, RadixError> {
        if n > self.free.len() {
            return Err(RadixError::PoolExhausted {
                tier: self.kind,
                requested: n,
                available: self.free.len(),
            });
        }
        let start = self.free.len() - n;
        // The last `n` free entries, last first (what popping them one by one would give).
        let out: Vec<u32> = self.free[start..].iter().rev().copied().collect();
        self.free.truncate(start);
        for &p in &out {
            self.state[p as usize] = PageState::Held;
        }
        self.held += n;
        Ok(out)
    }

    /// Checks that every page is in range, in state `want`, and listed once.
    pub(crate) fn check(&self, pages: &[u32], want: PageState) -> Result<(), RadixError> {
        let cap = self.capacity() as u32;
        for &p in pages {
            match self.state(p) {
                None => {
                    return Err(RadixError::InvalidPage {
                        tier: self.kind,
                        page: p,
                        capacity: cap,
                    });
                }
                Some(s) if s != want => {
                    return Err(RadixError::NotOwned {
                        tier: self.kind,
                        page: p,
                        state: s,
                    });
                }
                Some(_) => {}
            }
        }
        if pages.len() > 1 {
            let mut sorted = pages.to_vec();
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return Err(RadixError::DuplicatePage {
                    tier: self.kind,
                    page: w[0],
                });
            }
        }
        Ok(())
    }

    /// Returns held pages to the pool; all-or-nothing.
    pub(crate) fn free_held(&mut self, pages: &[u32]) -> Result<(), RadixError> {
        self.check(pages, PageState::Held)?;
        for &p in pages {
            self.state[p as usize] = PageState::Free;
            self.free.push(p);
        }
        self.held -= pages.len();
        Ok(())
    }

    /// Held → Cached (the tree takes ownership). Caller has run `check(.., Held)`.
    pub(crate) fn mark_cached(&mut self, pages: &[u32]) {
        for &p in pages {
            debug_assert_eq!(self.state[p as usize], PageState::Held);
            self.state[p as usize] = PageState::Cached;
        }
        self.held -= pages.len();
        self.cached += pages.len();
    }

    /// Cached → Free (eviction).
    pub(crate) fn release_cached(&mut self, pages: &[u32]) {
        for &p in pages {
            debug_assert_eq!(self.state[p as usize], PageState::Cached);
            self.state[p as usize] = PageState::Free;
            self.free.push(p);
        }
        self.cached -= pages.len();
    }

    /// Full consistency check (tests and `RadixCache::check_invariants`).
    pub(crate) fn audit(&self) -> Result<(), String> {
        let mut free = 0;
        let mut held = 0;
        let mut cached = 0;
        for s in &self.state {
            match s {
                PageState::Free => free += 1,
                PageState::Held => held += 1,
                PageState::Cached => cached += 1,
            }
        }
        if free != self.free.len() || held != self.held || cached != self.cached {
            return Err(format!(
                "{} pool counts drifted: free {free}/{} held {held}/{} cached {cached}/{}",
                self.kind,
                self.free.len(),
                self.held,
                self.cached
            ));
        }
        if self
            .free
            .iter()
            .any(|&p| self.state[p as usize] != PageState::Free)
        {
            return Err(format!("{} free list holds a non-free page", self.kind));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_roundtrip_and_errors() {
        let mut p = PagePool::new(TierKind::Device, 4);
        let a = p.alloc(3).unwrap();
        assert_eq!(a, [0, 1, 2]);
        assert!(matches!(
            p.alloc(2),
            Err(RadixError::PoolExhausted { available: 1, .. })
        ));
        assert_eq!(p.free_count(), 1, "failed alloc takes nothing");
        p.free_held(&a[..1]).unwrap();
        assert!(matches!(
            p.free_held(&a[..2]),
            Err(RadixError::NotOwned { page: 0, .. })
        ));
        assert_eq!(p.free_count(), 2, "failed free frees nothing");
        assert!(matches!(
            p.free_held(&[a[1], a[1]]),
            Err(RadixError::DuplicatePage { .. })
        ));
        assert!(matches!(
            p.free_held(&[9]),
            Err(RadixError::InvalidPage { .. })
        ));
        p.mark_cached(&a[1..2]);
        assert!(matches!(
            p.free_held(&a[1..2]),
            Err(RadixError::NotOwned {
                state: PageState::Cached,
                ..
            })
        ));
        p.free_held(&a[2..]).unwrap();
        p.release_cached(&a[1..2]);
        assert_eq!(p.free_count(), 4);
        p.audit().unwrap();
    }
}
