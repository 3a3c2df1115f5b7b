//! The router's shared state: the index and queues ([`Router`]), each event stream's state,
//! and what the router sent where. Subscriber threads fold batches in, HTTP handlers route;
//! both hold the lock only for one fold or one decision.

use std::time::Instant;

use kvtier_radix::HashScope;
use serde::Serialize;

use crate::background::Background;
use crate::cost::{CostModel, Estimate};
use crate::errors::UpstreamErrors;
use crate::feedback::FirstToken;
use crate::http_bookings::HttpBookings;
use crate::index::{Budget, DecodedBatch, IndexEvent, WireMap, index_events};
use crate::keys::{Translated, Translator, prompt_keys};
use crate::resolve::resolve;
use crate::route::{Router, Tracked};
use crate::stream::{Apply, StreamCounters};

/// How pages are keyed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Keys {
    /// The block hashes as published: kvtier's page hashes (the router computes them from a
    /// prompt's tokens, salt and adapter).
    Engine,
    /// The router's own hash of each event's tokens (vLLM, SGLang: engine hashes the router
    /// cannot compute).
    Tokens,
}

/// Whose pages a stream carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// One engine instance's (GPU, CPU; its STORAGE events go to the shared set).
    Instance(usize),
    /// The shared store's: every page it holds, as `STORAGE`.
    Storage,
}

/// One stream's state (`/stats` shows it).
#[derive(Debug)]
pub struct StreamState {
    pub name: String,
    pub endpoint: String,
    pub target: Target,
    /// The next sequence number expected (`null`: not synced).
    pub next_seq: Option<u64>,
    pub counters: StreamCounters,
    pub last_batch: Option<Instant>,
    /// Stores (with tokens) whose `block_size` was not the router's page size, and the
    /// latest such size: their pages match no prompt (`--page-size` must be the engines'
    /// block size).
    pub other_block_size: (u64, Option<u64>),
    pub translator: Option<Translator>,
}

/// Bytes of the streams' key tables, but `except`'s.
fn tables_bytes(streams: &[StreamState], except: Option<usize>) -> usize {
    streams
        .iter()
        .enumerate()
        .filter(|&(n, _)| Some(n) != except)
        .filter_map(|(_, s)| s.translator.as_ref())
        .map(Translator::memory_bytes)
        .sum()
}

/// Bytes stream `stream`'s key table may hold: `budget`, less the index's `index` bytes and
/// the other streams' tables.
fn room_in(streams: &[StreamState], budget: usize, index: usize, stream: usize) -> usize {
    budget.saturating_sub(index.saturating_add(tables_bytes(streams, Some(stream))))
}

/// Why a request was routed where it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Basis {
    /// From the index and the queues.
    Cache,
    /// The prompt's tokens were unknown: the least loaded instance.
    LoadOnly,
}

/// One decision.
#[derive(Clone, Debug, Serialize)]
pub struct Decision {
    pub instance: usize,
    pub basis: Basis,
    pub ttft_s: f64,
    pub queue_s: f64,
    pub compute_s: f64,
    pub load_s: f64,
    pub gpu_pages: usize,
    pub host_pages: usize,
    pub l3_pages: usize,
    /// Every instance's estimated TTFT, best first order not implied (by index).
    pub ttft_by_instance: Vec<f64>,
    /// The booking of a request routed with [`Cluster::route_tracked`], to report its first
    /// token and end by; `None` for one routed without.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub booking: Option<u64>,
}

pub struct Cluster {
    pub(crate) router: Router,
    pub(crate) page_size: usize,
    keys: Keys,
    budget: Budget,
    pub streams: Vec<StreamState>,
    routed: Vec<u64>,
    refused: Vec<u64>,
    /// Per instance: connections that failed (refused or timed out), for routed requests and
    /// for the router's own lookups.
    unreachable: Vec<u64>,
    in_flight: Vec<u64>,
    /// The instances' error answers (proxy): counted, and a streak of them avoided.
    upstream: UpstreamErrors,
    load_only: u64,
    /// Proxied requests the router could not send for want of file descriptors.
    overloaded: u64,
    started: Instant,
    next_booking: u64,
    /// Bookings made for `POST /route` clients ([`Cluster::route_booked`]), which report
    /// by booking over HTTP; each expires after its time to live, and together they hold
    /// at most a cap of pages (`http_bookings.rs`).
    pub(crate) http: HttpBookings,
    /// Bookings of background responses answered already ([`Cluster::background`]).
    pub(crate) background: Background,
}

