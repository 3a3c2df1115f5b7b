//! The router against real kvtier caches: each instance's events go through kvtier-events'
//! wire encoding into the router, and its per-instance prices must be what each cache's own
//! prefix match implies.

mod common;

use common::{PS, model};
use kvtier_events::{HashFormat, Medium, WireEvent, encode_batch};
use kvtier_radix::*;
use kvtier_router::*;
use proptest::prelude::*;

fn tokens(seed: u32, shared: usize, pages: usize) -> Vec<u32> {
    (0..pages * PS)
        .map(|i| {
            if i < shared * PS {
                i as u32
            } else {
                seed * 1000 + i as u32
            }
        })
        .collect()
}

fn cache() -> RadixCache {
    RadixCache::new(RadixConfig {
        page_size: PS,
        device_pages: 16,
        host_pages: 32,
        record_events: true,
    })
    .expect("config")
}

/// Serves a prompt on device and, with `backup`, copies its first pages to host.
fn serve(c: &mut RadixCache, toks: &[u32], backup: usize) {
    let hs = page_hashes(toks, PS, None);
    let m = c.match_prefix(&hs);
    if let Ok(p) = c.alloc_evicting::<Device>(hs.len() - m.device_pages) {
        let m = c.match_prefix(&hs);
        if p.len() == hs.len() - m.device_pages {
            let out = c
                .insert::<Device>(m.device_node, m.device_pages, &hs, toks, &p)
                .expect("insert");
            let dup: Vec<_> = out.duplicates.iter().map(|d| d.1).collect();
            c.free(&dup).expect("free");
        } else {
            c.free(&p).expect("free");
        }
    }
    let n = backup.min(hs.len());
    let m = c.match_prefix(&hs);
    if n > m.host_pages
        && m.device_pages >= n
        && let Ok(p) = c.alloc_evicting::<Host>(n - m.host_pages)
    {
        let m = c.match_prefix(&hs);
        if m.device_pages >= n && p.len() == n - m.host_pages {
            let out = c
                .insert::<Host>(m.host_node, m.host_pages, &hs[..n], &toks[..n * PS], &p)
                .expect("backup");
            let dup: Vec<_> = out.duplicates.iter().map(|d| d.1).collect();
            c.free(&dup).expect("free");
        } else {
            c.free(&p).expect("free");
        }
    }
}

fn publish(r: &mut Router, inst: usize, c: &mut RadixCache) {
    let evs: Vec<WireEvent> = c
        .drain_events()
        .iter()
        .map(|e| WireEvent::from_kv(e, PS as u32))
        .collect();
    r.apply_payload(
        inst,
        &encode_batch(0.0, &evs, 0, HashFormat::Int64).unwrap(),
    )
    .unwrap();
}

/// Instance `instance` holds `hashes` on its GPU (a `BlockStored` event).
fn on_gpu(r: &mut Router, instance: usize, hashes: &[u64]) {
    r.apply(
        instance,
        &IndexEvent::Stored {
            medium: Medium::Gpu,
            hashes: hashes.to_vec(),
        },
    )
    .unwrap();
}

/// Two instances whose devices hold `device_tokens` tokens each, a decode step of 10 ms: the
/// router of the tests that book requests and report their first tokens and ends.
fn tracking(device_tokens: f64) -> Router {
    let mut r = Router::new(2, model(), 1 << 20).expect("model");
    r.set_occupancy(Some(Occupancy {
        device_tokens,
        decode_step_s: 0.01,
    }))
    .expect("a valid occupancy");
    r
}

