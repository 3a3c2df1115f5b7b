//! The store's KV events with real processes: a `kvtier-l3` server (`--role both`, and a
//! split master with a store node) publishing on loopback, a real ZMQ SUB decoding every
//! frame, and a `kvtier-router` subscribed with `--storage` to the stream. Puts, removes,
//! evictions and a node's death must come out as the right `STORAGE` events; tensor-parallel
//! ranks of a page are one block; keys outside kvtier's grammar are never published; the
//! router, started after the puts (so from a snapshot), credits a prefix held only in the
//! store as L3 pages and drops it when the store does.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::kv_events::{
    PS, Sub, free_endpoint, free_endpoints, key, l3_pages_become, pages, prompt, router, router_on,
    wire,
};
use crate::common::procs::{Proc, args, master, node, spawn};
use crate::common::{client, t};
use kvtier_l3::{ExistOptions, L3Store, PutOptions, RemoteStore};
use kvtier_radix::PageHash;
use kvtier_router::launch::EndpointSpec;

fn store(extra: &[&str]) -> (Proc, String, String) {
    let (ev, rep) = (free_endpoint(), free_endpoint());
    let mut a = args(&[
        "--listen",
        "127.0.0.1:0",
        "--kv-events",
        &ev,
        "--kv-events-replay",
        &rep,
    ]);
    a.extend(args(extra));
    (spawn(&a, None), ev, rep)
}

fn put(c: &RemoteStore, tn: &str, k: &str, len: usize) {
    c.put(&t(tn), k, &vec![7u8; len], PutOptions::default())
        .unwrap_or_else(|e| panic!("put {k}: {e}"));
}

fn exists(c: &RemoteStore, tn: &str, keys: &[String]) -> Vec<bool> {
    c.batch_exist_key(&t(tn), keys, ExistOptions::default())
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

#[test]
fn puts_removes_and_evictions_come_out_as_storage_events_ranks_as_one_block() {
    // 1 MiB of DRAM, no SSD: an evicted object is gone
    let (p, ev, _) = store(&["--segment-bytes", "1048576"]);
    let mut sub = Sub::connect(&ev);
    let c = client(p.addr, None);
    let hs = pages(&prompt(1, 4));
    for h in &hs {
        for rank in 0..2 {
            put(&c, "a", &key("m1", h, rank), 100);
        }
    }
    let want: BTreeSet<u64> = hs.iter().map(wire).collect();
    sub.until("four stored pages", |s| s.resident() == want);
    for h in &hs {
        assert_eq!(sub.stored_count(wire(h)), 1, "two ranks, one block");
    }
    // keys outside the grammars are stored, and never published
    put(&c, "a", "plain-key", 100);
    let before = sub.events.len();
    sub.drain(Duration::from_millis(300));
    assert_eq!(sub.events.len(), before, "{:?}", &sub.events[before..]);
    // kvtier.vllm's key (vLLM's 36-byte OffloadKey, shard 0) is its chunk's block hash
    put(&c, "a", &format!("m1:{}00000000:0", "ab".repeat(32)), 100);
    let chunk = wire(&PageHash([0xab; 32]));
    sub.until("the chunk's block hash", |s| s.resident().contains(&chunk));
    assert_eq!(sub.stored_count(chunk), 1);
    c.remove(&t("a"), &format!("m1:{}00000000:0", "ab".repeat(32)), false)
        .unwrap();
    sub.until("the chunk removed", |s| !s.resident().contains(&chunk));

    // a page stays until its last rank goes
    c.remove(&t("a"), &key("m1", &hs[0], 0), false).unwrap();
    sub.drain(Duration::from_millis(300));
    assert_eq!(sub.resident(), want, "rank 1 still holds page 0");
    c.remove(&t("a"), &key("m1", &hs[0], 1), false).unwrap();
    let h0 = wire(&hs[0]);
    sub.until("page 0 removed", |s| !s.resident().contains(&h0));

    // eviction: 40 objects of 64 KiB into 1 MiB; the published set is exactly what exists
    let ev_pages = pages(&prompt(2, 40));
    let ev_keys: Vec<String> = ev_pages.iter().map(|h| key("m1", h, 0)).collect();
    for k in &ev_keys {
        put(&c, "a", k, 64 << 10);
    }
    let alive = exists(&c, "a", &ev_keys);
    assert!(alive.iter().any(|a| !a), "nothing was evicted");
    let mut expect: BTreeSet<u64> = hs[1..].iter().map(wire).collect();
    let older = exists(
        &c,
        "a",
        &hs[1..].iter().map(|h| key("m1", h, 1)).collect::<Vec<_>>(),
    );
    for (h, a) in hs[1..].iter().zip(older) {
        if !a {
            expect.remove(&wire(h));
        }
    }
    expect.extend(
        ev_pages
            .iter()
            .zip(&alive)
            .filter(|x| *x.1)
            .map(|x| wire(x.0)),
    );
    // the events of the eviction passes arrive when they arrive: wait for them, bounded
    sub.until("the published set is what exists", |s| {
        s.resident() == expect
    });
    assert!(
        sub.events
            .iter()
            .any(|e| matches!(e, crate::common::kv_events::Ev::Removed(v) if v.len() > 1))
            || alive.iter().filter(|a| !**a).count() == 1,
        "an eviction pass's removals go out as one BlockRemoved"
    );
    let seqs = sub.seqs.clone();
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "gapless numbers {seqs:?}"
    );
}