/// What a `POST /route` client reports of a booked request ([`Cluster::report`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Report {
    /// Its first token arrived.
    FirstToken,
    /// It ended (finished, aborted or failed after it ran).
    End,
    /// The instance refused it: it never ran there.
    Cancel,
}

/// The longest a background response's booking outlives its answer
/// ([`Cluster::background`]): as long as a `POST /route` booking without its end.
pub const BACKGROUND_MAX_S: f64 = BOOKING_TTL_S;

/// How long a booking made over `POST /route` lasts without its end reported: a client
/// that dies (or forgets) keeps its request counted in an instance's queue no longer. Ten
/// minutes: longer than a request runs on an engine; what outlives it just stops counting.
pub const BOOKING_TTL_S: f64 = 600.0;

impl Cluster {
    /// An index of at most `max_pages` entries, any number of bytes.
    pub fn new(
        instances: usize,
        model: CostModel,
        max_pages: usize,
        keys: Keys,
    ) -> Result<Self, crate::RouteError> {
        Self::with_budget(instances, model, Budget::pages(max_pages), keys)
    }

    /// The index and the streams' key tables (`keys` = [`Keys::Tokens`]) within one `budget`:
    /// its bytes bound their sum, its entries each table.
    /// A cost model that [`CostModel::check`] refuses is refused.
    pub fn with_budget(
        instances: usize,
        model: CostModel,
        budget: Budget,
        keys: Keys,
    ) -> Result<Self, crate::RouteError> {
        Ok(Self {
            router: Router::with_budget(instances, model, budget)?,
            page_size: model.page_size,
            keys,
            budget,
            streams: Vec::new(),
            routed: vec![0; instances],
            refused: vec![0; instances],
            unreachable: vec![0; instances],
            in_flight: vec![0; instances],
            upstream: UpstreamErrors::new(instances),
            load_only: 0,
            overloaded: 0,
            started: Instant::now(),
            next_booking: 0,
            http: HttpBookings::new(BOOKING_TTL_S, instances),
            background: Background::default(),
        })
    }

