//! Everything the engine can get wrong when it talks to the scheduler.
//!
//! Why: the engine's events arrive from other threads, processes and RPCs; duplicates, late
//! arrivals and mix-ups happen in production. Each is a [`SchedulerError`] value, returned
//! *before* anything is changed, so the caller can log it and carry on with a scheduler whose
//! state is exactly what it was.

use kvtier_fsm::{IllegalReason, OpKind, RequestEventKind, RequestStateKind};
use kvtier_radix::RadixError;
use thiserror::Error;

use crate::types::{OpId, RequestId, StepId};

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SchedulerError {
    #[error("unknown request {0:?}")]
    UnknownRequest(RequestId),
    #[error("request id {0:?} is already live")]
    DuplicateRequest(RequestId),
    #[error("empty prompt")]
    EmptyPrompt,
    #[error("max_new_tokens must be at least 1")]
    ZeroMaxNewTokens,
    #[error("request of {tokens} tokens exceeds max_context_tokens {max}")]
    TooLong { tokens: usize, max: usize },
    #[error(
        "extra key {index} spans tokens {start}..{end}, outside the prompt of {prompt_len} tokens (or empty)"
    )]
    BadExtraKey {
        index: usize,
        start: u32,
        end: u32,
        prompt_len: usize,
    },
    #[error(
        "request needs up to {pages} device pages, more than its tenant's device quota of {quota}"
    )]
    ExceedsTenantQuota { pages: usize, quota: u32 },
    #[error("unknown op {0:?}")]
    UnknownOp(OpId),
    #[error("op {0:?} already completed (duplicated or late completion)")]
    DuplicateCompletion(OpId),
    #[error("op {op:?} is a {actual} op, not {claimed}")]
    WrongCompletionKind {
        op: OpId,
        actual: OpKind,
        claimed: OpKind,
    },
    #[error("{what} for op {op:?}: {detail}")]
    BadCompletion {
        op: OpId,
        what: &'static str,
        detail: String,
    },
    #[error("unknown or already completed forward step {0:?}")]
    UnknownStep(StepId),
    #[error("forward result for {req:?}, which is not in step {step:?}")]
    NotInStep { step: StepId, req: RequestId },
    #[error("forward results of step {step:?} list {got} rows, the step had {expected}")]
    RowCountMismatch {
        step: StepId,
        expected: usize,
        got: usize,
    },
    #[error("forward step {step:?} completed before op {op:?} it waits for")]
    CompletionOutOfOrder { step: StepId, op: OpId },
    #[error("{event} is illegal for request {req:?} in state {state}: {reason}")]
    IllegalEvent {
        req: RequestId,
        state: RequestStateKind,
        event: RequestEventKind,
        reason: IllegalReason,
    },
    #[error("forward result of step {0:?} in a batch of op completions (report it with on_event)")]
    NotAnOpCompletion(StepId),
    #[error("cache: {0}")]
    Cache(#[from] RadixError),
    /// A direct loss report (`l3_lost`, `l3_lost_all`, `l3_lost_pages`) on a scheduler that
    /// is one rank of several (`SchedulerConfig::tp_ranks` > 1): applied on this rank alone
    /// it would make the ranks' plans diverge. Nothing changed.
    #[error(
        "this scheduler is rank {rank} of {tp_ranks} tensor-parallel ranks: a loss applied on one rank alone makes the ranks' plans diverge; record it with RankAgreement::lost (lost_all, lost_pages) and apply it on every rank with RankAgreement::agree_losses"
    )]
    LossNeedsAgreement { rank: u32, tp_ranks: u32 },
}
