//! Tensor-parallel agreement: every rank's scheduler must produce the same plan every step.
//!
//! Why this needs help from the engine: each tensor-parallel rank runs its own scheduler over
//! its own shard of the KV, and its own L3 keys (suffixed by rank). Completions that report what
//! L3 held — `L3QueryDone.hit_pages`, `PrefetchDone.completed`, `BackUpDone.success` — and even
//! whether a local copy succeeded can differ between ranks (rank 1's shard of a page was
//! evicted, rank 0's was not). Fed as they are, the schedulers diverge: different prefix
//! lengths, different forward shapes, a collective that hangs or mixes garbage. SGLang
//! all-reduces the minimum hit length across the group for this reason.
//!
//! The contract: **the engine feeds every rank's scheduler the same completions, reduced across
//! ranks**: the minimum of `hit_pages` and of `completed`, the conjunction of every `success`,
//! and only once *every* rank has completed the op. [`RankAgreement`] does that with one
//! reduction per step: one `u64` per op in flight (0 while this rank has not finished it, else
//! the value plus one; a rank that does not run an op contributes [`SKIPPED`]), the
//! element-wise minimum across ranks (e.g. one `torch.distributed.all_reduce(MIN)` of an int64
//! tensor), decoded back into events. Ops in flight are identical on every rank because the
//! plans are, so the vectors line up.
//!
//! An agreed event is exactly one every rank reported (or skipped), of the op's kind: `push`
//! does not know the op, so a reduction checks this rank's records against the ops in flight
//! first. A completion of another kind than its op's, or a count above the op's, makes every
//! value "not done" in [`RankAgreement::values`] (no rank agrees anything that step: the
//! refusing rank applies nothing, and the ranks must not part ways) and is a typed error
//! ([`AgreementError::WrongKind`], [`AgreementError::TooMany`]) that changes nothing, raised
//! after the collective (a rank that left it would leave the others waiting in it, or pair
//! their all-reduce with its next one); a record of an op not in flight is dropped ([`RankAgreement::dropped`]), so it
//! cannot answer a later op of that id. [`RankAgreement::push_checked`] refuses all of them
//! at the push.
//!
//! L3 *losses* need the same agreement (one rank's store lost a page, the others' did not):
//! see `agreed_losses.rs` ([`RankAgreement::lost`], [`RankAgreement::agree_losses`]); so do
//! the offloading manager's L3 *finds* (one rank's probe found its shard, another's did not):
//! `agreed_finds.rs` ([`RankAgreement::found_pages`], [`RankAgreement::agree_found`]).
//!
//! What is agreed is any [`AgreedOps`]: the [`Scheduler`] (its L3 queries, prefetches, loads,
//! write-backs and backups) or the offloading-manager mode's [`crate::OffloadManager`] (its
//! prefetches and backups; the engine counts its own workers' device↔host copies), whose plan
//! is likewise the same for every rank's shard.
//!
//! [`ExecutionPlan::digest`] is a cheap, rank-independent fingerprint of a plan (L3 keys are
//! hashed without their rank suffix) for a debug mode that all-gathers it and stops at the
//! first step where ranks disagree.
//!
//! For MLA models the latent KV is the same on every rank: with
//! [`L3Sharing::Replicated`](crate::L3Sharing) all ranks use the leader's keys, only the leader
//! runs `L3Query` and `BackUp` ([`crate::Scheduler::runs_here`]), and the others mark those ops
//! [`RankAgreement::skip`], so the reduction broadcasts the leader's answer.

use std::collections::BTreeMap;
use std::hash::Hasher;

use kvtier_fsm::OpKind;
use thiserror::Error;

use crate::ops::{OpCtx, PrefetchDst};
use crate::scheduler::Scheduler;
use crate::types::*;

