//! NVIDIA Dynamo's KV router (crate `dynamo-kv-router` 1.6.1) on the simulator's clock: the
//! baseline kvtier's router is measured against.
//!
//! Why Dynamo's own code and not a re-implementation: a baseline we wrote could be wrong in
//! our favour. So every part that decides is Dynamo's, in its default configuration
//! (`KvRouterConfig::default()`):
//! - events: each instance's kvtier events go through kvtier's vLLM wire encoder and Dynamo's
//!   decoder (`zmq_wire::decode_event_batch`) and normalizer (`ZmqEventNormalizer`), as its
//!   ZMQ listener does; GPU events go to its `RadixTree`, CPU (`HostPinned`) and worker-local
//!   `STORAGE` (`Disk`) events to its `LowerTierIndexers`;
//! - overlap: the device match (`RadixTree::find_match_details`), then the lower tiers from
//!   each worker's continuation (`query_lower_tiers_with_options`), turned into effective
//!   overlap with its tier credits (`OverlapAnalysis::signals`: host 0.75, disk 0.25);
//! - load: its active-sequence tracker (`ActiveSequencesMultiWorker`), told when a request is
//!   routed, when its prefill completes and when it ends, at the simulated time;
//! - selection: its default selector (`DefaultWorkerSelector`, the crate's native
//!   implementation of the default policy, built with the crate's `bench` feature, seeded so
//!   runs repeat): cost `prefill_load_scale × max(active_prefill + incoming − credit, 0) +
//!   decode_blocks`, softmax at its default temperature.
//!
//! What Dynamo is not told: the shared L3 as such. Its wire has no shared-store tier, so an
//! instance's backups reach it as that instance's `STORAGE` (worker-local disk) blocks; the
//! simulator's backups know only page hashes, so their events are rebuilt from the
//! (parent, token hash) Dynamo itself derived when the page was first stored on GPU.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::{
    LowerTierIndexers, LowerTierQueryOptions, RadixTree, query_lower_tiers_with_options,
};
use dynamo_kv_router::protocols::{
    BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
    WorkerConfigLike, WorkerWithDpRank, compute_block_hash_for_seq, compute_seq_hash_for_block,
};
use dynamo_kv_router::scheduling::{OverlapAnalysis, ScheduleMode, SchedulingRequest};
use dynamo_kv_router::zmq_wire::{ZmqEventNormalizer, decode_event_batch};
use dynamo_kv_router::{
    ActiveSequencesMultiWorker, DefaultWorkerSelector, KvRouterConfig, NoopSequencePublisher,
    SequenceRequest, WorkerSelectionInput, WorkerSelector,
};
use kvtier_events::{HashFormat, WireEvent, encode_batch};
use kvtier_radix::{KvEvent, PageHash};

use crate::workload::SimRequest;

/// A worker as Dynamo's selector sees it: one data-parallel rank, no limits declared.
#[derive(Clone, PartialEq)]
struct Worker;

impl WorkerConfigLike for Worker {
    fn data_parallel_start_rank(&self) -> u32 {
        0
    }
    fn data_parallel_size(&self) -> u32 {
        1
    }
    fn max_num_batched_tokens(&self) -> Option<u64> {
        None
    }
    fn total_kv_blocks(&self) -> Option<u64> {
        None
    }
}

pub struct DynamoRouter {
    config: KvRouterConfig,
    block_size: u32,
    device: RadixTree,
    lower: LowerTierIndexers,
    lower_dirty: bool,
    slots: ActiveSequencesMultiWorker<NoopSequencePublisher>,
    selector: DefaultWorkerSelector,
    workers: HashMap<u64, Worker>,
    normalizers: Vec<ZmqEventNormalizer>,
    next_event: u64,
    /// (parent, token hash) of every block Dynamo indexed, by block hash: what a `STORAGE`
    /// event for a backed-up page is rebuilt from.
    blocks: HashMap<u64, (Option<u64>, u64)>,
    epoch: Instant,
    /// Events Dynamo received, by tier (GPU, CPU, STORAGE), and those it rejected.
    pub received: [u64; 3],
    pub rejected: u64,
}

