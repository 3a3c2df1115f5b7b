//! OpenAI-compatible proxy in front of vLLM or SGLang servers: `/v1/completions`,
//! `/v1/responses` (and a stored response's `GET /v1/responses/{id}` and `.../cancel`, from the
//! instance that has it), `/v1/embeddings` and the other pooling APIs (routed by load),
//! Anthropic's `/v1/messages` (and `/v1/messages/count_tokens`), SGLang's `/generate`,
//! `/v1/chat/completions`, `/v1/models`, and vLLM's `/tokenize` and `/detokenize`; admin
//! calls (LoRA adapters, prefix-cache resets) go to every instance (`admin.rs`).
//!
//! Each request is routed by its prompt's tokens: token-id prompts are used as they are; a
//! text prompt or chat messages are tokenized by a backend's `/tokenize` (vLLM's, which takes
//! either), and if that fails the request is routed by load alone. The request goes to the
//! chosen instance unchanged: its body, its query, and every end-to-end header as sent
//! (vLLM names a completion by its `X-Request-Id` and takes its `X-data-parallel-rank`;
//! only the headers of the client's connection stay, [`NOT_FORWARDED`]); the response (status, headers, body) comes back as it arrives,
//! chunk by chunk, so a streaming answer's SSE events reach the client when the engine sends
//! them. If the chosen instance refuses the connection or answers 502, 503 or 504 (it did
//! not run the request), or, for a streamed answer, sends no head within the head timeout
//! (vLLM and SGLang send it before they generate, so it did not take the request), the next
//! best is tried, each instance once; if none is left, the latest such answer is the
//! client's. A request that fails before any answer is sent once more on a fresh connection
//! (a kept connection the instance closed as the request was written), then, failing
//! again, to the next best. Once a byte of an answer is sent it is the client's;
//! a body that fails midway is cut off there (the client sees a failure, not an end) and
//! counted as the instance's error. Each instance's requests in flight are counted
//! from the send until the answer's body ends or the client goes away, and each routed
//! request is booked in the router's closed-loop queue (`Router::route_tracked`): its first
//! token is its streamed answer's first chunk (an answer sent whole shows none: its prefill
//! is taken as done when predicted, and nothing is learnt from it), its end the body's end,
//! a request given up on before its first token or whole answer (the client went away, the
//! head timed out) teaches the instance to be at least that late (`Feedback::abandoned`),
//! and an instance that refuses it, answers an error status (not 2xx), streams an error
//! event in place of its first token (`data: {"error": ...}`) or fails after the
//! connection drops the booking: an error is no first token and no decode, and an instance
//! failing fast must not look fast. Server errors are counted per instance, and a streak of
//! them has the instance passed over for a while (`errors.rs`). A request naming a
//! LoRA adapter (vLLM's `model`, SGLang's `lora_path`) is routed by the adapter's keys
//! (`lora.rs`), and its `cache_salt` by the salt's.

use std::sync::PoisonError;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode, Uri, header};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::feedback::FirstToken;
use crate::lora::{self, ModelKind};
use crate::service::{AppState, body_rejected, error};

pub use crate::request_fields::COMPLETION_DEFAULT_MAX_TOKENS;
use crate::request_fields::{self, Kind};

pub mod admin;
mod background;
mod chunks;
mod in_flight;
mod prompt;

use chunks::{Chunk, chunk_of};
use in_flight::InFlight;
use prompt::{previous_response, tokens_of};

/// How long a lookup (`/tokenize`, or `/v1/models` for the adapters) may take in all,
/// whichever instances it asks, before the request is routed without its answer; and how
/// long `/v1/models` waits for each instance it asks.
const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a connection to an instance may take to open. Under the lookups' wait, so that
/// a lookup that finds an instance unreachable learns it ([`Cluster::unreachable`]) and has
/// time left for the next; on a LAN a connection opens in well under a millisecond, and
/// only a lost SYN (retransmitted after 1 s) is lost with it.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long the proxy waits, by default, for the head of a streamed answer
/// (`--head-timeout-s`): vLLM and SGLang send it before they generate, so an instance whose
/// head has not come in this time has not taken the request (it hangs, or its queue is
/// that long), and the next best instance is tried.
pub const HEAD_TIMEOUT_S: f64 = 30.0;