fn plain() -> HashScope {
    HashScope::new(None, None, Vec::new())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn prices_follow_each_caches_own_match_and_the_choice_is_the_cheapest(
        served in prop::collection::vec((0usize..4, 1u32..6, 0usize..4, 1usize..7, 0usize..7), 1..24),
        queries in prop::collection::vec((1u32..6, 0usize..4, 1usize..7), 1..12),
        weight in prop::sample::select(vec![None, Some(0.0), Some(0.5), Some(2.0)]),
    ) {
        let mut caches: Vec<RadixCache> = (0..4).map(|_| cache()).collect();
        let mut r = Router::new(4, model(), 1 << 20).expect("model");
        prop_assert_eq!(r.delay_weight(), DELAY_WEIGHT);
        if let Some(w) = weight {
            r.set_delay_weight(w).unwrap();
        }
        let w = r.delay_weight();
        for &(i, seed, shared, pages, backup) in &served {
            serve(&mut caches[i], &tokens(seed, shared.min(pages), pages), backup);
            publish(&mut r, i, &mut caches[i]);
        }
        let mut last_t = 0.0;
        for (t, &(seed, shared, pages)) in queries.iter().enumerate() {
            let toks = tokens(seed, shared.min(pages), pages);
            let hs = page_hashes(&toks, PS, None);
            let ests = r.estimates(&toks, &plain());
            // the prices at routing time: every queue drained by the time since the last route
            let now = t as f64 * 0.01;
            let mut at_route = Vec::new();
            for (i, c) in caches.iter_mut().enumerate() {
                let m = c.match_prefix(&hs);
                let (g, h) = (m.device_pages, m.host_pages.saturating_sub(m.device_pages));
                let want = model().estimate(toks.len(), g, h, 0, r.queues()[i]);
                prop_assert_eq!(ests[i], want, "instance {}", i);
                let q = (r.queues()[i] - (now - last_t)).max(0.0);
                at_route.push(model().estimate(toks.len(), g, h, 0, q));
            }
            last_t = now;
            // the cost: the request's TTFT plus w x its work, the delay it imposes on the
            // requests behind it; on an idle instance (empty queue) nobody is behind it
            let cost = |e: &Estimate| e.ttft_s() + if e.queue_s > 0.0 { w * e.work_s() } else { 0.0 };
            let best = at_route.iter().map(cost).fold(f64::INFINITY, f64::min);
            let (chosen, est) = r.route(&toks, &plain(), now).unwrap();
            prop_assert_eq!(est, at_route[chosen]);
            prop_assert!(cost(&est) <= best + 1e-12, "chose {} at {} over {}", chosen, cost(&est), best);
            // a failover's choice (the chosen instance excluded) follows the same rule, on the
            // queues as they are now
            let now_ests: Vec<Estimate> = at_route.iter().enumerate()
                .map(|(i, e)| model().estimate(toks.len(), e.gpu_pages, e.host_pages, 0, r.queues()[i]))
                .collect();
            if let Some((other, e)) = r.cheapest(&now_ests, |i| i != chosen) {
                let second = now_ests.iter().enumerate().filter(|(i, _)| *i != chosen)
                    .map(|(_, e)| cost(e)).fold(f64::INFINITY, f64::min);
                prop_assert!(other != chosen && e == now_ests[other]);
                prop_assert!(cost(&e) <= second + 1e-12);
            }
        }
    }
}

#[test]
fn a_gpu_hit_wins_then_a_hot_prefix_spreads_once_its_queue_outweighs_it() {
    let mut caches: Vec<RadixCache> = (0..3).map(|_| cache()).collect();
    let mut r = Router::new(3, model(), 1 << 20).expect("model");
    let hot = tokens(1, 0, 6);
    serve(&mut caches[2], &hot, 0);
    publish(&mut r, 2, &mut caches[2]);
    let (i, e) = r.route(&hot, &plain(), 0.0).unwrap();
    assert_eq!((i, e.gpu_pages), (2, 6));
    // all at once: instance 2's queue grows by nothing (a full hit costs no work), so a longer
    // prompt sharing the prefix adds work there until recomputing elsewhere is cheaper
    let long = [hot.clone(), tokens(7, 0, 6)].concat();
    let chosen: Vec<usize> = (0..12)
        .map(|_| r.route(&long, &plain(), 0.0).unwrap().0)
        .collect();
    assert_eq!(chosen[0], 2);
    assert!(chosen.iter().any(|&c| c != 2), "never spread: {chosen:?}");
    let q = r.queues();
    let (max, min) = q
        .iter()
        .fold((0.0f64, f64::INFINITY), |(a, b), &x| (a.max(x), b.min(x)));
    // a request costs its TTFT plus DELAY_WEIGHT x its work: queues stay within
    // (1 + DELAY_WEIGHT) x one request's work (48 ms computed away from instance 2)
    assert!(
        max - min <= (1.0 + DELAY_WEIGHT) * 0.048 + 1e-9,
        "queues stay within (1 + weight) x one request's work: {q:?}"
    );
    // time drains the queues
    r.route(&hot, &plain(), 100.0).unwrap();
    assert!(r.queues().iter().all(|&x| x == 0.0));
}

