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

/// An HTTP response as received: status, headers (lower-case names), the body's chunks as
/// framed on the wire (one element if not chunked).
#[derive(Debug)]
pub struct Got {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub chunks: Vec<Vec<u8>>,
}

impl Got {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    pub fn body(&self) -> Vec<u8> {
        self.chunks.concat()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body()).expect("JSON body")
    }
}

/// One HTTP/1.1 request over a fresh connection (`Connection: close`).
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&[u8]>) -> Got {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let body = body.unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("write");
    s.write_all(body).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut raw))
        .await
        .expect("response in time")
        .expect("read");
    parse_response(&raw)
}

pub fn parse_response(raw: &[u8]) -> Got {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of head");
    let head = std::str::from_utf8(&raw[..end]).expect("utf-8 head");
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut rest = &raw[end + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let mut chunks = Vec::new();
    if chunked {
        loop {
            let nl = rest
                .windows(2)
                .position(|w| w == b"\r\n")
                .expect("size line");
            let size = std::str::from_utf8(&rest[..nl]).expect("size");
            let n = usize::from_str_radix(size.trim(), 16).expect("hex size");
            rest = &rest[nl + 2..];
            if n == 0 {
                break;
            }
            chunks.push(rest[..n].to_vec());
            rest = &rest[n + 2..];
        }
    } else {
        chunks.push(rest.to_vec());
    }
    Got {
        status,
        headers,
        chunks,
    }
}

/// One recorded exchange with `vllm serve` (router/tests/fixtures/record_vllm.py).
#[derive(Clone, Debug, serde::Deserialize)]
pub struct Exchange {
    pub method: String,
    pub path: String,
    pub request: Option<serde_json::Value>,
    pub status: u16,
    pub content_type: String,
    pub chunks: Vec<String>,
}

impl Exchange {
    /// The request's token-id prompt.
    pub fn prompt_ids(&self) -> Vec<u32> {
        let p = self.request.as_ref().map(|r| r["prompt"].clone());
        serde_json::from_value(p.unwrap_or_default()).expect("a token-id prompt")
    }
}

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm")
}

pub fn recorded() -> Vec<Exchange> {
    let text = std::fs::read_to_string(fixtures().join("exchanges.json")).expect("recordings");
    serde_json::from_str(&text).expect("recordings parse")
}

/// An HTTP server on loopback that answers each request with the recorded response to the
/// same method, path and JSON body (chunked and paced 20 ms per chunk when recorded in
/// chunks), 404 otherwise; counts what it served. Stops when dropped.
pub struct Upstream {
    pub addr: SocketAddr,
    pub served: Arc<AtomicUsize>,
    pub requests: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    pub async fn start(exchanges: Vec<Exchange>) -> Upstream {
        Self::start_slow(exchanges, Duration::ZERO).await
    }

