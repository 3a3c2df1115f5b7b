//! Whole lives of a request: each test drives the machine through one path (plain
//! prefill-decode-finish, L3 probe and partial prefetch, chunked prefill, retraction and
//! resume, write-back then backups) and checks the state and its counters at every step, plus
//! the illegal events that path must refuse.

use kvtier_fsm::{IllegalReason, RequestEvent as E, RequestState as S};

use super::{decoding, illegal, run};

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
