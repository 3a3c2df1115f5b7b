//! Instances that fail: one answering an error at once is not taken for a fast instance,
//! and a URL that is not one is refused at start, or, given to the library, fails its
//! requests without leaving their bookings open.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use crate::proxy::{find, url_spec};
use kvtier_router::cluster::{Cluster, Keys};
use kvtier_router::launch::{self, EndpointSpec, SpecError, StartError};
use kvtier_router::service::{self, AppState};

/// The recordings, with every request answered by `status` at once and a JSON error (an
/// engine that is overloaded or broken fails fast).
fn failing(ex: &[Exchange], status: u16) -> Vec<Exchange> {
    ex.iter()
        .map(|e| Exchange {
            status,
            content_type: "application/json".into(),
            chunks: vec![r#"{"error":{"message":"unavailable","type":"x"}}"#.into()],
            ..e.clone()
        })
        .collect()
}

fn instance_of(got: &Got) -> usize {
    got.header("x-kvtier-instance")
        .and_then(|v| v.parse().ok())
        .expect("instance header")
}

/// Instance 1 answers every request with a 500 at once (an error of the request's own, not
/// retried elsewhere); instance 0 streams its answers, its first chunk 100 ms late. The 500s
/// are passed through, but they are no first tokens: the
/// broken instance is not learnt as early (which made it draw nearly every request while the
/// healthy one had any prefill pending), nothing is learnt from it, its errors are counted,
/// and after a few in a row it is passed over for a while. The healthy instance serves most
/// requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_answering_errors_at_once_does_not_draw_the_traffic() {
    let ex = recorded();
    let healthy = Upstream::start_slow(ex.clone(), Duration::from_millis(100)).await;
    let broken = Upstream::start(failing(&ex, 500)).await;
    let r = proxy_of(&[&healthy, &broken]).await;
    let streamed = find(&ex, "/v1/completions", true, true);
    let body = Arc::new(streamed.request.as_ref().expect("req").to_string());
    let (clients, each) = (8, 6);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (addr, body) = (r.addr, Arc::clone(&body));
        tasks.spawn(async move {
            let mut got = Vec::new();
            for _ in 0..each {
                got.push(http(addr, "POST", "/v1/completions", Some(body.as_bytes())).await);
            }
            got
        });
    }
    let mut by_instance = [0usize; 2];
    while let Some(got) = tasks.join_next().await {
        for g in got.expect("client") {
            let i = instance_of(&g);
            assert_eq!(g.status, if i == 0 { 200 } else { 500 }, "{g:?}");
            by_instance[i] += 1;
        }
    }
    let c = Arc::clone(&r.cluster);
    until("every booking ended", || {
        c.lock().expect("lock").router().booked() == 0
    })
    .await;
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert!(
        by_instance[0] * 3 >= clients * each * 2,
        "the healthy instance was starved: {by_instance:?} {stats}"
    );
    assert_eq!(
        stats["instances"][1]["upstream_errors"], by_instance[1],
        "{stats}"
    );
    assert_eq!(stats["instances"][0]["upstream_errors"], 0, "{stats}");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_url_that_is_not_a_uri_is_refused_at_start() {
    for bad in [
        "http://127.0.0.1:1/a b",
        "http://",
        "http://127.0.0.1:port",
        "http://[::1",
        "http://127.0.0.1:1/?a=1",
        "https://127.0.0.1:1",
        "http:/127.0.0.1:1",
    ] {
        let got = format!("url={bad}").parse::<EndpointSpec>();
        assert_eq!(got, Err(SpecError::BadUrl(bad.into())), "{bad}");
        // a spec built without parsing is checked at start
        let err = launch::start(config(vec![url_spec(bad.into())], 1 << 10, Keys::Tokens))
            .await
            .err()
            .unwrap_or_else(|| panic!("{bad} started a router"));
        assert!(
            matches!(err, StartError::Spec(SpecError::BadUrl(_))),
            "{err}"
        );
    }
    for good in [
        "http://127.0.0.1:8001",
        "http://localhost:8001/",
        "http://[::1]:8001",
        "http://engine/prefix",
    ] {
        let spec: EndpointSpec = format!("url={good}").parse().expect(good);
        assert_eq!(spec.url.as_deref(), Some(good));
    }
}

