//! Happy paths and targeted illegal cases of the request machine.

use kvtier_fsm::{
    FailReason, IllegalReason, RequestEvent as E, RequestState as S, RequestStateKind as K,
    RequestTransitionError,
};

/// Applies `events` in order, panicking with context on the first illegal one.
fn run(start: S, events: &[E]) -> S {
    events.iter().fold(start, |s, e| match s.apply(e.clone()) {
        Ok(next) => next,
        Err(err) => panic!("unexpected illegal transition: {err}"),
    })
}

fn illegal(state: S, event: E) -> RequestTransitionError {
    let before = state.clone();
    match state.apply(event) {
        Ok(next) => panic!("expected an illegal transition, got {next:?}"),
        Err(err) => {
            assert_eq!(err.state, before, "an illegal event changed the state");
            err
        }
    }
}

fn decoding(generated: u32) -> S {
    S::Decoding {
        generated,
        in_flight: false,
        abort_pending: false,
    }
}

#[test]
fn plain_request_prefill_decode_finish() {
    let s = run(
        S::new(),
        &[E::ScheduleFirstChunk {
            total: 10,
            cached: 0,
            tokens: 10,
        }],
    );
    assert_eq!(
        s,
        S::Prefilling {
            total: 10,
            done: 0,
            scheduled: 10,
            chunks: 1,
            abort_pending: false
        }
    );
    assert!(s.has_in_flight());
    let s = run(s, &[E::PrefillDone]);
    assert_eq!(s, decoding(1));
    let s = run(
        s,
        &[
            E::ScheduleDecode,
            E::DecodeStep,
            E::ScheduleDecode,
            E::DecodeStep,
        ],
    );
    assert_eq!(s, decoding(3));
    let s = run(
        s,
        &[
            E::Finish {
                pages_to_write_back: 0,
            },
            E::CommitDraining,
        ],
    );
    assert_eq!(s, S::Finished);
    assert!(s.is_terminal() && !s.is_live());
}

#[test]
fn prefetch_path_with_query_and_partial_success() {
    let s = run(
        S::Submitted,
        &[E::ScheduleQuery, E::QueryDone { hit_pages: 4 }],
    );
    assert_eq!(s, S::Submitted);
    let s = run(
        s,
        &[E::SchedulePrefetch {
            start_page: 2,
            pages: 4,
        }],
    );
    assert_eq!(
        s,
        S::Prefetching {
            start_page: 2,
            pages: 4,
            abort_pending: false
        }
    );
    let s = run(s, &[E::PrefetchDone { completed: 3 }]);
    assert_eq!(
        s,
        S::PrefetchDone {
            start_page: 2,
            completed: 3,
        }
    );
    let s = run(
        s,
        &[E::ScheduleFirstChunk {
            total: 20,
            cached: 12,
            tokens: 8,
        }],
    );
    assert_eq!(
        s,
        S::Prefilling {
            total: 20,
            done: 12,
            scheduled: 20,
            chunks: 1,
            abort_pending: false
        }
    );
    assert_eq!(run(s, &[E::PrefillDone]), decoding(1));
    // A prefetch that brought nothing is still a normal completion.
    let s = run(
        S::Submitted,
        &[
            E::SchedulePrefetch {
                start_page: 0,
                pages: 2,
            },
            E::PrefetchDone { completed: 0 },
        ],
    );
    assert_eq!(
        s,
        S::PrefetchDone {
            start_page: 0,
            completed: 0,
        }
    );
}

#[test]
fn chunked_prefill_counts_chunks_and_tokens() {
    let s = run(
        S::Submitted,
        &[
            E::ScheduleFirstChunk {
                total: 10,
                cached: 0,
                tokens: 4,
            },
            E::PrefillDone,
        ],
    );
    assert_eq!(
        s,
        S::Prefilling {
            total: 10,
            done: 4,
            scheduled: 4,
            chunks: 1,
            abort_pending: false
        }
    );
    assert!(!s.has_in_flight());
    let s = run(s, &[E::ScheduleNextChunk { tokens: 4 }]);
    assert_eq!(
        s,
        S::Prefilling {
            total: 10,
            done: 4,
            scheduled: 8,
            chunks: 2,
            abort_pending: false
        }
    );
    // Only one chunk at a time.
    let err = illegal(s.clone(), E::ScheduleNextChunk { tokens: 1 });
    assert_eq!(err.reason, IllegalReason::InFlight);
    let s = run(s, &[E::PrefillDone]);
    // Beyond the prompt.
    assert_eq!(
        illegal(s.clone(), E::ScheduleNextChunk { tokens: 3 }).reason,
        IllegalReason::ExceedsBound
    );
    assert_eq!(
        illegal(s.clone(), E::ScheduleNextChunk { tokens: 0 }).reason,
        IllegalReason::Zero
    );
    let s = run(s, &[E::ScheduleNextChunk { tokens: 2 }, E::PrefillDone]);
    assert_eq!(s, decoding(1));
}