#[test]
fn host_pages_and_the_shared_store_are_priced_at_their_bandwidths() {
    let mut r = Router::new(2, model(), 1 << 20).expect("model");
    let toks = tokens(3, 0, 8);
    let hs: Vec<u64> = page_hashes(&toks, PS, None)
        .iter()
        .map(HashFormat::int64)
        .collect();
    let stored = |m: Medium, hs: &[u64]| IndexEvent::Stored {
        medium: m,
        hashes: hs.to_vec(),
    };
    // instance 0 has 4 pages on host; the store has all 8 (from instance 1's backups)
    r.apply(0, &stored(Medium::Cpu, &hs[..4])).unwrap();
    r.apply(1, &stored(Medium::Storage, &hs)).unwrap();
    assert_eq!(
        r.apply(2, &IndexEvent::Cleared).unwrap_err(),
        RouteError::UnknownInstance(2, 2)
    );
    let e = r.estimates(&toks, &plain());
    assert_eq!((e[0].host_pages, e[0].l3_pages), (4, 4));
    assert_eq!((e[1].host_pages, e[1].l3_pages), (0, 8));
    // 4 host pages at 1 GB/s beat 4 more L3 pages at 0.25 GB/s
    assert!(e[0].ttft_s() < e[1].ttft_s());
    assert_eq!(r.route(&toks, &plain(), 0.0).unwrap().0, 0);
    // a salted request shares no hash with the unsalted pages
    let salted = HashScope::new(Some("tenant-b"), None, Vec::new());
    assert!(
        r.estimates(&toks, &salted)
            .iter()
            .all(|e| e.gpu_pages + e.host_pages + e.l3_pages == 0)
    );
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let mut r = Router::new(2, model(), 4).expect("model");
    assert_eq!(
        Router::new(0, model(), 4)
            .expect("model")
            .route(&[1, 2, 3, 4], &plain(), 0.0)
            .unwrap_err(),
        RouteError::NoInstances
    );
    assert!(matches!(
        r.apply_payload(0, b"\xc1garbage"),
        Err(RouteError::Decode(_))
    ));
    assert!(matches!(
        r.apply_payload(
            0,
            &encode_batch(0.0, &[], 0, HashFormat::Int64).unwrap()[..2]
        ),
        Err(RouteError::Decode(_))
    ));
    assert_eq!(
        r.apply_payload(5, &[]).unwrap_err(),
        RouteError::UnknownInstance(5, 2)
    );
    assert_eq!(r.index().pages(), 0);
    // removals of pages never stored, a clear of an empty instance: ignored
    let rm = WireEvent::BlockRemoved {
        block_hashes: vec![PageHash([1; 32])],
        medium: Medium::Gpu,
        locality: None,
    };
    r.apply_payload(
        1,
        &encode_batch(
            0.0,
            &[rm, WireEvent::AllBlocksCleared],
            0,
            HashFormat::Int64,
        )
        .unwrap(),
    )
    .unwrap();
    // the cap: 4 entries, the rest dropped and counted; routing still works
    let mut c = cache();
    serve(&mut c, &tokens(1, 0, 6), 0);
    publish(&mut r, 0, &mut c);
    assert_eq!((r.index().pages(), r.index().dropped()), (4, 2));
    let (_, e) = r.route(&tokens(1, 0, 6), &plain(), 0.0).unwrap();
    assert_eq!(e.gpu_pages, 4);
}

