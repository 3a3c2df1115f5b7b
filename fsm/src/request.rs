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
//! [`IllegalTransition`] that hands back the untouched state. Three rules shape it:
//!
//! 1. **Abort is deferred, never lost.** If an operation is in flight, `Abort` only sets
//!    `abort_pending`; the operation's completion then lands in [`RequestState::Aborted`]. While
//!    an abort is pending the completion is the only accepted event, and a second `Abort` is
//!    reported as [`IllegalReason::AbortAlreadyPending`] rather than merged.
//! 2. **Completions never fail for arithmetic.** Every counter is bumped (with checked
//!    arithmetic) when work is *scheduled*, so a completion can always be accepted.
//! 3. **States are checked before use.** A state whose data breaks an invariant (see
//!    [`RequestState::check_invariants`]) can only come from outside the machine (hand
//!    construction, deserialization); every event on it is refused with
//!    [`IllegalReason::InconsistentState`].
//!
//! `strum` derives the field-less mirrors [`RequestStateKind`] and [`RequestEventKind`]; the
//! transition table in [`crate::table`] is written in terms of those, and tests check that this
//! code and the table agree.

use serde::{Deserialize, Serialize};
use strum::{Display, EnumDiscriminants, EnumIter, IntoStaticStr};

use crate::error::{IllegalReason, IllegalTransition};

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

    /// Representative, internally consistent states of this kind: plain values, both values of
    /// every flag, and counters at their edges (0, 1, `u32::MAX`). Tests, the reachability check
    /// and downstream crates' tests use these.
    pub fn samples(self) -> Vec<RequestState> {
        use RequestState as S;
        const M: u32 = u32::MAX;
        let flags = [false, true];
        match self {
            Self::Submitted => vec![S::Submitted],
            Self::Querying => flags
                .iter()
                .map(|&abort_pending| S::Querying { abort_pending })
                .collect(),
            Self::Prefetching => [(0, 1), (2, 4), (0, M), (M - 1, 1)]
                .iter()
                .flat_map(|&(start_page, pages)| {
                    flags.iter().map(move |&abort_pending| S::Prefetching {
                        start_page,
                        pages,
                        abort_pending,
                    })
                })
                .collect(),
            Self::PrefetchDone => [(0, 0), (2, 3), (0, M), (M, 0)]
                .iter()
                .map(|&(start_page, completed)| S::PrefetchDone {
                    start_page,
                    completed,
                })
                .collect(),
            Self::Prefilling => {
                let p = |total, done, scheduled, chunks, abort_pending| S::Prefilling {
                    total,
                    done,
                    scheduled,
                    chunks,
                    abort_pending,
                };
                vec![
                    p(8, 0, 4, 1, false),
                    p(8, 0, 4, 1, true),
                    p(8, 4, 4, 1, false),
                    p(8, 4, 8, 2, false),
                    p(8, 4, 8, 2, true),
                    p(8, 2, 2, M, false),
                    p(M, M - 1, M - 1, 3, false),
                    p(M, 0, M, 1, false),
                ]
            }
            Self::Decoding => vec![
                S::Decoding {
                    generated: 1,
                    in_flight: false,
                    abort_pending: false,
                },
                S::Decoding {
                    generated: 5,
                    in_flight: true,
                    abort_pending: false,
                },
                S::Decoding {
                    generated: 5,
                    in_flight: true,
                    abort_pending: true,
                },
                S::Decoding {
                    generated: M - 1,
                    in_flight: true,
                    abort_pending: false,
                },
                S::Decoding {
                    generated: M,
                    in_flight: false,
                    abort_pending: false,
                },
            ],
            Self::Draining => [0, 3].iter().map(|&pages| S::Draining { pages }).collect(),
            Self::WritingBack => flags
                .iter()
                .map(|&abort_pending| S::WritingBack {
                    pages: 3,
                    abort_pending,
                })
                .collect(),
            Self::BackingUp => [1, 2]
                .iter()
                .flat_map(|&outstanding| {
                    flags.iter().map(move |&abort_pending| S::BackingUp {
                        outstanding,
                        abort_pending,
                    })
                })
                .collect(),
            Self::Retracting => flags
                .iter()
                .map(|&abort_pending| S::Retracting {
                    pages: 2,
                    abort_pending,
                })
                .collect(),
            Self::Retracted => flags.iter().map(|&saved| S::Retracted { saved }).collect(),
            Self::Finished => vec![S::Finished],
            Self::Aborted => vec![S::Aborted],
            Self::Failed => [
                FailReason::OpFailed,
                FailReason::OutOfMemory,
                FailReason::Internal,
            ]
            .iter()
            .map(|&reason| S::Failed { reason })
            .collect(),
        }
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

    /// Representative events of this kind, legal and illegal alike: zero counts, small counts,
    /// bounds-breaking and overflowing counts, every flag combination.
    pub fn samples(self) -> Vec<RequestEvent> {
        use RequestEvent as E;
        const M: u32 = u32::MAX;
        match self {
            Self::ScheduleQuery => vec![E::ScheduleQuery],
            Self::QueryDone => [0, 5]
                .iter()
                .map(|&hit_pages| E::QueryDone { hit_pages })
                .collect(),
            Self::SchedulePrefetch => [(0, 0), (0, 1), (2, 4), (0, M), (M, 1)]
                .iter()
                .map(|&(start_page, pages)| E::SchedulePrefetch { start_page, pages })
                .collect(),
            Self::PrefetchDone => [0, 1, 4, M]
                .iter()
                .map(|&completed| E::PrefetchDone { completed })
                .collect(),
            Self::ScheduleFirstChunk => [
                (8, 0, 4),
                (8, 4, 4),
                (8, 0, 8),
                (8, 7, 1),
                (8, 0, 0),
                (8, 4, 5),
                (M, M, 1),
            ]
            .iter()
            .map(|&(total, cached, tokens)| E::ScheduleFirstChunk {
                total,
                cached,
                tokens,
            })
            .collect(),
            Self::ScheduleNextChunk => [0, 1, 4, M]
                .iter()
                .map(|&tokens| E::ScheduleNextChunk { tokens })
                .collect(),
            Self::PrefillDone => vec![E::PrefillDone],
            Self::ScheduleDecode => vec![E::ScheduleDecode],
            Self::DecodeStep => vec![E::DecodeStep],
            Self::Finish => [0, 3]
                .iter()
                .map(|&pages_to_write_back| E::Finish {
                    pages_to_write_back,
                })
                .collect(),
            Self::CommitDraining => vec![E::CommitDraining],
            Self::WriteBackDone => [(true, 0), (false, 0), (true, 2), (false, 2)]
                .iter()
                .map(|&(success, backups)| E::WriteBackDone { success, backups })
                .collect(),
            Self::BackupDone => vec![E::BackupDone],
            Self::Retract => [0, 3]
                .iter()
                .map(|&write_back_pages| E::Retract { write_back_pages })
                .collect(),
            Self::ResumeFromRetracted => vec![E::ResumeFromRetracted],
            Self::Abort => vec![E::Abort],
            Self::Fail => [
                FailReason::OpFailed,
                FailReason::OutOfMemory,
                FailReason::Internal,
            ]
            .iter()
            .map(|&reason| E::Fail { reason })
            .collect(),
        }
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

    /// Checks the invariants every state produced by [`apply`](Self::apply) satisfies:
    ///
    /// - `abort_pending` implies something is in flight;
    /// - `Prefetching.pages`, `WritingBack.pages`, `Retracting.pages` and
    ///   `BackingUp.outstanding` are positive (zero would mean nothing is in flight);
    /// - `Prefetching`: `start_page + pages` fits in `u32`; `PrefetchDone`: so does
    ///   `start_page + completed`;
    /// - `Prefilling`: `done <= scheduled <= total`, `done < total` (a finished prefill is
    ///   `Decoding`) and `chunks >= 1`;
    /// - `Decoding`: `generated >= 1`, and `generated < u32::MAX` while a step is in flight (so
    ///   the step's completion can always be counted).
    ///
    /// Returns [`IllegalReason::InconsistentState`] otherwise.
    pub fn check_invariants(&self) -> Result<(), IllegalReason> {
        let ok = match *self {
            Self::Prefetching {
                start_page, pages, ..
            } => pages > 0 && start_page.checked_add(pages).is_some(),
            Self::PrefetchDone {
                start_page,
                completed,
            } => start_page.checked_add(completed).is_some(),
            Self::WritingBack { pages: n, .. }
            | Self::Retracting { pages: n, .. }
            | Self::BackingUp { outstanding: n, .. } => n > 0,
            Self::Prefilling {
                total,
                done,
                scheduled,
                chunks,
                abort_pending,
            } => {
                done <= scheduled
                    && scheduled <= total
                    && done < total
                    && chunks >= 1
                    && (!abort_pending || scheduled > done)
            }
            Self::Decoding {
                generated,
                in_flight,
                abort_pending,
            } => {
                generated >= 1
                    && (!abort_pending || in_flight)
                    && (!in_flight || generated < u32::MAX)
            }
            Self::Submitted
            | Self::Querying { .. }
            | Self::Draining { .. }
            | Self::Retracted { .. }
            | Self::Finished
            | Self::Aborted
            | Self::Failed { .. } => true,
        };
        if ok {
            Ok(())
        } else {
            Err(IllegalReason::InconsistentState)
        }
    }

    /// Applies `event`, consuming the state.
    ///
    /// On success returns the next state. On failure returns an [`IllegalTransition`] holding
    /// this very state, unchanged, together with the event and the reason; nothing panics.
    pub fn apply(
        self,
        event: RequestEvent,
    ) -> Result<RequestState, IllegalTransition<RequestState, RequestEvent>> {
        match self.next_state(&event) {
            Ok(next) => Ok(next),
            Err(reason) => Err(IllegalTransition {
                state: self,
                event,
                reason,
            }),
        }
    }

    /// Applies `event` in place: on success `self` becomes the next state; on failure `self` is
    /// left as it was and the error carries a copy of it. Convenient when the state lives inside
    /// a larger request record.
    pub fn apply_mut(
        &mut self,
        event: RequestEvent,
    ) -> Result<(), IllegalTransition<RequestState, RequestEvent>> {
        match self.next_state(&event) {
            Ok(next) => {
                *self = next;
                Ok(())
            }
            Err(reason) => Err(IllegalTransition {
                state: self.clone(),
                event,
                reason,
            }),
        }
    }

    /// What [`apply`](Self::apply) would return, without consuming anything: the next state, or
    /// the reason the event is illegal. This is the whole transition function.
    pub fn next_state(&self, event: &RequestEvent) -> Result<RequestState, IllegalReason> {
        use IllegalReason as R;
        use RequestEvent as E;
        use RequestState as S;

        if self.is_terminal() {
            return Err(R::Terminal);
        }
        self.check_invariants()?;

        match (self, event) {
            (_, E::Abort) => self.abort(),
            (_, E::Fail { reason }) => {
                if self.has_in_flight() {
                    Err(R::InFlight)
                } else {
                    Ok(S::Failed { reason: *reason })
                }
            }

            // L3 probe.
            (S::Submitted, E::ScheduleQuery) => Ok(S::Querying {
                abort_pending: false,
            }),
            (&S::Querying { abort_pending }, E::QueryDone { .. }) => Ok(if abort_pending {
                S::Aborted
            } else {
                S::Submitted
            }),

            // Prefetch L3 → host.
            (S::Submitted, &E::SchedulePrefetch { start_page, pages }) => {
                if pages == 0 {
                    Err(R::Zero)
                } else if start_page.checked_add(pages).is_none() {
                    Err(R::Overflow)
                } else {
                    Ok(S::Prefetching {
                        start_page,
                        pages,
                        abort_pending: false,
                    })
                }
            }
            (
                &S::Prefetching {
                    start_page,
                    pages,
                    abort_pending,
                },
                &E::PrefetchDone { completed },
            ) => {
                if completed > pages {
                    Err(R::ExceedsBound)
                } else if abort_pending {
                    Ok(S::Aborted)
                } else {
                    Ok(S::PrefetchDone {
                        start_page,
                        completed,
                    })
                }
            }

            // Prefill.
            (
                S::Submitted | S::PrefetchDone { .. },
                &E::ScheduleFirstChunk {
                    total,
                    cached,
                    tokens,
                },
            ) => {
                if tokens == 0 {
                    return Err(R::Zero);
                }
                let scheduled = cached.checked_add(tokens).ok_or(R::Overflow)?;
                if scheduled > total {
                    return Err(R::ExceedsBound);
                }
                Ok(S::Prefilling {
                    total,
                    done: cached,
                    scheduled,
                    chunks: 1,
                    abort_pending: false,
                })
            }
            (
                &S::Prefilling {
                    total,
                    done,
                    scheduled,
                    chunks,
                    abort_pending,
                },
                &E::ScheduleNextChunk { tokens },
            ) => {
                if scheduled > done {
                    return Err(R::InFlight);
                }
                if done >= total {
                    return Err(R::PrefillComplete);
                }
                if tokens == 0 {
                    return Err(R::Zero);
                }
                let scheduled = scheduled.checked_add(tokens).ok_or(R::Overflow)?;
                if scheduled > total {
                    return Err(R::ExceedsBound);
                }
                let chunks = chunks.checked_add(1).ok_or(R::Overflow)?;
                Ok(S::Prefilling {
                    total,
                    done,
                    scheduled,
                    chunks,
                    abort_pending,
                })
            }
            (
                &S::Prefilling {
                    total,
                    done,
                    scheduled,
                    chunks,
                    abort_pending,
                },
                E::PrefillDone,
            ) => {
                if scheduled <= done {
                    Err(R::NothingInFlight)
                } else if abort_pending {
                    Ok(S::Aborted)
                } else if scheduled == total {
                    Ok(S::Decoding {
                        generated: 1,
                        in_flight: false,
                        abort_pending: false,
                    })
                } else {
                    Ok(S::Prefilling {
                        total,
                        done: scheduled,
                        scheduled,
                        chunks,
                        abort_pending: false,
                    })
                }
            }

            // Decode.
            (
                &S::Decoding {
                    generated,
                    in_flight,
                    abort_pending,
                },
                E::ScheduleDecode,
            ) => {
                if in_flight {
                    Err(R::InFlight)
                } else if generated == u32::MAX {
                    // The step's completion could not be counted; refuse now, not then.
                    Err(R::Overflow)
                } else {
                    Ok(S::Decoding {
                        generated,
                        in_flight: true,
                        abort_pending,
                    })
                }
            }
            (
                &S::Decoding {
                    generated,
                    in_flight,
                    abort_pending,
                },
                E::DecodeStep,
            ) => {
                if !in_flight {
                    return Err(R::NothingInFlight);
                }
                if abort_pending {
                    return Ok(S::Aborted);
                }
                // Cannot overflow: the invariants keep `generated < u32::MAX` while in flight.
                let generated = generated.checked_add(1).ok_or(R::Overflow)?;
                Ok(S::Decoding {
                    generated,
                    in_flight: false,
                    abort_pending: false,
                })
            }
            (
                &S::Decoding { in_flight, .. },
                &E::Finish {
                    pages_to_write_back,
                },
            ) => {
                if in_flight {
                    Err(R::InFlight)
                } else {
                    Ok(S::Draining {
                        pages: pages_to_write_back,
                    })
                }
            }

            // Retraction (preemption).
            (S::Decoding { .. } | S::Prefilling { .. }, &E::Retract { write_back_pages }) => {
                if self.has_in_flight() {
                    Err(R::InFlight)
                } else if write_back_pages > 0 {
                    Ok(S::Retracting {
                        pages: write_back_pages,
                        abort_pending: false,
                    })
                } else {
                    Ok(S::Retracted { saved: false })
                }
            }
            (&S::Retracting { abort_pending, .. }, &E::WriteBackDone { success, backups }) => {
                if backups > 0 {
                    // Backups are tracked only on the finish path (BackingUp).
                    Err(R::ContradictoryEvent)
                } else if abort_pending {
                    Ok(S::Aborted)
                } else {
                    Ok(S::Retracted { saved: success })
                }
            }
            (S::Retracted { .. }, E::ResumeFromRetracted) => Ok(S::Submitted),

            // Drain, write back, back up.
            (&S::Draining { pages }, E::CommitDraining) => Ok(if pages > 0 {
                S::WritingBack {
                    pages,
                    abort_pending: false,
                }
            } else {
                S::Finished
            }),
            (&S::WritingBack { abort_pending, .. }, &E::WriteBackDone { success, backups }) => {
                if !success && backups > 0 {
                    // Nothing reached host, so nothing can be backed up from it.
                    Err(R::ContradictoryEvent)
                } else if backups > 0 {
                    // Backups were issued: their completions are owed even if an abort is
                    // pending, so the abort waits for them too.
                    Ok(S::BackingUp {
                        outstanding: backups,
                        abort_pending,
                    })
                } else if abort_pending {
                    Ok(S::Aborted)
                } else {
                    Ok(S::Finished)
                }
            }
            (
                &S::BackingUp {
                    outstanding,
                    abort_pending,
                },
                E::BackupDone,
            ) => {
                let outstanding = outstanding.checked_sub(1).ok_or(R::NothingInFlight)?;
                if outstanding > 0 {
                    Ok(S::BackingUp {
                        outstanding,
                        abort_pending,
                    })
                } else if abort_pending {
                    Ok(S::Aborted)
                } else {
                    Ok(S::Finished)
                }
            }

            _ => Err(R::NotAccepted),
        }
    }

    /// `Abort` on a live, consistent state.
    fn abort(&self) -> Result<RequestState, IllegalReason> {
        use RequestState as S;
        if self.abort_pending() {
            return Err(IllegalReason::AbortAlreadyPending);
        }
        if !self.has_in_flight() {
            return Ok(S::Aborted);
        }
        let mut next = self.clone();
        match &mut next {
            S::Querying { abort_pending }
            | S::Prefetching { abort_pending, .. }
            | S::Prefilling { abort_pending, .. }
            | S::Decoding { abort_pending, .. }
            | S::WritingBack { abort_pending, .. }
            | S::BackingUp { abort_pending, .. }
            | S::Retracting { abort_pending, .. } => {
                *abort_pending = true;
                Ok(next)
            }
            // Nothing else can have work in flight; answer conservatively rather than panic.
            S::Submitted
            | S::PrefetchDone { .. }
            | S::Draining { .. }
            | S::Retracted { .. }
            | S::Finished
            | S::Aborted
            | S::Failed { .. } => Err(IllegalReason::InconsistentState),
        }
    }
}
