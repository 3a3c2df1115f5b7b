//! The router's HTTP API: `POST /route`, `GET /stats`, `GET /health`, and, with backends
//! configured, the OpenAI-compatible proxy ([`crate::proxy`]).
//!
//! A `POST /route` client that sends the request itself can close the router's loop as the
//! proxy does: with `"track": true` the answer carries a `booking`, and the client reports
//! `POST /bookings/{booking}/first_token`, then `/end` (or `/cancel` if the instance refused
//! it). A booking whose end never comes expires after `--booking-ttl-s`, so a client that
//! dies costs at worst a few worse choices, never a queue counted forever.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Json;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;

use crate::cluster::{Cluster, Keyer, Report};
use crate::feedback::FirstToken;
use crate::lora::ModelNames;
use crate::proxy::{self, Upstream};

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    pub cluster: Arc<Mutex<Cluster>>,
    /// The instances' base URLs (`http://host:port`, instance `i` is `backends[i]`); empty: no
    /// proxy, `/route` only.
    pub backends: Arc<Vec<String>>,
    pub upstream: Upstream,
    /// Which `model` names are LoRA adapters (the proxy reads the instances' `/v1/models`).
    pub models: Arc<Mutex<ModelNames>>,
    /// How long a client's connection may take to send a request's head ([`serve`]).
    pub header_timeout: Duration,
}

impl AppState {
    pub fn new(cluster: Arc<Mutex<Cluster>>, backends: Vec<String>) -> Self {
        Self {
            cluster,
            backends: Arc::new(backends),
            upstream: Upstream::new(),
            models: Arc::new(Mutex::new(ModelNames::default())),
            header_timeout: Duration::from_secs_f64(HEADER_TIMEOUT_S),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `POST /route`'s body.
#[derive(Debug, Deserialize)]
pub struct RouteRequest {
    pub token_ids: Vec<u32>,
    #[serde(default)]
    pub salt: Option<String>,
    #[serde(default)]
    pub lora_name: Option<String>,
    /// Book the request: its first token and end will be reported by its booking.
    #[serde(default)]
    pub track: bool,
    /// With `track`: the tokens it may generate (0 if unknown), at most
    /// [`crate::Router::max_output_tokens`] (the device's tokens): more is a 400.
    #[serde(default)]
    pub max_tokens: usize,
    /// With `track`: whether its first token will be reported (a streamed answer); when
    /// not, its prefill is taken as done when predicted.
    #[serde(default = "yes")]
    pub report_first_token: bool,
}

fn yes() -> bool {
    true
}

/// An error answer: `{"error": {"message", "type"}}`, OpenAI's shape.
pub fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = serde_json::json!({"error": {"message": message.into(), "type": kind}});
    (status, Json(body)).into_response()
}

/// The API's JSON error for a request body that could not be read: 413 past [`MAX_BODY`],
/// 400 for a body that broke off.
pub fn body_rejected(e: &BytesRejection) -> Response {
    if caused_by_idle_body(e) {
        return error(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "the request's body stopped coming",
        );
    }
    let status = e.status();
    let kind = if status == StatusCode::PAYLOAD_TOO_LARGE {
        "request_too_large"
    } else {
        "invalid_request"
    };
    error(status, kind, e.body_text())
}

async fn route(
    State(st): State<AppState>,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) => return body_rejected(&e),
    };
    let req: RouteRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_request", e.to_string()),
    };
    let most = st.lock().router().max_output_tokens();
    if req.max_tokens > most {
        let m = format!(
            "max_tokens {} is more than an instance's device holds ({most} tokens)",
            req.max_tokens
        );
        return error(StatusCode::BAD_REQUEST, "invalid_request", m);
    }
    // the prompt is keyed before the lock is taken: hashing a long prompt is most of a
    // decision's cost, and other decisions and the streams' folds wait for the lock
    let keyer = st.lock().keyer();
    let tokens = req.token_ids.len();
    let Some(hashes) = keyed(keyer, req.token_ids, req.salt, req.lora_name).await else {
        let m = "the prompt could not be keyed";
        return error(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", m);
    };
    let d = if req.track {
        let first = if req.report_first_token {
            FirstToken::Reported
        } else {
            FirstToken::AtEstimate
        };
        st.lock()
            .route_booked_hashed(&hashes, tokens, req.max_tokens, first)
    } else {
        st.lock().route_hashed(&hashes, tokens, &[])
    };
    match d {
        Some(d) => {
            let mut v = serde_json::json!(d);
            if let (Some(url), Some(m)) = (st.backends.get(d.instance), v.as_object_mut()) {
                m.insert("url".into(), url.clone().into());
            }
            Json(v).into_response()
        }
        None => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_instances",
            "the router has no instances",
        ),
    }
}

