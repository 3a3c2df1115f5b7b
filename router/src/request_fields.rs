//! What the proxy reads of an OpenAI request's body — whether the answer is streamed and how
//! many tokens it may generate — read as the engines read it.
//!
//! Why not `Value::as_bool` / `as_u64`: vLLM's and SGLang's request models are pydantic
//! models in lax mode, which take `"stream": "true"` (or `1`, `"yes"`) as streamed and
//! `"max_tokens": 100.0` as 100. Read strictly, such a request was booked as an answer sent
//! whole (no head timeout, no first token learnt) and with the default 16 tokens, while the
//! engine streamed it and generated 100. The rules here are pydantic's lax ones; a value they
//! refuse the engine refuses too (HTTP 400), so what the router books for it does not matter.
//! And `n` sequences (SGLang's and vLLM's `n`, vLLM's older `best_of`) each generate up to
//! `max_tokens` with KV of their own, so the booked output is the product.

use serde_json::Value;

/// Which OpenAI endpoint a request came to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

/// What a completion that names no `max_tokens` generates at most: the OpenAI API's default,
/// which vLLM's and SGLang's `/v1/completions` follow (a chat's default is the context left,
/// which the router does not know).
pub const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

/// pydantic's lax boolean: `true`/`false`, the integers 0 and 1, and the strings `0`, `off`,
/// `f`, `false`, `n`, `no`, `1`, `on`, `t`, `true`, `y`, `yes` in any case; anything else is
/// not a boolean (`None`).
pub(crate) fn lax_bool(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::Number(n) => match n.as_u64() {
            Some(0) => Some(false),
            Some(1) => Some(true),
            _ => None,
        },
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            _ => None,
        },
        _ => None,
    }
}

/// pydantic's lax non-negative integer: an integer, a float with no fractional part, or a
/// string of one (surrounding whitespace allowed); anything else `None`.
pub(crate) fn lax_count(v: &Value) -> Option<u64> {
    let whole = |x: f64| (x.is_finite() && x >= 0.0 && x.fract() == 0.0).then_some(x);
    match v {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .and_then(whole)
                .map(|x| x.min(u64::MAX as f64) as u64)
        }),
        Value::String(s) => {
            let t = s.trim();
            t.parse::<u64>().ok().or_else(|| {
                t.parse::<f64>()
                    .ok()
                    .and_then(whole)
                    .map(|x| x.min(u64::MAX as f64) as u64)
            })
        }
        _ => None,
    }
}

/// Whether the answer is streamed (its first chunk is its first token).
pub(crate) fn streamed(v: &Value) -> bool {
    v.get("stream").and_then(lax_bool) == Some(true)
}

/// The tokens a request may generate: its `max_completion_tokens` or `max_tokens` (when it
/// names neither, a completion's default, [`COMPLETION_DEFAULT_MAX_TOKENS`], and for a chat
/// 0: unknown), times the sequences it asks for (`n`, or `best_of` where larger). The
/// router's memory timeline ends each request by it (docs/router/history.md, "What the router
/// is told of each answer").
pub(crate) fn max_tokens(v: &Value, kind: Kind) -> usize {
    let named = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| v.get(*k).and_then(lax_count));
    let each = match (named, kind) {
        (Some(n), _) => usize::try_from(n).unwrap_or(usize::MAX),
        (None, Kind::Completion) => COMPLETION_DEFAULT_MAX_TOKENS,
        (None, Kind::Chat) => 0,
    };
    each.saturating_mul(sequences(v))
        .saturating_mul(prompts(v, kind))
}

/// How many prompts the request runs: a completion whose `prompt` is a list of prompts
/// (texts, or token-id lists) runs each of them; any other request, one.
pub(crate) fn prompts(v: &Value, kind: Kind) -> usize {
    match (kind, v.get("prompt").and_then(Value::as_array)) {
        (Kind::Completion, Some(a))
            if !a.is_empty() && a.iter().all(|p| p.is_string() || p.is_array()) =>
        {
            a.len()
        }
        _ => 1,
    }
}

/// The prompt tokens the request runs, given its first prompt's `first` (the one it is
/// routed by): a batch of token-id lists counts each list; a batch of texts (not tokenized
/// past the first) counts each as long as the first.
pub(crate) fn prompt_tokens(v: &Value, kind: Kind, first: usize) -> usize {
    let n = prompts(v, kind);
    let lists = v.get("prompt").and_then(Value::as_array);
    match lists {
        Some(a) if n > 1 && a.iter().all(Value::is_array) => a
            .iter()
            .map(|p| p.as_array().map_or(0, Vec::len))
            .fold(0, usize::saturating_add),
        _ => first.saturating_mul(n),
    }
}