/// A head timeout of `s` seconds: `Some(None)` for 0 (none), `None` for a value that is not
/// a number of seconds at least 0.
pub fn head_timeout(s: f64) -> Option<Option<Duration>> {
    if s == 0.0 {
        return Some(None);
    }
    (s > 0.0)
        .then(|| Duration::try_from_secs_f64(s).ok())?
        .map(Some)
}

/// How long an idle connection to an instance is kept for the next request: under
/// uvicorn's keep-alive (vLLM's and SGLang's HTTP server closes a connection idle 5 s), so
/// the router does not write a request to a connection the server is closing.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(2);

/// The HTTP client to the instances.
#[derive(Clone)]
pub struct Upstream {
    /// Pooled: connections kept for the next request ([`POOL_IDLE_TIMEOUT`]).
    client: Client<HttpConnector, Full<Bytes>>,
    /// Unpooled: a fresh connection per request, for a request sent again after its pooled
    /// connection failed before any answer.
    fresh: Client<HttpConnector, Full<Bytes>>,
    /// How long a streamed answer's head may take ([`HEAD_TIMEOUT_S`]; `None`: for ever).
    head_timeout: Option<Duration>,
}

impl Default for Upstream {
    fn default() -> Self {
        Self::new()
    }
}

impl Upstream {
    pub fn new() -> Self {
        let mut c = HttpConnector::new();
        c.set_connect_timeout(Some(CONNECT_TIMEOUT));
        c.set_nodelay(true);
        Self {
            client: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(POOL_IDLE_TIMEOUT)
                .build(c.clone()),
            fresh: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(0)
                .build(c),
            head_timeout: Some(Duration::from_secs_f64(HEAD_TIMEOUT_S)),
        }
    }

    /// How long a streamed answer's head may take (`None`: for ever).
    pub fn set_head_timeout(&mut self, t: Option<Duration>) {
        self.head_timeout = t;
    }

    /// Whether instance `base` answers `GET /health` with a success within `within` (vLLM's
    /// and SGLang's readiness: 200 once the engine serves); on a fresh connection, so a
    /// pooled one the instance closed is not taken for the instance being down.
    pub async fn healthy(&self, base: &str, within: Duration) -> bool {
        let Ok(uri) = format!("{}/health", base.trim_end_matches('/')).parse::<hyper::Uri>() else {
            return false;
        };
        let Ok(req) = Request::builder()
            .method(Method::GET)
            .uri(uri)
            .body(Full::new(Bytes::new()))
        else {
            return false;
        };
        matches!(
            tokio::time::timeout(within, self.fresh.request(req)).await,
            Ok(Ok(r)) if r.status().is_success()
        )
    }
}

/// A request to one of the proxied APIs ([`Kind::at`]: `/v1/completions`,
/// `/v1/chat/completions`, `/v1/responses`, SGLang's `/generate`, `/v1/embeddings` and the
/// other pooling APIs),
/// forwarded with its query as a request of its kind. A Responses API request is routed by
/// the cache of its `instructions` and `input` (`prompt::responses_messages`), its stream's first
/// token the first event past `response.created` and `response.in_progress`
/// (`chunks::named_chunk`); an Anthropic message (`/v1/messages`) by its `system` and `messages`
/// (`prompt::anthropic_messages`); an embedding (a score, a rerank) reuses no KV and generates
/// nothing, so it is routed by load alone, its prompt not tokenized.
pub async fn api(
    State(st): State<AppState>,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let Some(kind) = Kind::at(uri.path()) else {
        let m = format!("no route {}", uri.path());
        return error(StatusCode::NOT_FOUND, "not_found", m);
    };
    match body {
        Ok(b) => forward(st, &target_of(uri.path(), &uri), kind, headers, b).await,
        Err(e) => body_rejected(&e),
    }
}

/// `/v1/models` from the first instance that answers ([`any_instance`]).
pub async fn models(State(st): State<AppState>, uri: Uri, headers: HeaderMap) -> Response {
    let target = target_of("/v1/models", &uri);
    let passed_over = unavailable_status;
    any_instance(
        &st,
        Method::GET,
        &target,
        &headers,
        Bytes::new(),
        passed_over,
    )
    .await
}

