//! OpenAI-compatible proxy in front of vLLM or SGLang servers: `/v1/completions`,
//! `/v1/responses` (and a stored response's `GET /v1/responses/{id}` and `.../cancel`, from the
//! instance that has it), `/v1/embeddings` and the other pooling APIs (routed by load),
//! Anthropic's `/v1/messages` (and `/v1/messages/count_tokens`), SGLang's `/generate`,
//! `/v1/chat/completions`, `/v1/models`, and vLLM's `/tokenize` and `/detokenize`.
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

use std::sync::{Arc, Mutex, PoisonError};
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

use crate::cluster::{Cluster, Decision};
use crate::feedback::FirstToken;
use crate::lora::{self, ModelKind};
use crate::service::{AppState, body_rejected, error};

pub use crate::request_fields::COMPLETION_DEFAULT_MAX_TOKENS;
use crate::request_fields::{self, Kind};

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

/// Counts a request in flight on an instance until dropped, and reports a tracked request's
/// first token (its answer's first chunk, when streamed) and end (the drop) to the router.
/// Dropped before its first token (streamed) or its answer's head (sent whole), the request
/// was given up on (its client went away): the instance is learnt to be at least that late.
struct InFlight {
    cluster: Arc<Mutex<Cluster>>,
    instance: usize,
    booking: Option<u64>,
    /// Whether the first chunk is the first token (a streamed answer).
    streamed: bool,
    /// Which endpoint's answer it is (how its stream's events read, [`chunk_of`]).
    kind: Kind,
    /// Whether the first chunk is the first token and not seen yet.
    awaiting_first: bool,
    /// The answer's head came (for an answer sent whole: the answer).
    answered: bool,
    /// The answer's body ended.
    done: bool,
}

impl InFlight {
    fn new(cluster: &Arc<Mutex<Cluster>>, d: &Decision, first: FirstToken, kind: Kind) -> Self {
        cluster
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .started(d.instance);
        let streamed = d.booking.is_some() && first == FirstToken::Reported;
        Self {
            cluster: Arc::clone(cluster),
            instance: d.instance,
            booking: d.booking,
            streamed,
            kind,
            awaiting_first: streamed,
            answered: false,
            done: false,
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

    /// The proxy stopped waiting for the answer's head: the booking goes, and the instance
    /// is learnt to be at least as late as it waited.
    fn abandon(&mut self) {
        self.awaiting_first = false;
        if let Some(b) = self.booking.take() {
            self.lock().abandoned(b);
        }
    }

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
        // given up on before the first token, or before a whole answer came
        let waiting = !self.done
            && if self.streamed {
                self.awaiting_first
            } else {
                !self.answered
            };
        let mut c = self.lock();
        c.finished(self.instance);
        match booking {
            Some(b) if waiting => c.abandoned(b),
            Some(b) => c.ended(b),
            None => {}
        }
    }
}

/// A request to one of the proxied APIs ([`Kind::at`]: `/v1/completions`,
/// `/v1/chat/completions`, `/v1/responses`, SGLang's `/generate`, `/v1/embeddings` and the
/// other pooling APIs),
/// forwarded with its query as a request of its kind. A Responses API request is routed by
/// the cache of its `instructions` and `input` ([`responses_messages`]), its stream's first
/// token the first event past `response.created` and `response.in_progress`
/// ([`named_chunk`]); an Anthropic message (`/v1/messages`) by its `system` and `messages`
/// ([`anthropic_messages`]); an embedding (a score, a rerank) reuses no KV and generates
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
            any_instance(
                &st,
                method,
                &target_of(uri.path(), &uri),
                &headers,
                b,
                missing,
            )
            .await
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
                if unavailable_status(status) {
                    // not run there, and nothing sent yet: the next best instance may
                    drop(guard);
                    tried.push(d.instance);
                    unavailable = Some((d.instance, resp));
                    continue;
                }
                return pass_through(resp, d.instance, Some(guard));
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

/// Whether a streamed answer's chunk is an error event, `data: {"error": ...}`: what vLLM
/// sends after a 200 head when a streamed request fails in its generator, and SGLang 0.5's
/// `create_streaming_error_response` (`json.dumps({"error": ErrorResponse.model_dump()})`,
/// yielded once its stream has started).
/// Any event of the chunk counts (a chunk may carry a token's event and the error's).
fn error_event(chunk: &[u8]) -> bool {
    chunk.split(|&b| b == b'\n').any(|line| {
        line.trim_ascii_start()
            .strip_prefix(b"data:")
            .and_then(|rest| rest.trim_ascii_start().strip_prefix(b"{"))
            .is_some_and(|r| r.trim_ascii_start().starts_with(b"\"error\""))
    })
}

/// What a streamed answer's chunk is to its booking.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Chunk {
    /// Events sent before the engine ran the prompt: not its first token.
    Preamble,
    /// An error event: the request failed in the engine ([`error_event`]).
    Error,
    /// Anything else: a token's event (the first is the first token), or the end.
    Token,
}