impl DynamoRouter {
    pub fn new(instances: usize, block_size: u32, seed: u64) -> Self {
        let config = KvRouterConfig::default();
        let dp: HashMap<u64, (u32, u32)> = (0..instances as u64).map(|w| (w, (0, 1))).collect();
        Self {
            selector: DefaultWorkerSelector::new_seeded(Some(config.clone()), "aggregated", seed),
            config,
            block_size,
            device: RadixTree::new(),
            lower: LowerTierIndexers::new(1, block_size),
            lower_dirty: false,
            slots: ActiveSequencesMultiWorker::new_without_expiry(
                NoopSequencePublisher,
                block_size as usize,
                dp,
                false,
                0,
                "aggregated",
            ),
            workers: (0..instances as u64).map(|w| (w, Worker)).collect(),
            normalizers: (0..instances)
                .map(|_| ZmqEventNormalizer::new(block_size))
                .collect(),
            next_event: 0,
            blocks: HashMap::new(),
            epoch: Instant::now(),
            received: [0; 3],
            rejected: 0,
        }
    }

    /// The simulated time as the instant Dynamo's load tracker takes (tokio's).
    fn at<T: From<Instant>>(&self, now_us: u64) -> T {
        T::from(self.epoch + Duration::from_micros(now_us))
    }

    fn worker(inst: usize) -> WorkerWithDpRank {
        WorkerWithDpRank::new(inst as u64, 0)
    }

    fn apply(&mut self, ev: RouterEvent) {
        if let KvCacheEventData::Stored(s) = &ev.event.data {
            let mut parent = s.parent_hash.map(|p| p.0);
            for b in &s.blocks {
                self.blocks
                    .insert(b.block_hash.0, (parent, b.tokens_hash.0));
                parent = Some(b.block_hash.0);
            }
        }
        let tier = match ev.storage_tier {
            StorageTier::Device => 0,
            StorageTier::HostPinned => 1,
            _ => 2,
        };
        self.received[tier] += 1;
        if ev.storage_tier.is_gpu() {
            if self.device.apply_event(ev).is_err() {
                self.rejected += 1;
            }
        } else {
            self.lower_dirty = true;
            let tier = ev.storage_tier;
            if self.lower.get_or_create(tier).enqueue_event(ev).is_err() {
                self.rejected += 1;
            }
        }
    }

    /// An instance's kvtier events, through the wire as a ZMQ subscriber gets them.
    pub fn kv_events(&mut self, inst: usize, events: &[KvEvent]) {
        if events.is_empty() || inst >= self.normalizers.len() {
            return;
        }
        let wire: Vec<WireEvent> = events
            .iter()
            .map(|e| WireEvent::from_kv(e, self.block_size))
            .collect();
        let Ok(payload) = encode_batch(0.0, &wire, 0, HashFormat::Int64) else {
            self.rejected += wire.len() as u64;
            return;
        };
        let Ok(batch) = decode_event_batch(&payload) else {
            self.rejected += wire.len() as u64;
            return;
        };
        for raw in batch.events {
            let id = self.next_event;
            self.next_event += 1;
            match self.normalizers[inst]
                .normalize(raw, id, Self::worker(inst))
                .and_then(|p| p.into_router_event())
            {
                Some(ev) => self.apply(ev),
                None => self.rejected += 1,
            }
        }
    }

    fn storage_event(&mut self, inst: usize, data: KvCacheEventData) {
        let id = self.next_event;
        self.next_event += 1;
        let mut ev = RouterEvent::new(
            inst as u64,
            KvCacheEvent {
                event_id: id,
                data,
                dp_rank: 0,
            },
        );
        ev.storage_tier = StorageTier::Disk;
        self.apply(ev);
    }

