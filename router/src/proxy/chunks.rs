//! What a streamed answer's chunk is to its request's booking: a token's event (the first is
//! the first token the router learns from), an error event (the request failed in the engine:
//! no first token, no decode), or, for the Responses and Anthropic Messages APIs, events the
//! engine sends before it runs the prompt. Why apart from the proxy: each API streams its own
//! event shapes, and reading one as another taught the router that failing instances were fast.

use serde_json::Value;

use crate::request_fields::Kind;

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
pub(super) enum Chunk {
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
pub(super) fn chunk_of(kind: Kind, chunk: &[u8]) -> Chunk {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
