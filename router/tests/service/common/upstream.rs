//! Recorded `vllm serve` exchanges and KV event batches, and an upstream that replays them.

use super::*;

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
    let Some((head, raw_body)) = read_request(&mut s).await else {
        return;
    };
    let mut first = head.split(' ');
    let (method, path) = (
        first.next().unwrap_or_default().to_string(),
        first.next().unwrap_or_default().to_string(),
    );
    let body: Option<serde_json::Value> = serde_json::from_slice(&raw_body).ok();
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
