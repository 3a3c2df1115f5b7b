//! The fault schedule: every 0.5–1.5 × `--fault-every-ms` one of the `--faults` kinds is
//! injected (dealt from a shuffled deck), and what it stopped is brought back later (a queue of timed events), until
//! `--seconds` have passed.
//!
//! Why a queue and not sleeps: faults overlap (a node is down while the leader is paused),
//! and the `paused-free` kind is a timed sequence of several signals (issue 33 item 1)
//! whose steps must happen while the rest of the chaos goes on.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::ValueEnum;

use crate::cluster::{Cluster, Masters};
use crate::ha::ETCD_MEMBERS;
use crate::oracle::Rng;
use crate::workload::Counts;

/// A kind of fault (`--faults` takes several, comma-separated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Faults {
    /// Store nodes SIGKILLed (back after 0.2–1.7 s, same id and SSD dir).
    Nodes,
    /// The master, or the etcd leader: SIGKILL, or one time in three SIGSTOP + SIGCONT.
    Master,
    /// `nodes` and `master`, sometimes together.
    Both,
    /// A store node SIGSTOPped, SIGCONTed after 0.25–2 × `--ttl-ms` (so sometimes after the
    /// master has declared it dead).
    NodePause,
    /// Issue 33's sequence (etcd masters): a node SIGSTOPped while the workers only remove,
    /// the leader SIGSTOPped, the node resumed (its ping queues at the paused leader and
    /// times out), the leader resumed 1.6 s later, then SIGKILLed 0.5–1.5 s later.
    PausedFree,
    /// One etcd member of three SIGKILLed (never two at once), restarted after 0.5–3 s on
    /// its ports and data dir (etcd masters).
    Etcd,
}

impl Faults {
    /// Needs `--masters` (an etcd deployment).
    pub fn needs_etcd(self) -> bool {
        matches!(self, Faults::PausedFree | Faults::Etcd)
    }

    /// How often it is picked relative to the others: the paused-free sequence is the one
    /// a short run must hit several times, and it cannot start while a failover is going on.
    fn weight(self) -> u64 {
        match self {
            Faults::PausedFree => 2,
            _ => 1,
        }
    }
}

/// What the schedule needs from the arguments.
pub struct Plan {
    pub faults: Vec<Faults>,
    pub seconds: u64,
    pub fault_every_ms: u64,
    /// The master's node liveness TTL.
    pub ttl_ms: u64,
    pub seed: u64,
    /// Tells the workers to only remove (the paused-free sequence's remove burst).
    pub burst: Arc<AtomicBool>,
    /// What the workers got answered (a leader that answers is serving, not rebuilding).
    pub counts: Arc<Counts>,
}

/// Faults injected, by kind.
#[derive(Debug, Default)]
pub struct Tally {
    pub node_kills: u64,
    pub node_pauses: u64,
    /// Of the node pauses, those longer than the node TTL.
    pub node_pauses_past_ttl: u64,
    /// The single master SIGKILLed, or the etcd leader SIGKILLed or SIGSTOPped.
    pub master: u64,
    /// Of the master faults, leaders SIGSTOPped (the rest SIGKILLed).
    pub master_paused: u64,
    /// Paused-free sequences started.
    pub paused_free: u64,
    /// Of those, the ones whose leader kept its lease across its pause and was SIGKILLed as
    /// the leader (issue 33's exact sequence; otherwise a failover happened in between).
    pub paused_free_held: u64,
    pub etcd_kills: u64,
}

impl Tally {
    pub fn total(&self) -> u64 {
        self.node_kills + self.node_pauses + self.master + self.paused_free + self.etcd_kills
    }

    /// The summary line.
    pub fn line(&self) -> String {
        format!(
            "faults: node kills {}, node pauses {} (past the node TTL {}), master faults {} \
             (SIGSTOP + SIGCONT {}), paused-free sequences {} (leader kept across its pause \
             {}), etcd member kills {}",
            self.node_kills,
            self.node_pauses,
            self.node_pauses_past_ttl,
            self.master,
            self.master_paused,
            self.paused_free,
            self.paused_free_held,
            self.etcd_kills,
        )
    }
}

