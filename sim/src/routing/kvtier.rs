//! kvtier's router (crate `kvtier-router`) on the simulator's clock.
//!
//! Why through the wire: the router a deployment runs reads vLLM-format event batches, so the
//! simulator feeds it the same bytes (`kvtier-events`' encoder, the router's decoder) from each
//! instance's scheduler: GPU and CPU pages per instance. The shared L3's residency goes in once
//! for the whole cluster (`STORAGE`), from the store's own stream (`kvtier_l3::kv_events`,
//! taken each plan): a page any instance backed up is loadable by all, and pages the store
//! lost, evicted or replaced leave it. The router keeps its own queue per instance (seconds of
//! estimated work, drained by the simulated clock), its cost model built from the simulated
//! model and links: what the deployment would measure.

use kvtier_events::{HashFormat, WireEvent, encode_batch};
use kvtier_radix::{KvEvent, page_hashes};
use kvtier_router::{CostModel, Occupancy, Router};

use crate::config::SimConfig;
use crate::workload::SimRequest;

/// Entries the router's index may hold (pages, all tiers and instances): far above any
/// simulated cluster's capacity, so nothing is dropped in the benchmark.
pub const MAX_INDEX_PAGES: usize = 64 << 20;

pub struct KvtierRouter {
    router: Router,
    page_size: usize,
    /// Event batches that did not decode (none expected).
    pub rejected: u64,
    /// Batches of the shared store's stream applied.
    pub store_batches: u64,
}

/// The router's cost model for the simulated deployment.
pub fn cost_model(cfg: &SimConfig) -> CostModel {
    let ps = cfg.scheduler.page_size;
    CostModel {
        page_size: ps,
        page_bytes: cfg.profile.kv_bytes_per_token * ps as u64,
        prefill_tokens_per_s: cfg.profile.prefill_tokens_per_s,
        host_bytes_per_s: cfg.links.pcie_gb_per_s * 1e9,
        l3_bytes_per_s: cfg.links.l3_gb_per_s * 1e9,
    }
}

/// The device memory and decode step of the simulated instances, for the router's queues.
pub fn occupancy(cfg: &SimConfig) -> Occupancy {
    Occupancy {
        device_tokens: cfg.scheduler.device_pages as f64 * cfg.scheduler.page_size as f64,
        decode_step_s: cfg.profile.forward_us(0, 1, 0) as f64 / 1e6,
    }
}

impl KvtierRouter {
    /// Refuses a profile or links whose rates make no cost model ([`CostModel::check`]).
    pub fn new(cfg: &SimConfig) -> Result<Self, String> {
        let mut router = Router::new(cfg.instances.max(1), cost_model(cfg), MAX_INDEX_PAGES)
            .map_err(|e| format!("--router kvtier: {e}"))?;
        router.set_occupancy(Some(occupancy(cfg))).expect(
            "an occupancy from page counts and a profile's microseconds is finite and >= 0",
        );
        Ok(Self {
            router,
            page_size: cfg.scheduler.page_size,
            rejected: 0,
            store_batches: 0,
        })
    }

    pub fn kv_events(&mut self, inst: usize, events: &[KvEvent]) {
        if events.is_empty() {
            return;
        }
        let wire: Vec<WireEvent> = events
            .iter()
            .map(|e| WireEvent::from_kv(e, self.page_size as u32))
            .collect();
        let ok = encode_batch(0.0, &wire, 0, HashFormat::Int64)
            .ok()
            .is_some_and(|p| self.router.apply_payload(inst, &p).is_ok());
        if !ok {
            self.rejected += 1;
        }
    }

    /// A batch of the shared store's stream: decoded as any subscriber decodes it, its
    /// `STORAGE` blocks go to the router's one shared set.
    pub fn store_batch(&mut self, batch: &[WireEvent]) {
        if batch.is_empty() {
            return;
        }
        self.store_batches += 1;
        let ok = encode_batch(0.0, batch, 0, HashFormat::Int64)
            .ok()
            .is_some_and(|p| self.router.apply_storage_payload(&p).is_ok());
        if !ok {
            self.rejected += 1;
        }
    }

    pub fn route(&mut self, r: &SimRequest, now_us: u64) -> Option<usize> {
        let hashes: Vec<u64> = page_hashes(&r.prompt, self.page_size, None)
            .iter()
            .map(HashFormat::int64)
            .collect();
        self.router
            .route_tracked(
                r.id,
                &hashes,
                r.prompt.len(),
                r.output_len as usize,
                now_us as f64 / 1e6,
            )
            .ok()
            .map(|(i, _)| i)
    }

    pub fn first_token(&mut self, id: u64, now_us: u64) {
        self.router.first_token(id, now_us as f64 / 1e6);
    }

    pub fn ended(&mut self, id: u64, now_us: u64) {
        self.router.finished(id, now_us as f64 / 1e6);
    }

    pub fn router(&self) -> &Router {
        &self.router
    }
}
