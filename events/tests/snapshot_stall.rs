//! Building a snapshot does not hold up `publish`.
//!
//! The one timing comparison of these tests, calibrated in the test itself: the bug made
//! each publish wait for a snapshot being built (several builds for twenty publishes), the
//! fix leaves twenty publishes of no event, a thousandth of one build; the bound between
//! them is two builds, measured on this machine under this load.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvtier_events::*;
use kvtier_radix::PageHash;

fn h(i: usize) -> PageHash {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
    PageHash(b)
}

/// `n` blocks in short chains over two media: a snapshot of many runs, slow to build.
fn index(n: usize) -> Vec<WireEvent> {
    (0..n)
        .map(|i| WireEvent::BlockStored {
            block_hashes: vec![h(i)],
            parent_block_hash: (i % 8 != 0).then(|| h(i - 1)),
            token_ids: vec![i as u32; 4],
            block_size: 4,
            medium: if i % 3 == 0 { Medium::Cpu } else { Medium::Gpu },
            lora_name: None,
            locality: Some(Locality::Local),
        })
        .collect()
}

/// An adversarial tester's stall: the publisher thread built each snapshot holding the lock
/// `publish` takes to number a batch, so a requester asking for snapshots in a loop (and
/// reading them: nothing else is wrong with it) held every `publish` of the engine for up to
/// one build, 1.2 s for a 500K-block index.
#[test]
fn publishing_does_not_wait_for_a_snapshot_being_built() {
    let blocks = index(200_000);
    let build = {
        let mut m = Mirror::new();
        blocks.iter().for_each(|e| m.apply(e));
        let t = Instant::now();
        let s = m.snapshot();
        let took = t.elapsed();
        drop(s);
        took
    };
    let p = Publisher::bind(PublisherConfig {
        block_size: 4,
        ..Default::default()
    })
    .unwrap();
    p.publish(0.0, &blocks).unwrap();
    drop(blocks);
    let stop = Arc::new(AtomicBool::new(false));
    let (answered_tx, answered_rx) = std::sync::mpsc::channel();
    let asker = {
        let (ep, stop) = (p.replay_endpoint().unwrap().to_owned(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let ctx = zmq::Context::new();
            let s = ctx.socket(zmq::DEALER).unwrap();
            s.set_linger(0).unwrap();
            s.set_rcvtimeo(500).unwrap();
            s.connect(&ep).unwrap();
            while !stop.load(Ordering::Relaxed) {
                s.send_multipart([&b""[..], &SNAPSHOT_REQUEST], 0).unwrap();
                // read the answer, up to its end marker
                while !stop.load(Ordering::Relaxed) {
                    match s.recv_multipart(0) {
                        Ok(f) if f.get(2).map(Vec::as_slice) == Some(&END_SEQ[..]) => {
                            let _ = answered_tx.send(());
                            break;
                        }
                        _ => {}
                    }
                }
            }
        })
    };
    // the asker is served: snapshots are being built from here on
    answered_rx
        .recv_timeout(Duration::from_secs(120))
        .expect("a snapshot answered");
    // an engine's steps: a batch every 20 ms, each a new state (the next request's
    // snapshot is a new one); the time spent in `publish` is summed
    let mut took = Duration::ZERO;
    for i in 0..20 {
        std::thread::sleep(Duration::from_millis(20));
        let t = Instant::now();
        p.publish(i as f64, &[]).unwrap();
        took += t.elapsed();
    }
    stop.store(true, Ordering::Relaxed);
    asker.join().unwrap();
    assert!(
        took < 2 * build,
        "20 publishes took {took:?} while snapshots were asked for; one build takes {build:?}"
    );
}