/// A step of the paused-free sequence.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// SIGSTOP the node (the workers only remove by now).
    PauseNode { node: usize },
    /// SIGSTOP the leader (node `node` is paused).
    PauseLeader { node: usize },
    /// SIGCONT the node: its next ping goes to the paused leader.
    ResumeNode { node: usize, leader: usize },
    /// SIGCONT the leader.
    ResumeLeader { leader: usize },
    /// SIGKILL the leader.
    KillLeader { leader: usize },
}

/// Something to do at a given time.
#[derive(Debug, Clone, Copy)]
enum Event {
    /// Restart a killed node.
    ReviveNode(usize),
    /// SIGCONT a paused node.
    ResumeNode(usize),
    /// Restart the single master.
    ReviveMaster,
    /// SIGCONT or restart an etcd master.
    ReviveHa(usize),
    /// Restart the etcd member that is down.
    RestartEtcd,
    Seq(Step),
}

/// The paused-free leader pause (issue 33: longer than a node's `--master-timeout-ms`
/// 1000, shorter than a leader lease of 2 s or more).
const LEADER_PAUSE: Duration = Duration::from_millis(1_600);

struct Injector<'a> {
    c: &'a mut Cluster,
    plan: &'a Plan,
    rng: Rng,
    tally: Tally,
    events: Vec<(Instant, Event)>,
    /// A paused-free sequence is under way: no other fault starts.
    in_sequence: bool,
    /// A paused-free sequence was picked and starts as soon as a leader serves (after a
    /// failover); no master fault meanwhile.
    sequence_due: bool,
    /// The workers' answers so far, and when they last grew.
    answered: (u64, Instant),
    /// Kinds still to deal ([`Injector::pick`]).
    deck: Vec<Faults>,
}

/// Injects faults until `plan.seconds` have passed; what is still down or paused then is
/// left to [`Cluster::revive_all`].
pub fn inject(c: &mut Cluster, plan: &Plan) -> Result<Tally, String> {
    let mut inj = Injector {
        c,
        plan,
        rng: Rng::new(plan.seed ^ 0x5eed),
        tally: Tally::default(),
        events: Vec::new(),
        in_sequence: false,
        sequence_due: false,
        answered: (0, Instant::now()),
        deck: Vec::new(),
    };
    let r = inj.run();
    plan.burst.store(false, Ordering::Relaxed);
    r.map(|()| inj.tally)
}

