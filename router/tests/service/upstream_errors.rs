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

/// Instance 1 answers every request with a 503 at once; instance 0 streams its answers, its
/// first chunk 100 ms late. The 503s are passed through, but they are no first tokens: the
/// broken instance is not learnt as early (which made it draw nearly every request while the
/// healthy one had any prefill pending), nothing is learnt from it, its errors are counted,
/// and after a few in a row it is passed over for a while. The healthy instance serves most
/// requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_answering_errors_at_once_does_not_draw_the_traffic() {
    let ex = recorded();
    let healthy = Upstream::start_slow(ex.clone(), Duration::from_millis(100)).await;
    let broken = Upstream::start(failing(&ex, 503)).await;
    let r = router(
        vec![url_spec(healthy.url()), url_spec(broken.url())],
        None,
        1 << 20,
        Keys::Tokens,
    )
    .await;
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
            assert_eq!(g.status, if i == 0 { 200 } else { 503 }, "{g:?}");
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