#[test]
fn retraction_with_write_back_then_resume() {
    let s = run(
        decoding(7),
        &[E::Retract {
            write_back_pages: 3,
        }],
    );
    assert_eq!(
        s,
        S::Retracting {
            pages: 3,
            abort_pending: false
        }
    );
    let s = run(
        s,
        &[E::WriteBackDone {
            success: true,
            backups: 0,
        }],
    );
    assert_eq!(s, S::Retracted { saved: true });
    let s = run(
        s,
        &[
            E::ResumeFromRetracted,
            E::ScheduleFirstChunk {
                total: 30,
                cached: 24,
                tokens: 6,
            },
            E::PrefillDone,
        ],
    );
    assert_eq!(s, decoding(1));
}

#[test]
fn retraction_variants() {
    // Nothing to write back: straight to Retracted, the prefix is recomputed.
    let s = run(
        decoding(2),
        &[E::Retract {
            write_back_pages: 0,
        }],
    );
    assert_eq!(s, S::Retracted { saved: false });
    // A failed write-back is not a failure of the request.
    let s = run(
        decoding(2),
        &[
            E::Retract {
                write_back_pages: 1,
            },
            E::WriteBackDone {
                success: false,
                backups: 0,
            },
        ],
    );
    assert_eq!(s, S::Retracted { saved: false });
    // Retract between prefill chunks, but not while one is in flight.
    let between = S::Prefilling {
        total: 10,
        done: 4,
        scheduled: 4,
        chunks: 1,
        abort_pending: false,
    };
    assert_eq!(
        run(
            between,
            &[E::Retract {
                write_back_pages: 0
            }]
        ),
        S::Retracted { saved: false }
    );
    let running = S::Prefilling {
        total: 10,
        done: 0,
        scheduled: 4,
        chunks: 1,
        abort_pending: false,
    };
    assert_eq!(
        illegal(
            running,
            E::Retract {
                write_back_pages: 0
            }
        )
        .reason,
        IllegalReason::InFlight
    );
    // Backups are not tracked on the retraction path.
    let retracting = S::Retracting {
        pages: 1,
        abort_pending: false,
    };
    assert_eq!(
        illegal(
            retracting,
            E::WriteBackDone {
                success: true,
                backups: 1
            }
        )
        .reason,
        IllegalReason::ContradictoryEvent
    );
    // Finished requests cannot be retracted.
    assert_eq!(
        illegal(
            S::Draining { pages: 1 },
            E::Retract {
                write_back_pages: 1
            }
        )
        .reason,
        IllegalReason::NotAccepted
    );
}

#[test]
fn write_back_then_backups_then_finished() {
    let s = run(
        decoding(5),
        &[
            E::Finish {
                pages_to_write_back: 2,
            },
            E::CommitDraining,
        ],
    );
    assert_eq!(
        s,
        S::WritingBack {
            pages: 2,
            abort_pending: false
        }
    );
    let s = run(
        s,
        &[E::WriteBackDone {
            success: true,
            backups: 2,
        }],
    );
    assert_eq!(
        s,
        S::BackingUp {
            outstanding: 2,
            abort_pending: false
        }
    );
    let s = run(s, &[E::BackupDone]);
    assert_eq!(
        s,
        S::BackingUp {
            outstanding: 1,
            abort_pending: false
        }
    );
    assert_eq!(run(s, &[E::BackupDone]), S::Finished);
    // No backups: finished right after the write-back, even a failed one.
    let s = S::WritingBack {
        pages: 1,
        abort_pending: false,
    };
    assert_eq!(
        run(
            s.clone(),
            &[E::WriteBackDone {
                success: false,
                backups: 0
            }]
        ),
        S::Finished
    );
    // Backups from pages that never reached host are a contradiction.
    assert_eq!(
        illegal(
            s,
            E::WriteBackDone {
                success: false,
                backups: 1
            }
        )
        .reason,
        IllegalReason::ContradictoryEvent
    );
}

