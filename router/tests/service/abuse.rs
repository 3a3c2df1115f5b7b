//! The proxy used as a production client and an attacker use it: clients that go away
//! mid-answer, OpenAI request bodies of every allowed shape, malformed and odd HTTP.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::*;
use crate::proxy::url_spec;
use kvtier_router::cluster::Keys;
use kvtier_router::launch::{self, Config, EndpointSpec, Running};

async fn proxy(urls: Vec<String>) -> Running {
    let specs: Vec<EndpointSpec> = urls.into_iter().map(url_spec).collect();
    launch::start(Config {
        ..config(specs, 1 << 20, Keys::Tokens)
    })
    .await
    .expect("start router")
}

/// An engine that answers every request with a streamed 200 whose chunks come `every`
/// apart for ever (silent after its head when `every` is `None`), and counts the
/// connections whose peer went away (read 0, or a write failed).
struct Drip {
    addr: std::net::SocketAddr,
    requests: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drip {
    async fn start(every: Option<Duration>, head: bool) -> Drip {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let requests = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (rq, cl) = (Arc::clone(&requests), Arc::clone(&closed));
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (rq, cl) = (Arc::clone(&rq), Arc::clone(&cl));
                tokio::spawn(async move {
                    let (mut r, mut w) = s.into_split();
                    let Some((request, _)) = read_request(&mut r).await else {
                        return;
                    };
                    if request.starts_with("GET /v1/models") {
                        let b = r#"{"object":"list","data":[{"id":"m"}]}"#;
                        let a = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                             content-length: {}\r\nconnection: close\r\n\r\n{b}",
                            b.len()
                        );
                        let _ = w.write_all(a.as_bytes()).await;
                        return;
                    }
                    rq.fetch_add(1, Ordering::SeqCst);
                    let gone = Arc::new(tokio::sync::Notify::new());
                    let g = Arc::clone(&gone);
                    let reader = tokio::spawn(async move {
                        let mut b = [0u8; 1024];
                        while let Ok(n) = r.read(&mut b).await {
                            if n == 0 {
                                break;
                            }
                        }
                        g.notify_one();
                    });
                    let writer = async {
                        if head {
                            let h = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                                     transfer-encoding: chunked\r\n\r\n";
                            if w.write_all(h.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        let Some(every) = every.filter(|_| head) else {
                            std::future::pending::<()>().await;
                            return;
                        };
                        let chunk = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
                        loop {
                            let c = format!("{:x}\r\n{chunk}\r\n", chunk.len());
                            if w.write_all(c.as_bytes()).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(every).await;
                        }
                    };
                    tokio::select! {
                        () = writer => {}
                        () = gone.notified() => {}
                    }
                    reader.abort();
                    cl.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        Drip {
            addr,
            requests,
            closed,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Drip {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn body(seed: u32, stream: bool) -> String {
    serde_json::json!({"model": "m", "prompt": tokens(seed, 2), "max_tokens": 1000,
                       "stream": stream})
    .to_string()
}

/// Sends a request and returns the connection once `want` bytes of its answer came.
async fn send_and_read(
    addr: std::net::SocketAddr,
    body: &str,
    want: usize,
) -> (tokio::net::TcpStream, Vec<u8>) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let mut b = [0u8; 4096];
    while got.len() < want {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b))
            .await
            .expect("answer in time")
            .expect("read");
        if n == 0 {
            break;
        }
        got.extend_from_slice(&b[..n]);
    }
    (s, got)
}

async fn released(r: &Running, what: &str) {
    let c = Arc::clone(&r.cluster);
    until(what, move || {
        let c = c.lock().expect("lock");
        c.in_flight().iter().all(|&n| n == 0) && c.router().booked() == 0
    })
    .await;
}

/// A client that goes away mid-stream (its connection closed): the engine's connection is
/// closed too (vLLM and SGLang abort a request whose client went away), and the request's
/// in-flight count and booking are released, whether the engine is sending chunks or is
/// silent after its head (a long prefill in its queue), and for an answer sent whole whose
/// client leaves before it comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_stream_cancels_the_engines_request_and_its_booking() {
    let up = Drip::start(Some(Duration::from_millis(50)), true).await;
    let r = proxy(vec![up.url()]).await;
    let (s, got) = send_and_read(r.addr, &body(1, true), 80).await;
    assert!(got.starts_with(b"HTTP/1.1 200"), "{got:?}");
    drop(s);
    let closed = Arc::clone(&up.closed);
    until("the engine's connection closed", || {
        closed.load(Ordering::SeqCst) == 1
    })
    .await;
    released(&r, "released").await;
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_the_engine_is_silent_cancels_it_too() {
    let up = Drip::start(None, true).await;
    let r = proxy(vec![up.url()]).await;
    let (s, got) = send_and_read(r.addr, &body(1, true), 20).await;
    assert!(got.starts_with(b"HTTP/1.1 200"), "{got:?}");
    drop(s);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let closed = Arc::clone(&up.closed);
    until("the engine's connection closed", || {
        closed.load(Ordering::SeqCst) == 1
    })
    .await;
    released(&r, "released").await;
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_before_a_whole_answer_cancels_it_too() {
    let up = Drip::start(None, false).await;
    let r = proxy(vec![up.url()]).await;
    let mut s = tokio::net::TcpStream::connect(r.addr).await.expect("c");
    let b = body(1, false);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{b}",
        b.len()
    );
    s.write_all(head.as_bytes()).await.expect("write");
    let rq = Arc::clone(&up.requests);
    until("the engine got it", || rq.load(Ordering::SeqCst) == 1).await;
    drop(s);
    let closed = Arc::clone(&up.closed);
    until("the engine's connection closed", || {
        closed.load(Ordering::SeqCst) == 1
    })
    .await;
    released(&r, "released").await;
    r.stop().await;
}

const JSON: (&str, &str) = ("Content-Type", "application/json");

/// Every request body shape the OpenAI API allows (a batch of prompts, token-id lists, chat
/// content parts with an image, tool calls, `null` content, `n`, `stream_options`, unknown
/// fields), and bodies it does not (wrong types, not JSON, not UTF-8, cut off), reach the
/// instance byte for byte, and the engine's answer the client: what the router cannot read
/// routes by load, it never fails the request. Bookings all return to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_body_shape_reaches_the_instance_as_sent() {
    let up = healthy().await;
    let r = proxy(vec![up.url()]).await;
    let bodies = [
        (
            "/v1/completions",
            serde_json::json!({"model": "m", "prompt": ["a b", "c d"]}),
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": "m", "prompt": [[1, 2, 3], [4, 5]]}),
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": "m", "prompt": []}),
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": "m", "prompt": [[]]}),
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": "m", "prompt": ""}),
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": "m", "prompt": [-1, 5000000000u64]}),
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": "m", "prompt": "x", "n": 3, "stream": true, "stream_options": {"include_usage": true}, "unknown_field": {"a": [1]}}),
        ),
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}],
            "max_completion_tokens": 5, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
        ),
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "m", "messages": "not a list"}),
        ),
        ("/v1/chat/completions", serde_json::json!([1, 2])),
        ("/v1/chat/completions", serde_json::json!(null)),
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "m", "messages": [], "max_tokens": 1e300, "n": -1}),
        ),
    ];
    for (path, b) in bodies {
        let b = b.to_string();
        let got = http_with(
            r.addr,
            "POST",
            path,
            &[JSON],
            b.as_bytes(),
            Duration::from_secs(10),
        )
        .await
        .expect("answer");
        assert_eq!(got.status, 200, "{path} {b}: {got:?}");
        let seen = up.seen();
        let last = seen
            .iter()
            .rev()
            .find(|s| s.target == path)
            .expect("forwarded");
        assert_eq!(last.body, b.as_bytes(), "{b}");
    }
    for raw in [&b"{not json"[..], b"", b"\xff\xfe", b"{\"prompt\": \"x\""] {
        let got = http_with(
            r.addr,
            "POST",
            "/v1/completions",
            &[JSON],
            raw,
            Duration::from_secs(10),
        )
        .await
        .expect("answer");
        assert_eq!(got.status, 200, "{raw:?}: {got:?}");
    }
    released(&r, "released").await;
    r.stop().await;
}

