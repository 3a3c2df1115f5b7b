//! Admin calls that change every instance (vLLM's `/v1/load_lora_adapter`,
//! `/v1/unload_lora_adapter` and `/reset_prefix_cache`; SGLang's `/load_lora_adapter`,
//! `/unload_lora_adapter` and `/flush_cache`): fanned out to every instance, 200 only if
//! every instance succeeded, and what they change reaches the router's own state (its
//! adapter names, its index of the instances' pages).

use std::time::Duration;

use kvtier_events::{Medium, WireEvent};
use serde_json::Value;

use crate::abuse::JSON;
use crate::common::*;
use crate::proxy::url_spec;

const WAIT: Duration = Duration::from_secs(6);

/// The admin paths, each with a body an engine takes.
const CALLS: [(&str, &str); 7] = [
    (
        "/v1/load_lora_adapter",
        r#"{"lora_name":"sql","lora_path":"/loras/sql"}"#,
    ),
    ("/v1/unload_lora_adapter", r#"{"lora_name":"sql"}"#),
    ("/reset_prefix_cache?reset_external=true", ""),
    (
        "/load_lora_adapter",
        r#"{"lora_name":"sql","lora_path":"/loras/sql"}"#,
    ),
    ("/unload_lora_adapter", r#"{"lora_name":"sql"}"#),
    ("/flush_cache", ""),
    (
        "/load_lora_adapter_from_tensors",
        r#"{"lora_name":"sql","tensors":""}"#,
    ),
];

async fn post(addr: std::net::SocketAddr, target: &str, body: &str) -> Got {
    http_with(addr, "POST", target, &[JSON], body.as_bytes(), WAIT)
        .await
        .expect("answered")
}

/// An engine that answers an admin call as `reply` says for its path, and everything else
/// as [`healthy`] does.
async fn engine(reply: impl Fn(&str) -> Option<Reply> + Send + Sync + 'static) -> Fake {
    Fake::start(
        move |s| {
            let path = s.target.split('?').next().unwrap_or_default();
            if let Some(r) = reply(path) {
                return r;
            }
            if path == "/v1/models" {
                return Reply::Json(200, r#"{"object":"list","data":[{"id":"m"}]}"#.into());
            }
            if path == "/reset_prefix_cache" {
                return Reply::Json(200, r#"{"success":true}"#.into());
            }
            Reply::Json(200, ok_json())
        },
        None,
    )
    .await
}

fn with_url(p: &kvtier_events::Publisher, url: String) -> kvtier_router::launch::EndpointSpec {
    let mut s = spec(p);
    s.url = Some(url);
    s
}

/// Every admin call reaches every instance, as sent (path, query, body), and the client gets
/// 200 with the first instance's answer. Before, each was the router's 404 (vLLM's
/// `/v1/load_lora_adapter` among them: an operator pointing the call at the router loaded
/// nothing anywhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_reach_every_instance() {
    let (a, b) = (engine(|_| None).await, engine(|_| None).await);
    let r = launch_router(vec![url_spec(a.url()), url_spec(b.url())]).await;
    for (target, body) in CALLS {
        let got = post(r.addr, target, body).await;
        assert_eq!(got.status, 200, "{target}: {got:?}");
        assert_eq!(got.header("x-kvtier-instances"), Some("2"), "{got:?}");
        for up in [&a, &b] {
            let seen = up.seen();
            let last = seen.last().expect("reached");
            assert_eq!(last.target, target);
            assert_eq!(last.body, body.as_bytes(), "{target}");
        }
    }
    // SGLang's /flush_cache is a GET too
    let got = get_within(r.addr, "/flush_cache", WAIT).await;
    assert_eq!(got.status, 200, "{got:?}");
    assert_eq!((a.count("/flush_cache"), b.count("/flush_cache")), (2, 2));
    r.stop().await;
}

/// One instance's failure is never a silent success: an instance that answers an error, one
/// that cannot be reached, and vLLM's reset answering `{"success": false}` (blocks still
/// held) each make the client's answer an error whose JSON names every instance's outcome,
/// so the operator sees which to retry. The same 4xx from every instance (the call's own
/// fault) is that status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_call_that_fails_on_one_instance_says_which() {
    let refusing = engine(|p| match p {
        "/v1/load_lora_adapter" => Some(Reply::Json(400, r#"{"error":"no such path"}"#.into())),
        "/reset_prefix_cache" => Some(Reply::Json(200, r#"{"success":false}"#.into())),
        _ => None,
    })
    .await;
    let ok = engine(|_| None).await;
    let down = format!("http://127.0.0.1:{}", closed_port());
    let r = launch_router(vec![url_spec(ok.url()), url_spec(refusing.url())]).await;
    let (target, body) = CALLS[0];
    let got = post(r.addr, target, body).await;
    assert_eq!(got.status, 502, "{got:?}");
    let outcome = &got.json()["error"]["instances"];
    assert_eq!(outcome[0]["status"], 200, "{outcome}");
    assert_eq!(outcome[0]["ok"], true, "{outcome}");
    assert_eq!(outcome[1]["status"], 400, "{outcome}");
    assert_eq!(outcome[1]["ok"], false, "{outcome}");
    assert_eq!(outcome[1]["body"]["error"], "no such path", "{outcome}");
    let got = post(r.addr, "/reset_prefix_cache", "").await;
    assert_eq!(got.status, 502, "{got:?}");
    assert_eq!(got.json()["error"]["instances"][1]["ok"], false, "{got:?}");
    r.stop().await;

    let r = launch_router(vec![url_spec(ok.url()), url_spec(down)]).await;
    let got = post(r.addr, "/flush_cache", "").await;
    assert_eq!(got.status, 502, "{got:?}");
    let outcome = &got.json()["error"]["instances"];
    assert_eq!(outcome[1]["status"], Value::Null, "{outcome}");
    assert!(outcome[1]["error"].is_string(), "{outcome}");
    r.stop().await;

    let r = launch_router(vec![url_spec(refusing.url()), url_spec(refusing.url())]).await;
    let got = post(r.addr, target, body).await;
    assert_eq!(got.status, 400, "the same refusal everywhere: {got:?}");
    assert_eq!(got.json()["error"]["instances"][0]["status"], 400);
    r.stop().await;
}

/// A prefix-cache reset drops the router's index of the pages of every instance that reset
/// (and only of those): the next request is not sent to an instance for pages it no longer
/// has, whether or not the instance's own `AllBlocksCleared` ever comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_cache_reset_drops_the_instances_pages_from_the_index() {
    let busy = engine(|p| {
        (p == "/reset_prefix_cache").then(|| Reply::Json(200, r#"{"success":false}"#.into()))
    })
    .await;
    let ok = engine(|_| None).await;
    let (p0, p1) = (publisher(), publisher());
    let r = launch_router(vec![with_url(&p0, ok.url()), with_url(&p1, busy.url())]).await;
    joined(&r).await;
    let ids = tokens(7, 4);
    p0.publish(0.0, &[stored(&ids, Medium::Gpu)])
        .expect("publish");
    p1.publish(0.0, &[stored(&ids, Medium::Gpu)])
        .expect("publish");
    let c = std::sync::Arc::clone(&r.cluster);
    let on = move |i: usize| {
        let c = c.lock().expect("lock");
        let e = c.router().index().entries();
        e.iter().filter(|x| x.0 == i).count()
    };
    until("indexed", || on(0) == 4 && on(1) == 4).await;
    let got = post(r.addr, "/reset_prefix_cache", "").await;
    assert_eq!(got.status, 502, "instance 1 did not reset: {got:?}");
    assert_eq!((on(0), on(1)), (0, 4), "only the instance that reset");
    r.stop().await;
}

/// A LoRA adapter loaded through the router is an adapter to its routing at once: a request
/// naming it is routed by the adapter's keys (to the instance holding the prompt under the
/// adapter), though the router read the listing (without it) a moment before and would
/// not read it again for `lora::REFRESH`. Unloaded, the name routes as the base model again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_adapter_loaded_through_the_router_is_routed_by_at_once() {
    let (a, b) = (engine(|_| None).await, engine(|_| None).await);
    let (p0, p1) = (publisher(), publisher());
    let r = launch_router(vec![with_url(&p0, a.url()), with_url(&p1, b.url())]).await;
    joined(&r).await;
    let ids = tokens(9, 4);
    let mut under_lora = stored(&ids, Medium::Gpu);
    if let WireEvent::BlockStored { lora_name, .. } = &mut under_lora {
        *lora_name = Some("sql".into());
    }
    p1.publish(0.0, &[under_lora]).expect("publish");
    let c = std::sync::Arc::clone(&r.cluster);
    until("indexed", || {
        c.lock().expect("lock").router().index().pages() == 4
    })
    .await;
    let ask = serde_json::json!({"model": "sql", "prompt": ids, "max_tokens": 1}).to_string();
    let complete = || post(r.addr, "/v1/completions", &ask);
    let got = complete().await;
    assert_eq!(got.header("x-kvtier-instance"), Some("0"), "not known yet");
    let (load, unload) = (CALLS[0], CALLS[1]);
    assert_eq!(post(r.addr, load.0, load.1).await.status, 200);
    let got = complete().await;
    assert_eq!(got.header("x-kvtier-instance"), Some("1"), "{got:?}");
    assert_eq!(post(r.addr, unload.0, unload.1).await.status, 200);
    let got = complete().await;
    assert_eq!(got.header("x-kvtier-instance"), Some("0"), "{got:?}");
    r.stop().await;
}

async fn launch_router(
    specs: Vec<kvtier_router::launch::EndpointSpec>,
) -> kvtier_router::launch::Running {
    router(specs, None, 1 << 20, kvtier_router::cluster::Keys::Tokens).await
}