#[test]
fn abort_is_immediate_without_in_flight_work() {
    for s in [
        S::Submitted,
        S::PrefetchDone {
            start_page: 0,
            completed: 1,
        },
        decoding(3),
        S::Draining { pages: 4 },
        S::Retracted { saved: true },
        S::Prefilling {
            total: 8,
            done: 4,
            scheduled: 4,
            chunks: 1,
            abort_pending: false,
        },
    ] {
        assert_eq!(run(s, &[E::Abort]), S::Aborted);
    }
}

#[test]
fn abort_is_deferred_while_in_flight() {
    let s = run(
        S::Submitted,
        &[
            E::SchedulePrefetch {
                start_page: 2,
                pages: 4,
            },
            E::Abort,
        ],
    );
    assert_eq!(
        s,
        S::Prefetching {
            start_page: 2,
            pages: 4,
            abort_pending: true
        }
    );
    assert!(s.abort_pending() && s.has_in_flight());
    // A duplicated abort is reported, the pending one is kept.
    assert_eq!(
        illegal(s.clone(), E::Abort).reason,
        IllegalReason::AbortAlreadyPending
    );
    // Only the completion is accepted now.
    assert_eq!(
        illegal(
            s.clone(),
            E::Fail {
                reason: FailReason::Internal
            }
        )
        .reason,
        IllegalReason::InFlight
    );
    assert_eq!(run(s, &[E::PrefetchDone { completed: 2 }]), S::Aborted);

    // Mid-decode.
    let s = run(decoding(2), &[E::ScheduleDecode, E::Abort]);
    assert_eq!(
        illegal(s.clone(), E::ScheduleDecode).reason,
        IllegalReason::InFlight
    );
    assert_eq!(run(s, &[E::DecodeStep]), S::Aborted);

    // A write-back that already issued backups waits for them before aborting.
    let s = run(
        S::WritingBack {
            pages: 2,
            abort_pending: false,
        },
        &[
            E::Abort,
            E::WriteBackDone {
                success: true,
                backups: 2,
            },
        ],
    );
    assert_eq!(
        s,
        S::BackingUp {
            outstanding: 2,
            abort_pending: true
        }
    );
    assert_eq!(run(s, &[E::BackupDone, E::BackupDone]), S::Aborted);
}

#[test]
fn fail_needs_nothing_in_flight() {
    let s = run(
        S::Submitted,
        &[E::Fail {
            reason: FailReason::OutOfMemory,
        }],
    );
    assert_eq!(
        s,
        S::Failed {
            reason: FailReason::OutOfMemory
        }
    );
    assert_eq!(
        illegal(
            S::Querying {
                abort_pending: false
            },
            E::Fail {
                reason: FailReason::OpFailed
            }
        )
        .reason,
        IllegalReason::InFlight
    );
}

#[test]
fn completions_without_work_in_flight_are_refused() {
    assert_eq!(
        illegal(decoding(1), E::DecodeStep).reason,
        IllegalReason::NothingInFlight
    );
    let between = S::Prefilling {
        total: 8,
        done: 4,
        scheduled: 4,
        chunks: 1,
        abort_pending: false,
    };
    assert_eq!(
        illegal(between, E::PrefillDone).reason,
        IllegalReason::NothingInFlight
    );
    assert_eq!(
        illegal(S::Submitted, E::BackupDone).reason,
        IllegalReason::NotAccepted
    );
    assert_eq!(
        illegal(
            S::Prefetching {
                start_page: 2,
                pages: 2,
                abort_pending: false
            },
            E::PrefetchDone { completed: 3 }
        )
        .reason,
        IllegalReason::ExceedsBound
    );
}

