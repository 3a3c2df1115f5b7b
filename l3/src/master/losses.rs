//! The loss journal: keys that stopped existing in the store, for engines that keep
//! "this page is in L3" hints.
//!
//! Why: an engine's prefix cache marks a page as stored in L3 when a backup succeeds, and a
//! write-back policy drops the page's host copy on the strength of that mark. The store
//! evicts on its own schedule (a later put needs the space, an SSD bucket is evicted, a node
//! holding the only replica dies), so the mark goes stale and the dropped page is gone from
//! every tier. With the journal on, every complete object that disappears — for whatever
//! reason, removes included — is recorded, and each engine reads what it has not seen yet and
//! clears its marks (`Scheduler::l3_lost`) before it trusts them again.
//!
//! How: a bounded log with sequence numbers, read with a cursor the *reader* keeps
//! ([`LossCursor`]), so any number of engines (in this process or over RPC) read the same
//! journal without taking entries from each other. A reader that falls behind by more than
//! the capacity, or whose cursor names another journal (the store restarted: a new `epoch`),
//! is told `overflowed`: some losses are unknown and every mark is to be taken as stale.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::types::Tenant;

/// A reader's position in a loss journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LossCursor {
    /// The journal's identity (a new one on every store start).
    pub epoch: u64,
    /// The sequence number of the next entry this reader has not seen.
    pub seq: u64,
}

/// What a reader has not seen yet, for one tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Losses {
    /// Keys gone since the cursor, oldest first. A key may appear more than once (stored
    /// again and lost again).
    pub keys: Vec<String>,
    /// Some losses since the cursor are not listed (the reader fell behind the journal's
    /// capacity, or the store restarted since the cursor was taken).
    pub overflowed: bool,
    /// The cursor to read from next time.
    pub next: LossCursor,
}

/// The master's journal (off when `capacity` is 0).
#[derive(Debug)]
pub(super) struct LossJournal {
    capacity: usize,
    epoch: u64,
    /// Sequence number the next entry gets; the oldest kept is `next_seq - entries.len()`.
    next_seq: u64,
    entries: VecDeque<(Tenant, String)>,
}

impl LossJournal {
    pub(super) fn new(capacity: usize) -> Self {
        // Distinct per start: a cursor taken before a restart must not read the new journal
        // as if it continued the old one.
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        LossJournal {
            capacity,
            epoch,
            next_seq: 0,
            entries: VecDeque::new(),
        }
    }

    pub(super) fn is_on(&self) -> bool {
        self.capacity > 0
    }

    /// Records that `key` of `t` is gone (no-op when the journal is off).
    pub(super) fn record(&mut self, t: &Tenant, key: &str) {
        if self.capacity == 0 {
            return;
        }
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back((t.clone(), key.to_string()));
        self.next_seq += 1;
    }

    fn head(&self) -> LossCursor {
        LossCursor {
            epoch: self.epoch,
            seq: self.next_seq,
        }
    }

    /// Tenant `t`'s losses from `cursor` on; `None` subscribes (nothing listed, the cursor
    /// of the journal's end).
    pub(super) fn since(&self, t: &Tenant, cursor: Option<LossCursor>) -> Losses {
        let next = self.head();
        let mut out = Losses {
            keys: Vec::new(),
            overflowed: false,
            next,
        };
        let Some(c) = cursor else {
            return out;
        };
        if c.epoch != self.epoch || c.seq > self.next_seq {
            out.overflowed = true;
            return out;
        }
        let oldest = self.next_seq - self.entries.len() as u64;
        out.overflowed = c.seq < oldest;
        let skip = c.seq.saturating_sub(oldest) as usize;
        out.keys = (self.entries.iter().skip(skip))
            .filter(|(et, _)| et == t)
            .map(|(_, k)| k.clone())
            .collect();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> Tenant {
        Tenant::new("t").expect("valid tenant")
    }

    fn u() -> Tenant {
        Tenant::new("u").expect("valid tenant")
    }

    #[test]
    fn off_records_nothing() {
        let mut j = LossJournal::new(0);
        assert!(!j.is_on());
        let c = j.since(&t(), None).next;
        j.record(&t(), "a");
        assert_eq!(j.since(&t(), Some(c)).keys, Vec::<String>::new());
    }

    #[test]
    fn readers_keep_their_own_cursors_and_see_their_tenant_only() {
        let mut j = LossJournal::new(8);
        let (a, b) = (j.since(&t(), None).next, j.since(&t(), None).next);
        let cu = j.since(&u(), None).next;
        j.record(&t(), "x");
        j.record(&u(), "y");
        let la = j.since(&t(), Some(a));
        assert_eq!(
            (la.keys.clone(), la.overflowed),
            (vec!["x".to_string()], false)
        );
        assert_eq!(
            j.since(&t(), Some(b)).keys,
            la.keys,
            "a's read took nothing from b"
        );
        assert_eq!(j.since(&u(), Some(cu)).keys, vec!["y".to_string()]);
        assert!(j.since(&t(), Some(la.next)).keys.is_empty());
    }

    #[test]
    fn a_reader_behind_the_capacity_or_from_another_start_is_told_it_overflowed() {
        let mut j = LossJournal::new(2);
        let c = j.since(&t(), None).next;
        for k in ["a", "b", "c"] {
            j.record(&t(), k);
        }
        let l = j.since(&t(), Some(c));
        assert!(l.overflowed);
        assert_eq!(l.keys, vec!["b".to_string(), "c".to_string()]);
        assert!(!j.since(&t(), Some(l.next)).overflowed);
        let other = LossCursor {
            epoch: l.next.epoch ^ 2,
            seq: 0,
        };
        assert!(j.since(&t(), Some(other)).overflowed, "restarted store");
        let ahead = LossCursor {
            seq: l.next.seq + 5,
            ..l.next
        };
        assert!(j.since(&t(), Some(ahead)).overflowed);
    }
}
