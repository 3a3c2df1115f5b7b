//! The APIs beside completions and chats that a fleet's clients call through the router:
//! OpenAI's `/v1/embeddings` (routed by load: an embedding reuses no KV) and `/v1/responses`
//! (routed by the cache of its `instructions` and `input`, its stream's first token told from
//! the events that come before it), and SGLang's native `/generate` (`text` or `input_ids`,
//! one prompt or a batch).

use std::time::Duration;

use serde_json::{Value, json};

use crate::abuse::{JSON, proxy, released};
use crate::common::*;

const WAIT: Duration = Duration::from_secs(6);

async fn post(r: &kvtier_router::launch::Running, path: &str, body: &Value) -> Got {
    http_with(
        r.addr,
        "POST",
        path,
        &[JSON],
        body.to_string().as_bytes(),
        WAIT,
    )
    .await
    .expect("answered")
}

async fn stats(r: &kvtier_router::launch::Running) -> Value {
    http(r.addr, "GET", "/stats", None).await.json()
}

/// The body of the latest request `up` received on `path`, as JSON.
fn last_body(up: &Fake, path: &str) -> Value {
    let seen = up.seen();
    let s = seen
        .iter()
        .rev()
        .find(|s| s.target.split('?').next() == Some(path))
        .unwrap_or_else(|| panic!("nothing reached {path}: {seen:?}"));
    serde_json::from_slice(&s.body).expect("JSON body")
}

/// `/v1/embeddings` and a pooling model's other APIs (vLLM's `/v2/embed`, `/pooling`,
/// `/classify`, `/score` and `/v1/score`, `/rerank`, `/v1/rerank` and `/v2/rerank`) reach an
/// instance as sent and the answer comes back; they reuse no KV, so they are routed by load
/// alone and no prompt is tokenized for them. Before, the router answered 404 (the pooling
/// paths but `/v1/embeddings` until the commit after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_reach_an_instance_routed_by_load() {
    let up = healthy().await;
    let r = proxy(vec![up.url()]).await;
    let paths = [
        "/v1/embeddings",
        "/v2/embed",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    ];
    for path in paths {
        let b = json!({"model": "m", "input": ["a long text", "another"], "query": "q"});
        let got = post(&r, path, &b).await;
        assert_eq!(got.status, 200, "{path}: {got:?}");
        assert_eq!(got.header("x-kvtier-instance"), Some("0"), "{got:?}");
        assert_eq!(last_body(&up, path), b);
    }
    assert_eq!(up.count("/tokenize"), 0, "nothing to route by the cache");
    assert_eq!(stats(&r).await["routed_load_only"], paths.len());
    released(&r, "embedding released").await;
    r.stop().await;
}

/// `/v1/responses` (OpenAI's Responses API, which vLLM 0.34 and SGLang serve) is routed by
/// the cache of the prompt the engine builds from it: `instructions` as the system message,
/// then `input` (a text as the user's message, or the list of message items as they are);
/// the instance's `/tokenize` is asked for those messages' tokens. Before, the router
/// answered 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_are_routed_by_the_cache_of_instructions_and_input() {
    let up = healthy().await;
    let r = proxy(vec![up.url()]).await;
    let items = json!([
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "message", "role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
        {"type": "function_call_output", "call_id": "c", "output": "42"},
    ]);
    for (input, messages) in [
        (
            json!("hi"),
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]),
        ),
        (
            items.clone(),
            // the message items (an assistant's as its text, as vLLM builds it; `input_text`
            // parts as the `text` parts vLLM's chat parser reads them as, which its /tokenize
            // takes: it refuses `input_text`), up to the first that is not a message: a sure
            // prefix of the prompt
            json!([{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                   {"role": "assistant", "content": "hello"}, items[2]]),
        ),
    ] {
        let b = json!({"model": "m", "instructions": "Be brief.", "input": input,
                       "max_output_tokens": 20, "tools": [
                           {"type": "function", "name": "f", "description": "d",
                            "parameters": {"type": "object"}, "strict": true},
                           {"type": "web_search"}]});
        let got = post(&r, "/v1/responses", &b).await;
        assert_eq!(got.status, 200, "{got:?}");
        assert_eq!(last_body(&up, "/v1/responses"), b, "sent as it came");
        let asked = last_body(&up, "/tokenize");
        assert_eq!(asked["messages"], messages, "{asked}");
        assert_eq!(asked["add_generation_prompt"], true, "{asked}");
        // the function tools in the chat's form, which the chat template renders
        let tools = json!([{"type": "function", "function": {"name": "f", "description": "d",
                            "parameters": {"type": "object"}, "strict": true}}]);
        assert_eq!(asked["tools"], tools, "{asked}");
    }
    let s = stats(&r).await;
    assert_eq!(s["routed_load_only"], 0, "{s}");
    released(&r, "responses released").await;
    r.stop().await;
}

