//! Abort and fail: an abort is immediate when nothing is in flight and deferred to the
//! completion otherwise (never lost, never merged); a failure needs nothing in flight.

use kvtier_fsm::{FailReason, IllegalReason, RequestEvent as E, RequestState as S};

use super::{decoding, illegal, run};

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
