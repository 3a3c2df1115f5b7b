//! The adaptive policy's referee: it plays the ghost-learnt setting against the fixed
//! options in phases and keeps whichever measured the best hit rate.
//!
//! Why: the ghost lists learn slowly where they see few hits (small caches: 232 ghost hits in
//! the whole conversation trace at 10,240 pages, three epochs, the level never passes 3), and
//! the learnt host admission compares evidence gathered in different regimes (while demoting,
//! only demotion's mistakes are seen; while copying at finish, only the copies' mistakes), so
//! it swings to whichever it is not doing (docs/sim.md). Measuring the hit rate each setting
//! actually gets on the same stream needs no model of either mistake.
//!
//! How: traffic (pages given to the device tier) is cut into phases of [`PHASE_CAPACITIES`]
//! cache capacities; a phase plays one arm, and only its second half is measured (the first
//! lets the tiers' contents follow the switch): pages matched over pages asked for by
//! distinct lookups. The ghost-learnt arm plays first for [`WARM_PHASES`] phases; then every
//! fixed arm plays once; from then on the best arm by measured rate plays, and every
//! [`EXPLORE_EVERY`]-th phase the runner-up, so a change of workload can overtake. Estimates
//! are halved before each new measurement (recent phases weigh more).
//!
//! Deterministic: driven only by the lookups the cache sees, in their order, with integer
//! arithmetic, so tensor-parallel ranks fed the same operations play the same arms.

use crate::adaptive::{LEVELS, LearntAdmission, knob};

/// A setting the referee can play.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum Arm {
    /// The ghost lists' level and learnt admission.
    #[default]
    Learnt,
    /// A fixed eviction level (0 = LRU, `LEVELS` = freq-depth) and host admission.
    Fixed { level: u32, admission: LearntAdmission },
}

/// Arms, the ghost-learnt one first.
pub(crate) const ARMS: [Arm; 5] = [
    Arm::Learnt,
    Arm::Fixed {
        level: 0,
        admission: LearntAdmission::CopyAtFinish,
    },
    Arm::Fixed {
        level: 0,
        admission: LearntAdmission::Demote,
    },
    Arm::Fixed {
        level: LEVELS,
        admission: LearntAdmission::CopyAtFinish,
    },
    Arm::Fixed {
        level: LEVELS,
        admission: LearntAdmission::Demote,
    },
];

/// A phase lasts this many cache capacities of traffic.
pub const PHASE_CAPACITIES: u64 = 2;
/// The ghost-learnt arm plays this many phases before the fixed ones are tried.
pub const WARM_PHASES: u64 = 2;
/// Once every arm was measured, every this-many-th phase plays the runner-up.
pub const EXPLORE_EVERY: u64 = 6;

#[derive(Debug, Clone)]
pub(crate) struct Referee {
    /// Index into [`ARMS`] of the arm playing now.
    arm: usize,
    /// Traffic when the current phase started.
    phase_start: u64,
    /// Phases finished.
    phases: u64,
    /// This phase's measured (pages matched, pages asked for).
    now: [u64; 2],
    /// Per arm: decayed (pages matched, pages asked for); (0, 0) = never measured.
    est: [[u64; 2]; ARMS.len()],
    /// Phase length in pages of traffic.
    phase_len: u64,
}

impl Referee {
    pub(crate) fn new(capacity: u64) -> Self {
        Referee {
            arm: 0,
            phase_start: 0,
            phases: 0,
            now: [0, 0],
            est: [[0, 0]; ARMS.len()],
            phase_len: capacity.max(1) * knob("KN_PHASE", PHASE_CAPACITIES),
        }
    }

    pub(crate) fn arm(&self) -> Arm {
        ARMS[self.arm]
    }

    /// A distinct lookup asked for `asked` pages and matched `matched` of them at `traffic`.
    /// Returns true when the arm changed (the caller ranks the tree again).
    pub(crate) fn on_lookup(&mut self, matched: usize, asked: usize, traffic: u64) -> bool {
        let into = traffic.saturating_sub(self.phase_start);
        if 2 * into >= self.phase_len {
            self.now[0] += matched as u64;
            self.now[1] += asked as u64;
        }
        if into < self.phase_len {
            return false;
        }
        let e = &mut self.est[self.arm];
        *e = [e[0] / 2 + self.now[0], e[1] / 2 + self.now[1]];
        if e[1] == 0 {
            // Nothing asked: still counts as measured.
            e[1] = 1;
        }
        self.now = [0, 0];
        self.phases += 1;
        self.phase_start = traffic;
        let old = self.arm;
        self.arm = self.next_arm();
        old != self.arm
    }

    fn next_arm(&self) -> usize {
        let warm = knob("KN_WARM", WARM_PHASES);
        if self.phases < warm {
            return 0;
        }
        if let Some(i) = self.est.iter().position(|e| e[1] == 0) {
            return i;
        }
        let mut order: Vec<usize> = (0..ARMS.len()).collect();
        // Best first; ties keep the arms' order (deterministic).
        order.sort_by(|&a, &b| {
            let (x, y) = (self.est[a], self.est[b]);
            (u128::from(y[0]) * u128::from(x[1])).cmp(&(u128::from(x[0]) * u128::from(y[1])))
        });
        let every = knob("KN_EXPLORE", EXPLORE_EVERY).max(1);
        if (self.phases - warm) % every == 0 {
            order[1]
        } else {
            order[0]
        }
    }

    /// Measured rate per arm in per mille (for reports).
    pub(crate) fn rates(&self) -> Vec<u64> {
        self.est
            .iter()
            .map(|e| if e[1] == 0 { 0 } else { e[0] * 1000 / e[1] })
            .collect()
    }
}
