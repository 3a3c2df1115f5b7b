//! A background response's booking after its immediate answer (`Cluster::background`): named
//! by the response's id from that answer, and ended when the response is seen done, a
//! `GET /v1/responses/{id}` (not streamed) showing it `completed`, `failed`, `cancelled` or
//! `incomplete`, or a `POST /v1/responses/{id}/cancel` that succeeded. Clients of background
//! mode poll that `GET` until the response is done, so its booking ends about when the
//! instance's work does, not only at its deadline.

use std::time::Duration;

use axum::body::Body;
use axum::http::{StatusCode, Uri};
use axum::response::Response;
use serde_json::Value;

use crate::service::{AppState, error};

/// The most of an answer read to find a response's id or status (a response is a JSON
/// object: its output, for a finished one); one whose `Content-Length` says more passes
/// through unread.
const MAX_READ: usize = 16 << 20;

/// Whether an answer is too long to read ([`MAX_READ`]) by its `Content-Length`.
fn too_long(r: &Response) -> bool {
    r.headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|n| n > MAX_READ as u64)
}

/// How long reading such an answer may take (it is sent whole).
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// A response's statuses once it runs no more.
const DONE: [&str; 4] = ["completed", "failed", "cancelled", "incomplete"];

/// The answer `out` of background booking `booking`, read whole for its response's `id`
/// (which names the booking), then passed on unchanged ([`read_json`]).
pub(super) async fn named(st: &AppState, booking: u64, out: Response) -> Response {
    if too_long(&out) {
        return out;
    }
    let (v, out) = match read_json(out).await {
        Ok(read) => read,
        Err(broke) => return broke,
    };
    if let Some(id) = v.as_ref().and_then(|v| v.get("id")).and_then(Value::as_str) {
        st.lock().background_named(booking, id);
    }
    out
}

/// An answer read whole (it is sent whole, within [`READ_TIMEOUT`]): its JSON, if it is
/// JSON, and the same answer to pass on; an answer that breaks off while read is a 502 (the
/// `Err`), as a whole answer that fails midway is cut off.
async fn read_json(answer: Response) -> Result<(Option<Value>, Response), Response> {
    let (parts, body) = answer.into_parts();
    let read = tokio::time::timeout(READ_TIMEOUT, axum::body::to_bytes(body, MAX_READ)).await;
    let Ok(Ok(bytes)) = read else {
        let m = "the instance's answer broke off";
        return Err(error(StatusCode::BAD_GATEWAY, "upstream_error", m));
    };
    let v = serde_json::from_slice::<Value>(&bytes).ok();
    Ok((v, Response::from_parts(parts, Body::from(bytes))))
}

/// A stored response's answer (`GET /v1/responses/{id}`, `get`; or its cancel), seen on its
/// way to the client: a held background booking of that response ends if the answer shows
/// it done ([`DONE`], or a cancel's success). Others pass untouched (and unread).
pub(super) async fn seen(st: &AppState, uri: &Uri, get: bool, answer: Response) -> Response {
    let Some(id) = uri
        .path()
        .strip_prefix("/v1/responses/")
        .and_then(|r| r.split('/').next())
    else {
        return answer;
    };
    let streamed = uri
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "stream=true"));
    if !answer.status().is_success() || streamed || !st.lock().background_holds(id) {
        return answer;
    }
    if get && too_long(&answer) {
        return answer;
    }
    if !get {
        st.lock().background_done(id);
        return answer;
    }
    let (v, answer) = match read_json(answer).await {
        Ok(read) => read,
        Err(broke) => return broke,
    };
    let status = v
        .as_ref()
        .and_then(|v| v.get("status"))
        .and_then(Value::as_str);
    if status.is_some_and(|s| DONE.contains(&s)) {
        st.lock().background_done(id);
    }
    answer
}