/// HTTP as clients speak it: HTTP/1.0 (a streamed answer ends with the connection),
/// `Expect: 100-continue` (answered, not forwarded), a chunked upload with a query, and a
/// kept-alive connection that goes on after the router's 404, 405 and 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_1_0_expect_continue_chunked_uploads_and_keep_alive_after_errors() {
    let up = healthy().await;
    let r = proxy(vec![up.url()]).await;
    let b = body(1, true);
    // HTTP/1.0, streamed
    let mut s = tokio::net::TcpStream::connect(r.addr).await.expect("c");
    let head = format!(
        "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    );
    s.write_all(head.as_bytes()).await.expect("w");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut raw))
        .await
        .expect("1.0 ends")
        .expect("read");
    let t = String::from_utf8_lossy(&raw);
    assert!(
        t.starts_with("HTTP/1.0 200") || t.starts_with("HTTP/1.1 200"),
        "{t}"
    );
    assert!(t.contains("[DONE]") && !t.contains("\r\n0\r\n"), "{t}");
    // Expect: 100-continue
    let mut s = tokio::net::TcpStream::connect(r.addr).await.expect("c");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: 100-continue\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        b.len()
    );
    s.write_all(head.as_bytes()).await.expect("w");
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("100 in time")
        .expect("r");
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 100"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    s.write_all(b.as_bytes()).await.expect("w");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut raw))
        .await
        .expect("ends")
        .expect("read");
    let t = String::from_utf8_lossy(&raw);
    assert!(t.contains("HTTP/1.1 200") && t.contains("[DONE]"), "{t}");
    assert!(up.seen().iter().all(|s| s.values("expect").is_empty()));
    // chunked upload
    let mut s = tokio::net::TcpStream::connect(r.addr).await.expect("c");
    let head = format!(
        "POST /v1/completions?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
        b.len()
    );
    s.write_all(head.as_bytes()).await.expect("w");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut raw))
        .await
        .expect("ends")
        .expect("read");
    let t = String::from_utf8_lossy(&raw);
    assert!(t.contains("HTTP/1.1 200") && t.contains("[DONE]"), "{t}");
    let last = up.seen().last().cloned().expect("seen");
    assert_eq!(last.body, b.as_bytes());
    assert_eq!(last.target, "/v1/completions?x=1");
    // keep-alive across errors: 404, 405, invalid, then a good one
    let mut s = tokio::net::TcpStream::connect(r.addr).await.expect("c");
    let mut all = String::new();
    for (m, p, body) in [
        ("GET", "/nope", ""),
        ("GET", "/v1/completions", ""),
        ("POST", "/route", "{bad"),
        ("POST", "/v1/completions", b.as_str()),
    ] {
        all.push_str(&format!("{m} {p} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()));
    }
    all.push_str("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(all.as_bytes()).await.expect("w");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut raw))
        .await
        .expect("ends")
        .expect("read");
    let t = String::from_utf8_lossy(&raw);
    for st in ["404", "405", "400", "200 OK"] {
        assert!(t.contains(&format!("HTTP/1.1 {st}")), "{st}: {t}");
    }
    assert_eq!(t.matches("HTTP/1.1 ").count(), 5, "{t}");
    released(&r, "released").await;
    r.stop().await;
}

/// `/v1/models` through the proxy while one instance is starting (a gateway in front of it
/// answers 503, as it does before vLLM listens) and the other is up: the client gets the
/// listing of the one that is up, as a completion would be sent there. Before, the first
/// instance asked answered for all, 503 and all. With every instance unavailable, the last
/// such answer is the client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_listed_by_an_instance_that_is_up_beside_one_that_is_not() {
    for status in [502, 503, 504] {
        let starting = Fake::start(
            move |_| Reply::Json(status, r#"{"error":"starting"}"#.into()),
            None,
        )
        .await;
        let up = healthy().await;
        let r = proxy(vec![starting.url(), up.url()]).await;
        let got = http_with(
            r.addr,
            "GET",
            "/v1/models",
            &[],
            b"",
            Duration::from_secs(6),
        )
        .await
        .expect("answered");
        assert_eq!(got.status, 200, "{status}: {got:?}");
        assert_eq!(got.header("x-kvtier-instance"), Some("1"), "{got:?}");
        assert_eq!(got.json()["data"][0]["id"], "m");
        assert_eq!(starting.count("/v1/models"), 1, "asked first");
        r.stop().await;
        let r = proxy(vec![starting.url(), starting.url()]).await;
        let got = http_with(
            r.addr,
            "GET",
            "/v1/models",
            &[],
            b"",
            Duration::from_secs(6),
        )
        .await
        .expect("answered");
        assert_eq!(got.status, status, "none up: the last answer: {got:?}");
        assert_eq!(got.header("x-kvtier-instance"), Some("1"), "{got:?}");
        r.stop().await;
    }
}

/// Whether the router closes `s` within `wait` (reads to its end, whatever it says).
async fn closed_within(s: &mut tokio::net::TcpStream, wait: Duration) -> bool {
    let mut b = [0u8; 4096];
    let t = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(t, s.read(&mut b)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// A client that opens connections and never finishes a request's head (slowloris), or
/// keeps a connection idle after its answer, holds it only for the header timeout: before,
/// for ever, and enough of them took every file descriptor the router had, failing every
/// other client. A request whose head came in time is not cut short however long its
/// answer takes (an engine's whole answer takes minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_never_finished_or_an_idle_connection_is_closed() {
    let slow = Fake::start(
        |s| {
            if !s.target.starts_with("/v1/completions") {
                return Reply::Json(200, r#"{"object":"list","data":[{"id":"m"}]}"#.into());
            }
            std::thread::sleep(Duration::from_millis(1500));
            Reply::Json(200, ok_json())
        },
        None,
    )
    .await;
    let specs = vec![url_spec(slow.url())];
    let r = launch::start(Config {
        header_timeout_s: 0.5,
        ..config(specs, 1 << 20, Keys::Tokens)
    })
    .await
    .expect("start router");
    // half a head
    let mut half = tokio::net::TcpStream::connect(r.addr).await.expect("c");
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("w");
    // nothing at all
    let mut mute = tokio::net::TcpStream::connect(r.addr).await.expect("c");
    // an answer, then idle on a kept connection
    let mut idle = tokio::net::TcpStream::connect(r.addr).await.expect("c");
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("w");
    let b = body(1, false);
    let t = std::time::Instant::now();
    let got = http_with(
        r.addr,
        "POST",
        "/v1/completions",
        &[JSON],
        b.as_bytes(),
        Duration::from_secs(10),
    )
    .await
    .expect("a slow whole answer");
    assert_eq!(got.status, 200, "{got:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(1400),
        "{:?}",
        t.elapsed()
    );
    for (name, s) in [
        ("half", &mut half),
        ("mute", &mut mute),
        ("idle", &mut idle),
    ] {
        assert!(
            closed_within(s, Duration::from_secs(3)).await,
            "{name} held"
        );
    }
    r.stop().await;
}

/// A client whose request head came but whose body stops (a slowloris past the head) is
/// answered 408 and its connection closed once no byte of the body came within the header
/// timeout, the instance never asked; a body that comes slowly but steadily is read whole.
/// Before, the router waited for the rest of the body for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_that_stops_coming_is_a_408() {
    let up = healthy().await;
    let specs = vec![url_spec(up.url())];
    let r = launch::start(Config {
        header_timeout_s: 0.5,
        ..config(specs, 1 << 20, Keys::Tokens)
    })
    .await
    .expect("start router");
    let b = body(1, false);
    for path in ["/v1/completions", "/v1/chat/completions", "/route"] {
        let mut s = tokio::net::TcpStream::connect(r.addr).await.expect("c");
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{}",
            b.len(),
            &b[..10]
        );
        s.write_all(head.as_bytes()).await.expect("w");
        let mut raw = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut raw)).await;
        assert!(read.is_ok(), "{path}: held");
        let got = parse_response(&raw);
        assert_eq!(got.status, 408, "{path}: {got:?}");
        assert_eq!(got.json()["error"]["type"], "request_timeout", "{got:?}");
    }
    assert_eq!(
        up.count("/v1/completions") + up.count("/v1/chat/completions"),
        0
    );
    // steady: a piece every 200 ms, 1.2 s in all
    let mut s = tokio::net::TcpStream::connect(r.addr).await.expect("c");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        b.len()
    );
    s.write_all(head.as_bytes()).await.expect("w");
    for piece in b.as_bytes().chunks(b.len().div_ceil(6)) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        s.write_all(piece).await.expect("w");
    }
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut raw))
        .await
        .expect("answered")
        .expect("read");
    assert_eq!(parse_response(&raw).status, 200);
    assert_eq!(up.seen().last().expect("seen").body, b.as_bytes());
    released(&r, "released").await;
    r.stop().await;
}

