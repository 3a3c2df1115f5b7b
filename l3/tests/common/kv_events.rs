//! A real ZMQ subscriber of a store's KV event stream, decoding every frame (vLLM's
//! `KVEventBatch` msgpack) and checking the fields the store promises; a router on the
//! same stream; kvtier-grammar keys of prompt pages.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kvtier_events::HashFormat;
use kvtier_radix::{HashScope, PageHash};
use rmpv::Value;

/// Tokens per page in these tests.
pub const PS: usize = 4;

/// One decoded event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ev {
    Stored(u64),
    Removed(Vec<u64>),
    Cleared,
}

/// `pages` pages of tokens for `seed`.
pub fn prompt(seed: u32, pages: usize) -> Vec<u32> {
    (0..(pages * PS) as u32)
        .map(|i| seed * 10_000 + i)
        .collect()
}

/// The prompt's page hashes, as kvtier's engines and the router (`--keys engine`) compute them.
pub fn pages(tokens: &[u32]) -> Vec<PageHash> {
    HashScope::new(None, None, Vec::new()).page_hashes(tokens, PS)
}

/// kvtier's L3 key of a page: `{namespace}:{hex}:{rank}`.
pub fn key(ns: &str, page: &PageHash, rank: u32) -> String {
    format!("{ns}:{}:{rank}", page.to_hex())
}

/// The 64-bit block hash the store publishes for a page.
pub fn wire(page: &PageHash) -> u64 {
    HashFormat::int64(page)
}

fn field<'a>(m: &'a [(Value, Value)], k: &str) -> Option<&'a Value> {
    m.iter()
        .find(|(a, _)| a.as_str() == Some(k))
        .map(|(_, v)| v)
}

fn hashes(v: Option<&Value>) -> Vec<u64> {
    match v {
        Some(Value::Array(a)) => a
            .iter()
            .map(|h| h.as_u64().expect("an int64 hash"))
            .collect(),
        other => panic!("block_hashes {other:?}"),
    }
}

/// Decodes one payload, asserting the store's promises: medium STORAGE, one block per
/// `BlockStored`, no parent, no tokens.
pub fn decode(payload: &[u8]) -> Vec<Ev> {
    let v = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack");
    let Value::Array(batch) = v else {
        panic!("a batch is an array")
    };
    assert_eq!(batch.len(), 3, "[ts, events, dp rank]");
    let Value::Array(events) = &batch[1] else {
        panic!("events")
    };
    events
        .iter()
        .map(|e| {
            let Value::Map(m) = e else {
                panic!("event map")
            };
            let ty = field(m, "type").and_then(Value::as_str).expect("type");
            if ty == "AllBlocksCleared" {
                return Ev::Cleared;
            }
            assert_eq!(field(m, "medium").and_then(Value::as_str), Some("STORAGE"));
            match ty {
                "BlockStored" => {
                    let hs = hashes(field(m, "block_hashes"));
                    assert_eq!(hs.len(), 1, "one page per BlockStored");
                    assert_eq!(field(m, "parent_block_hash"), Some(&Value::Nil));
                    assert_eq!(field(m, "token_ids"), Some(&Value::Array(Vec::new())));
                    Ev::Stored(hs[0])
                }
                "BlockRemoved" => Ev::Removed(hashes(field(m, "block_hashes"))),
                other => panic!("event type {other}"),
            }
        })
        .collect()
}

/// A SUB socket on a store's stream, joined (handshake seen) before it returns.
pub struct Sub {
    _ctx: zmq::Context,
    sub: zmq::Socket,
    /// Every event received, in order.
    pub events: Vec<Ev>,
    /// Sequence numbers received.
    pub seqs: Vec<u64>,
    /// The topic frame of each batch received.
    pub topics: Vec<Vec<u8>>,
}

impl Sub {
    pub fn connect(endpoint: &str) -> Sub {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.set_rcvtimeo(100).unwrap();
        // ZMQ's slow joiner: wait for the handshake, then for the PUB to take the
        // subscription, before anything is published
        sub.monitor(
            "inproc://kv-events-test-monitor",
            zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32,
        )
        .unwrap();
        let mon = ctx.socket(zmq::PAIR).unwrap();
        mon.set_rcvtimeo(10_000).unwrap();
        mon.connect("inproc://kv-events-test-monitor").unwrap();
        sub.connect(endpoint).unwrap();
        mon.recv_multipart(0).expect("the SUB's handshake");
        std::thread::sleep(Duration::from_millis(200));
        Sub {
            _ctx: ctx,
            sub,
            events: Vec::new(),
            seqs: Vec::new(),
            topics: Vec::new(),
        }
    }

