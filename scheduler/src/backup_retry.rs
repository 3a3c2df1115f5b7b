//! Failed backups tried again: the retry queue both backup planners share, the
//! [`crate::Scheduler`] (`lifecycle.rs`) and the [`crate::OffloadManager`] (`offload_l3.rs`).
//!
//! Why: a backup that fails (L3 down, or refusing) leaves its pages on host and out of L3;
//! unless they are planned again, pages computed while the L3 server was down never reach it
//! after it comes back, and other instances compute them again. Why a queue that waits for L3
//! to answer: a store that is down would cost a failed job per step for every page already
//! failed; new pages' backups are still tried, and are the probe that L3 is back. Each planner
//! says what "answered" is (a backup done, a read that found pages) and how a run is planned
//! (which pages are still on host and not in L3 nor being sent); the queue holds the runs,
//! their tries and the bounds.
//!
//! Why a probe: an engine that, once L3 is back, serves only requests whose pages are on
//! device or host stores nothing (no new backup) and reads nothing, so L3 never answers and
//! its backlog would wait until some unrelated store. So while failing, one plan in
//! [`BackupRetry::probe_every`] (counted in plans, the planners' only clock: neither has a
//! wall clock of its own) tries the oldest waiting run again as the probe, at most
//! [`BackupRetry::pages_per_plan`] of its pages; a failure (the probe's or any backup's)
//! starts the count again. The probed run stays waiting, so its failure costs it no try (a
//! long outage gives nothing up) and its success (L3 answered) lets the next plan retry the
//! rest. A server that is down thus costs at most one backup per `probe_every` plans.

use std::collections::VecDeque;

use kvtier_radix::PageHash;

/// How failed backups are tried again (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackupRetry {
    /// The most retried pages one plan plans (0: no retries).
    pub pages_per_plan: usize,
    /// How many times a failed run is tried again before it is given up.
    pub tries: u32,
    /// The most failed runs waiting (the oldest are given up beyond it).
    pub max_waiting: usize,
    /// While L3 has not answered since the last failure, one plan in this many tries the
    /// oldest waiting run as a probe (module doc); 0: never (only L3's answers let retries
    /// go).
    pub probe_every: u32,
}

impl Default for BackupRetry {
    fn default() -> Self {
        Self {
            pages_per_plan: 64,
            tries: 8,
            max_waiting: 4096,
            probe_every: 64,
        }
    }
}

/// A run of a chain to back up: pages `from..chain.len()`, tried `tries` times so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) chain: Vec<PageHash>,
    pub(crate) from: usize,
    pub(crate) tries: u32,
}

/// Runs whose backup failed, oldest first, waiting for L3 to answer again.
#[derive(Debug, Default)]
pub(crate) struct RetryQueue {
    waiting: VecDeque<Run>,
    /// The last L3 outcome heard was a failed backup: retries wait for L3 to answer.
    failing: bool,
    conf: BackupRetry,
    /// Failed runs given up (out of tries, or beyond `max_waiting`).
    given_up: u64,
    /// Retried runs planned (a run cut by the per-plan bound counts once per plan).
    retried: u64,
    /// Plans while failing since the last failure or probe (the probe's clock).
    quiet_plans: u32,
    /// Probes planned (a waiting run tried while failing).
    probes: u64,
}

impl RetryQueue {
    pub(crate) fn set_conf(&mut self, conf: BackupRetry) {
        self.conf = conf;
    }

    /// L3 answered (a write or a read succeeded): failed backups may be tried again.
    pub(crate) fn answered(&mut self) {
        self.failing = false;
        self.quiet_plans = 0;
    }

    /// A failed backup's run waits to be tried again (or is given up). A run within one
    /// already waiting (from the same page, its chain a prefix of the waiting one's: a
    /// chain's last page names the chain) waits in it, and costs it no try: write-back backs
    /// the same pages up at each try to free host space while L3 is down (a copy per failure
    /// pushed other runs out past `max_waiting`), and a probe's run stays waiting while it is
    /// tried. A failure restarts the probe's count.
    pub(crate) fn failed(&mut self, mut run: Run) {
        self.failing = true;
        self.quiet_plans = 0;
        let within = |w: &Run| {
            w.from == run.from
                && run.chain.len() <= w.chain.len()
                && run.chain.last() == run.chain.len().checked_sub(1).and_then(|i| w.chain.get(i))
        };
        if self.waiting.iter().any(within) {
            return;
        }
        run.tries = run.tries.saturating_add(1);
        if run.tries > self.conf.tries {
            self.given_up += 1;
            return;
        }
        self.waiting.push_back(run);
        while self.waiting.len() > self.conf.max_waiting {
            self.waiting.pop_front();
            self.given_up += 1;
        }
    }

    /// Whether the next plan would try a failed run again: L3 answered since the last
    /// failure, or the probe is due (module doc).
    pub(crate) fn due(&self) -> bool {
        self.retrying()
            && (!self.failing || self.quiet_plans.saturating_add(1) >= self.conf.probe_every)
    }

    /// Whether plans count towards the probe now: failing, runs waiting, and probes on.
    pub(crate) fn counting(&self) -> bool {
        self.failing && self.conf.probe_every > 0 && self.retrying()
    }