/// A completion the agreement cannot take.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum AgreementError {
    #[error("forward results are not reduced (every rank computes the same tokens)")]
    Forward,
    #[error("op {0:?} was already recorded this round")]
    Duplicate(OpId),
    /// This rank recorded a completion of another kind than its op's (the engine answered the
    /// op with the wrong event). This rank's values are all "not done", so no rank agrees
    /// anything that step; [`RankAgreement::reduce`] refuses after the collective (entered,
    /// so that no rank waits in it).
    #[error(
        "op {op:?} is of kind {kind:?}, but this rank recorded a completion of kind {claimed:?} for it: refused, nothing agreed or consumed (answer each op with its own kind's completion)"
    )]
    WrongKind {
        op: OpId,
        kind: OpKind,
        claimed: OpKind,
    },
    /// This rank recorded a count above what its op asked for (more hit pages than the L3
    /// query probed, more pages than the prefetch reads): refused like [`Self::WrongKind`].
    #[error(
        "this rank recorded {got} for {kind:?} op {op:?}, which asked for at most {most}: refused, nothing agreed or consumed"
    )]
    TooMany {
        op: OpId,
        kind: OpKind,
        got: u32,
        most: u32,
    },
    /// This rank skipped an op it runs itself ([`AgreedOps::runs_here`]): a skip says another
    /// rank answers for all, and the others would then agree that rank's answer for this
    /// rank's shard (pages it never read, counted as landed). Refused like
    /// [`Self::WrongKind`] (by [`RankAgreement::skip_checked`] at once).
    #[error(
        "this rank runs {kind:?} op {op:?} itself (runs_here): it must answer it with its own completion, not skip it; refused, nothing agreed or consumed"
    )]
    MustRun { op: OpId, kind: OpKind },
    /// A checked push ([`RankAgreement::push_checked`], [`RankAgreement::skip_checked`]) for
    /// an op that is not in flight: agreed already, or not issued yet.
    #[error(
        "op {0:?} is not in flight (agreed already, or not issued yet): its completion is refused"
    )]
    NotInFlight(OpId),
    #[error("reduced vector has {got} values, {expected} ops are in flight")]
    Length { expected: usize, got: usize },
    /// The reduction is not a minimum (a SUM or MAX all-reduce configured by mistake): a
    /// value exceeds this rank's own, e.g. it completes an op this rank has not finished.
    #[error(
        "reduced value {reduced} for op {op:?} is above this rank's own {own}: not the minimum over ranks (reduce with MIN)"
    )]
    NotMinimum { op: OpId, own: u64, reduced: u64 },
    #[error("loss words of rank {rank}: {why}")]
    BadLossWords { rank: usize, why: &'static str },
    #[error("the gathered losses leave out losses this rank recorded (its own words are missing)")]
    OwnLossesMissing,
    #[error("found words of rank {rank}: {why}")]
    BadFoundWords { rank: usize, why: &'static str },
    /// No rank's gathered found words are the words this rank sent (`agreed_finds.rs`): the
    /// engine's all-gather left this rank out, or passed another round's words.
    #[error(
        "the gathered finds leave out this rank's own words (no rank's words are the ones it sent)"
    )]
    OwnFindsMissing,
    /// The all-gather returned another number of ranks' words than the scheduler's group
    /// holds: the engine's all-gather is not over the whole group, or the scheduler was not
    /// told it is one rank of several (`SchedulerConfig::tp_ranks`, the offloading manager's
    /// `set_tp_ranks`), and would accept direct loss reports that diverge the ranks.
    #[error(
        "gathered the words of {got} ranks, but the scheduler plans for {tp_ranks} (tp_ranks): all-gather over the whole tensor-parallel group and set tp_ranks to its size"
    )]
    RankCount { got: usize, tp_ranks: u32 },
    /// The offloading manager refused an agreed completion (its job was no longer in flight
    /// there). The other agreed completions were applied and every rank's agreement consumed
    /// this one: it is reported, not dropped, because its job's pins stay until it ends.
    #[error("the offloading manager refused an agreed completion: {0}")]
    Refused(crate::offload::OffloadError),
}

/// Proof that L3 losses are being applied by the agreement: only this crate makes one, so
/// [`AgreedOps::forget_l3_pages`] and [`AgreedOps::forget_l3_all`] cannot be called around
/// [`RankAgreement::agree_losses`] (a loss applied on one rank alone diverges the ranks).
#[derive(Debug)]
pub struct AgreedLosses(());

impl AgreedLosses {
    pub(crate) fn new() -> AgreedLosses {
        AgreedLosses(())
    }
}

