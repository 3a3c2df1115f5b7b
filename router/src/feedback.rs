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
//! - memory: the KV of its requests that have not ended, each prompt page counted once however
//!   many of them share it (a system prompt shared by every running request is on the device
//!   once), plus their outputs; what a new request would add beyond the device's capacity
//!   (its pages not already held there, and its output) waits for running requests to end,
//!   that share of the instance's mean decode time (first token to end, learnt from the ends
//!   seen, an exponential average).
//!
//! - lateness: how much later than predicted the instance's first tokens have come (an
//!   exponential average of observed − predicted TTFT, learnt at each first token); what it
//!   says beyond the other instances' fades once the instance's first tokens stop coming
//!   ([`LATE_HALF_LIFE_S`]), so an instance priced out by a transient is tried again.
//!
//! Why each page once: counted per request, a chat's 1,024-token system prompt was counted
//! once per running request, and the memory term then said 56 ms on average where the
//! requests waited no longer than those without one (docs/router.md, "Learning the queue").
//!
//! Why lateness: what the model leaves out is not zero and not the same on every instance.
//! On the chat at 4 instances and 85 % load, a request routed to an instance with no pending
//! prefill still waited 21 ms for its first token (the forward passes it joins carry every
//! running request's decode row); one whose instance had 40 ms pending waited 50. The
//! instance whose requests come late is the busy one, so learning it per instance is what
//! steers the next request away, and an estimate that over-states (a memory term where
//! memory frees faster than the average decode says) is corrected the same way. The queue
//! never goes below 0.
//!
//! A booking the caller never closes stays counted: a front end must report every end
//! (finished, aborted or failed), as it must to free the request anyway.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::BuildHasherDefault;

use crate::index::PageKeyHasher;

/// Page hash → how many running requests hold it (the keys are hashes already).
type HeldPages = HashMap<u64, u32, BuildHasherDefault<PageKeyHasher>>;

/// Weight of the latest decode time in the instance's average.
pub const DECODE_EWMA: f64 = 0.1;

/// Weight of the latest first token's lateness (observed TTFT − predicted) in the instance's
/// average. In an earlier variant the chat's figures hardly moved between 0.02 and 0.5
/// (docs/router.md, "Learning the queue").
pub const LATE_EWMA: f64 = 0.1;

/// Half-life, in seconds of the router's clock, of what an instance's lateness says beyond
/// the other instances' once its first tokens stop coming. Lateness is learnt only from
/// first tokens, so an instance that was late for a while (a transient) and is priced out
/// shows none and would keep that lateness for ever; decaying toward the others', it is
/// tried again and relearnt. Long against a request's life (seconds: a busy instance's
/// lateness is always fresh), short against an operator's patience (an instance starved for
/// a transient is back within minutes).
pub const LATE_HALF_LIFE_S: f64 = 60.0;

/// How a booked request's first token becomes known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstToken {
    /// The caller reports it ([`Feedback::first_token`]): a streamed answer's first chunk.
    Reported,
    /// Nobody sees it (an answer sent whole at its end): its prefill is taken as done when
    /// the model predicted, and nothing is learnt from it but its end.
    AtEstimate,
}

struct Booking {
    instance: usize,
    work_s: f64,
    /// The prompt's whole pages (their hashes), held while the request runs.
    pages: Vec<u64>,
    /// Tokens held outside those pages: the prompt's partial last page and the output.
    extra_tokens: f64,
    prefilled_at: Option<f64>,
    /// When it was routed, and the TTFT predicted then: its first token says how late it was.
    routed_at: f64,
    predicted_s: f64,
    first: FirstToken,
}

/// A routing decision as the queue books it.
#[derive(Clone, Copy, Debug)]
pub struct Routed {
    /// Its prefill work (compute and loads).
    pub work_s: f64,
    /// Its TTFT as the model predicted it, without the instance's lateness.
    pub predicted_s: f64,
    /// When it was routed.
    pub at_s: f64,
    pub first: FirstToken,
}

/// What a request holds on its instance's device while it runs.
#[derive(Clone, Copy, Debug)]
pub struct Held<'a> {
    /// Its prompt's whole pages, by hash.
    pub pages: &'a [u64],
    /// Its other tokens: the prompt's partial last page and the output.
    pub extra_tokens: f64,
}