/// How many sequences the request generates: the larger of `n` and `best_of`, at least 1.
fn sequences(v: &Value) -> usize {
    ["n", "best_of"]
        .iter()
        .filter_map(|k| v.get(*k).and_then(lax_count))
        .max()
        .map_or(1, |n| usize::try_from(n).unwrap_or(usize::MAX).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
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

    /// What vLLM's and SGLang's pydantic models take in lax mode is what the engine does:
    /// a request streamed as `"stream": "true"` was booked as sent whole, and
    /// `"max_tokens": 100.0` as the default 16.
    #[test]
    fn fields_are_read_as_the_engines_lax_models_read_them() {
        for s in [
            json!(true),
            json!("true"),
            json!("True"),
            json!(1),
            json!("yes"),
            json!("on"),
        ] {
            assert!(streamed(&json!({ "stream": s })), "{s}");
        }
        for s in [
            json!(false),
            json!("false"),
            json!(0),
            json!("no"),
            json!(null),
            json!("maybe"),
            json!(2),
        ] {
            assert!(!streamed(&json!({ "stream": s })), "{s}");
        }
        assert!(!streamed(&json!({})));
        let c = Kind::Completion;
        assert_eq!(max_tokens(&json!({"max_tokens": 100.0}), c), 100);
        assert_eq!(max_tokens(&json!({"max_tokens": "100"}), c), 100);
        assert_eq!(max_tokens(&json!({"max_tokens": " 64 "}), c), 64);
        assert_eq!(
            max_tokens(&json!({"max_tokens": 100.5}), c),
            16,
            "not whole"
        );
        assert_eq!(max_tokens(&json!({"max_tokens": -3}), c), 16, "negative");
    }

    /// `n` sequences each generate up to `max_tokens` with KV of their own.
    #[test]
    fn n_sequences_book_n_times_the_output() {
        let c = Kind::Completion;
        assert_eq!(max_tokens(&json!({"max_tokens": 50, "n": 3}), c), 150);
        assert_eq!(
            max_tokens(&json!({"max_tokens": 50, "n": 2, "best_of": 4}), c),
            200
        );
        assert_eq!(max_tokens(&json!({"n": "2"}), c), 32);
        assert_eq!(max_tokens(&json!({"max_tokens": 50, "n": 0}), c), 50);
        assert_eq!(
            max_tokens(&json!({"n": 4}), Kind::Chat),
            0,
            "unknown stays unknown"
        );
        assert_eq!(
            max_tokens(&json!({"max_tokens": u64::MAX, "n": 8}), c),
            usize::MAX,
            "saturates"
        );
    }

    /// A completion's batch of prompts runs each: its output is each prompt's, and its prompt
    /// tokens every list's (token ids) or the first's times the batch (texts).
    #[test]
    fn a_batch_of_prompts_books_every_prompt() {
        let c = Kind::Completion;
        let ids = json!({"prompt": [[1, 2, 3], [4, 5], [6]], "max_tokens": 10, "n": 2});
        assert_eq!(prompts(&ids, c), 3);
        assert_eq!(max_tokens(&ids, c), 60);
        assert_eq!(prompt_tokens(&ids, c, 3), 6);
        let texts = json!({"prompt": ["a b", "c d e", "f"], "max_tokens": 10});
        assert_eq!((prompts(&texts, c), prompt_tokens(&texts, c, 2)), (3, 6));
        for one in [
            json!({"prompt": [1, 2, 3]}),
            json!({"prompt": "a b c"}),
            json!({"prompt": []}),
            json!({"prompt": [[1, 2, 3]]}),
            json!({"prompt": [1, [2]]}),
            json!({}),
        ] {
            assert_eq!(prompts(&one, c), 1, "{one}");
            assert_eq!(prompt_tokens(&one, c, 3), 3, "{one}");
        }
        let chat = json!({"prompt": [[1], [2]], "max_tokens": 10});
        assert_eq!(
            (prompts(&chat, Kind::Chat), max_tokens(&chat, Kind::Chat)),
            (1, 10)
        );
    }

    proptest! {
        /// Any JSON value in any of the fields reads as something, never a panic, and a
        /// count read is the integer the value names.
        #[test]
        fn any_value_reads_without_panicking(x in any::<i64>(), f in any::<f64>(), s in ".{0,12}") {
            for v in [json!(x), json!(f), json!(s.clone()), json!([x]), json!({"a": s})] {
                let body = json!({"stream": v, "max_tokens": v, "n": v, "best_of": v, "prompt": v});
                let _ = streamed(&body);
                let _ = max_tokens(&body, Kind::Completion);
                prop_assert!(prompts(&body, Kind::Completion) >= 1);
                let _ = prompt_tokens(&body, Kind::Completion, usize::MAX);
                if let Some(n) = lax_count(&v) {
                    prop_assert!(v.is_number() || v.is_string());
                    if let Some(i) = v.as_i64() { prop_assert_eq!(n as i64, i); }
                }
            }
        }
    }
}