    /// `inst` backed `pages` up to the store: its worker-local `STORAGE` blocks.
    pub fn stored(&mut self, inst: usize, pages: &[PageHash]) {
        for p in pages {
            let h = HashFormat::int64(p);
            let Some(&(parent, tokens)) = self.blocks.get(&h) else {
                self.rejected += 1;
                continue;
            };
            self.storage_event(
                inst,
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(ExternalSequenceBlockHash),
                    start_position: None,
                    blocks: vec![KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(h),
                        tokens_hash: LocalBlockHash(tokens),
                        mm_extra_info: None,
                    }],
                }),
            );
        }
    }

    /// The store lost `pages`: removed from every worker's `STORAGE` (a worker that did not
    /// hold one ignores it).
    pub fn lost(&mut self, instances: usize, pages: &[PageHash]) {
        let hashes: Vec<ExternalSequenceBlockHash> = pages
            .iter()
            .map(|p| ExternalSequenceBlockHash(HashFormat::int64(p)))
            .collect();
        for inst in 0..instances {
            self.storage_event(
                inst,
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: hashes.clone(),
                }),
            );
        }
    }

    /// Dynamo's choice for `r` at `now_us`; the request is booked on the chosen worker.
    pub fn route(&mut self, r: &SimRequest, now_us: u64) -> Option<usize> {
        if self.lower_dirty {
            for idx in self.lower.all() {
                // A closed lane only means events were lost: the query still answers.
                futures::executor::block_on(idx.flush_and_wait()).ok();
            }
            self.lower_dirty = false;
        }
        let local =
            compute_block_hash_for_seq(&r.prompt, self.block_size, BlockHashOptions::default());
        let device = self.device.find_match_details(local.clone(), false);
        let lower = query_lower_tiers_with_options(
            &self.lower,
            &local,
            &device,
            LowerTierQueryOptions::default(),
        );
        let tiered = dynamo_kv_router::indexer::TieredMatchDetails {
            device,
            lower_tier: lower,
        };
        let overlap = OverlapAnalysis::new(&self.config, self.block_size, &tiered).signals();
        let seq = compute_seq_hash_for_block(&local);
        let id = r.id.to_string();
        let now: tokio::time::Instant = self.at(now_us);
        let mut request = SchedulingRequest {
            mode: ScheduleMode::Tracked {
                request_id: id.clone(),
            },
            token_seq: Some(seq.clone()),
            isl_tokens: r.prompt.len(),
            lora_name: None,
            expected_output_tokens: Some(r.output_len),
            affinity_target: None,
            pinned_worker: None,
            allowed_worker_ids: None,
            routing_constraints: Default::default(),
            router_config_override: None,
            track_prefill_tokens: self.config.router_track_prefill_tokens,
            priority_jump: 0.0,
            strict_priority: 0,
            policy_class: None,
            session_context: None,
            overlap,
            kv_transfer_candidates: None,
            retain_kv_transfer_chain: false,
            shared_cache_hits: None,
            worker_loads: Default::default(),
            resp_tx: None,
        };
        request.worker_loads = self.slots.project_worker_loads(Some(&seq), now);
        let picked = self
            .selector
            .select_worker(WorkerSelectionInput::configured(
                &self.workers,
                &request,
                request.eligibility(),
                self.block_size,
            ))
            .ok()?;
        let worker = picked.worker;
        self.slots
            .add_request(
                SequenceRequest {
                    request_id: id,
                    token_sequence: Some(seq),
                    track_prefill_tokens: request.track_prefill_tokens,
                    expected_output_tokens: Some(r.output_len),
                    prefill_load_hint: None,
                    worker,
                    lora_name: None,
                },
                now,
            )
            .ok();
        Some(worker.worker_id as usize)
    }

    pub fn first_token(&mut self, id: u64, now_us: u64) {
        let now: tokio::time::Instant = self.at(now_us);
        self.slots.mark_prefill_completed(&id.to_string(), now).ok();
    }

    pub fn ended(&mut self, id: u64, now_us: u64) {
        let now: tokio::time::Instant = self.at(now_us);
        self.slots.free(&id.to_string(), now).ok();
    }

    /// Blocks Dynamo's device index holds (its lower tiers do not report a size).
    pub fn device_blocks(&self) -> usize {
        self.device.current_size()
    }
}
