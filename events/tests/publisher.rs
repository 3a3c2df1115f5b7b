//! The publisher over real ZMQ sockets on loopback: vLLM's framing, replay from a sequence
//! number, the snapshot request, and typed errors for bad configs.

use std::time::Duration;

use kvtier_events::*;
use kvtier_radix::PageHash;

fn stored(h: u8, parent: Option<u8>) -> WireEvent {
    WireEvent::BlockStored {
        block_hashes: vec![PageHash([h; 32])],
        parent_block_hash: parent.map(|p| PageHash([p; 32])),
        token_ids: vec![u32::from(h); 4],
        block_size: 4,
        medium: Medium::Gpu,
        lora_name: None,
        locality: Some(Locality::Local),
    }
}

fn removed(h: u8) -> WireEvent {
    WireEvent::BlockRemoved {
        block_hashes: vec![PageHash([h; 32])],
        medium: Medium::Gpu,
        locality: None,
    }
}

fn batches() -> Vec<Vec<WireEvent>> {
    (0u8..10)
        .map(|i| {
            if i % 3 == 2 {
                vec![removed(i - 1)]
            } else {
                vec![stored(i, i.checked_sub(1))]
            }
        })
        .collect()
}

fn ts(i: usize) -> f64 {
    1000.0 + i as f64
}

struct Client {
    _ctx: zmq::Context,
    /// The publisher's topic, checked on every live and replayed batch.
    topic: Vec<u8>,
    sub: zmq::Socket,
    replay: zmq::Socket,
}

