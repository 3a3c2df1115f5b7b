//! The transition tables, as data.
//!
//! Why: the `apply` functions are the truth the scheduler runs, but a `match` is a poor thing to
//! review, document or reason about as a whole. A table of `(from kind, event kind) → possible
//! target kinds, guard` is what a reader wants, what `docs/fsm.md` prints, and what a test can hold
//! the code to. Keeping both is only safe if they cannot drift, so the crate's tests check, over
//! representative sample states and events ([`crate::RequestStateKind::samples`],
//! [`crate::RequestEventKind::samples`]), that every successful `apply` lands in a kind listed in its row,
//! that every pair without a row is always illegal, and that every listed target is actually
//! reached by some sample (the table does not promise transitions the code never makes).
//!
//! How: one [`Row`] per accepted `(state kind, event kind)` pair, in a `static` slice. `to` lists
//! every kind the transition can land in; `guard` says in words when the event is accepted and
//! which target it picks. Rows appear in state order, then event order; the request table has at
//! most one row per pair.

use crate::op::{OpEventKind, OpState};
use crate::request::{RequestEventKind as E, RequestStateKind as S};

/// One accepted `(state kind, event kind)` pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row<K: 'static, V> {
    /// The state kind the event is applied to.
    pub from: K,
    /// The event kind.
    pub event: V,
    /// Every state kind the transition can land in.
    pub to: &'static [K],
    /// When the event is accepted and which target it picks; `"-"` when always accepted and the
    /// target is unique.
    pub guard: &'static str,
}

/// A row of the request machine's table.
pub type TransitionRow = Row<S, E>;

/// A row of the cache-op machine's table.
pub type OpTransitionRow = Row<OpState, OpEventKind>;

const fn row(from: S, event: E, to: &'static [S], guard: &'static str) -> TransitionRow {
    Row {
        from,
        event,
        to,
        guard,
    }
}

const ABORT_DEFERRED: &str = "abort_pending == false (a second Abort is reported); sets abort_pending, the completion then ends in Aborted";
const ABORT_IMMEDIATE: &str = "nothing in flight; Aborted at once";

