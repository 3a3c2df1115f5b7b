//! What goes into the scheduler (requests, events) and what comes out (execution plans).
//!
//! Why these shapes: the plan is consumed every step by an engine loop that is often Python,
//! so it carries no per-page objects beyond plain id vectors, and page tables travel as
//! *deltas* (what changed since the last plan for that request), not as whole lists every
//! step. Every cache op carries an [`OpId`]; the engine answers each with exactly one
//! completion [`Event`] of the matching kind.

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use kvtier_fsm::OpKind;
use kvtier_radix::{DevicePageId, ExtraKey, HostPageId};

/// The engine's id for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// A cache operation's id, assigned by the scheduler in increasing order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OpId(pub u64);

/// A forward batch's id, assigned by the scheduler in increasing order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StepId(pub u64);

/// A new request.
///
/// `cache_salt`, `adapter` and `extra_keys` scope the request's KV: two requests share a
/// cached page (on any tier, and in L3) only if their tokens, salt, adapter and the extra keys
/// of the whole prefix up to that page are equal (see [`kvtier_radix::HashScope`]). A request
/// with none of them set shares with every other unscoped request, under SGLang-compatible
/// page keys.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestSpec {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    /// Generation stops after this many new tokens (or earlier, when the engine says so).
    pub max_new_tokens: u32,
    /// Per-request (per-tenant) salt, as vLLM's `cache_salt`: requests of different salts
    /// never share KV, so one tenant cannot learn from its latency what another sent.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// The adapter (e.g. LoRA) the request runs with: its KV differs from the base model's.
    #[serde(default)]
    pub adapter: Option<String>,
    /// Multimodal spans: `(start, end, digest)` of placeholder tokens whose KV depends on the
    /// content `digest` names (an image's hash); `start < end ≤ prompt length`.
    #[serde(default)]
    pub extra_keys: Vec<ExtraKey>,
}

impl RequestSpec {
    /// An unscoped request (no salt, adapter or extra keys).
    pub fn new(id: RequestId, prompt: Vec<u32>, max_new_tokens: u32) -> RequestSpec {
        RequestSpec {
            id,
            prompt,
            max_new_tokens,
            cache_salt: None,
            adapter: None,
            extra_keys: Vec::new(),
        }
    }

    /// The same request under a cache salt.
    pub fn with_salt(mut self, salt: impl Into<String>) -> RequestSpec {
        self.cache_salt = Some(salt.into());
        self
    }

    /// The same request with an adapter.
    pub fn with_adapter(mut self, adapter: impl Into<String>) -> RequestSpec {
        self.adapter = Some(adapter.into());
        self
    }
}

/// One token produced by a forward row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenOutput {
    pub req: RequestId,
    pub token: u32,
    /// The engine saw a stop condition (EOS, stop string): the request finishes after this token.
    pub stop: bool,
}

/// Completions reported by the engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// An `L3Query` came back: `hit_pages` consecutive keys, from the first, exist in L3.
    L3QueryDone {
        op: OpId,
        hit_pages: u32,
    },
    /// A `Prefetch` came back: the first `completed` pages arrived (partial success is normal).
    PrefetchDone {
        op: OpId,
        completed: u32,
    },
    LoadBackDone {
        op: OpId,
        success: bool,
    },
    WriteBackDone {
        op: OpId,
        success: bool,
    },
    BackUpDone {
        op: OpId,
        success: bool,
    },
    /// A forward batch ran. Prefill rows that complete a request's prompt and all decode rows
    /// produce a token; rows of non-final prefill chunks are listed with any token (ignored).
    ForwardDone {
        step: StepId,
        outputs: Vec<TokenOutput>,
    },
}

