//! An instance's device memory over time, replayed for one routing decision: which requests
//! hold how much of it until when, and when a request in the engine's admission order gets
//! room and starts its prefill ([`super::Feedback::queue_s`]).
//!
//! Why a replay and not a formula: an engine admits in arrival order and stops at the first
//! request that does not fit, so a request's start depends on every request ahead of it —
//! one waiting prompt that fills most of the device holds up everything behind it until it
//! has been prefilled and has decoded its answer. Each admission pops ends in time order
//! until the room suffices; admissions never move back in time.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// One instance's device memory over time, as [`super::Feedback::queue_s`] replays it: the room
/// left, the expected ends of the requests holding memory (earliest first), and when the
/// prefill of the requests admitted so far is done.
pub(super) struct Timeline {
    free: f64,
    ends: BinaryHeap<Reverse<End>>,
    /// When the requests admitted so far are prefilled: the next one starts no earlier.
    prefilled_s: f64,
    /// The latest end the admissions so far waited for: ends free room in time order.
    freed_s: f64,
    now_s: f64,
}

/// A request's expected end and the tokens it then frees, ordered by time.
#[derive(Clone, Copy, PartialEq)]
struct End(f64, f64);

impl Eq for End {}

impl PartialOrd for End {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for End {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

impl Timeline {
    pub(super) fn new(device_tokens: f64, now_s: f64) -> Self {
        Self {
            free: device_tokens,
            ends: BinaryHeap::new(),
            prefilled_s: now_s,
            freed_s: now_s,
            now_s,
        }
    }

    /// A running request holding `tokens` until `end_s` (an overdue one ends now).
    pub(super) fn running(&mut self, end_s: f64, tokens: f64) {
        self.free -= tokens;
        self.ends.push(Reverse(End(end_s.max(self.now_s), tokens)));
    }

    /// Admits the next request in arrival order: it needs `need` tokens of room to start
    /// (its prompt: the engine admits a prompt that fits, its output grows into the room
    /// later), holds `holds` tokens until its end (prompt and output), and has `work_s` of
    /// prefill and `decode_s` more until that end. Returns when its prefill starts. A
    /// request larger than what the device frees at all is admitted once every holder
    /// ended (the engine runs it alone).
    pub(super) fn admit(&mut self, need: f64, holds: f64, work_s: f64, decode_s: f64) -> f64 {
        while self.free < need {
            let Some(Reverse(End(at, freed))) = self.ends.pop() else {
                break;
            };
            self.free += freed;
            self.freed_s = self.freed_s.max(at);
        }
        let start = self.prefilled_s.max(self.freed_s);
        self.free -= holds;
        self.prefilled_s = start + work_s;
        self.ends
            .push(Reverse(End(self.prefilled_s + decode_s, holds)));
        start
    }
}