/// A streamed answer longer than the header timeout goes on to its end: the timeout counts
/// only while the router waits for a request's head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_header_timeout_is_not_cut() {
    let up = Drip::start(Some(Duration::from_millis(50)), true).await;
    let specs = vec![url_spec(up.url())];
    let r = launch::start(Config {
        header_timeout_s: 0.3,
        ..config(specs, 1 << 20, Keys::Tokens)
    })
    .await
    .expect("start router");
    let (mut s, mut got) = send_and_read(r.addr, &body(1, true), 20).await;
    let until = tokio::time::Instant::now() + Duration::from_millis(1200);
    let mut b = [0u8; 4096];
    while tokio::time::Instant::now() < until {
        let n = tokio::time::timeout(Duration::from_millis(500), s.read(&mut b))
            .await
            .expect("chunks keep coming")
            .expect("read");
        assert!(n > 0, "cut after {} bytes", got.len());
        got.extend_from_slice(&b[..n]);
    }
    assert!(String::from_utf8_lossy(&got).matches("data:").count() >= 15);
    drop(s);
    released(&r, "released").await;
    r.stop().await;
}

/// vLLM's `/tokenize` and `/detokenize`, which clients call to count a prompt's tokens
/// before they send it, reach an instance through the proxy as `/v1/models` does (any
/// instance serves the same model: the first up answers), body and headers as sent. Before,
/// the router answered 404 and a client pointed at it lost them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_reach_an_instance_that_is_up() {
    let up = healthy().await;
    let down = format!("http://127.0.0.1:{}", closed_port());
    let r = proxy(vec![down, up.url()]).await;
    for path in ["/tokenize", "/detokenize"] {
        let b = r#"{"model":"m","prompt":"hello","tokens":[1,2]}"#;
        let got = http_with(
            r.addr,
            "POST",
            &format!("{path}?q=1"),
            &[JSON, ("Authorization", "Bearer k")],
            b.as_bytes(),
            Duration::from_secs(6),
        )
        .await
        .expect("answered");
        assert_eq!(got.status, 200, "{path}: {got:?}");
        assert_eq!(got.header("x-kvtier-instance"), Some("1"), "{got:?}");
        let seen = up.seen();
        let last = seen.last().expect("seen");
        assert_eq!(
            (last.target.as_str(), last.body.as_slice()),
            (format!("{path}?q=1").as_str(), b.as_bytes())
        );
        assert_eq!(last.values("authorization"), ["Bearer k"]);
    }
    r.stop().await;
}