/// What ranks agree on: a planner whose ops in flight are the same on every rank (because its
/// plans are), and which forgets agreed L3 losses.
pub trait AgreedOps {
    /// The ops in flight whose completions ranks reduce, in op-id order.
    fn agreed_ops(&self) -> Vec<(OpId, OpKind)>;
    /// The number of ranks that plan together (1: a single rank): how many ranks' loss words
    /// an agreement must gather.
    fn tp_ranks(&self) -> u32;
    /// Clears the "in L3" marks of `pages` (the union every rank agreed); the number of marks
    /// cleared.
    fn forget_l3_pages(&mut self, pages: &[kvtier_radix::PageHash], _: AgreedLosses) -> usize;
    /// Clears every "in L3" mark (a rank's loss report overflowed); the number cleared.
    fn forget_l3_all(&mut self, _: AgreedLosses) -> usize;
    /// The most a completion of `op` (in flight) may count: the keys an L3 query probed, the
    /// pages a prefetch reads. `None`: no bound (a success flag, or a planner that takes any
    /// count). A rank's record above it is refused ([`AgreementError::TooMany`]) before it is
    /// consumed, and enters the collective as "not done".
    fn max_count(&self, _op: OpId) -> Option<u32> {
        None
    }
    /// Whether this rank runs ops of `kind` itself (and so must answer them): every rank
    /// runs every op unless a leader answers for all (`Scheduler::runs_here`: an MLA model's
    /// replicated L3 keys). Only an op that does not run here may be skipped.
    fn runs_here(&self, _kind: OpKind) -> bool {
        true
    }
}

impl AgreedOps for Scheduler {
    fn agreed_ops(&self) -> Vec<(OpId, OpKind)> {
        self.in_flight_ops()
    }
    fn tp_ranks(&self) -> u32 {
        self.config().tp_ranks
    }
    fn runs_here(&self, kind: OpKind) -> bool {
        Scheduler::runs_here(self, kind)
    }
    fn forget_l3_pages(&mut self, pages: &[kvtier_radix::PageHash], _: AgreedLosses) -> usize {
        self.forget_l3_agreed(pages)
    }
    fn forget_l3_all(&mut self, _: AgreedLosses) -> usize {
        self.forget_l3_all_marks()
    }
    fn max_count(&self, op: OpId) -> Option<u32> {
        let n = match &self.ops.get(&op)?.ctx {
            OpCtx::Query { n, .. } => *n,
            OpCtx::Prefetch { dst, .. } => match dst {
                PrefetchDst::Host(p, _) => p.len(),
                PrefetchDst::Device(p, _) => p.len(),
            },
            _ => return None,
        };
        Some(u32::try_from(n).unwrap_or(u32::MAX))
    }
}

/// One rank's completions of a step, waiting to be reduced with the other ranks'.
#[derive(Clone, Debug, Default)]
pub struct RankAgreement {
    done: BTreeMap<OpId, Slot>,
    /// Pages this rank's store reported lost, not yet agreed (`agreed_losses.rs`).
    pub(crate) lost: std::collections::BTreeSet<kvtier_radix::PageHash>,
    /// This rank's loss report overflowed, not yet agreed.
    pub(crate) lost_all: bool,
    /// What the last `loss_words` sent, `(overflowed, pages)`: what the next `apply_losses`
    /// checks against the union and consumes. Losses recorded after it (another thread's
    /// `lost` while the words are gathered) wait for the next round.
    pub(crate) sent_losses: Option<(bool, std::collections::BTreeSet<kvtier_radix::PageHash>)>,
    /// Pages this rank's L3 probe found, not yet agreed (`agreed_finds.rs`).
    pub(crate) found: std::collections::BTreeSet<kvtier_radix::PageHash>,
    /// What the last `found_words` sent: what the next `apply_found` checks and consumes.
    pub(crate) sent_found: Option<std::collections::BTreeSet<kvtier_radix::PageHash>>,
    /// Records dropped by a reduction because their op was not in flight.
    dropped: u64,
}

#[derive(Clone, Debug)]
enum Slot {
    Done(Event),
    Skipped,
}

/// Identity of the minimum: a rank that does not run an op. `i64::MAX`, so that the values
/// reduce the same as signed 64-bit integers (what `torch.distributed` reduces).
pub const SKIPPED: u64 = i64::MAX as u64;

