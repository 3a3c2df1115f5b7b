//! Rate-limited warnings for refusals a peer can repeat at will.
//!
//! Why: a peer of another protocol version (a client or store node left on the old release)
//! is refused at `hello` and dials again for as long as it runs; a warning per connection
//! flooded the server's log (one line per refused dial). The first refusal is warned of at
//! once, later ones at most once per period, with how many were not warned of since.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Decides which of a stream of events to log: the first, then at most one per `every`.
pub(crate) struct EveryLog {
    every: Duration,
    /// When the last logged event was, and how many were not logged since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl EveryLog {
    /// Logs at most one event per `every`.
    pub(crate) const fn new(every: Duration) -> Self {
        EveryLog {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// The period.
    pub(crate) fn every(&self) -> Duration {
        self.every
    }

    /// One event at `now`: `Some(n)` when it is to be logged, `n` the events not logged
    /// since the last logged one; `None` when it is not (counted for the next one).
    pub(crate) fn note(&self, now: Instant) -> Option<u64> {
        let mut g = self.state.lock();
        let due = match g.0 {
            None => true,
            Some(last) => now.saturating_duration_since(last) >= self.every,
        };
        if due {
            g.0 = Some(now);
            Some(std::mem::take(&mut g.1))
        } else {
            g.1 = g.1.saturating_add(1);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the events' spacing: the first is logged, logged events are at least a
        /// period apart, an event a period after the last logged one is logged, and every
        /// event is either logged or counted in the next logged one (or still pending).
        #[test]
        fn at_most_one_per_period_and_none_uncounted(
            gaps in prop::collection::vec(0u64..3_000, 1..200),
        ) {
            let every = Duration::from_secs(1);
            let log = EveryLog::new(every);
            let t0 = Instant::now();
            let mut at = t0;
            let mut last: Option<Instant> = None;
            let (mut logged, mut counted) = (0u64, 0u64);
            for (i, g) in gaps.iter().enumerate() {
                at += Duration::from_millis(*g);
                let due = last.is_none_or(|l| at - l >= every);
                match log.note(at) {
                    Some(n) => {
                        prop_assert!(due, "event {i} logged within a period of the last");
                        logged += 1;
                        counted += n;
                        last = Some(at);
                    }
                    None => prop_assert!(!due, "event {i} due and not logged"),
                }
            }
            let pending = log.state.lock().1;
            prop_assert_eq!(logged + counted + pending, gaps.len() as u64);
        }
    }
}
