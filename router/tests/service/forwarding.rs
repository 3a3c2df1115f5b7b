//! What of a client's request reaches the instance: every end-to-end header as sent (the
//! request id vLLM names its completion by, its data-parallel rank, tracing, the user agent,
//! CORS's origin), the query string, and none of the hop-by-hop headers of the client's
//! connection.

use std::time::Duration;

use crate::common::*;
use crate::proxy::url_spec;
use kvtier_router::cluster::Keys;

/// Headers of the client's connection only (RFC 9110 §7.6.1), which a proxy must not
/// forward, with `x-hop`, which the client's `Connection` names.
const HOP: [(&str, &str); 7] = [
    ("Connection", "close, X-Hop"),
    ("X-Hop", "1"),
    ("Keep-Alive", "timeout=5"),
    ("TE", "trailers"),
    ("Trailer", "x-sum"),
    ("Proxy-Authorization", "Basic dXNlcjpwYXNz"),
    ("Upgrade", "h2c"),
];

/// End-to-end headers, each of which the instance must see as sent.
const END_TO_END: [(&str, &str); 11] = [
    ("Content-Type", "application/json"),
    ("Authorization", "Bearer sk-test"),
    ("Accept", "text/event-stream"),
    ("X-Request-Id", "my-trace-42"),
    ("X-data-parallel-rank", "0"),
    ("X-Session-Id", "s-7"),
    (
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    ),
    ("tracestate", "congo=t61rcWkgMzE"),
    ("User-Agent", "OpenAI/Python 1.99.0"),
    ("Origin", "https://app.example"),
    ("Accept-Language", "de"),
];

fn assert_forwarded(got: &Seen, upstream: &Fake, target: &str, body_len: usize) {
    assert_eq!(got.target, target, "{got:?}");
    for (k, v) in END_TO_END {
        assert_eq!(got.values(&k.to_ascii_lowercase()), [v], "{k}: {got:?}");
    }
    assert_eq!(
        got.values("x-multi"),
        ["a", "b"],
        "a repeated header, in order"
    );
    for (k, _) in HOP {
        let k = k.to_ascii_lowercase();
        // hyper's client may say how it keeps its own connection; never the client's words
        let vals = got.values(&k);
        if k == "connection" {
            assert!(
                vals.iter()
                    .all(|v| !v.to_ascii_lowercase().contains("x-hop")),
                "{got:?}"
            );
        } else {
            assert!(vals.is_empty(), "{k} forwarded: {got:?}");
        }
    }
    assert_eq!(
        got.values("host"),
        [upstream.addr.to_string().as_str()],
        "the instance's own host: {got:?}"
    );
    let length = got.values("content-length");
    // the request's own length (a GET without a body may leave it out), not the client's
    assert!(
        length == [body_len.to_string().as_str()] || (body_len == 0 && length.is_empty()),
        "{got:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_end_to_end_header_and_the_query_reach_the_instance() {
    let up = Fake::start(
        |s| {
            if s.target.starts_with("/v1/models") {
                Reply::Json(200, r#"{"object":"list","data":[{"id":"m"}]}"#.into())
            } else {
                Reply::Json(200, ok_json())
            }
        },
        None,
    )
    .await;
    let r = router(vec![url_spec(up.url())], None, 1 << 20, Keys::Tokens).await;
    let mut headers: Vec<(&str, &str)> = vec![("Host", "router.example")];
    headers.extend(END_TO_END);
    headers.extend(HOP);
    headers.extend([("X-Multi", "a"), ("X-Multi", "b")]);
    let wait = Duration::from_secs(10);
    for (path, body) in [
        (
            "/v1/completions",
            serde_json::json!({"model": "m", "prompt": tokens(1, 1), "max_tokens": 2}),
        ),
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ),
    ] {
        let body = body.to_string();
        let target = format!("{path}?api-version=2024-10-21&x=1%202");
        let got = http_with(r.addr, "POST", &target, &headers, body.as_bytes(), wait)
            .await
            .expect("answered");
        assert_eq!(got.status, 200, "{got:?}");
        let seen = up.seen();
        let sent = seen
            .iter()
            .rev()
            .find(|s| s.target.starts_with(path))
            .expect("the request reached the instance");
        assert_forwarded(sent, &up, &target, body.len());
        assert_eq!(sent.body, body.as_bytes());
    }
    let got = http_with(r.addr, "GET", "/v1/models?x=1", &headers, b"", wait)
        .await
        .expect("answered");
    assert_eq!(got.status, 200, "{got:?}");
    let seen = up.seen();
    let sent = seen.last().expect("models asked");
    assert_forwarded(sent, &up, "/v1/models?x=1", 0);
    r.stop().await;
}
