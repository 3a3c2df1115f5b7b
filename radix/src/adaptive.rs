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
//! small caches (docs/sim.md, "Adaptive eviction").
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
/// From this level on, the workload rewards frequency: `HostAdmission::Adaptive` demotes
/// instead of copying at finish (the trace's setting), below it copies at finish (the chat's).
pub const DEMOTE_FROM_LEVEL: u32 = 4;

/// Where a finished request's pages get their host copy, as learnt by the adaptive policy
/// (what `HostAdmission::Adaptive` follows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum LearntAdmission {
    /// At finish: the level is below [`DEMOTE_FROM_LEVEL`] (recency pays, every turn is read
    /// again, inclusive tiers keep more of them).
    #[default]
    CopyAtFinish,
    /// When device evicts them: the level is at or above [`DEMOTE_FROM_LEVEL`] (most pages are
    /// not read again; exclusive tiers hold more of those that are).
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
    /// First hash → (traffic at eviction, kind, pages); an entry whose traffic differs from the
    /// queue's is stale (the hash was evicted again later) and is skipped when expiring.
    ghosts: HashMap<PageHash, (u64, GhostKind, u32), BuildHasherDefault<PrefixHasher>>,
    /// Traffic a ghost lives for, and most ghosts kept: device + host pages.
    capacity: u64,
    /// Ghost hits of each kind so far (`[once, reused]`), for reports.
    hits: [u64; 2],
    /// Level steps so far.
    steps: u64,
}

/// What the adaptive policy has learnt, for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct AdaptiveSnapshot {
    /// 0 (LRU) … [`LEVELS`] (the conversation setting of freq-depth).
    pub level: u32,
    pub ghosts: usize,
    pub ghost_hits_once: u64,
    pub ghost_hits_reused: u64,
    pub steps: u64,
    /// Where finished requests' pages get their host copy at this level (followed only under
    /// `HostAdmission::Adaptive`).
    pub admission: LearntAdmission,
}

impl AdaptiveState {
    pub(crate) fn new(capacity_pages: usize) -> Self {
        AdaptiveState {
            level: 0,
            evicted: [0, 0],
            epoch_hits: [0, 0],
            epoch_count: 0,
            order: VecDeque::new(),
            ghosts: HashMap::default(),
            capacity: capacity_pages.max(1) as u64,
            hits: [0, 0],
            steps: 0,
        }
    }

    /// Where finished requests' pages get their host copy at the current level.
    pub(crate) fn admission(&self) -> LearntAdmission {
        if self.level >= DEMOTE_FROM_LEVEL {
            LearntAdmission::Demote
        } else {
            LearntAdmission::CopyAtFinish
        }
    }

    /// The policy leaves are ranked by at the current level.
    pub(crate) fn ranking(&self) -> EvictionPolicy {
        level_policy(self.level)
    }

    /// Remembers a leaf that left the tree.
    pub(crate) fn remember(
        &mut self,
        first: PageHash,
        pages: usize,
        kind: GhostKind,
        traffic: u64,
    ) {
        self.expire(traffic);
        while self.order.len() as u64 >= self.capacity {
            self.pop_oldest();
        }
        self.order.push_back((traffic, first));
        let pages = u32::try_from(pages).unwrap_or(u32::MAX);
        self.ghosts.insert(first, (traffic, kind, pages));
        self.evicted[kind as usize] += u64::from(pages);
    }

    /// A match stopped at `next` (the first page the tree lacks): if it is a ghost, learn from
    /// it. Returns true when the level changed (the caller ranks the tree again).
    pub(crate) fn on_miss(&mut self, next: &PageHash, traffic: u64) -> bool {
        self.expire(traffic);
        let Some((_, kind, pages)) = self.ghosts.remove(next) else {
            return false;
        };
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

    pub(crate) fn snapshot(&self) -> AdaptiveSnapshot {
        AdaptiveSnapshot {
            level: self.level,
            ghosts: self.ghosts.len(),
            ghost_hits_once: self.hits[0],
            ghost_hits_reused: self.hits[1],
            steps: self.steps,
            admission: self.admission(),
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
            && self.ghosts.get(&h).is_some_and(|&(gt, _, _)| gt == t)
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
