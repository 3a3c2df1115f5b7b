//! Instances that fail: one answering an error at once is not taken for a fast instance.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use crate::proxy::{find, url_spec};
use kvtier_router::cluster::Keys;

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
