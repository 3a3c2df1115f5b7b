//! Frees (split deployment): the allocations of a store node's segment this master dropped,
//! told to the node until it acknowledges that it dropped their bytes — and the nodes that
//! may still hold a dropped replica's bytes, so a version's death reaches them too.
//!
//! Why (issue 33): a node keeps its ended DRAM replicas across a remount and a new master
//! adopts what it reports (`adopt`). A free used to be handed out once, in the next reply;
//! if that reply was lost (the node's ping timed out at a paused leader) the node kept the
//! bytes of a removed key, acknowledged the key's cancel on a later ping, and the next
//! leader adopted the removed key. So:
//!
//! - Each free gets a per-node sequence number ([`FreeLog`]); every ping reply carries all
//!   the unacknowledged ones and the node acknowledges (`Ping::freed`) only what it dropped,
//!   over consecutive numbers. Applying a free twice is harmless (allocation ids are never
//!   reused by one master). Frees are not logged to etcd: a new master starts with none,
//!   and what a node kept is then a replica the new master knows of (it adopts or refuses
//!   it), not a stale one it cannot see.
//! - A replica dropped while its version lives on (evicted to its SSD copy, or lost with a
//!   node declared dead while the object keeps other copies) is remembered on the object
//!   (`Object::freed_on`) while its free is unacknowledged; if the version dies meanwhile,
//!   its cancel goes to that node too (`settle_gone`). Cancels are durable (etcd) until
//!   acknowledged, and a node acknowledges a cancel only after dropping its DRAM copies of
//!   that version and older ones, so the next master refuses whatever it still reports.
//! - A node this master declared dead (or saw leave) may keep all its bytes until it
//!   mounts again: its frees are *orphaned* — every replica it held counts as unacknowledged
//!   until its next mount (which reports its memory to this master, which refuses it all).
//!   This closes the gap of a node declared dead while only partitioned.

use std::collections::HashSet;

use super::sequenced::{Deliver, Sequenced};
use super::*;

/// One node's unacknowledged frees.
#[derive(Debug, Default)]
pub(super) struct FreeLog {
    /// The allocations freed, by sequence number.
    log: Sequenced<u64>,
    /// The allocations in `log`.
    allocs: HashSet<u64>,
    /// This master dropped the node's memory without telling it (declared dead, left): it
    /// may hold any of its old allocations until it mounts again.
    orphaned: bool,
}

impl FreeLog {
    /// Issues frees for these allocations of the node's segment.
    pub(super) fn push(&mut self, allocs: impl IntoIterator<Item = u64>) {
        for a in allocs {
            if self.allocs.insert(a) {
                self.log.push(a);
            }
        }
    }

    /// The node dropped the bytes of every free up to `applied`. A number past what was
    /// issued (a node counting from another master) is ignored.
    pub(super) fn ack(&mut self, applied: u64) {
        for a in self.log.ack(applied).unwrap_or_default() {
            self.allocs.remove(&a);
        }
    }

    /// Frees to hand out: those not handed out yet (put-end replies) or every
    /// unacknowledged one (pings: covers replies lost on the way).
    pub(super) fn take(&mut self, d: Deliver) -> Vec<(u64, u64)> {
        self.log.take(d)
    }

    /// Every free up to this one is acknowledged (the node counts on from here).
    pub(super) fn acked(&self) -> u64 {
        self.log.acked()
    }

    /// Whether the node may still hold the bytes of `alloc`, freed here.
    pub(super) fn may_hold(&self, alloc: u64) -> bool {
        self.orphaned || self.allocs.contains(&alloc)
    }

    /// Unacknowledged frees.
    pub(super) fn len(&self) -> usize {
        self.log.len()
    }

    /// The node's memory was dropped here without telling it (declared dead, left).
    pub(super) fn orphan(&mut self) {
        self.clear();
        self.orphaned = true;
    }

    /// The node mounts: it reports its memory now and drops whatever is not adopted, so
    /// nothing freed before is held any more once the mount is answered.
    pub(super) fn mounted(&mut self) {
        self.clear();
        self.orphaned = false;
    }

    fn clear(&mut self) {
        self.log.acknowledge_all();
        self.allocs.clear();
    }
}

impl Master {
    /// Issues the frees of `node`'s segment not issued yet, then returns those to hand out
    /// (see [`FreeLog::take`]) and the number acknowledged so far.
    pub(super) fn take_frees(&mut self, node: ClientId, d: Deliver) -> (Vec<(u64, u64)>, u64) {
        let Some(st) = self.nodes.get_mut(&node) else {
            return (Vec::new(), 0);
        };
        if let Some(seg) = st.segment {
            st.frees.push(self.segments.take_freed(seg));
        }
        (st.frees.take(d), st.frees.acked())
    }

