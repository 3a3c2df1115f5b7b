//! The adaptive eviction policy ([`EvictionPolicy::Adaptive`]): it learns online how much
//! weight the frequency/depth signal deserves on the current workload.
//!
//! Why: each fixed policy wins on some workload and loses on another. On the conversation
//! trace (76 % of blocks never read again) crediting reads beats LRU; on a multi-turn chat,
//! where every conversation's newest turn is read by its next one, the same credit keeps the
//! prefixes of finished conversations over the tails of live ones and loses up to 19 points.
//! No fixed setting fits both, so the cache measures which mistake it is making.
//!
//! How, after ARC (Megiddo & Modha, FAST'03): a leaf that leaves the tree (no copy on any
//! tier) is remembered in a *ghost list* by its first page hash, labelled by what it was:
//! - `Once`: never matched since it was written (what frequency credit ranks low);
//! - `Reused`: matched at least once (what frequency credit protects).
//!
//! When a later match stops exactly at a ghost (the prompt needs the evicted pages again),
//! the eviction was a mistake of the signal that ranked that leaf low. Every [`EPOCH_HITS`]
//! ghost hits the policy compares, per kind, the pages that came back with the pages evicted
//! in the epoch (one added to each, so that a fully protected kind still compares): when
//! `Reused` pages come back more often (by a margin), frequency deserves more weight and the
//! *level* goes up, in the opposite case down; one step, two when the rates differ by more
//! than 2 ×. Level 0 is plain LRU, [`LEVELS`] the conversation setting of `FrequencyDepth`, in
//! between that setting's credit and debit halved `LEVELS − level` times. A step re-ranks the
//! tree (O(n log n), at most once per epoch). Why per page and geometric: counting leaves let
//! a few short reused leaves outweigh long fresh ones, and linear steps were too coarse for
//! small caches (docs/sim/policies.md, "Adaptive eviction").
//!
//! The same ghosts also choose the host admission (`HostAdmission::Adaptive`, see
//! [`LearntAdmission`]): why, because demotion against copies at finish decides more than the
//! eviction order on both workloads, and again each wins on one; how, by the tier that dropped
//! the ghost's last copy (device without a host copy: demotion's mistake; host, within one
//! device capacity of traffic: the inclusive tiers' mistake).
//!
//! Bounded and deterministic: a ghost lives for one capacity's worth of traffic (device +
//! host pages given to the device tier since its eviction: ARC's ghost list is the size of the
//! cache, here sized in time, not in entries) and at most `device + host` ghosts are kept
//! (the oldest go first). Everything is driven by the operations the cache sees, in their
//! order, with no wall clock and no iteration over hash maps, so two caches fed the same
//! operations (tensor-parallel ranks) hold the same level and evict the same leaves.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use crate::cache::PrefixHasher;
use crate::hash::PageHash;
use crate::policy::EvictionPolicy;
use crate::tier::TierKind;

/// Levels between LRU (0) and the full frequency/depth setting.
pub const LEVELS: u32 = 8;
/// A ghost lives for this many capacities of traffic.
pub const GHOST_WINDOW: u64 = 1;
/// Ghost hits per epoch: the level moves at most one step per epoch.
pub const EPOCH_HITS: u64 = 64;
/// A kind's ghost hit rate must exceed the other's by this factor (in tenths) to move the level.
const MARGIN_TENTHS: u64 = 11;
/// Beyond this ratio of the two rates the level moves two steps.
const FAST: u128 = 2;
/// Where a finished request's pages get their host copy, as learnt by the adaptive policy
/// (what `HostAdmission::Adaptive` follows), after ARC's "which ghost list the misses hit":
/// - a ghost hit on a leaf that device dropped without a host copy is a mistake of demotion
///   (copies at finish would have kept it on host);
/// - a ghost hit on a leaf that host dropped, asked for again within one device capacity of
///   traffic since, is a mistake of copies at finish (with exclusive tiers, the cache holds a
///   device capacity more, so it would still be there).
///
/// The pages of each kind of mistake move a score, bounded by the cache's capacity; above
/// zero the admission is [`LearntAdmission::Demote`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum LearntAdmission {
    /// At finish (inclusive tiers): where it starts, and while demotion's mistakes weigh more.
    #[default]
    CopyAtFinish,
    /// When device is about to evict them (exclusive tiers): while copies at finish's
    /// mistakes weigh more.
    Demote,
}

/// What an evicted leaf was when it left the tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GhostKind {
    /// Never matched after it was written.
    Once = 0,
    /// Matched at least once.
    Reused = 1,
}