/// vLLM's `POST /tokenize`, `/detokenize` and `/v1/messages/count_tokens` (clients count a
/// prompt's tokens before they send it) from the first instance that answers
/// ([`any_instance`]): every instance serves the same model, and nothing is routed by it.
pub async fn tokenize(
    State(st): State<AppState>,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body {
        Ok(b) => {
            let target = target_of(uri.path(), &uri);
            any_instance(&st, Method::POST, &target, &headers, b, unavailable_status).await
        }
        Err(e) => body_rejected(&e),
    }
}

/// A stored response's `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: from
/// the instance that has it (vLLM and SGLang keep a stored response in the memory of the
/// instance that made it), asked in turn ([`any_instance`]), another's 404 passed over; the
/// last 404 is the client's if none has it.
pub async fn stored_response(
    State(st): State<AppState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let missing = |s: StatusCode| s == StatusCode::NOT_FOUND || unavailable_status(s);
    match body {
        Ok(b) => {
            let get = method == Method::GET;
            let answer = any_instance(
                &st,
                method,
                &target_of(uri.path(), &uri),
                &headers,
                b,
                missing,
            )
            .await;
            background::seen(&st, &uri, get, answer).await
        }
        Err(e) => body_rejected(&e),
    }
}

/// A request that any instance may answer, sent as the client sent it ([`Forward::All`])
/// to the instances in turn (the healthy first, those passed over for their errors not at
/// all while another is left), each awaited at most [`TOKENIZE_TIMEOUT`] until its answer's
/// head; the first answer is the client's. An answer saying the instance is not up (502,
/// 503, 504: a gateway in front of an engine that is starting) is passed over for the next
/// instance's, as a completion's is, and is the client's only if no instance answered
/// otherwise (until 2026-12-07 the first instance's answer was the client's, whatever it
/// was); so is any answer whose status `passed_over` says.
async fn any_instance(
    st: &AppState,
    method: Method,
    target: &str,
    headers: &HeaderMap,
    body: Bytes,
    passed_over: fn(StatusCode) -> bool,
) -> Response {
    let order = st.lock().lookup_order();
    let mut unavailable = None;
    for i in order {
        let Some(base) = st.backends.get(i) else {
            continue;
        };
        let Ok(req) = request(
            method.clone(),
            base,
            target,
            headers,
            body.clone(),
            Forward::All,
        ) else {
            continue;
        };
        let sent = st.upstream.client.request(req);
        match tokio::time::timeout(TOKENIZE_TIMEOUT, sent).await {
            Ok(Ok(resp)) if passed_over(resp.status()) => unavailable = Some((i, resp)),
            Ok(Ok(resp)) => return pass_through(resp, i, None),
            Ok(Err(e)) if e.is_connect() && !out_of_files(&e) => st.lock().unreachable(i),
            _ => {}
        }
    }
    if let Some((i, resp)) = unavailable {
        return pass_through(resp, i, None);
    }
    error(
        StatusCode::BAD_GATEWAY,
        "upstream_unavailable",
        "no instance answered",
    )
}