/// With each request's first token and end reported, a hot prefix stays where its pages are
/// while that device has room, and goes elsewhere once the device has no room for its prompt
/// until a running request ends, later than computing it there takes.
#[test]
fn tracked_requests_spread_once_the_devices_memory_is_full() {
    let mut r = tracking(100.0);
    // Three prompts of 40 tokens (10 pages each, none shared), all on instance 0's GPU.
    let prompt = |k: u64| -> Vec<u64> { (10 * k + 1..=10 * k + 10).collect() };
    for k in 1..=3 {
        on_gpu(&mut r, 0, &prompt(k));
    }
    // The first request teaches instance 0 its decode time: 10 s for 39 steps after its first
    // token, a tenth of each learnt ((0.01 + 0.1 × 9.99) / (1 + 0.1 × 38) = 0.21 s a step).
    // Its first token comes when predicted (no queue, no compute): nothing late to learn.
    assert_eq!(r.route_tracked(1, &prompt(1), 40, 40, 0.0).unwrap().0, 0);
    assert!(r.first_token(1, 0.0) && r.finished(1, 10.0));
    // The next one is held there (80 of 100 tokens, until 10 + 39 × 0.21 = 18.2 s) ...
    assert_eq!(r.route_tracked(2, &prompt(2), 40, 40, 10.0).unwrap().0, 0);
    assert!(r.first_token(2, 10.0));
    // ... so the third's 40-token prompt has no room there for 8.2 s, against 0.04 s to
    // compute its 40 tokens on instance 1.
    let (inst, est) = r.route_tracked(3, &prompt(3), 40, 40, 10.0).unwrap();
    assert_eq!(inst, 1);
    assert!((est.compute_s - 0.04).abs() < 1e-9, "{est:?}");
    assert!(!r.finished(99, 11.0), "an unknown request is not booked");
    // A prompt that fits beside the running one stays with its pages: 20 tokens free.
    let small: Vec<u64> = (200..205).collect();
    on_gpu(&mut r, 0, &small);
    let (inst, est) = r.route_tracked(4, &small, 20, 40, 10.0).unwrap();
    assert_eq!((inst, est.queue_s), (0, 0.0), "{est:?}");
}

/// A request that arrives behind a waiting prompt filling most of the device waits there
/// for that prompt's prefill *and* its whole answer: the engine admits in order, and the
/// request's own prompt has no room until the big one ends. Before the queue replayed the
/// instance's timeline it priced that wait as a share of a mean decode time (nothing before
/// an end was seen) and sent the request behind the big prompt, to its pages.
#[test]
fn a_request_is_not_routed_behind_a_prompt_that_fills_the_device_until_it_ends() {
    let mut r = tracking(1000.0);
    let turn: Vec<u64> = (1..=25).collect(); // 100 tokens, on instance 0's GPU
    on_gpu(&mut r, 0, &turn);
    let big: Vec<u64> = (1000..1225).collect(); // 900 tokens, on instance 0's GPU too
    on_gpu(&mut r, 0, &big);
    // The big prompt goes to its pages; it will decode 500 tokens (5 s at 0.01 s a token).
    assert_eq!(r.route_tracked(1, &big, 900, 500, 0.0).unwrap().0, 0);
    // The turn's pages are there too, but its 100 tokens have no room beside the big
    // prompt's 900 until that ends: more than 5 s, against 0.1 s to compute it on instance 1.
    let (inst, est) = r.route_tracked(2, &turn, 100, 10, 0.0).unwrap();
    assert_eq!(inst, 1, "{est:?}");
    // Once the big prompt ended, the turn's next request goes back to its pages.
    assert!(r.first_token(1, 0.1) && r.finished(1, 5.1));
    assert!(r.first_token(2, 0.1) && r.finished(2, 0.2));
    let (inst, est) = r.route_tracked(3, &turn, 100, 10, 5.2).unwrap();
    assert_eq!(inst, 0, "{est:?}");
    assert!(est.queue_s < 0.05, "only the lateness learnt: {est:?}");
}

/// Requests sharing their prompt hold its pages once: a hot prefix that fills half the device
/// stays where its pages are while the requests' own parts fit, though each request alone is
/// that half.
#[test]
fn running_requests_sharing_a_prefix_hold_it_once() {
    let mut r = tracking(100.0);
    let shared: Vec<u64> = (1..=12).collect(); // 48 tokens
    on_gpu(&mut r, 0, &shared);
    assert_eq!(r.route_tracked(1, &shared, 48, 2, 0.0).unwrap().0, 0);
    assert!(r.first_token(1, 0.0) && r.finished(1, 10.0)); // a decode time of 10 s, learnt
    // Four running requests of 50 tokens each: 48 shared + 4 × 2 own = 56 of 100 held.
    for id in 2..=5 {
        assert_eq!(r.route_tracked(id, &shared, 48, 2, 10.0).unwrap().0, 0);
        assert!(r.first_token(id, 10.0));
    }
    let (inst, est) = r.route_tracked(6, &shared, 48, 2, 10.0).unwrap();
    assert_eq!((inst, est.queue_s), (0, 0.0), "{est:?}");
}

