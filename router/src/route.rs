//! The decision: the instance where the request costs least — its expected TTFT, each
//! instance's queue included, plus the delay its work imposes on the requests that will queue
//! behind it there.
//!
//! Why the second term: a router that minimises each request's own TTFT moves a conversation
//! off the instance holding its KV as soon as that instance's queue is a little longer than
//! the recompute (or L3 load) elsewhere, and the recompute is work every later request on the
//! new instance waits for. On the built-in chat (4 instances, 85 % load) the greedy rule moved
//! 563 of 3,200 turns off their KV, with home queues of 8–24 ms against 6–15 ms of extra work;
//! its p99 was 109 ms where session affinity had 69 ms. Counting each second of work once more,
//! for the requests behind it (`cost = ttft + delay_weight × work`, [`DELAY_WEIGHT`] = 1), keeps
//! a turn home until its queue outweighs twice the work saved (docs/router/history.md has the
//! figures for weights 0, 0.5, 1 and 2).
//!
//! Except on an idle instance (nothing queued, nothing running): no request waits behind work
//! there, so its cost is the request's TTFT alone. Without this exception the chat's
//! conversations never went to an instance that had not yet computed their 1,024-token
//! system prompt (twice that prompt's work, 34 ms, outweighed the busy instances' queues), and
//! at 8 instances one stayed idle through the whole run (docs/router/history.md, "Idle
//! instances").
//!
//! The router keeps each instance's queue itself, in seconds of work: a routed request adds
//! its estimated work (compute plus loads, or, with an [`Occupancy`] set, the device
//! memory-time it will hold while decoding if that is larger) to its instance, and every instance drains one
//! second of work per second of the caller's clock. So a hot prefix goes to the instance
//! holding it until that instance's queue outweighs what the prefix saves, then spreads. Ties
//! go to the shorter queue, then the lower index, so equal inputs give equal choices.

use kvtier_events::HashFormat;
use kvtier_radix::HashScope;

use crate::cost::{CostModel, Estimate};
use crate::feedback::{Feedback, FirstToken, Held, Routed};
use crate::index::{Budget, ClusterIndex, DecodeError, IndexEvent, decode_batch};
use crate::occupancy::Occupancy;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RouteError {
    #[error("the router has no instances")]
    NoInstances,
    #[error("instance {0} does not exist ({1} instances)")]
    UnknownInstance(usize, usize),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("the delay weight must be finite and at least 0, got {0}")]
    BadDelayWeight(String),
    #[error("a time must be finite, got {0}")]
    BadTime(String),
    #[error("device tokens and decode step must be finite and at least 0, got {0}")]
    BadOccupancy(String),
    #[error("cost model: {0}")]
    BadModel(String),
    #[error("a booking's time to live must be a positive number of seconds, got {0}")]
    BadBookingTtl(String),
}

/// The weight of a request's work in its routing cost, for the requests that will wait behind
/// it (see the module docs; 0 routes by the request's own TTFT alone).
pub const DELAY_WEIGHT: f64 = 1.0;

/// The most output tokens a request is counted with without an [`Occupancy`] (more than any
/// model's context); with one, at most the device's tokens ([`Router::max_output_tokens`]).
pub const MAX_OUTPUT_TOKENS: usize = 1 << 24;

pub struct Router {
    index: ClusterIndex,
    model: CostModel,
    /// Per instance: the work of requests routed without a lifecycle to report
    /// ([`Self::route_request`] and the calls built on it), drained by the clock. The work of
    /// booked requests is the [`Feedback`]'s; an instance's queue is the sum of both, so a
    /// front end routing by `/route` and the proxy's booked requests see each other's load.
    queues: Vec<f64>,
    now_s: f64,
    occupancy: Option<Occupancy>,
    feedback: Option<Feedback>,
    delay_weight: f64,
}

/// One instance's closed-loop queue for a request.
#[derive(Clone, Copy, Debug, Default)]
struct Closed {
    /// As the model has it (pending prefill and memory).
    modelled_s: f64,
    /// With the instance's learnt lateness, never below 0: what the request is priced with.
    learnt_s: f64,
}

