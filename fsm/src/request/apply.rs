//! The transition function of the request machine: [`RequestState::apply`],
//! [`RequestState::apply_mut`], [`RequestState::next_state`], and the invariants every state they
//! produce satisfies ([`RequestState::check_invariants`]).
//!
//! Why: every rule of a request's life sits in one pure function of `(state, event)`, so the
//! transition table in [`crate::table`] and the property tests can be checked against it, and
//! an illegal event is a typed error that leaves the state as it was. Three rules shape it:
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

use crate::error::{IllegalReason, IllegalTransition};

use super::{RequestEvent, RequestState};

impl RequestState {
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
