//! The bookings of background responses (`/v1/responses` with `"background": true`) after
//! their immediate answer ([`crate::cluster::Cluster::background`]): each held until its
//! deadline, or until the response is seen done (a `GET /v1/responses/{id}` showing it
//! finished, or its cancel), at most a cap of them.
//!
//! Why apart from the router's books: nobody reports these bookings' ends, so what they
//! hold is bounded here, by time (each one's deadline) and by number (the cap: past it the
//! one due first goes).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Background responses' bookings, by deadline (nanoseconds of the router's clock), and by
/// response id where the answer named one.
#[derive(Debug, Default)]
pub(crate) struct Background {
    /// Deadlines, and entries of bookings already gone (dropped when they come up, or when
    /// they outnumber the held ones).
    due: BinaryHeap<Reverse<(u64, u64)>>,
    /// The bookings held, and their response's id if known.
    held: HashMap<u64, Option<String>>,
    by_id: HashMap<String, u64>,
}

impl Background {
    /// Bookings held.
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    /// Holds `booking` until `due_ns`; returns the bookings dropped to hold at most `cap`
    /// (the ones due first), to be cancelled.
    pub(crate) fn hold(&mut self, booking: u64, due_ns: u64, cap: usize) -> Vec<u64> {
        self.due.push(Reverse((due_ns, booking)));
        self.held.insert(booking, None);
        let mut out = Vec::new();
        while self.held.len() > cap.max(1) {
            match self.pop() {
                Some(b) => out.push(b),
                None => break,
            }
        }
        if self.due.len() > 2 * self.held.len() + 64 {
            let held = &self.held;
            self.due.retain(|Reverse((_, b))| held.contains_key(b));
        }
        out
    }

    /// Names held `booking` by its response's `id` (a later id for it replaces the earlier).
    pub(crate) fn name(&mut self, booking: u64, id: &str) {
        let Some(slot) = self.held.get_mut(&booking) else {
            return;
        };
        if let Some(old) = slot.replace(id.to_owned()) {
            self.by_id.remove(&old);
        }
        if let Some(other) = self.by_id.insert(id.to_owned(), booking)
            && other != booking
            && let Some(s) = self.held.get_mut(&other)
        {
            *s = None;
        }
    }

    /// The response `id` is done: its booking, no longer held, to be cancelled.
    pub(crate) fn done(&mut self, id: &str) -> Option<u64> {
        let b = self.by_id.remove(id)?;
        self.held.remove(&b);
        Some(b)
    }

    /// Whether a booking is held for response `id`.
    pub(crate) fn names(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    /// The bookings due by `now_ns`, no longer held, to be cancelled.
    pub(crate) fn expire(&mut self, now_ns: u64) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some(&Reverse((at, b))) = self.due.peek() {
            if at > now_ns {
                break;
            }
            self.due.pop();
            if let Some(id) = self.held.remove(&b) {
                if let Some(id) = id {
                    self.by_id.remove(&id);
                }
                out.push(b);
            }
        }
        out
    }

    /// The held booking due first, no longer held (entries of bookings gone skipped).
    fn pop(&mut self) -> Option<u64> {
        while let Some(Reverse((_, b))) = self.due.pop() {
            if let Some(id) = self.held.remove(&b) {
                if let Some(id) = id {
                    self.by_id.remove(&id);
                }
                return Some(b);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Hold(u64),
        Name(u64, u8),
        Done(u8),
        Expire(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u64..100).prop_map(Op::Hold),
            2 => (0u64..20, 0u8..6).prop_map(|(b, i)| Op::Name(b, i)),
            1 => (0u8..6).prop_map(Op::Done),
            1 => (0u64..100).prop_map(Op::Expire),
        ]
    }

    proptest! {
        /// Against a model (held bookings, their ids): every booking comes out once (past the
        /// cap, due, or done) and never while held; at most `cap` held; an id names at most
        /// one held booking; stale deadlines stay bounded.
        #[test]
        fn each_booking_comes_out_once_and_at_most_cap_are_held(
            ops in proptest::collection::vec(op(), 1..120),
            cap in 1usize..6,
        ) {
            let mut b = Background::default();
            let mut next = 0u64;
            let mut out: Vec<u64> = Vec::new();
            for op in ops {
                match op {
                    Op::Hold(due) => {
                        out.extend(b.hold(next, due, cap));
                        next += 1;
                    }
                    Op::Name(k, i) => b.name(k, &format!("resp_{i}")),
                    Op::Done(i) => out.extend(b.done(&format!("resp_{i}"))),
                    Op::Expire(now) => out.extend(b.expire(now)),
                }
                prop_assert!(b.len() <= cap);
                let mut seen = out.clone();
                seen.sort_unstable();
                seen.dedup();
                prop_assert_eq!(seen.len(), out.len(), "a booking came out twice");
                prop_assert_eq!(out.len() + b.len(), next as usize, "every booking held or out");
                for (id, k) in &b.by_id {
                    prop_assert_eq!(b.held.get(k), Some(&Some(id.clone())));
                }
                prop_assert!(b.due.len() <= 2 * b.held.len() + 65);
            }
        }
    }
}