/// What `chunk` of a streamed answer to a request of `kind` is: an error event for every
/// kind; past that, a completion's, chat's or `/generate`'s chunk is a token, and a
/// response's or an Anthropic message's is read by its events ([`named_chunk`]: a message's
/// first event, `message_start`, comes with its first token in vLLM, an `error` event is
/// its failure, a `ping` no token).
fn chunk_of(kind: Kind, chunk: &[u8]) -> Chunk {
    if error_event(chunk) {
        Chunk::Error
    } else if kind == Kind::Responses {
        named_chunk(chunk, &RESPONSES_PREAMBLE, &RESPONSES_FAILED)
    } else if kind == Kind::Messages {
        named_chunk(chunk, &[b"ping"], &[b"error"])
    } else {
        Chunk::Token
    }
}

/// The Responses API's events that vLLM's `responses_stream_generator` and SGLang's
/// `serving_responses.py` send before the engine runs the prompt (and OpenAI's
/// `response.queued`).
const RESPONSES_PREAMBLE: [&[u8]; 3] = [
    b"response.created",
    b"response.in_progress",
    b"response.queued",
];

/// The Responses API's events that end a stream in failure: `error` and `response.failed`.
const RESPONSES_FAILED: [&[u8]; 2] = [b"error", b"response.failed"];