    /// [`Self::start`], with every answer's first chunk `first_chunk` late (an engine whose
    /// first tokens come late: its headers go out at once, as a streaming server's do).
    pub async fn start_slow(exchanges: Vec<Exchange>, first_chunk: Duration) -> Upstream {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let served = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let ex = Arc::new(exchanges);
        let (sv, rq) = (Arc::clone(&served), Arc::clone(&requests));
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (ex, sv, rq) = (Arc::clone(&ex), Arc::clone(&sv), Arc::clone(&rq));
                tokio::spawn(async move { serve_one(s, &ex, &sv, &rq, first_chunk).await });
            }
        });
        Upstream {
            addr,
            served,
            requests,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_one(
    mut s: tokio::net::TcpStream,
    ex: &[Exchange],
    served: &AtomicUsize,
    requests: &Mutex<Vec<String>>,
    first_chunk: Duration,
) {
    // one request per connection is enough for the router's client: it reconnects
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let (head_end, len) = loop {
        let Ok(n) = s.read(&mut tmp).await else {
            return;
        };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(e) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..e]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            break (e, len);
        }
    };
    while buf.len() < head_end + 4 + len {
        let Ok(n) = s.read(&mut tmp).await else {
            return;
        };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut first = head.split(' ');
    let (method, path) = (
        first.next().unwrap_or_default().to_string(),
        first.next().unwrap_or_default().to_string(),
    );
    let body: Option<serde_json::Value> =
        serde_json::from_slice(&buf[head_end + 4..head_end + 4 + len]).ok();
    requests.lock().expect("lock").push(path.clone());
    let hit = ex
        .iter()
        .find(|e| e.method == method && e.path == path && e.request == body);
    let Some(e) = hit else {
        let b = br#"{"error":"not recorded"}"#;
        let r = format!(
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            b.len()
        );
        let _ = s.write_all(r.as_bytes()).await;
        let _ = s.write_all(b).await;
        return;
    };
    served.fetch_add(1, Ordering::Relaxed);
    let reason = if e.status == 200 { "OK" } else { "Error" };
    if e.chunks.len() > 1 {
        let r = format!(
            "HTTP/1.1 {} {reason}\r\ncontent-type: {}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
            e.status, e.content_type
        );
        if s.write_all(r.as_bytes()).await.is_err() {
            return;
        }
        let _ = s.flush().await;
        tokio::time::sleep(first_chunk).await;
        for c in &e.chunks {
            let frame = format!("{:x}\r\n{c}\r\n", c.len());
            if s.write_all(frame.as_bytes()).await.is_err() {
                return;
            }
            let _ = s.flush().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = s.write_all(b"0\r\n\r\n").await;
    } else {
        tokio::time::sleep(first_chunk).await;
        let b = e.chunks.concat();
        let r = format!(
            "HTTP/1.1 {} {reason}\r\ncontent-type: {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{b}",
            e.status,
            e.content_type,
            b.len()
        );
        let _ = s.write_all(r.as_bytes()).await;
    }
    let _ = s.shutdown().await;
}

/// A loopback port nothing listens on (bound, then closed).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

pub fn medium_str(m: Medium) -> &'static str {
    m.as_str()
}

/// `(seq, payload)` of one published batch.
pub type Batch = (u64, Vec<u8>);