/// A request to route and book ([`Router::route_tracked_among`]).
#[derive(Clone, Copy, Debug)]
pub struct Tracked {
    /// The caller's id for it, to report its first token and end by.
    pub id: u64,
    /// Its prompt's length in tokens.
    pub tokens: usize,
    /// Tokens it is expected to generate (its `max_tokens`, or an estimate; 0 if unknown).
    pub output: usize,
    pub first: FirstToken,
}

impl Router {
    /// `instances` instances of one class; the index holds at most `max_pages` entries. A
    /// cost model that [`CostModel::check`] refuses is refused ([`RouteError::BadModel`]).
    pub fn new(instances: usize, model: CostModel, max_pages: usize) -> Result<Self, RouteError> {
        Self::with_budget(instances, model, Budget::pages(max_pages))
    }

    /// `instances` instances of one class; the index holds what `budget` allows.
    pub fn with_budget(
        instances: usize,
        model: CostModel,
        budget: Budget,
    ) -> Result<Self, RouteError> {
        model.check()?;
        Ok(Self {
            index: ClusterIndex::with_budget(instances, budget),
            model,
            queues: vec![0.0; instances],
            now_s: 0.0,
            occupancy: None,
            feedback: None,
            delay_weight: DELAY_WEIGHT,
        })
    }

    /// The weight of a request's work in its routing cost ([`DELAY_WEIGHT`] by default; 0:
    /// each request to where its own TTFT is least). A negative or non-finite weight is
    /// refused and the router is unchanged.
    pub fn set_delay_weight(&mut self, weight: f64) -> Result<(), RouteError> {
        if !weight.is_finite() || weight < 0.0 {
            return Err(RouteError::BadDelayWeight(weight.to_string()));
        }
        self.delay_weight = weight;
        Ok(())
    }

    pub fn delay_weight(&self) -> f64 {
        self.delay_weight
    }

    /// Counts the device memory each request holds while it decodes in its instance's queue
    /// (`None`: prefill work only, the default). An occupancy whose sizes are negative or not
    /// finite is refused and nothing changes.
    pub fn set_occupancy(&mut self, occupancy: Option<Occupancy>) -> Result<(), RouteError> {
        if let Some(o) = occupancy {
            let ok = |v: f64| v.is_finite() && v >= 0.0;
            if !ok(o.device_tokens) || !ok(o.decode_step_s) {
                return Err(RouteError::BadOccupancy(format!("{o:?}")));
            }
        }
        self.occupancy = occupancy;
        Ok(())
    }

    pub fn occupancy(&self) -> Option<Occupancy> {
        self.occupancy
    }

    /// The most output tokens a request can generate on an instance: the device's tokens (its
    /// KV, output included, must fit there), and at most [`MAX_OUTPUT_TOKENS`]. The service
    /// ([`crate::cluster::Cluster::route_tracked`]) counts a larger output as this much.
    pub fn max_output_tokens(&self) -> usize {
        self.occupancy.map_or(MAX_OUTPUT_TOKENS, |o| {
            (o.device_tokens as usize).min(MAX_OUTPUT_TOKENS)
        })
    }

    /// Routes `id` as [`Self::route_request`] does, and books it: from the first booking on,
    /// the queues are closed-loop ([`Feedback`]), kept from [`Self::first_token`] and
    /// [`Self::finished`], which the caller must report for every booked request: pending
    /// prefill, the memory running requests hold (each shared page once), and how late each
    /// instance's first tokens have come against this model. Needs an [`Occupancy`] for the
    /// device's capacity (without one, memory is not counted).
    pub fn route_tracked(
        &mut self,
        id: u64,
        hashes: &[u64],
        tokens: usize,
        output: usize,
        now_s: f64,
    ) -> Result<(usize, Estimate), RouteError> {
        let request = Tracked {
            id,
            tokens,
            output,
            first: FirstToken::Reported,
        };
        self.route_tracked_among(request, hashes, now_s, &[])
    }