/// A streamed answer whose first event is an error (`data: {"error": ...}` after a 200
/// head: what vLLM 0.32's completion stream generator yields for a request failing in it)
/// is no first token and no decode: its booking is cancelled and nothing is
/// learnt. Before, the error event was taken as the first token at once and the end as a
/// decode, so an instance refusing requests looked fast and drew the traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_error_event_is_not_a_first_token() {
    let up = Fake::start(
        |_| {
            Reply::Sse(vec![
                "data: {\"error\": {\"object\": \"error\", \"message\": \"too long\", \
                 \"type\": \"BadRequestError\", \"code\": 400}}\n\n"
                    .into(),
                "data: [DONE]\n\n".into(),
            ])
        },
        None,
    )
    .await;
    let r = proxy(vec![up.url()]).await;
    let before = http(r.addr, "GET", "/stats", None).await.json();
    for seed in 0..4 {
        let b = body(seed, true);
        let got = http_with(
            r.addr,
            "POST",
            "/v1/completions",
            &[JSON],
            b.as_bytes(),
            Duration::from_secs(5),
        )
        .await
        .expect("answered");
        assert_eq!(got.status, 200, "passed through as it came: {got:?}");
        assert!(String::from_utf8_lossy(&got.body()).contains("too long"));
    }
    released(&r, "released").await;
    let after = http(r.addr, "GET", "/stats", None).await.json();
    for k in ["late_s", "decode_step_s"] {
        assert_eq!(
            after["instances"][0][k], before["instances"][0][k],
            "{k} learnt from errors: {after}"
        );
    }
    r.stop().await;
}