/// `--kv-events-parts-per-page 2` (two tensor-parallel ranks): a page is published once both
/// ranks' objects are readable under one tenant, and removed as soon as either goes (an
/// engine loads a page only with every rank's part); two tenants' single ranks make no page.
#[test]
fn with_parts_per_page_a_page_is_stored_only_while_every_rank_holds_it() {
    let (p, ev, _) = store(&["--kv-events-parts-per-page", "2"]);
    let mut sub = Sub::connect(&ev);
    let c = client(p.addr, None);
    let hs = pages(&prompt(3, 2));
    let (h0, h1) = (wire(&hs[0]), wire(&hs[1]));
    put(&c, "a", &key("m1", &hs[0], 0), 100);
    put(&c, "a", &key("m1", &hs[1], 0), 100);
    put(&c, "b", &key("m1", &hs[1], 1), 100);
    sub.drain(Duration::from_millis(300));
    assert!(sub.resident().is_empty(), "one rank each: {:?}", sub.events);
    put(&c, "a", &key("m1", &hs[0], 1), 100);
    sub.until("page 0 with both ranks", |s| s.resident().contains(&h0));
    assert!(
        !sub.resident().contains(&h1),
        "page 1's ranks are two tenants'"
    );
    c.remove(&t("a"), &key("m1", &hs[0], 0), false).unwrap();
    sub.until("page 0 removed with its rank 0", |s| {
        !s.resident().contains(&h0)
    });
    put(&c, "a", &key("m1", &hs[0], 0), 100);
    sub.until("page 0 back", |s| s.resident().contains(&h0));
    assert_eq!(sub.stored_count(h0), 2, "stored, removed, stored");
}

