//! What one publisher can make the router hold, measured as the process's peak resident
//! memory (`VmHWM` in /proc/self/status): its own test binary, so no other test's
//! allocations count.

use std::time::{Duration, Instant};

use kvtier_events::{HashFormat, Medium, WireEvent, encode_batch};
use kvtier_radix::HashScope;
use kvtier_router::CostModel;
use kvtier_router::cluster::Keys;
use kvtier_router::launch::{self, Config, EndpointSpec};

const PS: usize = 16;

/// The process's peak resident memory, bytes.
fn peak_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kb << 10
}

fn page(seed: u32) -> Vec<u8> {
    let toks: Vec<u32> = (0..PS as u32).map(|i| seed * 1000 + i).collect();
    let hs = HashScope::new(None, None, Vec::new()).page_hashes(&toks, PS);
    let ev = WireEvent::BlockStored {
        token_ids: toks,
        block_hashes: hs,
        parent_block_hash: None,
        block_size: PS as u32,
        medium: Medium::Gpu,
        lora_name: None,
        locality: None,
    };
    encode_batch(0.0, &[ev], 0, HashFormat::Int64).expect("encode")
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(30), "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A live frame of 1 GiB from a hostile publisher, with the batch cap at 1 MiB: the router
/// read it whole (ZMQ had no `ZMQ_MAXMSGSIZE`), then copied it, before the cap skipped it:
/// the process's peak grew by over 2 GiB. Now the publisher is disconnected at the frame's
/// header: the peak grows by far less than the frame, and the stream reconnects and goes on
/// applying the publisher's batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_frame_past_the_batch_cap_is_never_received_whole() {
    let ctx = zmq::Context::new();
    let pub_ = ctx.socket(zmq::PUB).expect("pub");
    pub_.set_linger(0).expect("linger");
    pub_.bind("tcp://127.0.0.1:*").expect("bind");
    let ep = pub_.get_last_endpoint().expect("ep").expect("utf-8");
    let mut subscribe = launch::subscribe_options(300, 600.0);
    subscribe.max_batch_bytes = 1 << 20;
    let r = launch::start(Config {
        model: CostModel {
            page_size: PS,
            ..CostModel::h100_llama8b()
        },
        keys: Keys::Engine,
        subscribe,
        ..Config::new(
            "127.0.0.1:0".parse().expect("addr"),
            vec![EndpointSpec {
                events: Some(ep),
                ..EndpointSpec::default()
            }],
        )
    })
    .await
    .expect("start");
    let mut seq = 0u64;
    let mut send = |payload: zmq::Message| {
        pub_.send(&b""[..], zmq::SNDMORE).expect("topic");
        pub_.send(&seq.to_be_bytes()[..], zmq::SNDMORE)
            .expect("seq");
        pub_.send(payload, 0).expect("payload");
        seq += 1;
    };
    let applied = |r: &launch::Running| r.cluster.lock().expect("lock").streams[0].counters.clone();
    // small batches until the SUB has joined (ZMQ's slow joiner)
    let small = page(1);
    let c = std::sync::Arc::clone(&r.cluster);
    let t = Instant::now();
    while applied(&r).applied == 0 {
        assert!(t.elapsed() < Duration::from_secs(30), "never joined");
        send(zmq::Message::from(&small[..]));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = peak_rss();
    // zeroed pages, never touched: sending them costs the publisher no resident memory
    send(zmq::Message::from(vec![0u8; 1 << 30]));
    until("the frame refused (or skipped)", || {
        let s = applied(&r);
        s.reconnects > 0 || s.oversized > 0
    })
    .await;
    let grew = peak_rss().saturating_sub(before);
    assert!(
        grew < 256 << 20,
        "the peak grew by {} MiB for a 1 GiB frame past a 1 MiB cap",
        grew >> 20
    );
    // the stream goes on: a later batch is indexed
    let next = page(2);
    let t = Instant::now();
    let pages = || c.lock().expect("lock").router().index().pages();
    while pages() < 2 {
        assert!(t.elapsed() < Duration::from_secs(30), "never recovered");
        send(zmq::Message::from(&next[..]));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        pages(),
        2,
        "the page before the frame stays, the one after is added"
    );
    r.stop().await;
}
