//! The router service against real kvtier publishers on loopback: live events, a real gap
//! recovered through the publisher's replay socket, a restarted router rebuilt from
//! snapshots, dead and garbage publishers, the memory cap, and `POST /route` over HTTP.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use kvtier_events::{Medium, WireEvent};
use kvtier_router::cluster::Keys;
use kvtier_router::launch::EndpointSpec;

/// Batches touching GPU and CPU: stores, a backup, removals, a re-store.
fn workload(seed: u32) -> Vec<Vec<WireEvent>> {
    let a = tokens(seed, 6);
    let b = tokens(seed + 1, 4);
    let c = tokens(seed + 2, 3);
    vec![
        vec![stored(&a, Medium::Gpu)],
        vec![stored(&b, Medium::Gpu)],
        vec![stored(&a[..4 * PS], Medium::Cpu)],
        vec![removed(&b, Medium::Gpu)],
        vec![stored(&c, Medium::Gpu), stored(&b[..2 * PS], Medium::Cpu)],
        vec![removed(&a[..2 * PS], Medium::Cpu)],
        vec![stored(&b, Medium::Gpu)],
        vec![removed(&c[2 * PS..], Medium::Gpu)],
        vec![stored(&tokens(seed + 3, 5), Medium::Gpu)],
        vec![stored(&tokens(seed + 4, 2), Medium::Cpu)],
    ]
}

