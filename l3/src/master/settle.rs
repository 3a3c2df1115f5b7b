//! Settlement (split deployment): what the master keeps telling a store node about object
//! versions it dropped, until the node acknowledges that it applied them durably.
//!
//! Why: the master drops a removed (or replaced, revoked, evicted) version at once, but the
//! node holding — or about to write — its SSD copy hears of it only on its next ping. If the
//! master forgot the order once it was *sent*, a node that crashed before the order reached
//! its disk would re-register the record at restart and bring the version back. So every
//! order ([`Settle`]) gets a per-node sequence number and stays here until the node's ping
//! carries an `applied` number at or past it; until then a rescanned record it names is
//! refused ([`Master::register_rescanned`]), and after a remount every unacknowledged order
//! is delivered again.
//!
//! Orders: [`Settle::Tombstone`] for a registered SSD copy; [`Settle::Cancel`] for a version
//! whose SSD copy may still be queued or unregistered on the node that writes it (the node
//! drops the queued write, or tombstones the record if already written). Both are
//! idempotent on the node, so repeating them is harmless.
//!
//! The embedded store (and `--role both`) tombstones and cancels under its own lock
//! ([`LOCAL_NODE`]); nothing is queued for it, nor for clients that are not store nodes.

use std::collections::{BTreeMap, HashMap};

use super::*;

/// An order a store node applies durably and then acknowledges (by sequence number).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Settle {
    /// Tombstone the SSD record at this location (its object version is gone).
    Tombstone(DiskLoc),
    /// Version `token` (and any older one) of the key is gone: do not write it, and
    /// tombstone the record if it is already written but not registered.
    Cancel {
        /// Tenant.
        tenant: Tenant,
        /// Key.
        key: String,
        /// The dropped version's put token.
        token: u64,
    },
}

/// Which unacknowledged settles a reply carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Deliver {
    /// Those not handed out yet (put-end replies).
    New,
    /// Every unacknowledged one (ping replies: covers replies lost on the way).
    Unacked,
}

/// One node's settles, by sequence number (1, 2, …; never reused for the node).
#[derive(Debug, Default)]
pub(super) struct Settlement {
    pending: BTreeMap<u64, Settle>,
    /// Last sequence number issued.
    issued: u64,
    /// Every settle up to this one is acknowledged.
    acked: u64,
    /// Handed out up to this one (since the node's last mount).
    sent: u64,
    /// Unacknowledged tombstones and cancels, counted per location and per key, so a
    /// rescan of many records checks each in O(1).
    locs: HashMap<DiskLoc, u32>,
    keys: HashMap<(Tenant, String), u32>,
}

fn bump<K: std::hash::Hash + Eq>(m: &mut HashMap<K, u32>, k: K, up: bool) {
    if up {
        *m.entry(k).or_default() += 1;
    } else if let Some(n) = m.get_mut(&k) {
        *n -= 1;
        if *n == 0 {
            m.remove(&k);
        }
    }
}

impl Settlement {
    fn index(&mut self, s: &Settle, up: bool) {
        match s {
            Settle::Tombstone(l) => bump(&mut self.locs, *l, up),
            Settle::Cancel { tenant, key, .. } => {
                bump(&mut self.keys, (tenant.clone(), key.clone()), up)
            }
        }
    }

    fn push(&mut self, s: Settle) {
        self.issued += 1;
        self.index(&s, true);
        self.pending.insert(self.issued, s);
    }

    /// The node applied every settle up to `applied`. A number past what was issued (a
    /// node still counting from before a master restart) is ignored.
    fn ack(&mut self, applied: u64) {
        if applied > self.issued || applied <= self.acked {
            return;
        }
        let rest = self.pending.split_off(&(applied + 1));
        let done = std::mem::replace(&mut self.pending, rest);
        for s in done.values() {
            self.index(s, false);
        }
        self.acked = applied;
        self.sent = self.sent.max(applied);
    }

    fn take(&mut self, d: Deliver) -> Vec<(u64, Settle)> {
        let from = match d {
            Deliver::New => self.sent,
            Deliver::Unacked => self.acked,
        };
        let v = self
            .pending
            .range(from + 1..)
            .map(|(n, s)| (*n, s.clone()))
            .collect();
        self.sent = self.issued;
        v
    }