/// A streamed response's events begin with `response.created` and `response.in_progress`,
/// which vLLM (`serving.py`'s `responses_stream_generator`) and SGLang send before the engine
/// runs the prompt: they are not its first token. A stream that then fails
/// (`response.failed`, or an `error` event) is no first token and no decode, as a
/// completion's error event is. Before (with the route), the `response.created` chunk was
/// learnt as the first token and the failure's end as a decode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_streams_preamble_is_not_its_first_token() {
    let created = r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","status":"in_progress","output":[]}}"#;
    let progress = r#"{"type":"response.in_progress","sequence_number":1,"response":{"id":"resp_1","status":"in_progress","output":[]}}"#;
    for end in [
        r#"event: response.failed
data: {"type":"response.failed","sequence_number":2,"response":{"id":"resp_1","status":"failed","error":{"code":"server_error","message":"boom"}}}

"#,
        r#"event: error
data: {"type":"error","sequence_number":2,"code":"server_error","message":"boom"}

"#,
    ] {
        let events = vec![
            format!("event: response.created\ndata: {created}\n\n"),
            format!("event: response.in_progress\ndata: {progress}\n\n"),
            end.to_string(),
        ];
        let body = |i| {
            json!({"model": "m", "input": format!("question {i}"), "stream": true,
                   "max_output_tokens": 50})
        };
        nothing_learnt_from(events, "/v1/responses", body).await;
    }
}

/// Asserts that 4 streamed requests to `path` (`body(i)` each) through the router to an
/// instance answering each with `events` (a failure: "boom" in it), passed through as they
/// came, teach the router no lateness and no decode step, every booking released.
async fn nothing_learnt_from(events: Vec<String>, path: &str, body: impl Fn(u32) -> Value) {
    let up = tokenizing(Reply::Sse(events)).await;
    let r = proxy(vec![up.url()]).await;
    let before = stats(&r).await;
    for i in 0..4 {
        let got = post(&r, path, &body(i)).await;
        assert_eq!(got.status, 200, "{got:?}");
        assert!(String::from_utf8_lossy(&got.body()).contains("boom"));
    }
    released(&r, "released").await;
    let after = stats(&r).await;
    for k in ["late_s", "decode_step_s"] {
        assert_eq!(
            after["instances"][0][k], before["instances"][0][k],
            "{path}: {k} learnt from a failed stream: {after}"
        );
    }
    r.stop().await;
}