fn encode(ev: &Event) -> u64 {
    match *ev {
        Event::L3QueryDone { hit_pages, .. } => hit_pages as u64 + 1,
        Event::PrefetchDone { completed, .. } => completed as u64 + 1,
        Event::LoadBackDone { success, .. }
        | Event::WriteBackDone { success, .. }
        | Event::BackUpDone { success, .. } => success as u64 + 1,
        Event::ForwardDone { .. } => 0,
    }
}

fn decode(op: OpId, kind: OpKind, v: u64) -> Event {
    let n = (v - 1).min(u32::MAX as u64) as u32;
    let success = v >= 2;
    match kind {
        OpKind::L3Query => Event::L3QueryDone { op, hit_pages: n },
        OpKind::Prefetch => Event::PrefetchDone { op, completed: n },
        OpKind::LoadBack => Event::LoadBackDone { op, success },
        OpKind::WriteBack => Event::WriteBackDone { op, success },
        OpKind::BackUp => Event::BackUpDone { op, success },
    }
}

/// Why this rank's completion `ev` cannot complete `op` (of `kind`, in flight in `sched`): a
/// completion of another kind, or a count above the op's.
fn refusal<S: AgreedOps + ?Sized>(
    sched: &S,
    op: OpId,
    kind: OpKind,
    ev: &Event,
) -> Option<AgreementError> {
    let (_, claimed) = ev.op_kind()?;
    if claimed != kind {
        return Some(AgreementError::WrongKind { op, kind, claimed });
    }
    let got = match *ev {
        Event::L3QueryDone { hit_pages, .. } => hit_pages,
        Event::PrefetchDone { completed, .. } => completed,
        _ => return None,
    };
    match sched.max_count(op) {
        Some(most) if got > most => Some(AgreementError::TooMany {
            op,
            kind,
            got,
            most,
        }),
        _ => None,
    }
}

impl RankAgreement {
    pub fn new() -> RankAgreement {
        RankAgreement::default()
    }

    /// Records this rank's completion of an op (held until every rank completed it). The op's
    /// kind and whether it is in flight are not known here: a completion of another kind or
    /// above the op's count is refused by the reduction ([`AgreementError::WrongKind`],
    /// [`AgreementError::TooMany`]), and a completion of an op that is not in flight then is
    /// dropped ([`Self::dropped`]). [`Self::push_checked`] refuses both at once.
    pub fn push(&mut self, ev: Event) -> Result<(), AgreementError> {
        let (op, _) = ev.op_kind().ok_or(AgreementError::Forward)?;
        if self.done.contains_key(&op) {
            return Err(AgreementError::Duplicate(op));
        }
        self.done.insert(op, Slot::Done(ev));
        Ok(())
    }

    /// [`Self::push`], checked against `sched` first: refused, and nothing recorded, unless
    /// `ev` completes an op in flight there ([`AgreementError::NotInFlight`]: agreed already,
    /// or not issued yet), of its kind and within its count. Only this closes the gap that a
    /// completion pushed for an op id before that op is issued (ids are sequential) would,
    /// unchecked, answer the op once issued, if no reduction came in between to drop it.
    pub fn push_checked<S: AgreedOps + ?Sized>(
        &mut self,
        sched: &S,
        ev: Event,
    ) -> Result<(), AgreementError> {
        let (op, _) = ev.op_kind().ok_or(AgreementError::Forward)?;
        if self.done.contains_key(&op) {
            return Err(AgreementError::Duplicate(op));
        }
        let kind = in_flight(sched, op)?;
        if let Some(e) = refusal(sched, op, kind, &ev) {
            return Err(e);
        }
        self.done.insert(op, Slot::Done(ev));
        Ok(())
    }

    /// This rank does not run `op` (another rank answers for all: see `Scheduler::runs_here`).
    /// Whether it does is not known here: a skip of an op that runs here is refused by the
    /// reduction ([`AgreementError::MustRun`]); [`Self::skip_checked`] refuses it at once.
    pub fn skip(&mut self, op: OpId) -> Result<(), AgreementError> {
        if self.done.contains_key(&op) {
            return Err(AgreementError::Duplicate(op));
        }
        self.done.insert(op, Slot::Skipped);
        Ok(())
    }

