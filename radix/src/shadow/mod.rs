//! The shadow policy selector ([`crate::EvictionPolicy::Shadow`]): it runs every candidate
//! option on the real request stream in metadata-only shadow caches and follows the one that
//! measurably hits most.
//!
//! Why: each fixed option (LRU or freq-depth eviction, host copies at finish or demotion)
//! wins on some workload and loses on another, and the adaptive policy, which learns from the
//! ghosts of what it evicted, sees only the outcomes of what it currently does — at small
//! capacities too few ghosts come back to learn in time (232 over the whole conversation
//! trace at 10,240 pages, docs/sim.md). A shadow measures a candidate on the same requests
//! at the same time from its own state, so the comparison does not depend on which phase of
//! the trace an option was tried in (what sank a referee that played options in turn).
//!
//! How:
//! - one [`ShadowCache`] per candidate, a real [`crate::RadixCache`] holding page ids and
//!   hashes only, fed each request's prompt at submission (`replay.rs`);
//! - full-size up to [`ShadowConfig::full_size_pages`] of device + host; above, spatially
//!   sampled (SHARDS, Waldspurger et al., FAST'15): a request is replayed only if the hash of
//!   its key page falls in a 1-in-R sample, and the shadows have 1/R of the capacity. The key
//!   is the page [`ShadowConfig::key_page`] deep past the prompt's hot shared prefix (its
//!   trunk: `trunk.rs`; or its last page), so sampling is by conversation, not by page —
//!   a page hit needs its ancestors, and every turn of a conversation has that page — and not
//!   by system prompt, however long the shared prefixes are;
//! - a sign test on the requests where a challenger and the current choice disagree
//!   (`sign_test.rs`) decides a switch, only at fixed request counts
//!   ([`ShadowConfig::decide_every`] submissions), so tensor-parallel ranks, which see the
//!   same submissions, switch in the same step without exchanging a word.
//!
//! Bounded: the shadows hold at most `candidates × full_size_pages` pages of metadata (and,
//! sampled, the hot-prefix table at most `2 × full_size_pages` page keys); a
//! request costs one match and at most two inserts per candidate (measured in
//! `benches/shadow.rs`).

mod replay;
mod sign_test;
mod trunk;

pub use replay::{Candidate, ShadowCache};
pub use sign_test::{Duel, MIN_DISAGREEMENTS, Z2_HUNDREDTHS};

use crate::adaptive::LearntAdmission;
use crate::error::RadixError;
use crate::hash::PageHash;
use crate::policy::EvictionPolicy;
use trunk::Trunks;

/// The selector's constants (frozen before the matrix run of issue 36: see docs/sim/shadow.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShadowConfig {
    /// The candidates; the first is the choice at start.
    pub candidates: Vec<Candidate>,
    /// Device + host pages up to which shadows are full-size; above, sampled 1 in
    /// `ceil(capacity / full_size_pages)`.
    pub full_size_pages: u64,
    /// The depth (pages) past the prompt's hot shared prefix of the page whose hash decides
    /// whether a request is sampled (1: the first page past it).
    pub key_page: usize,
    /// A page is part of hot shared prefixes once this many distinct pages followed it.
    pub hot_fanout: u32,
    /// Pages of each prompt searched for hot shared prefixes (sampled shadows only; the
    /// table keeps at most `2 × full_size_pages` pages).
    pub trunk_depth: usize,
    /// Submissions between two decisions.
    pub decide_every: u64,
    /// Decisions between two halvings of the evidence.
    pub halve_every: u64,
    /// Which 1-in-R sample sampled shadows replay (mixed into the key's hash): the
    /// selector's figures at sampled capacities move with it (docs/sim/shadow.md, round 9).
    pub sample_salt: u64,
}

impl ShadowConfig {
    /// The four fixed options of the policy matrix, LRU with copies at finish first.
    pub fn matrix_candidates() -> Vec<Candidate> {
        let mut out = Vec::new();
        for admission in [LearntAdmission::CopyAtFinish, LearntAdmission::Demote] {
            for eviction in [EvictionPolicy::Lru, EvictionPolicy::CONVERSATION] {
                out.push(Candidate {
                    eviction,
                    admission,
                });
            }
        }
        out
    }

