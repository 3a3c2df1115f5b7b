//! Instance queues from the requests' lifecycle: what each instance still has to prefill and
//! how much of its device memory running requests hold, as the engines report them.
//!
//! Why not only the router's own clock: an open-loop queue (each request's estimated work,
//! drained at one second per second) drifts from the instance as soon as the instance runs
//! slower than the model (decode steps share its forward passes, a full device admits the
//! next request only when one ends). The front end sees every request's first token and its
//! end anyway, so with them the queue is closed-loop:
//! - pending prefill: the estimated work of the instance's requests that have no first token
//!   yet, removed at the first token;
//! - memory: the prompt + output tokens of its requests that have not ended; what a new
//!   request would add beyond the device's capacity waits for running requests to end, that
//!   share of the instance's mean decode time (first token to end, learnt from the ends seen,
//!   an exponential average).
//!
//! A booking the caller never closes stays counted: a front end must report every end
//! (finished, aborted or failed), as it must to free the request anyway.

use std::collections::HashMap;

/// Weight of the latest decode time in the instance's average.
pub const DECODE_EWMA: f64 = 0.1;

struct Booking {
    instance: usize,
    work_s: f64,
    held_tokens: f64,
    prefilled_at: Option<f64>,
}

pub struct Feedback {
    device_tokens: f64,
    booked: HashMap<u64, Booking>,
    pending_s: Vec<f64>,
    held: Vec<f64>,
    decode_s: Vec<f64>,
}

impl Feedback {
    /// `instances` instances whose devices hold `device_tokens` tokens of KV each.
    pub fn new(instances: usize, device_tokens: f64) -> Self {
        Self {
            device_tokens,
            booked: HashMap::new(),
            pending_s: vec![0.0; instances],
            held: vec![0.0; instances],
            decode_s: vec![0.0; instances],
        }
    }

    /// Seconds a new request holding `tokens` tokens would wait on `instance`.
    pub fn queue_s(&self, instance: usize, tokens: f64) -> f64 {
        let (Some(p), Some(h), Some(d)) = (
            self.pending_s.get(instance),
            self.held.get(instance),
            self.decode_s.get(instance),
        ) else {
            return 0.0;
        };
        let over = (h + tokens - self.device_tokens).max(0.0);
        let memory = if self.device_tokens > 0.0 {
            (over / self.device_tokens).min(1.0) * d
        } else {
            0.0
        };
        p + memory
    }

    /// Request `id` was routed to `instance`: `work_s` of prefill, `held_tokens` of KV.
    pub fn book(&mut self, id: u64, instance: usize, work_s: f64, held_tokens: f64) {
        if instance >= self.pending_s.len() {
            return;
        }
        self.finished(id, None);
        self.pending_s[instance] += work_s;
        self.held[instance] += held_tokens;
        self.booked.insert(
            id,
            Booking {
                instance,
                work_s,
                held_tokens,
                prefilled_at: None,
            },
        );
    }

    /// Request `id` produced its first token at `now_s`; `false` if it is not booked.
    pub fn first_token(&mut self, id: u64, now_s: f64) -> bool {
        let Some(b) = self.booked.get_mut(&id) else {
            return false;
        };
        if b.prefilled_at.is_none() {
            b.prefilled_at = Some(now_s);
            let p = &mut self.pending_s[b.instance];
            *p = (*p - b.work_s).max(0.0);
        }
        true
    }

    /// Request `id` ended (`now_s`: when, to learn the decode time; `None`: do not learn).
    /// `false` if it is not booked.
    pub fn finished(&mut self, id: u64, now_s: Option<f64>) -> bool {
        let Some(b) = self.booked.remove(&id) else {
            return false;
        };
        let i = b.instance;
        match b.prefilled_at {
            None => self.pending_s[i] = (self.pending_s[i] - b.work_s).max(0.0),
            Some(t) => {
                if let Some(now) = now_s {
                    let d = (now - t).max(0.0);
                    self.decode_s[i] += DECODE_EWMA * (d - self.decode_s[i]);
                }
            }
        }
        self.held[i] = (self.held[i] - b.held_tokens).max(0.0);
        true
    }

    /// Requests booked and not yet ended.
    pub fn booked(&self) -> usize {
        self.booked.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pending_prefill_leaves_at_the_first_token_and_memory_at_the_end() {
        let mut f = Feedback::new(2, 1000.0);
        f.book(1, 0, 0.5, 600.0);
        assert_eq!(f.queue_s(0, 100.0), 0.5);
        assert!(f.first_token(1, 1.0));
        assert_eq!(f.queue_s(0, 100.0), 0.0);
        // 600 held + 600 new is 200 over 1000: a fifth of the decode time, once learnt.
        assert!(f.finished(1, Some(3.0)));
        assert!((f.decode_s[0] - DECODE_EWMA * 2.0).abs() < 1e-12);
        f.book(2, 0, 0.0, 600.0);
        let d = f.decode_s[0];
        assert!((f.queue_s(0, 600.0) - 0.2 * d).abs() < 1e-12);
        assert!(!f.first_token(9, 0.0) && !f.finished(9, None));
        assert_eq!(f.queue_s(7, 1.0), 0.0, "an unknown instance has no queue");
    }

    proptest! {
        /// Whatever the order of bookings, first tokens and ends, queues are never negative
        /// and return to zero once every request ended.
        #[test]
        fn queues_stay_non_negative_and_drain(
            ops in prop::collection::vec((0u64..12, 0usize..3, 0u8..3, 0.0f64..2.0), 1..80),
        ) {
            let mut f = Feedback::new(3, 500.0);
            let mut t = 0.0;
            for (id, inst, op, x) in ops {
                t += x;
                match op {
                    0 => f.book(id, inst, x, x * 400.0),
                    1 => { f.first_token(id, t); }
                    _ => { f.finished(id, Some(t)); }
                }
                for i in 0..3 {
                    prop_assert!(f.queue_s(i, 100.0) >= 0.0);
                }
            }
            for id in 0..12 {
                f.finished(id, Some(t));
            }
            prop_assert_eq!(f.booked(), 0);
            for i in 0..3 {
                prop_assert!(f.pending_s[i].abs() < 1e-9 && f.held[i].abs() < 1e-9);
            }
        }
    }
}
