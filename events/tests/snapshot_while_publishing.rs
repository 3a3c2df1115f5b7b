//! A snapshot asked for while batches are published is exactly the batches up to the number
//! it carries: byte for byte the snapshot of a mirror folded from batches 0..=N.

use std::sync::Arc;
use std::time::Duration;

use kvtier_events::*;
use kvtier_radix::PageHash;

fn h(i: u64) -> PageHash {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&(i + 1).to_le_bytes());
    PageHash(b)
}

/// Batch `i`: a chain stored on the device, part of it backed up to host, some of it
/// removed again, blocks stored again, now and then a clear.
fn batch(i: u64) -> Vec<WireEvent> {
    let base = (i % 40) * 4;
    let store = |from: u64, n: u64, medium| WireEvent::BlockStored {
        block_hashes: (from..from + n).map(h).collect(),
        parent_block_hash: from.checked_sub(1).map(h),
        token_ids: (0..n as u32 * 2).collect(),
        block_size: 2,
        medium,
        lora_name: i.is_multiple_of(3).then(|| "a".to_string()),
        locality: Some(Locality::Local),
    };
    let mut out = vec![store(base, 4, Medium::Gpu), store(base, 2, Medium::Cpu)];
    if i % 5 == 1 {
        out.push(WireEvent::BlockRemoved {
            block_hashes: vec![h(base + 3), h((i * 7) % 160)],
            medium: Medium::Gpu,
            locality: Some(Locality::Local),
        });
    }
    if i % 97 == 96 {
        out.push(WireEvent::AllBlocksCleared);
    }
    out
}

fn ts(i: u64) -> f64 {
    1000.0 + i as f64
}

#[test]
fn a_snapshot_taken_while_publishing_is_exactly_the_batches_up_to_its_number() {
    let n = 400u64;
    let expected: Vec<Vec<u8>> = {
        let mut m = Mirror::new();
        (0..n)
            .map(|i| {
                batch(i).iter().for_each(|e| m.apply(e));
                encode_batch(ts(i), &m.snapshot(), 0, HashFormat::Bytes).unwrap()
            })
            .collect()
    };
    let p = Arc::new(
        Publisher::bind(PublisherConfig {
            block_size: 2,
            hash_format: HashFormat::Bytes,
            ..Default::default()
        })
        .unwrap(),
    );
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_rcvtimeo(60_000).unwrap();
    s.connect(p.replay_endpoint().unwrap()).unwrap();
    // batches in chunks of 50, each published while snapshots are asked for; the next
    // chunk once a snapshot holding this one was answered (so at least 8 states are seen)
    let (answered_tx, answered_rx) = std::sync::mpsc::channel::<i64>();
    let publisher = {
        let p = Arc::clone(&p);
        std::thread::spawn(move || {
            for i in 0..n {
                assert_eq!(p.publish(ts(i), &batch(i)).unwrap(), i);
                if i % 50 == 49 {
                    while answered_rx
                        .recv_timeout(Duration::from_secs(120))
                        .expect("snapshots answered")
                        < i as i64
                    {}
                }
            }
        })
    };
    let mut seen = std::collections::BTreeSet::new();
    let mut last = -1i64;
    while last < n as i64 - 1 {
        s.send_multipart([&b""[..], &SNAPSHOT_REQUEST], 0).unwrap();
        let mut answer = None;
        loop {
            let f = s.recv_multipart(0).expect("an answer");
            let seq = i64::from_be_bytes(f[2].as_slice().try_into().unwrap());
            if seq == -1 {
                break;
            }
            assert!(answer.is_none(), "one batch per snapshot");
            answer = Some((seq, f[3].clone()));
        }
        // nothing published yet: the end marker alone
        let Some((seq, bytes)) = answer else { continue };
        assert!(seq >= last, "snapshot {seq} after snapshot {last}");
        assert!(
            bytes == expected[seq as usize],
            "the snapshot numbered {seq} is not the batches 0..={seq}"
        );
        seen.insert(seq);
        last = seq;
        let _ = answered_tx.send(seq);
    }
    publisher.join().unwrap();
    assert!(seen.len() >= 8, "snapshots of {} states only", seen.len());
}
