//! The per-operation state machine for cache operations.
//!
//! Why: every copy between tiers (and every L3 probe) that the scheduler hands to the engine must
//! come back as exactly one completion. Pages involved in an operation stay locked until then;
//! a completion that is lost leaks those locks forever, and a completion that is delivered twice
//! (or after a cancel) unlocks pages that someone else may already hold. Giving each operation
//! its own tiny machine turns both mistakes into typed errors at the point they happen.
//!
//! How: [`OpState`] is `Pending → Issued → Done | Failed`, plus `Pending → Cancelled` for an
//! operation the scheduler drops before handing it to the engine. Once issued, an operation can
//! only leave through [`OpEvent::Complete`]: cancelling an issued operation is refused with
//! [`IllegalReason::AlreadyIssued`], because the engine's copy may already be running. The
//! machine is the same for every [`OpKind`]; [`CacheOp`] pairs a kind with its state. Same
//! `apply` contract as the request machine: an illegal event returns the untouched state.

use serde::{Deserialize, Serialize};
use strum::{Display, EnumDiscriminants, EnumIter, IntoStaticStr};

use crate::error::{IllegalReason, IllegalTransition};

/// A storage tier.
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
    Display,
    IntoStaticStr,
    Serialize,
    Deserialize,
)]
pub enum Tier {
    /// GPU HBM pages.
    Device,
    /// Pinned host DRAM pages.
    Host,
    /// The distributed L3 store (DRAM + SSD).
    L3,
}

/// What a cache operation does.
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
    Display,
    IntoStaticStr,
    Serialize,
    Deserialize,
)]
pub enum OpKind {
    /// Host → device copy.
    LoadBack,
    /// Device → host copy.
    WriteBack,
    /// L3 → host fetch.
    Prefetch,
    /// Host → L3 store.
    BackUp,
    /// L3 existence probe; moves no data and allocates nothing.
    L3Query,
}

impl OpKind {
    /// The tiers data moves between, `(from, to)`; `None` for [`OpKind::L3Query`], which moves
    /// nothing.
    pub const fn route(self) -> Option<(Tier, Tier)> {
        match self {
            Self::LoadBack => Some((Tier::Host, Tier::Device)),
            Self::WriteBack => Some((Tier::Device, Tier::Host)),
            Self::Prefetch => Some((Tier::L3, Tier::Host)),
            Self::BackUp => Some((Tier::Host, Tier::L3)),
            Self::L3Query => None,
        }
    }
}

/// Where a cache operation is in its life.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    EnumIter,
    Display,
    IntoStaticStr,
    Serialize,
    Deserialize,
)]
pub enum OpState {
    /// Created by the scheduler, not yet handed to the engine.
    #[default]
    Pending,
    /// Handed to the engine; exactly one completion is owed.
    Issued,
    /// Terminal: completed successfully.
    Done,
    /// Terminal: completed unsuccessfully.
    Failed,
    /// Terminal: dropped before it was issued.
    Cancelled,
}

/// What can happen to a cache operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, EnumDiscriminants)]
#[strum_discriminants(name(OpEventKind))]
#[strum_discriminants(doc = "The field-less kind of an [`OpEvent`], for tables, maps and logs.")]
#[strum_discriminants(derive(
    EnumIter,
    Display,
    IntoStaticStr,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize
))]
pub enum OpEvent {
    /// The operation was handed to the engine. `Pending → Issued`.
    Issue,
    /// The engine reports the operation's one completion. `Issued → Done | Failed`.
    Complete {
        /// `Done` if true, `Failed` otherwise.
        success: bool,
    },
    /// Drop an operation that was never issued. `Pending → Cancelled` only.
    Cancel,
}

impl OpEvent {
    /// The event's field-less kind.
    pub fn kind(&self) -> OpEventKind {
        self.into()
    }
}

impl OpEventKind {
    /// Representative events of this kind.
    pub fn samples(self) -> Vec<OpEvent> {
        match self {
            Self::Issue => vec![OpEvent::Issue],
            Self::Complete => vec![
                OpEvent::Complete { success: true },
                OpEvent::Complete { success: false },
            ],
            Self::Cancel => vec![OpEvent::Cancel],
        }
    }
}

impl OpState {
    /// `Done`, `Failed` or `Cancelled`.
    pub const fn is_terminal(self) -> bool {
        matches!(self, Self::Done | Self::Failed | Self::Cancelled)
    }

    /// `Issued`: a completion is owed by the engine.
    pub const fn is_outstanding(self) -> bool {
        matches!(self, Self::Issued)
    }

    /// The whole transition function: the next state, or why `event` is illegal here.
    pub const fn next_state(self, event: OpEvent) -> Result<OpState, IllegalReason> {
        match (self, event) {
            (Self::Done | Self::Failed | Self::Cancelled, _) => Err(IllegalReason::Terminal),
            (Self::Pending, OpEvent::Issue) => Ok(Self::Issued),
            (Self::Pending, OpEvent::Cancel) => Ok(Self::Cancelled),
            (Self::Pending, OpEvent::Complete { .. }) => Err(IllegalReason::NothingInFlight),
            (Self::Issued, OpEvent::Complete { success: true }) => Ok(Self::Done),
            (Self::Issued, OpEvent::Complete { success: false }) => Ok(Self::Failed),
            (Self::Issued, OpEvent::Cancel) => Err(IllegalReason::AlreadyIssued),
            (Self::Issued, OpEvent::Issue) => Err(IllegalReason::InFlight),
        }
    }

    /// Applies `event`; on failure the error holds this state, unchanged.
    pub fn apply(self, event: OpEvent) -> Result<OpState, IllegalTransition<OpState, OpEvent>> {
        self.next_state(event).map_err(|reason| IllegalTransition {
            state: self,
            event,
            reason,
        })
    }

    /// Applies `event` in place; on failure `self` is left as it was.
    pub fn apply_mut(&mut self, event: OpEvent) -> Result<(), IllegalTransition<OpState, OpEvent>> {
        *self = self.apply(event)?;
        Ok(())
    }
}

/// A cache operation's kind together with its state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CacheOp {
    /// What the operation does.
    pub kind: OpKind,
    /// Where it is in its life.
    pub state: OpState,
}

impl CacheOp {
    /// A new, pending operation of `kind`.
    pub const fn new(kind: OpKind) -> Self {
        Self {
            kind,
            state: OpState::Pending,
        }
    }

    /// Applies `event` to the state; on failure the error holds this operation, unchanged.
    pub fn apply(self, event: OpEvent) -> Result<CacheOp, IllegalTransition<CacheOp, OpEvent>> {
        match self.state.next_state(event) {
            Ok(state) => Ok(Self {
                kind: self.kind,
                state,
            }),
            Err(reason) => Err(IllegalTransition {
                state: self,
                event,
                reason,
            }),
        }
    }

    /// Applies `event` in place; on failure `self` is left as it was.
    pub fn apply_mut(&mut self, event: OpEvent) -> Result<(), IllegalTransition<CacheOp, OpEvent>> {
        *self = self.apply(event)?;
        Ok(())
    }

    /// Whether the operation is terminal (`Done`, `Failed` or `Cancelled`).
    pub const fn is_terminal(&self) -> bool {
        self.state.is_terminal()
    }
}