/// The library's `AppState` takes its backends' URLs as given: a request routed to one that
/// is not a URI is answered 502 `bad_backend_url`, and its booking does not stay open (it
/// never expired: every later decision counted it in that instance's queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_cannot_be_sent_leaves_no_booking() {
    let cluster = Cluster::new(1, model(), 1 << 10, Keys::Tokens).expect("cluster");
    let cluster = Arc::new(Mutex::new(cluster));
    let st = AppState::new(Arc::clone(&cluster), vec!["http://127.0.0.1:1/a b".into()]);
    let (listener, addr) = service::bind("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(service::serve(listener, st, async {
        let _ = stopped.await;
    }));
    for stream in [true, false] {
        let body = serde_json::json!({"model": "m", "prompt": tokens(1, 2), "stream": stream});
        let got = http(
            addr,
            "POST",
            "/v1/completions",
            Some(body.to_string().as_bytes()),
        )
        .await;
        assert_eq!(got.status, 502);
        assert_eq!(got.json()["error"]["type"], "bad_backend_url", "{got:?}");
    }
    {
        let c = cluster.lock().expect("lock");
        assert_eq!(c.router().booked(), 0, "{}", c.stats());
        assert_eq!(c.in_flight(), [0]);
        assert_eq!(c.router().queue_s(0), 0.0);
    }
    let _ = stop.send(());
    server.await.expect("server").expect("serve");
}

/// An instance answering 502, 503 or 504 has not run the request (it is overloaded, down
/// behind its gateway, or timed out before it): before a byte of that answer reaches the
/// client, the proxy sends the request to the next best instance, and the client sees the
/// healthy instance's answer. Each attempt is counted as that instance's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_answer_is_retried_on_another_instance() {
    let ex = recorded();
    for status in [502u16, 503, 504] {
        let healthy = Upstream::start(ex.clone()).await;
        let broken = Upstream::start(failing(&ex, status)).await;
        let r = proxy_of(&[&broken, &healthy]).await;
        for stream in [true, false] {
            let req = find(&ex, "/v1/completions", stream, true);
            let body = req.request.as_ref().expect("req").to_string();
            for _ in 0..4 {
                let got = http(r.addr, "POST", "/v1/completions", Some(body.as_bytes())).await;
                assert_eq!(got.status, 200, "{status}: {got:?}");
                assert_eq!(instance_of(&got), 1, "{status}: {got:?}");
            }
        }
        let stats = http(r.addr, "GET", "/stats", None).await.json();
        let tried = completions(&broken);
        assert!(tried >= 1, "{status}: the broken instance was never tried");
        assert_eq!(stats["instances"][0]["upstream_errors"], tried, "{stats}");
        assert_eq!(stats["instances"][1]["upstream_errors"], 0, "{stats}");
        assert_eq!(stats["booked"], 0, "{stats}");
        r.stop().await;
    }
}

/// When every instance answers 503, each is tried once and the client gets the last answer
/// as it came (its status, body and instance), not a made-up one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_instance_unavailable_passes_the_last_answer_through() {
    let ex = recorded();
    let a = Upstream::start(failing(&ex, 503)).await;
    let b = Upstream::start(failing(&ex, 503)).await;
    let r = proxy_of(&[&a, &b]).await;
    let req = find(&ex, "/v1/completions", true, true);
    let body = req.request.as_ref().expect("req").to_string();
    let n = 5;
    for _ in 0..n {
        let got = http(r.addr, "POST", "/v1/completions", Some(body.as_bytes())).await;
        assert_eq!(got.status, 503, "{got:?}");
        assert_eq!(got.json()["error"]["message"], "unavailable", "{got:?}");
        assert!(got.header("x-kvtier-instance").is_some(), "{got:?}");
    }
    assert_eq!(
        completions(&a) + completions(&b),
        2 * n,
        "each instance tried once per request"
    );
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["booked"], 0, "{stats}");
    r.stop().await;
}

/// A 500 is the instance's answer to this request (it may fail the same way anywhere), so it
/// is passed through, not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_internal_error_is_not_retried() {
    let ex = recorded();
    let healthy = Upstream::start(ex.clone()).await;
    let broken = Upstream::start(failing(&ex, 500)).await;
    let r = proxy_of(&[&broken, &healthy]).await;
    let req = find(&ex, "/v1/completions", true, true);
    let body = req.request.as_ref().expect("req").to_string();
    let got = http(r.addr, "POST", "/v1/completions", Some(body.as_bytes())).await;
    assert_eq!((got.status, instance_of(&got)), (500, 0), "{got:?}");
    assert_eq!(completions(&healthy), 0);
    r.stop().await;
}

