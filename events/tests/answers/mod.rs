//! What the answer-memory tests share: the process's resident size, blocks, requesters
//! that never read, and a barrier that waits for the publisher thread.
//!
//! Memory is read as the process's resident size (`/proc/self/statm`), so each test file
//! holds one test (a process of its own: memory another test freed would hide growth), and
//! each bound is several times what the fix leaves and a fraction of what the bug took, so
//! neither a loaded machine nor the allocator's slack decides the outcome.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvtier_events::*;
use kvtier_radix::PageHash;

pub fn rss() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: usize = s
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("resident pages");
    pages * 4096
}

pub const MB: usize = 1 << 20;

pub fn h(i: usize) -> PageHash {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
    PageHash(b)
}

/// `n` blocks of 16 tokens, a chain from block `from` on: about 35 bytes a block on the wire.
pub fn chain(from: usize, n: usize) -> Vec<WireEvent> {
    (from..from + n)
        .map(|i| WireEvent::BlockStored {
            block_hashes: vec![h(i)],
            parent_block_hash: i.checked_sub(1).map(h),
            token_ids: vec![i as u32; 16],
            block_size: 16,
            medium: Medium::Gpu,
            lora_name: None,
            locality: Some(Locality::Local),
        })
        .collect()
}

pub fn nothing() -> Vec<WireEvent> {
    vec![WireEvent::BlockRemoved {
        block_hashes: vec![h(usize::MAX - 1)],
        medium: Medium::Gpu,
        locality: None,
    }]
}

/// A DEALER that asks and never reads: ZMQ's queue on its side holds one message, its
/// kernel buffer a few KB; the rest of what it is sent waits in the publisher.
pub fn deaf(ctx: &zmq::Context, p: &Publisher) -> zmq::Socket {
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_linger(0).unwrap();
    s.set_rcvhwm(1).unwrap();
    s.set_rcvbuf(4096).unwrap();
    s.set_sndhwm(0).unwrap();
    s.connect(p.replay_endpoint().unwrap()).unwrap();
    s
}

/// A subscriber and a requester that reads, to wait until the publisher thread has taken
/// the requests sent before: `n` round trips of the requester (the ROUTER takes requests
/// from its peers in turn, so each answered means every peer with a request waiting was
/// served once more: `n` at least the requests one peer sent), then `n` more batches, each
/// seen live.
pub struct Barrier {
    sub: zmq::Socket,
    asker: zmq::Socket,
}

impl Barrier {
    pub fn new(ctx: &zmq::Context, p: &Publisher) -> Self {
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.set_rcvtimeo(200).unwrap();
        sub.connect(p.endpoint()).unwrap();
        // the PUB takes the subscription asynchronously: publish until one arrives
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            p.publish(0.0, &nothing()).unwrap();
            if sub.recv_multipart(0).is_ok() {
                break;
            }
            assert!(Instant::now() < deadline, "the SUB never joined");
        }
        let asker = ctx.socket(zmq::DEALER).unwrap();
        asker.set_linger(0).unwrap();
        asker.set_rcvtimeo(120_000).unwrap();
        asker.connect(p.replay_endpoint().unwrap()).unwrap();
        Self { sub, asker }
    }

    /// A replay from past the end (the end marker alone), and its answer.
    fn round_trip(&self) {
        self.asker
            .send_multipart([&b""[..], &u64::MAX.to_be_bytes()[..]], 0)
            .unwrap();
        let f = self.asker.recv_multipart(0).expect("the end marker");
        assert_eq!(f.get(2).map(Vec::as_slice), Some(&END_SEQ[..]));
    }

    pub fn pass(&self, p: &Publisher, n: usize) {
        for _ in 0..n {
            self.round_trip();
        }
        let mut last = 0;
        for _ in 0..n {
            last = p.publish(0.0, &nothing()).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let Ok(f) = self.sub.recv_multipart(0)
                && f.get(1).map(Vec::as_slice) == Some(&last.to_be_bytes()[..])
            {
                return;
            }
        }
        panic!("batch {last} never arrived");
    }
}
