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
//!   once), plus their outputs. An engine admits its waiting requests in order, each once
//!   the device has room for its prompt (its output grows into the room later), so a new
//!   request starts its prefill when the requests ahead of it are prefilled *and* enough
//!   running requests have ended to make room for it and for those ahead: the queue
//!   replays that on the instance's timeline ([`Feedback::queue_s`]), each request ending
//!   its output's decode steps after its first token at the instance's time per step
//!   (learnt from the ends seen, from the [`crate::Occupancy`]'s decode step until then).
//!   A request is taken to hold what it can have generated in that time: declared outputs
//!   (`max_tokens`) that overstate what requests generate do not fill the device.
//!
//! - lateness: how much later than predicted the instance's first tokens have come (an
//!   exponential average of observed − predicted TTFT, learnt at each first token); what it
//!   says beyond the other instances' fades once the instance's first tokens stop coming
//!   ([`LATE_HALF_LIFE_S`]), so an instance priced out by a transient is tried again.
//!   A request whose client gave up before its first token (or before its whole answer)
//!   shows no first token, only that it came no sooner than that: [`Feedback::abandoned`]
//!   learns at least that much lateness, as the instance's own (an instance that hangs is
//!   no error of the model's every instance shares), until its next first token or end.
//!
//! Why a timeline, not a share of the mean decode time: the queue used to add, for what a
//! new request would hold beyond the device's capacity, that share of the instance's mean
//! decode time. On the conversation trace (4 instances, 85 % load) prompts reach 120K of the
//! device's 131K tokens: a request routed behind such a prompt waits until the prompt has
//! been prefilled *and* has decoded its whole answer, seconds, where the share said under
//! a second (and nothing before an end was seen); 11 of the 25 slowest first tokens of the
//! first 2,000 requests were requests waiting behind a prompt of 60K tokens or more
//! (docs/router/history.md, "Memory on the timeline").
//!
//! Why each page once: counted per request, a chat's 1,024-token system prompt was counted
//! once per running request, and the memory term then said 56 ms on average where the
//! requests waited no longer than those without one (docs/router/history.md, "Learning the
//! queue").
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
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::hash::BuildHasherDefault;

use crate::index::PageKeyHasher;

mod timeline;
use timeline::Timeline;

/// Page hash → how many running requests hold it (the keys are hashes already).
type HeldPages = HashMap<u64, u32, BuildHasherDefault<PageKeyHasher>>;

/// Weight of the latest end's decode time, and of its decode steps, in the instance's
/// averages (their ratio is its time per decode step).
pub const DECODE_EWMA: f64 = 0.1;

/// Weight of the latest first token's lateness (observed TTFT − predicted) in the instance's
/// average. In an earlier variant the chat's figures hardly moved between 0.02 and 0.5
/// (docs/router/history.md, "Learning the queue").
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
    /// Its place in its instance's arrival order (the engine admits in that order).
    seq: u64,
    work_s: f64,
    /// Tokens of device memory it takes when admitted: its pages no earlier booking on the
    /// instance held when it was booked, and its extra tokens.
    own_tokens: f64,
    /// Output tokens it is expected to generate (its decode time is learnt per decode step).
    output: f64,
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
    /// Output tokens it is expected to generate (0 if unknown).
    pub output: usize,
}

pub struct Feedback {
    device_tokens: f64,
    page_tokens: f64,
    booked: HashMap<u64, Booking>,
    /// Per instance: its bookings in arrival order (sequence number → id).
    order: Vec<BTreeMap<u64, u64>>,
    next_seq: u64,
    pending_s: Vec<f64>,
    /// Per instance: the prompt pages its running requests hold, each with how many hold it.
    /// Invariant: the count is the number of booked requests on that instance listing the
    /// page, and a page with none is not in the map.
    held_pages: Vec<HeldPages>,
    /// Per instance: the booked requests' `extra_tokens`, summed.
    held_extra: Vec<f64>,
    /// Per instance: requests booked and not yet ended.
    running: Vec<usize>,
    /// Per instance: exponential averages of the ends seen, seconds from first token to end
    /// and decode steps in that time (from one step at the decode step given at
    /// construction); their ratio is the instance's time per decode step. A ratio of
    /// averages, not an average of ratios: a request of 2 tokens whose one step rode in a
    /// long prefill's forward says little about how long a 500-token answer takes.
    decode: Vec<(f64, f64)>,
    /// Seconds of one decode step (a forward with decode rows only): no request generates
    /// faster.
    decode_step_s: f64,
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
    /// Per instance: lateness learnt from requests given up on before their first token
    /// ([`Self::abandoned`]), beyond `late_s`, and when it was learnt; it fades as lateness
    /// does and goes at the instance's next first token or end. Not in `late_sum`: a hung
    /// instance says nothing of the others.
    stall: Vec<(f64, f64)>,
    /// [`FirstToken::AtEstimate`] bookings by when their first token is taken to come (ns).
    unseen: BinaryHeap<Reverse<(u64, u64)>>,
}