async fn forward(
    st: AppState,
    target: &str,
    kind: Kind,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let json: Option<Value> = serde_json::from_slice(&body)
        .ok()
        .filter(|_| kind.reuses_kv());
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
        .is_some_and(|v| request_fields::streamed(v, kind));
    // a background response is answered at once, its generation unseen after the answer
    let background = !streamed
        && json
            .as_ref()
            .is_some_and(|v| request_fields::background(v, kind));
    let first = if streamed {
        FirstToken::Reported
    } else {
        FirstToken::AtEstimate
    };
    let output = json
        .as_ref()
        .map_or(0, |v| request_fields::max_tokens(v, kind));
    // a response continuing a stored one runs only where that one is stored
    let holder = match json.as_ref().and_then(previous_response) {
        Some(id) => {
            let target = format!("/v1/responses/{id}");
            let found = |i, _| Some(i);
            lookup(&st, Method::GET, &target, &headers, Bytes::new(), found).await
        }
        None => None,
    };
    // keyed once, before the lock is taken (a long prompt's hashing is most of a decision)
    let keyer = st.lock().keyer();
    let keyed = match tokens {
        Some(t) => {
            let (salt, lora) = (salt.map(str::to_owned), lora.clone());
            // a batch of prompts runs them all: its booking holds every one
            let n = json
                .as_ref()
                .map_or(t.len(), |v| request_fields::prompt_tokens(v, kind, t.len()));
            crate::service::keyed(keyer, t, salt, lora)
                .await
                .map(|h| (h, n))
        }
        None => None,
    };
    // instances tried: refused the connection, answered "unavailable", or sent no head
    let mut tried = Vec::new();
    // whether an instance sent no head in time (the client's error then says so)
    let mut timed_out = false;
    // the latest request that failed before any answer, twice (the client's error says so)
    let mut failed: Option<String> = None;
    // a streamed answer's head is due before the engine generates
    let head_timeout = st.upstream.head_timeout.filter(|_| streamed);
    // the latest "unavailable" answer, passed through if no instance is left
    let mut unavailable: Option<(usize, hyper::Response<hyper::body::Incoming>)> = None;
    loop {
        let decision = {
            let mut c = st.lock();
            // with a holder, every other instance is out
            let out: Vec<usize> = match holder {
                Some(h) => (0..c.instances())
                    .filter(|&i| i != h || tried.contains(&i))
                    .collect(),
                None => tried.clone(),
            };
            match &keyed {
                Some((h, n)) => c.route_tracked_hashed(h, *n, &out, output, first),
                None => c.route_load_only(&out),
            }
        };
        let Some(d) = decision else {
            if let Some((i, resp)) = unavailable {
                return pass_through(resp, i, None);
            }
            if let Some(e) = failed {
                return error(StatusCode::BAD_GATEWAY, "upstream_error", e);
            }
            if timed_out {
                return error(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream_timeout",
                    format!(
                        "no instance sent its answer's head in time, or took the connection ({tried:?})"
                    ),
                );
            }
            return error(
                StatusCode::BAD_GATEWAY,
                "upstream_unavailable",
                format!("every instance refused the connection ({tried:?})"),
            );
        };
        // from here every return ends or cancels the booking (the guard's drop ends it)
        let mut guard = InFlight::new(&st.cluster, &d, first, kind);
        let built = match st.backends.get(d.instance) {
            Some(base) => request(
                Method::POST,
                base,
                target,
                &headers,
                body.clone(),
                Forward::All,
            ),
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
        let mut answer = send(&st.upstream.client, req, head_timeout).await;
        if let Ok(Err(e)) = &answer
            && !e.is_connect()
        {
            // failed before any answer on a pooled connection: most likely one the instance
            // closed as the request was written (an idle connection's keep-alive ran out),
            // which it never read; once more on a fresh connection
            let again = st.backends.get(d.instance).map(|base| {
                let b = body.clone();
                request(Method::POST, base, target, &headers, b, Forward::All)
            });
            if let Some(Ok(req)) = again {
                answer = send(&st.upstream.fresh, req, head_timeout).await;
            }
        }
        let Ok(answer) = answer else {
            // no head in time: the instance did not take the request (it hangs), and nothing
            // was sent to the client yet, so the next best may
            guard.abandon();
            st.lock().answered(d.instance, false);
            drop(guard);
            tried.push(d.instance);
            timed_out = true;
            continue;
        };
        match answer {
            Ok(resp) => {
                guard.answered = true;
                let status = resp.status();
                if !status.is_success() {
                    guard.cancel();
                }
                if status.is_success() || status.is_server_error() {
                    st.lock().answered(d.instance, status.is_success());
                }
                let mut held = None;
                if background
                    && status.is_success()
                    && let Some(b) = guard.booking.take()
                {
                    // its booking outlives the answer, as the instance's work
                    st.lock().background(b, d.instance, d.ttft_s, output);
                    held = Some(b);
                }
                if unavailable_status(status) {
                    // not run there, and nothing sent yet: the next best instance may
                    drop(guard);
                    tried.push(d.instance);
                    unavailable = Some((d.instance, resp));
                    continue;
                }
                let out = pass_through(resp, d.instance, Some(guard));
                return match held {
                    Some(b) => background::named(&st, b, out).await,
                    None => out,
                };
            }
            Err(e) if e.is_connect() && out_of_files(&e) => {
                // the router's own limit, not the instance's refusal: no instance can be
                // connected to now, and none is to blame
                guard.cancel();
                drop(guard);
                st.lock().overloaded(d.instance);
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "router_overloaded",
                    format!("the router is out of file descriptors: {e}"),
                );
            }
            Err(e) if e.is_connect() => {
                guard.cancel();
                drop(guard);
                st.lock().refused(d.instance);
                tried.push(d.instance);
            }
            Err(e) => {
                // failed twice before any answer: the instance's error, and nothing was sent
                // to the client, so the next best may
                guard.cancel();
                drop(guard);
                st.lock().answered(d.instance, false);
                tried.push(d.instance);
                failed = Some(format!("instance {}: {e}", d.instance));
            }
        }
    }
}

