//! Tensor-parallel agreement on L3 losses: every rank forgets the same L3 marks in the same
//! step.
//!
//! Why: each rank's store holds that rank's shard of every page under rank-suffixed keys, and
//! loses objects on its own schedule. A rank whose store reports a loss clears the page's "in
//! L3" mark (`Scheduler::l3_lost`); the other ranks, told nothing, keep it. At the next finish
//! the first rank backs the page up and the others do not: the plans differ, and a collective
//! that follows hangs. A journal overflow (`l3_lost_all`) on one rank does the same to every
//! page. Losses therefore go through [`RankAgreement`] like op completions do: **the union of
//! every rank's losses, applied on every rank at the same point of the same step**. A page
//! lost on one rank is refetched or backed up again by all of them (the other ranks' copies
//! are overwritten with the same content), which is what keeps the shards of a page
//! consistent, too.
//!
//! How: a rank records its store's reports with [`RankAgreement::lost`] (its own keys,
//! translated to page hashes, which are the same on every rank) and [`RankAgreement::lost_all`].
//! Once per step every rank calls [`RankAgreement::agree_losses`] (or [`RankAgreement::loss_words`]
//! and [`RankAgreement::apply_losses`]), which all-gathers each rank's words — a header and
//! four words per lost page, three words when nothing was lost — and applies the union. The
//! call is collective: every rank makes it every step, at the same point (e.g. right after
//! [`RankAgreement::reduce`]), whether or not it has anything to report.
//!
//! By construction, not by protocol: a scheduler that is one rank of several
//! (`SchedulerConfig::tp_ranks` > 1) refuses the direct calls (`Scheduler::l3_lost`,
//! `l3_lost_all`, `l3_lost_pages`: `SchedulerError::LossNeedsAgreement`), the agreement is
//! the only other way to clear a mark ([`crate::AgreedLosses`]), and it refuses words
//! gathered from another number of ranks than the scheduler's `tp_ranks`
//! ([`AgreementError::RankCount`]) — so a rank 0 whose engine left `tp_ranks` at 1 is caught
//! at its first agreement, and a rank above 0 cannot be configured without it.

use std::collections::BTreeSet;

use kvtier_radix::PageHash;

use crate::agreement::{AgreedLosses, AgreedOps, AgreementError, RankAgreement};
use crate::scheduler::Scheduler;

/// First word of every rank's loss words ("kvtierL1"): a vector that does not start with it
/// is not loss words (a mix-up with another collective's buffers).
pub const LOSS_WORDS_TAG: u64 = 0x6b76_7469_6572_4c31;

/// Words before the pages: tag, "everything lost" flag, number of pages.
const HEADER: usize = 3;

/// What one rank reported: every mark may be stale (journal overflow), and these pages.
#[derive(Debug, Default, PartialEq, Eq)]
struct Losses {
    all: bool,
    pages: BTreeSet<PageHash>,
}

fn page_words(h: &PageHash) -> [u64; 4] {
    let mut w = [0u64; 4];
    for (i, chunk) in h.0.chunks_exact(8).enumerate() {
        let mut b = [0u8; 8];
        b.copy_from_slice(chunk);
        w[i] = u64::from_be_bytes(b);
    }
    w
}

fn words_page(w: &[u64]) -> PageHash {
    let mut h = [0u8; 32];
    for (i, x) in w.iter().take(4).enumerate() {
        h[i * 8..i * 8 + 8].copy_from_slice(&x.to_be_bytes());
    }
    PageHash(h)
}

