//! OpenAI-compatible proxy in front of vLLM or SGLang servers: `/v1/completions`,
//! `/v1/chat/completions`, `/v1/models`.
//!
//! Each request is routed by its prompt's tokens: token-id prompts are used as they are; a
//! text prompt or chat messages are tokenized by a backend's `/tokenize` (vLLM's, which takes
//! either), and if that fails the request is routed by load alone. The request goes to the
//! chosen instance unchanged; the response (status, headers, body) comes back as it arrives,
//! chunk by chunk, so a streaming answer's SSE events reach the client when the engine sends
//! them. If the chosen instance refuses the connection or answers 502, 503 or 504 (it did
//! not run the request), the next best is tried, each instance once; if none is left, the
//! latest such answer is the client's. Once a byte of an answer is sent it is the client's;
//! a body that fails midway is cut off there (the client sees a failure, not an end) and
//! counted as the instance's error. Each instance's requests in flight are counted
//! from the send until the answer's body ends or the client goes away, and each routed
//! request is booked in the router's closed-loop queue (`Router::route_tracked`): its first
//! token is its streamed answer's first chunk (an answer sent whole shows none: its prefill
//! is taken as done when predicted, and nothing is learnt from it), its end the body's end,
//! and an instance that refuses it, answers an error status (not 2xx) or fails after the
//! connection drops the booking: an error is no first token and no decode, and an instance
//! failing fast must not look fast. Server errors are counted per instance, and a streak of
//! them has the instance passed over for a while (`errors.rs`). A request naming a
//! LoRA adapter (vLLM's `model`, SGLang's `lora_path`) is routed by the adapter's keys
//! (`lora.rs`), and its `cache_salt` by the salt's.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::cluster::{Cluster, Decision};
use crate::feedback::FirstToken;
use crate::lora::{self, ModelKind};
use crate::service::{AppState, body_rejected, error};

/// How long a `/tokenize` (or `/v1/models`) call may take before the request is routed
/// without its answer.
const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(2);

/// The HTTP client to the instances.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for Upstream {
    fn default() -> Self {
        Self::new()
    }
}