/// Two models share one store: `--kv-events-stream` gives each namespace its own stream
/// (own numbers, own topic, own part count); each stream carries its namespace's pages
/// only, and a router told a stream's topic follows it while one pointed at the other
/// model's stream by mistake refuses every batch (live and replayed) and credits nothing.
#[test]
fn two_models_sharing_a_store_each_get_a_stream_of_their_own() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let [ev1, rep1, ev2, rep2]: [String; 4] = free_endpoints(4).try_into().unwrap();
    let p = spawn(
        &args(&[
            "--listen",
            "127.0.0.1:0",
            "--kv-events-stream",
            &format!("m1={ev1},{rep1}"),
            "--kv-events-stream",
            &format!("m2={ev2},{rep2},parts=2"),
        ]),
        None,
    );
    let (mut s1, mut s2) = (Sub::connect(&ev1), Sub::connect(&ev2));
    let c = client(p.addr, None);
    let toks = prompt(11, 3);
    let hs = pages(&toks);
    // the same prompt under both models: m1 holds pages 0..3 (one rank, its part count is
    // 1), m2 holds page 0 with both ranks and page 1 with one
    for h in &hs {
        put(&c, "a", &key("m1", h, 0), 100);
    }
    put(&c, "a", &key("m2", &hs[0], 0), 100);
    put(&c, "a", &key("m2", &hs[0], 1), 100);
    put(&c, "a", &key("m2", &hs[1], 0), 100);
    let all: BTreeSet<u64> = hs.iter().map(wire).collect();
    s1.until("m1's three pages", |s| s.resident() == all);
    s2.until("m2's one complete page", |s| !s.resident().is_empty());
    assert_eq!(s2.resident(), BTreeSet::from([wire(&hs[0])]));
    assert!(s1.topics.iter().all(|t| t == b"m1"), "{:?}", s1.topics);
    assert!(s2.topics.iter().all(|t| t == b"m2"), "{:?}", s2.topics);
    // each stream numbers its own batches: no gaps where the other stream published
    for s in [&s1, &s2] {
        assert!(s.seqs.windows(2).all(|w| w[1] == w[0] + 1), "{:?}", s.seqs);
    }

    let spec = |ev: &str, rep: &str, topic: &str| EndpointSpec {
        events: Some(ev.into()),
        replay: Some(rep.into()),
        url: None,
        topic: Some(topic.into()),
    };
    let keys = kvtier_router::cluster::Keys::Engine;
    let good = router_on(
        &rt,
        vec![EndpointSpec::default()],
        spec(&ev1, &rep1, "m1"),
        PS,
        keys,
    );
    assert_eq!(
        l3_pages_become(&good, &toks, 3),
        3,
        "m1's router, from m1's snapshot"
    );
    // m1's router given m2's endpoints: the snapshot (topic m2) is no answer, live batches
    // are dropped unread; it credits nothing although m2's stream holds page 0
    let wrong = router_on(
        &rt,
        vec![EndpointSpec::default()],
        spec(&ev2, &rep2, "m1"),
        PS,
        keys,
    );
    put(&c, "a", &key("m2", &hs[1], 1), 100); // a live m2 batch: page 1 complete
    s2.until("m2's page 1", |s| s.resident().len() == 2);
    // Live m2 batches (fresh pages completed under m2) go out until the wrong router's SUB
    // has heard one: a batch sent before that SUB joined is not seen (ZMQ's slow joiner; one
    // batch was not enough on a loaded CI machine), and nothing replays another topic.
    let end = Instant::now() + Duration::from_secs(20);
    let mut fresh = 100u32;
    loop {
        let cl = wrong.cluster.lock().unwrap();
        let n = &cl.streams[0].counters;
        if n.foreign_topic >= 1 {
            assert_eq!(n.applied, 0, "{n:?}");
            assert!(n.unanswered >= 1, "the m2 snapshot was refused: {n:?}");
            break;
        }
        drop(cl);
        assert!(Instant::now() < end, "no foreign batch counted");
        let h = pages(&prompt(fresh, 1))[0];
        fresh += 1;
        put(&c, "a", &key("m2", &h, 0), 100);
        put(&c, "a", &key("m2", &h, 1), 100);
        std::thread::sleep(Duration::from_millis(50));
    }
    let credited = |r: &kvtier_router::launch::Running| {
        r.cluster
            .lock()
            .unwrap()
            .route(&toks, None, None, &[])
            .unwrap()
            .l3_pages
    };
    assert_eq!(credited(&wrong), 0);
    assert_eq!(credited(&good), 3);
    rt.block_on(good.stop());
    rt.block_on(wrong.stop());
}

#[test]
fn a_dead_nodes_pages_are_removed_and_a_node_role_refuses_the_flag() {
    let (ev, rep) = (free_endpoint(), free_endpoint());
    let m = master(
        &[
            "--client-ttl-ms",
            "1000",
            "--kv-events",
            &ev,
            "--kv-events-replay",
            &rep,
        ],
        None,
    );
    let n = node(m.addr, 1, None, None);
    let mut sub = Sub::connect(&ev);
    let c = client(m.addr, None);
    let hs = pages(&prompt(3, 3));
    for h in &hs {
        put(&c, "a", &key("m1", h, 0), 1000);
    }
    let want: BTreeSet<u64> = hs.iter().map(wire).collect();
    sub.until("three stored pages", |s| s.resident() == want);
    drop(n); // SIGKILL: its DRAM replicas are lost once the master declares it dead
    sub.until("the dead node's pages removed", |s| s.resident().is_empty());

    // --kv-events on a store node is a startup error (the master publishes), not a panic
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args([
            "--role",
            "node",
            "--master",
            &m.addr.to_string(),
            "--kv-events",
            &ev,
        ])
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--kv-events is published by the master")
    );
}

