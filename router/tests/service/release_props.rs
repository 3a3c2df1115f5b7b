//! Proptest: whatever the clients and the instances do — answers whole or streamed, 4xx,
//! 500, 503, connections closed unanswered, streams that die midway, engines that hang
//! before their head or go silent after it, clients that read everything or go away at any
//! point, several at once — once every client is done, every instance's in-flight count and
//! the router's bookings are back to zero (an instance never looks busy for ever).

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::*;
use crate::proxy::url_spec;
use kvtier_router::cluster::Keys;
use kvtier_router::launch::{self, Config, EndpointSpec};

/// What an engine does with one request (the client names it in `X-Behave`, which the
/// router forwards as it does any end-to-end header).
#[derive(Clone, Copy, Debug)]
enum Behave {
    Whole,
    Stream,
    BadRequest,
    Internal,
    Unavailable,
    /// The connection closed, unanswered.
    Close,
    /// A streamed head and one chunk, then the connection drops.
    Die,
    /// Nothing, ever (until the peer goes).
    Hang,
    /// A streamed head, then nothing (a long prefill).
    Silent,
    /// A streamed answer of 20 chunks 10 ms apart.
    Slow,
}

const BEHAVE: [Behave; 10] = [
    Behave::Whole,
    Behave::Stream,
    Behave::BadRequest,
    Behave::Internal,
    Behave::Unavailable,
    Behave::Close,
    Behave::Die,
    Behave::Hang,
    Behave::Silent,
    Behave::Slow,
];

/// An engine acting as each request's `X-Behave` header says (by index into [`BEHAVE`]).
async fn engine() -> (String, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    let task = tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve_one(s));
        }
    });
    (url, task)
}

async fn serve_one(mut s: tokio::net::TcpStream) {
    let Some((head, _)) = read_request(&mut s).await else {
        return;
    };
    let head = head.to_ascii_lowercase();
    let behave = head
        .lines()
        .find_map(|l| l.strip_prefix("x-behave:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map_or(Behave::Whole, |i| BEHAVE[i % BEHAVE.len()]);
    let json = |status: u16, b: &str| {
        format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             connection: close\r\n\r\n{b}",
            b.len()
        )
    };
    if head.starts_with("get /v1/models") {
        let _ = s
            .write_all(json(200, r#"{"object":"list","data":[{"id":"m"}]}"#).as_bytes())
            .await;
        return;
    }
    let chunk = |c: &str| format!("{:x}\r\n{c}\r\n", c.len());
    let sse_head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                    transfer-encoding: chunked\r\n\r\n";
    let data = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
    let _ = match behave {
        Behave::Whole => s.write_all(json(200, &ok_json()).as_bytes()).await,
        Behave::BadRequest => {
            s.write_all(json(400, r#"{"error":"bad"}"#).as_bytes())
                .await
        }
        Behave::Internal => {
            s.write_all(json(500, r#"{"error":"oops"}"#).as_bytes())
                .await
        }
        Behave::Unavailable => {
            s.write_all(json(503, r#"{"error":"busy"}"#).as_bytes())
                .await
        }
        Behave::Close => return,
        Behave::Stream => {
            let a = format!(
                "{sse_head}{}{}0\r\n\r\n",
                chunk(data),
                chunk("data: [DONE]\n\n")
            );
            s.write_all(a.as_bytes()).await
        }
        Behave::Die => {
            let a = format!("{sse_head}{}", chunk(data));
            let _ = s.write_all(a.as_bytes()).await;
            tokio::time::sleep(Duration::from_millis(30)).await;
            return;
        }
        Behave::Hang | Behave::Silent => {
            if matches!(behave, Behave::Silent) && s.write_all(sse_head.as_bytes()).await.is_err() {
                return;
            }
            // held until the peer goes
            let mut buf = [0u8; 1024];
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
            return;
        }
        Behave::Slow => {
            if s.write_all(sse_head.as_bytes()).await.is_err() {
                return;
            }
            for _ in 0..20 {
                if s.write_all(chunk(data).as_bytes()).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            s.write_all(b"0\r\n\r\n").await
        }
    };
}

/// One client's request: its engine behaviour, streamed or not, and when it goes away
/// (`None`: it reads to the end; else after that many milliseconds).
#[derive(Clone, Debug)]
struct Call {
    behave: usize,
    stream: bool,
    leave_ms: Option<u64>,
    seed: u32,
}

fn call() -> impl Strategy<Value = Call> {
    (
        0..BEHAVE.len(),
        any::<bool>(),
        prop_oneof![Just(None), (0u64..150).prop_map(Some)],
        0u32..4,
    )
        .prop_map(|(behave, stream, leave_ms, seed)| Call {
            behave,
            stream,
            leave_ms,
            seed,
        })
}

async fn run(addr: std::net::SocketAddr, c: Call) {
    let body = serde_json::json!({"model": "m", "prompt": tokens(c.seed, 2), "max_tokens": 8,
                                  "stream": c.stream})
    .to_string();
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return;
    };
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nX-Behave: {}\r\nContent-Length: {}\r\n\r\n{body}",
        c.behave,
        body.len()
    );
    if s.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    let mut raw = Vec::new();
    // a client that reads to the end still gives up after a while (an engine that hangs
    // a whole answer is waited for without limit by the router)
    let wait = Duration::from_millis(c.leave_ms.unwrap_or(1500));
    let _ = tokio::time::timeout(wait, s.read_to_end(&mut raw)).await;
}

#[test]
fn in_flight_and_bookings_return_to_zero_whatever_clients_and_instances_do() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (r, _engines) = rt.block_on(async {
        let (a, ta) = engine().await;
        let (b, tb) = engine().await;
        let specs: Vec<EndpointSpec> = vec![url_spec(a), url_spec(b)];
        let r = launch::start(Config {
            head_timeout_s: 0.3,
            ..config(specs, 1 << 20, Keys::Tokens)
        })
        .await
        .expect("start router");
        (r, (ta, tb))
    });
    let addr = r.addr;
    let cluster = Arc::clone(&r.cluster);
    let mut runner = TestRunner::new(PropConfig {
        cases: 16,
        failure_persistence: None,
        ..PropConfig::default()
    });
    let result = runner.run(&proptest::collection::vec(call(), 1..6), |calls| {
        rt.block_on(async {
            let all: Vec<_> = calls
                .iter()
                .cloned()
                .map(|c| tokio::spawn(run(addr, c)))
                .collect();
            for t in all {
                let _ = t.await;
            }
            // the router sees each client's going within moments
            let t = tokio::time::Instant::now() + Duration::from_secs(5);
            loop {
                let (flying, booked) = {
                    let c = cluster.lock().expect("lock");
                    (c.in_flight().to_vec(), c.router().booked())
                };
                if flying.iter().all(|&n| n == 0) && booked == 0 {
                    return Ok(());
                }
                if tokio::time::Instant::now() > t {
                    return Err(TestCaseError::fail(format!(
                        "in flight {flying:?}, booked {booked} after {calls:?}"
                    )));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    });
    rt.block_on(r.stop());
    if let Err(e) = result {
        panic!("{e}");
    }
}