/// A prompt's page keys ([`Keyer::hashes`]), computed on a blocking thread (a long prompt
/// takes a while) and without the cluster's lock; `None` if that thread failed.
pub async fn keyed(
    keyer: Keyer,
    tokens: Vec<u32>,
    salt: Option<String>,
    lora: Option<String>,
) -> Option<Vec<u64>> {
    tokio::task::spawn_blocking(move || keyer.hashes(&tokens, salt.as_deref(), lora.as_deref()))
        .await
        .ok()
}

/// `POST /bookings/{booking}/{first_token|end|cancel}`: 204, or 404 for a booking that is
/// not open (never made over `/route`, ended, expired; a second first token); 400 for a
/// booking that is not a number (0 to 2^64 - 1), 404 for another report. Every error in the
/// API's JSON shape ([`error`]), nothing changed.
async fn report(
    State(st): State<AppState>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let (booking, what) = match path {
        Ok(Path(p)) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_request", e.body_text()),
    };
    let Ok(booking) = booking.parse::<u64>() else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("booking {booking:?} is not a booking number (0 to 2^64 - 1)"),
        );
    };
    let what = match what.as_str() {
        "first_token" => Report::FirstToken,
        "end" => Report::End,
        "cancel" => Report::Cancel,
        other => {
            return error(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no report {other:?}: first_token, end or cancel"),
            );
        }
    };
    if st.lock().report(booking, what) {
        StatusCode::NO_CONTENT.into_response()
    } else {
        error(
            StatusCode::NOT_FOUND,
            "unknown_booking",
            format!(
                "booking {booking} is not open (ended, expired, never made, or its first token already reported)"
            ),
        )
    }
}

async fn stats(State(st): State<AppState>) -> Response {
    Json(st.lock().stats()).into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    let text = crate::metrics::render(&st.lock().stats());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn health(State(st): State<AppState>) -> Response {
    let c = st.lock();
    let synced = c.streams.iter().filter(|s| s.next_seq.is_some()).count();
    Json(serde_json::json!({
        "status": "ok", "instances": c.instances(),
        "streams": c.streams.len(), "streams_synced": synced,
    }))
    .into_response()
}

/// The HTTP routes (the proxy's only when there are backends).
pub fn app(st: AppState) -> axum::Router {
    let mut r = axum::Router::new()
        .route("/route", post(route))
        .route("/bookings/{booking}/{what}", post(report))
        .route("/stats", get(stats))
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .route("/readiness", get(crate::readiness::readiness));
    if !st.backends.is_empty() {
        for (path, _) in crate::request_fields::Kind::PATHS {
            r = r.route(path, post(proxy::api));
        }
        r = r
            .route("/v1/responses/{id}", get(proxy::stored_response))
            .route("/v1/responses/{id}/cancel", post(proxy::stored_response))
            .route("/v1/models", get(proxy::models))
            .route("/tokenize", post(proxy::tokenize))
            .route("/detokenize", post(proxy::tokenize))
            .route("/v1/messages/count_tokens", post(proxy::tokenize));
        for (path, _) in proxy::admin::PATHS {
            // SGLang's `/flush_cache` takes a GET too
            let fan_out = if path == "/flush_cache" {
                get(proxy::admin::fan_out).post(proxy::admin::fan_out)
            } else {
                post(proxy::admin::fan_out)
            };
            r = r.route(path, fan_out);
        }
    }
    let idle = st.header_timeout;
    // chat requests with images or long prompts pass axum's 2 MB default
    r.layer(axum::middleware::map_request_with_state(idle, idle_body))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(st)
}

/// The request's body, failing ([`BodyIdle`]) when no byte of it comes within `idle`
/// (the header timeout): a client that sent a head and stops sending its body is answered
/// 408 and its connection closed, not waited for for ever.
async fn idle_body(
    State(idle): State<Duration>,
    req: axum::extract::Request,
) -> axum::extract::Request {
    req.map(|b| axum::body::Body::new(IdleBody::new(b, idle)))
}

/// A request body whose frames must come within `idle` of each other (and of the head).
struct IdleBody {
    inner: axum::body::Body,
    idle: Duration,
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl IdleBody {
    fn new(inner: axum::body::Body, idle: Duration) -> Self {
        Self {
            inner,
            idle,
            sleep: Box::pin(tokio::time::sleep(idle)),
        }
    }
}

/// A request's body stopped coming ([`IdleBody`]).
#[derive(Debug)]
struct BodyIdle;

impl std::fmt::Display for BodyIdle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request's body stopped coming")
    }
}