    /// Receives for `d`, folding everything in.
    pub fn drain(&mut self, d: Duration) {
        let end = Instant::now() + d;
        while Instant::now() < end {
            if let Ok(f) = self.sub.recv_multipart(0) {
                assert_eq!(f.len(), 3, "[topic, seq, payload]");
                self.topics.push(f[0].clone());
                self.seqs
                    .push(u64::from_be_bytes(f[1].as_slice().try_into().unwrap()));
                self.events.extend(decode(&f[2]));
            }
        }
    }

    /// Receives until `done(self)` holds (at most 20 s; then panics naming `what`), then
    /// for 300 ms more, so that anything published after it shows.
    pub fn until(&mut self, what: &str, done: impl Fn(&Sub) -> bool) {
        let end = Instant::now() + Duration::from_secs(20);
        while !done(self) {
            assert!(Instant::now() < end, "no {what}: {:?}", self.events);
            self.drain(Duration::from_millis(50));
        }
        self.drain(Duration::from_millis(300));
    }

    /// The pages resident per the events so far.
    pub fn resident(&self) -> BTreeSet<u64> {
        let mut r = BTreeSet::new();
        for e in &self.events {
            match e {
                Ev::Stored(h) => {
                    r.insert(*h);
                }
                Ev::Removed(hs) => hs.iter().for_each(|h| {
                    r.remove(h);
                }),
                Ev::Cleared => r.clear(),
            }
        }
        r
    }

    /// How many times each hash was announced stored.
    pub fn stored_count(&self, h: u64) -> usize {
        self.events.iter().filter(|e| **e == Ev::Stored(h)).count()
    }
}

/// `n` distinct free loopback ZMQ endpoints (bound together, then released: one port
/// bound and released may come back at once).
pub fn free_endpoints(n: usize) -> Vec<String> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| format!("tcp://{}", l.local_addr().unwrap()))
        .collect()
}

/// A free loopback ZMQ endpoint (a port bound and released).
pub fn free_endpoint() -> String {
    let a = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    format!("tcp://{a}")
}

/// A router (`--keys engine`) with one instance without an engine stream and the store's
/// stream as `--storage`, started on `rt`.
pub fn router(
    rt: &tokio::runtime::Runtime,
    ev: &str,
    rep: &str,
    page_size: usize,
) -> kvtier_router::launch::Running {
    use kvtier_router::launch::EndpointSpec;
    router_with(
        rt,
        vec![EndpointSpec::default()],
        (ev, rep),
        page_size,
        kvtier_router::cluster::Keys::Engine,
    )
}

/// A router with `instances` and the store's stream `(events, replay)` as `--storage`,
/// keying pages by `keys`, started on `rt`.
pub fn router_with(
    rt: &tokio::runtime::Runtime,
    instances: Vec<kvtier_router::launch::EndpointSpec>,
    (ev, rep): (&str, &str),
    page_size: usize,
    keys: kvtier_router::cluster::Keys,
) -> kvtier_router::launch::Running {
    use kvtier_router::launch::EndpointSpec;
    let storage = EndpointSpec {
        events: Some(ev.into()),
        replay: Some(rep.into()),
        url: None,
        topic: None,
    };
    router_on(rt, instances, storage, page_size, keys)
}

/// A router with `instances` and `storage` as `--storage`, keying pages by `keys`.
pub fn router_on(
    rt: &tokio::runtime::Runtime,
    instances: Vec<kvtier_router::launch::EndpointSpec>,
    storage: kvtier_router::launch::EndpointSpec,
    page_size: usize,
    keys: kvtier_router::cluster::Keys,
) -> kvtier_router::launch::Running {
    use kvtier_router::launch::{self, Config};
    let cfg = Config {
        storage: Some(storage),
        model: kvtier_router::CostModel {
            page_size,
            ..kvtier_router::CostModel::h100_llama8b()
        },
        max_pages: 1 << 20,
        max_index_bytes: usize::MAX,
        subscribe: launch::subscribe_options(500, 1.0),
        keys,
        ..Config::new("127.0.0.1:0".parse().unwrap(), instances)
    };
    rt.block_on(launch::start(cfg)).expect("router")
}

/// The router's L3 pages for a prompt, once they equal `want` (at most 20 s).
pub fn l3_pages_become(r: &kvtier_router::launch::Running, tokens: &[u32], want: usize) -> usize {
    let mut got = usize::MAX;
    let ok = super::procs::eventually(Duration::from_secs(20), || {
        got = r
            .cluster
            .lock()
            .unwrap()
            .route(tokens, None, None, &[])
            .map_or(usize::MAX, |d| d.l3_pages);
        got == want
    });
    assert!(ok, "L3 pages {got}, want {want}");
    got
}
