//! The time to first token no router can beat: each request prefilled alone on an idle
//! instance, with every page that an earlier request used already on that instance's device.
//!
//! Why: `router-bench` judges routers by their TTFT tails, and a tail can be set by the
//! prompts themselves — a 100K-token prompt seen for the first time needs its prefill
//! whatever instance it goes to. The floor says, at each point, how much of a tail routing can
//! remove at most: a router whose p99 is `x` × the floor's can improve by `x` at best, so a goal
//! of "1.3× lower p99 than router R" is out of reach wherever R's p99 is under 1.3× the floor.
//!
//! What "can beat" rests on, each a way the simulated engine is never faster:
//! - **no queue**: the request's forwards carry nothing else (no other prefill chunk, no
//!   decode row), so each costs `forward_us(chunk, 0, 0)`;
//! - **every reusable page on the device**: a page counts as cached if any request arriving no
//!   later has the same page hash in its prompt or its generated answer (the synthetic chat's
//!   next turn re-reads the answer) — whether or not that request has run, on any instance,
//!   and without the copy from host or L3 that a real hit on those tiers needs;
//! - **at least one token computed**: an engine computes the last prompt token to produce the
//!   first output token, so a fully cached prompt still costs one forward;
//! - **full chunks**: the uncached tokens in as few forwards of `chunked_prefill_size` tokens
//!   as possible (each forward's duration rounded down to the microsecond, then one microsecond
//!   less, so a different split of the same tokens cannot come out under it).
//!
//! `sim/tests/routers.rs` checks it against real runs: under every router, every percentile of
//! the measured TTFTs is at or above the floor's.

use std::collections::{HashMap, HashSet};

use kvtier_events::HashFormat;
use kvtier_radix::page_hashes;

use crate::config::SimConfig;
use crate::report::Percentiles;
use crate::workload::{SimRequest, WorkloadError, generated_token};

/// What the floor keeps of a request once it has read it: the pages it can reuse from others
/// and the pages it offers them.
struct Seen {
    arrival_ms: u64,
    prompt_tokens: usize,
    /// Page hashes of the prompt (whole pages, in order).
    prompt_pages: Vec<u64>,
    /// Page hashes of prompt + generated answer (whole pages), each once.
    offered: HashSet<u64>,
}

fn seen(r: &SimRequest, page_size: usize) -> Seen {
    let mut seq = r.prompt.clone();
    let p = seq.len();
    seq.extend((0..r.output_len as usize).map(|i| generated_token(r.id, p + i)));
    let full: Vec<u64> = page_hashes(&seq, page_size, None)
        .iter()
        .map(HashFormat::int64)
        .collect();
    let whole_prompt_pages = p / page_size;
    Seen {
        arrival_ms: r.arrival_ms,
        prompt_tokens: p,
        prompt_pages: full[..whole_prompt_pages.min(full.len())].to_vec(),
        offered: full.into_iter().collect(),
    }
}

/// Microseconds of a lone prefill of `tokens` uncached tokens (at least one).
pub fn lone_prefill_us(cfg: &SimConfig, tokens: usize) -> u64 {
    let chunk = cfg.scheduler.chunked_prefill_size.max(1);
    let mut left = tokens.max(1);
    let mut us = 0;
    while left > 0 {
        let n = left.min(chunk);
        us += cfg.profile.forward_us(n as u64, 0, 0).saturating_sub(1);
        left -= n;
    }
    us
}

