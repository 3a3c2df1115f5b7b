//! Queue-aware protection: prefixes that waiting requests will match are evicted last.
//!
//! Why: under overload a request waits seconds to minutes for admission, and until it is
//! admitted nothing locks the prefix it will match, so the cache's policy (LRU, freq-depth)
//! can evict those pages for the running requests' new ones just before the waiting request
//! would have reused them (CachedAttention, ATC'24, keeps a queued request's KV for this
//! reason). A protection is soft: protected leaves stay evictable, ranked after every
//! unprotected leaf of their tier, so protection never makes an allocation fail that would
//! have succeeded, and never pins more than the cache holds.
//!
//! How: the cache counts, per page hash, the waiting prompts that contain it
//! ([`RadixCache::protect`], [`RadixCache::unprotect`]). Page hashes are chained, so a node
//! whose first page hash is counted shares at least that page with a waiting prompt at the
//! same depth: the node is protected. Its ancestors are then protected too (their first pages
//! are earlier pages of the same chain). A node is re-ranked when its first hash's count
//! becomes or stops being zero; nodes made later (inserts, splits) are ranked with the count
//! current then. Every tensor-parallel rank that protects and unprotects the same prompts in
//! the same order ranks identically.

use crate::cache::RadixCache;
use crate::error::RadixError;
use crate::hash::PageHash;
use crate::tier::TierKind;

/// Whether a node is protected for a waiting request. Orders before the policy rank in a
/// tier's evictable set: unprotected leaves go first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protection {
    #[default]
    Unprotected,
    /// Some waiting prompt contains the node's first page at the node's depth.
    Waiting,
}

impl RadixCache {
    /// Protects the pages of a waiting prompt (its page hashes from the root): nodes whose
    /// first page is one of them are evicted only after every unprotected leaf. Counted: a
    /// prompt protected twice must be unprotected twice.
    pub fn protect(&mut self, hashes: &[PageHash]) {
        for &h in hashes {
            let c = self.protected.entry(h).or_insert(0);
            *c += 1;
            if *c == 1 {
                self.protection_changed(h);
            }
        }
    }

    /// Takes back one [`Self::protect`] of `hashes`. Errors (nothing changed): some hash is
    /// not protected as many times as `hashes` names it.
    pub fn unprotect(&mut self, hashes: &[PageHash]) -> Result<(), RadixError> {
        let mut need: std::collections::HashMap<PageHash, u32> = std::collections::HashMap::new();
        for &h in hashes {
            *need.entry(h).or_insert(0) += 1;
        }
        // In the list's order, so the error names the first hash short of protections.
        for h in hashes {
            if self.protected.get(h).copied().unwrap_or(0) < need[h] {
                return Err(RadixError::NotProtected { hash: *h });
            }
        }
        for &h in hashes {
            if let Some(c) = self.protected.get_mut(&h) {
                *c -= 1;
                if *c == 0 {
                    self.protected.remove(&h);
                    self.protection_changed(h);
                }
            }
        }
        Ok(())
    }

    /// Distinct page hashes protected now.
    pub fn protected_hashes(&self) -> usize {
        self.protected.len()
    }

    /// The protection of a node whose first page hash is `first`.
    pub(crate) fn protection_of(&self, first: Option<&PageHash>) -> Protection {
        match first {
            Some(h) if self.protected.contains_key(h) => Protection::Waiting,
            _ => Protection::Unprotected,
        }
    }

    fn protection_changed(&mut self, h: PageHash) {
        if let Some(&id) = self.index.get(&h) {
            self.refresh_evictable(id, TierKind::Device);
            self.refresh_evictable(id, TierKind::Host);
        }
    }
}
