//! Helpers shared by the integration tests: every sample state and event, and the completion
//! that answers an in-flight state.

#![allow(dead_code)]

use kvtier_fsm::{RequestEvent, RequestEventKind, RequestState, RequestStateKind};
use strum::IntoEnumIterator;

/// Every sample state of every kind.
pub fn all_states() -> Vec<RequestState> {
    RequestStateKind::iter().flat_map(|k| k.samples()).collect()
}

/// Every sample event of every kind.
pub fn all_events() -> Vec<RequestEvent> {
    RequestEventKind::iter().flat_map(|k| k.samples()).collect()
}

/// The completion that answers what `state` has in flight, choosing among the legal variants
/// with `pick` (any value; used to vary partial prefetches and backup counts). `None` if nothing
/// is in flight.
pub fn completion_for(state: &RequestState, pick: u32) -> Option<RequestEvent> {
    use RequestEvent as E;
    use RequestState as S;
    Some(match *state {
        S::Querying { .. } => E::QueryDone { hit_pages: pick },
        S::Prefetching { pages, .. } => E::PrefetchDone {
            completed: pick % pages.saturating_add(1).max(1),
        },
        S::Prefilling {
            done, scheduled, ..
        } if scheduled > done => E::PrefillDone,
        S::Decoding {
            in_flight: true, ..
        } => E::DecodeStep,
        S::WritingBack { .. } => E::WriteBackDone {
            success: !pick.is_multiple_of(3),
            backups: if pick % 3 == 1 { pick % 4 } else { 0 },
        },
        S::BackingUp { .. } => E::BackupDone,
        S::Retracting { .. } => E::WriteBackDone {
            success: pick.is_multiple_of(2),
            backups: 0,
        },
        _ => return None,
    })
}