impl Upstream {
    pub fn new() -> Self {
        let mut c = HttpConnector::new();
        c.set_connect_timeout(Some(Duration::from_secs(2)));
        c.set_nodelay(true);
        Self {
            client: Client::builder(TokioExecutor::new()).build(c),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Counts a request in flight on an instance until dropped, and reports a tracked request's
/// first token (its answer's first chunk, when streamed) and end (the drop) to the router.
struct InFlight {
    cluster: Arc<Mutex<Cluster>>,
    instance: usize,
    booking: Option<u64>,
    /// Whether the first chunk is the first token (a streamed answer) and not seen yet.
    awaiting_first: bool,
}

impl InFlight {
    fn new(cluster: &Arc<Mutex<Cluster>>, d: &Decision, first: FirstToken) -> Self {
        cluster
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .started(d.instance);
        Self {
            cluster: Arc::clone(cluster),
            instance: d.instance,
            booking: d.booking,
            awaiting_first: d.booking.is_some() && first == FirstToken::Reported,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A chunk of the answer arrived.
    fn chunk(&mut self) {
        if std::mem::take(&mut self.awaiting_first)
            && let Some(b) = self.booking
        {
            self.lock().first_token(b);
        }
    }

    /// The request did not run on the instance as booked (it refused the connection, answered
    /// an error status, or failed): its booking goes, nothing learnt from it.
    fn cancel(&mut self) {
        self.awaiting_first = false;
        if let Some(b) = self.booking.take() {
            self.lock().cancel(b);
        }
    }
}

impl InFlight {
    /// The answer's body failed midway: the booking goes, and an answer whose status said
    /// success is counted as the instance's error after all (an error status was already).
    fn failed(&mut self, answered_ok: bool) {
        self.cancel();
        if answered_ok {
            self.lock().answered(self.instance, false);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let booking = self.booking;
        let mut c = self.lock();
        c.finished(self.instance);
        if let Some(b) = booking {
            c.ended(b);
        }
    }
}

pub async fn completions(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body {
        Ok(b) => forward(st, "/v1/completions", Kind::Completion, headers, b).await,
        Err(e) => body_rejected(&e),
    }
}

pub async fn chat(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body {
        Ok(b) => forward(st, "/v1/chat/completions", Kind::Chat, headers, b).await,
        Err(e) => body_rejected(&e),
    }
}

/// `/v1/models` from the first instance that answers.
pub async fn models(State(st): State<AppState>, headers: HeaderMap) -> Response {
    for (i, base) in st.backends.iter().enumerate() {
        let Ok(req) = request(Method::GET, base, "/v1/models", &headers, Bytes::new()) else {
            continue;
        };
        if let Ok(resp) = st.upstream.client.request(req).await {
            return pass_through(resp, i, None);
        }
    }
    error(
        StatusCode::BAD_GATEWAY,
        "upstream_unavailable",
        "no instance answered",
    )
}

async fn forward(
    st: AppState,
    path: &str,
    kind: Kind,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let json: Option<Value> = serde_json::from_slice(&body).ok();
    let tokens = match &json {
        Some(v) => tokens_of(&st, kind, v, &headers).await,
        None => None,
    };
    let salt = json
        .as_ref()
        .and_then(|v| v.get("cache_salt"))
        .and_then(Value::as_str);
    let lora = match &json {
        Some(v) => adapter_of(&st, v, &headers).await,
        None => None,
    };
    // a streamed answer's first chunk is its first token; one sent whole shows none
    let streamed = json
        .as_ref()
        .and_then(|v| v.get("stream"))
        .and_then(Value::as_bool);
    let first = if streamed == Some(true) {
        FirstToken::Reported
    } else {
        FirstToken::AtEstimate
    };
    let output = json.as_ref().map_or(0, |v| max_tokens(v, kind));
    // instances tried: refused the connection, or answered "unavailable"
    let mut tried = Vec::new();
    // the latest "unavailable" answer, passed through if no instance is left
    let mut unavailable: Option<(usize, hyper::Response<hyper::body::Incoming>)> = None;
    loop {
        let decision = {
            let mut c = st.lock();
            match &tokens {
                Some(t) => c.route_tracked(t, (salt, lora.as_deref()), &tried, output, first),
                None => c.route_load_only(&tried),
            }
        };
        let Some(d) = decision else {
            if let Some((i, resp)) = unavailable {
                return pass_through(resp, i, None);
            }
            return error(
                StatusCode::BAD_GATEWAY,
                "upstream_unavailable",
                format!("every instance refused the connection ({tried:?})"),
            );
        };
        // from here every return ends or cancels the booking (the guard's drop ends it)
        let mut guard = InFlight::new(&st.cluster, &d, first);
        let built = match st.backends.get(d.instance) {
            Some(base) => request(Method::POST, base, path, &headers, body.clone()),
            None => Err(format!("instance {} has no URL", d.instance)),
        };
        let req = match built {
            Ok(r) => r,
            Err(e) => {
                guard.cancel();
                st.lock().answered(d.instance, false);
                return error(StatusCode::BAD_GATEWAY, "bad_backend_url", e);
            }
        };
        match st.upstream.client.request(req).await {
            Ok(resp) => {
                let status = resp.status();
                if !status.is_success() {
                    guard.cancel();
                }
                if status.is_success() || status.is_server_error() {
                    st.lock().answered(d.instance, status.is_success());
                }
                if unavailable_status(status) {
                    // not run there, and nothing sent yet: the next best instance may
                    drop(guard);
                    tried.push(d.instance);
                    unavailable = Some((d.instance, resp));
                    continue;
                }
                return pass_through(resp, d.instance, Some(guard));
            }
            Err(e) if e.is_connect() => {
                guard.cancel();
                drop(guard);
                st.lock().refused(d.instance);
                tried.push(d.instance);
            }
            Err(e) => {
                guard.cancel();
                st.lock().answered(d.instance, false);
                return error(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    format!("instance {}: {e}", d.instance),
                );
            }
        }
    }
}

/// Whether an answer says the instance did not run the request and another may: 502 and
/// 504 (a gateway in front of the engine found it down, or gave up waiting), 503 (the engine
/// is overloaded, starting or shutting down). A 500 or any 4xx is the request's own answer
/// (it may fail the same way anywhere) and is passed through.
fn unavailable_status(s: StatusCode) -> bool {
    matches!(
        s,
        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT
    )
}

fn request(
    method: Method,
    base: &str,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Request<Full<Bytes>>, String> {
    let uri: hyper::Uri = format!("{}{path}", base.trim_end_matches('/'))
        .parse()
        .map_err(|e| format!("backend URL {base:?}: {e}"))?;
    let mut b = Request::builder().method(method).uri(uri);
    for name in [header::CONTENT_TYPE, header::AUTHORIZATION, header::ACCEPT] {
        if let Some(v) = headers.get(&name) {
            b = b.header(name, v);
        }
    }
    b.body(Full::new(body)).map_err(|e| e.to_string())
}

/// The instance's answer as it comes: status, headers (less hop-by-hop ones), and the body
/// chunk by chunk; the in-flight count ends with the body. A body that fails midway (the
/// instance died or dropped the connection) is the instance's error and cancels the booking:
/// the time to the failure is no decode time; the client's answer is cut off there, so it
/// sees a failure, not an end.
fn pass_through(
    resp: hyper::Response<hyper::body::Incoming>,
    instance: usize,
    mut guard: Option<InFlight>,
) -> Response {
    let (parts, incoming) = resp.into_parts();
    // counted as a success until the body fails (once)
    let mut answered_ok = parts.status.is_success();
    let stream = incoming.into_data_stream().map(move |chunk| {
        if let Some(g) = guard.as_mut() {
            match &chunk {
                Ok(_) => g.chunk(),
                Err(_) => g.failed(std::mem::take(&mut answered_ok)),
            }
        }
        chunk
    });
    let mut out = Response::new(Body::from_stream(stream));
    *out.status_mut() = parts.status;
    for (k, v) in &parts.headers {
        if k == header::CONNECTION || k == header::TRANSFER_ENCODING || k.as_str() == "keep-alive" {
            continue;
        }
        out.headers_mut().append(k, v.clone());
    }
    out.headers_mut()
        .insert("x-kvtier-instance", HeaderValue::from(instance));
    out
}

/// What a completion that names no `max_tokens` generates at most: the OpenAI API's default,
/// which vLLM's and SGLang's `/v1/completions` follow (a chat's default is the context left,
/// which the router does not know).
pub const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

/// The tokens a request may generate: its `max_completion_tokens` or `max_tokens`; when it
/// names neither, a completion's default ([`COMPLETION_DEFAULT_MAX_TOKENS`]) and for a chat 0
/// (unknown). The router's memory timeline ends each request by it (docs/router.md, "What the
/// router is told of each answer").
fn max_tokens(v: &Value, kind: Kind) -> usize {
    let named = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| v.get(*k).and_then(Value::as_u64));
    match (named, kind) {
        (Some(n), _) => usize::try_from(n).unwrap_or(usize::MAX),
        (None, Kind::Completion) => COMPLETION_DEFAULT_MAX_TOKENS,
        (None, Kind::Chat) => 0,
    }
}

/// The LoRA adapter the request names (`lora.rs`): SGLang's `lora_path`, or a vLLM `model`
/// that the instances' `/v1/models` lists as an adapter (read when the name is new to the
/// router, at most every `lora::REFRESH`).
async fn adapter_of(st: &AppState, v: &Value, headers: &HeaderMap) -> Option<String> {
    if let Some(a) = lora::named_adapter(v) {
        return Some(a.to_owned());
    }
    let model = v.get("model").and_then(Value::as_str)?;
    let now = Instant::now();
    {
        let mut m = st.models.lock().unwrap_or_else(PoisonError::into_inner);
        match m.kind(model) {
            Some(ModelKind::Adapter) => return Some(model.to_owned()),
            Some(ModelKind::Base) => return None,
            None if !m.may_read(now) => return None,
            None => m.read_at(now),
        }
    }
    for base in st.backends.iter().take(2) {
        let Some(listing) =
            ask_json(st, Method::GET, base, "/v1/models", headers, Bytes::new()).await
        else {
            continue;
        };
        let mut m = st.models.lock().unwrap_or_else(PoisonError::into_inner);
        if m.learn(&listing) > 0 {
            return (m.kind(model) == Some(ModelKind::Adapter)).then(|| model.to_owned());
        }
    }
    None
}

/// The prompt's token ids, from the request or a backend's `/tokenize`; `None` if neither.
async fn tokens_of(st: &AppState, kind: Kind, v: &Value, headers: &HeaderMap) -> Option<Vec<u32>> {
    let ids = |a: &Value| -> Option<Vec<u32>> {
        a.as_array()?
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    let model = v.get("model").cloned().unwrap_or(Value::Null);
    let ask = match kind {
        Kind::Completion => {
            let p = v.get("prompt")?;
            if let Some(t) = ids(p).filter(|t| !t.is_empty()) {
                return Some(t);
            }
            // a batch of prompts: the first one routes the request
            let first = p.as_array().and_then(|a| a.first());
            if let Some(t) = first.and_then(ids) {
                return Some(t);
            }
            let text = p.as_str().or_else(|| first.and_then(Value::as_str))?;
            serde_json::json!({"model": model, "prompt": text})
        }
        Kind::Chat => {
            let mut ask = serde_json::json!({
                "model": model,
                "messages": v.get("messages")?.clone(),
                "add_generation_prompt": v.get("add_generation_prompt").cloned().unwrap_or(Value::Bool(true)),
            });
            for k in ["continue_final_message", "chat_template_kwargs", "tools"] {
                if let (Some(x), Some(m)) = (v.get(k), ask.as_object_mut()) {
                    m.insert(k.into(), x.clone());
                }
            }
            ask
        }
    };
    let body = Bytes::from(serde_json::to_vec(&ask).ok()?);
    for base in st.backends.iter().take(2) {
        let answer = ask_json(st, Method::POST, base, "/tokenize", headers, body.clone()).await;
        if let Some(t) = answer.as_ref().and_then(|v| ids(v.get("tokens")?)) {
            return Some(t);
        }
    }
    None
}

/// A backend's JSON answer to one call, within `TOKENIZE_TIMEOUT`; `None` for any failure.
async fn ask_json(
    st: &AppState,
    method: Method,
    base: &str,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Option<Value> {
    let req = request(method, base, path, headers, body).ok()?;
    let call = async {
        let resp = st.upstream.client.request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let bytes = resp.into_body().collect().await.ok()?.to_bytes();
        serde_json::from_slice::<Value>(&bytes).ok()
    };
    tokio::time::timeout(TOKENIZE_TIMEOUT, call)
        .await
        .ok()
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_request_without_max_tokens_is_booked_with_the_engines_default() {
        let c = Kind::Completion;
        assert_eq!(max_tokens(&json!({"prompt": "x"}), c), 16);
        assert_eq!(
            max_tokens(&json!({"prompt": "x", "max_tokens": 300}), c),
            300
        );
        assert_eq!(
            max_tokens(&json!({"max_completion_tokens": 7, "max_tokens": 300}), c),
            7
        );
        assert_eq!(
            max_tokens(&json!({"max_tokens": "many"}), c),
            16,
            "not a count: the default"
        );
        assert_eq!(
            max_tokens(&json!({"messages": []}), Kind::Chat),
            0,
            "a chat's: unknown"
        );
        assert_eq!(max_tokens(&json!({"max_tokens": 9}), Kind::Chat), 9);
    }
}
