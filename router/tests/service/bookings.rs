//! `POST /route` clients closing the router's loop themselves: a tracked route returns a
//! booking, the client reports its first token and end over HTTP, a booking never ended
//! expires, and nobody can end a booking that is not theirs.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::*;
use kvtier_router::cluster::{BOOKING_TTL_S, Cluster, Keys, Report};
use kvtier_router::launch::{self, Config, EndpointSpec, StartError};
use kvtier_router::{FirstToken, Occupancy, RouteError};
use proptest::prelude::*;

fn post(body: serde_json::Value) -> Vec<u8> {
    body.to_string().into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_client_books_reports_and_its_forgotten_bookings_expire() {
    let (p0, p1) = (publisher(), publisher());
    let r = router(vec![spec(&p0), spec(&p1)], None, 1 << 20, Keys::Engine).await;
    let a = tokens(7, 8);
    let tracked = post(serde_json::json!({"token_ids": a, "track": true, "max_tokens": 64}));
    let got = http(r.addr, "POST", "/route", Some(&tracked)).await;
    assert_eq!(got.status, 200);
    let j = got.json();
    let id = j["booking"]
        .as_u64()
        .expect("a tracked route has a booking");
    let inst = j["instance"].as_u64().expect("instance") as usize;
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["bookings"]["open"], 1, "{stats}");
    assert_eq!(stats["bookings"]["http_open"], 1, "{stats}");
    assert!(
        stats["instances"][inst]["queue_s"].as_f64() > Some(0.0),
        "{stats}"
    );
    // an untracked route has none
    let plain = post(serde_json::json!({"token_ids": a}));
    let j = http(r.addr, "POST", "/route", Some(&plain)).await.json();
    assert!(j.get("booking").is_none(), "{j}");
    let report = |id: u64, what: &str| format!("/bookings/{id}/{what}");
    // first token once, then the end once
    assert_eq!(
        http(r.addr, "POST", &report(id, "first_token"), None)
            .await
            .status,
        204
    );
    let again = http(r.addr, "POST", &report(id, "first_token"), None).await;
    assert_eq!(again.status, 404);
    assert_eq!(again.json()["error"]["type"], "unknown_booking");
    assert_eq!(
        http(r.addr, "POST", &report(id, "end"), None).await.status,
        204
    );
    assert_eq!(
        http(r.addr, "POST", &report(id, "end"), None).await.status,
        404
    );
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["bookings"]["open"], 0, "{stats}");
    // bad reports: typed errors, nothing changes
    assert_eq!(
        http(r.addr, "POST", &report(999, "end"), None).await.status,
        404
    );
    assert_eq!(
        http(r.addr, "POST", &report(id, "finish"), None)
            .await
            .status,
        404
    );
    assert_eq!(
        http(r.addr, "POST", "/bookings/x/end", None).await.status,
        400
    );
    let bad = post(serde_json::json!({"token_ids": a, "track": true, "max_tokens": -1}));
    assert_eq!(http(r.addr, "POST", "/route", Some(&bad)).await.status, 400);
    // a booking the proxy made (not over /route) cannot be ended by a client guessing it
    let theirs = r
        .cluster
        .lock()
        .expect("lock")
        .route_tracked(&a, (None, None), &[], 16, FirstToken::Reported)
        .and_then(|d| d.booking)
        .expect("booked");
    assert_eq!(
        http(r.addr, "POST", &report(theirs, "end"), None)
            .await
            .status,
        404
    );
    assert_eq!(r.cluster.lock().expect("lock").router().booked(), 1);
    // a client that never reports: its booking expires, the queue no longer counts it
    r.cluster
        .lock()
        .expect("lock")
        .set_booking_ttl_s(0.3)
        .expect("ttl");
    let j = http(r.addr, "POST", "/route", Some(&tracked)).await.json();
    let lost = j["booking"].as_u64().expect("booking");
    assert_eq!(r.cluster.lock().expect("lock").router().booked(), 2);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(
        stats["bookings"]["http_open"], 1,
        "not expired before anyone asks: {stats}"
    );
    http(r.addr, "POST", "/route", Some(&plain)).await; // any route expires what is due
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["bookings"]["http_open"], 0, "{stats}");
    assert_eq!(stats["bookings"]["http_expired"], 1, "{stats}");
    assert_eq!(
        stats["bookings"]["open"], 1,
        "only the proxy's is left: {stats}"
    );
    assert_eq!(
        http(r.addr, "POST", &report(lost, "end"), None)
            .await
            .status,
        404
    );
    r.stop().await;
}