    /// The candidates with one host admission only (a scheduler whose admission is fixed).
    pub fn with_admission(mut self, admission: LearntAdmission) -> ShadowConfig {
        self.candidates.retain(|c| c.admission == admission);
        self
    }
}

impl Default for ShadowConfig {
    fn default() -> Self {
        ShadowConfig {
            candidates: ShadowConfig::matrix_candidates(),
            full_size_pages: 1 << 16,
            key_page: 1,
            hot_fanout: 8,
            trunk_depth: 128,
            decide_every: 64,
            halve_every: 16,
            sample_salt: 0,
        }
    }
}

/// Why a selector could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShadowConfigError {
    #[error("a shadow selector needs at least one candidate")]
    NoCandidate,
    #[error("`{0}` must be positive")]
    Zero(&'static str),
    #[error("candidate `{0}` is itself learnt; shadows compare fixed options only")]
    NotFixed(String),
}

/// One shadow's figures, for reports.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ShadowStat {
    pub candidate: String,
    pub hit_rate: f64,
    pub nodes: usize,
}

/// What the selector chose and saw, for reports and tests.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ShadowSnapshot {
    /// The current choice.
    pub choice: String,
    pub choice_index: usize,
    /// 1 = full-size shadows; R = 1 request prefix in R replayed, capacities / R.
    pub sample: u64,
    pub observed: u64,
    pub replayed: u64,
    pub switches: u64,
    /// (submission count, candidate index) of every switch, oldest first (at most 64 kept).
    pub switch_log: Vec<(u64, usize)>,
    pub shadows: Vec<ShadowStat>,
    /// Page keys in the hot-prefix table (sampled shadows; 0 at full size).
    pub trunk_pages: usize,
}

/// The selector: shadows, evidence and the current choice (see the module docs).
pub struct ShadowSelector {
    cfg: ShadowConfig,
    shadows: Vec<ShadowCache>,
    duels: Vec<Duel>,
    current: usize,
    sample: u64,
    /// The stream's hot shared prefixes, when sampled.
    trunks: Option<Trunks>,
    observed: u64,
    replayed: u64,
    decisions: u64,
    switches: u64,
    switch_log: Vec<(u64, usize)>,
    hits: Vec<usize>,
}

/// Switches kept in the log.
const SWITCH_LOG: usize = 64;

impl ShadowSelector {
    /// A selector for a cache of `device_pages` + `host_pages`.
    pub fn new(
        cfg: ShadowConfig,
        device_pages: u32,
        host_pages: u32,
    ) -> Result<ShadowSelector, ShadowConfigError> {
        if cfg.candidates.is_empty() {
            return Err(ShadowConfigError::NoCandidate);
        }
        for (v, name) in [
            (cfg.full_size_pages, "full_size_pages"),
            (cfg.key_page as u64, "key_page"),
            (u64::from(cfg.hot_fanout), "hot_fanout"),
            (cfg.trunk_depth as u64, "trunk_depth"),
            (cfg.decide_every, "decide_every"),
            (cfg.halve_every, "halve_every"),
        ] {
            if v == 0 {
                return Err(ShadowConfigError::Zero(name));
            }
        }
        if let Some(c) = cfg.candidates.iter().find(|c| {
            matches!(
                c.eviction,
                EvictionPolicy::Adaptive | EvictionPolicy::Shadow
            )
        }) {
            return Err(ShadowConfigError::NotFixed(c.to_string()));
        }
        let total = u64::from(device_pages) + u64::from(host_pages);
        let sample = total.div_ceil(cfg.full_size_pages).max(1);
        let scale = |p: u32| u32::try_from(u64::from(p) / sample).unwrap_or(u32::MAX);
        let shadows = cfg
            .candidates
            .iter()
            .map(|&c| ShadowCache::new(c, scale(device_pages), scale(host_pages)))
            .collect::<Result<Vec<_>, RadixError>>()
            .map_err(|_| ShadowConfigError::Zero("page size"))?;
        let n = shadows.len();
        let trunks = (sample > 1).then(|| {
            let cap = usize::try_from(cfg.full_size_pages).unwrap_or(usize::MAX);
            Trunks::new(cfg.trunk_depth, cfg.hot_fanout, cap)
        });
        Ok(ShadowSelector {
            cfg,
            shadows,
            duels: vec![Duel::default(); n],
            current: 0,
            sample,
            trunks,
            observed: 0,
            replayed: 0,
            decisions: 0,
            switches: 0,
            switch_log: Vec::new(),
            hits: vec![0; n],
        })
    }

