//! A requester replays the whole buffer as often as it asks on one connection.

use kvtier_events::*;

/// An adversarial tester's hole: the ROUTER's send high-water mark (`buffer_steps` + 2)
/// counted messages its requester had already read as queued (ZMQ tells the sending side of
/// reads only every low-water mark, 8,978 messages at 10,002), so a second whole replay on
/// one connection passed the mark and was cut without its end marker (3,000 batches: 1,502
/// then nothing; 5 batches: 5, then cut every time after): a router that resynced twice
/// timed out for ever. Answers are bounded by the bytes each requester has not read
/// (462186f, eaa0e91), not by the mark.
#[test]
fn a_whole_replay_arrives_whole_every_time_it_is_asked_for() {
    for steps in [5usize, 3_000] {
        let p = Publisher::bind(PublisherConfig {
            buffer_steps: steps,
            ..Default::default()
        })
        .unwrap();
        for i in 0..steps {
            p.publish(i as f64, &[]).unwrap();
        }
        let ctx = zmq::Context::new();
        let s = ctx.socket(zmq::DEALER).unwrap();
        s.set_linger(0).unwrap();
        s.set_rcvtimeo(60_000).unwrap();
        s.connect(p.replay_endpoint().unwrap()).unwrap();
        for round in 0..4 {
            s.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)
                .unwrap();
            let mut seqs = Vec::new();
            loop {
                let f = s.recv_multipart(0).unwrap_or_else(|e| {
                    panic!(
                        "{steps} steps, round {round}: {e} after {} batches",
                        seqs.len()
                    )
                });
                if f[2] == END_SEQ {
                    break;
                }
                seqs.push(u64::from_be_bytes(f[2].as_slice().try_into().unwrap()));
            }
            assert_eq!(seqs, (0..steps as u64).collect::<Vec<_>>(), "round {round}");
        }
    }
}