    /// `node` dropped the bytes of every free up to `applied`.
    pub(super) fn frees_acked(&mut self, node: ClientId, applied: u64) {
        if let Some(st) = self.nodes.get_mut(&node) {
            st.frees.ack(applied);
        }
    }

    /// Whether `node` may still hold the bytes of `alloc`, which this master freed: the
    /// free is not acknowledged (or not even issued), or the node's memory was dropped
    /// here without telling it.
    pub(super) fn may_hold_freed(&self, node: ClientId, alloc: u64) -> bool {
        let Some(st) = self.nodes.get(&node) else {
            return false;
        };
        st.frees.may_hold(alloc)
            || st
                .segment
                .is_some_and(|seg| self.segments.freed_not_taken(seg, alloc))
    }

    /// Memory replicas of a version that lives on were dropped: remembered on the object
    /// while their nodes may hold the bytes (`Object::freed_on`; entries whose frees are
    /// acknowledged are pruned here).
    pub(super) fn note_freed(&mut self, t: &Tenant, key: &str, gone: &[MemReplica]) {
        let mut add: Vec<(ClientId, u64)> = gone
            .iter()
            .filter_map(|r| {
                let owner = self.segments.get(r.seg).map(|s| s.owner)?;
                self.nodes.contains_key(&owner).then_some((owner, r.alloc))
            })
            .collect();
        let Some(old) = self.obj(t, key).map(|o| o.freed_on.clone()) else {
            return;
        };
        if add.is_empty() && old.is_empty() {
            return;
        }
        let mut keep: Vec<(ClientId, u64)> = old
            .into_iter()
            .filter(|(n, a)| self.may_hold_freed(*n, *a))
            .collect();
        keep.append(&mut add);
        if let Some(mut o) = self.obj_mut(t, key) {
            o.freed_on = keep;
        }
    }

    /// This master drops `node`'s memory without telling it (declared dead, left): until
    /// it mounts again, it may hold any replica it had.
    pub(super) fn orphan_node_memory(&mut self, node: ClientId) {
        if let Some(st) = self.nodes.get_mut(&node) {
            st.frees.orphan();
        }
    }

    /// Unacknowledged frees of a node (tests, metrics).
    pub fn unfreed(&self, node: ClientId) -> usize {
        self.nodes.get(&node).map_or(0, |st| st.frees.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn frees_are_repeated_until_acknowledged() {
        let mut f = FreeLog::default();
        f.push([7, 8]);
        assert_eq!(f.take(Deliver::New), vec![(1, 7), (2, 8)]);
        // That reply was lost: a put-end reply has nothing new, a ping repeats both.
        assert!(f.take(Deliver::New).is_empty());
        f.push([9]);
        assert_eq!(f.take(Deliver::Unacked), vec![(1, 7), (2, 8), (3, 9)]);
        assert!(f.may_hold(8));
        f.ack(2);
        assert!(!f.may_hold(8) && f.may_hold(9));
        assert_eq!(f.take(Deliver::Unacked), vec![(3, 9)]);
        // A number from another master, or going back: ignored.
        f.ack(99);
        f.ack(1);
        assert_eq!((f.acked(), f.len()), (2, 1));
        f.orphan();
        assert!(f.may_hold(1234) && f.len() == 0);
        f.mounted();
        assert!(!f.may_hold(9) && f.take(Deliver::Unacked).is_empty());
        assert_eq!(f.acked(), 3);
    }

    proptest! {
        /// Whatever the node acknowledges, every free it has not acknowledged is in the next
        /// ping reply, once, in order, and `may_hold` is exactly "issued, not acknowledged".
        #[test]
        fn pings_carry_exactly_the_unacknowledged_frees(
            steps in proptest::collection::vec((0u8..4, 0u64..6), 1..60)
        ) {
            let mut f = FreeLog::default();
            let mut next = 0u64;
            let mut issued: Vec<(u64, u64)> = Vec::new();
            let mut acked = 0u64;
            for (kind, n) in steps {
                match kind {
                    0 => {
                        let allocs: Vec<u64> = (0..n).map(|i| next + i).collect();
                        next += n;
                        for a in &allocs {
                            issued.push((issued.len() as u64 + 1, *a));
                        }
                        f.push(allocs);
                    }
                    1 => {
                        let to = acked + n;
                        f.ack(to);
                        if to <= issued.len() as u64 {
                            acked = acked.max(to);
                        }
                    }
                    2 => { f.take(Deliver::New); }
                    _ => {
                        let want: Vec<(u64, u64)> =
                            issued.iter().filter(|(s, _)| *s > acked).copied().collect();
                        prop_assert_eq!(f.take(Deliver::Unacked), want);
                    }
                }
                for (s, a) in &issued {
                    prop_assert_eq!(f.may_hold(*a), *s > acked);
                }
                prop_assert_eq!(f.acked(), acked);
            }
        }
    }
}