impl std::error::Error for BodyIdle {}

impl axum::body::HttpBody for IdleBody {
    type Data = axum::body::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        use std::task::Poll;
        let this = self.get_mut();
        match std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(f) => {
                let next = tokio::time::Instant::now() + this.idle;
                this.sleep.as_mut().reset(next);
                Poll::Ready(f.map(|r| r.map_err(Into::into)))
            }
            Poll::Pending if this.sleep.as_mut().poll(cx).is_ready() => {
                Poll::Ready(Some(Err(Box::new(BodyIdle))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Whether a body was refused because it stopped coming ([`BodyIdle`]).
fn caused_by_idle_body(e: &BytesRejection) -> bool {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(e) = next {
        if e.is::<BodyIdle>() {
            return true;
        }
        next = e.source();
    }
    false
}

/// A path the router does not serve: the API's JSON 404 (axum's own is an empty body).
async fn not_found(uri: axum::http::Uri) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route {}", uri.path()),
    )
}

/// A method a path does not take: the API's JSON 405.
async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not served on {}", uri.path()),
    )
}

/// How long, by default, a client's connection may take to send a request's head
/// ([`crate::launch::Config::header_timeout_s`]), from its start or its previous answer.
pub const HEADER_TIMEOUT_S: f64 = 30.0;

/// The largest request body accepted (a 413 beyond).
pub const MAX_BODY: usize = 64 << 20;

/// Serves `app` on a bound listener until `shutdown` resolves, then lets the connections
/// finish their requests in flight. HTTP/1.1 (and 1.0), each connection closed when a
/// request's head has not come within [`AppState::header_timeout`] from the connection's
/// start or its previous answer: a client that never finishes a head (slowloris) or keeps
/// a connection idle holds it that long, not for ever. (`axum::serve` had no such timeout:
/// enough such connections took every file descriptor, and no client was served.)
pub async fn serve(
    listener: tokio::net::TcpListener,
    st: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let header_timeout = st.header_timeout;
    let app = app(st);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    // every connection holds a receiver; all dropped: every connection ended
    let (close_tx, close_rx) = tokio::sync::watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let io = tokio::select! {
            a = listener.accept() => match a {
                Ok((io, _)) => io,
                Err(e) => {
                    accept_failed(&e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = io.set_nodelay(true);
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = http.serve_connection(TokioIo::new(io), svc).with_upgrades();
        let mut close = close_rx.clone();
        tokio::spawn(async move {
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = close.changed() => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
            drop(close);
        });
    }
    drop(listener);
    drop(close_rx);
    let _ = close_tx.send(());
    close_tx.closed().await;
    Ok(())
}

/// After a failed accept: a connection that failed before it was accepted is nothing; any
/// other error (out of file descriptors) is waited out a little, as `axum::serve` does, so
/// the loop does not spin.
async fn accept_failed(e: &std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if !matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Binds `addr` (port 0: a free one) and returns the listener and its address.
pub async fn bind(addr: SocketAddr) -> std::io::Result<(tokio::net::TcpListener, SocketAddr)> {
    let l = tokio::net::TcpListener::bind(addr).await?;
    let a = l.local_addr()?;
    Ok((l, a))
}