/// One rank's words: `tag`, a flag (0 or 1), the number of pages, four words per page (the
/// format of loss words and of found words, `agreed_finds.rs`). Returns the flag and the
/// pages; zero padding after them is allowed (`all_gather` collectives need equal sizes).
/// What is wrong is `bad(why)`.
pub(crate) fn decode_words(
    w: &[u64],
    tag: u64,
    bad: impl Fn(&'static str) -> AgreementError,
) -> Result<(bool, BTreeSet<PageHash>), AgreementError> {
    if w.len() < HEADER || w[0] != tag {
        return Err(bad("does not start with the words' tag"));
    }
    let flag = match w[1] {
        0 => false,
        1 => true,
        _ => return Err(bad("the flag word is neither 0 nor 1")),
    };
    let n = usize::try_from(w[2]).map_err(|_| bad("page count out of range"))?;
    let end = n
        .checked_mul(4)
        .and_then(|x| x.checked_add(HEADER))
        .filter(|&e| e <= w.len())
        .ok_or(bad("shorter than its page count says"))?;
    if w[end..].iter().any(|&x| x != 0) {
        return Err(bad("padding after the pages is not zero"));
    }
    Ok((
        flag,
        w[HEADER..end].chunks_exact(4).map(words_page).collect(),
    ))
}

/// `tag`, `flag`, the number of pages, then four big-endian words of each page hash.
pub(crate) fn encode_words(tag: u64, flag: bool, pages: &BTreeSet<PageHash>) -> Vec<u64> {
    let mut w = Vec::with_capacity(HEADER + 4 * pages.len());
    w.extend([tag, flag as u64, pages.len() as u64]);
    for h in pages {
        w.extend(page_words(h));
    }
    w
}

/// Decodes one rank's loss words.
fn decode(rank: usize, w: &[u64]) -> Result<Losses, AgreementError> {
    let (all, pages) = decode_words(w, LOSS_WORDS_TAG, |why| AgreementError::BadLossWords {
        rank,
        why,
    })?;
    Ok(Losses { all, pages })
}

impl RankAgreement {
    /// Records keys this rank's store reported lost (its journal, an eviction callback, a
    /// dead node), to be agreed with the other ranks at the next [`Self::agree_losses`]. Keys
    /// are translated to page hashes with `sched`'s key builder; keys of other namespaces or
    /// ranks are ignored. Returns the number of keys recorded. Nothing changes in `sched`
    /// until the agreement.
    pub fn lost<K: AsRef<str>>(&mut self, sched: &Scheduler, keys: &[K]) -> usize {
        let mut n = 0;
        for h in keys.iter().filter_map(|k| sched.keys.page_of(k.as_ref())) {
            self.lost.insert(h);
            n += 1;
        }
        n
    }

    /// Records page hashes this rank found lost in its store (for planners that name pages
    /// by hash, such as the offloading-manager mode, whose engine keys are not the
    /// scheduler's), to be agreed at the next [`Self::agree_losses`]. Returns how many were
    /// not recorded already.
    pub fn lost_pages(&mut self, pages: &[PageHash]) -> usize {
        pages.iter().filter(|h| self.lost.insert(**h)).count()
    }

    /// This rank's loss report was incomplete (the store's journal overflowed): at the next
    /// agreement every rank clears every L3 mark (`Scheduler::l3_lost_all`).
    pub fn lost_all(&mut self) {
        self.lost_all = true;
    }

    /// Losses recorded and not yet agreed: `(pages, overflowed)`.
    pub fn pending_losses(&self) -> (usize, bool) {
        (self.lost.len(), self.lost_all)
    }

    /// This rank's contribution to the all-gather: [`LOSS_WORDS_TAG`], 0 or 1 (overflowed),
    /// the number of pages, then four big-endian words of each page hash (`3 + 4n` words;
    /// as int64 for `torch.distributed`, whose reductions are signed: bit patterns, not
    /// numbers). Remembers what it sent: the next [`Self::apply_losses`] checks and consumes
    /// exactly these, and losses recorded meanwhile wait for the next round.
    pub fn loss_words(&mut self) -> Vec<u64> {
        let w = encode_words(LOSS_WORDS_TAG, self.lost_all, &self.lost);
        self.sent_losses = Some((self.lost_all, self.lost.clone()));
        w
    }

    /// Applies the union of every rank's losses to `sched`. `gathered` holds every rank's
    /// [`Self::loss_words`] (this rank's included, any order, each possibly zero-padded).
    /// Checked whole before anything changes: it must hold `sched`'s `tp_ranks` entries
    /// ([`AgreementError::RankCount`]), each must decode ([`AgreementError::BadLossWords`])
    /// and the union must cover what this rank's last [`Self::loss_words`] sent (all it
    /// recorded, without one) ([`AgreementError::OwnLossesMissing`]: its own words were left
    /// out). Then every rank clears the same marks: all of them if some rank overflowed, else
    /// those of the union's pages; what this rank sent is consumed, and losses it recorded
    /// since wait for the next agreement. Returns the tree nodes cleared.
    pub fn apply_losses<S: AgreedOps + ?Sized, W: AsRef<[u64]>>(
        &mut self,
        sched: &mut S,
        gathered: &[W],
    ) -> Result<usize, AgreementError> {
        let tp_ranks = sched.tp_ranks();
        if gathered.len() != tp_ranks as usize {
            return Err(AgreementError::RankCount {
                got: gathered.len(),
                tp_ranks,
            });
        }
        let mut union = Losses::default();
        for (rank, w) in gathered.iter().enumerate() {
            let l = decode(rank, w.as_ref())?;
            union.all |= l.all;
            union.pages.extend(l.pages);
        }
        let (own_all, own) = match &self.sent_losses {
            Some((all, pages)) => (*all, pages),
            None => (self.lost_all, &self.lost),
        };
        if (own_all && !union.all) || !own.is_subset(&union.pages) {
            return Err(AgreementError::OwnLossesMissing);
        }
        match self.sent_losses.take() {
            Some((all, pages)) => {
                self.lost.retain(|p| !pages.contains(p));
                self.lost_all &= !all;
            }
            None => {
                self.lost.clear();
                self.lost_all = false;
            }
        }
        Ok(if union.all {
            sched.forget_l3_all(AgreedLosses::new())
        } else {
            let pages: Vec<PageHash> = union.pages.into_iter().collect();
            sched.forget_l3_pages(&pages, AgreedLosses::new())
        })
    }

    /// [`Self::loss_words`], all-gathered by `all_gather` (which returns every rank's words,
    /// this rank's included), then [`Self::apply_losses`]. Collective: every rank calls it
    /// once per step at the same point.
    pub fn agree_losses<S: AgreedOps + ?Sized>(
        &mut self,
        sched: &mut S,
        all_gather: impl FnOnce(&[u64]) -> Vec<Vec<u64>>,
    ) -> Result<usize, AgreementError> {
        let gathered = all_gather(&self.loss_words());
        self.apply_losses(sched, &gathered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_and_padding() {
        let h = PageHash([7u8; 32]);
        let mut a = RankAgreement::new();
        a.lost.insert(h);
        let mut w = a.loss_words();
        assert_eq!(w.len(), HEADER + 4);
        w.extend([0, 0, 0]);
        let l = decode(0, &w).unwrap();
        assert!(!l.all && l.pages.len() == 1 && l.pages.contains(&h));
        w.push(5);
        assert!(decode(0, &w).is_err());
        assert!(decode(0, &[LOSS_WORDS_TAG, 2, 0]).is_err());
        assert!(decode(0, &[LOSS_WORDS_TAG, 0, 1, 9]).is_err());
        assert!(decode(0, &[LOSS_WORDS_TAG, 0, u64::MAX]).is_err());
        assert!(decode(0, &[1, 0, 0]).is_err());
    }
}