    fn refuses(&self, t: &Tenant, key: &str, loc: &DiskLoc) -> bool {
        self.locs.contains_key(loc)
            || (!self.keys.is_empty() && self.keys.contains_key(&(t.clone(), key.to_string())))
    }
}

/// What a dropped object version leaves to settle on nodes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Gone {
    token: u64,
    writer: ClientId,
    staged_on: Option<ClientId>,
    disk: Option<(ClientId, DiskLoc)>,
}

impl Object {
    pub(super) fn gone(&self) -> Gone {
        Gone {
            token: self.token,
            writer: self.writer,
            staged_on: match self.staged {
                Some(Staged::OnNode { node, .. }) => Some(node),
                _ => None,
            },
            disk: self.disk.map(|d| (self.disk_node, d)),
        }
    }
}

impl Master {
    /// Queues an order for a store node (nothing for [`LOCAL_NODE`] or for a client that
    /// never mounted as a node).
    pub(super) fn queue_settle(&mut self, node: ClientId, s: Settle) {
        if node == LOCAL_NODE {
            return;
        }
        if let Some(st) = self.nodes.get_mut(&node) {
            st.settle.push(s);
        }
    }

    /// Queues the tombstone of a removed object's SSD record for the node holding it (a
    /// no-op for [`LOCAL_NODE`], whose caller tombstones directly).
    pub fn queue_tombstone(&mut self, node: ClientId, loc: DiskLoc) {
        self.queue_settle(node, Settle::Tombstone(loc));
    }

    /// A version of `key` left the master (removed, replaced, revoked, evicted without an
    /// SSD copy, lost with its node's memory): its registered SSD copy is tombstoned, or,
    /// when none is registered yet, the nodes that may be writing one (the write-through
    /// writer, the node it is staged on) cancel the write.
    pub(super) fn settle_gone(&mut self, t: &Tenant, key: &str, g: Gone) {
        if let Some((node, loc)) = g.disk {
            self.queue_settle(node, Settle::Tombstone(loc));
            return;
        }
        let mut to = vec![g.writer];
        to.extend(g.staged_on.filter(|n| *n != g.writer));
        for node in to {
            self.queue_settle(
                node,
                Settle::Cancel {
                    tenant: t.clone(),
                    key: key.to_string(),
                    token: g.token,
                },
            );
        }
    }

    /// Settles for a node, and every settle up to which it acknowledged (the node counts
    /// on from there).
    pub(super) fn take_settles(&mut self, node: ClientId, d: Deliver) -> (Vec<(u64, Settle)>, u64) {
        match self.nodes.get_mut(&node) {
            Some(st) => (st.settle.take(d), st.settle.acked),
            None => (Vec::new(), 0),
        }
    }

    /// The node applied (durably) every settle up to `applied`: they are dropped.
    pub fn node_ack(&mut self, node: ClientId, applied: u64) {
        if let Some(st) = self.nodes.get_mut(&node) {
            st.settle.ack(applied);
        }
    }

    /// After a (re)mount every unacknowledged settle is handed out again.
    pub(super) fn redeliver_settles(&mut self, node: ClientId) {
        if let Some(st) = self.nodes.get_mut(&node) {
            st.settle.sent = st.settle.acked;
        }
    }

    /// Whether an unacknowledged settle of `node` forbids registering this rescanned record
    /// (a tombstone of its location, or a cancel of its key).
    pub(super) fn settle_refuses(
        &self,
        node: ClientId,
        t: &Tenant,
        key: &str,
        loc: &DiskLoc,
    ) -> bool {
        self.nodes
            .get(&node)
            .is_some_and(|st| st.settle.refuses(t, key, loc))
    }

    /// Unacknowledged settles of a node (tests, metrics).
    pub fn unsettled(&self, node: ClientId) -> usize {
        self.nodes
            .get(&node)
            .map_or(0, |st| st.settle.pending.len())
    }

    /// Unacknowledged settles of all nodes (metrics).
    pub fn unsettled_total(&self) -> usize {
        self.nodes.values().map(|st| st.settle.pending.len()).sum()
    }
}