    /// Runs wait, and the bounds let them be retried at all.
    fn retrying(&self) -> bool {
        !self.waiting.is_empty() && self.conf.pages_per_plan > 0
    }

    /// Runs waiting, runs given up so far, retried runs planned so far.
    pub(crate) fn counts(&self) -> (usize, u64, u64) {
        (self.waiting.len(), self.given_up, self.retried)
    }

    /// Probes planned so far (waiting runs tried while L3 had not answered).
    pub(crate) fn probes(&self) -> u64 {
        self.probes
    }

    /// Plans the waiting runs, oldest first, once L3 has answered since the last failure: at
    /// most `pages_per_plan` pages in all. `plan(run, budget)` plans at most `budget` pages of
    /// `run` and returns how many it planned and what is left of the run beyond them; a run
    /// with nothing planned is dropped (its pages left host, are in L3, or are being sent).
    /// While failing, one call in `probe_every` plans the probe instead (module doc); every
    /// call counts, so the planner calls this every plan while [`Self::counting`].
    pub(crate) fn plan(&mut self, mut plan: impl FnMut(Run, usize) -> (usize, Option<Run>)) {
        if self.failing {
            if self.counting() {
                self.quiet_plans = self.quiet_plans.saturating_add(1);
                if self.quiet_plans >= self.conf.probe_every {
                    self.quiet_plans = 0;
                    self.probe(plan);
                }
            }
            return;
        }
        let mut budget = self.conf.pages_per_plan;
        while budget > 0 {
            let Some(run) = self.waiting.pop_front() else {
                break;
            };
            let (planned, rest) = plan(run, budget);
            if planned > 0 {
                self.retried += 1;
            }
            budget = budget.saturating_sub(planned);
            if let Some(rest) = rest {
                self.waiting.push_front(rest);
                if planned == 0 {
                    break; // nothing planned now: the rest waits for the next plan
                }
            }
        }
    }
}

impl RetryQueue {
    /// Plans the oldest waiting run that has pages to back up as the probe; it stays waiting
    /// (its failure costs no try, its success lets the next plan retry it and the rest). Runs
    /// with nothing to plan before it are dropped, as a plan drops them.
    fn probe(&mut self, mut plan: impl FnMut(Run, usize) -> (usize, Option<Run>)) {
        while let Some(run) = self.waiting.front() {
            let (planned, rest) = plan(run.clone(), self.conf.pages_per_plan);
            if planned > 0 {
                self.probes += 1;
                return;
            }
            if rest.is_some() {
                return; // nothing plannable now, but the run is not done: it waits
            }
            self.waiting.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(n: usize) -> Run {
        Run {
            chain: (0..n as u8).map(|i| PageHash([i; 32])).collect(),
            from: 0,
            tries: 0,
        }
    }

    #[test]
    fn nothing_is_tried_before_l3_answers_and_each_plan_is_bounded() {
        let mut q = RetryQueue::default();
        q.set_conf(BackupRetry {
            pages_per_plan: 3,
            ..BackupRetry::default()
        });
        q.failed(run(5));
        assert!(!q.due());
        q.plan(|_, _| panic!("planned while L3 had not answered"));
        q.answered();
        assert!(q.due());
        let mut seen = Vec::new();
        q.plan(|r, budget| {
            let n = (r.chain.len() - r.from).min(budget);
            seen.push(n);
            let rest = (r.from + n < r.chain.len()).then(|| Run {
                from: r.from + n,
                ..r.clone()
            });
            (n, rest)
        });
        assert_eq!(seen, vec![3]);
        assert_eq!(q.counts(), (1, 0, 1));
    }

    #[test]
    fn runs_out_of_tries_or_room_are_given_up() {
        let mut q = RetryQueue::default();
        q.set_conf(BackupRetry {
            pages_per_plan: 8,
            tries: 1,
            max_waiting: 1,
            ..BackupRetry::default()
        });
        q.failed(run(1));
        q.failed(run(2));
        assert_eq!(
            q.counts(),
            (1, 1, 0),
            "the oldest given up beyond max_waiting"
        );
        let again = Run { tries: 1, ..run(3) };
        q.failed(again);
        assert_eq!(q.counts(), (1, 2, 0), "out of tries");
    }

    /// A run that fails again while it waits (write-back backs the same pages up at each try
    /// to free host space while L3 is down) waits once: before, each failure queued another
    /// copy, and the copies pushed other runs out past `max_waiting` (given up, never tried
    /// again) though each copy was dropped when planned.
    #[test]
    fn a_run_failing_again_while_it_waits_waits_once() {
        let mut q = RetryQueue::default();
        q.set_conf(BackupRetry {
            pages_per_plan: 64,
            tries: 8,
            max_waiting: 2,
            ..BackupRetry::default()
        });
        q.failed(run(1));
        for _ in 0..5 {
            q.failed(run(4));
        }
        assert_eq!(q.counts(), (2, 0, 0), "run(1) still waits, run(4) once");
        let other_span = Run { from: 2, ..run(4) };
        q.failed(other_span);
        assert_eq!(q.counts(), (2, 1, 0), "another span is another run");
    }
}
