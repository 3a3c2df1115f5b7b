//! The router's own endpoints beside the proxied completions: `/v1/models`, `/tokenize` and
//! `/detokenize` answered by an instance that is up, `/readiness` from the instances'
//! health, `/metrics` in Prometheus' text format.

use std::time::Duration;

use crate::abuse::{JSON, body, proxy, released};
use crate::common::*;

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
        let got = get_within(r.addr, "/v1/models", Duration::from_secs(6)).await;
        assert_eq!(got.status, 200, "{status}: {got:?}");
        assert_eq!(got.header("x-kvtier-instance"), Some("1"), "{got:?}");
        assert_eq!(got.json()["data"][0]["id"], "m");
        assert_eq!(starting.count("/v1/models"), 1, "asked first");
        r.stop().await;
        let r = proxy(vec![starting.url(), starting.url()]).await;
        let got = get_within(r.addr, "/v1/models", Duration::from_secs(6)).await;
        assert_eq!(got.status, status, "none up: the last answer: {got:?}");
        assert_eq!(got.header("x-kvtier-instance"), Some("1"), "{got:?}");
        r.stop().await;
    }
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
        let got = complete(r.addr, &b, Duration::from_secs(5)).await;
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
