//! Every way the cache can be misused, as one typed error.
//!
//! Why: the scheduler above us is driven by events from an engine we do not control, so a
//! stale handle or a duplicated free must come back as a value the caller can report, never as
//! a panic. Every fallible method checks before it mutates: on `Err`, the cache is unchanged.

use thiserror::Error;

use crate::hash::PageHash;
use crate::pool::PageState;
use crate::tier::TierKind;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RadixError {
    #[error("unknown or removed node")]
    UnknownNode,
    #[error("unknown lock handle (already released, or from another cache)")]
    UnknownLock,
    #[error("handle belongs to another cache instance")]
    ForeignHandle,
    #[error("{tier} lock handle used on the wrong tier")]
    WrongTier { tier: TierKind },
    #[error("node holds no {tier} copy")]
    NotResident { tier: TierKind },
    #[error("{tier} pool exhausted: requested {requested} pages, {available} obtainable")]
    PoolExhausted {
        tier: TierKind,
        requested: usize,
        available: usize,
    },
    #[error(
        "tenant {tenant} holds {charged} {tier} pages of its quota of {cap}, none of them evictable; {requested} more do not fit"
    )]
    TenantQuota {
        tier: TierKind,
        tenant: u64,
        charged: usize,
        cap: usize,
        requested: usize,
    },
    #[error("{tier} page {page} is out of range (capacity {capacity})")]
    InvalidPage {
        tier: TierKind,
        page: u32,
        capacity: u32,
    },
    #[error("{tier} page {page} is {state:?}, not owned by the caller here (double free?)")]
    NotOwned {
        tier: TierKind,
        page: u32,
        state: PageState,
    },
    #[error("{tier} page {page} appears twice in one call")]
    DuplicatePage { tier: TierKind, page: u32 },
    #[error("insert offset {got} does not match the start node's end depth {expected}")]
    OffsetMismatch { expected: usize, got: usize },
    #[error("length mismatch: {what}: expected {expected}, got {got}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("node is not an unlocked leaf on {tier}")]
    NotEvictable { tier: TierKind },
    #[error("page {hash:?} is not protected (unprotect without a matching protect)")]
    NotProtected { hash: PageHash },
    #[error("page_size must be positive")]
    ZeroPageSize,
    #[error("page {page} of the inserted run does not continue the path (hash mismatch)")]
    NotAContinuation { page: usize },
}

/// A lock transition the cache refused, with the handle handed back unchanged: still valid
/// wherever it was valid before the call, so the caller keeps it or gives it back and nothing
/// is pinned forever by a handle lost in an error path.
pub struct Refused<H> {
    /// Why the cache refused.
    pub error: RadixError,
    /// The handle the call took, untouched.
    pub handle: H,
}

impl<H: std::fmt::Debug> std::fmt::Debug for Refused<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Refused")
            .field("error", &self.error)
            .field("handle", &self.handle)
            .finish()
    }
}

impl<H> std::fmt::Display for Refused<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "refused: {}", self.error)
    }
}

impl<H: std::fmt::Debug> std::error::Error for Refused<H> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}