pub struct Feedback {
    device_tokens: f64,
    page_tokens: f64,
    booked: HashMap<u64, Booking>,
    pending_s: Vec<f64>,
    /// Per instance: the prompt pages its running requests hold, each with how many hold it.
    /// Invariant: the count is the number of booked requests on that instance listing the
    /// page, and a page with none is not in the map.
    held_pages: Vec<HeldPages>,
    /// Per instance: the booked requests' `extra_tokens`, summed.
    held_extra: Vec<f64>,
    /// Per instance: requests booked and not yet ended.
    running: Vec<usize>,
    decode_s: Vec<f64>,
    /// Per instance: how much later than predicted its first tokens come, an exponential
    /// average; added to its queue (the model's bias there, learnt).
    late_s: Vec<f64>,
    /// Per instance: when its latest first token was learnt from (`None`: never; its
    /// `late_s` is then not learnt).
    late_seen_at: Vec<Option<f64>>,
    /// The sum of `late_s` over the instances that have learnt one, and their number, kept
    /// at each first token learnt from, so a route prices every instance's lateness against
    /// the others' mean in O(instances), not O(instances²).
    late_sum: (f64, usize),
    /// [`FirstToken::AtEstimate`] bookings by when their first token is taken to come (ns).
    unseen: BinaryHeap<Reverse<(u64, u64)>>,
}

impl Feedback {
    /// `instances` instances whose devices hold `device_tokens` tokens of KV each, in pages of
    /// `page_tokens` tokens.
    pub fn new(instances: usize, device_tokens: f64, page_tokens: usize) -> Self {
        Self {
            device_tokens,
            page_tokens: page_tokens as f64,
            booked: HashMap::new(),
            pending_s: vec![0.0; instances],
            held_pages: vec![HeldPages::default(); instances],
            held_extra: vec![0.0; instances],
            running: vec![0; instances],
            decode_s: vec![0.0; instances],
            late_s: vec![0.0; instances],
            late_seen_at: vec![None; instances],
            late_sum: (0.0, 0),
            unseen: BinaryHeap::new(),
        }
    }

    /// Tokens of KV the running requests of `instance` hold.
    pub fn held_tokens(&self, instance: usize) -> f64 {
        match (self.held_pages.get(instance), self.held_extra.get(instance)) {
            (Some(p), Some(e)) => p.len() as f64 * self.page_tokens + e,
            _ => 0.0,
        }
    }

    /// Seconds a new request holding `held` would wait on `instance`.
    pub fn queue_s(&self, instance: usize, held: Held<'_>) -> f64 {
        let (Some(p), Some(pages), Some(d)) = (
            self.pending_s.get(instance),
            self.held_pages.get(instance),
            self.decode_s.get(instance),
        ) else {
            return 0.0;
        };
        let new_pages = held.pages.iter().filter(|h| !pages.contains_key(h)).count();
        let adds = new_pages as f64 * self.page_tokens + held.extra_tokens;
        let over = (self.held_tokens(instance) + adds - self.device_tokens).max(0.0);
        let memory = if self.device_tokens > 0.0 {
            (over / self.device_tokens).min(1.0) * d
        } else {
            0.0
        };
        p + memory
    }

    /// How much later than predicted `instance`'s first tokens come (negative: earlier), as
    /// of `now_s`. An instance none of whose first tokens was seen yet is taken to be as late
    /// as the average of the others seen: part of the lateness is the model's error on every
    /// instance (a prefill rate set too high), and an instance unseen is not faster for being
    /// unseen. What an instance's own lateness says beyond that average decays with the time
    /// since its latest first token ([`LATE_HALF_LIFE_S`]).
    pub fn late_s(&self, instance: usize, now_s: f64) -> f64 {
        let Some(seen_at) = self.late_seen_at.get(instance) else {
            return 0.0;
        };
        // the others' mean: the kept sum without this instance's own term
        let (mut sum, mut n) = self.late_sum;
        if seen_at.is_some() {
            sum -= self.late_s[instance];
            n -= 1;
        }
        let others = if n == 0 { 0.0 } else { sum / n as f64 };
        match seen_at {
            None => others,
            Some(_) => others + (self.late_s[instance] - others) * self.freshness(instance, now_s),
        }
    }