/// An error event after the first token (a request failing midway: vLLM's and SGLang's
/// stream generators yield `data: {"error": ...}` and `[DONE]`) ends no decode: the stream's
/// end is not learnt as a decode step. Before, only an error in place of the first token was
/// told apart, and a failing instance's errors were learnt as decodes of 3e-8 s a step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_event_after_the_first_token_is_no_decode() {
    let up = Fake::start(
        |_| {
            Reply::Sse(vec![
                "data: {\"choices\":[{\"text\":\"a\"}]}\n\n".into(),
                "data: {\"error\": {\"object\": \"error\", \"message\": \"engine died\", \
                 \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\n"
                    .into(),
                "data: [DONE]\n\n".into(),
            ])
        },
        None,
    )
    .await;
    let r = proxy(vec![up.url()]).await;
    let before = http(r.addr, "GET", "/stats", None).await.json();
    for seed in 0..4 {
        let b = body(seed, true);
        let got = http_with(
            r.addr,
            "POST",
            "/v1/completions",
            &[JSON],
            b.as_bytes(),
            Duration::from_secs(5),
        )
        .await
        .expect("answered");
        assert_eq!(got.status, 200, "passed through as it came: {got:?}");
        assert!(String::from_utf8_lossy(&got.body()).contains("engine died"));
    }
    released(&r, "released").await;
    let after = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(
        after["instances"][0]["decode_step_s"], before["instances"][0]["decode_step_s"],
        "a decode learnt from failed streams: {after}"
    );
    r.stop().await;
}

