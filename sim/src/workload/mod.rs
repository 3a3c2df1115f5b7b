//! Workloads: Mooncake's public trace format, a synthetic multi-turn chat generator, and the
//! routing of requests to engine instances.
//!
//! Why token ids from hash ids: the public trace carries no text, only one hash id per
//! 512-token block, with equal ids meaning equal prefixes. We turn each block id into 512
//! deterministic token ids, so equal ids give equal tokens, equal tokens give equal page
//! hashes, and the real radix cache sees exactly the sharing the trace describes.
//!
//! Files: `trace` (the trace format: parsing, streaming, the line cap and the order check);
//! this file the request type, the synthetic chat generator and the routing.

mod trace;

pub use trace::{
    MAX_LINE_BYTES, TRACE_BLOCK, TraceReader, TraceSummary, block_token, parse_trace, scan_trace,
};

use thiserror::Error;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRequest {
    pub id: u64,
    pub arrival_ms: u64,
    pub prompt: Vec<u32>,
    pub output_len: u32,
    /// Conversation / session the request belongs to (for affinity routing).
    pub session: u64,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum WorkloadError {
    #[error("trace line {line}: {msg}")]
    Line { line: usize, msg: String },
    #[error("trace line {line}, field `{field}`: {msg}")]
    Field {
        line: usize,
        field: &'static str,
        msg: String,
    },
    #[error("reading the trace: {0}")]
    Io(String),
    #[error("empty workload")]
    Empty,
    #[error("chat workload: {0}")]
    Chat(String),
}

/// splitmix64: a tiny, fast, well-mixed PRNG step (deterministic across platforms).
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The token a simulated engine generates at `pos` for request `req` (the synthetic chat
/// generator puts the same tokens in the next turn's prompt, so answers are reusable KV).
pub fn generated_token(req: u64, pos: usize) -> u32 {
    (mix(req ^ 0xa5a5_0000_0000_0000 ^ ((pos as u64) << 20)) % 128_000) as u32
}

/// The synthetic multi-turn chat generator.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ChatSpec {
    pub clients: u32,
    pub rounds: u32,
    pub system_prompt_tokens: u32,
    pub turn_tokens: u32,
    pub answer_tokens: u32,
    /// Mean gap between a client's turns (ms, exponential).
    pub think_ms: u64,
    /// Mean gap between client starts (ms, exponential: Poisson arrivals).
    pub client_interarrival_ms: u64,
    pub seed: u64,
}

impl Default for ChatSpec {
    fn default() -> Self {
        ChatSpec {
            clients: 400,
            rounds: 8,
            system_prompt_tokens: 1024,
            turn_tokens: 384,
            answer_tokens: 128,
            think_ms: 8_000,
            client_interarrival_ms: 400,
            seed: 7,
        }
    }
}

/// The most prompt tokens a chat workload may hold (1 GiB of token ids): it is built in
/// memory, every turn's prompt the whole conversation so far.
pub const MAX_CHAT_TOKENS: u64 = 1 << 28;

impl ChatSpec {
    /// Prompt tokens the workload holds: every client's turn `k` (from 0) repeats the system
    /// prompt, `k + 1` user turns and `k` answers.
    pub fn prompt_tokens(&self) -> u128 {
        let r = u128::from(self.rounds);
        let per_client = r * u128::from(self.system_prompt_tokens)
            + u128::from(self.turn_tokens) * r * (r + 1) / 2
            + u128::from(self.answer_tokens) * r * r.saturating_sub(1) / 2;
        u128::from(self.clients) * per_client
    }

    /// Refuses a workload with no requests (no clients or no rounds), empty prompts, or more
    /// than [`MAX_CHAT_TOKENS`] prompt tokens (it would not fit in memory).
    pub fn check(&self) -> Result<(), WorkloadError> {
        let bad = |msg: String| Err(WorkloadError::Chat(msg));
        if self.clients == 0 {
            return bad("clients 0: no requests (at least 1 client)".into());
        }
        if self.rounds == 0 {
            return bad("rounds 0: no requests (at least 1 round)".into());
        }
        if self.system_prompt_tokens == 0 && self.turn_tokens == 0 {
            return bad("system_prompt_tokens and turn_tokens 0: empty prompts".into());
        }
        let tokens = self.prompt_tokens();
        if tokens > u128::from(MAX_CHAT_TOKENS) {
            return bad(format!(
                "{} clients × {} rounds hold {tokens} prompt tokens, past the cap of \
                 {MAX_CHAT_TOKENS} (1 GiB of token ids)",
                self.clients, self.rounds
            ));
        }
        Ok(())
    }
}

fn exp_sample(state: &mut u64, mean_ms: u64) -> u64 {
    *state = mix(*state);
    let u = ((*state >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    (-(u.ln()) * mean_ms as f64) as u64
}

/// Generates a multi-turn chat workload: every client shares the system prompt; turn k's
/// prompt is the whole conversation so far (earlier turns and the engine's answers) plus a new
/// user turn.
pub fn synthetic_chat(spec: &ChatSpec) -> Vec<SimRequest> {
    let mut rng = spec.seed ^ 0x5eed;
    let system: Vec<u32> = (0..spec.system_prompt_tokens as usize)
        .map(|i| block_token(u64::MAX - 1, i))
        .collect();
    let mut out = Vec::new();
    let mut start = 0u64;
    for c in 0..spec.clients as u64 {
        start += exp_sample(&mut rng, spec.client_interarrival_ms);
        let mut t = start;
        let mut convo = system.clone();
        for k in 0..spec.rounds as u64 {
            let id = c * spec.rounds as u64 + k;
            convo.extend((0..spec.turn_tokens as usize).map(|i| block_token(mix(id) | 1 << 63, i)));
            let prompt = convo.clone();
            // The engine's answer tokens are what `generated_token` produces for this id.
            let p = prompt.len();
            convo.extend((0..spec.answer_tokens as usize).map(|i| generated_token(id, p + i)));
            out.push(SimRequest {
                id,
                arrival_ms: t,
                prompt,
                output_len: spec.answer_tokens.max(1),
                session: c,
            });
            t += exp_sample(&mut rng, spec.think_ms).max(1);
        }
    }
    out.sort_by_key(|r| (r.arrival_ms, r.id));
    out
}

/// How requests are spread over engine instances (`--router`; `--routing` is its alias).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
pub enum Routing {
    /// Request i goes to instance i mod N.
    RoundRobin,
    /// The instance with the fewest prompt tokens waiting for their first token.
    LeastLoaded,
    /// A session always goes to the same instance.
    Session,
    /// NVIDIA Dynamo's KV router (crate `dynamo-kv-router`, default configuration).
    Dynamo,
    /// kvtier's router (crate `kvtier-router`): least expected TTFT over the tiers.
    Kvtier,
}

impl Routing {
    /// Every router, in the order reports list them.
    pub const ALL: [Routing; 5] = [
        Routing::RoundRobin,
        Routing::LeastLoaded,
        Routing::Session,
        Routing::Dynamo,
        Routing::Kvtier,
    ];

    /// The name the command line takes.
    pub fn name(self) -> &'static str {
        match self {
            Routing::RoundRobin => "round-robin",
            Routing::LeastLoaded => "least-loaded",
            Routing::Session => "session",
            Routing::Dynamo => "dynamo",
            Routing::Kvtier => "kvtier",
        }
    }
}

/// The instance of a router that needs no state: round-robin by request id, session by a hash
/// of the session id; `None` for the routers that keep state (`crate::routing`).
pub fn route(r: &SimRequest, instances: usize, routing: Routing) -> Option<usize> {
    let n = instances.max(1) as u64;
    match routing {
        Routing::RoundRobin => Some((r.id % n) as usize),
        Routing::Session => Some((mix(r.session) % n) as usize),
        Routing::LeastLoaded | Routing::Dynamo | Routing::Kvtier => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The count the memory cap uses is the generator's; no clients, no rounds or empty
    /// prompts are refused.
    #[test]
    fn the_chat_check_counts_what_the_generator_holds() {
        for (clients, rounds, sys, turn, answer) in
            [(3, 4, 100, 30, 7), (1, 1, 0, 5, 0), (2, 5, 0, 1, 9)]
        {
            let spec = ChatSpec {
                clients,
                rounds,
                system_prompt_tokens: sys,
                turn_tokens: turn,
                answer_tokens: answer,
                ..ChatSpec::default()
            };
            let held: usize = synthetic_chat(&spec).iter().map(|r| r.prompt.len()).sum();
            assert_eq!(spec.prompt_tokens(), held as u128);
            spec.check().unwrap();
        }
        for (spec, want) in [
            (
                ChatSpec {
                    clients: 0,
                    ..ChatSpec::default()
                },
                "clients 0",
            ),
            (
                ChatSpec {
                    rounds: 0,
                    ..ChatSpec::default()
                },
                "rounds 0",
            ),
            (
                ChatSpec {
                    system_prompt_tokens: 0,
                    turn_tokens: 0,
                    ..ChatSpec::default()
                },
                "empty prompts",
            ),
            (
                ChatSpec {
                    clients: u32::MAX,
                    ..ChatSpec::default()
                },
                "cap",
            ),
            (
                ChatSpec {
                    rounds: u32::MAX,
                    ..ChatSpec::default()
                },
                "cap",
            ),
        ] {
            let e = spec.check().unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
        }
        ChatSpec::default().check().unwrap();
    }

    #[test]
    fn chat_turns_extend_the_conversation() {
        let w = synthetic_chat(&ChatSpec {
            clients: 2,
            rounds: 3,
            ..ChatSpec::default()
        });
        assert_eq!(w.len(), 6);
        let c0: Vec<_> = w.iter().filter(|r| r.session == 0).collect();
        assert!(c0[1].prompt.starts_with(&c0[0].prompt));
        let p = c0[0].prompt.len();
        assert_eq!(c0[1].prompt[p], generated_token(c0[0].id, p));
    }
}
