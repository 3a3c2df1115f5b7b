//! The router tests' one set of fixtures: kvtier publishers on loopback, a lossy relay that
//! makes real gaps, a router started as the binary starts it, a raw HTTP/1.1 client that
//! sees the chunks, and an upstream that replays recorded vLLM responses.
#![allow(dead_code)] // each test file uses its own subset

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_events::{HashFormat, Medium, Publisher, PublisherConfig, WireEvent, encode_batch};
use kvtier_radix::{HashScope, PageHash};
use kvtier_router::cluster::Keys;
use kvtier_router::launch::{self, Config, EndpointSpec, Running};
use kvtier_router::{ClusterIndex, CostModel, decode_batch};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const PS: usize = 32;

pub fn model() -> CostModel {
    CostModel {
        page_size: PS,
        page_bytes: 1 << 20,
        prefill_tokens_per_s: 10_000.0,
        host_bytes_per_s: 10e9,
        l3_bytes_per_s: 1e9,
    }
}

/// `pages` pages of tokens, distinct per seed.
pub fn tokens(seed: u32, pages: usize) -> Vec<u32> {
    (0..(pages * PS) as u32)
        .map(|i| seed * 100_000 + i)
        .collect()
}

/// kvtier's page hashes of a prompt (no salt, no adapter).
pub fn hashes(toks: &[u32]) -> Vec<PageHash> {
    HashScope::new(None, None, Vec::new()).page_hashes(toks, PS)
}

/// A `BlockStored` of a prompt's pages on one medium, with its tokens.
pub fn stored(toks: &[u32], medium: Medium) -> WireEvent {
    let hs = hashes(toks);
    WireEvent::BlockStored {
        token_ids: toks[..hs.len() * PS].to_vec(),
        block_hashes: hs,
        parent_block_hash: None,
        block_size: PS as u32,
        medium,
        lora_name: None,
        locality: None,
    }
}

pub fn removed(toks: &[u32], medium: Medium) -> WireEvent {
    WireEvent::BlockRemoved {
        block_hashes: hashes(toks),
        medium,
        locality: None,
    }
}

/// A publisher on loopback ports with replay and snapshots.
pub fn publisher() -> Publisher {
    Publisher::bind(PublisherConfig {
        block_size: PS as u32,
        ..PublisherConfig::default()
    })
    .expect("bind publisher")
}

pub fn spec(p: &Publisher) -> EndpointSpec {
    EndpointSpec {
        events: Some(p.endpoint().to_string()),
        replay: p.replay_endpoint().map(str::to_string),
        url: None,
        topic: None,
    }
}

/// The index a stream's batches give when applied in order to a fresh index (the reference).
pub fn reference(instance_batches: &[Vec<Vec<WireEvent>>], max_pages: usize) -> ClusterIndex {
    let mut idx = ClusterIndex::new(instance_batches.len(), max_pages);
    for (i, batches) in instance_batches.iter().enumerate() {
        for b in batches {
            let p = encode_batch(0.0, b, 0, HashFormat::Int64).expect("encode");
            for e in decode_batch(&p).expect("decode") {
                idx.apply(i, &e);
            }
        }
    }
    idx
}

/// The tests' router configuration: 127.0.0.1 on a free port, quick replay timeouts and
/// resyncs, the defaults otherwise.
pub fn config(instances: Vec<EndpointSpec>, max_pages: usize, keys: Keys) -> Config {
    Config {
        model: model(),
        max_pages,
        max_index_bytes: usize::MAX,
        keys,
        subscribe: launch::subscribe_options(300, 0.3),
        ..Config::new("127.0.0.1:0".parse().expect("addr"), instances)
    }
}

/// A router started with [`config`].
pub async fn router(
    instances: Vec<EndpointSpec>,
    storage: Option<EndpointSpec>,
    max_pages: usize,
    keys: Keys,
) -> Running {
    launch::start(Config {
        storage,
        ..config(instances, max_pages, keys)
    })
    .await
    .expect("start router")
}

/// Waits (up to 10 s) until `f` holds.
pub async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until every stream of the router has synced (answered its snapshot or started).
pub async fn synced(r: &Running) {
    let c = Arc::clone(&r.cluster);
    until("streams synced", move || {
        let c = c.lock().expect("lock");
        c.streams.iter().all(|s| s.next_seq.is_some())
    })
    .await;
}

/// [`synced`], then a pause for the SUB sockets to join (ZMQ's slow joiner: a batch sent
/// before would be a gap, recovered, but the tests want the plain path too).
pub async fn joined(r: &Running) {
    synced(r).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// Relays a publisher's PUB stream to a new PUB socket, dropping the batches numbered in
/// `drop` (a real gap: the router's replay socket is the publisher's own).
pub struct Relay {
    pub endpoint: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Relay {
    pub fn start(upstream: &str, drop: HashSet<u64>) -> Relay {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).expect("sub");
        sub.set_subscribe(b"").expect("subscribe");
        sub.connect(upstream).expect("connect");
        let pub_ = ctx.socket(zmq::PUB).expect("pub");
        pub_.set_linger(0).expect("linger");
        pub_.bind("tcp://127.0.0.1:*").expect("bind");
        let endpoint = pub_.get_last_endpoint().expect("endpoint").expect("utf-8");
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let _ctx = ctx;
            while !s.load(Ordering::Relaxed) {
                if sub.poll(zmq::POLLIN, 50).unwrap_or(0) == 0 {
                    continue;
                }
                let Ok(frames) = sub.recv_multipart(0) else {
                    continue;
                };
                let seq = frames
                    .get(1)
                    .and_then(|f| <[u8; 8]>::try_from(f.as_slice()).ok())
                    .map(u64::from_be_bytes);
                if seq.is_some_and(|n| drop.contains(&n)) {
                    continue;
                }
                let _ = pub_.send_multipart(frames, 0);
            }
        });
        Relay {
            endpoint,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A loopback port nothing listens on (bound, then closed).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

pub fn medium_str(m: Medium) -> &'static str {
    m.as_str()
}

mod fake;
mod http;
mod upstream;
mod vllm_like;
pub use fake::*;
pub use http::*;
pub use upstream::*;
pub use vllm_like::*;