#[test]
fn bad_endpoints_are_refused_at_startup_naming_them() {
    for bad in [
        "127.0.0.1:5557",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:0",
        "http://x:1",
        "ipc://",
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
            .args(["--listen", "127.0.0.1:0", "--kv-events", bad])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("a ZMQ endpoint is tcp://HOST:PORT"),
            "{bad}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    // a namespace holding the key separator
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--kv-events",
            "tcp://127.0.0.1:*",
        ])
        .args(["--kv-events-namespace", "a:b"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("a key namespace"));
    // --kv-events-stream: a part count of 0, two streams on one address
    for (bad, code, says) in [
        ("m1=tcp://127.0.0.1:*,parts=0", 2, "a positive integer"),
        ("m1", 2, "NAMESPACE=PUB"),
        (
            "m1=tcp://127.0.0.1:*,tcp://127.0.0.1:*,tcp://127.0.0.1:*",
            2,
            "NAMESPACE=PUB",
        ),
        ("a:b=tcp://127.0.0.1:*", 2, "a key namespace"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
            .args(["--listen", "127.0.0.1:0", "--kv-events-stream", bad])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(code), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{bad}: {err}");
    }
    let ep = free_endpoint();
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args(["--listen", "127.0.0.1:0", "--kv-events", &ep])
        .args(["--kv-events-stream", &format!("m2={ep}")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("given to two streams"));
    // a port already taken: a typed startup error
    let (p, ev, _) = store(&[]);
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args(["--listen", "127.0.0.1:0", "--kv-events", &ev])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot publish"), "{err}");
    drop(p);
}

#[test]
fn a_router_on_the_stores_stream_credits_a_prefix_held_only_in_l3() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (p, ev, rep) = store(&[]);
    let c = client(p.addr, None);
    let toks = prompt(5, 6);
    let hs = pages(&toks);
    // the first four pages of the prompt, both ranks, before the router starts
    for h in &hs[..4] {
        for rank in 0..2 {
            put(&c, "a", &key("m1", h, rank), 100);
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    let r = router(&rt, &ev, &rep, PS);
    let t0 = Instant::now();
    assert_eq!(l3_pages_become(&r, &toks, 4), 4);
    {
        let c = r.cluster.lock().unwrap();
        let d = c.router().index();
        assert_eq!(
            d.tier_pages().1,
            4,
            "one STORAGE entry per page, ranks merged"
        );
        assert!(
            c.streams[0].counters.snapshots >= 1,
            "synced from a snapshot"
        );
    }
    // a prompt the store does not hold gets no credit
    assert_eq!(
        r.cluster
            .lock()
            .unwrap()
            .route(&prompt(6, 6), None, None, &[])
            .unwrap()
            .l3_pages,
        0
    );
    // live: the fifth page arrives, then the second goes (both ranks)
    put(&c, "a", &key("m1", &hs[4], 0), 100);
    l3_pages_become(&r, &toks, 5);
    for rank in 0..2 {
        c.remove(&t("a"), &key("m1", &hs[1], rank), false).unwrap();
    }
    // the prefix now stops after page 0
    l3_pages_become(&r, &toks, 1);
    eprintln!("router synced and followed in {:?}", t0.elapsed());
    rt.block_on(r.stop());
}

/// kvtier's vLLM integration's L3 key of a chunk: `{namespace}:{OffloadKey hex}:{shard}`,
/// the OffloadKey being the chunk's last block hash and the KV group (0).
fn vllm_key(ns: &str, last: &PageHash, shard: u32) -> String {
    format!("{ns}:{}{:08x}:{shard}", last.to_hex(), 0)
}

/// The router in `--keys tokens` mode (in front of vLLM, whose block hashes it cannot
/// compute): the store's objects carry no tokens, and are keyed through the instance whose
/// stream named the same block hashes with their tokens. A real `kvtier-l3` publishing
/// chunks of two pages (`--kv-events-block-size`), an instance publishing vLLM-format GPU
/// events on a real ZMQ publisher, and the router subscribed to both, started after part of
/// each was published (so synced from both snapshots, in either order).
#[test]
fn a_tokens_router_keys_the_stores_chunks_through_the_instance_that_computed_them() {
    use kvtier_events::{HashFormat, Publisher, PublisherConfig, WireEvent};
    use kvtier_router::cluster::Keys;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let chunk_tokens = (2 * PS).to_string();
    let (p, ev, rep) = store(&["--kv-events-block-size", &chunk_tokens]);
    let c = client(p.addr, None);
    let engine = Publisher::bind(PublisherConfig {
        block_size: PS as u32,
        hash_format: HashFormat::Int64,
        ..PublisherConfig::default()
    })
    .expect("publisher");
    // engine hashes the router cannot compute: any 32 bytes per block
    let hashes = |seed: u8, n: usize| -> Vec<PageHash> {
        (0..n)
            .map(|i| PageHash([seed.wrapping_mul(31).wrapping_add(i as u8 + 1); 32]))
            .collect()
    };
    let gpu = |toks: &[u32], hs: &[PageHash]| WireEvent::BlockStored {
        block_hashes: hs.to_vec(),
        parent_block_hash: None,
        token_ids: toks.to_vec(),
        block_size: PS as u32,
        medium: kvtier_events::Medium::Gpu,
        lora_name: None,
        locality: None,
    };
    let gone = |hs: &[PageHash]| WireEvent::BlockRemoved {
        block_hashes: hs.to_vec(),
        medium: kvtier_events::Medium::Gpu,
        locality: None,
    };
    // before the router: prompt A computed and its two chunks stored (two shards each)
    let (a, ha) = (prompt(7, 4), hashes(7, 4));
    engine.publish(0.0, &[gpu(&a, &ha)]).unwrap();
    for last in [&ha[1], &ha[3]] {
        for shard in 0..2 {
            put(&c, "a", &vllm_key("m1", last, shard), 100);
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    let instance = EndpointSpec {
        events: Some(engine.endpoint().into()),
        replay: engine.replay_endpoint().map(str::to_owned),
        url: None,
        topic: None,
    };
    let r =
        crate::common::kv_events::router_with(&rt, vec![instance], (&ev, &rep), PS, Keys::Tokens);
    // A's blocks are on the GPU: every page is a GPU hit, and the store holds all four
    let gpu_pages_become = |toks: &[u32], want: usize| {
        let ok = crate::common::procs::eventually(Duration::from_secs(20), || {
            let c = r.cluster.lock().unwrap();
            let e = c
                .router()
                .estimates_of(&c.prompt_hashes(toks, None, None), toks.len());
            e[0].gpu_pages == want
        });
        assert!(ok, "GPU pages never became {want}");
    };
    gpu_pages_become(&a, 4);
    let ok = crate::common::procs::eventually(Duration::from_secs(20), || {
        r.cluster.lock().unwrap().router().index().tier_pages().1 == 4
    });
    assert!(ok, "the store's two chunks were not keyed as four pages");
    // the engine drops A from its GPU: the prefix is now priced as L3 pages
    engine.publish(0.0, &[gone(&ha)]).unwrap();
    l3_pages_become(&r, &a, 4);
    // live, in the other order: prompt B's chunk reaches the store before the engine's
    // event names its blocks, and is keyed once it does
    let (b, hb) = (prompt(8, 2), hashes(8, 2));
    put(&c, "a", &vllm_key("m1", &hb[1], 0), 100);
    std::thread::sleep(Duration::from_millis(300));
    engine.publish(0.0, &[gpu(&b, &hb)]).unwrap();
    gpu_pages_become(&b, 2);
    engine.publish(0.0, &[gone(&hb)]).unwrap();
    l3_pages_become(&r, &b, 2);
    // A's second chunk leaves the store (both shards): A's L3 prefix is its first chunk
    for shard in 0..2 {
        c.remove(&t("a"), &vllm_key("m1", &ha[3], shard), false)
            .unwrap();
    }
    l3_pages_become(&r, &a, 2);
    let unkeyed = r.cluster.lock().unwrap().streams[1]
        .translator
        .as_ref()
        .map(|t| t.unkeyed);
    assert_eq!(unkeyed, Some(0), "every object was keyed");
    rt.block_on(r.stop());
}

/// The ```sh lines of docs/l3/kv-events.md, the page "KV events for routers".
fn documented_lines() -> Vec<String> {
    let sec = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/l3/kv-events.md"
    ))
    .unwrap();
    assert!(sec.starts_with("# KV events for routers"), "the page");
    let mut out = Vec::new();
    let mut in_sh = false;
    for line in sec.lines() {
        let l = line.trim();
        if l.starts_with("```") {
            in_sh = !in_sh && l == "```sh";
            continue;
        }
        if in_sh {
            out.push(l.to_string());
        }
    }
    out
}

fn flag<'a>(words: &'a [&str], name: &str) -> &'a str {
    let i = words
        .iter()
        .position(|w| *w == name)
        .unwrap_or_else(|| panic!("{name}"));
    words[i + 1]
}

#[test]
fn the_documented_store_and_router_lines_run_and_agree() {
    let lines = documented_lines();
    let l3 = lines
        .iter()
        .find(|l| l.starts_with("kvtier-l3 "))
        .expect("a kvtier-l3 line");
    let rl = lines
        .iter()
        .find(|l| l.starts_with("kvtier-router "))
        .expect("a router line");
    let words: Vec<&str> = l3.split_whitespace().skip(1).collect();
    let (ev, rep) = (
        flag(&words, "--kv-events"),
        flag(&words, "--kv-events-replay"),
    );
    let ns = flag(&words, "--kv-events-namespace");
    // the documented ports may be taken here: the same flags on free ones
    let (ev2, rep2) = (free_endpoint(), free_endpoint());
    let a: Vec<String> = words
        .iter()
        .map(|w| match *w {
            w if w == ev => ev2.clone(),
            w if w == rep => rep2.clone(),
            w if w.starts_with("127.0.0.1:") => "127.0.0.1:0".into(),
            w => w.to_string(),
        })
        .collect();
    let p = spawn(&a, None);
    let mut sub = Sub::connect(&ev2);
    let c = client(p.addr, None);
    let rw: Vec<&str> = rl.split_whitespace().collect();
    assert_eq!(
        flag(&rw, "--keys"),
        "engine",
        "the store's hashes are kvtier's page hashes"
    );
    let ps: usize = flag(&rw, "--page-size").parse().unwrap();
    let toks: Vec<u32> = (0..(ps * 2) as u32).collect();
    let hs = kvtier_radix::HashScope::new(None, None, Vec::new()).page_hashes(&toks, ps);
    for h in &hs {
        put(&c, "a", &key(ns, h, 0), 100);
    }
    put(&c, "a", &key("some-other-model", &hs[0], 0), 100);
    let want: BTreeSet<u64> = hs.iter().map(wire).collect();
    sub.until("the documented namespace's pages", |s| s.resident() == want);
    assert_eq!(
        sub.stored_count(wire(&hs[0])),
        1,
        "the other namespace is not published"
    );
    // the router's --storage names the store's endpoints
    let storage: EndpointSpec = flag(&rw, "--storage").parse().unwrap();
    assert_eq!(storage.events.as_deref(), Some(ev));
    assert_eq!(storage.replay.as_deref(), Some(rep));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let r = router(&rt, &ev2, &rep2, ps);
    l3_pages_become(&r, &toks, 2);
    rt.block_on(r.stop());
}

/// docs/l3/kv-events.md's lines for several models on one store: the `kvtier-l3` line with two
/// `--kv-events-stream`s runs (on free ports), each stream carries its namespace's pages
/// under its namespace as topic, and the router line's `--storage` names the first stream's
/// endpoints and topic, which a router then follows.
#[test]
fn the_documented_lines_for_two_models_run_and_agree() {
    let lines = documented_lines();
    let l3 = lines
        .iter()
        .find(|l| l.starts_with("kvtier-l3 ") && l.contains("--kv-events-stream"))
        .expect("a kvtier-l3 line with streams");
    let rl = lines
        .iter()
        .find(|l| l.starts_with("kvtier-router ") && l.contains("topic="))
        .expect("a router line with a topic");
    let words: Vec<&str> = l3.split_whitespace().skip(1).collect();
    // every documented endpoint moved to a free one, the rest as documented
    let mut moved: Vec<(String, String)> = Vec::new();
    let mut free = |ep: &str| {
        if let Some((_, f)) = moved.iter().find(|(d, _)| d == ep) {
            return f.clone();
        }
        // a port bound and released may come back at once: never give one twice
        let f = std::iter::repeat_with(free_endpoint)
            .find(|f| moved.iter().all(|(_, g)| g != f))
            .expect("a free port");
        moved.push((ep.to_string(), f.clone()));
        f
    };
    let mut streams: Vec<(String, Vec<String>)> = Vec::new();
    let mut a: Vec<String> = Vec::new();
    for (i, w) in words.iter().enumerate() {
        if i > 0 && words[i - 1] == "--kv-events-stream" {
            let (ns, rest) = w.split_once('=').expect("NAMESPACE=…");
            let items: Vec<String> = rest
                .split(',')
                .map(|x| {
                    if x.starts_with("tcp://") {
                        free(x)
                    } else {
                        x.into()
                    }
                })
                .collect();
            a.push(format!("{ns}={}", items.join(",")));
            streams.push((ns.into(), items));
        } else if w.starts_with("127.0.0.1:") {
            a.push("127.0.0.1:0".into());
        } else {
            a.push(w.to_string());
        }
    }
    assert_eq!(streams.len(), 2, "two models");
    let p = spawn(&a, None);
    let mut subs: Vec<Sub> = streams.iter().map(|(_, it)| Sub::connect(&it[0])).collect();
    let c = client(p.addr, None);
    let rw: Vec<&str> = rl.split_whitespace().collect();
    let ps: usize = flag(&rw, "--page-size").parse().unwrap();
    let toks: Vec<u32> = (0..(ps * 2) as u32).collect();
    let hs = kvtier_radix::HashScope::new(None, None, Vec::new()).page_hashes(&toks, ps);
    for (ns, items) in &streams {
        let parts: u32 = items
            .iter()
            .find_map(|x| x.strip_prefix("parts="))
            .map_or(1, |n| n.parse().unwrap());
        for h in &hs {
            for rank in 0..parts {
                put(&c, "a", &key(ns, h, rank), 100);
            }
        }
    }
    let want: BTreeSet<u64> = hs.iter().map(wire).collect();
    for ((ns, _), sub) in streams.iter().zip(&mut subs) {
        sub.until("the stream's namespace's pages", |s| s.resident() == want);
        assert!(sub.topics.iter().all(|t| t == ns.as_bytes()), "{ns}");
    }
    // the router's --storage is the first stream, by its documented endpoints and topic
    let storage: EndpointSpec = flag(&rw, "--storage").parse().unwrap();
    let documented = |ep: &str| moved.iter().find(|(_, f)| f == ep).map(|(d, _)| d.clone());
    let (ns0, it0) = &streams[0];
    assert_eq!(storage.events, documented(&it0[0]));
    assert_eq!(storage.replay, documented(&it0[1]));
    assert_eq!(storage.topic.as_deref(), Some(ns0.as_str()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let on_free = EndpointSpec {
        events: Some(it0[0].clone()),
        replay: Some(it0[1].clone()),
        ..storage
    };
    let keys = kvtier_router::cluster::Keys::Engine;
    let r = router_on(&rt, vec![EndpointSpec::default()], on_free, ps, keys);
    assert_eq!(l3_pages_become(&r, &toks, 2), 2);
    rt.block_on(r.stop());
}
