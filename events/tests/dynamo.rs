//! kvtier's event stream fed to NVIDIA Dynamo's own KV router (crate `dynamo-kv-router`, its
//! default configuration): Dynamo decodes the bytes with its vLLM wire decoder
//! (`zmq_wire::decode_event_batch`), normalizes them as its ZMQ listener does, indexes them in
//! its `RadixTree`, and for any prompt reports the same per-instance device overlap that each
//! instance's kvtier cache reports for it. So a Dynamo deployment routes on kvtier's events
//! without an adapter.
//!
//! What Dynamo does not take from this stream: host (`CPU`) blocks go to its lower-tier
//! index, not the `RadixTree` checked here; and since its block hashes are computed from
//! tokens, two tenants' salted prefixes with equal tokens look the same to it unless the
//! salt travels as an extra key (kvtier's own hashes keep them apart).

use dynamo_kv_router::protocols::{BlockHashOptions, WorkerWithDpRank, compute_block_hash_for_seq};
use dynamo_kv_router::radix_tree::RadixTree;
use dynamo_kv_router::zmq_wire::{ZmqEventNormalizer, decode_event_batch};
use kvtier_events::{HashFormat, WireEvent, encode_batch};
use kvtier_radix::*;
use proptest::prelude::*;

mod common;
use common::*;

/// One instance: a kvtier cache and what Dynamo was told about it.
struct Instance {
    cache: RadixCache,
    worker: WorkerWithDpRank,
    normalizer: ZmqEventNormalizer,
    next_event: u64,
}

impl Instance {
    fn new(id: u64, device_pages: u32) -> Self {
        let cache = RadixCache::new(RadixConfig {
            page_size: PS,
            device_pages,
            host_pages: 0,
            record_events: true,
        })
        .expect("config");
        Self {
            cache,
            worker: WorkerWithDpRank::new(id, 0),
            normalizer: ZmqEventNormalizer::new(PS as u32),
            next_event: 0,
        }
    }

    /// Serves a prompt on device; its pages stay cached.
    fn serve(&mut self, toks: &[u32]) {
        put_device(&mut self.cache, toks);
    }

    /// Publishes what happened since the last call to `tree`, through the wire bytes.
    fn publish(&mut self, tree: &mut RadixTree, ts: f64) {
        let events: Vec<WireEvent> = self
            .cache
            .drain_events()
            .iter()
            .map(|e| WireEvent::from_kv(e, PS as u32))
            .collect();
        let payload = encode_batch(ts, &events, 0, HashFormat::Int64).expect("encode");
        let batch = decode_event_batch(&payload).expect("Dynamo decodes kvtier's batch");
        assert_eq!(batch.events.len(), events.len());
        for raw in batch.events {
            let id = self.next_event;
            self.next_event += 1;
            let placement = self
                .normalizer
                .normalize(raw, id, self.worker)
                .expect("Dynamo keeps the event");
            let ev = placement
                .into_router_event()
                .expect("a local worker's event");
            tree.apply_event(ev).expect("Dynamo's tree applies it");
        }
    }

    fn device_overlap(&mut self, toks: &[u32]) -> u32 {
        self.cache
            .match_prefix(&page_hashes(toks, PS, None))
            .device_pages as u32
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn dynamo_computes_the_overlap_kvtier_has(
        served in prop::collection::vec((0usize..3, 1u32..8, 0usize..4, 1usize..7), 1..30),
        queries in prop::collection::vec((1u32..8, 0usize..4, 1usize..7), 1..10),
    ) {
        let mut tree = RadixTree::new();
        let mut insts: Vec<Instance> = (0..3).map(|i| Instance::new(100 + i, 16)).collect();
        for (step, &(inst, seed, shared, pages)) in served.iter().enumerate() {
            insts[inst].serve(&tokens(seed, shared.min(pages), pages));
            insts[inst].publish(&mut tree, step as f64);
        }
        for &(seed, shared, pages) in &queries {
            let toks = tokens(seed, shared.min(pages), pages);
            let seq = compute_block_hash_for_seq(&toks, PS as u32, BlockHashOptions::default());
            let scores = tree.find_matches(seq, false).scores;
            for inst in &mut insts {
                let want = inst.device_overlap(&toks);
                let got = scores.get(&inst.worker).copied().unwrap_or(0);
                prop_assert_eq!(got, want, "worker {}", inst.worker.worker_id);
            }
        }
    }
}