fn entries(r: &kvtier_router::launch::Running) -> Vec<(usize, &'static str, u64)> {
    r.cluster.lock().expect("lock").router().index().entries()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_gap_is_recovered_by_replay_to_the_exact_index() {
    let p = publisher();
    let batches = workload(1);
    // the router hears the publisher through a relay that loses batches 3 and 6
    let relay = Relay::start(p.endpoint(), HashSet::from([3, 6]));
    let spec = EndpointSpec {
        events: Some(relay.endpoint.clone()),
        replay: p.replay_endpoint().map(str::to_string),
        url: None,
        topic: None,
    };
    let r = router(vec![spec], None, 1 << 20, Keys::Engine).await;
    joined(&r).await;
    // two separate gaps: the replay of the first could reach past batch 6 (and cover the
    // second) if 6 went out before it ran, so batch 6 waits until the first is recovered
    let c = Arc::clone(&r.cluster);
    for (i, b) in batches.iter().enumerate() {
        if i == 6 {
            until("the first gap recovered", || {
                c.lock().expect("lock").streams[0].next_seq == Some(6)
            })
            .await;
        }
        p.publish(0.0, b).expect("publish");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let want = reference(std::slice::from_ref(&batches), 1 << 20).entries();
    until("index equals the clean stream's", || {
        c.lock().expect("lock").router().index().entries() == want
    })
    .await;
    let st = r.cluster.lock().expect("lock").streams[0].counters.clone();
    assert!(st.gaps >= 2, "{st:?}");
    assert!(st.replays >= 2, "{st:?}");
    assert_eq!(st.lost, 0, "{st:?}");
    assert_eq!(
        r.cluster.lock().expect("lock").streams[0].next_seq,
        Some(batches.len() as u64)
    );
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_router_rebuilds_the_same_index_from_snapshots() {
    let (p0, p1, l3) = (publisher(), publisher(), publisher());
    let specs = vec![spec(&p0), spec(&p1)];
    let first = router(specs.clone(), Some(spec(&l3)), 1 << 20, Keys::Engine).await;
    joined(&first).await;
    let (w0, w1) = (workload(10), workload(20));
    let store: Vec<Vec<WireEvent>> = vec![
        vec![stored(&tokens(10, 6), Medium::Storage)],
        vec![removed(&tokens(10, 6)[..3 * PS], Medium::Storage)],
        vec![stored(&tokens(30, 3), Medium::Storage)],
    ];
    for i in 0..w0.len() {
        p0.publish(0.0, &w0[i]).expect("publish");
        p1.publish(0.0, &w1[i]).expect("publish");
        if let Some(s) = store.get(i) {
            l3.publish(0.0, s).expect("publish");
        }
    }
    let mut want = reference(&[w0.clone(), w1.clone()], 1 << 20);
    for b in &store {
        let p = kvtier_events::encode_batch(0.0, b, 0, kvtier_events::HashFormat::Int64)
            .expect("encode");
        for e in kvtier_router::decode_batch(&p).expect("decode") {
            want.apply(0, &e);
        }
    }
    let want = want.entries();
    let c = Arc::clone(&first.cluster);
    until("live index complete", || {
        c.lock().expect("lock").router().index().entries() == want
    })
    .await;
    first.stop().await;
    // a new router: nothing is published any more, so only snapshots can fill it
    let second = router(specs, Some(spec(&l3)), 1 << 20, Keys::Engine).await;
    synced(&second).await;
    assert_eq!(entries(&second), want);
    {
        let c = second.cluster.lock().expect("lock");
        assert!(c.streams.iter().all(|s| s.counters.snapshots == 1));
        assert_eq!(c.streams[0].next_seq, Some(w0.len() as u64));
        assert_eq!(c.streams[2].next_seq, Some(store.len() as u64));
    }
    second.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_and_garbage_publishers_never_fail_a_request() {
    // instance 0: nothing listens; instance 1: a PUB that sends garbage; instance 2: healthy
    let dead = EndpointSpec {
        events: Some(format!("tcp://127.0.0.1:{}", closed_port())),
        replay: Some(format!("tcp://127.0.0.1:{}", closed_port())),
        url: None,
        topic: None,
    };
    let ctx = zmq::Context::new();
    let garbage = ctx.socket(zmq::PUB).expect("pub");
    garbage.bind("tcp://127.0.0.1:*").expect("bind");
    let gep = garbage.get_last_endpoint().expect("ep").expect("utf-8");
    let bad = EndpointSpec {
        events: Some(gep),
        replay: None,
        url: None,
        topic: None,
    };
    let good = publisher();
    let r = router(vec![dead, bad, spec(&good)], None, 1 << 20, Keys::Engine).await;
    let c = Arc::clone(&r.cluster);
    // the healthy stream syncs (the others never can), then its SUB socket joins
    until("the healthy stream synced", || {
        c.lock().expect("lock").streams[2].next_seq.is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let hot = tokens(7, 8);
    good.publish(0.0, &[stored(&hot, Medium::Gpu)])
        .expect("publish");
    // garbage goes out in bursts until the router has heard 20 of it: a burst sent before
    // its SUB socket joined is dropped by ZMQ, not seen
    let mut i = 0u64;
    until("20 garbage batches heard", || {
        for _ in 0..20 {
            let bad_payload = garbage
                .send_multipart([&b""[..], &i.to_be_bytes()[..], &b"\xc1not msgpack"[..]], 0);
            let one_frame = garbage.send_multipart([&b"x"[..]], 0); // not a batch
            let short_seq = garbage.send_multipart([&b""[..], &b"short"[..], &b"\x90"[..]], 0);
            assert!(bad_payload.and(one_frame).and(short_seq).is_ok(), "send");
            i += 1;
        }
        c.lock().expect("lock").streams[1].counters.garbage >= 20
    })
    .await;
    until("the hot prefix is indexed", || {
        c.lock().expect("lock").router().index().tier_pages().0[2].0 == 8
    })
    .await;
    let body = serde_json::json!({"token_ids": hot}).to_string();
    let got = http(r.addr, "POST", "/route", Some(body.as_bytes())).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.json()["instance"], 2);
    let other = serde_json::json!({"token_ids": tokens(99, 3)}).to_string();
    assert_eq!(
        http(r.addr, "POST", "/route", Some(other.as_bytes()))
            .await
            .status,
        200
    );
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    let s = &stats["streams"];
    assert!(
        s[0]["counters"]["unanswered"].as_u64().unwrap_or(0) >= 1,
        "{s}"
    );
    assert!(
        s[1]["counters"]["garbage"].as_u64().unwrap_or(0) >= 20,
        "{s}"
    );
    assert_eq!(stats["instances"][1]["gpu_pages"], 0);
    let health = http(r.addr, "GET", "/health", None).await.json();
    assert_eq!(health["status"], "ok");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_never_exceeds_its_page_cap_and_reports_memory() {
    let p = publisher();
    let r = router(vec![spec(&p)], None, 50, Keys::Engine).await;
    joined(&r).await;
    for s in 0..20 {
        p.publish(0.0, &[stored(&tokens(s, 10), Medium::Gpu)])
            .expect("publish");
    }
    let c = Arc::clone(&r.cluster);
    until("every batch applied", || {
        c.lock().expect("lock").streams[0].next_seq == Some(20)
    })
    .await;
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["index_pages"], 50, "{stats}");
    assert_eq!(stats["dropped_stores"], 150, "{stats}");
    assert!(stats["memory_bytes"].as_u64().unwrap_or(0) > 0);
    assert!(
        stats["memory_bytes"].as_u64().unwrap_or(u64::MAX) < 4096,
        "{stats}"
    );
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_route_picks_the_instance_holding_the_prefix_and_prices_the_store() {
    let (p0, p1, l3) = (publisher(), publisher(), publisher());
    let r = router(
        vec![spec(&p0), spec(&p1)],
        Some(spec(&l3)),
        1 << 20,
        Keys::Engine,
    )
    .await;
    joined(&r).await;
    let a = tokens(1, 16);
    let b = tokens(2, 16);
    p0.publish(0.0, &[stored(&a, Medium::Gpu)])
        .expect("publish");
    p1.publish(0.0, &[stored(&b[..8 * PS], Medium::Cpu)])
        .expect("publish");
    l3.publish(0.0, &[stored(&b, Medium::Storage)])
        .expect("publish");
    let c = Arc::clone(&r.cluster);
    until("indexed", || {
        c.lock().expect("lock").router().index().pages() == 40
    })
    .await;
    let route = |t: &[u32]| serde_json::json!({"token_ids": t}).to_string();
    let got = http(r.addr, "POST", "/route", Some(route(&a).as_bytes())).await;
    assert_eq!(got.status, 200);
    let j = got.json();
    assert_eq!(
        (j["instance"].as_u64(), j["gpu_pages"].as_u64()),
        (Some(0), Some(16)),
        "{j}"
    );
    assert_eq!(j["basis"], "cache");
    // b: instance 1 has half in host memory, the store all of it; instance 0 only the store
    let j = http(r.addr, "POST", "/route", Some(route(&b).as_bytes()))
        .await
        .json();
    assert_eq!(j["instance"], 1, "{j}");
    assert_eq!(
        (j["host_pages"].as_u64(), j["l3_pages"].as_u64()),
        (Some(8), Some(8))
    );
    let ttft = j["ttft_by_instance"].as_array().expect("array").clone();
    assert!(ttft[1].as_f64() < ttft[0].as_f64(), "{j}");
    // a salted prompt shares no page (kvtier's hashes cover the salt)
    let salted = serde_json::json!({"token_ids": a, "salt": "tenant-b"}).to_string();
    let j = http(r.addr, "POST", "/route", Some(salted.as_bytes()))
        .await
        .json();
    assert_eq!(j["gpu_pages"], 0, "{j}");
    // bad input: typed 400s
    for bad in [&b"{"[..], br#"{"token_ids": [-1]}"#, br#"{"tokens": [1]}"#] {
        let got = http(r.addr, "POST", "/route", Some(bad)).await;
        assert_eq!(got.status, 400);
        assert_eq!(got.json()["error"]["type"], "invalid_request");
    }
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    // a, then the salted prompt (no hit anywhere: the shorter queue), to 0; b to 1
    assert_eq!(stats["instances"][0]["routed"], 2, "{stats}");
    assert_eq!(stats["instances"][1]["routed"], 1, "{stats}");
    assert_eq!(stats["storage_pages"], 16);
    // latency of one decision over HTTP (loopback, a new connection each)
    let t = Instant::now();
    let n = 200;
    for _ in 0..n {
        let got = http(r.addr, "POST", "/route", Some(route(&a).as_bytes())).await;
        assert_eq!(got.status, 200);
    }
    eprintln!(
        "POST /route, {}-token prompt, 2 instances: {:.0} us per request (new connection each)",
        a.len(),
        t.elapsed().as_secs_f64() / f64::from(n) * 1e6
    );
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_publisher_replaces_its_instances_pages() {
    let old = publisher();
    let (ep, rep) = (
        old.endpoint().to_string(),
        old.replay_endpoint().expect("replay").to_string(),
    );
    let r = router(vec![spec(&old)], None, 1 << 20, Keys::Engine).await;
    joined(&r).await;
    for s in 0..3 {
        old.publish(0.0, &[stored(&tokens(s, 4), Medium::Gpu)])
            .expect("publish");
    }
    let c = Arc::clone(&r.cluster);
    until("old pages", || {
        c.lock().expect("lock").router().index().pages() == 12
    })
    .await;
    drop(old);
    // the engine comes back on the same ports with a new cache, numbering from 0 again
    let new = kvtier_events::Publisher::bind(kvtier_events::PublisherConfig {
        endpoint: ep,
        replay_endpoint: Some(rep),
        block_size: PS as u32,
        ..kvtier_events::PublisherConfig::default()
    })
    .expect("rebind");
    // the SUB reconnects (and resyncs) before the new incarnation publishes: a batch sent
    // before would be in the resync's snapshot, not seen as a restart
    until("the SUB reconnected", || {
        c.lock().expect("lock").streams[0].counters.reconnects >= 1
    })
    .await;
    let fresh = tokens(9, 2);
    new.publish(0.0, &[stored(&fresh, Medium::Gpu)])
        .expect("publish");
    let want = reference(&[vec![vec![stored(&fresh, Medium::Gpu)]]], 1 << 20).entries();
    until("only the new pages", || {
        c.lock().expect("lock").router().index().entries() == want
    })
    .await;
    assert_eq!(
        r.cluster.lock().expect("lock").streams[0].counters.restarts,
        1
    );
    r.stop().await;
}

/// A library user's [`launch::start`] with a cost model the router refuses gets the typed
/// error, and nothing listens (the binary checks its flags before; the library must too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_with_a_cost_model_it_cannot_use_does_not_start() {
    use kvtier_router::launch::{self, Config, StartError};
    let err = launch::start(Config {
        model: kvtier_router::CostModel {
            prefill_tokens_per_s: f64::NAN,
            ..model()
        },
        ..config(vec![EndpointSpec::default()], 1 << 10, Keys::Tokens)
    })
    .await
    .err()
    .expect("a NaN prefill rate started a router");
    assert!(
        matches!(
            err,
            StartError::Model(kvtier_router::RouteError::BadModel(_))
        ),
        "{err}"
    );
}

/// An endpoint with a NUL byte (a library caller's string; argv cannot hold one) is a typed
/// error before anything listens, for the stream and for its replay socket: the zmq crate
/// panics on it (`CString::new(..).unwrap()`), in `start` or later in the subscriber thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_with_a_nul_byte_is_refused_at_start() {
    use kvtier_router::launch::{self, StartError};
    for spec in [
        EndpointSpec {
            events: Some("tcp://127.0.0.1:5557\0".into()),
            ..EndpointSpec::default()
        },
        EndpointSpec {
            events: Some("tcp://127.0.0.1:5557".into()),
            replay: Some("tcp://127.0.0.1:5558\0".into()),
            ..EndpointSpec::default()
        },
    ] {
        let err = launch::start(config(vec![spec], 1 << 10, Keys::Tokens))
            .await
            .err()
            .expect("a NUL endpoint started a router");
        assert!(matches!(err, StartError::Subscribe(_)), "{err}");
    }
}

/// `topic=`: a stream whose publisher names another topic is refused batch by batch, live
/// and replayed: nothing of it reaches the index and `foreign_topic` counts the live
/// batches; the same publisher under its own topic is followed to the exact index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_another_topic_is_refused_live_and_replayed() {
    let p = kvtier_events::Publisher::bind(kvtier_events::PublisherConfig {
        block_size: PS as u32,
        topic: "model-b".into(),
        ..Default::default()
    })
    .expect("bind publisher");
    let batches = workload(3);
    // the first batch before the router starts: it comes by snapshot, or not at all
    p.publish(0.0, &batches[0]).expect("publish");
    let with = |topic: &str| EndpointSpec {
        topic: Some(topic.into()),
        ..spec(&p)
    };
    let r = router(
        vec![with("model-a"), with("model-b")],
        None,
        1 << 20,
        Keys::Engine,
    )
    .await;
    let c = Arc::clone(&r.cluster);
    until("the right topic's stream synced", move || {
        c.lock().expect("lock").streams[1].next_seq.is_some()
    })
    .await;
    // The other topic's stream cannot recover a batch its SUB missed (its replays are
    // refused), so the second batch goes out until that SUB has heard it (ZMQ's slow joiner:
    // a fixed pause was not enough on a loaded machine); the right topic's stream takes
    // the repeats as the same stores again.
    let foreign = |c: &Arc<std::sync::Mutex<kvtier_router::cluster::Cluster>>| {
        c.lock().expect("lock").streams[0].counters.foreign_topic as usize
    };
    let c = Arc::clone(&r.cluster);
    until("the other topic's SUB joined", || {
        p.publish(0.0, &batches[1]).expect("publish");
        std::thread::sleep(Duration::from_millis(50));
        foreign(&c) >= 1
    })
    .await;
    let joined_at = foreign(&c);
    for b in &batches[2..] {
        p.publish(0.0, b).expect("publish");
    }
    let want = reference(&[Vec::new(), batches.clone()], 1 << 20).entries();
    let c = Arc::clone(&r.cluster);
    until("the right topic's stream applied every batch", move || {
        c.lock().expect("lock").router().index().entries() == want
    })
    .await;
    let c = Arc::clone(&r.cluster);
    until("the other topic's live batches counted", move || {
        foreign(&c) == joined_at + batches.len() - 2
    })
    .await;
    assert!(
        entries(&r).iter().all(|(i, _, _)| *i == 1),
        "nothing of the other topic indexed"
    );
    let wrong = r.cluster.lock().expect("lock").streams[0].counters.clone();
    assert_eq!(wrong.applied, 0, "{wrong:?}");
    assert!(wrong.unanswered >= 1, "its snapshot was refused: {wrong:?}");
    r.stop().await;
}

/// A replay socket that takes requests and never answers (vLLM given a replay endpoint it
/// connects to instead of binding; a hung publisher): every gap held the stream's thread up
/// for two replay timeouts (the replay, then a snapshot), so with regular gaps the router
/// fell ever further behind the live stream (600 batches behind, then 2,351, over 17 s).
/// After a request goes unanswered the replay socket is left alone for a backoff: the gaps
/// meanwhile are lost at once and the live batches applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_replay_socket_is_not_waited_on_at_every_gap() {
    use kvtier_events::{HashFormat, encode_batch};
    let ctx = zmq::Context::new();
    let pub_ = ctx.socket(zmq::PUB).expect("pub");
    pub_.set_linger(0).expect("linger");
    pub_.bind("tcp://127.0.0.1:*").expect("bind");
    let silent = ctx.socket(zmq::ROUTER).expect("router");
    silent.set_linger(0).expect("linger");
    silent.bind("tcp://127.0.0.1:*").expect("bind");
    let ep = |s: &zmq::Socket| s.get_last_endpoint().expect("ep").expect("utf-8");
    let mut cfg = config(
        vec![EndpointSpec {
            events: Some(ep(&pub_)),
            replay: Some(ep(&silent)),
            url: None,
            topic: None,
        }],
        1 << 20,
        Keys::Engine,
    );
    cfg.subscribe.replay_backoff = Duration::from_secs(600);
    let r = kvtier_router::launch::start(cfg).await.expect("start");
    let batch = |s: u64| {
        let ev = stored(&tokens(1000 + s as u32, 1), Medium::Gpu);
        encode_batch(0.0, &[ev], 0, HashFormat::Int64).expect("encode")
    };
    let send = |s: u64| {
        pub_.send_multipart([&b""[..], &s.to_be_bytes()[..], &batch(s)[..]], 0)
            .expect("send");
    };
    let counters = || r.cluster.lock().expect("lock").streams[0].counters.clone();
    // batch 0 until the SUB has joined (a repeated 0 is a duplicate)
    let t = Instant::now();
    while counters().applied == 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "never joined");
        send(0);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // 62 more batches, every 6th lost on the way: 10 gaps
    let last = 62u64;
    let mut delivered = 1;
    for s in 1..=last {
        if s % 6 != 0 {
            send(s);
            delivered += 1;
        }
    }
    let c = Arc::clone(&r.cluster);
    until("the stream caught up with the live batches", || {
        c.lock().expect("lock").streams[0].next_seq == Some(last + 1)
    })
    .await;
    let mut asked = 0;
    while silent.recv_multipart(zmq::DONTWAIT).is_ok() {
        asked += 1;
    }
    let got = counters();
    assert!(
        asked <= 2,
        "the silent replay socket was asked {asked} times ({got:?})"
    );
    assert_eq!(got.applied, delivered, "{got:?}");
    assert_eq!(
        r.cluster.lock().expect("lock").router().index().pages(),
        delivered as usize
    );
    r.stop().await;
}