/// Whether `e` (or an error it was caused by) is the process or the system running out of
/// file descriptors (`EMFILE`, `ENFILE`): the router's own overload, not the instance's
/// refusal.
fn out_of_files(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        let code = e
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error);
        if matches!(code, Some(libc::EMFILE | libc::ENFILE)) {
            return true;
        }
        next = e.source();
    }
    false
}

/// Sends `req` on `client`, its answer's head awaited at most `head_timeout` (`Err`: not in
/// time).
async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    req: Request<Full<Bytes>>,
    head_timeout: Option<Duration>,
) -> Result<
    Result<hyper::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>,
    tokio::time::error::Elapsed,
> {
    let sent = client.request(req);
    match head_timeout {
        Some(t) => tokio::time::timeout(t, sent).await,
        None => Ok(sent.await),
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

/// Which of the client's headers a request to an instance carries.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Forward {
    /// The client's request itself: every end-to-end header ([`end_to_end`]).
    All,
    /// The router's own call on the client's behalf (`/tokenize`, `/v1/models` for the
    /// adapters): its credentials only, and a JSON body's type.
    Credentials,
}

/// Headers of one connection only (RFC 9110 §7.6.1, and `Proxy-Connection`), never
/// forwarded, with `Host` and `Content-Length` (the request's own URI and body set them) and
/// `Expect` (the router read the whole body already).
const NOT_FORWARDED: [header::HeaderName; 11] = [
    header::CONNECTION,
    header::HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::HOST,
    header::CONTENT_LENGTH,
];

/// The end-to-end headers of `headers`: all but those of the connection ([`NOT_FORWARDED`]
/// and those the `Connection` header names), each value in order. `keep_length`: a
/// `Content-Length` stays (an answer's, whose body is passed on as it is).
fn end_to_end(
    headers: &HeaderMap,
    keep_length: bool,
) -> impl Iterator<Item = (&header::HeaderName, &HeaderValue)> {
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .collect();
    headers.iter().filter(move |(k, _)| {
        let length = keep_length && *k == header::CONTENT_LENGTH;
        let hop = NOT_FORWARDED.contains(k) || *k == header::EXPECT;
        (length || !hop) && !named.iter().any(|n| n == k.as_str())
    })
}

/// A request to instance `base` for `target` (a path and its query), carrying the client's
/// headers as `forward` says.
fn request(
    method: Method,
    base: &str,
    target: &str,
    headers: &HeaderMap,
    body: Bytes,
    forward: Forward,
) -> Result<Request<Full<Bytes>>, String> {
    let uri: hyper::Uri = format!("{}{target}", base.trim_end_matches('/'))
        .parse()
        .map_err(|e| format!("backend URL {base:?}: {e}"))?;
    let mut b = Request::builder().method(method).uri(uri);
    match forward {
        Forward::All => {
            for (k, v) in end_to_end(headers, false) {
                b = b.header(k, v);
            }
        }
        Forward::Credentials => {
            if let Some(v) = headers.get(header::AUTHORIZATION) {
                b = b.header(header::AUTHORIZATION, v);
            }
            if !body.is_empty() {
                b = b.header(header::CONTENT_TYPE, "application/json");
            }
        }
    }
    b.body(Full::new(body)).map_err(|e| e.to_string())
}

/// The path and query a client asked for under `path`: `path` with the query as sent.
fn target_of(path: &str, uri: &Uri) -> String {
    match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    }
}