    /// How much of `instance`'s own lateness estimate still holds at `now_s`: 1 when its
    /// latest first token is now (or it has none: its estimate starts at 0, on time), halved
    /// every [`LATE_HALF_LIFE_S`] after.
    fn freshness(&self, instance: usize, now_s: f64) -> f64 {
        match self.late_seen_at.get(instance) {
            Some(Some(at)) => (-(now_s - at).max(0.0) / LATE_HALF_LIFE_S).exp2(),
            _ => 1.0,
        }
    }

    /// Request `id` was routed to `instance` as `routed` says, holding `held` of KV while it
    /// runs.
    pub fn book(&mut self, id: u64, instance: usize, routed: Routed, held: Held<'_>) {
        if instance >= self.pending_s.len() {
            return;
        }
        let Routed {
            work_s,
            predicted_s,
            at_s: now_s,
            first,
        } = routed;
        if first == FirstToken::AtEstimate {
            self.unseen.push(Reverse((due(now_s, predicted_s), id)));
        }
        self.finished(id, None);
        self.pending_s[instance] += work_s;
        for &h in held.pages {
            *self.held_pages[instance].entry(h).or_insert(0) += 1;
        }
        self.held_extra[instance] += held.extra_tokens;
        self.running[instance] += 1;
        self.booked.insert(
            id,
            Booking {
                instance,
                work_s,
                pages: held.pages.to_vec(),
                extra_tokens: held.extra_tokens,
                prefilled_at: None,
                routed_at: now_s,
                predicted_s,
                first,
            },
        );
    }

    /// Request `id` produced its first token at `now_s`; `false` if it is not booked.
    pub fn first_token(&mut self, id: u64, now_s: f64) -> bool {
        self.prefilled(id, now_s, Learn::Lateness)
    }

    /// The bookings whose first token nobody sees ([`FirstToken::AtEstimate`]) and whose
    /// predicted first token is due by `now_s` leave the pending prefill, learning nothing.
    pub fn settle(&mut self, now_s: f64) {
        let now = due(now_s, 0.0);
        while let Some(&Reverse((due, id))) = self.unseen.peek() {
            if due > now {
                break;
            }
            self.unseen.pop();
            // the entry of this booking, not of an earlier one under the same id
            let mine = self
                .booked
                .get(&id)
                .is_some_and(|b| b.first == FirstToken::AtEstimate && due_of(b) == due);
            if mine {
                self.prefilled(id, due as f64 / 1e9, Learn::Nothing);
            }
        }
    }

