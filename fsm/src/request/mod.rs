//! The per-request state machine.
//!
//! Why: a request in a tiered KV cache is rarely "just running". It may be probing L3, waiting for
//! pages to come up from L3, halfway through a chunked prefill, decoding, being preempted (its
//! pages written back to host so device memory can be reclaimed), draining its pages to host after
//! it finished, or waiting for host→L3 backups tied to it. Each of those phases owns different
//! resources, and each has at most one operation in flight whose completion *will* arrive. The
//! bugs this machine exists to catch are the classic scheduler ones: an abort that drops a request
//! while its copy is still in flight (so the completion lands on freed pages), a chunk scheduled
//! twice, a completion delivered twice, a finished request that is retracted.
//!
//! How: [`RequestState`] is an enum whose variants carry exactly the data of their phase;
//! [`RequestEvent`] lists everything the scheduler or the engine can say about a request.
//! [`RequestState::apply`] is a pure function from `(state, event)` to the next state, or to an
//! [`IllegalTransition`](crate::IllegalTransition) that hands back the untouched state.
//!
//! `strum` derives the field-less mirrors [`RequestStateKind`] and [`RequestEventKind`]; the
//! transition table in [`crate::table`] is written in terms of those, and tests check that this
//! code and the table agree.
//!
//! This file holds the types, their kinds and the questions asked of a state (terminal, in
//! flight, abort pending); the rest:
//! - `apply`: the transition function, the three rules that shape it and the invariants it
//!   keeps ([`RequestState::check_invariants`]),
//! - `samples`: representative states and events of every kind, for tests and the reachability
//!   check.

mod apply;
mod samples;

use serde::{Deserialize, Serialize};
use strum::{Display, EnumDiscriminants, EnumIter, IntoStaticStr};

/// Why a request ended in [`RequestState::Failed`].
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    EnumIter,
    Display,
    IntoStaticStr,
    Serialize,
    Deserialize,
)]
pub enum FailReason {
    /// A cache operation the request depended on failed and the request cannot go on without it.
    OpFailed,
    /// Device or host memory could not be found for the request even after eviction.
    OutOfMemory,
    /// A bug or an engine error outside the cache.
    Internal,
}

/// Where a request is in its life. Each variant carries the data of that phase.
///
/// Token counts are `u32` tokens, page counts are `u32` pages. "In flight" means an operation or
/// a forward pass was scheduled and its completion event has not arrived yet; see
/// [`RequestState::has_in_flight`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize, EnumDiscriminants)]
#[strum_discriminants(name(RequestStateKind))]
#[strum_discriminants(
    doc = "The field-less kind of a [`RequestState`], for tables, maps and logs."
)]
#[strum_discriminants(derive(
    EnumIter,
    Display,
    IntoStaticStr,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize
))]
pub enum RequestState {
    /// Waiting to be scheduled (new, after an L3 probe, or resumed after retraction).
    #[default]
    Submitted,
    /// An L3 existence probe (`L3Query`, no allocation) is in flight.
    Querying {
        /// An abort arrived while the probe was in flight.
        abort_pending: bool,
    },
    /// A `Prefetch` op (L3→host) for `pages` pages is in flight, for the run of prompt pages
    /// that starts at page index `start_page`.
    Prefetching {
        /// Index (in pages, from the start of the prompt) of the first prefetched page: the
        /// device/host match length the L3 keys were computed against. Prefetched pages must be
        /// inserted at this offset, whatever the host match has become meanwhile.
        start_page: u32,
        /// Pages requested from L3 (> 0; `start_page + pages` fits in `u32`).
        pages: u32,
        /// An abort arrived while the prefetch was in flight.
        abort_pending: bool,
    },
    /// The prefetch came back; `completed` pages (possibly fewer than requested, possibly zero)
    /// are now on host, as prompt pages `start_page .. start_page + completed`.
    PrefetchDone {
        /// Index of the first prefetched page, carried over from `Prefetching`.
        start_page: u32,
        /// Pages that actually arrived on host.
        completed: u32,
    },
    /// Chunked prefill. A chunk is in flight iff `scheduled > done`.
    Prefilling {
        /// Prompt tokens to prefill in total (cached prefix included).
        total: u32,
        /// Tokens whose KV is ready, including the cached prefix.
        done: u32,
        /// Tokens covered by chunks scheduled so far (`done <= scheduled <= total`).
        scheduled: u32,
        /// Chunks scheduled so far (>= 1).
        chunks: u32,
        /// An abort arrived while a chunk was in flight.
        abort_pending: bool,
    },
    /// Generating tokens, one decode step at a time.
    Decoding {
        /// Tokens generated since the last prefill completed (the last prefill chunk yields the
        /// first one, so this starts at 1; a resumed request starts again at 1).
        generated: u32,
        /// A decode step is in flight.
        in_flight: bool,
        /// An abort arrived while a decode step was in flight.
        abort_pending: bool,
    },
    /// Finished generating; `pages` device pages are to be written back to host.
    Draining {
        /// Pages to write back device→host (0: nothing to write back).
        pages: u32,
    },
    /// A `WriteBack` op (device→host) for the finished request is in flight.
    WritingBack {
        /// Pages being written back (> 0).
        pages: u32,
        /// An abort arrived while the write-back was in flight.
        abort_pending: bool,
    },
    /// Host→L3 backups tied to this request are still in flight; their host pages stay locked.
    BackingUp {
        /// Backup ops still to complete (> 0).
        outstanding: u32,
        /// An abort arrived while backups were in flight.
        abort_pending: bool,
    },
    /// Preempted under device pressure; the victim pages are being written back to host.
    Retracting {
        /// Pages being written back (> 0).
        pages: u32,
        /// An abort arrived while the write-back was in flight.
        abort_pending: bool,
    },
    /// Preempted and waiting to resume.
    Retracted {
        /// The pages were written back to host, so resuming can load them back; `false` means
        /// the prefix must be recomputed (or found elsewhere in the cache).
        saved: bool,
    },
    /// Terminal: done, pages released.
    Finished,
    /// Terminal: aborted by the client or the scheduler.
    Aborted,
    /// Terminal: failed.
    Failed {
        /// Why.
        reason: FailReason,
    },
}

