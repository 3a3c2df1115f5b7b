//! What a master repeats to one store node until the node acknowledges it: orders numbered
//! 1, 2, … per node (never reused), handed out in replies, dropped once the node's ping
//! carries an acknowledgement at or past them.
//!
//! Why one type: settles (`settle`, durable) and frees (`frees`, in memory) follow the same
//! protocol — a put-end reply carries what was not handed out yet, a ping reply carries
//! every unacknowledged order (so a reply lost on the way is covered), and the node moves
//! its acknowledgement only over consecutive numbers (so an order lost on the way is never
//! skipped). Applying an order twice must be harmless on the node.

use std::collections::BTreeMap;

/// Which unacknowledged orders a reply carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Deliver {
    /// Those not handed out yet (put-end replies).
    New,
    /// Every unacknowledged one (ping replies: covers replies lost on the way).
    Unacked,
}

/// Orders to one node, by sequence number.
#[derive(Debug)]
pub(super) struct Sequenced<T> {
    pending: BTreeMap<u64, T>,
    /// Last sequence number issued.
    issued: u64,
    /// Every order up to this one is acknowledged.
    acked: u64,
    /// Handed out up to this one (since the node's last mount).
    sent: u64,
}

impl<T> Default for Sequenced<T> {
    fn default() -> Self {
        Sequenced {
            pending: BTreeMap::new(),
            issued: 0,
            acked: 0,
            sent: 0,
        }
    }
}

impl<T: Clone> Sequenced<T> {
    /// The number the next order gets.
    pub(super) fn next_seq(&self) -> u64 {
        self.issued + 1
    }

    /// Issues an order; its sequence number.
    pub(super) fn push(&mut self, order: T) -> u64 {
        self.issued += 1;
        self.pending.insert(self.issued, order);
        self.issued
    }

    /// The node applied every order up to `applied`: they are dropped and returned. None
    /// (nothing changes) for a number past what was issued (a node still counting from
    /// another master incarnation) or not past the last acknowledgement.
    pub(super) fn ack(&mut self, applied: u64) -> Option<Vec<T>> {
        if applied > self.issued || applied <= self.acked {
            return None;
        }
        let rest = self.pending.split_off(&(applied + 1));
        let done = std::mem::replace(&mut self.pending, rest);
        self.acked = applied;
        self.sent = self.sent.max(applied);
        Some(done.into_values().collect())
    }

    /// Orders to hand out now: those not handed out yet, or every unacknowledged one.
    pub(super) fn take(&mut self, d: Deliver) -> Vec<(u64, T)> {
        let from = match d {
            Deliver::New => self.sent,
            Deliver::Unacked => self.acked,
        };
        let v = self
            .pending
            .range(from + 1..)
            .map(|(n, o)| (*n, o.clone()))
            .collect();
        self.sent = self.issued;
        v
    }

    /// The node mounted again: every unacknowledged order is handed out again.
    pub(super) fn redeliver(&mut self) {
        self.sent = self.acked;
    }

    /// Drops every order as if acknowledged (the node dropped all they concern).
    pub(super) fn acknowledge_all(&mut self) {
        self.pending.clear();
        self.acked = self.issued;
        self.sent = self.issued;
    }

    /// Replays a logged issue; false (nothing changes) for one already acknowledged or known.
    pub(super) fn restore(&mut self, seq: u64, order: T) -> bool {
        self.issued = self.issued.max(seq);
        if seq > self.acked && !self.pending.contains_key(&seq) {
            self.pending.insert(seq, order);
            return true;
        }
        false
    }

    /// Replays a logged acknowledgement (also a floor for the counter).
    pub(super) fn restore_acked(&mut self, applied: u64) -> Option<Vec<T>> {
        self.issued = self.issued.max(applied);
        self.ack(applied)
    }

    /// Last sequence number issued.
    pub(super) fn issued(&self) -> u64 {
        self.issued
    }

    /// Every order up to this one is acknowledged.
    pub(super) fn acked(&self) -> u64 {
        self.acked
    }

    /// Unacknowledged orders, in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&u64, &T)> {
        self.pending.iter()
    }

    /// Unacknowledged orders.
    pub(super) fn values(&self) -> impl Iterator<Item = &T> {
        self.pending.values()
    }

    /// How many are unacknowledged.
    pub(super) fn len(&self) -> usize {
        self.pending.len()
    }
}
