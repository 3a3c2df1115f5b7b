//! Tensor-parallel agreement on L3 finds: every rank marks the same pages "in L3" in the same
//! step.
//!
//! Why: the offloading manager's engine probes L3 for the pages after a host prefix
//! (SGLang's `batch_is_exist`), and under tensor parallelism each rank probes its own shard
//! under its own keys. Their answers differ (rank 1's shard of a page was evicted, rank 0's
//! was not). A rank told of its own find alone answers `Lookup::InL3` where the others answer
//! a miss: it plans a prefetch they do not, reports another prefix length, and the forward
//! that follows computes different tokens on different ranks or hangs in a collective. A page
//! is usable from L3 only when **every rank's shard is there**: the intersection of the
//! ranks' finds (for finds that are runs from the same page, the shortest run), applied on
//! every rank at the same point of the same step.
//!
//! How: a rank records what its probe found with [`RankAgreement::found_pages`]. Then every
//! rank calls [`RankAgreement::agree_found`] (or [`RankAgreement::found_words`] and
//! [`RankAgreement::apply_found`]), which all-gathers each rank's words — the format of loss
//! words (`agreed_losses.rs`) under [`FOUND_WORDS_TAG`] — and marks the pages every rank
//! found. Ranks in one process (vLLM's one manager over every rank's tier) use
//! [`OffloadManager::agree_found_in_process`]. A find is agreed in the round every rank
//! records it; the pages only some ranks found are consumed all the same (a miss for every
//! rank: the engine probes again later). Marks are hints, as losses are: what L3 loses after
//! is agreed as a loss.
//!
//! By construction: a manager of several ranks refuses the direct
//! [`OffloadManager::l3_found`] (`OffloadError::FoundNeedsAgreement`), and the agreement
//! refuses words gathered from another number of ranks than its `tp_ranks`
//! ([`AgreementError::RankCount`]).

use std::collections::BTreeSet;

use kvtier_radix::PageHash;

use crate::agreed_losses::{decode_words, encode_words};
use crate::agreement::{AgreementError, RankAgreement};
use crate::offload::OffloadManager;

/// First word of every rank's found words ("kvtierF1"): a vector that does not start with it
/// is not found words (loss words, or another collective's buffers).
pub const FOUND_WORDS_TAG: u64 = 0x6b76_7469_6572_4631;

fn rank_count(m: &OffloadManager, got: usize) -> Result<(), AgreementError> {
    let tp_ranks = m.tp_ranks();
    if got != tp_ranks as usize {
        return Err(AgreementError::RankCount { got, tp_ranks });
    }
    Ok(())
}

/// The pages in every one of `sets` (none without sets).
fn intersection<'a>(mut sets: impl Iterator<Item = &'a BTreeSet<PageHash>>) -> Vec<PageHash> {
    let Some(first) = sets.next() else {
        return Vec::new();
    };
    let mut common = first.clone();
    for s in sets {
        common.retain(|p| s.contains(p));
    }
    common.into_iter().collect()
}

impl RankAgreement {
    /// Records pages this rank's L3 probe found (its shard of each is in its store), to be
    /// agreed with the other ranks at the next [`Self::agree_found`]. Returns how many were
    /// not recorded already. Nothing changes in a manager until the agreement.
    pub fn found_pages(&mut self, pages: &[PageHash]) -> usize {
        pages.iter().filter(|h| self.found.insert(**h)).count()
    }

    /// Finds recorded and not yet agreed.
    pub fn pending_found(&self) -> usize {
        self.found.len()
    }

    /// This rank's contribution to the all-gather: [`FOUND_WORDS_TAG`], 0, the number of
    /// pages, four big-endian words per page hash (as [`Self::loss_words`]). Remembers what
    /// it sent: the next [`Self::apply_found`] checks and consumes exactly these, and finds
    /// recorded meanwhile wait for the next round.
    pub fn found_words(&mut self) -> Vec<u64> {
        self.sent_found = Some(self.found.clone());
        encode_words(FOUND_WORDS_TAG, false, &self.found)
    }