/// Everything the scheduler or the engine can tell a request's machine.
///
/// `Schedule*`, `Finish`, `CommitDraining`, `Retract`, `ResumeFromRetracted`, `Abort` and `Fail`
/// are the scheduler's decisions; `QueryDone`, `PrefetchDone`, `PrefillDone`, `DecodeStep`,
/// `WriteBackDone` and `BackupDone` are completions of work that was in flight.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, EnumDiscriminants)]
#[strum_discriminants(name(RequestEventKind))]
#[strum_discriminants(
    doc = "The field-less kind of a [`RequestEvent`], for tables, maps and logs."
)]
#[strum_discriminants(derive(
    EnumIter,
    Display,
    IntoStaticStr,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize
))]
pub enum RequestEvent {
    /// Send an L3 existence probe. `Submitted → Querying`.
    ScheduleQuery,
    /// The L3 probe came back. `Querying → Submitted` (or `Aborted` if an abort is pending).
    QueryDone {
        /// Pages found in L3 beyond the device/host match (informational; the scheduler decides).
        hit_pages: u32,
    },
    /// Start prefetching `pages` (> 0) pages from L3 to host: prompt pages
    /// `start_page .. start_page + pages`, where `start_page` is the device/host match length the
    /// L3 keys were computed against. `Submitted → Prefetching`.
    SchedulePrefetch {
        /// Index of the first page to prefetch (the current device/host match, in pages).
        start_page: u32,
        /// Pages to prefetch.
        pages: u32,
    },
    /// The prefetch came back with `completed <= pages` pages on host (partial success is normal).
    /// `Prefetching → PrefetchDone` (or `Aborted`).
    PrefetchDone {
        /// Pages that arrived.
        completed: u32,
    },
    /// Schedule the first prefill chunk: `tokens` (> 0) tokens after a `cached` prefix, with
    /// `cached + tokens <= total`. `Submitted | PrefetchDone → Prefilling`.
    ScheduleFirstChunk {
        /// Prompt tokens in total, cached prefix included.
        total: u32,
        /// Tokens whose KV is already on device (after any load-back).
        cached: u32,
        /// Tokens in this chunk.
        tokens: u32,
    },
    /// Schedule the next prefill chunk of `tokens` (> 0) tokens; needs no chunk in flight.
    ScheduleNextChunk {
        /// Tokens in this chunk.
        tokens: u32,
    },
    /// The in-flight prefill chunk completed. The last chunk moves the request to `Decoding`.
    PrefillDone,
    /// Put the request in the next decode batch; needs no decode step in flight.
    ScheduleDecode,
    /// The in-flight decode step produced one token.
    DecodeStep,
    /// Generation is over (stop token, length limit); `pages_to_write_back` device pages are to be
    /// written back to host. `Decoding → Draining`.
    Finish {
        /// Pages to write back device→host.
        pages_to_write_back: u32,
    },
    /// Commit the drain: issue the write-back, or finish at once if there is nothing to write.
    CommitDraining,
    /// The write-back came back. `backups` is the number of host→L3 backup ops the scheduler
    /// issued for this request's pages (only after a successful write-back of a finished request).
    WriteBackDone {
        /// The pages are now on host. A failed write-back is not a request failure: the pages are
        /// simply not on host.
        success: bool,
        /// Backup ops issued and tied to this request.
        backups: u32,
    },
    /// One host→L3 backup op tied to this request completed (successfully or not).
    BackupDone,
    /// Preempt the request to free device memory; `write_back_pages` victim pages are written back
    /// to host first (0: drop them, the prefix will be recomputed).
    Retract {
        /// Pages to write back device→host before dropping them from device.
        write_back_pages: u32,
    },
    /// Put a retracted request back in the queue. `Retracted → Submitted`.
    ResumeFromRetracted,
    /// Abort the request. Immediate when nothing is in flight, deferred to the completion
    /// otherwise.
    Abort,
    /// Fail the request; needs nothing in flight (in-flight work reports failure through its
    /// completion).
    Fail {
        /// Why.
        reason: FailReason,
    },
}