/// Two instances with the same prefix on their GPUs tie, and ties go to instance 0. Two
/// requests at once: the second goes to instance 1 (instance 0 has the first's prefill
/// pending), and both first tokens teach their instance's lateness. When instance 0's come
/// later than predicted the router sends every later request to instance 1; when they come
/// earlier, every later request stays on instance 0.
#[test]
fn an_instance_whose_first_tokens_come_late_is_avoided() {
    let hashes: Vec<u64> = (1..=10).collect();
    let run = |late_s: f64| -> Vec<usize> {
        let mut r = tracking(1e6);
        for i in 0..2 {
            on_gpu(&mut r, i, &hashes);
        }
        let first = |inst: usize, t: f64, est: &Estimate| {
            t + est.ttft_s() + if inst == 0 { late_s } else { 0.0 }
        };
        let (a, ea) = r.route_tracked(0, &hashes, 44, 4, 0.0).unwrap();
        let (b, eb) = r.route_tracked(1, &hashes, 44, 4, 0.0).unwrap();
        assert_eq!(
            (a, b),
            (0, 1),
            "the second request goes where nothing is pending"
        );
        for (id, inst, est) in [(0, a, ea), (1, b, eb)] {
            let at = first(inst, 0.0, &est);
            assert!(r.first_token(id, at) && r.finished(id, at + 0.1));
        }
        (2..30u64)
            .map(|id| {
                let t = id as f64;
                let (inst, est) = r.route_tracked(id, &hashes, 44, 4, t).unwrap();
                let at = first(inst, t, &est);
                assert!(r.first_token(id, at) && r.finished(id, at + 0.1));
                inst
            })
            .collect()
    };
    assert!(run(-0.002).iter().all(|&i| i == 0), "early: stays");
    let late = run(0.05);
    assert!(late.iter().all(|&i| i == 1), "{late:?}");
}

/// Work routed without a lifecycle (`route_hashes`, the service's `/route`) and booked work
/// (`route_tracked`, the proxy's) are one queue: each kind of request sees the other's.
#[test]
fn open_loop_and_booked_work_are_one_queue() {
    let mut r = Router::new(2, model(), 1 << 20).expect("model");
    let pages = |k: u64, n: u64| -> Vec<u64> { (1000 * k..1000 * k + n).collect() };
    // an untracked request queues its 0.4 s (400 tokens) on instance 0 (ties go there) ...
    assert_eq!(r.route_hashes(&pages(1, 100), 400, 0.0).unwrap().0, 0);
    // ... which a booked one of 0.8 s sees: it goes to instance 1 (0.8 + 0.8 there against
    // 0.4 + 0.8 + 0.8 on instance 0) and books its 0.8 s there
    assert_eq!(
        r.route_tracked(1, &pages(2, 200), 800, 0, 0.0).unwrap().0,
        1
    );
    assert!((r.queue_s(0) - 0.4).abs() < 1e-9, "{}", r.queue_s(0));
    assert!((r.queue_s(1) - 0.8).abs() < 1e-9, "{}", r.queue_s(1));
    // the next untracked request sees the booked work: instance 0's queue is the shorter
    assert_eq!(r.route_hashes(&[9], 4, 0.0).unwrap().0, 0);
    // the open-loop part drains by the clock, the booked part at the first token
    assert!(r.first_token(1, 0.8));
    assert!(r.queue_s(1).abs() < 1e-9, "{}", r.queue_s(1));
    assert_eq!(r.route_hashes(&[11], 4, 0.1).unwrap().0, 1);
    assert_eq!(r.booked(), 1);
}

