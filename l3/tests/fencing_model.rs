//! A property test of the HA epoch fencing over a simulated cluster: several masters, an
//! etcd model with a leader key under a lease (create revisions, TTL from the moment etcd
//! receives a keep-alive), message delays, paused masters, and store nodes fenced by the
//! real [`EpochFence`]. The masters follow the real rule: act only until `keep-alive sent +
//! TTL - margin` (the real [`margin`]).
//!
//! Invariants, after every step of any schedule:
//! - whenever a master believes it leads, etcd's leader key is its own and unexpired — so
//!   two masters never serve at once (no split brain), even across pauses and slow links;
//! - no two masters ever commit in the same epoch (the fenced txn);
//! - no node ever applies an order from an epoch older than one it has applied.

use std::time::Duration;

use kvtier_l3::ha::EpochFence;
use kvtier_l3::ha::election::margin;
use proptest::prelude::*;

const TTL: u64 = 1000;
const MASTERS: usize = 3;
const NODES: usize = 2;

#[derive(Debug, Clone)]
enum Step {
    /// Master campaigns; its request reaches etcd after `d1` ms, the reply after `d2`.
    Campaign { m: usize, d1: u64, d2: u64 },
    /// Master sends a keep-alive (same delays).
    KeepAlive { m: usize, d1: u64, d2: u64 },
    /// Master is paused (SIGSTOP) for this long: it takes no step meanwhile, then acts on
    /// what it believed before (time does not stop for the others).
    Pause { m: usize, ms: u64 },
    /// Master sends an order to a node, delivered after `delay` ms.
    Order { m: usize, node: usize, delay: u64 },
    /// Master commits a settle in a txn fenced on its epoch, arriving after `d1`.
    Commit { m: usize, d1: u64 },
    /// Time passes.
    Idle { ms: u64 },
}

fn step() -> impl Strategy<Value = Step> {
    let m = 0..MASTERS;
    let d = 0u64..400;
    prop_oneof![
        (m.clone(), d.clone(), d.clone()).prop_map(|(m, d1, d2)| Step::Campaign { m, d1, d2 }),
        (m.clone(), d.clone(), d.clone()).prop_map(|(m, d1, d2)| Step::KeepAlive { m, d1, d2 }),
        (m.clone(), 0u64..3000).prop_map(|(m, ms)| Step::Pause { m, ms }),
        (m.clone(), 0..NODES, 0u64..2000).prop_map(|(m, node, delay)| Step::Order {
            m,
            node,
            delay
        }),
        (m, d).prop_map(|(m, d1)| Step::Commit { m, d1 }),
        (0u64..800).prop_map(|ms| Step::Idle { ms }),
    ]
}

#[derive(Debug, Default, Clone, Copy)]
struct Key {
    owner: usize,
    rev: u64,
    expires: u64,
}

#[derive(Debug, Default)]
struct Sim {
    now: u64,
    rev: u64,
    key: Option<Key>,
    /// Per master: (epoch, valid_until) while it believes it leads.
    leading: [Option<(u64, u64)>; MASTERS],
    /// Orders in flight: (deliver at, node, epoch).
    flight: Vec<(u64, usize, u64)>,
    /// (epoch, master) of every commit etcd accepted.
    commits: Vec<(u64, usize)>,
    /// Per master: stopped until this time.
    paused_until: [u64; MASTERS],
}

impl Sim {
    fn live_key(&self, at: u64) -> Option<Key> {
        self.key.filter(|k| k.expires > at)
    }

    /// What master `m` may act on now (the real check: before its deadline).
    fn valid(&self, m: usize) -> Option<u64> {
        self.leading[m].and_then(|(e, until)| (self.now < until).then_some(e))
    }

    fn advance(&mut self, ms: u64) {
        self.now += ms;
    }
}