/// A report naming no booking id (not a number, negative, past u64, not UTF-8) or no report
/// is answered with the API's JSON error shape, not axum's plain-text rejection, and
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_report_is_a_json_error_and_changes_nothing() {
    let r = router(vec![EndpointSpec::default()], None, 1 << 20, Keys::Engine).await;
    let tracked = post(serde_json::json!({"token_ids": tokens(7, 2), "track": true}));
    let j = http(r.addr, "POST", "/route", Some(&tracked)).await.json();
    let id = j["booking"].as_u64().expect("booking");
    for (path, status, kind) in [
        ("/bookings/abc/end".to_string(), 400, "invalid_request"),
        ("/bookings/-1/end".into(), 400, "invalid_request"),
        (
            "/bookings/18446744073709551616/end".into(),
            400,
            "invalid_request",
        ),
        ("/bookings/%FF/end".into(), 400, "invalid_request"),
        (format!("/bookings/{id}x/end"), 400, "invalid_request"),
        (format!("/bookings/{id}/nope"), 404, "not_found"),
    ] {
        let got = http(r.addr, "POST", &path, None).await;
        assert_eq!(got.status, status, "{path}");
        assert_eq!(
            got.header("content-type"),
            Some("application/json"),
            "{path}"
        );
        let j: serde_json::Value = serde_json::from_slice(&got.body())
            .unwrap_or_else(|e| panic!("{path}: {e}: {:?}", String::from_utf8_lossy(&got.body())));
        assert_eq!(j["error"]["type"], kind, "{path}: {j}");
        assert!(j["error"]["message"].is_string(), "{path}: {j}");
    }
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["bookings"]["http_open"], 1, "{stats}");
    let end = format!("/bookings/{id}/end");
    assert_eq!(http(r.addr, "POST", &end, None).await.status, 204);
    r.stop().await;
}

/// A tracked route's `max_tokens` above the instances' device tokens (a request whose KV
/// cannot fit) is a 400 and books nothing: 2^64 - 1 made its instance's queue ~9e16 s for
/// every later decision until the booking expired. Up to the device's tokens is booked; a
/// proxied request (whose `max_tokens` the engine judges) is booked with at most that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_tokens_past_the_device_is_refused_and_books_nothing() {
    let device = 100_000usize;
    let occupancy = Some(Occupancy {
        device_tokens: device as f64,
        decode_step_s: 0.005,
    });
    let instances = vec![EndpointSpec::default(), EndpointSpec::default()];
    let r = launch::start(Config {
        occupancy,
        ..config(instances, 1 << 20, Keys::Engine)
    })
    .await
    .expect("start");
    let a = tokens(7, 2);
    for bad in [serde_json::json!(u64::MAX), serde_json::json!(device + 1)] {
        let body = post(serde_json::json!({"token_ids": a, "track": true, "max_tokens": bad}));
        let got = http(r.addr, "POST", "/route", Some(&body)).await;
        assert_eq!(got.status, 400, "{bad}");
        assert_eq!(got.json()["error"]["type"], "invalid_request", "{bad}");
    }
    let stats = http(r.addr, "GET", "/stats", None).await.json();
    assert_eq!(stats["bookings"]["open"], 0, "{stats}");
    for i in 0..2 {
        assert_eq!(stats["instances"][i]["queue_s"], 0.0, "{stats}");
    }
    let body = post(serde_json::json!({"token_ids": a, "track": true, "max_tokens": device}));
    let got = http(r.addr, "POST", "/route", Some(&body)).await;
    assert_eq!(got.status, 200, "the device's tokens are allowed");
    r.stop().await;
    // the library books any output at most as the device's tokens
    let queue_with = |output: usize| {
        let mut c = Cluster::new(1, model(), 1 << 10, Keys::Tokens).expect("cluster");
        c.set_occupancy(occupancy).expect("occupancy");
        let d = c.route_tracked(&a, (None, None), &[], output, FirstToken::Reported);
        c.first_token(d.and_then(|d| d.booking).expect("booked"));
        c.router().queue_s(0)
    };
    // (each on its own clock: equal but for the microseconds between them)
    let (most, device_full) = (queue_with(usize::MAX), queue_with(device));
    assert!((most - device_full).abs() < 0.1, "{most} {device_full}");
    assert!(device_full < 1e3, "{device_full}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_booking_time_to_live_that_is_not_a_positive_time_is_refused() {
    let mut c = Cluster::new(2, model(), 1 << 10, Keys::Tokens).expect("cluster");
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            c.set_booking_ttl_s(bad),
            Err(RouteError::BadBookingTtl(_))
        ));
    }
    c.set_booking_ttl_s(BOOKING_TTL_S)
        .expect("the default is fine");
    let err = launch::start(Config {
        booking_ttl_s: f64::NAN,
        ..config(vec![EndpointSpec::default()], 1 << 10, Keys::Tokens)
    })
    .await
    .err()
    .expect("a NaN time to live started a router");
    assert!(matches!(err, StartError::BookingTtl(_)), "{err}");
}

