//! The scheduler's record of one request: its tokens, page table, locks and FSM state.
//!
//! Invariants (kept by the scheduler, checked in tests through `Scheduler::check`):
//! - the device page table ([`DeviceTable`]) keeps its own (written on the type);
//! - `hashes[i]` is the chained (scoped) hash of page `i` of `tokens`, for every full page
//!   computed so far.

use smallvec::SmallVec;

use kvtier_fsm::RequestState;
use std::sync::Arc;

use kvtier_radix::{
    Device, DevicePageId, HashScope, InsertOwner, LockHandle, PageHash, ScopeLabel, TenantId,
    extend_hashes,
};

use crate::ops::AnyLock;
use crate::types::{OpId, PageTableDelta, RequestId};

/// A request's progress in consulting L3 before its first admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum L3Progress {
    /// Not probed yet. `reprobes`: probes already thrown away because the local match shrank
    /// below their start before the prefetch could be planned.
    Unprobed { reprobes: u8 },
    /// The probe found keys of pages `start .. start + hit` in L3 (and nothing else was asked).
    Probed {
        start: usize,
        hit: usize,
        reprobes: u8,
    },
    /// L3 was consulted (prefetched, or not worth it) or is disabled: do not ask again.
    Done,
}

/// How many times a request probes again after its local match shrank below its probe.
pub(crate) const MAX_REPROBES: u8 = 1;

/// A request's device page table: page `i` holds the KV of tokens `i*ps .. (i+1)*ps`.
///
/// Invariant (checked by `Scheduler::check`): `pages[..tree_pages]` are pages owned by the
/// radix tree, pinned by `lock`, whose node ends exactly at depth `tree_pages` (no lock iff
/// `tree_pages == 0`); `pages[tree_pages..]` are pages *held* by the request (allocated, not yet
/// published into the tree). The engine holds a copy: `sent` entries were sent, and entries
/// from `dirty_from` on were changed in place since (a publish swapped in the tree's copy), so
/// the next row carries the delta from `min(sent, dirty_from)`.
#[derive(Default)]
pub(crate) struct DeviceTable {
    pub pages: Vec<DevicePageId>,
    pub tree_pages: usize,
    pub lock: Option<LockHandle<Device>>,
    pub sent: usize,
    /// Smallest index changed in place since the last send (usize::MAX: none).
    pub dirty_from: usize,
}

impl DeviceTable {
    pub(crate) fn new() -> DeviceTable {
        DeviceTable {
            dirty_from: usize::MAX,
            ..DeviceTable::default()
        }
    }

    /// The page-table change to send with the next row of this request, if any.
    pub(crate) fn take_delta(&mut self) -> Option<PageTableDelta> {
        let from = self.sent.min(self.dirty_from);
        self.dirty_from = usize::MAX;
        if from >= self.pages.len() && self.sent == self.pages.len() {
            return None;
        }
        self.sent = self.pages.len();
        Some(PageTableDelta {
            from: from as u32,
            pages: self.pages[from..].to_vec(),
        })
    }
}

pub(crate) struct Request {
    pub id: RequestId,
    /// Arrival order; queues are ordered by it (retracted requests keep theirs, so they resume first).
    pub seq: u64,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_new: u32,
    pub hashes: Vec<PageHash>,
    /// Salt, adapter and extra keys when the request is scoped (`None`: the plain chain).
    pub scope: Option<Box<(HashScope, Arc<ScopeLabel>)>>,
    /// The tenant its cache salt names ([`TenantId::SHARED`] without a salt): owns the tree
    /// nodes the request creates and is charged for its allocations (per-tenant quotas).
    pub tenant: TenantId,
    pub state: RequestState,
    /// The device page table the engine's attention kernels read.
    pub table: DeviceTable,
    /// Where the request is in consulting L3.
    pub l3: L3Progress,
    /// Prompt pages `start .. start + n` arrived from L3 by the last prefetch (hits on them
    /// are L3 hits, not host hits).
    pub prefetched: Option<(usize, usize)>,
    /// Pins the pages the last prefetch brought in (host, or device without a host tier) from
    /// `PrefetchDone` until the request is admitted: unpinned, host pressure in between could
    /// evict them (and under write-back drop them without a backup) before their only reader
    /// gets to them.
    pub prefetch_pin: Option<AnyLock>,
    /// The request was retracted once: later admissions reuse its own pages, which are not
    /// counted as prefix hits.
    pub resumed: bool,
    /// Ops in flight that serve this request.
    pub ops: SmallVec<[OpId; 2]>,
    /// A load-back this request's current chunk reads failed: recompute instead.
    pub recompute: bool,
    /// Time (ms, the engine's clock) the request arrived.
    pub arrival_ms: u64,
    pub first_token_ms: Option<u64>,
}

impl Request {
    pub(crate) fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens whose KV is on device once no forward is in flight: all but the last token,
    /// which is the input of the next decode step.
    pub(crate) fn kv_len(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }

    /// Who the tree nodes this request creates belong to: its tenant and scope label.
    pub(crate) fn owner(&self) -> InsertOwner<'_> {
        InsertOwner {
            tenant: self.tenant,
            label: self.scope.as_ref().map(|s| &s.1),
        }
    }

    /// Makes sure `hashes` covers the first `pages` full pages.
    pub(crate) fn ensure_hashes(&mut self, pages: usize, page_size: usize) {
        if self.hashes.len() < pages {
            let from = self.hashes.len();
            // Exactly what is missing (this runs once per publish, not per page): doubling a
            // whole prompt's hashes for the few pages a decode added costs a fresh block.
            self.hashes.reserve_exact(pages - from);
            match &self.scope {
                None => extend_hashes(&mut self.hashes, &self.tokens, page_size, from, pages),
                Some(s) => {
                    s.0.extend_hashes(&mut self.hashes, &self.tokens, page_size, from, pages)
                }
            }
        }
    }
}