/// An instance none of whose first tokens was seen is priced with the others' average
/// lateness, not as if it were on time: the model's error (here a prefill slower than it
/// says, on every instance) does not send requests to the instance it was not yet seen on.
#[test]
fn an_instance_not_yet_seen_is_as_late_as_the_others() {
    let hashes: Vec<u64> = (1..=10).collect();
    let mut r = Router::new(2, model(), 1 << 20).expect("model");
    on_gpu(&mut r, 0, &hashes);
    // every first token on instance 0 comes 50 ms late; instance 1 holds nothing
    for id in 0..30u64 {
        let t = id as f64;
        let (inst, est) = r.route_tracked(id, &hashes, 44, 4, t).unwrap();
        assert_eq!(inst, 0, "request {id}: {est:?}");
        let at = t + est.ttft_s() + 0.05;
        assert!(r.first_token(id, at) && r.finished(id, at + 0.1));
    }
    assert!((r.late_s(1) - r.late_s(0)).abs() < 1e-12 && r.late_s(0) > 0.04);
}

/// An instance whose first tokens came late for a while (a transient: a long prefill, a
/// pause) is not shut out for good once it is on time again: its lateness is learnt only
/// from first tokens, and an instance no request goes to shows none. The learnt lateness
/// of an instance not seen for a while decays toward the other instances' (half-life
/// `LATE_HALF_LIFE_S`), so it is tried again and relearnt. Before, it kept its last value
/// for ever and got no request in ten minutes of steady traffic.
#[test]
fn an_instance_late_once_is_tried_again_and_relearnt() {
    let hashes: Vec<u64> = (1..=10).collect();
    let mut r = Router::new(2, model(), 1 << 20).expect("model");
    for i in 0..2 {
        on_gpu(&mut r, i, &hashes);
    }
    // Two requests at once, one per instance; instance 0's first token comes 2 s late.
    let (a, ea) = r.route_tracked(0, &hashes, 44, 4, 0.0).unwrap();
    let (b, eb) = r.route_tracked(1, &hashes, 44, 4, 0.0).unwrap();
    assert_eq!((a, b), (0, 1));
    assert!(r.first_token(0, ea.ttft_s() + 2.0) && r.finished(0, ea.ttft_s() + 2.1));
    assert!(r.first_token(1, eb.ttft_s()) && r.finished(1, eb.ttft_s() + 0.1));
    let learnt = r.late_s(0);
    assert!(learnt > 0.1, "{learnt}");
    // Ten minutes of pairs of requests, one pair a second; every first token now on time.
    let mut back = None;
    for k in 1..600u64 {
        let t = k as f64 + 3.0;
        let pair: Vec<_> = (0..2)
            .map(|j| {
                let id = 10 * k + j;
                (id, r.route_tracked(id, &hashes, 44, 4, t).unwrap())
            })
            .collect();
        for (id, (inst, est)) in pair {
            if inst == 0 && back.is_none() {
                back = Some(t);
            }
            let at = t + est.ttft_s();
            assert!(r.first_token(id, at) && r.finished(id, at + 0.1));
        }
    }
    let back = back.expect("instance 0 got no request in ten minutes");
    assert!(back < 600.0, "{back}");
    assert!(
        r.late_s(0) < learnt / 2.0,
        "relearnt: {} (was {learnt})",
        r.late_s(0)
    );
}

/// A time that is not finite (NaN, infinite) is refused and changes nothing: before, a NaN
/// routing time or first-token time made the instance's lateness NaN, and every later price
/// of that instance NaN (it was never chosen again, and `/stats` showed `null`).
#[test]
fn a_time_that_is_not_finite_is_refused_and_changes_nothing() {
    let hashes: Vec<u64> = (1..=10).collect();
    let mut r = Router::new(2, model(), 1 << 20).expect("model");
    let (inst, _) = r.route_tracked(1, &hashes, 44, 4, 1.0).unwrap();
    let (queue, late, booked) = (r.queue_s(inst), r.late_s(inst), r.booked());
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        assert!(matches!(
            r.route_tracked(2, &hashes, 44, 4, bad),
            Err(RouteError::BadTime(_))
        ));
        assert!(matches!(
            r.route_hashes(&hashes, 44, bad),
            Err(RouteError::BadTime(_))
        ));
        assert!(!r.first_token(1, bad) && !r.finished(1, bad));
        assert_eq!((r.queue_s(inst), r.booked()), (queue, booked));
        assert_eq!(r.late_s(inst).to_bits(), late.to_bits());
    }
    assert!(r.first_token(1, 1.5) && r.finished(1, 2.0));
    assert!(r.late_s(inst).is_finite());
}

