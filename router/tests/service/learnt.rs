//! What a proxied request books and teaches the router: an error event is no first token
//! and no decode, a batch of prompts is booked whole, token ids written as whole floats
//! route by the cache.

use std::time::Duration;

use crate::abuse::{JSON, body, proxy, released};
use crate::common::*;
use kvtier_router::launch::Running;

/// A streamed answer whose first event is an error (`data: {"error": ...}` after a 200
/// head: what vLLM 0.32's completion stream generator yields for a request failing in it)
/// is no first token and no decode: its booking is cancelled and nothing is
/// learnt. Before, the error event was taken as the first token at once and the end as a
/// decode, so an instance refusing requests looked fast and drew the traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_error_event_is_not_a_first_token() {
    let (before, after) = stats_around_streams(
        vec![
            "data: {\"error\": {\"object\": \"error\", \"message\": \"too long\", \
             \"type\": \"BadRequestError\", \"code\": 400}}\n\n"
                .into(),
            "data: [DONE]\n\n".into(),
        ],
        "too long",
    )
    .await;
    for k in ["late_s", "decode_step_s"] {
        assert_eq!(
            after["instances"][0][k], before["instances"][0][k],
            "{k} learnt from errors: {after}"
        );
    }
}

/// An error event after the first token (a request failing midway: vLLM's and SGLang's
/// stream generators yield `data: {"error": ...}` and `[DONE]`) ends no decode: the stream's
/// end is not learnt as a decode step. Before, only an error in place of the first token was
/// told apart, and a failing instance's errors were learnt as decodes of 3e-8 s a step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_event_after_the_first_token_is_no_decode() {
    let (before, after) = stats_around_streams(
        vec![
            "data: {\"choices\":[{\"text\":\"a\"}]}\n\n".into(),
            "data: {\"error\": {\"object\": \"error\", \"message\": \"engine died\", \
             \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\n"
                .into(),
            "data: [DONE]\n\n".into(),
        ],
        "engine died",
    )
    .await;
    assert_eq!(
        after["instances"][0]["decode_step_s"], before["instances"][0]["decode_step_s"],
        "a decode learnt from failed streams: {after}"
    );
}

/// The router's `/stats` before and after 4 streamed completions through it to an engine
/// that answers each with `events`, each passed through as it came (200, `marker` in it),
/// every booking released.
async fn stats_around_streams(
    events: Vec<String>,
    marker: &str,
) -> (serde_json::Value, serde_json::Value) {
    let up = Fake::start(move |_| Reply::Sse(events.clone()), None).await;
    let r = proxy(vec![up.url()]).await;
    let before = http(r.addr, "GET", "/stats", None).await.json();
    for seed in 0..4 {
        let got = complete(r.addr, &body(seed, true), Duration::from_secs(5)).await;
        assert_eq!(got.status, 200, "passed through as it came: {got:?}");
        assert!(String::from_utf8_lossy(&got.body()).contains(marker));
    }
    released(&r, "released").await;
    let after = http(r.addr, "GET", "/stats", None).await.json();
    r.stop().await;
    (before, after)
}

/// Sends the completion `body` to the router, answered (or not) in the background.
fn in_background(r: &Running, body: serde_json::Value) -> tokio::task::JoinHandle<Option<Got>> {
    let addr = r.addr;
    tokio::spawn(async move {
        let b = body.to_string();
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
}

/// The first instance's queue (`/stats`' `queue_s`) once it is past `above`, or as it is
/// after 2 s.
async fn queue_past(r: &Running, above: f64) -> f64 {
    let mut q = above;
    for _ in 0..100 {
        let s = http(r.addr, "GET", "/stats", None).await.json();
        q = s["instances"][0]["queue_s"].as_f64().unwrap_or(0.0);
        if q > above {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    q
}

/// A batch of prompts (`"prompt": [[ids], [ids], ...]`, or a list of texts) runs every
/// prompt on the instance it is sent to, so its booking holds every prompt's tokens and
/// output: the instance's queue grows by about the batch's size. Before, the booking held the
/// first prompt alone, and batches piled onto an instance the router took for idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_prompts_is_booked_whole() {
    let up = Fake::start(|_| Reply::Hang, None).await;
    let r = proxy(vec![up.url()]).await;
    let one = in_background(
        &r,
        serde_json::json!({"model": "m", "prompt": tokens(1, 8), "max_tokens": 1}),
    );
    let q1 = queue_past(&r, 0.0).await;
    assert!(q1 > 0.0, "the single prompt is queued");
    let batch: Vec<Vec<u32>> = (10..26).map(|s| tokens(s, 8)).collect();
    let many = in_background(
        &r,
        serde_json::json!({"model": "m", "prompt": batch, "max_tokens": 1}),
    );
    let q2 = queue_past(&r, q1).await;
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
    let got = complete(r.addr, &b, Duration::from_secs(5)).await;
    assert_eq!(got.status, 200, "{got:?}");
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["routed_load_only"], 0, "{stats}");
    r.stop().await;
}

/// A batch of texts (`"prompt": ["short", <100K characters>]`) runs each text, so its
/// booking holds each text's tokens: the first's as the instance's `/tokenize` counted them,
/// every other's estimated from its length at the first's tokens per byte. Before, every
/// text was booked as long as the first, and a batch holding one long document beside a
/// short prompt was queued as two short prompts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_texts_books_each_text_by_its_length() {
    let up = tokenizing(Reply::Hang).await;
    let r = proxy(vec![up.url()]).await;
    let long = "word ".repeat(18_000); // 90,000 bytes: 50,000 tokens at the first's 5 per 9 bytes
    let sent = in_background(
        &r,
        serde_json::json!({"model": "m", "prompt": ["a b c d e", long], "max_tokens": 1}),
    );
    let queue = queue_past(&r, 0.0).await;
    // 50,005 prompt tokens at 10,000 a second
    assert!(
        queue > 4.0,
        "the batch queued as {queue:.4} s: booked as two short prompts"
    );
    sent.abort();
    r.stop().await;
}