#[derive(Debug, Clone)]
enum Op {
    Book(bool),
    Report(usize, Report),
    Unknown(u64, Report),
    Proxy,
}

fn op() -> impl Strategy<Value = Op> {
    let report = prop_oneof![
        Just(Report::FirstToken),
        Just(Report::End),
        Just(Report::Cancel)
    ];
    prop_oneof![
        3 => any::<bool>().prop_map(Op::Book),
        4 => (0usize..16, report.clone()).prop_map(|(i, r)| Op::Report(i, r)),
        1 => (1_000u64..2_000, report).prop_map(|(i, r)| Op::Unknown(i, r)),
        1 => Just(Op::Proxy),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A report succeeds exactly when the booking is a `/route` client's and open (a first
    /// token: not reported yet); the router's open bookings are the model's plus the proxy's.
    #[test]
    fn reports_change_exactly_the_open_bookings_they_name(ops in proptest::collection::vec(op(), 1..80)) {
        let mut c = Cluster::new(3, model(), 1 << 12, Keys::Tokens).expect("cluster");
        // the model: each booking made over /route -> (open, first token reported)
        let mut made: Vec<u64> = Vec::new();
        let mut open: BTreeMap<u64, bool> = BTreeMap::new();
        let mut proxy = 0usize;
        let prompt = tokens(3, 4);
        for op in ops {
            match op {
                Op::Book(stream) => {
                    let first = if stream { FirstToken::Reported } else { FirstToken::AtEstimate };
                    let d = c.route_booked(&prompt, (None, None), 32, first).expect("routed");
                    let id = d.booking.expect("booked");
                    // an answer sent whole has no first token to report
                    open.insert(id, !stream);
                    made.push(id);
                }
                Op::Report(i, what) => {
                    let Some(&id) = made.get(i) else { continue };
                    let want = match (open.get(&id), what) {
                        (None, _) => false,
                        (Some(&seen), Report::FirstToken) => !seen,
                        (Some(_), _) => true,
                    };
                    prop_assert_eq!(c.report(id, what), want, "{:?} of {}", what, id);
                    if want {
                        if what == Report::FirstToken {
                            open.insert(id, true);
                        } else {
                            open.remove(&id);
                        }
                    }
                }
                Op::Unknown(id, what) => prop_assert!(!c.report(id, what)),
                Op::Proxy => {
                    c.route_tracked(&prompt, (None, None), &[], 8, FirstToken::Reported).expect("routed");
                    proxy += 1;
                }
            }
            prop_assert_eq!(c.router().booked(), open.len() + proxy);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Background responses' bookings (`Cluster::background`), whatever their predicted first
    /// token (NaN, infinite, negative, huge) and output: at most the open-booking cap is held,
    /// every one held is still in the router's books and no other (those past the cap, and
    /// those due: a predicted 0 s and no output is due at once, dropped at the next decision,
    /// leave both), so none leaks.
    #[test]
    fn background_bookings_stay_within_their_cap_and_leak_none(
        held in proptest::collection::vec(
            (prop_oneof![Just(f64::NAN), Just(f64::INFINITY), Just(-1.0), 0.0..1e9f64],
             any::<usize>(), any::<bool>()),
            1..40,
        ),
        cap in 1usize..8,
    ) {
        let mut c = Cluster::new(2, model(), 1 << 12, Keys::Tokens).expect("cluster");
        c.set_max_open_bookings(cap);
        let prompt = tokens(3, 2);
        for (ttft, output, due_now) in held {
            let d = c.route_tracked(&prompt, (None, None), &[], 8, FirstToken::AtEstimate)
                .expect("routed");
            let (ttft, output) = if due_now { (0.0, 0) } else { (ttft, output) };
            c.background(d.booking.expect("booked"), d.instance, ttft, output);
            let open = c.stats()["bookings"]["background_open"].as_u64().expect("count");
            prop_assert!(open as usize <= cap, "{} held, cap {}", open, cap);
            prop_assert_eq!(c.router().booked(), open as usize);
        }
    }
}

/// `POST /route` clients that book huge prompts and never report held the router's memory
/// without bound until their bookings expired (400 bookings of 1M-token prompts: 250 MB).
/// Open bookings hold at most a cap of prompt pages together: past it the oldest are dropped
/// as if expired (their reports find nothing), and a prompt alone past it is routed unbooked.
#[test]
fn open_bookings_hold_at_most_their_page_cap_and_drop_the_oldest() {
    let mut c = Cluster::new(2, model(), 1 << 20, Keys::Tokens).expect("cluster");
    c.set_max_booked_pages(25);
    let prompt = |seed| tokens(seed, 10); // 10 pages each
    let book = |c: &mut Cluster, seed| {
        c.route_booked(&prompt(seed), (None, None), 8, FirstToken::Reported)
            .expect("routed")
            .booking
    };
    let a = book(&mut c, 1).expect("booked");
    let b = book(&mut c, 2).expect("booked");
    let d = book(&mut c, 3).expect("booked"); // 30 pages > 25: a is dropped
    let stats = c.stats();
    assert_eq!(stats["bookings"]["http_pages"], 20);
    assert_eq!(stats["bookings"]["http_evicted"], 1);
    assert_eq!(c.router().booked(), 2, "the router's queues forgot a too");
    assert!(!c.report(a, Report::End), "a was dropped");
    assert!(c.report(b, Report::FirstToken) && c.report(d, Report::End));
    // a prompt past the cap alone: routed, not booked, nothing else dropped
    let big = c
        .route_booked(&tokens(4, 40), (None, None), 8, FirstToken::Reported)
        .expect("routed");
    assert_eq!(big.booking, None);
    assert_eq!(c.stats()["bookings"]["http_open"], 1);
    assert!(c.report(b, Report::End));
    assert_eq!(c.stats()["bookings"]["http_pages"], 0);
}

/// Bookings of prompts shorter than a page hold no pages, so the page cap never dropped
/// them: a client that left 50,000 open made every decision replay all of them on the
/// instances' timelines (8.4 ms a `/route`) and booking them took quadratic time. Their
/// number is capped too (1,024 per instance of the router by default): past it the oldest is
/// dropped as if expired, so a decision never walks more than that many bookings.
#[test]
fn open_bookings_are_capped_in_number_however_few_pages_they_hold() {
    let occupancy = Occupancy {
        device_tokens: 131_072.0,
        decode_step_s: 0.006,
    };
    let mut c = Cluster::new(2, model(), 1 << 20, Keys::Tokens).expect("cluster");
    c.set_occupancy(Some(occupancy)).expect("occupancy");
    let extra = 10;
    let made: Vec<u64> = (0..2 * 1024 + extra)
        .map(|i| {
            c.route_booked(&[i as u32], (None, None), 16, FirstToken::Reported)
                .expect("routed")
                .booking
                .expect("booked")
        })
        .collect();
    let stats = c.stats();
    assert_eq!(
        stats["bookings"]["http_pages"], 0,
        "one-token prompts: no pages"
    );
    assert_eq!(stats["bookings"]["http_open"], 2 * 1024, "{stats}");
    assert_eq!(stats["bookings"]["http_evicted"], extra as u64, "{stats}");
    assert_eq!(
        c.router().booked(),
        2 * 1024,
        "the queues hold only the open ones"
    );
    // the oldest went, the newest are open
    assert!(!c.report(made[0], Report::End));
    assert!(c.report(made[made.len() - 1], Report::End));
    // a lower cap drops the oldest at the next booking
    c.set_max_open_bookings(3);
    c.route_booked(&[7], (None, None), 16, FirstToken::Reported)
        .expect("routed");
    assert_eq!(c.router().booked(), 3);
}

/// A prompt's page keys are computed before the router's lock is taken, and at most
/// [`kvtier_router::cluster::MAX_ROUTED_PAGES`] of them: a decision holds the lock for its
/// own work only. The bug: a `POST /route` of 30 million token ids (a 60 MB body, under the
/// 64 MiB limit) at page size 1 hashed every page under the lock, which held every other
/// decision and every event stream's fold for over 2 s (the adversarial round measured
/// 2.2 s for a small `/route` beside one such request); now the lock is free within a
/// fraction of that, and the prompt is still routed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_prompt_does_not_hold_the_router_up() {
    let cfg = Config {
        model: kvtier_router::CostModel {
            page_size: 1,
            ..model()
        },
        ..config(vec![EndpointSpec::default()], usize::MAX, Keys::Engine)
    };
    let r = launch::start(cfg).await.expect("start");
    let n = 30_000_000;
    let mut body = String::with_capacity(2 * n + 20);
    body.push_str("{\"token_ids\": [");
    for i in 0..n {
        body.push_str(if i == 0 { "7" } else { ",7" });
    }
    body.push_str("]}");
    let addr = r.addr;
    let big =
        tokio::spawn(async move { http(addr, "POST", "/route", Some(body.as_bytes())).await });
    // the longest wait for the lock while the request is in the router
    let cluster = std::sync::Arc::clone(&r.cluster);
    let longest = tokio::task::spawn_blocking(move || {
        let mut longest = Duration::ZERO;
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_secs(6) {
            let t = std::time::Instant::now();
            drop(cluster.lock().expect("lock"));
            longest = longest.max(t.elapsed());
            std::thread::sleep(Duration::from_millis(2));
        }
        longest
    })
    .await
    .expect("waiter");
    let got = big.await.expect("request");
    assert_eq!(
        got.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&got.body())
    );
    assert_eq!(got.json()["instance"], 0);
    assert!(
        longest < Duration::from_millis(600),
        "the lock was held {longest:?}"
    );
}