/// An upstream that answers every request with a streamed 200 whose first chunk comes at
/// once and whose connection then drops after `hold` without ending the body: an engine
/// that died mid-answer.
async fn dying_upstream(hold: Duration) -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 65536];
                // the whole request (small) before answering
                let _ = tokio::time::timeout(Duration::from_millis(200), s.read(&mut buf)).await;
                let chunk = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                     transfer-encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n",
                    chunk.len()
                );
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.flush().await;
                tokio::time::sleep(hold).await;
                // dropped: no terminating chunk
            });
        }
    });
    (url, task)
}

/// A streamed 200 whose upstream dies midway is a failed request, not a finished one: its
/// booking is cancelled (nothing learnt: the time to the failure is not a decode time), the
/// instance's error is counted, and the client's answer is cut off (no terminating chunk),
/// so it can tell a failure from an end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_fails_midway_is_an_error_not_an_end() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (url, task) = dying_upstream(Duration::from_millis(300)).await;
    let r = router(vec![url_spec(url)], None, 1 << 20, Keys::Tokens).await;
    let before = http(r.addr, "GET", "/stats", None).await.json();
    let step0 = before["instances"][0]["decode_step_s"]
        .as_f64()
        .expect("decode_step_s");
    let body = serde_json::json!({"model": "m", "prompt": tokens(3, 2), "stream": true,
                                  "max_tokens": 8});
    let body = body.to_string();
    let mut s = tokio::net::TcpStream::connect(r.addr)
        .await
        .expect("connect");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut raw)).await;
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.contains("\"text\":\"a\""),
        "the first chunk reached the client: {text}"
    );
    assert!(
        !text.ends_with("0\r\n\r\n"),
        "the body must not look complete: {text:?}"
    );
    let c = Arc::clone(&r.cluster);
    until("the booking closed", || {
        c.lock().expect("lock").router().booked() == 0
    })
    .await;
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["instances"][0]["upstream_errors"], 1, "{stats}");
    assert_eq!(
        stats["instances"][0]["decode_step_s"].as_f64(),
        Some(step0),
        "a failure learnt as a decode: {stats}"
    );
    task.abort();
    r.stop().await;
}

/// Every answer of the router's own is the API's JSON error, also for a path it does not
/// serve (404), a method a path does not take (405) and a body over the limit (413).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_own_errors_are_json() {
    let ex = recorded();
    let up = Upstream::start(ex.clone()).await;
    let r = proxy_of(&[&up]).await;
    for (method, path, status) in [
        ("GET", "/nope", 404),
        ("POST", "/v1/nope", 404),
        ("GET", "/route", 405),
        ("DELETE", "/stats", 405),
        ("GET", "/v1/completions", 405),
    ] {
        let got = http(r.addr, method, path, None).await;
        assert_eq!(got.status, status, "{method} {path}: {got:?}");
        assert!(
            got.header("content-type")
                .is_some_and(|c| c.starts_with("application/json")),
            "{method} {path}: {got:?}"
        );
        assert!(got.json()["error"]["message"].is_string(), "{got:?}");
    }
    for path in ["/route", "/v1/completions", "/v1/chat/completions"] {
        let got = claims_too_much(r.addr, path).await;
        assert_eq!(got.status, 413, "{path}: {got:?}");
        assert_eq!(
            got.json()["error"]["type"],
            "request_too_large",
            "{path}: {got:?}"
        );
    }
    assert_eq!(completions(&up), 0);
    r.stop().await;
}

/// A POST of one byte over the router's body limit.
async fn claims_too_much(addr: std::net::SocketAddr, path: &str) -> Got {
    let body = vec![b' '; kvtier_router::service::MAX_BODY + 1];
    http(addr, "POST", path, Some(&body)).await
}

/// The completions an upstream was sent (the proxy also reads `/v1/models`).
fn completions(u: &Upstream) -> usize {
    let r = u.requests.lock().expect("lock");
    r.iter().filter(|p| p.as_str() == "/v1/completions").count()
}

/// A router proxying to `upstreams` (instance `i` is `upstreams[i]`), keyed by tokens.
async fn proxy_of(upstreams: &[&Upstream]) -> launch::Running {
    let urls = upstreams.iter().map(|u| url_spec(u.url())).collect();
    router(urls, None, 1 << 20, Keys::Tokens).await
}
