//! Explicit state machines for kvtier requests and cache operations.
//!
//! Why: the scheduler juggles requests whose KV pages move between device, host and L3 while
//! forward passes and copies are in flight. The bugs that hurt in such a scheduler are ordering
//! bugs — an abort that frees pages a copy is still writing, a completion delivered twice, a
//! chunk scheduled while the previous one runs, a backup whose source pages were reused. Encoding
//! each request's and each operation's life as an explicit machine turns those into typed errors
//! at the exact event that is wrong, instead of corrupted KV discovered much later.
//!
//! How:
//! - [`RequestState`] / [`RequestEvent`]: the request machine ([`request`]). Variants carry their
//!   own data; `strum` derives [`RequestStateKind`] and [`RequestEventKind`].
//! - [`OpState`] / [`OpEvent`] / [`CacheOp`]: the cache-operation machine ([`op`]), for the
//!   [`OpKind`]s `LoadBack`, `WriteBack`, `Prefetch`, `BackUp` and `L3Query`.
//! - Both expose `apply(self, event) -> Result<Self, IllegalTransition<Self, Event>>`: an illegal
//!   event returns the untouched state inside the error, with an [`IllegalReason`] ([`error`]).
//!   Nothing here panics.
//! - [`table`] holds both transition tables as data; tests check the code against them, and
//!   [`render_markdown`] turns them into `docs/fsm.md` ([`doc`]).
//!
//! ```
//! use kvtier_fsm::{RequestEvent as E, RequestState, RequestStateKind};
//!
//! let s = RequestState::new()
//!     .apply(E::ScheduleFirstChunk { total: 8, cached: 0, tokens: 8 })?
//!     .apply(E::PrefillDone)?;
//! assert_eq!(s.kind(), RequestStateKind::Decoding);
//!
//! // An illegal event hands the state back untouched.
//! let err = s.clone().apply(E::PrefillDone).unwrap_err();
//! assert_eq!(err.state, s);
//! # Ok::<(), kvtier_fsm::IllegalTransition<RequestState, E>>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects
    )
)]

pub mod doc;
pub mod error;
pub mod op;
pub mod request;
pub mod table;

pub use doc::render_markdown;
pub use error::{IllegalReason, IllegalTransition};
pub use op::{CacheOp, OpEvent, OpEventKind, OpKind, OpState, Tier};
pub use request::{FailReason, RequestEvent, RequestEventKind, RequestState, RequestStateKind};
pub use table::{
    OpTransitionRow, Row, TransitionRow, op_row, op_table, request_row, request_table,
};

/// The error of the request machine.
pub type RequestTransitionError = IllegalTransition<RequestState, RequestEvent>;

/// The error of the cache-op machine.
pub type OpTransitionError = IllegalTransition<OpState, OpEvent>;