    /// [`Self::skip`], refused unless `op` is in flight in `sched`
    /// ([`AgreementError::NotInFlight`]) and does not run there ([`AgreementError::MustRun`]).
    pub fn skip_checked<S: AgreedOps + ?Sized>(
        &mut self,
        sched: &S,
        op: OpId,
    ) -> Result<(), AgreementError> {
        if self.done.contains_key(&op) {
            return Err(AgreementError::Duplicate(op));
        }
        let kind = in_flight(sched, op)?;
        if sched.runs_here(kind) {
            return Err(AgreementError::MustRun { op, kind });
        }
        self.done.insert(op, Slot::Skipped);
        Ok(())
    }

    /// Completions recorded and not yet agreed.
    pub fn pending(&self) -> usize {
        self.done.len()
    }

    /// Records a reduction dropped because their op was not in flight in the scheduler it
    /// reduced over (a completion pushed twice, after its op was agreed, or for an op id not
    /// issued): none of them ever completes an op. Cumulative.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Checks this rank's records of the ops in flight in `sched`, changing nothing: each
    /// completion is of its op's kind and within its count ([`AgreementError::WrongKind`],
    /// [`AgreementError::TooMany`]), and each skip is of an op that does not run here
    /// ([`AgreementError::MustRun`]). [`Self::reduce`] does this before entering the
    /// collective; a caller that reduces [`Self::values`] itself should too (a refused rank's
    /// values never complete the op, on any rank, but [`Self::apply_reduced`] refuses it only
    /// after the collective).
    pub fn check<S: AgreedOps + ?Sized>(&self, sched: &S) -> Result<(), AgreementError> {
        self.check_ops(sched, &sched.agreed_ops())
    }

