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

/// Which endpoint a request came to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    /// `/v1/completions`: `prompt`, a text, token ids, or a batch of either.
    Completion,
    /// `/v1/chat/completions`: `messages`.
    Chat,
    /// `/v1/responses` (OpenAI's Responses API): `instructions` and `input`.
    Responses,
    /// Anthropic's Messages API (vLLM's `/v1/messages`): `system` and `messages`.
    Messages,
    /// SGLang's native `/generate`: `text` or `input_ids`, one prompt or a batch, and
    /// `sampling_params`.
    Generate,
    /// A pooling model's APIs (vLLM's `/v1/embeddings`, `/v2/embed`, `/pooling`, `/classify`,
    /// `/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`; SGLang's alike): no KV
    /// reused and nothing generated, routed by load.
    Pooling,
}

impl Kind {
    /// The proxied paths and the kind of each.
    pub(crate) const PATHS: [(&'static str, Kind); 14] = [
        ("/v1/completions", Kind::Completion),
        ("/v1/chat/completions", Kind::Chat),
        ("/v1/responses", Kind::Responses),
        ("/v1/messages", Kind::Messages),
        ("/generate", Kind::Generate),
        ("/v1/embeddings", Kind::Pooling),
        ("/v2/embed", Kind::Pooling),
        ("/pooling", Kind::Pooling),
        ("/classify", Kind::Pooling),
        ("/score", Kind::Pooling),
        ("/v1/score", Kind::Pooling),
        ("/rerank", Kind::Pooling),
        ("/v1/rerank", Kind::Pooling),
        ("/v2/rerank", Kind::Pooling),
    ];

    /// The kind of a request to `path` ([`Self::PATHS`]).
    pub(crate) fn at(path: &str) -> Option<Kind> {
        Self::PATHS
            .iter()
            .find(|(p, _)| *p == path)
            .map(|(_, k)| *k)
    }

    /// Whether a request of this kind reuses cached KV (and is routed by its prompt's).
    pub(crate) fn reuses_kv(self) -> bool {
        self != Kind::Pooling
    }

    /// The field holding the prompt, or a batch of prompts, where the kind has one.
    fn prompt_field(self, v: &Value) -> Option<&Value> {
        let given = |k| v.get(k).filter(|p: &&Value| !p.is_null());
        match self {
            Kind::Completion => given("prompt"),
            Kind::Generate => given("input_ids").or_else(|| given("text")),
            Kind::Chat | Kind::Responses | Kind::Messages | Kind::Pooling => None,
        }
    }
}

/// What SGLang's `/generate` generates at most when its `sampling_params` name no
/// `max_new_tokens` (SGLang 0.5's `SamplingParams`).
pub const GENERATE_DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// The bytes of text taken for one token when no tokenizer's count calibrates the estimate
/// (a text batched after token ids).
const BYTES_PER_TOKEN: usize = 4;

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
pub(crate) fn streamed(v: &Value, kind: Kind) -> bool {
    kind != Kind::Pooling && v.get("stream").and_then(lax_bool) == Some(true)
}

/// Whether the request is a background response (`/v1/responses` with `"background": true`):
/// answered at once (`status: queued`), generated after the answer.
pub(crate) fn background(v: &Value, kind: Kind) -> bool {
    kind == Kind::Responses && v.get("background").and_then(lax_bool) == Some(true)
}

/// The tokens a request may generate: its `max_completion_tokens` or `max_tokens` (when it
/// names neither, a completion's default, [`COMPLETION_DEFAULT_MAX_TOKENS`], and for a chat
/// 0: unknown), times the sequences it asks for (`n`, or `best_of` where larger), times its
/// prompts; a response's `max_output_tokens` and a message's `max_tokens` (0: unknown);
/// SGLang's `sampling_params` `max_new_tokens` (default
/// [`GENERATE_DEFAULT_MAX_NEW_TOKENS`]) times its `n`, for each prompt (one
/// `sampling_params` for all, or a list of one each); an embedding's 0. The router's memory
/// timeline ends each request by it (docs/router/history.md, "What the router is told of
/// each answer").
pub(crate) fn max_tokens(v: &Value, kind: Kind) -> usize {
    match kind {
        Kind::Responses | Kind::Messages => v
            .get(if kind == Kind::Messages {
                "max_tokens"
            } else {
                "max_output_tokens"
            })
            .and_then(lax_count)
            .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX)),
        Kind::Pooling => 0,
        Kind::Generate => generated(v),
        Kind::Completion | Kind::Chat => {
            let named = ["max_completion_tokens", "max_tokens"]
                .iter()
                .find_map(|k| v.get(*k).and_then(lax_count));
            let each = match (named, kind) {
                (Some(n), _) => usize::try_from(n).unwrap_or(usize::MAX),
                (None, Kind::Completion) => COMPLETION_DEFAULT_MAX_TOKENS,
                _ => 0,
            };
            each.saturating_mul(sequences(v))
                .saturating_mul(prompts(v, kind))
        }
    }
}