impl Client {
    fn connect(p: &Publisher, topic: &str) -> Self {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.set_rcvtimeo(300).unwrap();
        // A SUB joins asynchronously (ZMQ's slow joiner): wait for its handshake (at most
        // 5 s, however loaded the machine), then for the PUB to take the subscription.
        sub.monitor(
            "inproc://sub-monitor",
            zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32,
        )
        .unwrap();
        let mon = ctx.socket(zmq::PAIR).unwrap();
        mon.set_rcvtimeo(5000).unwrap();
        mon.connect("inproc://sub-monitor").unwrap();
        sub.connect(p.endpoint()).unwrap();
        mon.recv_multipart(0).expect("the SUB's handshake");
        let replay = ctx.socket(zmq::DEALER).unwrap();
        replay.set_rcvtimeo(3000).unwrap();
        replay.connect(p.replay_endpoint().unwrap()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        Self {
            _ctx: ctx,
            topic: topic.as_bytes().to_vec(),
            sub,
            replay,
        }
    }

    /// `(seq, payload)` of a replay request, up to the end marker.
    fn request(&self, start: [u8; 8]) -> Vec<(i64, Vec<u8>)> {
        self.replay.send_multipart([&b""[..], &start], 0).unwrap();
        let mut out = Vec::new();
        loop {
            // vLLM 0.32's replies: [empty, topic, seq, payload], the end [empty, empty, -1, empty]
            let f = self.replay.recv_multipart(0).expect("a replay reply");
            assert_eq!(f.len(), 4, "[empty, topic, seq, payload]");
            assert!(f[0].is_empty());
            let seq = i64::from_be_bytes(f[2].as_slice().try_into().unwrap());
            if seq == -1 {
                assert!(f[1].is_empty() && f[3].is_empty(), "the end marker");
                return out;
            }
            assert_eq!(f[1], self.topic, "a replayed batch names its topic");
            out.push((seq, f[3].clone()));
        }
    }

    /// The live batches, up to the one numbered `last`: received until it arrives (or 20 s
    /// pass, however late the publisher thread runs), not until a quiet spell.
    fn live(&self, last: i64) -> Vec<(i64, Vec<u8>)> {
        let mut out: Vec<(i64, Vec<u8>)> = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while out.last().map(|l| l.0) != Some(last) && std::time::Instant::now() < deadline {
            if let Ok(f) = self.sub.recv_multipart(0) {
                assert_eq!(f.len(), 3, "[topic, seq, payload]");
                assert_eq!(f[0], self.topic, "a live batch names its topic");
                out.push((
                    i64::from_be_bytes(f[1].as_slice().try_into().unwrap()),
                    f[2].clone(),
                ));
            }
        }
        out
    }
}

#[test]
fn live_stream_and_replay_carry_every_batch_in_order() {
    let p = Publisher::bind(PublisherConfig {
        block_size: 4,
        topic: "model-a".into(),
        ..Default::default()
    })
    .unwrap();
    let all = batches();
    for (i, b) in all[..5].iter().enumerate() {
        assert_eq!(p.publish(ts(i), b).unwrap(), i as u64);
    }
    let c = Client::connect(&p, "model-a"); // joined late: batches 0..5 only by replay
    for (i, b) in all.iter().enumerate().skip(5) {
        assert_eq!(p.publish(ts(i), b).unwrap(), i as u64);
    }
    let want: Vec<(i64, Vec<u8>)> = all
        .iter()
        .enumerate()
        .map(|(i, b)| {
            (
                i as i64,
                encode_batch(ts(i), b, 0, HashFormat::Int64).unwrap(),
            )
        })
        .collect();
    // Live: every batch from the one the subscriber joined at, in order; replay has all of
    // them. Where it joined is a race, not a constant: `publish` only queues the batch for the
    // publisher thread, so on a loaded machine batches 0..5 may reach the PUB after the
    // subscription (joined < 5), and the PUB may take the subscription late (joined > 5).
    // What cannot happen is a gap, a reordering, or missing the last batch.
    let live = c.live(9);
    let joined = want.len().saturating_sub(live.len());
    assert!(
        joined < want.len(),
        "the subscriber heard {} of {} batches",
        live.len(),
        want.len()
    );
    assert_eq!(
        live,
        want[joined..].to_vec(),
        "the live stream from when the subscriber joined"
    );
    assert_eq!(c.request(0u64.to_be_bytes()), want, "replay from 0");
    assert_eq!(
        c.request(7u64.to_be_bytes()),
        want[7..].to_vec(),
        "replay from 7"
    );
    assert_eq!(
        c.request(10u64.to_be_bytes()),
        vec![],
        "replay past the end"
    );
}

#[test]
fn a_subscriber_whose_history_is_gone_recovers_from_a_snapshot() {
    // whole hashes on the wire, so the decoded snapshot can be compared hash for hash
    let p = Publisher::bind(PublisherConfig {
        block_size: 4,
        buffer_steps: 3,
        hash_format: HashFormat::Bytes,
        ..Default::default()
    })
    .unwrap();
    let c = Client::connect(&p, "");
    assert_eq!(
        c.request(SNAPSHOT_REQUEST),
        vec![],
        "nothing published: the end marker alone"
    );
    let all = batches();
    let mut truth = Mirror::new();
    for (i, b) in all.iter().enumerate() {
        p.publish(ts(i), b).unwrap();
        b.iter().for_each(|e| truth.apply(e));
    }
    // the batches reach the publisher thread asynchronously: wait until the last one is out
    assert_eq!(c.live(9).last().map(|l| l.0), Some(9));
    let replayed = c.request(0u64.to_be_bytes());
    assert_eq!(
        replayed.first().map(|r| r.0),
        Some(7),
        "only the last 3 batches are kept: a gap"
    );
    let snap = c.request(SNAPSHOT_REQUEST);
    assert_eq!(snap.len(), 1);
    assert_eq!(
        snap[0].0, 9,
        "the snapshot includes every batch up to the last"
    );
    // stamped with the last batch's time (it was 0.0: a router ageing entries by the batch
    // time took a fresh snapshot for one from 1970)
    assert_eq!(batch_ts(&snap[0].1), ts(all.len() - 1));
    // decode the snapshot the way a subscriber does and rebuild the index from it
    let mut rebuilt = Mirror::new();
    for e in decode_batch(&snap[0].1) {
        rebuilt.apply(&e);
    }
    assert_eq!(rebuilt.hashes(Medium::Gpu), truth.hashes(Medium::Gpu));
    assert_eq!(p.resident_blocks(), truth.blocks());
}

#[test]
fn the_replay_buffer_is_bounded_in_bytes_too() {
    // 10,000 batches (vLLM's default) of a long prompt's blocks each are gigabytes: the
    // buffer also keeps at most `buffer_bytes`, oldest dropped first (a subscriber further
    // behind recovers from a snapshot), and always the latest batch.
    let big = |i: u8| -> Vec<WireEvent> {
        (0..64)
            .map(|k| stored(i.wrapping_mul(64).wrapping_add(k), None))
            .collect()
    };
    let p = Publisher::bind(PublisherConfig {
        block_size: 4,
        buffer_steps: 1_000,
        buffer_bytes: 1,
        ..Default::default()
    })
    .unwrap();
    let c = Client::connect(&p, "");
    for i in 0..3u8 {
        p.publish(ts(i as usize), &big(i)).unwrap();
    }
    assert_eq!(c.live(2).last().map(|l| l.0), Some(2));
    let replayed = c.request(0u64.to_be_bytes());
    assert_eq!(
        replayed.iter().map(|r| r.0).collect::<Vec<_>>(),
        vec![2],
        "only the latest"
    );
    // room for two batches of that size: the last two
    let one = replayed[0].1.len();
    let p = Publisher::bind(PublisherConfig {
        block_size: 4,
        buffer_steps: 1_000,
        buffer_bytes: 2 * one + one / 2,
        ..Default::default()
    })
    .unwrap();
    let c = Client::connect(&p, "");
    for i in 0..5u8 {
        p.publish(ts(i as usize), &big(i)).unwrap();
    }
    assert_eq!(c.live(4).last().map(|l| l.0), Some(4));
    let seqs: Vec<i64> = c.request(0u64.to_be_bytes()).iter().map(|r| r.0).collect();
    assert_eq!(seqs, vec![3, 4]);
    let snap = c.request(SNAPSHOT_REQUEST);
    assert_eq!(
        snap.len(),
        1,
        "a snapshot still answers for what the buffer dropped"
    );
}

#[test]
fn bad_configs_are_typed_errors() {
    let bad = |cfg: PublisherConfig| Publisher::bind(cfg).err().expect("refused");
    assert!(matches!(
        bad(PublisherConfig {
            buffer_steps: 0,
            ..Default::default()
        }),
        PublishError::Config(_)
    ));
    assert!(matches!(
        bad(PublisherConfig {
            buffer_bytes: 0,
            ..Default::default()
        }),
        PublishError::Config(_)
    ));
    assert!(matches!(
        bad(PublisherConfig {
            block_size: 0,
            ..Default::default()
        }),
        PublishError::Config(_)
    ));
    assert!(matches!(
        bad(PublisherConfig {
            endpoint: "tcp://256.1.1.1:5557".into(),
            ..Default::default()
        }),
        PublishError::Zmq { .. }
    ));
    assert!(matches!(
        bad(PublisherConfig {
            replay_endpoint: Some("nonsense".into()),
            ..Default::default()
        }),
        PublishError::Zmq { .. }
    ));
    // a NUL byte in an address (from Python, a config file): a typed error, not the zmq
    // crate's panic in `CString::new`
    assert!(matches!(
        bad(PublisherConfig {
            endpoint: "tcp://127.0.0.1:*\0x".into(),
            ..Default::default()
        }),
        PublishError::Config(_)
    ));
    assert!(matches!(
        bad(PublisherConfig {
            replay_endpoint: Some("tcp://127.0.0.1:*\0".into()),
            ..Default::default()
        }),
        PublishError::Config(_)
    ));
    // two publishers on one address: the second is refused, the first keeps working
    let a = Publisher::bind(PublisherConfig::default()).unwrap();
    let taken = PublisherConfig {
        endpoint: a.endpoint().to_string(),
        ..Default::default()
    };
    assert!(matches!(bad(taken), PublishError::Zmq { .. }));
    assert_eq!(a.publish(0.0, &[WireEvent::AllBlocksCleared]).unwrap(), 0);
}

#[test]
fn a_closed_publisher_refuses_batches() {
    let mut p = Publisher::bind(PublisherConfig::default()).unwrap();
    p.shutdown();
    assert!(matches!(p.publish(0.0, &[]), Err(PublishError::Closed)));
    p.shutdown(); // idempotent
}

extern "C" fn ignore_signal(_: libc::c_int) {}

/// A signal delivered to the publishing thread while its send waits for the publisher thread
/// (behind, answering snapshot requests) interrupted the send: `publish` failed with EINTR,
/// and `publish_from` had already drained the scheduler's events, so a router never heard of
/// them (no gap in the numbers: the batch was never numbered); a batch interrupted after its
/// first frame left that frame queued, so the next batch arrived as four frames and was
/// dropped by the thread. Python installs its handlers without `SA_RESTART`, and engines get
/// SIGCHLD, SIGINT, SIGALRM. Every publish now succeeds, and every batch is replayed whole.
#[test]
fn signals_during_a_send_neither_fail_nor_split_a_batch() {
    // SAFETY: a handler that does nothing, installed without SA_RESTART (as Python's are).
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = ignore_signal as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut act.sa_mask);
        act.sa_flags = 0;
        assert_eq!(
            libc::sigaction(libc::SIGUSR1, &act, std::ptr::null_mut()),
            0
        );
    }
    let n = 5_000usize;
    let p = Publisher::bind(PublisherConfig {
        block_size: 4,
        buffer_steps: n + 10,
        buffer_bytes: 1 << 30,
        ..Default::default()
    })
    .unwrap();
    // A large mirror, so that each snapshot request keeps the publisher thread busy.
    let big: Vec<WireEvent> = (0..100_000u32)
        .map(|i| {
            let mut h = [0u8; 32];
            h[..4].copy_from_slice(&i.to_le_bytes());
            h[31] = 1;
            WireEvent::BlockStored {
                block_hashes: vec![PageHash(h)],
                parent_block_hash: None,
                token_ids: vec![i; 4],
                block_size: 4,
                medium: Medium::Gpu,
                lora_name: None,
                locality: None,
            }
        })
        .collect();
    p.publish(0.0, &big).unwrap();
    let c = Client::connect(&p, "");
    for _ in 0..10 {
        c.replay
            .send_multipart([&b""[..], &SNAPSHOT_REQUEST], 0)
            .unwrap();
    }
    // SAFETY: pthread_self of this thread, signalled only while it lives (joined below).
    let me = unsafe { libc::pthread_self() };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let signaller = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // SAFETY: the test thread outlives this loop (it stops and joins it).
                unsafe { libc::pthread_kill(me, libc::SIGUSR1) };
                sent += 1;
                std::thread::sleep(Duration::from_micros(50));
            }
            sent
        })
    };
    let mut failed = Vec::new();
    for i in 1..=n {
        if let Err(e) = p.publish(ts(i), &[stored((i % 200) as u8, None)]) {
            failed.push((i, e.to_string()));
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let signals = signaller.join().unwrap();
    assert!(signals > 0);
    assert!(
        failed.is_empty(),
        "{} of {n} publishes failed under {signals} signals, first {:?}",
        failed.len(),
        failed.first()
    );
    // The snapshot answers first: each is a snapshot and the end marker.
    let mut ends = 0;
    while ends < 10 {
        let f = c.replay.recv_multipart(0).expect("a snapshot answer");
        if f.get(2).map(Vec::as_slice) == Some(&END_SEQ[..]) {
            ends += 1;
        }
    }
    // The last batches whole and in order (fewer than the replay socket's queue holds): a
    // batch split by an interrupted send is dropped by the thread and missing here.
    let from = n - 499;
    let replayed = c.request((from as u64).to_be_bytes());
    let seqs: Vec<i64> = replayed.iter().map(|r| r.0).collect();
    assert_eq!(seqs, (from as i64..=n as i64).collect::<Vec<_>>());
    for (seq, payload) in &replayed {
        assert_eq!(batch_ts(payload), ts(*seq as usize));
    }
}

/// A minimal msgpack reading of the batch (the full check against vLLM's own classes is
/// bindings/tests/vllm_suite/test_vllm_kv_events.py).
/// A batch's timestamp (its first field).
fn batch_ts(b: &[u8]) -> f64 {
    let v = rmpv::decode::read_value(&mut &b[..]).unwrap();
    v.as_array()
        .and_then(|top| top[0].as_f64())
        .expect("a float timestamp first")
}

fn decode_batch(b: &[u8]) -> Vec<WireEvent> {
    use rmpv::Value;
    let v = rmpv::decode::read_value(&mut &b[..]).unwrap();
    let Value::Array(top) = v else {
        panic!("a batch is an array")
    };
    assert_eq!(top.len(), 3);
    let Value::Array(events) = &top[1] else {
        panic!("events")
    };
    let field = |m: &Vec<(Value, Value)>, k: &str| {
        m.iter()
            .find(|(x, _)| x.as_str() == Some(k))
            .map(|(_, v)| v.clone())
    };
    let hash = |v: &Value| PageHash(v.as_slice().unwrap().try_into().unwrap());
    let medium = |v: Value| match v.as_str().unwrap() {
        "GPU" => Medium::Gpu,
        "CPU" => Medium::Cpu,
        _ => Medium::Storage,
    };
    events
        .iter()
        .map(|e| {
            let Value::Map(m) = e else {
                panic!("an event is a map")
            };
            match field(m, "type").unwrap().as_str().unwrap() {
                "AllBlocksCleared" => WireEvent::AllBlocksCleared,
                "BlockStored" => WireEvent::BlockStored {
                    block_hashes: field(m, "block_hashes")
                        .unwrap()
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(hash)
                        .collect(),
                    parent_block_hash: field(m, "parent_block_hash")
                        .filter(|v| !v.is_nil())
                        .map(|v| hash(&v)),
                    token_ids: field(m, "token_ids")
                        .unwrap()
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap() as u32)
                        .collect(),
                    block_size: field(m, "block_size").unwrap().as_u64().unwrap() as u32,
                    medium: medium(field(m, "medium").unwrap()),
                    lora_name: None,
                    locality: None,
                },
                other => panic!("unexpected {other}"),
            }
        })
        .collect()
}

