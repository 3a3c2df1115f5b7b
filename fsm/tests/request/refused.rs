//! Refusals and the error API: completions with nothing in flight, counters at their
//! arithmetic edges, states that break an invariant; `apply_mut` and `next_state` agree with
//! `apply`; errors box into `std::error::Error` and name state, event and reason.

use kvtier_fsm::{IllegalReason, RequestEvent as E, RequestState as S, RequestStateKind as K};

use super::{decoding, illegal};

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