/// Anthropic's Messages API (vLLM 0.34's `/v1/messages`, which Anthropic SDK clients call) is
/// routed by the cache of the chat vLLM runs it as (`anthropic/serving.py`'s
/// `to_chat_completion_request`): `system` (a text or its text blocks joined) as the system
/// message, then the messages, text blocks as their text, up to the first message holding
/// anything else (a tool use, an image: a sure prefix); `/v1/messages/count_tokens` reaches an
/// instance as `/tokenize` does. Before, both were the router's 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_are_routed_by_the_cache_of_their_chat() {
    let up = healthy().await;
    let r = proxy(vec![up.url()]).await;
    let b = json!({"model": "m", "max_tokens": 64,
    "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
    "system": [{"type": "text", "text": "You are "}, {"type": "text", "text": "brief."}],
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
    ]});
    let got = post(&r, "/v1/messages", &b).await;
    assert_eq!(got.status, 200, "{got:?}");
    assert_eq!(last_body(&up, "/v1/messages"), b, "sent as it came");
    let asked = last_body(&up, "/tokenize");
    assert_eq!(
        asked["messages"],
        json!([
            {"role": "system", "content": "You are brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]),
        "{asked}"
    );
    let tools = json!([{"type": "function", "function": {"name": "f", "description": "d",
                        "parameters": {"type": "object"}}}]);
    assert_eq!(
        asked["tools"], tools,
        "the tools in the chat's form: {asked}"
    );
    assert_eq!(stats(&r).await["routed_load_only"], 0);
    let count = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let got = post(&r, "/v1/messages/count_tokens", &count).await;
    assert_eq!(got.status, 200, "{got:?}");
    assert_eq!(last_body(&up, "/v1/messages/count_tokens"), count);
    released(&r, "messages released").await;
    r.stop().await;
}

/// A streamed message that fails sends Anthropic's error event (`event: error`, `data:
/// {"type": "error", "error": {...}}`: vLLM's `message_stream_converter`), which is no first
/// token and no decode, as a completion's `data: {"error": ...}` is. Before (with the route),
/// it was learnt as the first token and the stream's end as a decode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anthropic_error_event_is_not_a_first_token() {
    let events = vec![
        "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"boom\"}}\n\n"
            .to_string(),
    ];
    let body = |i| {
        json!({"model": "m", "max_tokens": 50, "stream": true,
               "messages": [{"role": "user", "content": format!("question {i}")}]})
    };
    nothing_learnt_from(events, "/v1/messages", body).await;
}

/// SGLang's native `/generate` is forwarded as sent and routed by the cache: `input_ids` as
/// they are (no `/tokenize`), `text` tokenized by an instance, the first prompt of a batch
/// routing it. Before, the router answered 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_generate_is_routed_by_the_cache() {
    let up = healthy().await;
    let r = proxy(vec![up.url()]).await;
    let ids = tokens(4, 2);
    for (b, tokenized) in [
        (
            json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 8}}),
            None,
        ),
        (
            json!({"input_ids": [ids, tokens(5, 1)], "sampling_params": {"max_new_tokens": 8}}),
            None,
        ),
        (
            json!({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}),
            Some("The capital of France is"),
        ),
        (
            json!({"text": ["first prompt", "second"], "stream": true}),
            Some("first prompt"),
        ),
    ] {
        let asked = up.count("/tokenize");
        let got = post(&r, "/generate", &b).await;
        assert_eq!(got.status, 200, "{b}: {got:?}");
        assert_eq!(last_body(&up, "/generate"), b, "sent as it came");
        match tokenized {
            None => assert_eq!(up.count("/tokenize"), asked, "{b}: ids need no /tokenize"),
            Some(t) => assert_eq!(last_body(&up, "/tokenize")["prompt"], t, "{b}"),
        }
    }
    let s = stats(&r).await;
    assert_eq!(s["routed_load_only"], 0, "{s}");
    released(&r, "generate released").await;
    r.stop().await;
}