    /// [`Self::route_tracked`] for a request whose first token is seen as `request.first`
    /// says, among the instances not in `exclude` (those that refused it). `NoInstances` when
    /// none is left.
    pub fn route_tracked_among(
        &mut self,
        request: Tracked,
        hashes: &[u64],
        now_s: f64,
        exclude: &[usize],
    ) -> Result<(usize, Estimate), RouteError> {
        let Tracked {
            id,
            tokens,
            output,
            first,
        } = request;
        check_time(now_s)?;
        let n = self.queues.len();
        let (device_tokens, decode_step_s) = self
            .occupancy
            .map_or((0.0, 0.0), |o| (o.device_tokens, o.decode_step_s));
        let page_size = self.model.page_size;
        self.feedback
            .get_or_insert_with(|| Feedback::new(n, device_tokens, page_size, decode_step_s));
        self.route_among(
            hashes,
            tokens,
            output,
            now_s,
            |i| !exclude.contains(&i),
            Some((id, first)),
        )
    }

    /// Booked request `id` produced its first token (`false`: not booked, or `now_s` is not
    /// finite, which changes nothing).
    pub fn first_token(&mut self, id: u64, now_s: f64) -> bool {
        now_s.is_finite()
            && self
                .feedback
                .as_mut()
                .is_some_and(|f| f.first_token(id, now_s))
    }

    /// Booked request `id` was given up on before its first token (or its whole answer) at
    /// `now_s`: it ends, and its instance is learnt to be at least that late
    /// ([`Feedback::abandoned`]; `false`: not booked, or `now_s` is not finite, which changes
    /// nothing).
    pub fn abandoned(&mut self, id: u64, now_s: f64) -> bool {
        now_s.is_finite()
            && self
                .feedback
                .as_mut()
                .is_some_and(|f| f.abandoned(id, now_s))
    }

    /// Booked request `id` will not run (its instance refused it): dropped without learning
    /// anything (`false`: not booked).
    pub fn cancel(&mut self, id: u64) -> bool {
        self.feedback.as_mut().is_some_and(|f| f.cancel(id))
    }

    /// How much later than predicted `instance`'s first tokens have come (0 before any).
    pub fn late_s(&self, instance: usize) -> f64 {
        self.feedback
            .as_ref()
            .map_or(0.0, |f| f.late_s(instance, self.now_s))
    }

    /// Seconds per decode step on `instance` as the closed loop has learnt it from its
    /// requests' ends (the configured step until then; 0 without feedback).
    pub fn decode_step_s(&self, instance: usize) -> f64 {
        self.feedback.as_ref().map_or(0.0, |f| f.step_s(instance))
    }

    /// Requests booked ([`Self::route_tracked`]) and not yet ended or cancelled.
    pub fn booked(&self) -> usize {
        self.feedback.as_ref().map_or(0, Feedback::booked)
    }

    /// Booked request `id` ended (finished, aborted, failed; `false`: not booked, or `now_s`
    /// is not finite, which changes nothing).
    pub fn finished(&mut self, id: u64, now_s: f64) -> bool {
        now_s.is_finite()
            && self
                .feedback
                .as_mut()
                .is_some_and(|f| f.finished(id, Some(now_s)))
    }

    pub fn index(&self) -> &ClusterIndex {
        &self.index
    }

    /// The index, to bound it ([`ClusterIndex::set_shared_bytes`]); events go through
    /// [`Self::apply`].
    pub fn index_mut(&mut self) -> &mut ClusterIndex {
        &mut self.index
    }

    /// The open-loop queues (work routed without a lifecycle, drained by the clock); an
    /// instance's whole queue is [`Self::queue_s`].
    pub fn queues(&self) -> &[f64] {
        &self.queues
    }

    /// Folds one vLLM-format event batch from `instance` in. A batch that does not decode is
    /// an error and changes nothing.
    pub fn apply_payload(&mut self, instance: usize, payload: &[u8]) -> Result<(), RouteError> {
        let n = self.index.instances();
        if instance >= n {
            return Err(RouteError::UnknownInstance(instance, n));
        }
        for e in crate::index::decode_instance_batch(payload)? {
            self.index.apply(instance, &e);
        }
        Ok(())
    }

    /// Folds one batch of the shared store's stream in ([`ClusterIndex::apply_storage`]).
    /// A batch that does not decode is an error and changes nothing.
    pub fn apply_storage_payload(&mut self, payload: &[u8]) -> Result<(), RouteError> {
        for e in decode_batch(payload)? {
            self.index.apply_storage(&e);
        }
        Ok(())
    }