impl Injector<'_> {
    /// `base` plus up to `spread` ms.
    fn ms(&mut self, base: u64, spread: u64) -> Duration {
        Duration::from_millis(base + self.rng.below(spread))
    }

    fn at(&mut self, t: Instant, e: Event) {
        self.events.push((t, e));
    }

    fn run(&mut self) -> Result<(), String> {
        let every = self.plan.fault_every_ms;
        let end = Instant::now() + Duration::from_secs(self.plan.seconds);
        let mut next = Instant::now() + Duration::from_millis(every);
        while Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
            let now = Instant::now();
            let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.events)
                .into_iter()
                .partition(|(t, _)| *t <= now);
            self.events = later;
            for (_, e) in due {
                self.handle(e, now)?;
            }
            let c = &self.plan.counts;
            let answered = [&c.puts_acked, &c.removes_acked, &c.reads_checked]
                .iter()
                .map(|a| a.load(Ordering::Relaxed))
                .sum();
            if answered > self.answered.0 {
                self.answered = (answered, now);
            }
            if self.sequence_due && !self.in_sequence && self.start_sequence(now) {
                self.sequence_due = false;
            }
            if now < next {
                continue;
            }
            next = now + Duration::from_millis(every / 2 + self.rng.below(every));
            if self.in_sequence {
                continue;
            }
            let kind = self.pick();
            self.fault(kind, now);
        }
        Ok(())
    }

    /// The next kind: drawn from a shuffled deck holding each kind `weight` times, dealt
    /// out before it is shuffled again, so every kind comes up regularly even in a short
    /// run. No draw when there is one kind (a one-kind schedule is the same for a seed as
    /// before there were several).
    fn pick(&mut self) -> Faults {
        let f = &self.plan.faults;
        if f.len() == 1 {
            return f[0];
        }
        if self.deck.is_empty() {
            self.deck = f
                .iter()
                .flat_map(|k| std::iter::repeat_n(*k, k.weight() as usize))
                .collect();
            for i in (1..self.deck.len()).rev() {
                let j = self.rng.below(i as u64 + 1) as usize;
                self.deck.swap(i, j);
            }
        }
        self.deck.pop().unwrap_or(f[0])
    }

    fn fault(&mut self, kind: Faults, now: Instant) {
        match kind {
            Faults::Nodes => self.kill_node(now),
            Faults::Master => self.master_fault(now),
            Faults::Both => {
                let node_kill = self.rng.below(10) < 6;
                let also_node = self.rng.below(5) == 0;
                if node_kill || also_node {
                    self.kill_node(now);
                }
                if !node_kill {
                    self.master_fault(now);
                }
            }
            Faults::NodePause => self.pause_node(now),
            Faults::PausedFree => self.sequence_due = true,
            Faults::Etcd => self.kill_etcd(now),
        }
    }

    fn handle(&mut self, e: Event, now: Instant) -> Result<(), String> {
        match e {
            // A node exits when it cannot mount (its master is down): try again soon, as a
            // supervisor would.
            Event::ReviveNode(i) => {
                if self.c.revive_node(i).is_err() {
                    self.at(now + Duration::from_millis(300), e);
                }
            }
            Event::ResumeNode(i) => self.c.resume_node(i),
            Event::ReviveMaster => self.c.revive_single()?,
            Event::ReviveHa(i) => self.c.revive_ha(i)?,
            Event::RestartEtcd => {
                if let Masters::Ha(h) = &mut self.c.masters
                    && let Err(err) = h.restart_etcd()
                {
                    tracing::warn!(error = %err, "etcd member restart; again");
                    self.at(now + Duration::from_millis(300), e);
                }
            }
            Event::Seq(s) => self.step(s, now),
        }
        Ok(())
    }

    /// A live node to stop, keeping at least one node up.
    fn pick_live_node(&mut self) -> Option<usize> {
        let live: Vec<usize> = (0..self.c.nodes()).filter(|i| self.c.node_up(*i)).collect();
        if live.len() < 2 {
            return None;
        }
        Some(live[self.rng.below(live.len() as u64) as usize])
    }

    fn kill_node(&mut self, now: Instant) {
        if let Some(i) = self.pick_live_node() {
            tracing::info!(node = i, "SIGKILL node");
            self.c.kill_node(i);
            self.tally.node_kills += 1;
            let back = now + self.ms(200, 1_500);
            self.at(back, Event::ReviveNode(i));
        }
    }

    fn pause_node(&mut self, now: Instant) {
        if let Some(i) = self.pick_live_node() {
            self.c.pause_node(i);
            self.tally.node_pauses += 1;
            let ttl = self.plan.ttl_ms;
            let d = self.ms(ttl / 4, ttl * 7 / 4);
            tracing::info!(node = i, ms = d.as_millis(), "SIGSTOP node");
            if d > Duration::from_millis(ttl) {
                self.tally.node_pauses_past_ttl += 1;
            }
            self.at(now + d, Event::ResumeNode(i));
        }
    }

    /// Kills the single master, or kills or pauses the etcd leader (when one is serving and
    /// no paused-free sequence waits for it).
    fn master_fault(&mut self, now: Instant) {
        if self.sequence_due {
            return;
        }
        let rng = &mut self.rng;
        match &mut self.c.masters {
            Masters::Single(s) => {
                if s.proc.is_some() {
                    s.proc = None;
                    self.tally.master += 1;
                    let back = now + Duration::from_millis(100 + rng.below(900));
                    self.events.push((back, Event::ReviveMaster));
                }
            }
            Masters::Ha(h) => {
                let Some(i) = h.live_leader() else {
                    return;
                };
                self.tally.master += 1;
                let pause = rng.below(3) == 0;
                tracing::info!(master = i, pause, "leader fault");
                let back = if pause {
                    // Long enough, often, for its lease to run out: it must step down.
                    h.pause(i);
                    self.tally.master_paused += 1;
                    now + Duration::from_millis(300 + rng.below(2_500))
                } else {
                    h.kill(i);
                    now + Duration::from_millis(100 + rng.below(900))
                };
                self.events.push((back, Event::ReviveHa(i)));
            }
        }
    }

    fn kill_etcd(&mut self, now: Instant) {
        let rng = &mut self.rng;
        let Masters::Ha(h) = &mut self.c.masters else {
            return;
        };
        // Half the time etcd's raft leader (an election), else any member.
        let any = rng.below(ETCD_MEMBERS as u64) as usize;
        let i = if rng.below(2) == 0 {
            h.etcd_leader().unwrap_or(any)
        } else {
            any
        };
        if h.kill_etcd(i) {
            tracing::info!(member = i, "SIGKILL etcd member");
            self.tally.etcd_kills += 1;
            let back = now + Duration::from_millis(500 + rng.below(2_500));
            self.events.push((back, Event::RestartEtcd));
        }
    }

    /// Issue 33's sequence, first step: the workers switch to removes only (a remove goes
    /// to the master alone: none of them will be waiting on the node when it is paused, so
    /// removes go on while it is), and the node is paused 100 ms later. Whether it started:
    /// not while only one node runs, or no leader serves (a new one rebuilds until every
    /// node is back; removes it refuses meanwhile would leave the model unsure what exists).
    fn start_sequence(&mut self, now: Instant) -> bool {
        let Masters::Ha(h) = &self.c.masters else {
            return true;
        };
        let serving = now.duration_since(self.answered.1) < Duration::from_millis(100);
        if !serving || h.live_leader().is_none() {
            return false;
        }
        let Some(node) = self.pick_live_node() else {
            return false;
        };
        self.plan.burst.store(true, Ordering::Relaxed);
        self.tally.paused_free += 1;
        self.in_sequence = true;
        let t = now + Duration::from_millis(100);
        self.at(t, Event::Seq(Step::PauseNode { node }));
        true
    }

    /// The end of a sequence (done or given up).
    fn end_sequence(&mut self) {
        self.plan.burst.store(false, Ordering::Relaxed);
        self.in_sequence = false;
    }

    fn step(&mut self, s: Step, now: Instant) {
        tracing::info!(step = ?s, "paused-free");
        if let Step::PauseNode { node } = s {
            if !self.c.node_up(node) {
                self.end_sequence();
                return;
            }
            // Removes meanwhile; not so long that the master declares it dead before the
            // leader is paused.
            self.c.pause_node(node);
            let t = now + self.ms(300, 500);
            self.at(t, Event::Seq(Step::PauseLeader { node }));
            return;
        }
        let rng = &mut self.rng;
        let Masters::Ha(h) = &mut self.c.masters else {
            self.end_sequence();
            return;
        };
        match s {
            Step::PauseNode { .. } => {}
            Step::PauseLeader { node } => match h.live_leader() {
                Some(leader) => {
                    self.plan.burst.store(false, Ordering::Relaxed);
                    h.pause(leader);
                    let t = now + Duration::from_millis(50);
                    self.events
                        .push((t, Event::Seq(Step::ResumeNode { node, leader })));
                }
                None => {
                    tracing::info!("paused-free: no live leader, given up");
                    // A failover under way (a leader's lease ran out): give up.
                    self.c.resume_node(node);
                    self.end_sequence();
                }
            },
            Step::ResumeNode { node, leader } => {
                self.c.resume_node(node);
                let t = now + LEADER_PAUSE - Duration::from_millis(50);
                self.events
                    .push((t, Event::Seq(Step::ResumeLeader { leader })));
            }
            Step::ResumeLeader { leader } => {
                h.resume(leader);
                // A few of the node's 100 ms pings (after its timed-out one, it may wait
                // for another timeout before it pings the resumed leader).
                let t = now + Duration::from_millis(500 + rng.below(1_000));
                self.events
                    .push((t, Event::Seq(Step::KillLeader { leader })));
            }
            Step::KillLeader { leader } => {
                // As `end_sequence` (`h` borrows the cluster).
                self.plan.burst.store(false, Ordering::Relaxed);
                self.in_sequence = false;
                let victim = if h.is_live_leader(leader) {
                    self.tally.paused_free_held += 1;
                    Some(leader)
                } else {
                    h.live_leader()
                };
                tracing::info!(leader, ?victim, "paused-free: SIGKILL");
                if let Some(i) = victim {
                    h.kill(i);
                    let t = now + Duration::from_millis(100 + rng.below(900));
                    self.events.push((t, Event::ReviveHa(i)));
                }
            }
        }
    }
}
