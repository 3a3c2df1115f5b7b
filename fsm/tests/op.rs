//! Unit tests of the cache-op machine.

use kvtier_fsm::{CacheOp, IllegalReason, OpEvent, OpKind, OpState, Tier};
use strum::IntoEnumIterator;

#[test]
fn issue_then_complete() {
    for kind in OpKind::iter() {
        let op = CacheOp::new(kind);
        assert_eq!(op.state, OpState::Pending);
        let op = op.apply(OpEvent::Issue).unwrap();
        assert!(op.state.is_outstanding());
        let done = op.apply(OpEvent::Complete { success: true }).unwrap();
        assert_eq!(
            done,
            CacheOp {
                kind,
                state: OpState::Done
            }
        );
        let failed = op.apply(OpEvent::Complete { success: false }).unwrap();
        assert_eq!(failed.state, OpState::Failed);
        assert!(done.is_terminal() && failed.is_terminal());
    }
}

#[test]
fn cancel_only_before_issue() {
    assert_eq!(
        OpState::Pending.apply(OpEvent::Cancel),
        Ok(OpState::Cancelled)
    );
    let err = OpState::Issued.apply(OpEvent::Cancel).unwrap_err();
    assert_eq!(err.state, OpState::Issued);
    assert_eq!(err.reason, IllegalReason::AlreadyIssued);
}

#[test]
fn one_completion_only() {
    let mut op = CacheOp::new(OpKind::BackUp);
    op.apply_mut(OpEvent::Issue).unwrap();
    op.apply_mut(OpEvent::Complete { success: true }).unwrap();
    let err = op
        .apply_mut(OpEvent::Complete { success: true })
        .unwrap_err();
    assert_eq!(err.reason, IllegalReason::Terminal);
    assert_eq!(err.state, op);
    assert_eq!(op.state, OpState::Done);
    // A completion for an op that was never issued.
    assert_eq!(
        OpState::Pending
            .apply(OpEvent::Complete { success: true })
            .unwrap_err()
            .reason,
        IllegalReason::NothingInFlight
    );
    // Issued twice.
    assert_eq!(
        OpState::Issued.apply(OpEvent::Issue).unwrap_err().reason,
        IllegalReason::InFlight
    );
}

#[test]
fn routes() {
    assert_eq!(OpKind::LoadBack.route(), Some((Tier::Host, Tier::Device)));
    assert_eq!(OpKind::WriteBack.route(), Some((Tier::Device, Tier::Host)));
    assert_eq!(OpKind::Prefetch.route(), Some((Tier::L3, Tier::Host)));
    assert_eq!(OpKind::BackUp.route(), Some((Tier::Host, Tier::L3)));
    assert_eq!(OpKind::L3Query.route(), None);
}
