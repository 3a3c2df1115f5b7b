//! Which instance serves each request: the five routers `--router` picks from.
//!
//! Why here and not in the workload: two of them need what the engines publish (their KV
//! events and the shared store's residency) and one the instances' queues, so the router is
//! state the event loop feeds as the simulation runs:
//! - `round-robin` and `session` need nothing (`workload::route`);
//! - `least-loaded` counts the prompt tokens routed to each instance that have not yet
//!   produced their first token (its queued prefill work);
//! - `dynamo` ([`dynamo`]) runs NVIDIA Dynamo's indexers, load tracker and default selector;
//! - `kvtier` ([`kvtier`]) runs kvtier's router on the simulator's clock.
//!
//! The engine tells every router the same things (events, first tokens, ends); a router that
//! does not use one ignores it.

pub mod dynamo;
pub mod kvtier;

use std::collections::HashMap;

use kvtier_events::WireEvent;
use kvtier_radix::{KvEvent, PageHash};
use serde::Serialize;

use crate::config::SimConfig;
use crate::workload::{Routing, SimRequest, route};

/// Seed of Dynamo's selector (its softmax sampling and tie breaks), fixed so runs repeat.
pub const DYNAMO_SEED: u64 = 0x6b76_7469_6572;

enum State {
    Stateless,
    LeastLoaded,
    Dynamo(Box<dynamo::DynamoRouter>),
    Kvtier(Box<kvtier::KvtierRouter>),
}

/// What a router's index holds at the end of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct IndexStats {
    /// Entries (pages × tiers × instances) the index holds.
    pub pages: u64,
    /// Bytes the entries take (`None`: the router does not report it).
    pub bytes: Option<u64>,
    /// Events the router received (GPU, CPU, STORAGE) and rejected.
    pub events: [u64; 3],
    pub rejected: u64,
}

pub struct ClusterRouter {
    kind: Routing,
    instances: usize,
    state: State,
    /// Requests routed and not yet at their first token: instance and prompt tokens.
    waiting: HashMap<u64, (usize, u64)>,
    /// Per instance: prompt tokens waiting for their first token.
    queued_tokens: Vec<u64>,
    /// Requests routed to each instance.
    pub routed: Vec<u64>,
}

impl ClusterRouter {
    pub fn new(cfg: &SimConfig) -> Result<Self, String> {
        let n = cfg.instances.max(1);
        let state = match cfg.routing {
            Routing::RoundRobin | Routing::Session => State::Stateless,
            Routing::LeastLoaded => State::LeastLoaded,
            Routing::Dynamo => State::Dynamo(Box::new(dynamo::DynamoRouter::new(
                n,
                cfg.scheduler.page_size as u32,
                DYNAMO_SEED,
            ))),
            Routing::Kvtier => State::Kvtier(Box::new(kvtier::KvtierRouter::new(cfg)?)),
        };
        Ok(Self {
            kind: cfg.routing,
            instances: n,
            state,
            waiting: HashMap::new(),
            queued_tokens: vec![0; n],
            routed: vec![0; n],
        })
    }

    /// Whether the router reads the instances' KV events (the schedulers must record them).
    pub fn wants_events(&self) -> bool {
        matches!(self.state, State::Dynamo(_) | State::Kvtier(_))
    }

    /// The instance `r` goes to, at simulated time `now_us`.
    pub fn route(&mut self, r: &SimRequest, now_us: u64) -> usize {
        let n = self.instances;
        let least_loaded = |q: &[u64]| (0..n).min_by_key(|&i| (q[i], i)).unwrap_or_default();
        let picked = match &mut self.state {
            State::Stateless => route(r, n, self.kind),
            State::LeastLoaded => Some(least_loaded(&self.queued_tokens)),
            State::Dynamo(d) => d.route(r, now_us),
            State::Kvtier(k) => k.route(r, now_us),
        };
        // A router that cannot decide (none expected) falls back to the least loaded.
        let inst = picked
            .filter(|&i| i < n)
            .unwrap_or_else(|| least_loaded(&self.queued_tokens));
        let tokens = r.prompt.len() as u64;
        self.queued_tokens[inst] += tokens;
        self.waiting.insert(r.id, (inst, tokens));
        self.routed[inst] += 1;
        inst
    }

    /// Events an instance's scheduler recorded (GPU and CPU pages).
    pub fn kv_events(&mut self, inst: usize, events: &[KvEvent]) {
        match &mut self.state {
            State::Dynamo(d) => d.kv_events(inst, events),
            State::Kvtier(k) => k.kv_events(inst, events),
            State::Stateless | State::LeastLoaded => {}
        }
    }

    /// Whether the router reads the shared store's own event stream (`STORAGE`), which
    /// the store then keeps ([`kvtier_l3::kv_events::Delivery::Pull`]).
    pub fn wants_store_events(&self) -> bool {
        matches!(self.state, State::Kvtier(_))
    }

    /// `inst` backed `pages` up to the shared store: what an engine publishes of its own
    /// writes (Dynamo's worker-local `STORAGE`).
    pub fn l3_written(&mut self, inst: usize, pages: &[PageHash]) {
        if let State::Dynamo(d) = &mut self.state {
            d.stored(inst, pages);
        }
    }

    /// The shared store lost `pages` (evicted, removed), from its loss journal: what each
    /// engine learns and publishes of its own writes.
    pub fn l3_lost(&mut self, pages: &[PageHash]) {
        let n = self.instances;
        if let State::Dynamo(d) = &mut self.state {
            d.lost(n, pages);
        }
    }

    /// A batch of the shared store's own stream (`STORAGE` residency, one for the cluster).
    pub fn store_events(&mut self, batch: &[WireEvent]) {
        if let State::Kvtier(k) = &mut self.state {
            k.store_batch(batch);
        }
    }

    fn done_waiting(&mut self, id: u64) {
        if let Some((inst, tokens)) = self.waiting.remove(&id) {
            self.queued_tokens[inst] -= tokens;
        }
    }

    /// Request `id` produced its first token.
    pub fn first_token(&mut self, id: u64, now_us: u64) {
        self.done_waiting(id);
        match &mut self.state {
            State::Dynamo(d) => d.first_token(id, now_us),
            State::Kvtier(k) => k.first_token(id, now_us),
            State::Stateless | State::LeastLoaded => {}
        }
    }

    /// Request `id` ended (finished, aborted or rejected).
    pub fn ended(&mut self, id: u64, now_us: u64) {
        self.done_waiting(id);
        match &mut self.state {
            State::Dynamo(d) => d.ended(id, now_us),
            State::Kvtier(k) => k.ended(id, now_us),
            State::Stateless | State::LeastLoaded => {}
        }
    }

    /// The pages the router believes the shared store holds (`None`: it does not read the
    /// store's stream).
    pub fn storage_view(&self) -> Option<Vec<u64>> {
        match &self.state {
            State::Kvtier(k) => Some(k.router().index().storage_hashes()),
            _ => None,
        }
    }

    pub fn index_stats(&self) -> IndexStats {
        match &self.state {
            State::Stateless | State::LeastLoaded => IndexStats::default(),
            State::Dynamo(d) => IndexStats {
                pages: d.device_blocks() as u64,
                bytes: None,
                events: d.received,
                rejected: d.rejected,
            },
            State::Kvtier(k) => IndexStats {
                pages: k.router().index().pages() as u64,
                bytes: Some(k.router().index().memory_bytes() as u64),
                events: [0; 3],
                rejected: k.rejected,
            },
        }
    }
}