/// A chunk of a stream of named events (`event: NAME` / `data: {"type": NAME, ...}`, as
/// vLLM's and SGLang's `/v1/responses` and vLLM's `/v1/messages` send them): an error if any
/// event is one of `failed`, a token if any event is not one of `preamble`; a chunk of the
/// preamble alone, or naming no event (a comment, the rest of an event cut across chunks),
/// is no token.
fn named_chunk(chunk: &[u8], preamble: &[&[u8]], failed: &[&[u8]]) -> Chunk {
    let mut named = false;
    let mut names: Vec<&[u8]> = Vec::new();
    let mut types: Vec<String> = Vec::new();
    for line in chunk.split(|&b| b == b'\n') {
        let line = line.trim_ascii();
        if let Some(n) = line.strip_prefix(b"event:") {
            named = true;
            names.push(n.trim_ascii());
        } else if !named && let Some(d) = line.strip_prefix(b"data:") {
            // read only while no event is named (an event's name comes before its data)
            let t = serde_json::from_slice::<Value>(d.trim_ascii())
                .ok()
                .and_then(|v| v.get("type")?.as_str().map(str::to_owned));
            types.extend(t);
        }
    }
    // an event's `event:` line names it; a stream without them, its data's `type`
    let all: Vec<&[u8]> = if named {
        names
    } else {
        types.iter().map(|t| t.as_bytes()).collect()
    };
    if all.iter().any(|n| failed.contains(n)) {
        Chunk::Error
    } else if all.iter().any(|n| !preamble.contains(n)) {
        Chunk::Token
    } else {
        Chunk::Preamble
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
    let learnt = |_, listing: Value| {
        let mut m = st.models.lock().unwrap_or_else(PoisonError::into_inner);
        (m.learn(&listing) > 0).then(|| m.kind(model) == Some(ModelKind::Adapter))
    };
    let adapter = lookup(st, Method::GET, "/v1/models", headers, Bytes::new(), learnt).await;
    (adapter == Some(true)).then(|| model.to_owned())
}

/// The prompt's token ids, from the request or a backend's `/tokenize`; `None` if neither.
async fn tokens_of(st: &AppState, kind: Kind, v: &Value, headers: &HeaderMap) -> Option<Vec<u32>> {
    // vLLM's `list[int]` reads whole floats too (pydantic's lax mode); strings are texts
    let ids = |a: &Value| -> Option<Vec<u32>> {
        a.as_array()?
            .iter()
            .map(|t| {
                t.is_number()
                    .then(|| request_fields::lax_count(t))
                    .flatten()
                    .and_then(|t| u32::try_from(t).ok())
            })
            .collect()
    };
    let model = v.get("model").cloned().unwrap_or(Value::Null);
    let mut ask = match kind {
        Kind::Completion | Kind::Generate => {
            let field = |k| v.get(k).filter(|p: &&Value| !p.is_null());
            let p = match kind {
                Kind::Generate => field("input_ids").or_else(|| field("text"))?,
                _ => field("prompt")?,
            };
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
        Kind::Responses => serde_json::json!({
            "model": model,
            "messages": responses_messages(v)?,
            "add_generation_prompt": true,
            "tools": chat_tools(v, Kind::Responses),
        }),
        Kind::Messages => {
            let mut ask = serde_json::json!({
                "model": model,
                "messages": anthropic_messages(v)?,
                "add_generation_prompt": true,
                "tools": chat_tools(v, Kind::Messages),
            });
            if let (Some(x), Some(m)) = (v.get("chat_template_kwargs"), ask.as_object_mut()) {
                m.insert("chat_template_kwargs".into(), x.clone());
            }
            ask
        }
        Kind::Pooling => return None,
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
    // a request naming no model (SGLang's `/generate`) asks for the served one; one without
    // tools names none
    if let Some(m) = ask.as_object_mut() {
        if model.is_null() {
            m.remove("model");
        }
        if m.get("tools").is_some_and(Value::is_null) {
            m.remove("tools");
        }
    }
    let body = Bytes::from(serde_json::to_vec(&ask).ok()?);
    let tokens = |_, v: Value| ids(v.get("tokens")?);
    lookup(st, Method::POST, "/tokenize", headers, body, tokens).await
}

/// The stored response a Responses API request continues (`previous_response_id`), where
/// it names one that can stand in a path as it is (OpenAI's and vLLM's ids: `resp_` and
/// letters, digits, `-`, `_`).
fn previous_response(v: &Value) -> Option<&str> {
    v.get("previous_response_id")
        .and_then(Value::as_str)
        .filter(|id| {
            !id.is_empty()
                && id.len() <= 256
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// The chat messages a Responses API request is run as, as vLLM 0.34 builds them
/// (`responses/utils.py`'s `construct_input_messages`): `instructions` as the system message,
/// then `input`, a text as the user's message or its items that are messages (an assistant's
/// as its text, another's parts as the chat's, [`chat_parts`]); the items stop at the first
/// that is no message (a tool call, its output, reasoning) or holds a part of another kind,
/// so the messages are a sure prefix of the prompt. `None` without a message.
fn responses_messages(v: &Value) -> Option<Value> {
    let mut messages = Vec::new();
    if let Some(i) = v.get("instructions").and_then(Value::as_str)
        && !i.is_empty()
    {
        messages.push(serde_json::json!({"role": "system", "content": i}));
    }
    match v.get("input")? {
        Value::String(text) => messages.push(serde_json::json!({"role": "user", "content": text})),
        Value::Array(items) => {
            for item in items {
                let Some(role) = item.get("role").and_then(Value::as_str) else {
                    break;
                };
                if role != "assistant" {
                    let content = match item.get("content") {
                        Some(Value::Array(parts)) => match chat_parts(parts) {
                            Some(p) => p,
                            None => break,
                        },
                        Some(c) => c.clone(),
                        None => break,
                    };
                    messages.push(serde_json::json!({"role": role, "content": content}));
                    continue;
                }
                let text = match item.get("content") {
                    Some(Value::String(t)) => t.as_str(),
                    Some(Value::Array(parts)) => parts
                        .first()
                        .and_then(|p| p.get("text").or(Some(p)))
                        .and_then(Value::as_str)
                        .unwrap_or(""),
                    _ => "",
                };
                messages.push(serde_json::json!({"role": "assistant", "content": text}));
            }
        }
        _ => return None,
    }
    (!messages.is_empty()).then_some(Value::Array(messages))
}

/// A Responses message's content parts as the chat's parts that vLLM's chat parser reads
/// them as (`MM_PARSER_MAP`): `input_text` and `output_text` as `text`, an `input_image`'s
/// URL as an `image_url`. vLLM's `/tokenize` takes only the chat's (it refuses `input_text`:
/// until 2026-12-07 a response whose input had such parts, the OpenAI SDK's usual form, was
/// routed by load). `None` for a part of any other kind.
fn chat_parts(parts: &[Value]) -> Option<Value> {
    parts
        .iter()
        .map(|p| match p.get("type").and_then(Value::as_str)? {
            "input_text" | "output_text" | "text" => {
                let text = p.get("text")?.as_str()?;
                Some(serde_json::json!({"type": "text", "text": text}))
            }
            "input_image" => {
                let url = p.get("image_url")?.as_str()?;
                Some(serde_json::json!({"type": "image_url", "image_url": {"url": url}}))
            }
            _ => None,
        })
        .collect()
}

/// A Responses or Anthropic Messages request's tools in the chat's form
/// (`{"type": "function", "function": {...}}`), which the chat template renders into the
/// prompt, as vLLM 0.34 converts them: a response's function tools, their fields but `type`
/// as the function (`construct_tool_dicts`; its built-in tools are no chat tools); a
/// message's tools, `input_schema` as the parameters (`_convert_tools`). `Null` without
/// tools.
fn chat_tools(v: &Value, kind: Kind) -> Value {
    let Some(tools) = v.get("tools").and_then(Value::as_array) else {
        return Value::Null;
    };
    let function = |t: &Value| -> Option<Value> {
        let t = t.as_object()?;
        let f: serde_json::Map<String, Value> = match kind {
            Kind::Responses => {
                if t.get("type").and_then(Value::as_str) != Some("function") {
                    return None;
                }
                t.iter()
                    .filter(|(k, _)| *k != "type")
                    .map(|(k, x)| (k.clone(), x.clone()))
                    .collect()
            }
            _ => [
                "name",
                "description",
                "input_schema",
                "strict",
                "defer_loading",
            ]
            .iter()
            .filter_map(|k| Some((*k, t.get(*k)?)))
            .map(|(k, x)| {
                let k = if k == "input_schema" { "parameters" } else { k };
                (k.to_owned(), x.clone())
            })
            .collect(),
        };
        Some(serde_json::json!({"type": "function", "function": f}))
    };
    let chat: Vec<Value> = tools.iter().filter_map(function).collect();
    if chat.is_empty() {
        Value::Null
    } else {
        Value::Array(chat)
    }
}

/// The chat messages an Anthropic Messages API request is run as, as vLLM 0.34 builds them
/// (`anthropic/serving.py`'s `to_chat_completion_request`): `system` (a text, or its text
/// blocks joined, Claude Code's `x-anthropic-billing-header` block left out) as the system
/// message, then each message whose content is a text or text blocks (one block as its
/// text, several as `text` parts), up to the first holding anything else (a tool use or
/// result, an image, thinking: the messages before it are a sure prefix). `None` without a
/// message.
fn anthropic_messages(v: &Value) -> Option<Value> {
    // a content's texts, `None` if it holds anything but text blocks
    let texts = |c: &Value| -> Option<Vec<String>> {
        match c {
            Value::String(t) => Some(vec![t.clone()]),
            Value::Array(blocks) => blocks
                .iter()
                .filter(|b| b.get("text").and_then(Value::as_str) != Some(""))
                .map(|b| {
                    (b.get("type").and_then(Value::as_str) == Some("text"))
                        .then(|| b.get("text")?.as_str().map(str::to_owned))
                        .flatten()
                })
                .collect(),
            _ => None,
        }
    };
    let mut messages = Vec::new();
    if let Some(system) = v.get("system").and_then(texts) {
        let kept: String = system
            .iter()
            .filter(|t| !t.starts_with("x-anthropic-billing-header"))
            .map(String::as_str)
            .collect();
        if !kept.is_empty() {
            messages.push(serde_json::json!({"role": "system", "content": kept}));
        }
    }
    for m in v.get("messages")?.as_array()? {
        let Some(role) = m.get("role").and_then(Value::as_str) else {
            break;
        };
        let content = m.get("content").unwrap_or(&Value::Null);
        let Some(parts) = texts(content) else {
            break;
        };
        let content = match (content, parts.as_slice()) {
            (Value::String(t), _) => Value::String(t.clone()),
            (_, [one]) => Value::String(one.clone()),
            (_, []) => break,
            (_, many) => many
                .iter()
                .map(|t| serde_json::json!({"type": "text", "text": t}))
                .collect(),
        };
        messages.push(serde_json::json!({"role": role, "content": content}));
    }
    (!messages.is_empty()).then_some(Value::Array(messages))
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
    fn error_events_are_told_from_tokens() {
        for e in [
            &b"data: {\"error\": {\"message\": \"x\"}}\n\n"[..],
            b"data:{\"error\":{}}\n\n",
            b"\n data: { \"error\" : 1}",
            // a token's event and the error's in one chunk
            b"data: {\"choices\": [{\"text\": \"a\"}]}\n\ndata: {\"error\": {}}\n\n",
            // SGLang 0.5.23's, as its serving_completions.py / serving_chat.py yield it
            b"data: {\"error\": {\"object\": \"error\", \"message\": \"boom\", \
              \"type\": \"BadRequestError\", \"param\": null, \"code\": 400}}\n\n",
        ] {
            assert!(error_event(e), "{}", String::from_utf8_lossy(e));
        }
        for t in [
            &b"data: {\"id\": \"c\", \"choices\": [{\"text\": \"\\\"error\\\"\"}]}\n\n"[..],
            b"data: [DONE]\n\n",
            b"data: {\"choices\": [{\"text\": \"a\"}]}\n\ndata: [DONE]\n\n",
            b": ping\n\n",
            b"",
            b"{\"error\": 1}",
        ] {
            assert!(!error_event(t), "{}", String::from_utf8_lossy(t));
        }
    }

    /// A streamed response's chunks as vLLM 0.34 and SGLang send them: the preamble
    /// (`response.created`, `response.in_progress`) is no token, the first delta or item is,
    /// and a failure (`error`, `response.failed`, a completion-style error event) is an error
    /// wherever it comes.
    #[test]
    fn responses_events_are_told_apart() {
        let ev = |name: &str| format!("event: {name}\ndata: {{\"type\":\"{name}\"}}\n\n");
        let r = Kind::Responses;
        let preamble = [
            ev("response.created"),
            ev("response.in_progress"),
            ev("response.created") + &ev("response.in_progress"),
            // an event without its `event:` line (SGLang's data carries the type too)
            "data: {\"type\":\"response.created\"}\n\n".into(),
            // the rest of an event cut across chunks, a comment
            "\"output\":[]}}\n\n".into(),
            ": ping\n\n".into(),
        ];
        for c in &preamble {
            assert_eq!(chunk_of(r, c.as_bytes()), Chunk::Preamble, "{c}");
            assert_eq!(chunk_of(Kind::Chat, c.as_bytes()), Chunk::Token, "{c}");
        }
        for c in [
            ev("response.output_text.delta"),
            ev("response.in_progress") + &ev("response.output_item.added"),
            ev("response.reasoning_text.delta"),
            ev("response.completed"),
            "data: {\"type\":\"response.output_text.delta\",\"delta\":\"a\"}\n\n".into(),
        ] {
            assert_eq!(chunk_of(r, c.as_bytes()), Chunk::Token, "{c}");
        }
        for c in [
            ev("error"),
            ev("response.failed"),
            ev("response.output_text.delta") + &ev("response.failed"),
            "data: {\"type\":\"error\",\"message\":\"x\"}\n\n".into(),
            "data: {\"error\": {\"message\": \"x\"}}\n\n".into(),
        ] {
            assert_eq!(chunk_of(r, c.as_bytes()), Chunk::Error, "{c}");
        }
        // Anthropic's, as vLLM's message_stream_converter sends them
        let m = Kind::Messages;
        assert_eq!(chunk_of(m, ev("message_start").as_bytes()), Chunk::Token);
        assert_eq!(
            chunk_of(m, ev("content_block_delta").as_bytes()),
            Chunk::Token
        );
        assert_eq!(chunk_of(m, ev("ping").as_bytes()), Chunk::Preamble);
        assert_eq!(chunk_of(m, ev("error").as_bytes()), Chunk::Error);
        assert_eq!(chunk_of(Kind::Chat, ev("error").as_bytes()), Chunk::Token);
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
