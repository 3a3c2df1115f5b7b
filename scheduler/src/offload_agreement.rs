//! Tensor-parallel agreement for the offloading-manager mode: one plan, every rank's shard.
//!
//! Why: under tensor parallelism an engine such as vLLM runs one offloading manager, but each
//! rank holds its own shard of every host slot, and kvtier's L3 keeps each rank's shard under
//! its own key (docs/page-keys.md). A prefetch is therefore `world_size` reads and a backup
//! `world_size` writes, which finish at different times and can end differently (rank 1's
//! shard of a page was evicted from L3, rank 0's was not). The manager must act once, on the
//! outcome every rank shares: a page is on host only when every rank's shard landed, in L3
//! only when every rank's shard was written, and a page one rank lost is lost for all.
//! That is [`RankAgreement`]'s contract, so the manager is an [`AgreedOps`] like the
//! [`Scheduler`](crate::Scheduler): each rank records its completions in its own
//! `RankAgreement`, the element-wise minimum of their values (one per prefetch and backup in
//! flight) yields the agreed events, and [`OffloadManager::apply_agreed`] applies them; L3
//! losses a rank's store reports are agreed with `RankAgreement::lost_pages` and
//! `agree_losses` (their union is forgotten).
//!
//! How: the ops are the manager's prefetch jobs ([`OpKind::Prefetch`], value = pages read)
//! and backup jobs ([`OpKind::BackUp`], value = success), identified by job id. The engine's
//! own device↔host copies are not listed: the engine counts its workers' completions itself.

use kvtier_fsm::OpKind;
use kvtier_radix::PageHash;

use crate::agreement::{AgreedLosses, AgreedOps, RankAgreement};
use crate::offload::{JobOutcome, OffloadError, OffloadManager};
use crate::types::{Event, OpId};

impl AgreedOps for OffloadManager {
    fn agreed_ops(&self) -> Vec<(OpId, OpKind)> {
        let mut v: Vec<(OpId, OpKind)> = self
            .l3
            .prefetch_jobs()
            .map(|j| (OpId(j), OpKind::Prefetch))
            .chain(self.l3.backup_jobs().map(|j| (OpId(j), OpKind::BackUp)))
            .collect();
        v.sort_unstable_by_key(|(op, _)| *op);
        v
    }

    fn tp_ranks(&self) -> u32 {
        self.tp_ranks
    }

    /// A prefetch reads its pages, at most.
    fn max_count(&self, op: OpId) -> Option<u32> {
        self.l3
            .prefetch_pages(op.0)
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    }

    fn forget_l3_pages(&mut self, pages: &[PageHash], _: AgreedLosses) -> usize {
        let before = self.l3_known();
        self.forget_l3(pages);
        before - self.l3_known()
    }

    fn forget_l3_all(&mut self, _: AgreedLosses) -> usize {
        let before = self.l3_known();
        self.forget_l3_all_marks();
        before
    }
}

impl OffloadManager {
    /// Applies one agreed completion of [`RankAgreement::reduce`]: `PrefetchDone` completes
    /// the prefetch with the pages every rank read ([`Self::complete_prefetch`]), `BackUpDone`
    /// the backup (`Done` only if every rank wrote its shard). Other events are refused.
    pub fn apply_agreed(&mut self, ev: &Event) -> Result<(), OffloadError> {
        match *ev {
            Event::PrefetchDone { op, completed } => {
                self.complete_prefetch(op.0, completed as usize)
            }
            Event::BackUpDone { op, success } => {
                let outcome = if success {
                    JobOutcome::Done
                } else {
                    JobOutcome::Failed
                };
                self.complete_backup(op.0, outcome)
            }
            Event::L3QueryDone { .. } => Err(OffloadError::NotAnL3Completion("L3QueryDone")),
            Event::LoadBackDone { .. } => Err(OffloadError::NotAnL3Completion("LoadBackDone")),
            Event::WriteBackDone { .. } => Err(OffloadError::NotAnL3Completion("WriteBackDone")),
            Event::ForwardDone { .. } => Err(OffloadError::NotAnL3Completion("ForwardDone")),
        }
    }

    /// Reduces every rank's completions (in-process ranks: the element-wise minimum of their
    /// [`RankAgreement::values`], [`RankAgreement::reduce_in_process`]) and applies the agreed
    /// events; their number. Every rank's agreement consumes the same ops; there must be one
    /// per rank the manager plans for ([`Self::set_tp_ranks`], else
    /// `AgreementError::RankCount`), and a rank's completion of another kind than its job's
    /// (`AgreementError::WrongKind`) is refused; on these errors nothing changes. An
    /// agreed event the manager refuses is `AgreementError::Refused`, after every other
    /// agreed event was applied. For ranks in other processes, reduce with the process group
    /// instead and [`Self::apply_agreed`] what `RankAgreement::reduce` returns.
    pub fn agree_in_process(
        &mut self,
        ranks: &mut [RankAgreement],
    ) -> Result<usize, crate::AgreementError> {
        // Checked whole (every rank's records, the number of ranks) before any is consumed.
        let events = RankAgreement::reduce_in_process(ranks, self)?;
        // Every agreed event is of an op in flight here (the values listed it), so none should
        // be refused; if one is, the rest are still applied (each releases its job's pins) and
        // the first refusal is the answer.
        let mut refused = None;
        for ev in &events {
            if let Err(e) = self.apply_agreed(ev) {
                refused.get_or_insert(e);
            }
        }
        match refused {
            Some(e) => Err(crate::AgreementError::Refused(e)),
            None => Ok(events.len()),
        }
    }
}
