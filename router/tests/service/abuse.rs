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

pub(crate) async fn proxy(urls: Vec<String>) -> Running {
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

pub(crate) fn body(seed: u32, stream: bool) -> String {
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

pub(crate) async fn released(r: &Running, what: &str) {
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
    client_gone_mid_stream(Some(Duration::from_millis(50)), 80, Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_the_engine_is_silent_cancels_it_too() {
    client_gone_mid_stream(None, 20, Duration::from_secs(1)).await;
}

/// A client reads `want` bytes of a streamed answer from an engine sending a chunk every
/// `every` (silent after its head when `None`) and goes away; after `settle`, the engine's
/// connection closes and the request is released.
async fn client_gone_mid_stream(every: Option<Duration>, want: usize, settle: Duration) {
    let up = Drip::start(every, true).await;
    let r = proxy(vec![up.url()]).await;
    let (s, got) = send_and_read(r.addr, &body(1, true), want).await;
    assert!(got.starts_with(b"HTTP/1.1 200"), "{got:?}");
    drop(s);
    tokio::time::sleep(settle).await;
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

pub(crate) const JSON: (&str, &str) = ("Content-Type", "application/json");

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
    let got = complete(r.addr, &b, Duration::from_secs(10)).await;
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