/// Each request's floor (µs), in the order the requests were given. Requests are grouped by
/// arrival time whatever their order in the stream: a request may reuse the pages of any
/// request arriving no later, itself excepted.
pub fn floors_us(
    cfg: &SimConfig,
    reqs: impl IntoIterator<Item = Result<SimRequest, WorkloadError>>,
) -> Result<Vec<u64>, WorkloadError> {
    let ps = cfg.scheduler.page_size.max(1);
    let mut all = Vec::new();
    for r in reqs {
        all.push(seen(&r?, ps));
    }
    let mut order: Vec<usize> = (0..all.len()).collect();
    order.sort_by_key(|&i| all[i].arrival_ms);
    let mut floors = vec![0; all.len()];
    let mut earlier: HashSet<u64> = HashSet::new();
    for group in order.chunk_by(|&a, &b| all[a].arrival_ms == all[b].arrival_ms) {
        // Pages offered by the group's members: a member reuses one another member offers.
        let mut offered_by: HashMap<u64, u32> = HashMap::new();
        for &i in group {
            for &h in &all[i].offered {
                *offered_by.entry(h).or_default() += 1;
            }
        }
        for &i in group {
            let s = &all[i];
            let cached = s
                .prompt_pages
                .iter()
                .take_while(|h| earlier.contains(h) || offered_by.get(h).is_some_and(|&n| n >= 2))
                .count();
            floors[i] = lone_prefill_us(cfg, s.prompt_tokens.saturating_sub(cached * ps));
        }
        for &i in group {
            earlier.extend(all[i].offered.iter().copied());
        }
    }
    Ok(floors)
}

/// The floor's percentiles (ms), computed as the simulator's report computes the measured ones.
pub fn floor_percentiles(
    cfg: &SimConfig,
    reqs: impl IntoIterator<Item = Result<SimRequest, WorkloadError>>,
) -> Result<Percentiles, WorkloadError> {
    let mut us = floors_us(cfg, reqs)?;
    us.sort_unstable();
    Ok(Percentiles::of_sorted_us(&us))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: u64, arrival_ms: u64, prompt: Vec<u32>) -> Result<SimRequest, WorkloadError> {
        Ok(SimRequest {
            id,
            arrival_ms,
            prompt,
            output_len: 1,
            session: id,
        })
    }

    fn cfg() -> SimConfig {
        let mut c = SimConfig::default();
        c.scheduler.page_size = 4;
        c.scheduler.chunked_prefill_size = 8;
        c
    }

    #[test]
    fn reuse_needs_an_arrival_no_later_and_a_whole_page_prefix() {
        let c = cfg();
        let shared: Vec<u32> = (0..8).collect();
        let mut second = shared.clone();
        second.extend([100, 101, 102, 103]);
        let mut late = shared.clone();
        late.extend([200, 201]);
        let f = floors_us(
            &c,
            [
                req(1, 10, shared.clone()),
                req(2, 20, second),
                req(3, 5, late), // arrives first: reuses nothing
            ],
        )
        .unwrap();
        assert_eq!(f[2], lone_prefill_us(&c, 10));
        // Request 1 finds request 3's two pages (same tokens, earlier): one token computed.
        assert_eq!(f[0], lone_prefill_us(&c, 1));
        assert_eq!(f[1], lone_prefill_us(&c, 4));
        // Twelve uncached tokens take two forwards of at most eight.
        assert_eq!(
            lone_prefill_us(&c, 12),
            c.profile.forward_us(8, 0, 0) + c.profile.forward_us(4, 0, 0) - 2
        );
    }

    #[test]
    fn same_arrival_reuses_the_others_pages_not_its_own() {
        let c = cfg();
        let p: Vec<u32> = (0..8).collect();
        let alone = floors_us(&c, [req(1, 0, p.clone())]).unwrap();
        assert_eq!(alone[0], lone_prefill_us(&c, 8));
        let pair = floors_us(&c, [req(1, 0, p.clone()), req(2, 0, p)]).unwrap();
        assert_eq!(pair, vec![lone_prefill_us(&c, 1); 2]);
    }

    #[test]
    fn answers_are_reusable() {
        let c = cfg();
        let first: Vec<u32> = (0..4).collect();
        let mut next = first.clone();
        next.extend((0..4).map(|i| generated_token(1, 4 + i)));
        next.extend([900, 901, 902, 903]);
        let mut r1 = req(1, 0, first).unwrap();
        r1.output_len = 4;
        let f = floors_us(&c, [Ok(r1), req(2, 1, next)]).unwrap();
        assert_eq!(f[1], lone_prefill_us(&c, 4));
    }

    #[test]
    fn a_bad_request_is_the_error() {
        let bad = Err(WorkloadError::Empty);
        assert!(floors_us(&cfg(), [req(1, 0, vec![1]), bad]).is_err());
    }
}
