//! `GET /readiness`: whether the router can serve a request now. An orchestrator asks two
//! questions of a proxy: is the process alive (`/health`, the router's own answer, whatever
//! its instances do) and may traffic be sent to it (this). Before, only the first had an
//! answer, so a router whose every instance was down stayed in a load balancer's rotation
//! and answered each request with an error.
//!
//! 200 when at least one instance answers its own `GET /health` (vLLM's and SGLang's
//! readiness) within [`PROBE_TIMEOUT`], 503 otherwise; the body names the instances up.
//! The instances are asked at once, so the answer takes at most [`PROBE_TIMEOUT`]. A router
//! without instances (`/route` only) is ready.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::service::AppState;

/// How long an instance may take to answer its `/health`.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// `GET /readiness` (module doc).
pub async fn readiness(State(st): State<AppState>) -> Response {
    let probes = st
        .backends
        .iter()
        .map(|base| st.upstream.healthy(base, PROBE_TIMEOUT));
    let up: Vec<usize> = futures::future::join_all(probes)
        .await
        .into_iter()
        .enumerate()
        .filter_map(|(i, ok)| ok.then_some(i))
        .collect();
    let instances = st.backends.len();
    let status = if up.is_empty() && instances > 0 {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let body = serde_json::json!({
        "status": if status == StatusCode::OK { "ready" } else { "unavailable" },
        "instances": instances,
        "instances_up": up,
    });
    (status, Json(body)).into_response()
}