    /// Marks in `m` the pages every rank found. `gathered` holds every rank's
    /// [`Self::found_words`] (this rank's included, any order, each possibly zero-padded).
    /// Checked whole before anything changes: `m`'s `tp_ranks` entries
    /// ([`AgreementError::RankCount`]), each decodes ([`AgreementError::BadFoundWords`]), and
    /// one of them is what this rank's last [`Self::found_words`] sent (all it recorded,
    /// without one) ([`AgreementError::OwnFindsMissing`]). Then what this rank sent is
    /// consumed, and the intersection is marked in L3, the same on every rank. Returns the
    /// marks added.
    pub fn apply_found<W: AsRef<[u64]>>(
        &mut self,
        m: &mut OffloadManager,
        gathered: &[W],
    ) -> Result<usize, AgreementError> {
        rank_count(m, gathered.len())?;
        let mut sets = Vec::with_capacity(gathered.len());
        for (rank, w) in gathered.iter().enumerate() {
            let bad = |why| AgreementError::BadFoundWords { rank, why };
            let (flag, pages) = decode_words(w.as_ref(), FOUND_WORDS_TAG, bad)?;
            if flag {
                return Err(bad("the flag word of found words is not 0"));
            }
            sets.push(pages);
        }
        let own = self.sent_found.as_ref().unwrap_or(&self.found);
        if !sets.iter().any(|s| s == own) {
            return Err(AgreementError::OwnFindsMissing);
        }
        match self.sent_found.take() {
            Some(sent) => self.found.retain(|p| !sent.contains(p)),
            None => self.found.clear(),
        }
        Ok(m.mark_l3_found(intersection(sets.iter())))
    }

    /// [`Self::found_words`], all-gathered by `all_gather` (which returns every rank's words,
    /// this rank's included), then [`Self::apply_found`]. Collective: every rank calls it at
    /// the same point (after the ranks' probes of the same pages), whether or not its probe
    /// found anything.
    pub fn agree_found(
        &mut self,
        m: &mut OffloadManager,
        all_gather: impl FnOnce(&[u64]) -> Vec<Vec<u64>>,
    ) -> Result<usize, AgreementError> {
        let gathered = all_gather(&self.found_words());
        self.apply_found(m, &gathered)
    }
}

impl OffloadManager {
    /// Agrees the finds of ranks whose agreements are in this process (one per rank the
    /// manager plans for, else [`AgreementError::RankCount`] and nothing changes): marks the
    /// pages every rank found, and consumes every rank's finds. The marks added.
    pub fn agree_found_in_process(
        &mut self,
        ranks: &mut [RankAgreement],
    ) -> Result<usize, AgreementError> {
        rank_count(self, ranks.len())?;
        let common = intersection(ranks.iter().map(|r| &r.found));
        for r in ranks.iter_mut() {
            r.found.clear();
            r.sent_found = None;
        }
        Ok(self.mark_l3_found(common))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_radix::EvictionPolicy;

    #[test]
    fn found_words_are_not_loss_words() {
        let mut m = OffloadManager::new(4, EvictionPolicy::Lru).unwrap();
        m.set_tp_ranks(2).unwrap();
        let mut a = RankAgreement::new();
        a.found_pages(&[PageHash([3u8; 32])]);
        let mine = a.found_words();
        let loss = RankAgreement::new().loss_words();
        assert!(matches!(
            a.apply_found(&mut m, &[mine.clone(), loss]),
            Err(AgreementError::BadFoundWords { rank: 1, .. })
        ));
        let mut flagged = RankAgreement::new().found_words();
        flagged[1] = 1;
        assert!(matches!(
            a.apply_found(&mut m, &[mine, flagged]),
            Err(AgreementError::BadFoundWords { rank: 1, .. })
        ));
        assert_eq!((a.pending_found(), m.l3_known()), (1, 0));
    }
}