/// A weight that is negative or not finite is a typed error and leaves the weight as it was.
#[test]
fn a_bad_delay_weight_is_refused() {
    let mut r = Router::new(2, model(), 16).expect("model");
    r.set_delay_weight(0.5).unwrap();
    for w in [-0.1, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            r.set_delay_weight(w),
            Err(RouteError::BadDelayWeight(_))
        ));
        assert_eq!(r.delay_weight(), 0.5);
    }
}

/// An occupancy whose device size or decode step is negative or not finite is a typed error
/// and leaves the occupancy as it was (a NaN there made every closed-loop queue NaN).
#[test]
fn a_bad_occupancy_is_refused() {
    let mut r = Router::new(2, model(), 16).expect("model");
    let good = Occupancy {
        device_tokens: 1e6,
        decode_step_s: 0.01,
    };
    r.set_occupancy(Some(good)).unwrap();
    for (device_tokens, decode_step_s) in [
        (f64::NAN, 0.01),
        (-1.0, 0.01),
        (f64::INFINITY, 0.01),
        (1e6, f64::NAN),
        (1e6, -0.01),
        (1e6, f64::INFINITY),
    ] {
        let bad = Occupancy {
            device_tokens,
            decode_step_s,
        };
        assert!(matches!(
            r.set_occupancy(Some(bad)),
            Err(RouteError::BadOccupancy(_))
        ));
        assert_eq!(r.occupancy(), Some(good));
    }
    r.set_occupancy(None).unwrap();
    assert_eq!(r.occupancy(), None);
}

/// A conversation's next turn stays on the instance holding its history until that instance's
/// queue outweighs (1 + delay weight) x the work moving would add: the recompute elsewhere is
/// work that the requests behind it wait for. The greedy rule (weight 0) moved it as soon as
/// the queue passed the extra work.
#[test]
fn a_turn_stays_with_its_history_until_its_queue_outweighs_the_work_moving_adds() {
    // 6 pages of history on instance 0's GPU; the turn adds 2 pages: 8 ms of work there,
    // 32 ms on instance 1, which has nothing cached.
    let history = tokens(5, 0, 6);
    let turn = [history.clone(), tokens(6, 0, 2)].concat();
    let extra_s = (32.0 - 8.0) / 1000.0;
    // None: the default router, which must keep the turn home until twice the extra work
    for set in [None, Some(0.0), Some(0.5), Some(1.0), Some(2.0)] {
        let w = set.unwrap_or(1.0);
        let mut c = cache();
        serve(&mut c, &history, 0);
        let mut r = Router::new(2, model(), 1 << 20).expect("model");
        if let Some(w) = set {
            r.set_delay_weight(w).unwrap();
        }
        publish(&mut r, 0, &mut c);
        // instance 1 is serving a request (its first token came: it decodes), so work routed
        // there delays the requests behind it
        busy(&mut r, 1);
        // every turn at the same instant: each one kept home adds its 8 ms to instance 0
        let (queue_at_move, home) = route_until_it_moves(&mut r, &turn, w);
        // It moves at the first queue where staying costs at least as much (ties go to the
        // shorter queue): within one turn's work (8 ms) above (1 + w) x the extra work.
        let threshold = (1.0 + w) * extra_s;
        assert!(
            queue_at_move >= threshold - 1e-9 && queue_at_move < threshold + 0.008,
            "weight {w}: moved at a queue of {queue_at_move} s after {home} turns, threshold {threshold} s"
        );
    }
}

/// Routes `turn` (6 pages of history on instance 0's GPU, 2 new) again and again at one
/// instant until it leaves instance 0: instance 0's queue then, and the turns kept home.
fn route_until_it_moves(r: &mut Router, turn: &[u32], w: f64) -> (f64, usize) {
    let mut home = 0;
    loop {
        let q0 = r.queues()[0];
        let (i, e) = r.route(turn, &plain(), 0.0).unwrap();
        if i != 0 {
            assert_eq!(e.compute_s, 0.032, "weight {w}");
            return (q0, home);
        }
        assert_eq!(e.gpu_pages, 6);
        home += 1;
        assert!(home < 100, "weight {w}: never moved");
    }
}