/// `GET /readiness` says whether traffic may be sent to the router: 200 while any instance
/// answers its own `/health` (a 503 there, one that hangs or a closed port do not count),
/// 503 once none does; `/health` stays the router's own
/// liveness (200 throughout). Before, `/readiness` was a 404 and `/health` the only answer,
/// so a router whose every instance was down stayed in a load balancer's rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_instances_health_and_health_the_router() {
    let starting = Fake::start(
        |s| {
            if s.target.starts_with("/health") {
                Reply::Json(503, r#"{"error":"loading"}"#.into())
            } else {
                Reply::Json(200, ok_json())
            }
        },
        None,
    )
    .await;
    let hung = Fake::start(|_| Reply::Hang, None).await;
    let mut up = Some(healthy().await);
    let down = format!("http://127.0.0.1:{}", closed_port());
    let up_url = up.as_ref().map(Fake::url).unwrap_or_default();
    let r = proxy(vec![down, starting.url(), hung.url(), up_url]).await;
    let ask = |path: &'static str| async move { http(r.addr, "GET", path, None).await };
    let ready = ask("/readiness").await;
    assert_eq!(ready.status, 200, "{ready:?}");
    assert_eq!(
        ready.json()["instances_up"],
        serde_json::json!([3]),
        "{ready:?}"
    );
    assert_eq!(ready.json()["instances"], 4);
    up.take(); // the healthy instance goes
    let ready = ask("/readiness").await;
    assert_eq!(ready.status, 503, "{ready:?}");
    assert_eq!(ready.json()["instances_up"], serde_json::json!([]));
    assert_eq!(
        ask("/health").await.status,
        200,
        "the router itself is alive"
    );
    r.stop().await;
}

/// A batch of prompts (`"prompt": [[ids], [ids], ...]`, or a list of texts) runs every
/// prompt on the instance it is sent to, so its booking holds every prompt's tokens and
/// output: the instance's queue grows by about the batch's size. Before, the booking held the
/// first prompt alone, and batches piled onto an instance the router took for idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_prompts_is_booked_whole() {
    let up = Fake::start(|_| Reply::Hang, None).await;
    let r = proxy(vec![up.url()]).await;
    let queue = || async {
        http(r.addr, "GET", "/stats", None).await.json()["instances"][0]["queue_s"]
            .as_f64()
            .unwrap_or(0.0)
    };
    let send = |b: String| {
        let addr = r.addr;
        tokio::spawn(async move {
            http_with(
                addr,
                "POST",
                "/v1/completions",
                &[JSON],
                b.as_bytes(),
                Duration::from_secs(30),
            )
            .await
        })
    };
    let one = send(
        serde_json::json!({"model": "m", "prompt": tokens(1, 8), "max_tokens": 1}).to_string(),
    );
    let mut q1 = 0.0;
    for _ in 0..100 {
        q1 = queue().await;
        if q1 > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(q1 > 0.0, "the single prompt is queued");
    let batch: Vec<Vec<u32>> = (10..26).map(|s| tokens(s, 8)).collect();
    let many =
        send(serde_json::json!({"model": "m", "prompt": batch, "max_tokens": 1}).to_string());
    let mut q2 = q1;
    for _ in 0..100 {
        q2 = queue().await;
        if q2 > q1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        q2 - q1 > 8.0 * q1,
        "a batch of 16 prompts queued as {:.4} s, one prompt {q1:.4} s",
        q2 - q1
    );
    one.abort();
    many.abort();
    r.stop().await;
}

