//! A requester that asks for snapshots and never reads them cannot grow the publisher's
//! memory without bound (see `answers/mod.rs` for how memory is read).

use kvtier_events::*;

mod answers;
use answers::*;

/// An adversarial tester's growth: a requester that asks for snapshots and never reads them
/// had each answer copied into its queue at the publisher, up to the ROUTER's high-water
/// mark (5,001 snapshots with the default 10,000 buffered steps): a 0.7 MB snapshot asked
/// for 2,000 times took 1.5 GB of the engine's memory, a 500K-block index's hundreds of GB.
/// Snapshots of one sequence number are one buffer however many requesters wait for it,
/// and past `buffer_bytes` of answers held for requesters that do not read, a request
/// whose answer would add more is not answered (the requester times out and asks again).
#[test]
fn a_requester_that_never_reads_cannot_grow_the_publisher_by_its_snapshots() {
    let p = Publisher::bind(PublisherConfig {
        block_size: 16,
        buffer_bytes: 4 * MB,
        ..Default::default()
    })
    .unwrap();
    p.publish(0.0, &chain(0, 20_000)).unwrap();
    let ctx = zmq::Context::new();
    let barrier = Barrier::new(&ctx, &p);
    let a = deaf(&ctx, &p);
    barrier.pass(&p, 1);
    let before = rss();
    // the same state asked for again and again
    for _ in 0..300 {
        a.send_multipart([&b""[..], &SNAPSHOT_REQUEST], 0).unwrap();
    }
    barrier.pass(&p, 400);
    let same = rss().saturating_sub(before);
    // a new state each time: each answer its own snapshot
    for _ in 0..300 {
        a.send_multipart([&b""[..], &SNAPSHOT_REQUEST], 0).unwrap();
        p.publish(0.0, &nothing()).unwrap();
    }
    barrier.pass(&p, 400);
    let grown = rss().saturating_sub(before);
    assert!(
        same < 60 * MB && grown < 60 * MB,
        "the publisher grew by {} MB for 300 snapshots of one state, {} MB with 300 more of \
         new states (one is 0.7 MB)",
        same / MB,
        grown / MB
    );
}