static REQUEST_TABLE: &[TransitionRow] = &[
    // Submitted
    row(S::Submitted, E::ScheduleQuery, &[S::Querying], "-"),
    row(
        S::Submitted,
        E::SchedulePrefetch,
        &[S::Prefetching],
        "pages > 0 && start_page + pages fits in u32; the state keeps start_page",
    ),
    row(
        S::Submitted,
        E::ScheduleFirstChunk,
        &[S::Prefilling],
        "tokens > 0 && cached + tokens <= total; done = cached, scheduled = cached + tokens, chunks = 1",
    ),
    row(S::Submitted, E::Abort, &[S::Aborted], ABORT_IMMEDIATE),
    row(S::Submitted, E::Fail, &[S::Failed], "-"),
    // Querying
    row(
        S::Querying,
        E::QueryDone,
        &[S::Submitted, S::Aborted],
        "Aborted if abort_pending, else Submitted",
    ),
    row(S::Querying, E::Abort, &[S::Querying], ABORT_DEFERRED),
    // Prefetching
    row(
        S::Prefetching,
        E::PrefetchDone,
        &[S::PrefetchDone, S::Aborted],
        "completed <= pages (partial success is normal); Aborted if abort_pending, else PrefetchDone { start_page, completed }",
    ),
    row(S::Prefetching, E::Abort, &[S::Prefetching], ABORT_DEFERRED),
    // PrefetchDone
    row(
        S::PrefetchDone,
        E::ScheduleFirstChunk,
        &[S::Prefilling],
        "tokens > 0 && cached + tokens <= total; done = cached, scheduled = cached + tokens, chunks = 1",
    ),
    row(S::PrefetchDone, E::Abort, &[S::Aborted], ABORT_IMMEDIATE),
    row(S::PrefetchDone, E::Fail, &[S::Failed], "-"),
    // Prefilling
    row(
        S::Prefilling,
        E::ScheduleNextChunk,
        &[S::Prefilling],
        "no chunk in flight (scheduled == done) && tokens > 0 && scheduled + tokens <= total; chunks += 1",
    ),
    row(
        S::Prefilling,
        E::PrefillDone,
        &[S::Prefilling, S::Decoding, S::Aborted],
        "chunk in flight; done = scheduled; Aborted if abort_pending, else Decoding { generated: 1 } if done == total, else Prefilling",
    ),
    row(
        S::Prefilling,
        E::Retract,
        &[S::Retracting, S::Retracted],
        "no chunk in flight; Retracting if write_back_pages > 0, else Retracted { saved: false }",
    ),
    row(
        S::Prefilling,
        E::Abort,
        &[S::Prefilling, S::Aborted],
        "chunk in flight: deferred (sets abort_pending; a second Abort is reported); otherwise Aborted at once",
    ),
    row(S::Prefilling, E::Fail, &[S::Failed], "no chunk in flight"),
    // Decoding
    row(
        S::Decoding,
        E::ScheduleDecode,
        &[S::Decoding],
        "!in_flight && generated < u32::MAX; sets in_flight",
    ),
    row(
        S::Decoding,
        E::DecodeStep,
        &[S::Decoding, S::Aborted],
        "in_flight; Aborted if abort_pending, else generated += 1, in_flight = false",
    ),
    row(
        S::Decoding,
        E::Finish,
        &[S::Draining],
        "!in_flight; pages = pages_to_write_back",
    ),
    row(
        S::Decoding,
        E::Retract,
        &[S::Retracting, S::Retracted],
        "!in_flight; Retracting if write_back_pages > 0, else Retracted { saved: false }",
    ),
    row(
        S::Decoding,
        E::Abort,
        &[S::Decoding, S::Aborted],
        "in_flight: deferred (sets abort_pending; a second Abort is reported); otherwise Aborted at once",
    ),
    row(S::Decoding, E::Fail, &[S::Failed], "!in_flight"),
    // Draining
    row(
        S::Draining,
        E::CommitDraining,
        &[S::WritingBack, S::Finished],
        "WritingBack if pages > 0, else Finished",
    ),
    row(S::Draining, E::Abort, &[S::Aborted], ABORT_IMMEDIATE),
    row(S::Draining, E::Fail, &[S::Failed], "-"),
    // WritingBack
    row(
        S::WritingBack,
        E::WriteBackDone,
        &[S::BackingUp, S::Finished, S::Aborted],
        "success || backups == 0; BackingUp { outstanding: backups } (keeping abort_pending) if backups > 0, else Aborted if abort_pending, else Finished",
    ),
    row(S::WritingBack, E::Abort, &[S::WritingBack], ABORT_DEFERRED),
    // BackingUp
    row(
        S::BackingUp,
        E::BackupDone,
        &[S::BackingUp, S::Finished, S::Aborted],
        "outstanding -= 1; at 0: Aborted if abort_pending, else Finished",
    ),
    row(S::BackingUp, E::Abort, &[S::BackingUp], ABORT_DEFERRED),
    // Retracting
    row(
        S::Retracting,
        E::WriteBackDone,
        &[S::Retracted, S::Aborted],
        "backups == 0; Aborted if abort_pending, else Retracted { saved: success }",
    ),
    row(S::Retracting, E::Abort, &[S::Retracting], ABORT_DEFERRED),
    // Retracted
    row(S::Retracted, E::ResumeFromRetracted, &[S::Submitted], "-"),
    row(S::Retracted, E::Abort, &[S::Aborted], ABORT_IMMEDIATE),
    row(S::Retracted, E::Fail, &[S::Failed], "-"),
];

static OP_TABLE: &[OpTransitionRow] = &[
    Row {
        from: OpState::Pending,
        event: OpEventKind::Issue,
        to: &[OpState::Issued],
        guard: "-",
    },
    Row {
        from: OpState::Pending,
        event: OpEventKind::Cancel,
        to: &[OpState::Cancelled],
        guard: "-",
    },
    Row {
        from: OpState::Issued,
        event: OpEventKind::Complete,
        to: &[OpState::Done, OpState::Failed],
        guard: "Done if success, else Failed",
    },
];

/// Every accepted `(state kind, event kind)` pair of the request machine. A pair with no row is
/// always illegal.
pub fn request_table() -> &'static [TransitionRow] {
    REQUEST_TABLE
}

/// Every accepted `(state, event kind)` pair of the cache-op machine. A pair with no row is
/// always illegal; in particular `Cancel` on an `Issued` op.
pub fn op_table() -> &'static [OpTransitionRow] {
    OP_TABLE
}

/// The request table's row for `(from, event)`, if the pair is ever accepted.
pub fn request_row(from: S, event: E) -> Option<&'static TransitionRow> {
    REQUEST_TABLE
        .iter()
        .find(|r| r.from == from && r.event == event)
}

/// The op table's row for `(from, event)`, if the pair is ever accepted.
pub fn op_row(from: OpState, event: OpEventKind) -> Option<&'static OpTransitionRow> {
    OP_TABLE.iter().find(|r| r.from == from && r.event == event)
}