/// Token ids written as whole floats (`[1.0, 2.0]`: vLLM's `list[int]` prompt reads them in
/// pydantic's lax mode) route by the cache like integers; a list of strings is a batch of
/// texts to vLLM (its `list[str]`), not ids. Before, a float id made the prompt unreadable and
/// the request was routed by load alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_float_token_ids_route_by_the_cache() {
    let up = healthy().await;
    let r = proxy(vec![up.url()]).await;
    let ids: Vec<f64> = tokens(3, 2).into_iter().map(f64::from).collect();
    let b = serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 1}).to_string();
    let got = http_with(
        r.addr,
        "POST",
        "/v1/completions",
        &[JSON],
        b.as_bytes(),
        Duration::from_secs(5),
    )
    .await
    .expect("answered");
    assert_eq!(got.status, 200, "{got:?}");
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["routed_load_only"], 0, "{stats}");
    r.stop().await;
}

/// `GET /metrics` is `/stats` in Prometheus' text format (what a scrape of vLLM's and
/// SGLang's `/metrics` beside it expects): each line a `# HELP`/`# TYPE` comment or a sample
/// `name{labels} value`, the per-instance figures labelled by instance and equal to
/// `/stats`'. Before, the scrape got the router's JSON 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_the_stats_in_prometheus_text() {
    let up = healthy().await;
    let down = format!("http://127.0.0.1:{}", closed_port());
    let r = proxy(vec![up.url(), down]).await;
    for seed in 0..3 {
        let b = body(seed, false);
        let got = http_with(
            r.addr,
            "POST",
            "/v1/completions",
            &[JSON],
            b.as_bytes(),
            Duration::from_secs(5),
        )
        .await
        .expect("answered");
        assert_eq!(got.status, 200, "{got:?}");
    }
    released(&r, "released").await;
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    let got = http(r.addr, "GET", "/metrics", None).await;
    assert_eq!(got.status, 200, "{got:?}");
    assert!(
        got.header("content-type")
            .is_some_and(|t| t.starts_with("text/plain")),
        "{got:?}"
    );
    let text = String::from_utf8(got.body()).expect("utf-8");
    let mut samples = std::collections::HashMap::new();
    for line in text.lines() {
        if line.starts_with("# HELP ") || line.starts_with("# TYPE ") {
            continue;
        }
        let (name, value) = line.rsplit_once(' ').expect("a sample: name value");
        let v: f64 = value.parse().expect("a number");
        assert!(!name.contains(' '), "{line}");
        samples.insert(name.to_string(), v);
    }
    for (i, inst) in stats["instances"]
        .as_array()
        .expect("instances")
        .iter()
        .enumerate()
    {
        for (metric, key) in [
            ("kvtier_router_routed_total", "routed"),
            ("kvtier_router_in_flight", "in_flight"),
            ("kvtier_router_upstream_errors_total", "upstream_errors"),
        ] {
            assert_eq!(
                samples
                    .get(&format!("{metric}{{instance=\"{i}\"}}"))
                    .copied(),
                inst[key].as_f64(),
                "{metric} of instance {i}: {text}"
            );
        }
    }
    assert_eq!(
        samples.get("kvtier_router_routed_total{instance=\"0\"}"),
        Some(&3.0),
        "{text}"
    );
    assert!(
        text.contains("# TYPE kvtier_router_routed_total counter"),
        "{text}"
    );
    assert_eq!(
        samples.get("kvtier_router_memory_bytes").copied(),
        stats["memory_bytes"].as_f64()
    );
    r.stop().await;
}
