//! Admin calls that change an instance's state, which every instance must share: vLLM's
//! `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (runtime LoRA updating) and
//! `POST /reset_prefix_cache`; SGLang's `/load_lora_adapter`, `/load_lora_adapter_from_tensors`,
//! `/unload_lora_adapter` and `/flush_cache` (`GET` or `POST`).
//!
//! Sent to one instance, they would leave the fleet inconsistent: an adapter loaded on one
//! instance, and a request for it routed by the cache to another that lacks it (a 404 for
//! the user). So each is sent, as the client sent it, to every instance at once, each
//! awaited at most its [`timeout`]; the client gets 200 (the first instance's answer) only
//! if every instance succeeded: a 2xx whose JSON body, if any, does not say
//! `"success": false` (vLLM's reset answers 200 `{"success": false}` while blocks are held).
//! Otherwise the answer is an error whose JSON names each instance's outcome (its status,
//! `null` if it sent none, and its answer or the failure), so the operator can retry where it
//! failed: the status every instance answered if they all refused alike with a 4xx (the
//! call's own fault), else 502. Never a partial silent success.
//!
//! What they change reaches the router too, for the instances that succeeded: a loaded
//! adapter's name routes by the adapter's keys at once and an unloaded one's no longer
//! (`lora::ModelNames`, without waiting for `/v1/models` to be read again); a reset prefix
//! cache drops the instance's pages from the index at once (`Cluster::cache_reset`). vLLM and
//! SGLang also publish `AllBlocksCleared` on a reset, but only at the engine's next event
//! batch, and only where events are configured: a request sent right after the reset's answer
//! would be routed by pages that are gone. The event, when it comes, clears nothing more; a
//! batch published before the reset but folded after the drop is cleared again by it, as it
//! comes after that batch in the instance's stream.

use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use serde_json::{Value, json};

use super::{Forward, out_of_files, request, target_of};
use crate::service::{AppState, body_rejected};

/// What an admin call changes, beside the instances.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admin {
    LoraLoad,
    LoraUnload,
    CacheReset,
}

/// The admin paths, and what each changes.
pub const PATHS: [(&str, Admin); 7] = [
    ("/v1/load_lora_adapter", Admin::LoraLoad),
    ("/v1/unload_lora_adapter", Admin::LoraUnload),
    ("/reset_prefix_cache", Admin::CacheReset),
    ("/load_lora_adapter", Admin::LoraLoad),
    ("/load_lora_adapter_from_tensors", Admin::LoraLoad),
    ("/unload_lora_adapter", Admin::LoraUnload),
    ("/flush_cache", Admin::CacheReset),
];

/// How long an instance may take to answer: loading an adapter reads its weights (from a
/// local path, or downloads them through vLLM's resolver), seconds to a minute or two for a
/// large one; a cache reset waits for the engine's step, and SGLang's `/flush_cache` as long
/// as its `timeout` query asks (the operator's to keep under this).
pub fn timeout(a: Admin) -> Duration {
    match a {
        Admin::LoraLoad | Admin::LoraUnload => Duration::from_secs(300),
        Admin::CacheReset => Duration::from_secs(60),
    }
}

/// The most of an instance's answer read (an admin answer is a line or a small JSON).
const MAX_ANSWER: usize = 1 << 20;

/// The most of an instance's answer quoted in a failure's body.
const QUOTED: usize = 4096;

/// One instance's answer to an admin call.
struct Outcome {
    status: Option<StatusCode>,
    content_type: Option<HeaderValue>,
    body: Bytes,
    /// Why it sent no (whole) answer.
    error: Option<String>,
}

impl Outcome {
    fn failed(e: impl Into<String>) -> Self {
        Self {
            status: None,
            content_type: None,
            body: Bytes::new(),
            error: Some(e.into()),
        }
    }

    /// A 2xx whose JSON body does not say `"success": false`.
    fn ok(&self) -> bool {
        self.error.is_none()
            && self.status.is_some_and(|s| s.is_success())
            && serde_json::from_slice::<Value>(&self.body)
                .ok()
                .and_then(|v| v.get("success").and_then(Value::as_bool))
                != Some(false)
    }

    /// The answer as the failure's body quotes it: its JSON, or its text (cut short).
    fn quoted(&self) -> Value {
        if let Ok(v) = serde_json::from_slice::<Value>(&self.body) {
            return v;
        }
        let text = String::from_utf8_lossy(&self.body);
        Value::String(text.chars().take(QUOTED).collect())
    }
}

/// An admin call ([`PATHS`]), fanned out to every instance (the module's doc).
pub async fn fan_out(
    State(st): State<AppState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) => return body_rejected(&e),
    };
    let Some(&(_, admin)) = PATHS.iter().find(|(p, _)| *p == uri.path()) else {
        let m = format!("no route {}", uri.path());
        return crate::service::error(StatusCode::NOT_FOUND, "not_found", m);
    };
    let target = target_of(uri.path(), &uri);
    let within = timeout(admin);
    let calls = st.backends.iter().enumerate().map(|(i, base)| {
        let req = request(
            method.clone(),
            base,
            &target,
            &headers,
            body.clone(),
            Forward::All,
        );
        let st = &st;
        async move {
            let req = match req {
                Ok(r) => r,
                Err(e) => return Outcome::failed(e),
            };
            let call = async {
                let resp = match st.upstream.client.request(req).await {
                    Ok(r) => r,
                    Err(e) => {
                        if e.is_connect() && !out_of_files(&e) {
                            st.lock().unreachable(i);
                        }
                        return Outcome::failed(format!("no answer: {e}"));
                    }
                };
                let (parts, incoming) = resp.into_parts();
                let read = Limited::new(incoming, MAX_ANSWER).collect().await;
                let (body, error) = match read {
                    Ok(b) => (b.to_bytes(), None),
                    Err(e) => (Bytes::new(), Some(format!("its answer failed: {e}"))),
                };
                Outcome {
                    status: Some(parts.status),
                    content_type: parts.headers.get(header::CONTENT_TYPE).cloned(),
                    body,
                    error,
                }
            };
            match tokio::time::timeout(within, call).await {
                Ok(o) => o,
                Err(_) => Outcome::failed(format!(
                    "no answer within {} s (it may still complete there)",
                    within.as_secs()
                )),
            }
        }
    });
    let outcomes = futures::future::join_all(calls).await;
    let ok: Vec<usize> = (0..outcomes.len()).filter(|&i| outcomes[i].ok()).collect();
    learn(&st, admin, &body, &ok);
    match (verdict(&outcomes), outcomes.first()) {
        (StatusCode::OK, Some(first)) => answer(first, outcomes.len()),
        (status, _) => failure(&st, &outcomes, ok.len(), status),
    }
}