impl Event {
    /// The op kind a completion claims to complete (`None` for forward results).
    pub fn op_kind(&self) -> Option<(OpId, OpKind)> {
        match *self {
            Event::L3QueryDone { op, .. } => Some((op, OpKind::L3Query)),
            Event::PrefetchDone { op, .. } => Some((op, OpKind::Prefetch)),
            Event::LoadBackDone { op, .. } => Some((op, OpKind::LoadBack)),
            Event::WriteBackDone { op, .. } => Some((op, OpKind::WriteBack)),
            Event::BackUpDone { op, .. } => Some((op, OpKind::BackUp)),
            Event::ForwardDone { .. } => None,
        }
    }
}

/// Page ids on the tier an op reads or writes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TierPages {
    Device(Vec<DevicePageId>),
    Host(Vec<HostPageId>),
}

impl TierPages {
    pub fn len(&self) -> usize {
        match self {
            TierPages::Device(p) => p.len(),
            TierPages::Host(p) => p.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a cache op moves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OpSpec {
    /// Which of `keys` exist in L3? No memory is allocated. Answer: the number of leading keys
    /// that exist.
    L3Query { keys: Vec<String> },
    /// L3 → `dst` (host pages, or device pages when the host tier is disabled), key `i` into
    /// page `i`. Answer: how many leading pages arrived.
    Prefetch { keys: Vec<String>, dst: TierPages },
    /// Host → device, page `i` of `src` into page `i` of `dst`.
    LoadBack {
        src: Vec<HostPageId>,
        dst: Vec<DevicePageId>,
    },
    /// Device → host, page `i` of `src` into page `i` of `dst`.
    WriteBack {
        src: Vec<DevicePageId>,
        dst: Vec<HostPageId>,
    },
    /// `src` (host pages, or device pages without a host tier) → L3 under `keys`.
    BackUp { keys: Vec<String>, src: TierPages },
}

/// One cache op of a plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedOp {
    pub id: OpId,
    pub kind: OpKind,
    /// The request the op serves, if any (write-back-policy backups serve the cache).
    pub req: Option<RequestId>,
    /// The forward of this plan reads what this op writes: run it (and wait) first.
    pub before_forward: bool,
    pub spec: OpSpec,
}

/// A change to a request's device page table: entries from index `from` on are replaced by
/// `pages` (the table's new length is `from + pages.len()`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageTableDelta {
    pub from: u32,
    pub pages: Vec<DevicePageId>,
}

/// A prefill chunk: compute tokens `start .. start + len` of the request's sequence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillChunk {
    pub req: RequestId,
    pub start: u32,
    pub len: u32,
    /// This chunk ends the prompt (its row yields the first new token).
    pub last: bool,
    pub table: Option<PageTableDelta>,
    /// The tokens of this chunk.
    pub tokens: Vec<u32>,
    /// Ops that write pages this chunk reads; they complete before the forward's result.
    pub waits_for: SmallVec<[OpId; 1]>,
}

/// A decode row: one token at `position` (the request's sequence length before this step).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeRow {
    pub req: RequestId,
    pub position: u32,
    pub table: Option<PageTableDelta>,
}

/// One forward batch.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardBatch {
    pub step: Option<StepId>,
    pub prefill: Vec<PrefillChunk>,
    pub decode: Vec<DecodeRow>,
}

impl ForwardBatch {
    pub fn is_empty(&self) -> bool {
        self.prefill.is_empty() && self.decode.is_empty()
    }
    pub fn rows(&self) -> usize {
        self.prefill.len() + self.decode.len()
    }
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Finished,
    Aborted,
    Failed,
}

/// What the engine should do this step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecutionPlan {
    /// Cache ops to start now (those with `before_forward` must finish before the forward).
    pub ops: Vec<PlannedOp>,
    /// In-flight prefetches to stop now: report what has arrived with `PrefetchDone`.
    pub terminate_prefetch: Vec<OpId>,
    /// The forward batch (`step` is `None` when there is nothing to compute).
    pub forward: ForwardBatch,
    /// Requests that reached a terminal state since the last plan; their page tables are void.
    pub ended: Vec<(RequestId, Outcome)>,
    /// Requests preempted since the last plan: their page tables are void; they will be sent
    /// again, from index 0, when they resume.
    pub retracted: Vec<RequestId>,
}