/// A stored response lives in the memory of the instance that made it (vLLM's
/// `VLLM_ENABLE_RESPONSES_API_STORE`, SGLang's store): a request continuing it
/// (`previous_response_id`) is sent to that instance, found by asking the instances for it
/// (`GET /v1/responses/{id}`), and `GET /v1/responses/{id}` and `POST .../cancel` reach the
/// instance that has it, another's 404 passed over. Before, the continuation went to the
/// cheapest instance (here the one without it: its 404 was the client's) and the other two
/// were the router's 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_response_is_continued_and_read_where_it_is() {
    let holder = |has: bool| {
        Fake::start(
            move |s| {
                let names = |id: &str| {
                    s.target.contains(id) || s.body.windows(id.len()).any(|w| w == id.as_bytes())
                };
                if s.target.starts_with("/tokenize") {
                    Reply::Json(200, r#"{"tokens":[1,2,3,4,5],"count":5}"#.into())
                } else if names("resp_9") || (!has && names("resp_1")) {
                    Reply::Json(404, r#"{"error":{"message":"Response not found."}}"#.into())
                } else {
                    Reply::Json(
                        200,
                        r#"{"id":"resp_2","object":"response","status":"completed"}"#.into(),
                    )
                }
            },
            None,
        )
    };
    let (without, with) = (holder(false).await, holder(true).await);
    let r = proxy(vec![without.url(), with.url()]).await;
    for i in 0..3 {
        let b = json!({"model": "m", "input": format!("and then {i}?"),
                       "previous_response_id": "resp_1"});
        let got = post(&r, "/v1/responses", &b).await;
        assert_eq!(got.status, 200, "{got:?}");
        assert_eq!(got.header("x-kvtier-instance"), Some("1"), "{got:?}");
    }
    assert_eq!(
        without.count("/v1/responses"),
        0,
        "no continuation sent where it is not"
    );
    let got = get_within(r.addr, "/v1/responses/resp_1", WAIT).await;
    assert_eq!(
        (got.status, got.header("x-kvtier-instance")),
        (200, Some("1")),
        "{got:?}"
    );
    let got = http_with(
        r.addr,
        "POST",
        "/v1/responses/resp_1/cancel",
        &[JSON],
        b"",
        WAIT,
    )
    .await
    .expect("answered");
    assert_eq!(
        (got.status, got.header("x-kvtier-instance")),
        (200, Some("1")),
        "{got:?}"
    );
    // one that no instance has: an instance's 404, not the router's
    let got = get_within(r.addr, "/v1/responses/resp_9", WAIT).await;
    assert_eq!(got.status, 404, "{got:?}");
    assert!(got.header("x-kvtier-instance").is_some(), "{got:?}");
    released(&r, "released").await;
    r.stop().await;
}

/// A router in front of `url` whose instances take `step_s` per decode step (its occupancy's
/// decode step, until ends teach it another).
async fn with_decode_step(url: String, step_s: f64) -> kvtier_router::launch::Running {
    let occupancy = kvtier_router::Occupancy {
        device_tokens: 1e6,
        decode_step_s: step_s,
    };
    kvtier_router::launch::start(kvtier_router::launch::Config {
        occupancy: Some(occupancy),
        ..config(
            vec![crate::proxy::url_spec(url)],
            1 << 20,
            kvtier_router::cluster::Keys::Tokens,
        )
    })
    .await
    .expect("start router")
}

/// A background response (`"background": true`): vLLM answers at once (`status: queued`) and
/// the engine generates afterwards. Its booking outlives the answer, as the instance's work
/// it is, and nothing is learnt from the answer (its time is no decode time); it is dropped,
/// learning nothing, once its predicted prefill and its `max_output_tokens` of decode steps
/// (at the instance's step) have passed, so the instance's load is honest within that
/// bound. Before, the booking ended with the immediate answer (0 bookings open), and the
/// instance looked idle while it generated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_stays_booked_past_its_immediate_answer() {
    let queued = json!({"id": "resp_1", "object": "response", "status": "queued",
                        "background": true, "output": []});
    let up = tokenizing(Reply::Json(200, queued.to_string())).await;
    let background = |tokens: u32| {
        json!({"model": "m", "input": "hi", "background": true, "store": true,
               "max_output_tokens": tokens})
    };
    let settled = |r: &kvtier_router::launch::Running| {
        let c = std::sync::Arc::clone(&r.cluster);
        until("answered", move || {
            c.lock().expect("lock").in_flight().iter().all(|&n| n == 0)
        })
    };
    // 1000 tokens at 10 ms a step: 10 s of generation
    let r = with_decode_step(up.url(), 0.01).await;
    let got = post(&r, "/v1/responses", &background(1000)).await;
    assert_eq!(got.status, 200, "{got:?}");
    assert_eq!(got.json()["status"], "queued");
    settled(&r).await;
    let after = stats(&r).await;
    assert_eq!(
        after["bookings"]["open"], 1,
        "still the instance's work: {after}"
    );
    assert_eq!(after["bookings"]["background_open"], 1, "{after}");
    // as configured: nothing learnt
    for (k, v) in [("late_s", 0.0), ("decode_step_s", 0.01)] {
        assert_eq!(
            after["instances"][0][k], v,
            "{k} learnt from a background answer: {after}"
        );
    }
    r.stop().await;
    // 10 tokens at 1 µs a step: done within a millisecond, dropped at the next decision
    let r = with_decode_step(up.url(), 1e-6).await;
    let got = post(&r, "/v1/responses", &background(10)).await;
    assert_eq!(got.status, 200, "{got:?}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let whole = json!({"model": "m", "input": "hi", "max_output_tokens": 10});
    assert_eq!(post(&r, "/v1/responses", &whole).await.status, 200);
    released(&r, "the background booking expired").await;
    r.stop().await;
}

/// A background response's booking ends when the response is seen done: a client of
/// background mode polls `GET /v1/responses/{id}`, and the one showing it `completed` (not
/// the one showing it `in_progress`) ends its booking, learning nothing; so does a
/// successful `POST /v1/responses/{id}/cancel`. The answers reach the client unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_seen_done_or_cancelled_ends_its_booking() {
    let polls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (p, made) = (
        std::sync::Arc::clone(&polls),
        std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0)),
    );
    let up = Fake::start(
        move |s| {
            use std::sync::atomic::Ordering::SeqCst;
            let path = s.target.split('?').next().unwrap_or_default();
            let response = |id: &str, status: &str| {
                json!({"id": id, "object": "response", "status": status, "output": []}).to_string()
            };
            match path {
                "/tokenize" => Reply::Json(200, r#"{"tokens":[1,2,3,4,5],"count":5}"#.into()),
                "/v1/responses" => {
                    let n = made.fetch_add(1, SeqCst);
                    Reply::Json(200, response(&format!("resp_{n}"), "queued"))
                }
                "/v1/responses/resp_0" => {
                    let status = if p.fetch_add(1, SeqCst) == 0 {
                        "in_progress"
                    } else {
                        "completed"
                    };
                    Reply::Json(200, response("resp_0", status))
                }
                "/v1/responses/resp_1/cancel" => Reply::Json(200, response("resp_1", "cancelled")),
                _ => Reply::Json(404, r#"{"error":"no"}"#.into()),
            }
        },
        None,
    )
    .await;
    let r = with_decode_step(up.url(), 0.01).await;
    let background = json!({"model": "m", "input": "hi", "background": true,
                            "max_output_tokens": 1000});
    let open =
        |r: &kvtier_router::launch::Running| r.cluster.lock().expect("lock").router().booked();
    for _ in 0..2 {
        assert_eq!(
            post(&r, "/v1/responses", &background).await.json()["status"],
            "queued"
        );
    }
    let c = std::sync::Arc::clone(&r.cluster);
    until("answered", move || {
        c.lock().expect("lock").in_flight().iter().all(|&n| n == 0)
    })
    .await;
    assert_eq!(open(&r), 2, "both generating");
    let get = |r: &kvtier_router::launch::Running| {
        let addr = r.addr;
        async move { get_within(addr, "/v1/responses/resp_0", WAIT).await }
    };
    assert_eq!(get(&r).await.json()["status"], "in_progress");
    assert_eq!(open(&r), 2, "still generating");
    assert_eq!(get(&r).await.json()["status"], "completed");
    assert_eq!(open(&r), 1, "resp_0 done");
    let got = post(&r, "/v1/responses/resp_1/cancel", &json!({})).await;
    assert_eq!(got.json()["status"], "cancelled");
    assert_eq!(open(&r), 0, "resp_1 cancelled");
    let s = stats(&r).await;
    assert_eq!(
        s["instances"][0]["decode_step_s"], 0.01,
        "nothing learnt: {s}"
    );
    assert_eq!(s["bookings"]["background_open"], 0, "{s}");
    r.stop().await;
}