/// A request running on `instance` (booked, its first token reported): the instance is busy
/// with no queue.
fn busy(r: &mut Router, instance: usize) {
    let own: Vec<u64> = (9000..9004).collect();
    on_gpu(r, instance, &own);
    let (i, _) = r.route_tracked(9999, &own, 4 * PS, 8, 0.0).unwrap();
    assert_eq!(i, instance);
    assert!(r.first_token(9999, 0.0));
    assert_eq!(r.queue_s(instance), 0.0);
}

/// On an idle instance (nothing queued, nothing running) no request waits behind the work a
/// move adds: the turn moves there as soon as its queue at home outweighs the extra work
/// less the delay its own work home would impose (w x 8 ms), not (1 + w) x the extra work.
#[test]
fn a_turn_moves_to_an_idle_instance_once_its_queue_outweighs_the_extra_work() {
    let history = tokens(5, 0, 6);
    let turn = [history.clone(), tokens(6, 0, 2)].concat();
    for w in [0.0, 0.5, 1.0, 2.0] {
        let mut c = cache();
        serve(&mut c, &history, 0);
        let mut r = Router::new(2, model(), 1 << 20).expect("model");
        r.set_delay_weight(w).unwrap();
        publish(&mut r, 0, &mut c);
        // the first turn goes home: instance 0 is idle too, and 8 ms < 32 ms
        let (queue_at_move, home) = route_until_it_moves(&mut r, &turn, w);
        // staying: q0 + 8 ms + w x 8 ms; moving: 32 ms (an idle instance: no weight)
        let threshold = (0.024 - w * 0.008_f64).max(0.0);
        assert!(
            queue_at_move >= threshold - 1e-9 && queue_at_move < threshold + 0.008,
            "weight {w}: moved at a queue of {queue_at_move} s after {home} turns, threshold {threshold} s"
        );
    }
}

/// A cost model the estimates cannot use is refused when the router is built (before this, a
/// NaN prefill rate made every queue NaN and sent every request to instance 0, and a page of
/// 0 tokens hid every cached page): by [`Router::new`], [`Cluster::new`] and
/// [`CostModel::check`], each with the same typed error.
#[test]
fn a_cost_model_with_a_rate_that_is_not_a_positive_number_is_refused() {
    let bad_rates = [0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY];
    let mut bad = vec![
        CostModel {
            page_size: 0,
            ..model()
        },
        CostModel {
            page_bytes: 0,
            ..model()
        },
    ];
    for v in bad_rates {
        bad.push(CostModel {
            prefill_tokens_per_s: v,
            ..model()
        });
        bad.push(CostModel {
            host_bytes_per_s: v,
            ..model()
        });
        bad.push(CostModel {
            l3_bytes_per_s: v,
            ..model()
        });
    }
    for m in bad {
        assert!(
            matches!(m.check(), Err(RouteError::BadModel(_))),
            "{m:?} accepted"
        );
        assert!(matches!(
            Router::new(2, m, 1 << 20),
            Err(RouteError::BadModel(_))
        ));
        assert!(matches!(
            kvtier_router::cluster::Cluster::new(
                2,
                m,
                1 << 20,
                kvtier_router::cluster::Keys::Tokens
            ),
            Err(RouteError::BadModel(_))
        ));
    }
    model().check().expect("the tests' model");
    CostModel::h100_llama8b().check().expect("the H100 model");
}

proptest! {
    /// Any model with a positive page, positive bytes and finite positive rates is accepted,
    /// and its estimates are finite.
    #[test]
    fn every_model_with_finite_positive_rates_is_accepted(
        page_size in 1usize..1024,
        page_bytes in 1u64..(1 << 32),
        rates in proptest::array::uniform3(1e-6f64..1e15),
        tokens in 0usize..100_000,
        pages in proptest::array::uniform3(0usize..1000),
    ) {
        let m = CostModel {
            page_size,
            page_bytes,
            prefill_tokens_per_s: rates[0],
            host_bytes_per_s: rates[1],
            l3_bytes_per_s: rates[2],
        };
        prop_assert!(m.check().is_ok());
        let e = m.estimate(tokens, pages[0], pages[1], pages[2], 0.0);
        prop_assert!(e.ttft_s().is_finite() && e.ttft_s() >= 0.0);
        prop_assert!(Router::new(3, m, 16).is_ok());
    }
}
