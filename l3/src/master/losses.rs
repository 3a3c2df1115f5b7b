//! The loss journal: keys that stopped existing in the store, for an engine that keeps
//! "this page is in L3" hints.
//!
//! Why: an engine's prefix cache marks a page as stored in L3 when a backup succeeds, and a
//! write-back policy drops the page's host copy on the strength of that mark. The store
//! evicts on its own schedule (a later put needs the space, an SSD bucket is evicted, a node
//! holding the only replica dies), so the mark goes stale and the dropped page is gone from
//! every tier. With the journal on, every object that disappears — for whatever reason,
//! removes included — is recorded once, and the engine drains the journal and clears its
//! marks (`Scheduler::l3_lost`) before it trusts them again.
//!
//! Bounded: past `capacity` entries the oldest are dropped and `overflowed` is set for the
//! dropped entry's tenant, which tells that tenant's reader that some losses are unknown (it
//! must treat every mark as stale). Each tenant's reader drains its own entries only.

use std::collections::{HashSet, VecDeque};

use crate::types::Tenant;

/// Keys that stopped existing since the last drain.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Losses {
    /// (tenant, key) of each object gone, oldest first. A key may appear more than once
    /// (stored again and lost again).
    pub keys: Vec<(Tenant, String)>,
    /// Entries were dropped because the journal was full: some losses are not listed.
    pub overflowed: bool,
}

/// The master's journal (off when `capacity` is 0).
#[derive(Debug, Default)]
pub(super) struct LossJournal {
    capacity: usize,
    keys: VecDeque<(Tenant, String)>,
    /// Tenants an entry was dropped for since their last drain.
    overflowed: HashSet<Tenant>,
}

impl LossJournal {
    pub(super) fn new(capacity: usize) -> Self {
        LossJournal {
            capacity,
            keys: VecDeque::new(),
            overflowed: HashSet::new(),
        }
    }

    /// Records that `key` of `t` is gone (no-op when the journal is off).
    pub(super) fn record(&mut self, t: &Tenant, key: &str) {
        if self.capacity == 0 {
            return;
        }
        if self.keys.len() == self.capacity
            && let Some((dropped, _)) = self.keys.pop_front()
        {
            self.overflowed.insert(dropped);
        }
        self.keys.push_back((t.clone(), key.to_string()));
    }

    /// The entries of tenant `only` (of every tenant with `None`), taken out of the journal.
    pub(super) fn drain(&mut self, only: Option<&Tenant>) -> Losses {
        let Some(t) = only else {
            return Losses {
                keys: self.keys.drain(..).collect(),
                overflowed: !std::mem::take(&mut self.overflowed).is_empty(),
            };
        };
        let (mine, rest): (VecDeque<_>, VecDeque<_>) =
            self.keys.drain(..).partition(|(k, _)| k == t);
        self.keys = rest;
        Losses {
            keys: mine.into(),
            overflowed: self.overflowed.remove(t),
        }
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
    fn a_tenant_drains_its_own_entries_and_overflows() {
        let mut j = LossJournal::new(2);
        j.record(&t(), "a");
        j.record(&u(), "b");
        j.record(&u(), "c");
        let l = j.drain(Some(&t()));
        assert!(l.overflowed, "t's entry was dropped");
        assert!(l.keys.is_empty());
        let l = j.drain(Some(&u()));
        assert!(!l.overflowed);
        assert_eq!(l.keys, vec![(u(), "b".to_string()), (u(), "c".to_string())]);
        assert_eq!(j.drain(None), Losses::default());
    }

    #[test]
    fn off_records_nothing() {
        let mut j = LossJournal::new(0);
        j.record(&t(), "a");
        assert_eq!(j.drain(None), Losses::default());
    }

    #[test]
    fn full_journal_drops_the_oldest_and_says_so_once() {
        let mut j = LossJournal::new(2);
        for k in ["a", "b", "c"] {
            j.record(&t(), k);
        }
        let l = j.drain(None);
        assert!(l.overflowed);
        assert_eq!(
            l.keys.iter().map(|(_, k)| k.as_str()).collect::<Vec<_>>(),
            ["b", "c"]
        );
        j.record(&t(), "d");
        let l = j.drain(None);
        assert!(
            !l.overflowed,
            "the overflow is reported by the drain that lost entries"
        );
        assert_eq!(l.keys.len(), 1);
    }
}