    /// Folds one decoded event of the shared store's stream in.
    pub fn apply_storage(&mut self, e: &IndexEvent) {
        self.index.apply_storage(e);
    }

    /// Folds one decoded event of `instance` in.
    pub fn apply(&mut self, instance: usize, e: &IndexEvent) -> Result<(), RouteError> {
        let n = self.index.instances();
        if self.index.apply(instance, e) {
            Ok(())
        } else {
            Err(RouteError::UnknownInstance(instance, n))
        }
    }

    /// Every instance's estimate for the prompt, without routing it.
    pub fn estimates(&self, tokens: &[u32], scope: &HashScope) -> Vec<Estimate> {
        self.estimates_of(&self.hashes(tokens, scope), tokens.len())
    }

    /// [`Self::estimates`] from the prompt's block hashes (vLLM's 64-bit form) and length.
    pub fn estimates_of(&self, hashes: &[u64], tokens: usize) -> Vec<Estimate> {
        let closed = self.closed(self.held(hashes, tokens, 0));
        self.estimates_with(hashes, tokens, &closed)
    }

    fn estimates_with(&self, hashes: &[u64], tokens: usize, closed: &[Closed]) -> Vec<Estimate> {
        let in_storage = self.index.in_storage(hashes);
        (0..self.index.instances())
            .map(|i| {
                let (g, h, l) = self.index.prefix_with(i, hashes, &in_storage);
                let queue = self.queues[i] + closed.get(i).map_or(0.0, |c| c.learnt_s);
                self.model.estimate(tokens, g, h, l, queue)
            })
            .collect()
    }