impl RequestStateKind {
    /// `Finished`, `Aborted` and `Failed`: states that accept no event at all.
    pub const fn is_terminal(self) -> bool {
        matches!(self, Self::Finished | Self::Aborted | Self::Failed)
    }
}

impl RequestEventKind {
    /// Whether events of this kind report the completion of in-flight work (as opposed to a
    /// scheduler decision).
    pub const fn is_completion(self) -> bool {
        matches!(
            self,
            Self::QueryDone
                | Self::PrefetchDone
                | Self::PrefillDone
                | Self::DecodeStep
                | Self::WriteBackDone
                | Self::BackupDone
        )
    }
}

impl RequestEvent {
    /// The event's field-less kind.
    pub fn kind(&self) -> RequestEventKind {
        self.into()
    }
}

impl RequestState {
    /// A fresh request: [`RequestState::Submitted`].
    pub const fn new() -> Self {
        Self::Submitted
    }

    /// The state's field-less kind.
    pub fn kind(&self) -> RequestStateKind {
        self.into()
    }

    /// `Finished`, `Aborted` or `Failed`.
    pub fn is_terminal(&self) -> bool {
        self.kind().is_terminal()
    }

    /// Not terminal: the request still holds, or may still acquire, resources.
    pub fn is_live(&self) -> bool {
        !self.is_terminal()
    }

    /// Whether an operation or forward pass is in flight, i.e. a completion event is owed:
    /// `Querying`, `Prefetching`, `Prefilling` with `scheduled > done`, `Decoding` with
    /// `in_flight`, `WritingBack`, `BackingUp` and `Retracting`.
    pub fn has_in_flight(&self) -> bool {
        match *self {
            Self::Querying { .. }
            | Self::Prefetching { .. }
            | Self::WritingBack { .. }
            | Self::BackingUp { .. }
            | Self::Retracting { .. } => true,
            Self::Prefilling {
                done, scheduled, ..
            } => scheduled > done,
            Self::Decoding { in_flight, .. } => in_flight,
            Self::Submitted
            | Self::PrefetchDone { .. }
            | Self::Draining { .. }
            | Self::Retracted { .. }
            | Self::Finished
            | Self::Aborted
            | Self::Failed { .. } => false,
        }
    }

    /// Whether an abort arrived while something was in flight and waits for its completion.
    pub fn abort_pending(&self) -> bool {
        match *self {
            Self::Querying { abort_pending }
            | Self::Prefetching { abort_pending, .. }
            | Self::Prefilling { abort_pending, .. }
            | Self::Decoding { abort_pending, .. }
            | Self::WritingBack { abort_pending, .. }
            | Self::BackingUp { abort_pending, .. }
            | Self::Retracting { abort_pending, .. } => abort_pending,
            Self::Submitted
            | Self::PrefetchDone { .. }
            | Self::Draining { .. }
            | Self::Retracted { .. }
            | Self::Finished
            | Self::Aborted
            | Self::Failed { .. } => false,
        }
    }
}