    pub fn instances(&self) -> usize {
        self.routed.len()
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    /// [`Router::set_delay_weight`]: a bad weight is refused and nothing changes.
    pub fn set_delay_weight(&mut self, weight: f64) -> Result<(), crate::RouteError> {
        self.router.set_delay_weight(weight)
    }

    /// The instances' device memory and decode step ([`Router::set_occupancy`]): a bad one is
    /// refused and nothing changes.
    pub fn set_occupancy(
        &mut self,
        occupancy: Option<crate::Occupancy>,
    ) -> Result<(), crate::RouteError> {
        self.router.set_occupancy(occupancy)
    }

    /// Registers a stream; returns its number.
    pub fn add_stream(&mut self, name: &str, endpoint: &str, target: Target) -> usize {
        self.streams.push(StreamState {
            name: name.into(),
            endpoint: endpoint.into(),
            target,
            next_seq: None,
            counters: StreamCounters::default(),
            last_batch: None,
            other_block_size: (0, None),
            translator: (self.keys == Keys::Tokens).then(|| match target {
                Target::Instance(_) => Translator::new(self.budget.max_pages),
                Target::Storage => Translator::for_store(self.budget.max_pages),
            }),
        });
        self.streams.len() - 1
    }

    /// Bytes of the streams' key tables, but `except`'s.
    fn key_table_bytes(&self, except: Option<usize>) -> usize {
        tables_bytes(&self.streams, except)
    }

    /// Bytes stream `stream`'s key table may hold now: the budget, less the index and the
    /// other streams' tables.
    fn table_room(&self, stream: usize) -> usize {
        room_in(
            &self.streams,
            self.budget.max_bytes,
            self.router.index().memory_bytes(),
            stream,
        )
    }

    /// Folds one of a stream's batches in (or resets its pages); `false` if it did not decode.
    /// The stream's key table may take what the budget leaves; then the index may take what
    /// the key tables leave.
    pub fn apply(&mut self, stream: usize, a: Apply<'_>) -> bool {
        match a {
            Apply::Reset => self.fold(stream, None),
            Apply::Batch(p) => self.fold(stream, Some(DecodedBatch::of(p))),
            Apply::Decoded(d) => self.fold(stream, Some(d)),
            Apply::Replace(p) => self.replace(stream, DecodedBatch::of(p)),
            Apply::ReplaceDecoded(d) => self.replace(stream, d),
        }
    }

    /// A snapshot's first batch: the stream's pages are cleared and the batch folded in, under
    /// one lock, only if it decodes (a routing in between saw the instance empty; a garbage
    /// snapshot left it so).
    fn replace(&mut self, stream: usize, batch: DecodedBatch) -> bool {
        if batch.0.is_err() || stream >= self.streams.len() {
            return false;
        }
        self.fold(stream, None) && self.fold(stream, Some(batch))
    }

    /// Folds a decoded batch in (`None`: clears the stream's pages).
    fn fold(&mut self, stream: usize, batch: Option<DecodedBatch>) -> bool {
        let room = self.table_room(stream);
        let Some(st) = self.streams.get_mut(stream) else {
            return false;
        };
        if let Some(t) = st.translator.as_mut() {
            t.set_max_bytes(room);
        }
        let target = st.target;
        let batch = batch.map(|d| d.0);
        let (events, storage) = match batch {
            None => {
                if let Some(t) = st.translator.as_mut() {
                    t.clear();
                }
                (vec![IndexEvent::Cleared], Vec::new())
            }
            Some(values) => {
                st.last_batch = Some(Instant::now());
                let other = values
                    .as_deref()
                    .map(|v| other_block_sizes(v, self.page_size))
                    .unwrap_or_default();
                let decoded =
                    match (values, st.translator.as_mut()) {
                        (Err(e), _) => Err(e),
                        (Ok(v), Some(t)) => t.translate_events(&v),
                        (Ok(v), None) => index_events(&v, matches!(target, Target::Instance(_)))
                            .map(|events| Translated {
                                events,
                                ..Translated::default()
                            }),
                    };
                let Ok(batch) = decoded else {
                    return false;
                };
                if let (n, Some(size)) = other {
                    st.other_block_size.0 += n;
                    st.other_block_size.1 = Some(size);
                }
                let (budget, index) = (self.budget.max_bytes, self.router.index().memory_bytes());
                let room = move |s: &[StreamState], n: usize| room_in(s, budget, index, n);
                resolve(&mut self.streams, stream, batch, self.page_size, &room)
            }
        };
        let keys = self.key_table_bytes(None);
        self.router.index_mut().set_shared_bytes(keys);
        for e in events {
            match (target, e) {
                (Target::Instance(i), e) => {
                    // an unknown instance is ignored: configuration, not input
                    let _ = self.router.apply(i, &e);
                }
                (Target::Storage, e) => self.router.apply_storage(&e),
            }
        }
        for e in storage {
            self.router.apply_storage(&e);
        }
        true
    }

    /// The prompt's page keys as this router's index keys them (at most
    /// [`MAX_ROUTED_PAGES`]).
    pub fn prompt_hashes(
        &self,
        tokens: &[u32],
        salt: Option<&str>,
        lora: Option<&str>,
    ) -> Vec<u64> {
        self.keyer().hashes(tokens, salt, lora)
    }

    /// How this router keys a prompt, to compute its keys without the cluster's lock
    /// ([`Keyer::hashes`], then [`Self::route_hashed`] or [`Self::route_tracked_hashed`]).
    pub fn keyer(&self) -> Keyer {
        Keyer {
            keys: self.keys,
            page_size: self.page_size,
        }
    }

    pub(crate) fn now_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Routes a prompt by its tokens; counts it as sent to the instance chosen. `exclude`:
    /// instances not to choose (they refused a connection); `None` if none is left.
    pub fn route(
        &mut self,
        tokens: &[u32],
        salt: Option<&str>,
        lora: Option<&str>,
        exclude: &[usize],
    ) -> Option<Decision> {
        let hashes = self.prompt_hashes(tokens, salt, lora);
        self.route_hashed(&hashes, tokens.len(), exclude)
    }

    /// [`Self::route`] of a prompt of `tokens` tokens keyed already ([`Keyer::hashes`]).
    pub fn route_hashed(
        &mut self,
        hashes: &[u64],
        tokens: usize,
        exclude: &[usize],
    ) -> Option<Decision> {
        self.expire_bookings(); // every decision sees no booking past its time to live
        let now = self.now_s();
        if exclude.is_empty() {
            // every instance's estimate as the decision saw it (before its work is queued)
            let all = self.router.estimates_of(hashes, tokens);
            let (i, est) = self.router.route_hashes(hashes, tokens, now).ok()?;
            return Some(self.decided(i, est, Basis::Cache, &all));
        }
        let all = self.router.estimates_of(hashes, tokens);
        // the same rule as a first choice, among the instances left
        let (i, est) = self.router.cheapest(&all, |i| !exclude.contains(&i))?;
        Some(self.decided(i, est, Basis::Cache, &all))
    }

    /// [`Self::route`] for a request whose first token and end the caller will report
    /// ([`Self::first_token`], [`Self::ended`]; [`Self::cancel`] if the instance refuses it):
    /// the queues are then closed-loop and each instance's lateness is learnt (the router's
    /// `route_tracked`). `scope`: its salt and LoRA adapter, as [`Self::route`] takes them;
    /// `output`: tokens it may generate (`max_tokens`; 0 if unknown; counted as at most
    /// [`Router::max_output_tokens`]);
    /// `first`: whether its first token will be seen (a streamed answer) or not.
    pub fn route_tracked(
        &mut self,
        tokens: &[u32],
        scope: (Option<&str>, Option<&str>),
        exclude: &[usize],
        output: usize,
        first: FirstToken,
    ) -> Option<Decision> {
        let hashes = self.prompt_hashes(tokens, scope.0, scope.1);
        self.route_tracked_hashed(&hashes, tokens.len(), exclude, output, first)
    }

    /// [`Self::route_tracked`] of a prompt of `tokens` tokens keyed already
    /// ([`Keyer::hashes`]).
    pub fn route_tracked_hashed(
        &mut self,
        hashes: &[u64],
        tokens: usize,
        exclude: &[usize],
        output: usize,
        first: FirstToken,
    ) -> Option<Decision> {
        self.expire_bookings();
        let now = self.now_s();
        let exclude = &self.upstream.avoid(exclude, now);
        let id = self.next_booking;
        self.next_booking += 1;
        let request = Tracked {
            id,
            tokens,
            output: output.min(self.router.max_output_tokens()), // 2^64 - 1 kept a queue ~9e16 s
            first,
        };
        let (i, est) = self
            .router
            .route_tracked_among(request, hashes, now, exclude)
            .ok()?;
        // every instance's estimate as the decision saw it (its work not yet queued)
        let mut all = self.router.estimates_of(hashes, tokens);
        if let Some(e) = all.get_mut(i) {
            *e = est;
        }
        let mut d = self.decided(i, est, Basis::Cache, &all);
        d.booking = Some(id);
        Some(d)
    }

    /// A tracked request's first token arrived.
    pub fn first_token(&mut self, booking: u64) {
        let now = self.now_s();
        self.router.first_token(booking, now);
    }

    /// A tracked request ended (its answer's end, or the client went away).
    pub fn ended(&mut self, booking: u64) {
        let now = self.now_s();
        self.router.finished(booking, now);
    }

    /// A tracked request was given up on before its first token (a streamed answer) or its
    /// answer (one sent whole): its client went away, or the proxy stopped waiting for the
    /// head. Its booking goes, and its instance is learnt to be at least as late as it waited
    /// ([`crate::feedback::Feedback::abandoned`]).
    pub fn abandoned(&mut self, booking: u64) {
        let now = self.now_s();
        self.router.abandoned(booking, now);
    }

    /// A background response (`"background": true`) was answered at once (`status: queued`)
    /// and its instance generates it now, unseen: its booking (of `instance`, predicted
    /// `ttft_s` to its first token, `output` tokens) stays open as the instance's work until
    /// that first token and `output` decode steps at the instance's learnt step (and its
    /// lateness) have passed, at most [`BACKGROUND_MAX_S`], then is dropped, learning
    /// nothing: when it really ended is unknown, and its answer's time is no decode time.
    /// At most as many are held as `POST /route` bookings may be open; past that the one due
    /// first goes ([`crate::background`]).
    pub fn background(&mut self, booking: u64, instance: usize, ttft_s: f64, output: usize) {
        let output = output.min(self.router.max_output_tokens()) as f64;
        let late = self.router.late_s(instance).max(0.0);
        let s = ttft_s.max(0.0) + late + output * self.router.decode_step_s(instance);
        let s = if s.is_finite() {
            s.min(BACKGROUND_MAX_S)
        } else {
            BACKGROUND_MAX_S
        };
        let due = ((self.now_s() + s) * 1e9) as u64;
        for b in self.background.hold(booking, due, self.http.max_open) {
            self.router.cancel(b);
        }
    }

    /// Names a held background response's booking by the response's `id` (its answer's), so
    /// that seeing it done ends it ([`Self::background_done`]).
    pub fn background_named(&mut self, booking: u64, id: &str) {
        self.background.name(booking, id);
    }

    /// Whether a background response's booking is held under `id`.
    pub fn background_holds(&self, id: &str) -> bool {
        self.background.names(id)
    }

    /// Background response `id` was seen done (a `GET` of it finished, or cancelled): its
    /// booking goes, learning nothing (when it ended is not known); `false` if none is held.
    pub fn background_done(&mut self, id: &str) -> bool {
        match self.background.done(id) {
            Some(b) => {
                self.router.cancel(b);
                true
            }
            None => false,
        }
    }

    /// Instance `i` reset its prefix cache (vLLM's `/reset_prefix_cache`, SGLang's
    /// `/flush_cache`, answered a success through the proxy): its device and host pages are
    /// dropped from the index at once, as its own `AllBlocksCleared` drops them when it comes
    /// (an unknown instance is ignored).
    pub fn cache_reset(&mut self, i: usize) {
        let _ = self.router.apply(i, &IndexEvent::Cleared);
    }

    /// A tracked request's instance refused it: its booking goes, nothing learnt.
    pub fn cancel(&mut self, booking: u64) {
        self.router.cancel(booking);
    }

    /// The instances to ask for a lookup of the router's own (`/tokenize`, `/v1/models`),
    /// best first: those not passed over for their errors ([`crate::errors`]), the least
    /// late first (ties: the lower number); every instance if all are passed over.
    pub fn lookup_order(&self) -> Vec<usize> {
        let avoid = self.upstream.avoid(&[], self.now_s());
        let mut order: Vec<usize> = (0..self.instances())
            .filter(|i| !avoid.contains(i))
            .collect();
        order.sort_by(|&a, &b| self.router.late_s(a).total_cmp(&self.router.late_s(b)));
        order
    }

    /// Routes without tokens: the instance with the shortest queue, then the fewest requests
    /// in flight, then the lowest number.
    pub fn route_load_only(&mut self, exclude: &[usize]) -> Option<Decision> {
        self.expire_bookings();
        let first_try = exclude.is_empty();
        let exclude = &self.upstream.avoid(exclude, self.now_s());
        let q: Vec<f64> = (0..self.instances())
            .map(|i| self.router.queue_s(i))
            .collect();
        let i = (0..self.instances())
            .filter(|i| !exclude.contains(i))
            .min_by(|&a, &b| {
                q[a].total_cmp(&q[b])
                    .then(self.in_flight[a].cmp(&self.in_flight[b]))
                    .then(a.cmp(&b))
            })?;
        self.load_only += u64::from(first_try);
        let est = Estimate {
            gpu_pages: 0,
            host_pages: 0,
            l3_pages: 0,
            queue_s: q[i],
            compute_s: 0.0,
            load_s: 0.0,
        };
        Some(self.decided(i, est, Basis::LoadOnly, &[]))
    }

    fn decided(&mut self, i: usize, est: Estimate, basis: Basis, all: &[Estimate]) -> Decision {
        self.routed[i] += 1;
        Decision {
            instance: i,
            basis,
            ttft_s: est.ttft_s(),
            queue_s: est.queue_s,
            compute_s: est.compute_s,
            load_s: est.load_s,
            gpu_pages: est.gpu_pages,
            host_pages: est.host_pages,
            l3_pages: est.l3_pages,
            ttft_by_instance: all.iter().map(Estimate::ttft_s).collect(),
            booking: None,
        }
    }

    /// The instance chosen refused the connection (or its connect timed out): not counted
    /// as routed there, and passed over from now ([`Self::unreachable`]).
    pub fn refused(&mut self, i: usize) {
        if let (Some(r), Some(f)) = (self.routed.get_mut(i), self.refused.get_mut(i)) {
            *r = r.saturating_sub(1);
            *f += 1;
        }
        self.unreachable(i);
    }

    /// The request routed to `i` could not be sent for want of the router's own file
    /// descriptors (`EMFILE`, `ENFILE`): not counted as routed there, and not the instance's
    /// refusal (`router_overloaded` in `/stats`).
    pub fn overloaded(&mut self, i: usize) {
        if let Some(r) = self.routed.get_mut(i) {
            *r = r.saturating_sub(1);
        }
        self.overloaded += 1;
    }

    /// Instance `i` could not be connected to (refused, or timed out), for a request or a
    /// lookup: it is passed over at once while another is left
    /// ([`UpstreamErrors::unreachable`]).
    pub fn unreachable(&mut self, i: usize) {
        if let Some(n) = self.unreachable.get_mut(i) {
            *n += 1;
        }
        let now = self.now_s();
        self.upstream.unreachable(i, now);
    }

    /// Instance `i` answered a proxied request: a success, or a server error
    /// ([`crate::errors`]: a streak of them is avoided by tracked and load-only routes).
    pub fn answered(&mut self, i: usize, ok: bool) {
        let now = self.now_s();
        self.upstream.answered(i, ok, now);
    }

    /// A proxied request started on `i`.
    pub fn started(&mut self, i: usize) {
        if let Some(n) = self.in_flight.get_mut(i) {
            *n += 1;
        }
    }

    /// A proxied request on `i` finished (its response ended or the client went away).
    pub fn finished(&mut self, i: usize) {
        if let Some(n) = self.in_flight.get_mut(i) {
            *n = n.saturating_sub(1);
        }
    }

    pub fn in_flight(&self) -> &[u64] {
        &self.in_flight
    }

    /// Index memory: the index's tables plus the streams' key tables, in bytes as the
    /// allocator counts them; at most the budget's bytes.
    pub fn memory_bytes(&self) -> usize {
        self.router.index().memory_bytes() + self.key_table_bytes(None)
    }

    /// What `/stats` returns.
    pub fn stats(&self) -> serde_json::Value {
        let idx = self.router.index();
        let (locals, storage) = idx.tier_pages();
        let streams: Vec<serde_json::Value> = self
            .streams
            .iter()
            .map(|s| {
                serde_json::json!({
                    "name": s.name, "endpoint": s.endpoint, "target": s.target,
                    "next_seq": s.next_seq, "counters": s.counters,
                    "idle_s": s.last_batch.map(|t| t.elapsed().as_secs_f64()),
                    "unkeyed": s.translator.as_ref().map(|t| t.unkeyed),
                    "other_block_size": s.other_block_size.0,
                    "block_size": s.other_block_size.1,
                    "waiting": s.translator.as_ref().map(|t| t.pending()),
                })
            })
            .collect();
        let instances: Vec<serde_json::Value> = locals
            .iter()
            .enumerate()
            .map(|(i, (g, c))| {
                serde_json::json!({
                    "gpu_pages": g, "cpu_pages": c,
                    "queue_s": self.router.queue_s(i), "late_s": self.router.late_s(i),
                    "decode_step_s": self.router.decode_step_s(i),
                    "routed": self.routed[i], "refused": self.refused[i],
                    "unreachable": self.unreachable[i], "in_flight": self.in_flight[i],
                    "upstream_errors": self.upstream.errors(i),
                })
            })
            .collect();
        serde_json::json!({
            "keys": self.keys,
            "instances": instances,
            "bookings": {"open": self.router.booked(), "http_open": self.http.len(),
                         "http_pages": self.http.pages(), "http_expired": self.http.expired,
                         "http_evicted": self.http.evicted, "http_max_open": self.http.max_open,
                         "background_open": self.background.len()},
            "storage_pages": storage,
            "index_pages": idx.pages(),
            "max_pages": bound(self.budget.max_pages),
            "max_index_bytes": bound(self.budget.max_bytes),
            "dropped_stores": idx.dropped(),
            "memory_bytes": self.memory_bytes(),
            "routed_load_only": self.load_only,
            "router_overloaded": self.overloaded,
            "booked": self.router.booked(),
            "device_tokens": self.router.occupancy().map(|o| o.device_tokens),
            "streams": streams,
        })
    }
}

/// The stores with tokens among `events` whose `block_size` is not `page_size`, and the
/// latest such size (token-less stores name a run's size, not a block's).
fn other_block_sizes(events: &[rmpv::Value], page_size: usize) -> (u64, Option<u64>) {
    let mut out = (0, None);
    for e in events {
        let Ok(e) = WireMap::of(e) else { continue };
        let with_tokens =
            matches!(e.field("token_ids"), Some(rmpv::Value::Array(t)) if !t.is_empty());
        let size = e.field("block_size").and_then(rmpv::Value::as_u64);
        if e.kind() == Some("BlockStored")
            && with_tokens
            && let Some(size) = size
            && size != page_size as u64
        {
            out = (out.0 + 1, Some(size));
        }
    }
    out
}

/// The most pages of a prompt the router keys and looks up (2^20: a million-token prompt at
/// page size 1, 16 million at 16); past them a prompt's pages are priced as computed.
/// Bounds what one request costs the router: a `POST /route` of 30 million token ids at
/// page size 1 hashed them all under the cluster's lock, holding every other decision and
/// every stream's fold for over 2 s.
pub const MAX_ROUTED_PAGES: usize = 1 << 20;

/// How a router keys a prompt's pages ([`Cluster::keyer`]): computed outside the cluster's
/// lock, the decision then takes it for its own work only.
#[derive(Clone, Copy, Debug)]
pub struct Keyer {
    keys: Keys,
    page_size: usize,
}

impl Keyer {
    /// The page keys of the prompt's first [`MAX_ROUTED_PAGES`] pages, as the index keys
    /// them.
    pub fn hashes(&self, tokens: &[u32], salt: Option<&str>, lora: Option<&str>) -> Vec<u64> {
        let most = MAX_ROUTED_PAGES.saturating_mul(self.page_size);
        let tokens = tokens.get(..most).unwrap_or(tokens);
        match self.keys {
            Keys::Engine => HashScope::new(salt, lora, Vec::new())
                .page_hashes(tokens, self.page_size)
                .iter()
                .map(kvtier_events::HashFormat::int64)
                .collect(),
            Keys::Tokens => prompt_keys(tokens, self.page_size, lora),
        }
    }
}

/// A bound as `/stats` shows it: `null` for none.
fn bound(n: usize) -> Option<usize> {
    (n != usize::MAX).then_some(n)
}