    /// What a request of these pages, `tokens` prompt and `output` output tokens holds.
    fn held<'a>(&self, hashes: &'a [u64], tokens: usize, output: usize) -> Held<'a> {
        Held {
            pages: hashes,
            extra_tokens: tokens
                .saturating_sub(hashes.len() * self.model.page_size)
                .saturating_add(output) as f64,
            output,
        }
    }

    /// Each instance's closed-loop queue for a request holding `held` (zeros before the
    /// first booking): the queue plus the instance's learnt lateness, never below 0. It is
    /// not drained by the clock as the open-loop one is: the engines' first tokens and ends
    /// drain it (draining it by the clock too under-stated every queue by the time since the
    /// last routing, docs/router/history.md, "Learning the queue").
    fn closed(&self, held: Held<'_>) -> Vec<Closed> {
        (0..self.queues.len())
            .map(|i| self.closed_of(i, held))
            .collect()
    }

    /// [`Self::closed`] for one instance.
    fn closed_of(&self, instance: usize, held: Held<'_>) -> Closed {
        match &self.feedback {
            Some(fb) => {
                let modelled_s = fb.queue_s(instance, held, self.now_s);
                Closed {
                    modelled_s,
                    learnt_s: (modelled_s + fb.late_s(instance, self.now_s)).max(0.0),
                }
            }
            None => Closed::default(),
        }
    }

    /// Seconds a request holding nothing would wait on `instance` now, as a route would price
    /// it (open-loop and closed-loop parts); 0 for an unknown instance.
    pub fn queue_s(&self, instance: usize) -> f64 {
        let Some(open) = self.queues.get(instance) else {
            return 0.0;
        };
        open + self.closed_of(instance, self.held(&[], 0, 0)).learnt_s
    }

    /// Routes a prompt at time `now_s` (seconds, the caller's clock; a time before the last
    /// one counts as no time passing): the chosen instance and its estimate, whose work is
    /// added to that instance's queue.
    pub fn route(
        &mut self,
        tokens: &[u32],
        scope: &HashScope,
        now_s: f64,
    ) -> Result<(usize, Estimate), RouteError> {
        let hashes = self.hashes(tokens, scope);
        self.route_hashes(&hashes, tokens.len(), now_s)
    }

    /// [`Self::route`] from the prompt's block hashes (vLLM's 64-bit form: an engine front end
    /// that hashed the prompt already) and its length in tokens.
    pub fn route_hashes(
        &mut self,
        hashes: &[u64],
        tokens: usize,
        now_s: f64,
    ) -> Result<(usize, Estimate), RouteError> {
        self.route_request(hashes, tokens, 0, now_s)
    }

    /// [`Self::route_hashes`] for a request expected to generate `output` tokens (its
    /// `max_tokens`, or an estimate): with an [`Occupancy`] set, its queue share counts the
    /// device memory it will hold while decoding.
    pub fn route_request(
        &mut self,
        hashes: &[u64],
        tokens: usize,
        output: usize,
        now_s: f64,
    ) -> Result<(usize, Estimate), RouteError> {
        self.route_among(hashes, tokens, output, now_s, |_| true, None)
    }

    /// The decision of every route: the cheapest allowed instance, its work then booked (with
    /// `booking`: the request's id and how its first token will be seen) or added to the
    /// open-loop queue (without).
    fn route_among(
        &mut self,
        hashes: &[u64],
        tokens: usize,
        output: usize,
        now_s: f64,
        allowed: impl Fn(usize) -> bool,
        booking: Option<(u64, FirstToken)>,
    ) -> Result<(usize, Estimate), RouteError> {
        if self.queues.is_empty() {
            return Err(RouteError::NoInstances);
        }
        check_time(now_s)?;
        self.advance(now_s);
        if let Some(fb) = &mut self.feedback {
            fb.settle(now_s);
        }
        let held = self.held(hashes, tokens, output);
        let closed = self.closed(held);
        let ests = self.estimates_with(hashes, tokens, &closed);
        let (best, est) = self
            .cheapest(&ests, allowed)
            .ok_or(RouteError::NoInstances)?;
        // lateness is learnt against the model's own prediction, without lateness
        let predicted_s = self.queues[best] + closed[best].modelled_s + est.work_s();
        match (booking, &mut self.feedback) {
            (Some((id, first)), Some(fb)) => {
                let routed = Routed {
                    work_s: est.work_s(),
                    predicted_s,
                    at_s: now_s,
                    first,
                };
                fb.book(id, best, routed, held);
            }
            _ => {
                let memory_s = self.occupancy.map_or(0.0, |o| o.memory_s(tokens, output));
                self.queues[best] += est.work_s().max(memory_s);
            }
        }
        Ok((best, est))
    }

    /// The instance where a request with these estimates (one per instance) costs least, among
    /// those `allowed` admits: the decision rule of the module docs, ties to the shorter queue,
    /// then the lower index. `None` when none is allowed.
    pub fn cheapest(
        &self,
        ests: &[Estimate],
        allowed: impl Fn(usize) -> bool,
    ) -> Option<(usize, Estimate)> {
        // nobody waits behind work on an idle instance (nothing queued, nothing running)
        let w = |i: usize| {
            if self.idle(i) { 0.0 } else { self.delay_weight }
        };
        ests.iter()
            .enumerate()
            .filter(|(i, _)| allowed(*i))
            .min_by(|(i, a), (j, b)| {
                a.cost_s(w(*i))
                    .total_cmp(&b.cost_s(w(*j)))
                    .then(a.queue_s.total_cmp(&b.queue_s))
                    .then(i.cmp(j))
            })
            .map(|(i, e)| (i, *e))
    }

    /// Nothing is queued on `instance` (open-loop or booked) and nothing runs there.
    fn idle(&self, instance: usize) -> bool {
        self.queues.get(instance).is_none_or(|&q| q <= 0.0)
            && self
                .feedback
                .as_ref()
                .is_none_or(|f| f.running(instance) == 0)
    }

    fn advance(&mut self, now_s: f64) {
        let dt = now_s - self.now_s;
        if dt > 0.0 {
            for q in &mut self.queues {
                *q = (*q - dt).max(0.0);
            }
            self.now_s = now_s;
        }
    }

    fn hashes(&self, tokens: &[u32], scope: &HashScope) -> Vec<u64> {
        scope
            .page_hashes(tokens, self.model.page_size)
            .iter()
            .map(HashFormat::int64)
            .collect()
    }
}

/// A caller's time must be finite: a NaN or infinite one would make every later price of an
/// instance NaN or infinite (its lateness is learnt from the times given).
fn check_time(now_s: f64) -> Result<(), RouteError> {
    if now_s.is_finite() {
        Ok(())
    } else {
        Err(RouteError::BadTime(now_s.to_string()))
    }
}