#[test]
fn arithmetic_edges_are_refused_when_scheduling() {
    assert_eq!(
        illegal(
            S::Submitted,
            E::ScheduleFirstChunk {
                total: u32::MAX,
                cached: u32::MAX,
                tokens: 1
            }
        )
        .reason,
        IllegalReason::Overflow
    );
    assert_eq!(
        illegal(
            S::Submitted,
            E::ScheduleFirstChunk {
                total: 8,
                cached: 4,
                tokens: 5
            }
        )
        .reason,
        IllegalReason::ExceedsBound
    );
    assert_eq!(
        illegal(
            S::Submitted,
            E::ScheduleFirstChunk {
                total: 8,
                cached: 0,
                tokens: 0
            }
        )
        .reason,
        IllegalReason::Zero
    );
    assert_eq!(
        illegal(
            S::Submitted,
            E::SchedulePrefetch {
                start_page: 0,
                pages: 0,
            }
        )
        .reason,
        IllegalReason::Zero
    );
    assert_eq!(
        illegal(
            S::Submitted,
            E::SchedulePrefetch {
                start_page: u32::MAX,
                pages: 1,
            }
        )
        .reason,
        IllegalReason::Overflow
    );
    assert_eq!(
        illegal(decoding(u32::MAX), E::ScheduleDecode).reason,
        IllegalReason::Overflow
    );
    let max_chunks = S::Prefilling {
        total: 8,
        done: 2,
        scheduled: 2,
        chunks: u32::MAX,
        abort_pending: false,
    };
    assert_eq!(
        illegal(max_chunks, E::ScheduleNextChunk { tokens: 1 }).reason,
        IllegalReason::Overflow
    );
}

#[test]
fn inconsistent_states_refuse_every_event() {
    let bad = [
        S::Decoding {
            generated: 1,
            in_flight: false,
            abort_pending: true,
        },
        S::Decoding {
            generated: 0,
            in_flight: false,
            abort_pending: false,
        },
        S::Prefilling {
            total: 8,
            done: 5,
            scheduled: 4,
            chunks: 1,
            abort_pending: false,
        },
        S::Prefilling {
            total: 8,
            done: 8,
            scheduled: 8,
            chunks: 1,
            abort_pending: false,
        },
        S::Prefetching {
            start_page: 2,
            pages: 0,
            abort_pending: false,
        },
        S::BackingUp {
            outstanding: 0,
            abort_pending: false,
        },
    ];
    for s in bad {
        assert_eq!(s.check_invariants(), Err(IllegalReason::InconsistentState));
        for e in [E::Abort, E::PrefillDone, E::DecodeStep, E::BackupDone] {
            assert_eq!(
                illegal(s.clone(), e).reason,
                IllegalReason::InconsistentState
            );
        }
    }
}

#[test]
fn apply_mut_keeps_the_state_on_error() {
    let mut s = S::Submitted;
    s.apply_mut(E::ScheduleQuery).unwrap();
    assert_eq!(s.kind(), K::Querying);
    let err = s.apply_mut(E::ScheduleQuery).unwrap_err();
    assert_eq!(err.state, s);
    assert_eq!(
        s,
        S::Querying {
            abort_pending: false
        }
    );
}

#[test]
fn next_state_is_apply_without_consuming() {
    let s = S::Submitted;
    assert_eq!(
        s.next_state(&E::ScheduleQuery),
        Ok(S::Querying {
            abort_pending: false
        })
    );
    assert_eq!(
        s.next_state(&E::DecodeStep),
        Err(IllegalReason::NotAccepted)
    );
}

#[test]
fn errors_box_into_std_error() {
    fn boxed() -> Result<S, Box<dyn std::error::Error + Send + Sync>> {
        Ok(S::Submitted.apply(E::DecodeStep)?)
    }
    let err = boxed().unwrap_err();
    assert!(err.to_string().contains("not accepted"), "{err}");
}

#[test]
fn error_message_names_state_event_and_reason() {
    let err = illegal(S::Finished, E::Abort);
    assert_eq!(err.reason, IllegalReason::Terminal);
    assert_eq!(
        err.to_string(),
        "illegal transition: Abort in state Finished: the state is terminal"
    );
    assert_eq!(err.into_state(), S::Finished);
}

#[test]
fn kinds_have_stable_names() {
    assert_eq!(K::PrefetchDone.to_string(), "PrefetchDone");
    let name: &'static str = K::BackingUp.into();
    assert_eq!(name, "BackingUp");
    assert_eq!(S::default(), S::Submitted);
}
