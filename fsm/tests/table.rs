//! The transition tables and the `apply` functions must agree.

mod common;

use std::collections::BTreeSet;

use kvtier_fsm::{
    IllegalReason, OpEventKind, OpState, RequestEventKind, RequestStateKind, op_row, op_table,
    request_row, request_table,
};
use strum::IntoEnumIterator;

#[test]
fn request_table_has_at_most_one_row_per_pair_and_no_rows_from_terminal_states() {
    let mut seen = BTreeSet::new();
    for r in request_table() {
        assert!(seen.insert((r.from, r.event)), "duplicate row {r:?}");
        assert!(!r.from.is_terminal(), "row from terminal state: {r:?}");
        assert!(!r.to.is_empty(), "row without targets: {r:?}");
        assert!(!r.guard.is_empty(), "row without guard text: {r:?}");
    }
}

/// For every state kind × event kind, over every sample: a successful `apply` lands in a kind
/// listed in the row; a pair with no row is always illegal; and every listed target is reached
/// by at least one sample.
#[test]
fn request_apply_agrees_with_table() {
    let mut reached = BTreeSet::new();
    for sk in RequestStateKind::iter() {
        let states = sk.samples();
        assert!(!states.is_empty(), "no samples for {sk}");
        for ek in RequestEventKind::iter() {
            let row = request_row(sk, ek);
            let events = ek.samples();
            assert!(!events.is_empty(), "no samples for {ek}");
            for s in &states {
                assert_eq!(s.kind(), sk, "sample {s:?} is not of kind {sk}");
                assert_eq!(s.check_invariants(), Ok(()), "sample {s:?} is inconsistent");
                for e in &events {
                    assert_eq!(e.kind(), ek);
                    match (row, s.clone().apply(e.clone())) {
                        (Some(row), Ok(next)) => {
                            assert!(
                                row.to.contains(&next.kind()),
                                "{s:?} + {e:?} -> {next:?}, not in table row {row:?}"
                            );
                            reached.insert((sk, ek, next.kind()));
                        }
                        (None, Ok(next)) => {
                            panic!("{s:?} + {e:?} -> {next:?}, but the table has no row")
                        }
                        (_, Err(err)) => {
                            assert_eq!(&err.state, s);
                            assert_eq!(&err.event, e);
                            if row.is_none() && !sk.is_terminal() {
                                assert!(
                                    matches!(
                                        err.reason,
                                        IllegalReason::NotAccepted | IllegalReason::InFlight
                                    ),
                                    "{s:?} + {e:?}: {}",
                                    err.reason
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    for r in request_table() {
        for &to in r.to {
            assert!(
                reached.contains(&(r.from, r.event, to)),
                "table row {} + {} -> {to} is never taken by any sample",
                r.from,
                r.event
            );
        }
    }
}

#[test]
fn every_live_state_accepts_abort_and_every_state_kind_appears_in_the_table() {
    for sk in RequestStateKind::iter() {
        if sk.is_terminal() {
            assert!(request_table().iter().any(|r| r.to.contains(&sk)));
        } else {
            assert!(request_row(sk, RequestEventKind::Abort).is_some(), "{sk}");
        }
    }
}

#[test]
fn op_apply_agrees_with_table() {
    let mut reached = BTreeSet::new();
    for s in OpState::iter() {
        for ek in OpEventKind::iter() {
            let row = op_row(s, ek);
            for e in ek.samples() {
                match (row, s.apply(e)) {
                    (Some(row), Ok(next)) => {
                        assert!(row.to.contains(&next), "{s} + {e:?} -> {next}");
                        reached.insert((s, ek, next));
                    }
                    (None, Ok(next)) => panic!("{s} + {e:?} -> {next} without a table row"),
                    (_, Err(err)) => {
                        assert_eq!(err.state, s);
                        assert_eq!(err.event, e);
                    }
                }
            }
        }
    }
    for r in op_table() {
        for &to in r.to {
            assert!(reached.contains(&(r.from, r.event, to)), "{r:?} -> {to}");
        }
    }
    assert!(op_row(OpState::Issued, OpEventKind::Cancel).is_none());
}