    /// The current choice.
    pub fn choice(&self) -> Candidate {
        self.shadows[self.current].candidate
    }

    /// Records a request in the stream's hot shared prefixes and says whether it is in the
    /// sample: the hash of its page `key_page` deep past its trunk (or its last page).
    fn sampled(&mut self, hashes: &[PageHash]) -> bool {
        let Some(trunks) = self.trunks.as_mut() else {
            return true;
        };
        let trunk = trunks.observe(hashes);
        let depth = trunk.saturating_add(self.cfg.key_page).min(hashes.len());
        let Some(key) = hashes.get(depth.saturating_sub(1)) else {
            return false;
        };
        // Mix the key (the low bits of a page hash also index the trees' maps).
        let k = (key.prefix_u64() ^ self.cfg.sample_salt).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (k >> 32).is_multiple_of(self.sample)
    }

    /// Feeds one submitted request's prompt to every shadow (if sampled); at a decision point
    /// switches to a significantly better challenger. Returns true when the choice changed.
    pub fn observe(&mut self, hashes: &[PageHash]) -> bool {
        self.observed += 1;
        if !hashes.is_empty() && self.sampled(hashes) {
            self.replayed += 1;
            for (h, s) in self.hits.iter_mut().zip(self.shadows.iter_mut()) {
                *h = s.replay(hashes);
            }
            let cur = self.hits[self.current];
            for (d, &h) in self.duels.iter_mut().zip(&self.hits) {
                d.record(h, cur);
            }
        }
        if !self.observed.is_multiple_of(self.cfg.decide_every) {
            return false;
        }
        self.decide()
    }

    fn decide(&mut self) -> bool {
        self.decisions += 1;
        let best = (0..self.duels.len())
            .filter(|&i| i != self.current && self.duels[i].significant())
            .max_by_key(|&i| {
                let d = &self.duels[i];
                // Ties go to the lower index (max_by_key keeps the last maximum).
                (d.pages_won - d.pages_lost, std::cmp::Reverse(i))
            });
        if let Some(b) = best {
            self.current = b;
            self.switches += 1;
            if self.switch_log.len() == SWITCH_LOG {
                self.switch_log.remove(0);
            }
            self.switch_log.push((self.observed, b));
            self.duels.iter_mut().for_each(|d| *d = Duel::default());
            return true;
        }
        if self.decisions.is_multiple_of(self.cfg.halve_every) {
            self.duels.iter_mut().for_each(Duel::halve);
        }
        false
    }

    /// The shadows (for tests).
    pub fn shadows(&self) -> &[ShadowCache] {
        &self.shadows
    }

    pub fn snapshot(&self) -> ShadowSnapshot {
        ShadowSnapshot {
            choice: self.choice().to_string(),
            choice_index: self.current,
            sample: self.sample,
            observed: self.observed,
            replayed: self.replayed,
            switches: self.switches,
            switch_log: self.switch_log.clone(),
            shadows: self
                .shadows
                .iter()
                .map(|s| ShadowStat {
                    candidate: s.candidate.to_string(),
                    hit_rate: s.hit_rate(),
                    nodes: s.node_count(),
                })
                .collect(),
            trunk_pages: self.trunks.as_ref().map_or(0, Trunks::len),
        }
    }

    /// Every shadow's invariants, and the evidence's bound (for `check_invariants`).
    pub fn check(&self) -> Result<(), String> {
        for s in &self.shadows {
            s.check_invariants()
                .map_err(|e| format!("shadow {}: {e}", s.candidate))?;
        }
        if self.current >= self.shadows.len() || self.duels[self.current] != Duel::default() {
            return Err("current choice out of range or dueling itself".into());
        }
        Ok(())
    }
}