/// The instance's answer as it comes: status, headers (less hop-by-hop ones), and the body
/// chunk by chunk; the in-flight count ends with the body. A body that fails midway (the
/// instance died or dropped the connection) is the instance's error and cancels the booking:
/// the time to the failure is no decode time; the client's answer is cut off there, so it
/// sees a failure, not an end.
fn pass_through(
    resp: hyper::Response<hyper::body::Incoming>,
    instance: usize,
    guard: Option<InFlight>,
) -> Response {
    let (parts, incoming) = resp.into_parts();
    // counted as a success until the body fails (once)
    let answered_ok = parts.status.is_success();
    let stream = futures::stream::unfold(
        (incoming.into_data_stream(), guard, answered_ok),
        |(mut body, mut guard, mut ok)| async move {
            let chunk = body.next().await;
            if let Some(g) = guard.as_mut() {
                match &chunk {
                    // an error event, in place of the first token or after it: the request
                    // failed in the engine, so no first token and no decode is learnt
                    Some(Ok(c)) if g.streamed => match chunk_of(g.kind, c) {
                        Chunk::Error => g.cancel(),
                        Chunk::Preamble => {}
                        Chunk::Token => g.chunk(),
                    },
                    Some(Ok(_)) => g.chunk(),
                    Some(Err(_)) => g.failed(std::mem::take(&mut ok)),
                    None => g.done = true,
                }
            }
            // the guard drops with the stream: at the body's end, or when the client goes
            chunk.map(|c| (c, (body, guard, ok)))
        },
    );
    let mut out = Response::new(Body::from_stream(stream));
    *out.status_mut() = parts.status;
    for (k, v) in end_to_end(&parts.headers, true) {
        out.headers_mut().append(k, v.clone());
    }
    out.headers_mut()
        .insert("x-kvtier-instance", HeaderValue::from(instance));
    out
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
    let learnt = |_, listing: Value| {
        let mut m = st.models.lock().unwrap_or_else(PoisonError::into_inner);
        (m.learn(&listing) > 0).then(|| m.kind(model) == Some(ModelKind::Adapter))
    };
    let adapter = lookup(st, Method::GET, "/v1/models", headers, Bytes::new(), learnt).await;
    (adapter == Some(true)).then(|| model.to_owned())
}

/// A lookup of the router's own (`/tokenize`, `/v1/models`, a stored response): the first
/// JSON answer that `take` takes (given the instance and its answer), asking the instances
/// in turn ([`Cluster::lookup_order`]: the healthy first, none passed over for its errors
/// while another is left), within [`TOKENIZE_TIMEOUT`] in all; `None` if none did. An instance that cannot be connected to is passed over from now
/// ([`Cluster::unreachable`]).
async fn lookup<T>(
    st: &AppState,
    method: Method,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
    mut take: impl FnMut(usize, Value) -> Option<T>,
) -> Option<T> {
    let order = st.lock().lookup_order();
    let deadline = tokio::time::Instant::now() + TOKENIZE_TIMEOUT;
    for i in order {
        let Some(base) = st.backends.get(i) else {
            continue;
        };
        let Ok(req) = request(
            method.clone(),
            base,
            path,
            headers,
            body.clone(),
            Forward::Credentials,
        ) else {
            continue;
        };
        let call = async {
            let resp = match st.upstream.client.request(req).await {
                Ok(r) => r,
                Err(e) => {
                    if e.is_connect() && !out_of_files(&e) {
                        st.lock().unreachable(i);
                    }
                    return None;
                }
            };
            if !resp.status().is_success() {
                return None;
            }
            let bytes = resp.into_body().collect().await.ok()?.to_bytes();
            serde_json::from_slice::<Value>(&bytes).ok()
        };
        match tokio::time::timeout_at(deadline, call).await {
            Ok(Some(v)) => {
                if let Some(t) = take(i, v) {
                    return Some(t);
                }
            }
            Ok(None) => {}
            Err(_) => return None, // the lookup's time is up
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error caused by another, as hyper-util's connect errors are (its `ConnectError`
    /// wraps the socket's `io::Error`).
    #[derive(Debug)]
    struct Caused(std::io::Error);

    impl std::fmt::Display for Caused {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("tcp open error")
        }
    }

    impl std::error::Error for Caused {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn running_out_of_file_descriptors_is_the_routers_not_a_refusal() {
        let os = std::io::Error::from_raw_os_error;
        for code in [libc::EMFILE, libc::ENFILE] {
            assert!(out_of_files(&os(code)), "{code}");
            assert!(out_of_files(&Caused(os(code))), "{code}, as a cause");
        }
        for code in [libc::ECONNREFUSED, libc::ETIMEDOUT, libc::ENETUNREACH] {
            assert!(!out_of_files(&Caused(os(code))), "{code}");
        }
        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timeout");
        assert!(!out_of_files(&Caused(timed_out)));
    }
}