/// The client's status: 200 if every instance succeeded (and there is one); else the status
/// every instance answered, if they refused alike with a 4xx (the call's own fault); else 502.
fn verdict(outcomes: &[Outcome]) -> StatusCode {
    if !outcomes.is_empty() && outcomes.iter().all(Outcome::ok) {
        return StatusCode::OK;
    }
    let statuses: Vec<Option<StatusCode>> = outcomes
        .iter()
        .map(|o| o.status.filter(|_| o.error.is_none()))
        .collect();
    match statuses.first() {
        Some(Some(s)) if s.is_client_error() && statuses.iter().all(|x| *x == Some(*s)) => *s,
        _ => StatusCode::BAD_GATEWAY,
    }
}

/// What the instances in `ok` changed, told to the router.
fn learn(st: &AppState, admin: Admin, body: &Bytes, ok: &[usize]) {
    if ok.is_empty() {
        return;
    }
    match admin {
        Admin::CacheReset => {
            let mut c = st.lock();
            for &i in ok {
                c.cache_reset(i);
            }
        }
        Admin::LoraLoad | Admin::LoraUnload => {
            let v = serde_json::from_slice::<Value>(body).ok();
            let Some(name) = v
                .as_ref()
                .and_then(|v| v.get("lora_name"))
                .and_then(Value::as_str)
            else {
                return;
            };
            let mut m = st
                .models
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if admin == Admin::LoraLoad {
                m.loaded(name);
            } else {
                m.unloaded(name);
            }
        }
    }
}

/// Every instance succeeded: the first one's answer, and how many answered it.
fn answer(first: &Outcome, instances: usize) -> Response {
    let mut out = Response::new(Body::from(first.body.clone()));
    *out.status_mut() = first.status.unwrap_or(StatusCode::OK);
    if let Some(ct) = &first.content_type {
        out.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
    }
    out.headers_mut()
        .insert("x-kvtier-instances", HeaderValue::from(instances));
    out
}

/// Some instance failed: each instance's outcome, under `status` ([`verdict`]).
fn failure(st: &AppState, outcomes: &[Outcome], ok: usize, status: StatusCode) -> Response {
    let instances: Vec<Value> = outcomes
        .iter()
        .enumerate()
        .map(|(i, o)| {
            json!({
                "instance": i,
                "url": st.backends.get(i),
                "ok": o.ok(),
                "status": o.status.map(|s| s.as_u16()),
                "body": o.quoted(),
                "error": o.error,
            })
        })
        .collect();
    let failed = outcomes.len() - ok;
    let message = format!(
        "{failed} of {} instances failed (each instance's outcome is in `instances`): the \
         instances may differ now; retry where it failed",
        outcomes.len()
    );
    let body = json!({"error": {
        "message": message, "type": "fan_out_failed", "instances": instances,
    }});
    let mut out = axum::response::IntoResponse::into_response(axum::Json(body));
    *out.status_mut() = status;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn outcome(status: Option<u16>, body: &str) -> Outcome {
        Outcome {
            status: status.and_then(|s| StatusCode::from_u16(s).ok()),
            content_type: None,
            body: Bytes::from(body.to_owned()),
            error: status.is_none().then(|| "no answer".to_owned()),
        }
    }

    proptest! {
        /// 200 exactly when every instance succeeded; a failure is never a 2xx, and is a
        /// 4xx only when every instance answered that same 4xx.
        #[test]
        fn the_client_gets_200_only_if_every_instance_succeeded(
            answers in proptest::collection::vec(
                (proptest::option::of(prop::sample::select(vec![200u16, 204, 400, 404, 500, 503])),
                 prop::sample::select(vec!["", "{\"success\":true}", "{\"success\":false}", "Success"])),
                0..5,
            )
        ) {
            let outcomes: Vec<Outcome> =
                answers.iter().map(|(s, b)| outcome(*s, b)).collect();
            let all_ok = !outcomes.is_empty() && outcomes.iter().all(Outcome::ok);
            let v = verdict(&outcomes);
            prop_assert_eq!(v == StatusCode::OK, all_ok);
            if !all_ok {
                prop_assert!(!v.is_success());
                if v.is_client_error() {
                    prop_assert!(answers.iter().all(|(s, _)| *s == Some(v.as_u16())));
                }
            }
        }
    }

    #[test]
    fn a_success_false_is_a_failure() {
        assert!(outcome(Some(200), r#"{"success":true}"#).ok());
        assert!(outcome(Some(200), "Success: LoRA adapter 'sql' added successfully.").ok());
        assert!(!outcome(Some(200), r#"{"success":false}"#).ok());
        assert!(!outcome(Some(400), "").ok());
        assert!(!outcome(None, "").ok());
    }
}
