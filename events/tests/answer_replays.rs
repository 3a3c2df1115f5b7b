//! Requesters replaying the buffer at once cannot grow the publisher's memory by a copy
//! each (see `answers/mod.rs` for how memory is read).

use kvtier_events::*;

mod answers;
use answers::*;

/// Many requesters replaying the whole buffer at once had each a copy of it queued: 20 that
/// do not read, a 7 MB buffer, 140 MB. A replay's batches are the buffer's own bytes.
#[test]
fn requesters_replaying_at_once_share_the_buffers_bytes() {
    let p = Publisher::bind(PublisherConfig {
        block_size: 16,
        ..Default::default()
    })
    .unwrap();
    for i in 0..20 {
        p.publish(0.0, &chain(i * 2_000, 2_000)).unwrap();
    }
    let ctx = zmq::Context::new();
    let barrier = Barrier::new(&ctx, &p);
    let clients: Vec<zmq::Socket> = (0..20).map(|_| deaf(&ctx, &p)).collect();
    barrier.pass(&p, 1);
    let before = rss();
    for c in &clients {
        c.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)
            .unwrap();
    }
    barrier.pass(&p, 100);
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 50 * MB,
        "the publisher grew by {} MB for 20 replays of a 7 MB buffer",
        grown / MB
    );
}