/// SGLang's `/generate`: each prompt's `max_new_tokens` times its `n`, summed.
fn generated(v: &Value) -> usize {
    let one = |p: Option<&Value>| {
        let each = p
            .and_then(|p| p.get("max_new_tokens"))
            .and_then(lax_count)
            .map_or(GENERATE_DEFAULT_MAX_NEW_TOKENS, |n| {
                usize::try_from(n).unwrap_or(usize::MAX)
            });
        each.saturating_mul(p.map_or(1, sequences))
    };
    match v.get("sampling_params") {
        Some(Value::Array(each)) if !each.is_empty() => each
            .iter()
            .map(|p| one(Some(p)))
            .fold(0, usize::saturating_add),
        p => one(p).saturating_mul(prompts(v, Kind::Generate)),
    }
}

/// The request's batch of prompts, where it is one: a completion's `prompt` or SGLang's
/// `text` / `input_ids` given as a non-empty list of prompts (texts or token-id lists).
fn batch(v: &Value, kind: Kind) -> Option<&Vec<Value>> {
    let a = kind.prompt_field(v)?.as_array()?;
    (!a.is_empty() && a.iter().all(|p| p.is_string() || p.is_array())).then_some(a)
}

/// How many prompts the request runs: a batch runs each of them ([`batch`]); any other
/// request, one.
pub(crate) fn prompts(v: &Value, kind: Kind) -> usize {
    batch(v, kind).map_or(1, Vec::len)
}

/// The prompt tokens the request runs, given its first prompt's `first` (the one it is
/// routed by): a batch counts each of its prompts, a token-id list as long as it is and a
/// text past the first estimated from its length ([`text_tokens`]).
pub(crate) fn prompt_tokens(v: &Value, kind: Kind, first: usize) -> usize {
    let Some(a) = batch(v, kind).filter(|a| a.len() > 1) else {
        return first;
    };
    // the first prompt's tokens per byte, where it is a text the tokenizer counted
    let calibration = a[0].as_str().map(|t| (first, t.len()));
    a[1..]
        .iter()
        .map(|p| match p {
            Value::String(t) => text_tokens(t.len(), calibration),
            p => p.as_array().map_or(0, Vec::len),
        })
        .fold(first, usize::saturating_add)
}