/// The learnt state of [`EvictionPolicy::Adaptive`] (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct AdaptiveState {
    /// 0 = LRU … `LEVELS` = `EvictionPolicy::CONVERSATION`.
    level: u32,
    /// This epoch's pages of leaves that left the tree, per kind (`[once, reused]`).
    evicted: [u64; 2],
    /// This epoch's ghost hits in pages (the evicted leaf's), per kind.
    epoch_hits: [u64; 2],
    /// This epoch's ghost hits.
    epoch_count: u64,
    /// Ghosts in eviction order: (traffic at eviction, first hash).
    order: VecDeque<(u64, PageHash)>,
    /// First hash → (traffic at eviction, kind, pages, the tier that dropped it last); an
    /// entry whose traffic differs from the queue's is stale (the hash was evicted again
    /// later) and is skipped when expiring.
    ghosts: HashMap<PageHash, Ghost, BuildHasherDefault<PrefixHasher>>,
    /// Traffic a ghost lives for, and most ghosts kept: device + host pages.
    capacity: u64,
    /// Device pages: the extra capacity exclusive tiers have over inclusive ones.
    device: u64,
    /// Pages of copies-at-finish mistakes minus pages of demotion mistakes, within
    /// ±`capacity` ([`LearntAdmission`]).
    admission_score: i64,
    /// Ghost hits of each kind so far (`[once, reused]`), for reports.
    hits: [u64; 2],
    /// Level steps so far.
    steps: u64,
}

/// A ghost: (traffic at eviction, kind, pages, the tier that dropped the last copy).
type Ghost = (u64, GhostKind, u32, TierKind);

/// What the adaptive policy has learnt, for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct AdaptiveSnapshot {
    /// 0 (LRU) … [`LEVELS`] (the conversation setting of freq-depth).
    pub level: u32,
    pub ghosts: usize,
    pub ghost_hits_once: u64,
    pub ghost_hits_reused: u64,
    pub steps: u64,
    /// Where finished requests' pages get their host copy (followed only under
    /// `HostAdmission::Adaptive`), and the score it comes from.
    pub admission: LearntAdmission,
    pub admission_score: i64,
}

impl AdaptiveState {
    pub(crate) fn new(device_pages: usize, host_pages: usize) -> Self {
        let capacity_pages = device_pages + host_pages;
        AdaptiveState {
            level: 0,
            evicted: [0, 0],
            epoch_hits: [0, 0],
            epoch_count: 0,
            order: VecDeque::new(),
            ghosts: HashMap::default(),
            capacity: capacity_pages.max(1) as u64,
            device: device_pages as u64,
            admission_score: 0,
            hits: [0, 0],
            steps: 0,
        }
    }

    /// The policy leaves are ranked by at the current level.
    pub(crate) fn ranking(&self) -> EvictionPolicy {
        level_policy(self.level)
    }

    /// Where finished requests' pages get their host copy (see [`LearntAdmission`]).
    pub(crate) fn admission(&self) -> LearntAdmission {
        if self.admission_score > 0 {
            LearntAdmission::Demote
        } else {
            LearntAdmission::CopyAtFinish
        }
    }

    /// Remembers a leaf that left the tree when tier `from` dropped its last copy.
    pub(crate) fn remember(
        &mut self,
        first: PageHash,
        pages: usize,
        kind: GhostKind,
        from: TierKind,
        traffic: u64,
    ) {
        self.expire(traffic);
        while self.order.len() as u64 >= self.capacity {
            self.pop_oldest();
        }
        self.order.push_back((traffic, first));
        let pages = u32::try_from(pages).unwrap_or(u32::MAX);
        self.ghosts.insert(first, (traffic, kind, pages, from));
        self.evicted[kind as usize] += u64::from(pages);
    }

    /// A match stopped at `next` (the first page the tree lacks): if it is a ghost, learn from
    /// it. Returns true when the level changed (the caller ranks the tree again).
    pub(crate) fn on_miss(&mut self, next: &PageHash, traffic: u64) -> bool {
        self.expire(traffic);
        let Some((evicted_at, kind, pages, from)) = self.ghosts.remove(next) else {
            return false;
        };
        self.learn_admission(from, traffic.saturating_sub(evicted_at), pages);
        self.hits[kind as usize] += 1;
        self.epoch_count += 1;
        self.epoch_hits[kind as usize] += u64::from(pages);
        if self.epoch_count < EPOCH_HITS {
            return false;
        }
        // The rate at which each kind's evicted pages came back: pages hit / pages evicted.
        // The kind whose pages come back more often deserves more protection.
        // One more evicted page per kind (Laplace): a kind nothing of which was evicted this
        // epoch (fully protected) still compares, and loses its protection if the other
        // kind's pages come back.
        let [h_once, h_reused] = self.epoch_hits.map(u128::from);
        let [e_once, e_reused] = self.evicted.map(|e| u128::from(e) + 1);
        let m = u128::from(MARGIN_TENTHS);
        let old = self.level;
        let (reused, once) = (h_reused * e_once, h_once * e_reused);
        if 10 * reused > m * once {
            let step = if reused > FAST * once { 2 } else { 1 };
            self.level = (self.level + step).min(LEVELS);
        } else if 10 * once > m * reused {
            let step = if once > FAST * reused { 2 } else { 1 };
            self.level = self.level.saturating_sub(step);
        }
        self.evicted = [0, 0];
        self.epoch_hits = [0, 0];
        self.epoch_count = 0;
        if self.level != old {
            self.steps += 1;
        }
        self.level != old
    }