fn run(steps: &[Step]) -> Result<(), TestCaseError> {
    let ttl = TTL;
    let margin = margin(Duration::from_millis(TTL)).as_millis() as u64;
    let mut s = Sim::default();
    let nodes: Vec<EpochFence> = (0..NODES).map(|_| EpochFence::default()).collect();
    let mut applied: Vec<u64> = vec![0; NODES];
    for st in steps {
        let actor = match *st {
            Step::Campaign { m, .. }
            | Step::KeepAlive { m, .. }
            | Step::Order { m, .. }
            | Step::Commit { m, .. } => Some(m),
            Step::Pause { .. } | Step::Idle { .. } => None,
        };
        if actor.is_some_and(|m| s.now < s.paused_until[m]) {
            // A stopped process does nothing; time still passes a little.
            s.advance(10);
            continue;
        }
        match *st {
            Step::Campaign { m, d1, d2 } => {
                let sent = s.now;
                s.advance(d1);
                if s.valid(m).is_none() && s.live_key(s.now).is_none() {
                    s.rev += 1;
                    s.key = Some(Key {
                        owner: m,
                        rev: s.rev,
                        expires: s.now + ttl,
                    });
                    s.advance(d2);
                    s.leading[m] = Some((s.rev, sent + ttl - margin));
                } else {
                    s.advance(d2);
                }
            }
            Step::KeepAlive { m, d1, d2 } => {
                let sent = s.now;
                s.advance(d1);
                let mine = s.leading[m].map(|(e, _)| e);
                let renewed = match (s.live_key(s.now), mine) {
                    (Some(k), Some(e)) if k.rev == e => {
                        s.key = Some(Key {
                            expires: s.now + ttl,
                            ..k
                        });
                        true
                    }
                    _ => false,
                };
                s.advance(d2);
                if let Some((e, until)) = s.leading[m] {
                    s.leading[m] = renewed.then_some((e, until.max(sent + ttl - margin)));
                }
            }
            Step::Pause { m, ms } => s.paused_until[m] = s.now + ms,
            Step::Idle { ms } => s.advance(ms),
            Step::Order { m, node, delay } => {
                if let Some(e) = s.valid(m) {
                    s.flight.push((s.now + delay, node, e));
                }
            }
            Step::Commit { m, d1 } => {
                if let Some(e) = s.valid(m) {
                    s.advance(d1);
                    if s.live_key(s.now).is_some_and(|k| k.rev == e) {
                        s.commits.push((e, m));
                    }
                }
            }
        }
        // Deliver the orders that are due, in delivery order.
        s.flight.sort_unstable();
        let now = s.now;
        let due: Vec<_> = s.flight.iter().copied().filter(|o| o.0 <= now).collect();
        s.flight.retain(|o| o.0 > now);
        for (_, node, epoch) in due {
            if nodes[node].admit(epoch).is_ok() {
                prop_assert!(epoch >= applied[node], "node applied an older epoch");
                applied[node] = epoch;
            }
        }
        // No split brain: a master that believes it leads owns the unexpired key.
        for m in 0..MASTERS {
            if let Some(e) = s.valid(m) {
                let k = s.live_key(s.now);
                prop_assert!(
                    k.is_some_and(|k| k.owner == m && k.rev == e),
                    "master {m} acts on epoch {e} but etcd holds {k:?} at {}",
                    s.now
                );
            }
        }
        let leaders = (0..MASTERS).filter(|&m| s.valid(m).is_some()).count();
        prop_assert!(leaders <= 1, "{leaders} masters serve at once");
    }
    for (i, a) in s.commits.iter().enumerate() {
        for b in &s.commits[i + 1..] {
            prop_assert!(
                a.0 != b.0 || a.1 == b.1,
                "two masters committed in epoch {}",
                a.0
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn epochs_fence_masters_and_nodes(steps in proptest::collection::vec(step(), 1..80)) {
        run(&steps)?;
    }
}

/// The rule the model relies on, and that a wrong margin breaks: a leader that trusted
/// `sent + TTL` *plus* a slack instead of minus a margin serves while a successor leads.
#[test]
fn a_leader_without_the_margin_would_overlap_its_successor() {
    // Keep-alive sent at 0 reaches etcd at 300: etcd expires the key at 1300. A master that
    // took its reply (at 600) as "valid until 600 + TTL" would serve until 1600.
    let (sent, arrive, reply) = (0u64, 300u64, 600u64);
    let etcd_expiry = arrive + TTL;
    let wrong_until = reply + TTL;
    let right_until = sent + TTL - margin(Duration::from_millis(TTL)).as_millis() as u64;
    assert!(
        wrong_until > etcd_expiry,
        "the wrong rule overlaps a successor"
    );
    assert!(right_until <= etcd_expiry);
}