/// `n` distinct stored blocks, a chain (a resident set a snapshot has to list).
fn chain(n: usize) -> Vec<WireEvent> {
    (0..n)
        .map(|i| {
            let h = |i: usize| {
                let mut b = [0u8; 32];
                b[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
                PageHash(b)
            };
            WireEvent::BlockStored {
                block_hashes: vec![h(i)],
                parent_block_hash: i.checked_sub(1).map(h),
                token_ids: vec![i as u32; 4],
                block_size: 4,
                medium: Medium::Gpu,
                lora_name: None,
                locality: Some(Locality::Local),
            }
        })
        .collect()
}

/// An adversarial tester's hang: a client asking for snapshots in a loop slows the publisher
/// thread; once the batches queued to it filled its inbound queue, `publish` blocked handing
/// it the next one while holding the state lock, which the thread needed to build the next
/// snapshot: both waited for ever (the engine's step stuck in `publish_from`). Publishing
/// must finish whatever the replay socket is asked.
#[test]
fn snapshot_requests_never_block_publishing() {
    let p = std::sync::Arc::new(
        Publisher::bind(PublisherConfig {
            block_size: 4,
            ..Default::default()
        })
        .unwrap(),
    );
    p.publish(0.0, &chain(10_000)).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let asker = {
        let (ep, stop) = (p.replay_endpoint().unwrap().to_owned(), stop.clone());
        std::thread::spawn(move || {
            let ctx = zmq::Context::new();
            let s = ctx.socket(zmq::DEALER).unwrap();
            s.set_linger(0).unwrap();
            s.connect(&ep).unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // never read the answers: the publisher thread keeps building snapshots
                if s.send_multipart([&b""[..], &SNAPSHOT_REQUEST], zmq::DONTWAIT)
                    .is_err()
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
    };
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let publisher = std::sync::Arc::clone(&p);
    std::thread::spawn(move || {
        for i in 0..6_000 {
            publisher.publish(ts(i), &[removed(7)]).unwrap();
        }
        let _ = done_tx.send(());
    });
    let finished = done_rx.recv_timeout(Duration::from_secs(120)).is_ok();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(finished, "publish blocked behind the snapshots");
    asker.join().unwrap();
}

/// An adversarial tester's hole: a replay sent more batches than the ROUTER socket queues
/// (its default send high-water mark, 1,000), and ZMQ dropped the rest and the end marker
/// without an error: the requester saw batches 0..999 and nothing more. Every kept batch and
/// the end marker arrive, or (a requester that does not read) none after the first refused.
#[test]
fn a_replay_longer_than_a_socket_queue_arrives_whole() {
    let p = Publisher::bind(PublisherConfig {
        block_size: 4,
        ..Default::default()
    })
    .unwrap();
    let c = Client::connect(&p, "");
    let n = 3_000;
    for i in 0..n {
        p.publish(ts(i), &[removed(7)]).unwrap();
    }
    assert_eq!(c.live(n as i64 - 1).last().map(|l| l.0), Some(n as i64 - 1));
    let got = c.request(0u64.to_be_bytes());
    let seqs: Vec<i64> = got.iter().map(|g| g.0).collect();
    assert_eq!(seqs, (0..n as i64).collect::<Vec<_>>());
}

/// A malformed replay request (a start that is not 8 bytes, a missing or extra frame) was
/// not answered at all: the requester waited out its timeout. It gets the end marker alone,
/// and the publisher goes on answering.
#[test]
fn a_malformed_replay_request_gets_the_end_marker() {
    let p = Publisher::bind(PublisherConfig {
        block_size: 4,
        ..Default::default()
    })
    .unwrap();
    p.publish(ts(0), &[removed(7)]).unwrap();
    let c = Client::connect(&p, "");
    for bad in [
        vec![&b""[..], &b"abc"[..]],
        vec![&b""[..]],
        vec![&b""[..], &[0u8; 8][..], &b"x"[..]],
        vec![&b"x"[..], &[0u8; 8][..]],
    ] {
        c.replay.send_multipart(bad.clone(), 0).unwrap();
        let f = c
            .replay
            .recv_multipart(0)
            .unwrap_or_else(|e| panic!("{bad:?}: {e}"));
        assert_eq!(f.len(), 4, "{bad:?}");
        assert_eq!(i64::from_be_bytes(f[2].as_slice().try_into().unwrap()), -1);
    }
    assert_eq!(c.request(0u64.to_be_bytes()).len(), 1, "still answering");
}

/// A child forked while a publisher was live (an engine forking its workers, `multiprocessing`'s
/// fork start method) shares its parent's sockets but not its thread: a publish there was
/// queued for a thread that does not exist, and dropping the publisher (a Python child's
/// exit) panicked ("threads should not terminate unexpectedly", joining it) and closed the
/// sockets, whose signalling the parent's ZMQ threads share: the parent aborted
/// (`Assertion failed: ok (mailbox.cpp:99)`). In a child every publish is refused and the
/// drop touches nothing of the parent's; the parent publishes on.
#[test]
fn a_forked_child_neither_publishes_nor_breaks_the_parents_publisher() {
    let p = Publisher::bind(PublisherConfig::default()).unwrap();
    p.publish(ts(0), &batches()[0]).unwrap();
    // SAFETY: the child calls only the publisher and then `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let refused = matches!(
                p.publish(ts(1), &batches()[1]),
                Err(PublishError::Forked { .. })
            );
            drop(p);
            refused
        })) {
            Ok(true) => 0,
            Ok(false) => 1,
            Err(_) => 2,
        };
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child: 1 = its publish was not refused, 2 = it panicked (status {status:#x})"
    );
    let c = Client::connect(&p, "");
    let seq = p.publish(ts(2), &batches()[2]).unwrap();
    assert_eq!(seq, 1, "the child's batch was not numbered");
    let live = c.live(1);
    assert_eq!(
        live.last().map(|l| l.0),
        Some(1),
        "the parent still publishes"
    );
    assert_eq!(
        c.request(0i64.to_be_bytes()).len(),
        2,
        "its history is whole"
    );
}
