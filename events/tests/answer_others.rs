//! A requester that never reads its answers does not cost the others theirs.

use kvtier_events::*;

mod answers;
use answers::*;

/// `(seq, payload)` of a snapshot request, or None when no end marker came in a minute.
fn snapshot(s: &zmq::Socket) -> Option<Option<i64>> {
    s.send_multipart([&b""[..], &SNAPSHOT_REQUEST], 0).unwrap();
    let mut got = None;
    loop {
        let f = s.recv_multipart(0).ok()?;
        let seq = i64::from_be_bytes(f[2].as_slice().try_into().unwrap());
        if seq == -1 {
            return Some(got);
        }
        got = Some(seq);
    }
}

/// 462186f bounded what answers nobody reads may hold (`buffer_bytes` beyond the buffer)
/// for all requesters together: one that asked for a snapshot larger than that once and
/// never read it held it until it disconnected, and every other requester's snapshot of a
/// newer state (and every replay) went unanswered meanwhile: a router stuck for a while cost
/// the others their resync. A requester's unread answers count against itself; all of them
/// together only against what four such requesters may hold.
#[test]
fn a_requester_that_never_reads_does_not_cost_the_others_their_snapshots() {
    let p = Publisher::bind(PublisherConfig {
        block_size: 16,
        buffer_bytes: 256 << 10,
        ..Default::default()
    })
    .unwrap();
    // a snapshot of about 10 MB: past buffer_bytes, and past what the kernel's socket
    // buffers take off ZMQ's queue (4 MB here)
    p.publish(0.0, &chain(0, 300_000)).unwrap();
    let ctx = zmq::Context::new();
    let barrier = Barrier::new(&ctx, &p);
    let stuck = deaf(&ctx, &p);
    barrier.pass(&p, 1);
    stuck
        .send_multipart([&b""[..], &SNAPSHOT_REQUEST], 0)
        .unwrap();
    barrier.pass(&p, 10);
    let other = ctx.socket(zmq::DEALER).unwrap();
    other.set_linger(0).unwrap();
    other.set_rcvtimeo(60_000).unwrap();
    other.connect(p.replay_endpoint().unwrap()).unwrap();
    for _ in 0..3 {
        let seq = p.publish(0.0, &nothing()).unwrap();
        let got = snapshot(&other).expect("the other requester is answered");
        assert_eq!(got, Some(seq as i64), "a snapshot of the state now");
    }
    // and replays
    other
        .send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)
        .unwrap();
    let first = other.recv_multipart(0).expect("a replay answered");
    assert_eq!(first.len(), 4);
}
