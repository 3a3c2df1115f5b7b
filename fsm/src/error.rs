//! The one error both machines return: an event that is not allowed in the current state.
//!
//! Why: the scheduler feeds the machines events that come from the engine (completions) and from
//! its own decisions (schedule, retract, abort). A bug on either side — a duplicated completion, an
//! abort racing a finish, a chunk scheduled twice — must surface as a typed, inspectable error, and
//! the state it happened in must survive: a machine that panics takes the engine down, and a
//! machine that swallows the state loses the request (and whatever pages it holds).
//!
//! How: [`IllegalTransition`] is generic over the state and event types and carries the state
//! exactly as it was before the event (the caller gets it back by value), the rejected event, and
//! an [`IllegalReason`] that names which rule said no. The reason is a small `Copy` enum rather
//! than a string so callers can match on it (for example to tell a duplicated abort apart from a
//! genuinely misplaced event).

use std::fmt::Debug;

use serde::{Deserialize, Serialize};
use strum::{EnumIter, IntoStaticStr};

/// Why a transition was refused.
///
/// The `Display` text is a short sentence fragment meant for logs; the variant name (via
/// [`IntoStaticStr`]) is stable and meant for metrics labels.
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
    IntoStaticStr,
    Serialize,
    Deserialize,
    thiserror::Error,
)]
pub enum IllegalReason {
    /// The state is terminal; terminal states absorb every event.
    #[error("the state is terminal")]
    Terminal,
    /// No transition table row exists for this state kind and event kind.
    #[error("the event is not accepted in this state")]
    NotAccepted,
    /// The state's own data breaks an invariant (for example `done > scheduled`, or
    /// `abort_pending` with nothing in flight); such a state can only come from outside the
    /// machine (hand construction, deserialization), and nothing is applied to it.
    #[error("the state's data is inconsistent")]
    InconsistentState,
    /// An operation (query, prefetch, chunk, decode step, write-back, backup) is in flight and
    /// the event needs it to have completed first.
    #[error("an operation is in flight")]
    InFlight,
    /// The event is a completion, but nothing it could complete is in flight.
    #[error("nothing is in flight to complete")]
    NothingInFlight,
    /// An abort is already pending; a second abort is reported, not merged.
    #[error("an abort is already pending")]
    AbortAlreadyPending,
    /// A count that must be positive (pages, tokens) is zero.
    #[error("a page or token count is zero")]
    Zero,
    /// A count exceeds its bound (tokens beyond the prompt, more completed pages than requested).
    #[error("a count exceeds its bound")]
    ExceedsBound,
    /// Prefill already covers the whole prompt; there is no next chunk to schedule.
    #[error("prefill already covers the whole prompt")]
    PrefillComplete,
    /// The event's fields contradict each other (for example backups after a failed write-back).
    #[error("the event's fields are contradictory")]
    ContradictoryEvent,
    /// A counter would overflow `u32`.
    #[error("a counter would overflow")]
    Overflow,
    /// An operation that has been issued cannot be cancelled; it must come back through exactly
    /// one completion.
    #[error("an issued operation must complete, not be cancelled")]
    AlreadyIssued,
}

/// An event that the machine refused, with the state exactly as it was before the event.
///
/// Never constructed with a modified state: `err.state == before` is a tested property of both
/// machines.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("illegal transition: {event:?} in state {state:?}: {reason}")]
pub struct IllegalTransition<S, E> {
    /// The untouched state the event was applied to.
    pub state: S,
    /// The rejected event.
    pub event: E,
    /// Which rule refused it.
    pub reason: IllegalReason,
}

impl<S, E> IllegalTransition<S, E> {
    /// Gives back the untouched state, dropping the event and the reason.
    pub fn into_state(self) -> S {
        self.state
    }
}