    /// A ghost hit of `pages` that `from` dropped `since` pages of traffic ago: whose mistake
    /// it was (see [`LearntAdmission`]).
    fn learn_admission(&mut self, from: TierKind, since: u64, pages: u32) {
        let pages = i64::from(pages);
        let delta = match from {
            TierKind::Device => -pages,
            TierKind::Host if since <= self.device => pages,
            TierKind::Host => 0,
        };
        let cap = i64::try_from(self.capacity).unwrap_or(i64::MAX);
        self.admission_score = (self.admission_score + delta).clamp(-cap, cap);
    }

    pub(crate) fn snapshot(&self) -> AdaptiveSnapshot {
        AdaptiveSnapshot {
            level: self.level,
            ghosts: self.ghosts.len(),
            ghost_hits_once: self.hits[0],
            ghost_hits_reused: self.hits[1],
            steps: self.steps,
            admission: self.admission(),
            admission_score: self.admission_score,
        }
    }

    /// Drops ghosts older than one capacity of traffic.
    fn expire(&mut self, traffic: u64) {
        while let Some(&(t, _)) = self.order.front() {
            if traffic.saturating_sub(t) <= GHOST_WINDOW * self.capacity {
                break;
            }
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if let Some((t, h)) = self.order.pop_front()
            && self.ghosts.get(&h).is_some_and(|&(gt, ..)| gt == t)
        {
            self.ghosts.remove(&h);
        }
    }

    /// The memory bound: at most one capacity of queued ghosts, each live ghost queued, and
    /// the level within its range (for `check_invariants`).
    pub(crate) fn check_bounds(&self) -> Result<(), String> {
        if self.order.len() as u64 > self.capacity {
            return Err(format!(
                "{} ghosts queued, bound {}",
                self.order.len(),
                self.capacity
            ));
        }
        if self.ghosts.len() > self.order.len() {
            return Err("more live ghosts than queued".into());
        }
        if self.admission_score.unsigned_abs() > self.capacity {
            return Err(format!("admission score {}", self.admission_score));
        }
        if self.level > LEVELS || self.epoch_count >= EPOCH_HITS {
            return Err(format!(
                "level {} / epoch {:?}",
                self.level, self.epoch_hits
            ));
        }
        Ok(())
    }
}

/// The ranking of level `level`: LRU at 0; above, the conversation setting's credit and
/// debit halved `LEVELS − level` times (geometric steps, so that the first steps are small
/// next to small caches: the full credit, 56K pages of traffic, dwarfs a cache of a few
/// thousand pages, where a tenth of it already reorders everything).
pub(crate) fn level_policy(level: u32) -> EvictionPolicy {
    let EvictionPolicy::FrequencyDepth {
        use_credit_pages,
        max_credited_uses,
        depth_debit_per_page,
    } = EvictionPolicy::CONVERSATION
    else {
        return EvictionPolicy::Lru;
    };
    match level.min(LEVELS) {
        0 => EvictionPolicy::Lru,
        l => {
            let shift = LEVELS - l;
            EvictionPolicy::FrequencyDepth {
                use_credit_pages: use_credit_pages >> shift,
                max_credited_uses,
                depth_debit_per_page: depth_debit_per_page >> shift,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(i: u64) -> PageHash {
        let toks: Vec<u32> = vec![i as u32; 4];
        crate::hash::page_hashes(&toks, 4, None)[0]
    }

    /// Host dropping what comes back within a device capacity votes for demotion; device
    /// dropping what comes back votes for copies at finish; a host ghost back later than
    /// that votes for neither; the score stays within ± the capacity.
    #[test]
    fn whose_mistake_moves_the_admission() {
        let mut a = AdaptiveState::new(10, 40);
        assert_eq!(a.admission(), LearntAdmission::CopyAtFinish);
        a.remember(hash(1), 3, GhostKind::Once, TierKind::Host, 100);
        a.on_miss(&hash(1), 105);
        assert_eq!(
            (a.admission_score, a.admission()),
            (3, LearntAdmission::Demote)
        );
        a.remember(hash(2), 5, GhostKind::Reused, TierKind::Device, 110);
        a.on_miss(&hash(2), 111);
        assert_eq!(
            (a.admission_score, a.admission()),
            (-2, LearntAdmission::CopyAtFinish)
        );
        a.remember(hash(3), 4, GhostKind::Once, TierKind::Host, 120);
        a.on_miss(&hash(3), 131);
        assert_eq!(
            a.admission_score, -2,
            "back after more than a device capacity"
        );
        for i in 0..100 {
            a.remember(hash(10 + i), 7, GhostKind::Once, TierKind::Host, 200 + i);
            a.on_miss(&hash(10 + i), 200 + i);
        }
        assert_eq!(a.admission_score, 50);
        a.check_bounds().unwrap();
    }
}
