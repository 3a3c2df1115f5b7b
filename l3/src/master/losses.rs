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
//!
//! Durable (a master with a settle log: `--state-dir`, or `--etcd`): every entry is a
//! settle-log entry too ([`SettleLogEntry::Lost`]), made durable before any reply leaves,
//! like a tombstone, and the journal's identity and position go with every snapshot
//! (`LossJournal`, at most [`PERSISTED`] entries: older ones are trimmed, and a reader behind
//! them is told `overflowed`). A restarted master or a new etcd leader replays it, so a
//! reader's cursor stays valid across the restart and a loss recorded just before a
//! failover is still reported after it. What such a master cannot name — the losses of the
//! restart itself, when a store node lost its memory meanwhile — is an [`Entry::Unknown`]
//! entry: every reader whose cursor is before it is told `overflowed` (`rebuild`).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::SettleLogEntry;
use crate::types::Tenant;

/// At most this many entries go into a durable snapshot (the whole etcd snapshot must fit
/// one etcd request: 1.5 MiB by default).
pub(super) const PERSISTED: usize = 8192;

/// One journal entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Entry {
    /// A complete object of this tenant and key stopped existing.
    Lost(Tenant, String),
    /// Some losses here are not named (a restart whose nodes lost memory meanwhile).
    Unknown,
}

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
    entries: VecDeque<Entry>,
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

    /// Records that `key` of `t` is gone (no-op when the journal is off); returns the entry
    /// for a durable log.
    pub(super) fn record(&mut self, t: &Tenant, key: &str) -> Option<SettleLogEntry> {
        self.push(Entry::Lost(t.clone(), key.to_string()))
    }

    /// Records that some losses are not named; returns the entry for a durable log.
    pub(super) fn unknown(&mut self) -> Option<SettleLogEntry> {
        self.push(Entry::Unknown)
    }

    fn push(&mut self, e: Entry) -> Option<SettleLogEntry> {
        if self.capacity == 0 {
            return None;
        }
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        let logged = match &e {
            Entry::Lost(t, k) => SettleLogEntry::Lost {
                tenant: t.clone(),
                key: k.clone(),
            },
            Entry::Unknown => SettleLogEntry::LossesUnknown,
        };
        self.entries.push_back(e);
        self.next_seq += 1;
        Some(logged)
    }

    /// The journal as log entries: its identity and the sequence number of the first entry
    /// kept, then the newest [`PERSISTED`] entries (none when the journal is off).
    pub(super) fn snapshot(&self) -> Vec<SettleLogEntry> {
        if self.capacity == 0 {
            return Vec::new();
        }
        let skip = self.entries.len().saturating_sub(PERSISTED);
        let mut out = vec![SettleLogEntry::LossJournal {
            id: self.epoch,
            first_seq: self.next_seq - (self.entries.len() - skip) as u64,
        }];
        out.extend(self.entries.iter().skip(skip).map(|e| match e {
            Entry::Lost(t, k) => SettleLogEntry::Lost {
                tenant: t.clone(),
                key: k.clone(),
            },
            Entry::Unknown => SettleLogEntry::LossesUnknown,
        }));
        out
    }

    /// Replays a journal entry of a durable log (others are ignored).
    pub(super) fn restore(&mut self, e: &SettleLogEntry) {
        match e {
            SettleLogEntry::LossJournal { id, first_seq } => {
                self.epoch = *id;
                self.next_seq = *first_seq;
                self.entries.clear();
            }
            SettleLogEntry::Lost { tenant, key } => {
                self.record(tenant, key);
            }
            SettleLogEntry::LossesUnknown => {
                self.unknown();
            }
            _ => {}
        }
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
        for e in self.entries.iter().skip(skip) {
            match e {
                Entry::Lost(et, k) if et == t => out.keys.push(k.clone()),
                Entry::Lost(..) => {}
                Entry::Unknown => out.overflowed = true,
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A journal replayed from its snapshot and the entries logged after it.
    fn replayed(log: &[SettleLogEntry], capacity: usize) -> LossJournal {
        let mut j = LossJournal::new(capacity);
        for e in log {
            j.restore(e);
        }
        j
    }

    proptest! {
        /// Whatever a reader reads from a journal, it reads the same from the journal a
        /// restart replays from the durable log (snapshot, then the entries logged since),
        /// while the snapshot holds every entry; an `Unknown` entry is an overflow.
        #[test]
        fn a_replayed_journal_answers_every_cursor_as_the_original(
            ops in proptest::collection::vec((0u8..4, 0u8..6), 0..60),
            split in 0usize..60,
            capacity in 1usize..40,
        ) {
            let mut j = LossJournal::new(capacity);
            let mut log = Vec::new();
            let mut cursors = vec![j.since(&t(), None).next];
            for (i, (op, k)) in ops.iter().enumerate() {
                if i == split {
                    log = j.snapshot();
                }
                let tenant = if *op == 1 { u() } else { t() };
                let e = if *op == 3 { j.unknown() } else { j.record(&tenant, &format!("k{k}")) };
                log.extend(e);
                cursors.push(j.since(&t(), None).next);
            }
            if split >= ops.len() {
                log = j.snapshot();
            }
            let r = replayed(&log, capacity);
            for c in cursors {
                prop_assert_eq!(r.since(&t(), Some(c)), j.since(&t(), Some(c)));
                prop_assert_eq!(r.since(&u(), Some(c)), j.since(&u(), Some(c)));
            }
        }
    }

    #[test]
    fn an_unknown_entry_is_an_overflow_for_readers_before_it_only() {
        let mut j = LossJournal::new(8);
        let before = j.since(&t(), None).next;
        j.record(&t(), "a");
        j.unknown();
        let l = j.since(&t(), Some(before));
        assert!(l.overflowed);
        assert_eq!(l.keys, vec!["a".to_string()]);
        j.record(&t(), "b");
        let after = j.since(&t(), Some(l.next));
        assert!(!after.overflowed);
        assert_eq!(after.keys, vec!["b".to_string()]);
    }

    #[test]
    fn a_snapshot_keeps_the_newest_entries_and_a_reader_behind_them_overflows() {
        let mut j = LossJournal::new(PERSISTED * 2);
        let c = j.since(&t(), None).next;
        for i in 0..PERSISTED + 3 {
            j.record(&t(), &format!("k{i}"));
        }
        let snap = j.snapshot();
        assert_eq!(snap.len(), PERSISTED + 1);
        let r = replayed(&snap, PERSISTED * 2);
        let l = r.since(&t(), Some(c));
        assert!(l.overflowed, "the 3 oldest were trimmed");
        assert_eq!(l.keys.first(), Some(&"k3".to_string()));
        assert_eq!(l.next, j.since(&t(), Some(c)).next);
    }

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
