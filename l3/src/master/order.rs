//! Each tenant's eviction order: its eviction candidates (complete objects with a memory
//! replica) ranked as [`crate::eviction`] ranks them apart from pins and leases — those with
//! an SSD copy first, then least recently used first. Pins and leases change with the clock,
//! so they are checked when the order is walked.
//!
//! Why: an eviction used to collect and sort every object of the store (or of a tenant at its
//! quota) under the master lock — 29 ms a put for a tenant of 100,000 objects at its quota
//! (`benches/evict.rs`). Walking a kept order costs the victims, not the objects.
//!
//! Why lazy: every read makes its object the most recent, and moving it in a B-tree at each
//! read (a removal and an insertion) cost reads a quarter more under the master lock
//! (727 → 915 ns at 100,000 objects). So a read leaves the object's entry where it was: an
//! entry may rank an object *earlier* than it now stands (never later, never in another
//! class), and a walk that reaches such a stale entry moves it to where the object stands,
//! which is further along the walk, so the walk still visits objects in their true order.
//! Every other change (a class change, an object becoming or ceasing to be a candidate)
//! moves the entry at once.
//!
//! Invariant (checked by [`Order::mismatch`], which `Master::check_census` runs): an object
//! that is a candidate has exactly one entry, at `ordered_as`, in its class and no later than
//! its last access; an object that is not has none; nothing else is in the order.

use std::collections::BTreeSet;
use std::ops::Bound;

use super::Object;

/// Where an eviction candidate ranks: those with an SSD copy first (evicting them loses
/// nothing), then least recently used first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct EvictRank {
    pub unsaved: bool,
    pub last_access: u64,
}

impl EvictRank {
    /// `None` for an object no eviction may take: incomplete, or no memory replica.
    pub(super) fn of(o: &Object) -> Option<EvictRank> {
        (!o.mem.is_empty() && o.is_complete()).then_some(EvictRank {
            unsaved: o.disk.is_none(),
            last_access: o.last_access,
        })
    }

    /// Whether an entry at `self` still places an object that now ranks `now` (the same
    /// class, no later: a read since only made it more recent).
    fn holds(self, now: EvictRank) -> bool {
        self.unsaved == now.unsaved && self.last_access <= now.last_access
    }
}

/// One entry: a rank and a key, ordered by rank, then key (a total order).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Entry(pub EvictRank, pub String);

/// One tenant's eviction order (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Order(BTreeSet<Entry>);

impl Order {
    /// Places `o` (under `key`) after a change: its entry stays where it is if it still holds
    /// (a read), else moves to where `o` ranks now, or goes if `o` is no candidate.
    pub(super) fn place(&mut self, key: &str, o: &mut Object) {
        let now = EvictRank::of(o);
        if let (Some(r), Some(n)) = (o.ordered_as, now)
            && r.holds(n)
        {
            return;
        }
        if o.ordered_as == now {
            return;
        }
        let owned = o
            .ordered_as
            .and_then(|r| self.0.take(&Entry(r, key.to_string())))
            .map(|e| e.1);
        if let Some(n) = now {
            self.0
                .insert(Entry(n, owned.unwrap_or_else(|| key.to_string())));
        }
        o.ordered_as = now;
    }

    /// Takes `o`'s entry out (`o` leaves the table).
    pub(super) fn unplace(&mut self, key: &str, o: &Object) {
        if let Some(r) = o.ordered_as {
            self.0.remove(&Entry(r, key.to_string()));
        }
    }

    /// The first entry after `after` (from the front if `None`) that places its object where
    /// it stands, moving the stale ones passed on the way to where theirs stand (later).
    pub(super) fn next_fresh(
        &mut self,
        after: Option<&Entry>,
        objects: &mut super::table::Objects,
    ) -> Option<Entry> {
        loop {
            let e = match after {
                None => self.0.first(),
                Some(a) => self.0.range((Bound::Excluded(a), Bound::Unbounded)).next(),
            }?
            .clone();
            let Some(o) = objects.get_mut(&e.1) else {
                self.0.remove(&e); // names no object: the invariant check reports such
                continue;
            };
            let now = EvictRank::of(o);
            if now == Some(e.0) {
                return Some(e);
            }
            self.0.remove(&e);
            if let Some(n) = now {
                self.0.insert(Entry(n, e.1));
            }
            o.ordered_as = now;
        }
    }

    /// What breaks the invariant (module docs) for these objects, if anything.
    pub(super) fn mismatch(&self, objects: &super::table::Objects) -> Option<String> {
        let mut placed = 0;
        for (k, o) in objects {
            match (o.ordered_as, EvictRank::of(o)) {
                (None, None) => {}
                // spelt out, not `holds`: the check must not share what it checks
                (Some(r), Some(n)) if r.unsaved == n.unsaved && r.last_access <= n.last_access => {
                    if !self.0.contains(&Entry(r, k.clone())) {
                        return Some(format!("{k:?} placed at {r:?} but not in the order"));
                    }
                    placed += 1;
                }
                (was, now) => {
                    return Some(format!("{k:?} placed at {was:?}, ranks {now:?}"));
                }
            }
        }
        (placed != self.0.len())
            .then(|| format!("{} entries for {placed} placed objects", self.0.len()))
    }
}
