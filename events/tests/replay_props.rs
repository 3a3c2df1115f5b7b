//! The replay socket against a model, over real sockets: any interleaving of batches of any
//! size, replays from any start (before the buffer, inside it, past the end, negative, the
//! extremes) and snapshots gets exactly the kept batches from the start on, in order and
//! byte for byte, or the snapshot of every batch published.

use kvtier_events::*;
use kvtier_radix::PageHash;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// A batch storing `n` blocks from `from` on (0: no event).
    Publish {
        from: u8,
        n: u8,
    },
    Replay(i64),
    Snapshot,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<u8>(), 0u8..12).prop_map(|(from, n)| Op::Publish { from, n }),
        2 => prop_oneof![
            -3i64..40,
            Just(i64::MIN),
            Just(i64::MAX),
        ]
        .prop_map(Op::Replay),
        1 => Just(Op::Snapshot),
    ]
}

fn events(from: u8, n: u8) -> Vec<WireEvent> {
    if n == 0 {
        return Vec::new();
    }
    let h = |i: u8| PageHash([i; 32]);
    vec![WireEvent::BlockStored {
        block_hashes: (0..n).map(|k| h(from.wrapping_add(k))).collect(),
        parent_block_hash: None,
        token_ids: (0..u32::from(n) * 2).collect(),
        block_size: 2,
        medium: Medium::Gpu,
        lora_name: None,
        locality: Some(Locality::Local),
    }]
}

fn ask(s: &zmq::Socket, start: i64) -> Vec<(i64, Vec<u8>)> {
    s.send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)
        .unwrap();
    let mut out = Vec::new();
    loop {
        let f = s.recv_multipart(0).expect("an answer");
        let seq = i64::from_be_bytes(f[2].as_slice().try_into().unwrap());
        if seq == -1 {
            return out;
        }
        out.push((seq, f[3].clone()));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn replays_and_snapshots_answer_what_the_model_keeps(
        ops in prop::collection::vec(op(), 1..40),
        steps in 1usize..6,
        bytes in prop_oneof![Just(1usize), 200usize..2000, Just(1 << 20)],
    ) {
        let p = Publisher::bind(PublisherConfig {
            block_size: 2,
            buffer_steps: steps,
            buffer_bytes: bytes,
            hash_format: HashFormat::Bytes,
            ..Default::default()
        })
        .unwrap();
        let ctx = zmq::Context::new();
        let s = ctx.socket(zmq::DEALER).unwrap();
        s.set_linger(0).unwrap();
        s.set_rcvtimeo(60_000).unwrap();
        s.connect(p.replay_endpoint().unwrap()).unwrap();
        let mut kept: std::collections::VecDeque<(i64, Vec<u8>)> = Default::default();
        let mut mirror = Mirror::new();
        let mut next = 0i64;
        for op in &ops {
            match *op {
                Op::Publish { from, n } => {
                    let ev = events(from, n);
                    let ts = next as f64;
                    prop_assert_eq!(p.publish(ts, &ev).unwrap(), next as u64);
                    ev.iter().for_each(|e| mirror.apply(e));
                    kept.push_back((next, encode_batch(ts, &ev, 0, HashFormat::Bytes).unwrap()));
                    while kept.len() > 1
                        && (kept.len() > steps || kept.iter().map(|k| k.1.len()).sum::<usize>() > bytes)
                    {
                        kept.pop_front();
                    }
                    next += 1;
                }
                Op::Replay(start) if start != -2 => {
                    // a start is read as vLLM reads it: unsigned
                    let from = start as u64;
                    let want: Vec<_> = kept.iter().filter(|k| k.0 as u64 >= from).cloned().collect();
                    prop_assert_eq!(ask(&s, start), want, "replay from {}", start);
                }
                // -2 is the snapshot request
                Op::Snapshot | Op::Replay(_) => {
                    let got = ask(&s, -2);
                    if next == 0 {
                        prop_assert!(got.is_empty());
                    } else {
                        let want = encode_batch((next - 1) as f64, &mirror.snapshot(), 0, HashFormat::Bytes).unwrap();
                        prop_assert_eq!(got, vec![(next - 1, want)]);
                    }
                }
            }
        }
    }
}