/// A text of `bytes` bytes' estimated tokens: at the rate of a text the tokenizer counted
/// (`(tokens, bytes)`), rounded up, or [`BYTES_PER_TOKEN`] bytes a token without one (or
/// with an empty one).
fn text_tokens(bytes: usize, calibration: Option<(usize, usize)>) -> usize {
    let est = match calibration {
        Some((tokens, of)) if of > 0 => (tokens as u128 * bytes as u128).div_ceil(of as u128),
        _ => bytes.div_ceil(BYTES_PER_TOKEN) as u128,
    };
    usize::try_from(est).unwrap_or(usize::MAX)
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
            assert!(streamed(&json!({ "stream": s }), Kind::Chat), "{s}");
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
            assert!(!streamed(&json!({ "stream": s }), Kind::Chat), "{s}");
        }
        assert!(!streamed(&json!({}), Kind::Chat));
        assert!(!streamed(&json!({"stream": true}), Kind::Pooling));
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
        // texts past the first at the first's 2 tokens per 3 bytes, rounded up: 2 + 4 + 1
        let texts = json!({"prompt": ["a b", "c d e", "f"], "max_tokens": 10});
        assert_eq!((prompts(&texts, c), prompt_tokens(&texts, c, 2)), (3, 7));
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
                let body = json!({"stream": v, "max_tokens": v, "n": v, "best_of": v, "prompt": v,
                                  "max_output_tokens": v, "text": v, "input_ids": v,
                                  "sampling_params": v});
                for kind in [Kind::Completion, Kind::Chat, Kind::Responses, Kind::Messages, Kind::Generate,
                             Kind::Pooling] {
                    let _ = streamed(&body, kind);
                    let _ = max_tokens(&body, kind);
                    prop_assert!(prompts(&body, kind) >= 1);
                    let _ = prompt_tokens(&body, kind, usize::MAX);
                }
                if let Some(n) = lax_count(&v) {
                    prop_assert!(v.is_number() || v.is_string());
                    if let Some(i) = v.as_i64() { prop_assert_eq!(n as i64, i); }
                }
            }
        }

        /// A batch of texts books each text by its length at the first's tokens per byte:
        /// texts as long as the first book as many tokens each, a longer text never fewer,
        /// and the batch never less than its first prompt; SGLang's `text` alike.
        #[test]
        fn each_text_of_a_batch_is_booked_by_its_length(
            texts in proptest::collection::vec("[a-z ]{0,40}", 1..6),
            first in 0usize..10_000,
            which in any::<prop::sample::Index>(),
            more in 1usize..100,
        ) {
            for (kind, field) in [(Kind::Completion, "prompt"), (Kind::Generate, "text")] {
                let booked = |t: &[String]| prompt_tokens(&json!({ field: t }), kind, first);
                let total = booked(&texts);
                prop_assert!(total >= first);
                let same = vec![texts[0].clone(); texts.len()];
                if !texts[0].is_empty() {
                    prop_assert_eq!(booked(&same), first * texts.len());
                }
                let mut longer = texts.clone();
                let i = which.index(texts.len());
                longer[i].push_str(&"x".repeat(more));
                if i > 0 {
                    prop_assert!(booked(&longer) >= total, "{:?}", longer);
                }
            }
        }
    }

    /// A response books its `max_output_tokens`; SGLang's `/generate` its `sampling_params`'
    /// `max_new_tokens` (128 unnamed) times `n`, for each prompt of a batch; an embedding
    /// nothing.
    #[test]
    fn each_apis_output_is_read_from_its_own_fields() {
        assert_eq!(
            max_tokens(&json!({"max_output_tokens": 40}), Kind::Responses),
            40
        );
        assert_eq!(max_tokens(&json!({"max_tokens": 40}), Kind::Responses), 0);
        let m = json!({"max_tokens": 40, "n": 3});
        assert_eq!(max_tokens(&m, Kind::Messages), 40);
        let g = Kind::Generate;
        assert_eq!(max_tokens(&json!({"text": "a"}), g), 128);
        let p = json!({"text": ["a", "b"], "sampling_params": {"max_new_tokens": 10, "n": 3}});
        assert_eq!(max_tokens(&p, g), 60);
        let each = json!({"input_ids": [[1], [2]], "sampling_params": [
            {"max_new_tokens": 10}, {"max_new_tokens": "5", "n": 2}]});
        assert_eq!(max_tokens(&each, g), 20);
        assert_eq!(prompts(&json!({"input_ids": [1, 2, 3]}), g), 1);
        assert_eq!(
            prompt_tokens(&json!({"input_ids": [[1, 2], [3, 4, 5]]}), g, 2),
            5
        );
        assert_eq!(
            prompt_tokens(&json!({"input_ids": null, "text": ["ab", "abcd"]}), g, 1),
            3
        );
        assert_eq!(
            max_tokens(&json!({"input": "a", "max_tokens": 9}), Kind::Pooling),
            0
        );
    }
}
