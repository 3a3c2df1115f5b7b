//! The prompt a request is routed by: its token ids where it carries them, else the text or
//! chat an instance's `/tokenize` turns into the tokens the engine will run — for the
//! Responses and Anthropic Messages APIs the chat vLLM builds from them (instructions or
//! system, messages, tools), up to the first item whose rendering the router cannot be sure
//! of, so the tokens are a prefix of the engine's prompt.

use axum::http::{HeaderMap, Method};
use bytes::Bytes;
use serde_json::Value;

use super::lookup;
use crate::request_fields::{self, Kind};
use crate::service::AppState;

/// The prompt's token ids, from the request or a backend's `/tokenize`; `None` if neither.
pub(super) async fn tokens_of(
    st: &AppState,
    kind: Kind,
    v: &Value,
    headers: &HeaderMap,
) -> Option<Vec<u32>> {
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
pub(super) fn previous_response(v: &Value) -> Option<&str> {
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