    fn check_ops<S: AgreedOps + ?Sized>(
        &self,
        sched: &S,
        ops: &[(OpId, OpKind)],
    ) -> Result<(), AgreementError> {
        for (op, kind) in ops {
            match self.done.get(op) {
                Some(Slot::Done(ev)) => {
                    if let Some(e) = refusal(sched, *op, *kind, ev) {
                        return Err(e);
                    }
                }
                Some(Slot::Skipped) if sched.runs_here(*kind) => {
                    return Err(AgreementError::MustRun {
                        op: *op,
                        kind: *kind,
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// This rank's contribution: one value per op in flight in `sched`, in op-id order. When
    /// [`Self::check`] refuses a record, every value is "not done" (0): no rank agrees any op
    /// this step, since this rank, which raises, applies none, and a rank that applied events
    /// another did not would plan differently from then on.
    pub fn values<S: AgreedOps + ?Sized>(&self, sched: &S) -> Vec<u64> {
        self.contribution(sched, &sched.agreed_ops()).0
    }

    /// [`Self::values`] over `ops`, checked once: the values, and the refusal that made them
    /// all "not done" (if any).
    fn contribution<S: AgreedOps + ?Sized>(
        &self,
        sched: &S,
        ops: &[(OpId, OpKind)],
    ) -> (Vec<u64>, Result<(), AgreementError>) {
        let checked = self.check_ops(sched, ops);
        if checked.is_err() {
            return (vec![0; ops.len()], checked);
        }
        let v = ops
            .iter()
            .map(|(op, _)| match self.done.get(op) {
                None => 0,
                Some(Slot::Skipped) => SKIPPED,
                Some(Slot::Done(ev)) => encode(ev),
            })
            .collect();
        (v, checked)
    }

    /// Reduces this step's completions across ranks and returns the agreed events, to be fed to
    /// `sched` in order. `all_reduce_min` must replace each element with its minimum over all
    /// ranks (every rank calls `reduce` once per step, with the same ops in flight). Ops not
    /// yet done on some rank stay recorded for a later step; records of ops not in flight are
    /// dropped ([`Self::dropped`]).
    ///
    /// Nothing changes on an error. A record [`Self::check`] refuses is refused *after*
    /// `all_reduce_min`: this rank enters the collective with every op "not done" (0, as
    /// [`Self::values`] gives them), so no rank agrees anything, and then returns the refusal. A rank
    /// that refused before the collective left the others waiting in it, or paired their
    /// all-reduce with its next one (another vector read as this one). A reduced vector that
    /// cannot be the minimum (see [`Self::apply_reduced`]) is refused after it too.
    pub fn reduce<S: AgreedOps + ?Sized>(
        &mut self,
        sched: &S,
        all_reduce_min: impl FnOnce(&mut [u64]),
    ) -> Result<Vec<Event>, AgreementError> {
        let ops = sched.agreed_ops();
        let (mut v, checked) = self.contribution(sched, &ops);
        all_reduce_min(&mut v);
        checked?;
        self.apply_reduced(sched, &v)
    }

    /// The second half of [`Self::reduce`], for callers that reduce [`Self::values`]
    /// themselves: the agreed events for the element-wise minimum `reduced`.
    ///
    /// Checked whole before anything is consumed: the length must match the ops in flight,
    /// this rank's records must pass [`Self::check`], and no value may exceed this rank's own
    /// ([`AgreementError::NotMinimum`]): a minimum over ranks never does, while a SUM or MAX
    /// reduction would complete ops this rank never finished, or with more pages than it
    /// holds. On success the agreed ops' records are consumed and records of ops not in
    /// flight dropped.
    pub fn apply_reduced<S: AgreedOps + ?Sized>(
        &mut self,
        sched: &S,
        reduced: &[u64],
    ) -> Result<Vec<Event>, AgreementError> {
        let ops = sched.agreed_ops();
        if ops.len() != reduced.len() {
            return Err(AgreementError::Length {
                expected: ops.len(),
                got: reduced.len(),
            });
        }
        let (own, checked) = self.contribution(sched, &ops);
        checked?;
        for (((op, _), &x), &mine) in ops.iter().zip(reduced).zip(&own) {
            if x > mine {
                return Err(AgreementError::NotMinimum {
                    op: *op,
                    own: mine,
                    reduced: x,
                });
            }
        }
        let mut out = Vec::new();
        for ((op, kind), &x) in ops.iter().zip(reduced) {
            // 0: a rank has not finished it; SKIPPED: nobody ran it (not a valid answer).
            if x == 0 || x >= SKIPPED {
                continue;
            }
            self.done.remove(op);
            out.push(decode(*op, *kind, x));
        }
        let before = self.done.len();
        self.done
            .retain(|op, _| ops.binary_search_by_key(op, |(o, _)| *o).is_ok());
        self.dropped += (before - self.done.len()) as u64;
        Ok(out)
    }

    /// Reduces the agreements of ranks in one process (one per rank of `sched`'s group:
    /// [`AgreementError::RankCount`] otherwise) with the element-wise minimum of their values;
    /// the agreed events, the same for every rank, to be applied once. Checked whole first:
    /// if any rank's records are refused ([`Self::check`]) no rank's agreement changes.
    pub fn reduce_in_process<S: AgreedOps + ?Sized>(
        ranks: &mut [RankAgreement],
        sched: &S,
    ) -> Result<Vec<Event>, AgreementError> {
        if ranks.len() != sched.tp_ranks() as usize {
            return Err(AgreementError::RankCount {
                got: ranks.len(),
                tp_ranks: sched.tp_ranks(),
            });
        }
        let ops = sched.agreed_ops();
        let mut min: Option<Vec<u64>> = None;
        for a in ranks.iter() {
            let (v, checked) = a.contribution(sched, &ops);
            checked?;
            min = Some(match min {
                None => v,
                Some(m) => m.iter().zip(&v).map(|(a, b)| (*a).min(*b)).collect(),
            });
        }
        let Some(min) = min else {
            return Ok(Vec::new());
        };
        // Every rank passed its checks and `min` is at most each rank's own values, so no
        // `apply_reduced` below can refuse: the ranks consume the same ops.
        let mut events = Vec::new();
        for (i, a) in ranks.iter_mut().enumerate() {
            let evs = a.apply_reduced(sched, &min)?;
            if i == 0 {
                events = evs;
            }
        }
        Ok(events)
    }
}

/// The kind of `op` if it is in flight in `sched`.
fn in_flight<S: AgreedOps + ?Sized>(sched: &S, op: OpId) -> Result<OpKind, AgreementError> {
    let ops = sched.agreed_ops();
    match ops.binary_search_by_key(&op, |(o, _)| *o) {
        Ok(i) => Ok(ops[i].1),
        Err(_) => Err(AgreementError::NotInFlight(op)),
    }
}

/// FNV-1a, 64 bit: stable across processes, builds and platforms (unlike `DefaultHasher`).
struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= *b as u64;
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
    }
}

fn key_without_rank(k: &str) -> &str {
    k.rsplit_once(':').map_or(k, |(head, _)| head)
}

impl ExecutionPlan {
    /// A fingerprint of the plan, equal on every tensor-parallel rank whose scheduler made the
    /// same decisions (L3 keys count without their rank suffix). For a debug mode: all-gather
    /// it each step and stop at the first step where ranks differ.
    pub fn digest(&self) -> u64 {
        let mut h = Fnv(0xcbf2_9ce4_8422_2325);
        let ids = |h: &mut Fnv, v: &mut dyn Iterator<Item = u32>| {
            let mut n = 0u32;
            for x in v {
                h.write_u32(x);
                n += 1;
            }
            h.write_u32(n);
        };
        let keys = |h: &mut Fnv, ks: &[String]| {
            for k in ks {
                h.write(key_without_rank(k).as_bytes());
                h.write_u8(0xff);
            }
            h.write_usize(ks.len());
        };
        let tier = |h: &mut Fnv, t: &TierPages| match t {
            TierPages::Device(p) => {
                h.write_u8(0);
                ids(h, &mut p.iter().map(|x| x.index()));
            }
            TierPages::Host(p) => {
                h.write_u8(1);
                ids(h, &mut p.iter().map(|x| x.index()));
            }
        };
        let delta = |h: &mut Fnv, d: &Option<PageTableDelta>| match d {
            None => h.write_u8(0),
            Some(d) => {
                h.write_u8(1);
                h.write_u32(d.from);
                ids(h, &mut d.pages.iter().map(|x| x.index()));
            }
        };
        h.write_usize(self.ops.len());
        for op in &self.ops {
            h.write_u64(op.id.0);
            h.write_u8(op.kind as u8);
            h.write_u64(op.req.map_or(u64::MAX, |r| r.0));
            h.write_u8(op.before_forward as u8);
            match &op.spec {
                OpSpec::L3Query { keys: k } => keys(&mut h, k),
                OpSpec::Prefetch { keys: k, dst } => {
                    keys(&mut h, k);
                    tier(&mut h, dst);
                }
                OpSpec::LoadBack { src, dst } => {
                    ids(&mut h, &mut src.iter().map(|x| x.index()));
                    ids(&mut h, &mut dst.iter().map(|x| x.index()));
                }
                OpSpec::WriteBack { src, dst } => {
                    ids(&mut h, &mut src.iter().map(|x| x.index()));
                    ids(&mut h, &mut dst.iter().map(|x| x.index()));
                }
                OpSpec::BackUp { keys: k, src } => {
                    keys(&mut h, k);
                    tier(&mut h, src);
                }
            }
        }
        for op in &self.terminate_prefetch {
            h.write_u64(op.0);
        }
        h.write_usize(self.terminate_prefetch.len());
        h.write_u64(self.forward.step.map_or(0, |s| s.0));
        for c in &self.forward.prefill {
            h.write_u64(c.req.0);
            h.write_u32(c.start);
            h.write_u32(c.len);
            h.write_u8(c.last as u8);
            delta(&mut h, &c.table);
            ids(&mut h, &mut c.tokens.iter().copied());
            for w in &c.waits_for {
                h.write_u64(w.0);
            }
        }
        h.write_usize(self.forward.prefill.len());
        for d in &self.forward.decode {
            h.write_u64(d.req.0);
            h.write_u32(d.position);
            delta(&mut h, &d.table);
        }
        h.write_usize(self.forward.decode.len());
        for (r, o) in &self.ended {
            h.write_u64(r.0);
            h.write_u8(*o as u8);
        }
        h.write_usize(self.ended.len());
        for r in &self.retracted {
            h.write_u64(r.0);
        }
        h.write_usize(self.retracted.len());
        h.finish()
    }
}