impl Feedback {
    /// `instances` instances whose devices hold `device_tokens` tokens of KV each, in pages of
    /// `page_tokens` tokens, taking `decode_step_s` a decode step until their ends teach
    /// better (0: requests are taken to end at their first token until then).
    pub fn new(
        instances: usize,
        device_tokens: f64,
        page_tokens: usize,
        decode_step_s: f64,
    ) -> Self {
        Self {
            device_tokens,
            page_tokens: page_tokens as f64,
            booked: HashMap::new(),
            order: vec![BTreeMap::new(); instances],
            next_seq: 0,
            pending_s: vec![0.0; instances],
            held_pages: vec![HeldPages::default(); instances],
            held_extra: vec![0.0; instances],
            running: vec![0; instances],
            decode: vec![(decode_step_s.max(0.0), 1.0); instances],
            decode_step_s: decode_step_s.max(0.0),
            late_s: vec![0.0; instances],
            late_seen_at: vec![None; instances],
            late_sum: (0.0, 0),
            stall: vec![(0.0, 0.0); instances],
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

    /// Seconds a new request holding `held` would wait on `instance` from `now_s` before its
    /// prefill starts: the instance's timeline replayed. Its running requests hold their
    /// memory until their expected ends (first token + their decode steps × the instance's
    /// time per step; one overdue ends now); its waiting requests are admitted in arrival order,
    /// each once the prefills ahead of it are done and the device has room for it (ends free
    /// room in time order), and hold their memory from then until their own ends; the new
    /// request is admitted after them the same way. Without a device size (0), memory is not
    /// counted and the queue is the waiting requests' prefill work.
    pub fn queue_s(&self, instance: usize, held: Held<'_>, now_s: f64) -> f64 {
        let (Some(&pending), Some(order), Some(pages)) = (
            self.pending_s.get(instance),
            self.order.get(instance),
            self.held_pages.get(instance),
        ) else {
            return 0.0;
        };
        if self.device_tokens <= 0.0 {
            return pending;
        }
        let step_s = self.step_s(instance);
        // A request generates at most its decode time over the decode step: when the
        // declared outputs (`max_tokens`) overstate what requests generate, they end sooner
        // than their declared output at the decode step would say, and hold that much less.
        let generated = if self.decode_step_s > 0.0 {
            (step_s / self.decode_step_s).min(1.0)
        } else {
            1.0
        };
        let holds = |b: &Booking| (b.own_tokens - b.output * (1.0 - generated)).max(0.0);
        let mut line = Timeline::new(self.device_tokens, now_s);
        let mut waiting = Vec::new();
        for id in order.values() {
            let Some(b) = self.booked.get(id) else {
                continue;
            };
            match b.prefilled_at {
                Some(t) => line.running(t + decode_steps(b.output) * step_s, holds(b)),
                None => waiting.push(b),
            }
        }
        for b in waiting {
            line.admit(
                (b.own_tokens - b.output).max(0.0),
                holds(b),
                b.work_s,
                decode_steps(b.output) * step_s,
            );
        }
        let new_pages = held.pages.iter().filter(|h| !pages.contains_key(h)).count();
        let need = new_pages as f64 * self.page_tokens + held.extra_tokens - held.output as f64;
        line.admit(need.max(0.0), 0.0, 0.0, 0.0) - now_s
    }

    /// Seconds per decode step on `instance`, as learnt from its ends.
    pub fn step_s(&self, instance: usize) -> f64 {
        self.decode.get(instance).map_or(0.0, |&(d, n)| d / n)
    }

    /// How much later than predicted `instance`'s first tokens come (negative: earlier), as
    /// of `now_s`. An instance none of whose first tokens was seen yet is taken to be as late
    /// as the average of the others seen: part of the lateness is the model's error on every
    /// instance (a prefill rate set too high), and an instance unseen is not faster for being
    /// unseen. What an instance's own lateness says beyond that average decays with the time
    /// since its latest first token ([`LATE_HALF_LIFE_S`]). Lateness learnt from requests
    /// given up on ([`Self::abandoned`]) is added.
    pub fn late_s(&self, instance: usize, now_s: f64) -> f64 {
        self.first_token_late_s(instance, now_s) + self.stall_s(instance, now_s)
    }

    /// [`Self::late_s`] as the first tokens alone say it.
    fn first_token_late_s(&self, instance: usize, now_s: f64) -> f64 {
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

    /// The lateness requests given up on taught `instance` beyond its first tokens', as of
    /// `now_s`: halved every [`LATE_HALF_LIFE_S`] after the latest.
    fn stall_s(&self, instance: usize, now_s: f64) -> f64 {
        self.stall.get(instance).map_or(0.0, |&(s, at)| {
            s * (-(now_s - at).max(0.0) / LATE_HALF_LIFE_S).exp2()
        })
    }

    /// Request `id`'s client gave up at `now_s` before its first token (a streamed answer)
    /// or before its answer (one sent whole), or the proxy gave up waiting for its head: it
    /// ends, and its instance's lateness is learnt to be at least the time it waited past its
    /// predicted first token, as a first token that late would teach it (never lowered: a
    /// client that leaves early says nothing). `false` if it is not booked.
    pub fn abandoned(&mut self, id: u64, now_s: f64) -> bool {
        let Some(b) = self.booked.get(&id) else {
            return false;
        };
        let (i, waited_late) = (b.instance, (now_s - b.routed_at) - b.predicted_s);
        let late = self.late_s(i, now_s);
        if waited_late.is_finite() && waited_late > late {
            let w = 1.0 - (1.0 - LATE_EWMA) * self.freshness(i, now_s);
            let stall = self.stall_s(i, now_s) + w * (waited_late - late);
            if let Some(s) = self.stall.get_mut(i) {
                *s = (stall, now_s);
            }
        }
        self.finished(id, None)
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
        let mut new_pages = 0usize;
        for &h in held.pages {
            let n = self.held_pages[instance].entry(h).or_insert(0);
            if *n == 0 {
                new_pages += 1;
            }
            *n += 1;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.order[instance].insert(seq, id);
        self.held_extra[instance] += held.extra_tokens;
        self.running[instance] += 1;
        self.booked.insert(
            id,
            Booking {
                instance,
                seq,
                work_s,
                own_tokens: new_pages as f64 * self.page_tokens + held.extra_tokens,
                output: held.output as f64,
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
            self.stall[i] = (0.0, at_s); // it answers: what its first tokens say holds
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
        if now_s.is_some() {
            self.stall[i].0 = 0.0; // it answered
        }
        match b.prefilled_at {
            None => self.pending_s[i] = (self.pending_s[i] - b.work_s).max(0.0),
            Some(t) => {
                if let Some(now) = now_s {
                    let steps = decode_steps(b.output);
                    if steps > 0.0 {
                        let (d, n) = &mut self.decode[i];
                        *d += DECODE_EWMA * ((now - t).max(0.0) - *d);
                        *n += DECODE_EWMA * (steps - *n);
                    }
                }
            }
        }
        self.order[i].remove(&b.seq);
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

/// Decode steps after the first token of a request generating `output` tokens (the first
/// comes from its prefill). An unknown output (0) counts as one step: the instance then
/// learns, and predicts, the whole decode time of such requests per request.
fn decode_steps(output: f64) -> f64 {
    if output <= 0.0 {
        1.0
    } else {
        (output - 1.0).max(0.0)
    }
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
mod tests;