    fn prefilled(&mut self, id: u64, at_s: f64, learn: Learn) -> bool {
        let Some(b) = self.booked.get_mut(&id) else {
            return false;
        };
        if b.prefilled_at.is_some() {
            return true;
        }
        b.prefilled_at = Some(at_s);
        let (i, work_s, late) = (b.instance, b.work_s, (at_s - b.routed_at) - b.predicted_s);
        if learn == Learn::Lateness {
            // The older the instance's estimate, the more the new first token weighs: LATE_EWMA
            // when it is fresh, all of it when the estimate has faded, so an instance tried
            // again after a transient relearns at its first on-time token. (Its own average,
            // not pulled toward the others': an instance seen once a second keeps its
            // lateness.)
            let w = self.freshness(i, at_s);
            let weight = 1.0 - (1.0 - LATE_EWMA) * w;
            self.late_s[i] += weight * (late - self.late_s[i]);
            self.late_seen_at[i] = Some(at_s);
            // recomputed, not adjusted, so no rounding accumulates over a long run
            self.late_sum = self
                .late_s
                .iter()
                .zip(&self.late_seen_at)
                .filter(|(_, at)| at.is_some())
                .fold((0.0, 0), |(s, n), (l, _)| (s + l, n + 1));
        }
        let p = &mut self.pending_s[i];
        *p = (*p - work_s).max(0.0);
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
        let pages = &mut self.held_pages[i];
        for h in &b.pages {
            if let Some(n) = pages.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    pages.remove(h);
                }
            }
        }
        self.held_extra[i] = (self.held_extra[i] - b.extra_tokens).max(0.0);
        self.running[i] = self.running[i].saturating_sub(1);
        true
    }

    /// Request `id` will not run (its instance refused it): dropped, nothing learnt. `false`
    /// if it is not booked.
    pub fn cancel(&mut self, id: u64) -> bool {
        self.finished(id, None)
    }

    /// Requests booked on `instance` and not yet ended (0 for an unknown instance).
    pub fn running(&self, instance: usize) -> usize {
        self.running.get(instance).copied().unwrap_or(0)
    }

    /// Requests booked and not yet ended.
    pub fn booked(&self) -> usize {
        self.booked.len()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Learn {
    Lateness,
    Nothing,
}

/// When a booking's first token is taken to come, in whole nanoseconds (for ordering; times
/// before 0 count as 0).
fn due(at_s: f64, predicted_s: f64) -> u64 {
    ((at_s + predicted_s).max(0.0) * 1e9) as u64
}

fn due_of(b: &Booking) -> u64 {
    due(b.routed_at, b.predicted_s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn routed(work_s: f64, predicted_s: f64, at_s: f64) -> Routed {
        Routed {
            work_s,
            predicted_s,
            at_s,
            first: FirstToken::Reported,
        }
    }

    fn held(pages: &[u64], extra: f64) -> Held<'_> {
        Held {
            pages,
            extra_tokens: extra,
        }
    }

    #[test]
    fn pending_prefill_leaves_at_the_first_token_and_memory_at_the_end() {
        let mut f = Feedback::new(2, 1000.0, 100);
        let six: Vec<u64> = (0..6).collect();
        // routed at 0.5 with 0.5 s of work: its first token at 1.0 is on time
        f.book(1, 0, routed(0.5, 0.5, 0.5), held(&six, 0.0));
        assert_eq!(f.queue_s(0, held(&[], 100.0)), 0.5);
        assert!(f.first_token(1, 1.0));
        assert_eq!(f.queue_s(0, held(&[], 100.0)), 0.0);
        // 600 held + 600 new is 200 over 1000: a fifth of the decode time, once learnt.
        assert!(f.finished(1, Some(3.0)));
        assert!((f.decode_s[0] - DECODE_EWMA * 2.0).abs() < 1e-12);
        f.book(2, 0, routed(0.0, 0.0, 0.0), held(&six, 0.0));
        let d = f.decode_s[0];
        let other: Vec<u64> = (10..16).collect();
        assert!((f.queue_s(0, held(&other, 0.0)) - 0.2 * d).abs() < 1e-12);
        assert!(!f.first_token(9, 0.0) && !f.finished(9, None));
        assert_eq!(
            f.queue_s(7, held(&[], 1.0)),
            0.0,
            "an unknown instance has no queue"
        );
    }

    #[test]
    fn a_page_shared_by_running_requests_is_held_once() {
        let mut f = Feedback::new(1, 1000.0, 100);
        f.decode_s[0] = 1.0;
        let system: Vec<u64> = (0..5).collect();
        let (mut a, mut b) = (system.clone(), system.clone());
        a.extend([100, 101]);
        b.extend([200, 201]);
        f.book(1, 0, routed(0.0, 0.0, 0.0), held(&a, 30.0));
        f.book(2, 0, routed(0.0, 0.0, 0.0), held(&b, 30.0));
        // 5 shared + 2 + 2 own pages and 60 extra tokens: 960, not 1,460
        assert!((f.held_tokens(0) - 960.0).abs() < 1e-9);
        // a third sharing the system prompt adds its own 2 pages only: 160 over
        let mut c = system.clone();
        c.extend([300, 301]);
        assert!((f.queue_s(0, held(&c, 0.0)) - 0.16).abs() < 1e-9);
        // the shared pages stay held until their last holder ends
        f.finished(1, None);
        assert!((f.held_tokens(0) - 730.0).abs() < 1e-9);
        f.finished(2, None);
        assert_eq!(f.held_tokens(0), 0.0);
        assert!(f.held_pages[0].is_empty());
    }

    #[test]
    fn an_instance_whose_first_tokens_come_late_is_learnt_and_early_ones_too() {
        let mut f = Feedback::new(2, 1e6, 16);
        for k in 0..200u64 {
            let t = k as f64;
            // instance 0: every first token 20 ms after its predicted 10 ms
            f.book(2 * k, 0, routed(0.01, 0.01, t), held(&[], 1.0));
            assert!(f.first_token(2 * k, t + 0.03));
            // instance 1: every first token 50 ms before its predicted 100 ms
            f.book(2 * k + 1, 1, routed(0.1, 0.1, t), held(&[], 1.0));
            assert!(f.first_token(2 * k + 1, t + 0.05));
        }
        // (as of instance 0's last first token: instance 1's came 20 ms later)
        let now = 199.03;
        assert!(
            (f.late_s(0, now) - 0.02).abs() < 1e-6,
            "{}",
            f.late_s(0, now)
        );
        assert!(
            (f.late_s(1, now) + 0.05).abs() < 1e-6,
            "{}",
            f.late_s(1, now)
        );
        assert_eq!(f.late_s(7, now), 0.0, "an unknown instance is never late");
        // an instance none of whose first tokens was seen: the average of those seen
        let mut g = Feedback::new(3, 1e6, 16);
        assert_eq!(g.late_s(2, 0.0), 0.0, "nothing seen anywhere");
        for (id, inst, first) in [(1, 0, 0.21), (2, 1, 0.41)] {
            g.book(id, inst, routed(0.01, 0.01, 0.0), held(&[], 1.0));
            assert!(g.first_token(id, first));
        }
        assert!((g.late_s(0, 0.21) - 0.02).abs() < 1e-9 && (g.late_s(1, 0.41) - 0.04).abs() < 1e-9);
        assert!(
            (g.late_s(2, 0.41) - 0.03).abs() < 1e-9,
            "{}",
            g.late_s(2, 0.41)
        );
        // an instance not seen for a while: what its lateness says beyond the others' halves
        // every LATE_HALF_LIFE_S (instance 0: 0.04 + (0.02 - 0.04) / 2 one half-life on)
        let later = 0.21 + LATE_HALF_LIFE_S;
        assert!(
            (g.late_s(0, later) - 0.03).abs() < 1e-9,
            "{}",
            g.late_s(0, later)
        );
        assert!((g.late_s(0, 0.21 + 20.0 * LATE_HALF_LIFE_S) - 0.04).abs() < 1e-6);
        assert!(
            (g.late_s(0, 0.0) - 0.02).abs() < 1e-9,
            "a time before it was seen: as seen"
        );
        // a first token reported twice is learnt once
        let before = f.late_s(0, now);
        assert!(f.first_token(398, 500.0));
        assert_eq!(f.late_s(0, now), before);
    }

    #[test]
    fn an_unseen_first_token_leaves_the_queue_when_predicted_and_teaches_nothing() {
        let mut f = Feedback::new(1, 1e6, 16);
        let unseen = Routed {
            first: FirstToken::AtEstimate,
            ..routed(0.3, 0.5, 1.0)
        };
        f.book(1, 0, unseen, held(&[], 1.0));
        f.settle(1.4);
        assert!(
            (f.queue_s(0, held(&[], 1.0)) - 0.3).abs() < 1e-9,
            "due at 1.5"
        );
        f.settle(1.5);
        assert_eq!(f.queue_s(0, held(&[], 1.0)), 0.0);
        assert_eq!(f.late_s(0, 2.0), 0.0);
        // a cancelled booking's entry is skipped; a new booking under its id is its own
        f.book(2, 0, unseen, held(&[], 1.0));
        assert!(f.cancel(2) && !f.cancel(2));
        f.book(2, 0, routed(0.3, 0.5, 1.2), held(&[], 1.0));
        f.settle(2.0);
        assert!(
            (f.queue_s(0, held(&[], 1.0)) - 0.3).abs() < 1e-9,
            "reported: waits"
        );
        assert!(f.first_token(2, 2.1) && f.finished(2, Some(3.0)));
        assert_eq!(f.booked(), 1, "request 1 runs until its end");
        assert!(f.finished(1, Some(3.0)));
    }

    /// `late_s` as defined, the others' mean computed from scratch: what the kept sum must
    /// give.
    fn late_s_by_definition(f: &Feedback, instance: usize, now_s: f64) -> f64 {
        let Some(seen_at) = f.late_seen_at.get(instance) else {
            return 0.0;
        };
        let others: Vec<f64> = (0..f.late_s.len())
            .filter(|&j| j != instance && f.late_seen_at[j].is_some())
            .map(|j| f.late_s[j])
            .collect();
        let mean = if others.is_empty() {
            0.0
        } else {
            others.iter().sum::<f64>() / others.len() as f64
        };
        match seen_at {
            None => mean,
            Some(_) => mean + (f.late_s[instance] - mean) * f.freshness(instance, now_s),
        }
    }

    proptest! {
        /// The others' mean from the sum kept at each first token equals the mean computed
        /// from scratch, for every instance, at any mix of learnt and unlearnt instances.
        #[test]
        fn the_kept_lateness_sum_prices_like_the_definition(
            tokens in proptest::collection::vec((0usize..6, 0.0f64..0.5, 0.0f64..2.0), 0..60),
        ) {
            let mut f = Feedback::new(6, 1e6, 16);
            let mut now = 0.0;
            for (id, &(inst, predicted, late)) in tokens.iter().enumerate() {
                now += 1.0;
                f.book(id as u64, inst, routed(0.01, predicted, now), held(&[], 1.0));
                prop_assert!(f.first_token(id as u64, now + predicted + late));
                for i in 0..7 {
                    let (got, want) = (f.late_s(i, now + 5.0), late_s_by_definition(&f, i, now + 5.0));
                    prop_assert!((got - want).abs() < 1e-9, "instance {i}: {got} vs {want}");
                }
            }
        }

        /// However far apart an instance's first tokens come (a second or ten minutes), a
        /// constant lateness is learnt exactly (the decay never pulls the estimate toward
        /// the other instances'), and the price between first tokens always lies between
        /// the instance's own estimate and the others' average.
        #[test]
        fn lateness_is_learnt_at_any_spacing_and_priced_between_own_and_others(
            gaps in prop::collection::vec(0.0f64..600.0, 100..140),
            late in -0.5f64..2.0,
            other in -0.5f64..2.0,
        ) {
            let mut f = Feedback::new(2, 1e6, 16);
            f.book(1_000_000, 1, routed(0.01, 0.01, 0.0), held(&[], 1.0));
            prop_assert!(f.first_token(1_000_000, 0.01 + other / LATE_EWMA));
            let mut t = 0.0;
            for (k, gap) in gaps.iter().enumerate() {
                t += gap;
                let (own, others) = (f.late_s[0], f.late_s[1]);
                let priced = f.late_s(0, t);
                prop_assert!(priced >= own.min(others) - 1e-9 && priced <= own.max(others) + 1e-9);
                f.book(k as u64, 0, routed(0.01, 0.01, t), held(&[], 1.0));
                prop_assert!(f.first_token(k as u64, t + 0.01 + late));
                prop_assert!(f.finished(k as u64, Some(t + 0.1)));
            }
            prop_assert!((f.late_s(0, t + 0.01 + late) - late).abs() < 1e-3, "{} vs {late}", f.late_s(0, t));
        }

        /// Whatever the order of bookings, first tokens and ends, queues are never negative,
        /// the held pages are exactly the union of the running requests' pages, and everything
        /// returns to zero once every request ended.
        #[test]
        fn queues_stay_non_negative_and_drain(
            ops in prop::collection::vec(
                (0u64..12, 0usize..3, 0u8..4, 0.0f64..2.0, prop::collection::vec(0u64..20, 0..6)),
                1..80,
            ),
        ) {
            let mut f = Feedback::new(3, 500.0, 16);
            let mut t = 0.0;
            let mut running: HashMap<u64, (usize, Vec<u64>)> = HashMap::new();
            for (id, inst, op, x, pages) in ops {
                t += x;
                match op {
                    0 => {
                        let mut r = routed(x, x, t);
                        if id % 2 == 1 {
                            r.first = FirstToken::AtEstimate;
                        }
                        f.book(id, inst, r, held(&pages, x * 40.0));
                        running.insert(id, (inst, pages));
                    }
                    1 => { f.first_token(id, t); }
                    2 => f.settle(t),
                    _ => {
                        f.finished(id, Some(t));
                        running.remove(&id);
                    }
                }
                for i in 0..3 {
                    prop_assert!(f.queue_s(i, held(&[1, 2], 100.0)) >= 0.0);
                    let union: std::collections::HashSet<u64> = running
                        .values()
                        .filter(|(j, _)| *j == i)
                        .flat_map(|(_, p)| p.iter().copied())
                        .collect();
                    let mine: std::collections::HashSet<u64> =
                        f.held_pages[i].keys().copied().collect();
                    prop_assert_eq!(mine, union);
                    prop_assert_eq!(
                        f.running(i),
                        running.values().filter(|(j, _)| *j == i).count()
                    );
                }
            }
            for id in 0..12 {
                f.finished(id, Some(t));
            }
            prop_assert_eq!(f.booked(), 0);
            for i in 0..3 {
                prop_assert!(f.pending_s[i].abs() < 1e-9 && f.held_tokens(i).abs() < 1e-9);
            }
        }
    }
}