/// KV event batches recorded from `vllm serve` (router/tests/fixtures/vllm/events.json): the
/// block size, the prompt the completions used, and the batches in order.
pub fn recorded_events() -> (usize, Vec<u32>, Vec<Batch>) {
    let text = std::fs::read_to_string(fixtures().join("events.json")).expect("events");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let bs = v["block_size"].as_u64().expect("block_size") as usize;
    let prompt = serde_json::from_value(v["prompt"].clone()).expect("prompt");
    let batches = v["batches"]
        .as_array()
        .expect("batches")
        .iter()
        .map(|b| {
            let hex = b["payload"].as_str().expect("hex");
            let p = (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex"))
                .collect();
            (b["seq"].as_u64().expect("seq"), p)
        })
        .collect();
    (bs, prompt, batches)
}

/// A publisher that speaks as vLLM 0.32's `ZmqEventPublisher` does: PUB frames
/// `[topic, seq, payload]`; the replay ROUTER reads the start number unsigned (so -2 asks for
/// nothing) and answers `[id, "", topic, seq, payload]` per kept batch, then
/// `[id, "", "", -1, ""]`. It serves the batches given once [`VllmLike::publish`] is called,
/// sending live only those `send_live` allows.
pub struct VllmLike {
    pub events: String,
    pub replay: String,
    go: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl VllmLike {
    pub fn start(
        batches: Vec<(u64, Vec<u8>)>,
        send_live: impl Fn(u64) -> bool + Send + 'static,
    ) -> Self {
        let ctx = zmq::Context::new();
        let pub_ = ctx.socket(zmq::PUB).expect("pub");
        pub_.bind("tcp://127.0.0.1:*").expect("bind");
        let router = ctx.socket(zmq::ROUTER).expect("router");
        router.bind("tcp://127.0.0.1:*").expect("bind");
        let ep = |s: &zmq::Socket| s.get_last_endpoint().expect("ep").expect("utf-8");
        let (events, replay) = (ep(&pub_), ep(&router));
        let stop = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let (s, g) = (Arc::clone(&stop), Arc::clone(&go));
        let thread = std::thread::spawn(move || {
            let _ctx = ctx;
            let mut sent = false;
            while !s.load(Ordering::Relaxed) {
                if !sent && g.load(Ordering::Relaxed) {
                    for (seq, p) in batches.iter().filter(|b| send_live(b.0)) {
                        let _ = pub_.send_multipart([&b""[..], &seq.to_be_bytes()[..], &p[..]], 0);
                    }
                    sent = true;
                }
                if router.poll(zmq::POLLIN, 20).unwrap_or(0) == 0 {
                    continue;
                }
                let Ok(f) = router.recv_multipart(0) else {
                    continue;
                };
                let [id, _, start] = f.as_slice() else {
                    continue;
                };
                let mut b = [0u8; 8];
                b.copy_from_slice(&start[..8.min(start.len())]);
                let start = u64::from_be_bytes(b);
                if sent {
                    for (seq, p) in batches.iter().filter(|b| b.0 >= start) {
                        let _ = router
                            .send_multipart([&id[..], b"", b"", &seq.to_be_bytes()[..], &p[..]], 0);
                    }
                }
                let _ =
                    router.send_multipart([&id[..], b"", b"", &(-1i64).to_be_bytes()[..], b""], 0);
            }
        });
        VllmLike {
            events,
            replay,
            go,
            stop,
            thread: Some(thread),
        }
    }

    /// Publishes the batches (live and in the replay buffer).
    pub fn publish(&self) {
        self.go.store(true, Ordering::Relaxed);
    }

    pub fn spec(&self) -> EndpointSpec {
        EndpointSpec {
            events: Some(self.events.clone()),
            replay: Some(self.replay.clone()),
            url: None,
            topic: None,
        }
    }
}

impl Drop for VllmLike {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One request a [`Fake`] upstream received: its request line, its headers as sent (names
/// lower-cased, in order, repeats kept), its body, and the number of its connection.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    /// The request target: path and query.
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Which of the upstream's connections carried it (0, 1, ... in accept order).
    pub conn: usize,
    /// Requests on that connection before it.
    pub nth: usize,
}

impl Seen {
    /// Every value of header `name` (lower case), in order.
    pub fn values(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// How a [`Fake`] answers one request.
#[derive(Clone, Debug)]
pub enum Reply {
    /// A whole answer: status and JSON body, with `content-length`, the connection kept.
    Json(u16, String),
    /// A streamed 200 (`text/event-stream`, chunked): these chunks, then the end.
    Sse(Vec<String>),
    /// Nothing, ever: the request is read and the connection held open (a hung engine).
    Hang,
    /// The connection is closed at once, unanswered (a server that closed it as the
    /// request came).
    Close,
}

/// An HTTP/1.1 upstream on loopback that records every request ([`Seen`]) and answers as
/// `reply` says, keeping connections alive between requests; with `idle_close`, a
/// connection idle that long is closed by the server (uvicorn's `timeout_keep_alive`).
/// Stops when dropped.
pub struct Fake {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

type ReplyFn = dyn Fn(&Seen) -> Reply + Send + Sync;

impl Fake {
    pub async fn start(
        reply: impl Fn(&Seen) -> Reply + Send + Sync + 'static,
        idle_close: Option<Duration>,
    ) -> Fake {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let accepted = Arc::new(AtomicUsize::new(0));
        let reply: Arc<ReplyFn> = Arc::new(reply);
        let (sn, ac) = (Arc::clone(&seen), Arc::clone(&accepted));
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((s, _)) = l.accept().await {
                let conn = ac.fetch_add(1, Ordering::SeqCst);
                let (sn, reply) = (Arc::clone(&sn), Arc::clone(&reply));
                // owned by this task: aborting it closes every connection
                conns.spawn(async move { fake_conn(s, conn, &sn, &*reply, idle_close).await });
            }
        });
        Fake {
            addr,
            seen,
            accepted,
            task,
        }
    }

    /// A fake answering every request with one small JSON completion.
    pub async fn ok() -> Fake {
        Fake::start(|_| Reply::Json(200, ok_json()), None).await
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    /// Requests received on `path` (the target's path, query left out).
    pub fn count(&self, path: &str) -> usize {
        let s = self.seen.lock().expect("lock");
        s.iter()
            .filter(|r| r.target.split('?').next() == Some(path))
            .count()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A small completion answer.
pub fn ok_json() -> String {
    r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"length"}]}"#.into()
}

async fn fake_conn(
    mut s: tokio::net::TcpStream,
    conn: usize,
    seen: &Mutex<Vec<Seen>>,
    reply: &ReplyFn,
    idle_close: Option<Duration>,
) {
    let mut buf: Vec<u8> = Vec::new();
    let mut tmp = [0u8; 8192];
    for nth in 0.. {
        // the head of the next request (the idle timeout runs until its first byte)
        let head_end = loop {
            if let Some(e) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break e;
            }
            let read = s.read(&mut tmp);
            let n = match (idle_close, buf.is_empty()) {
                (Some(t), true) => match tokio::time::timeout(t, read).await {
                    Ok(r) => r,
                    Err(_) => return, // idle: closed by the server
                },
                _ => read.await,
            };
            match n {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let mut lines = head.split("\r\n");
        let mut first = lines.next().unwrap_or_default().split(' ');
        let (method, target) = (
            first.next().unwrap_or_default().to_string(),
            first.next().unwrap_or_default().to_string(),
        );
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let len = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse::<usize>().ok())
            .unwrap_or(0);
        while buf.len() < head_end + 4 + len {
            match s.read(&mut tmp).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        }
        let body = buf[head_end + 4..head_end + 4 + len].to_vec();
        buf.drain(..head_end + 4 + len);
        let req = Seen {
            method,
            target,
            headers,
            body,
            conn,
            nth,
        };
        seen.lock().expect("lock").push(req.clone());
        match reply(&req) {
            Reply::Json(status, b) => {
                let r = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}",
                    b.len()
                );
                if s.write_all(r.as_bytes()).await.is_err() {
                    return;
                }
            }
            Reply::Sse(chunks) => {
                let mut r = String::from(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
                );
                for c in &chunks {
                    r.push_str(&format!("{:x}\r\n{c}\r\n", c.len()));
                }
                r.push_str("0\r\n\r\n");
                if s.write_all(r.as_bytes()).await.is_err() {
                    return;
                }
            }
            Reply::Hang => {
                // held until the client goes away
                while let Ok(n) = s.read(&mut tmp).await {
                    if n == 0 {
                        return;
                    }
                }
                return;
            }
            Reply::Close => return,
        }
    }
}

/// A loopback listener that accepts every connection and never reads or answers (a hung
/// engine, a half-dead host): connections are held until it is dropped.
pub struct Hole {
    pub addr: SocketAddr,
    pub accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Hole {
    pub async fn start() -> Hole {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let ac = Arc::clone(&accepted);
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                ac.fetch_add(1, Ordering::SeqCst);
                held.push(s);
            }
        });
        Hole {
            addr,
            accepted,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Hole {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One HTTP/1.1 request with these header lines, a `Content-Length` and, unless they hold
/// a `Connection`, `Connection: close` (nothing else is added); its answer read to the
/// connection's end within `wait` (`None` if not).
pub async fn http_with(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    wait: Duration,
) -> Option<Got> {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut head = format!(
        "{method} {target} HTTP/1.1\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("connection"))
    {
        head.push_str("Connection: close\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await.expect("write");
    s.write_all(body).await.expect("write");
    let mut raw = Vec::new();
    match tokio::time::timeout(wait, s.read_to_end(&mut raw)).await {
        Ok(Ok(_)) => Some(parse_response(&raw)),
        _ => None,
    }
}
