//! `Feedback`'s unit tests: queues, lateness and the memory timeline against hand-worked
//! cases, and their invariants as property tests.

use super::*;
use proptest::prelude::*;

fn routed(work_s: f64, predicted_s: f64, at_s: f64) -> Routed {
    Routed {
        work_s,
        predicted_s,
        at_s,
        first: FirstToken::Reported,
    }
}

fn held(pages: &[u64], extra: f64) -> Held<'_> {
    Held {
        pages,
        extra_tokens: extra,
        output: 0,
    }
}

fn held_out(pages: &[u64], extra: f64, output: usize) -> Held<'_> {
    Held {
        pages,
        extra_tokens: extra,
        output,
    }
}

#[test]
fn pending_prefill_leaves_at_the_first_token_and_memory_at_the_end() {
    let mut f = Feedback::new(2, 1000.0, 100, 0.0);
    let six: Vec<u64> = (0..6).collect();
    // routed at 0.5 with 0.5 s of work: its first token at 1.0 is on time
    f.book(1, 0, routed(0.5, 0.5, 0.5), held_out(&six, 20.0, 20));
    assert_eq!(f.queue_s(0, held(&[], 100.0), 0.5), 0.5);
    assert!(f.first_token(1, 1.0));
    assert_eq!(f.queue_s(0, held(&[], 100.0), 1.0), 0.0);
    // 2 s for 19 decode steps after the first token, a tenth of each learnt
    assert!(f.finished(1, Some(3.0)));
    let learnt = (DECODE_EWMA * 2.0) / (1.0 + DECODE_EWMA * 18.0);
    assert!((f.step_s(0) - learnt).abs() < 1e-12);
    let step_s = f.step_s(0);
    f.book(2, 0, routed(0.0, 0.0, 0.0), held_out(&six, 20.0, 20));
    assert!(f.first_token(2, 10.0));
    // 620 held until 10 + 19 steps: 620 + 600 new is over 1000, so the new request
    // waits for that end
    let other: Vec<u64> = (10..16).collect();
    let q = f.queue_s(0, held(&other, 0.0), 10.0);
    assert!((q - 19.0 * step_s).abs() < 1e-12, "{q}");
    // one that fits beside it does not wait
    assert_eq!(f.queue_s(0, held(&other[..3], 0.0), 10.0), 0.0);
    // an overdue request ends now
    assert!(10.0 + 19.0 * step_s < 12.0);
    assert_eq!(f.queue_s(0, held(&other, 0.0), 12.0), 0.0);
    assert!(!f.first_token(9, 0.0) && !f.finished(9, None));
    assert_eq!(
        f.queue_s(7, held(&[], 1.0), 0.0),
        0.0,
        "an unknown instance has no queue"
    );
}

#[test]
fn a_request_behind_a_waiting_one_that_fills_the_device_waits_for_its_whole_answer() {
    // the conversation trace's case: a prompt of most of the device waits for room, is
    // prefilled, decodes its answer, and only then is there room for the next one
    let mut f = Feedback::new(1, 1000.0, 100, 0.1);
    let a: Vec<u64> = (0..5).collect();
    f.book(1, 0, routed(0.2, 0.2, 0.0), held_out(&a, 0.0, 51));
    assert!(f.first_token(1, 0.2)); // holds 500 until 0.2 + 50 steps x 0.1 = 5.2
    let b: Vec<u64> = (10..18).collect();
    f.book(2, 0, routed(1.0, 1.0, 1.0), held_out(&b, 0.0, 11)); // 800: waits for room
    // b is admitted at 5.2, prefilled at 6.2, ends at 7.2; c (300) fits only after
    let c: Vec<u64> = (20..23).collect();
    let q = f.queue_s(0, held(&c, 0.0), 1.0);
    assert!((q - 6.2).abs() < 1e-9, "{q}");
    // one of 200 fits beside b: it waits for b's prefill only
    let q = f.queue_s(0, held(&c[..2], 0.0), 1.0);
    assert!((q - 5.2).abs() < 1e-9, "{q}");
    // a page b holds already is not needed twice
    let mut shared = b[..3].to_vec();
    shared.extend([30, 31]);
    let q = f.queue_s(0, held(&shared, 0.0), 1.0);
    assert!((q - 5.2).abs() < 1e-9, "{q}");
}

#[test]
fn an_unknown_output_ends_a_request_after_the_mean_decode_time() {
    let mut f = Feedback::new(1, 1000.0, 100, 0.0);
    let six: Vec<u64> = (0..6).collect();
    for (k, t) in (0..40u64).zip((0..).map(|x| x as f64 * 10.0)) {
        f.book(k, 0, routed(0.0, 0.0, t), held(&six, 0.0));
        assert!(f.first_token(k, t));
        assert!(f.finished(k, Some(t + 3.0)));
    }
    // learnt: 3 s from first token to end, for a request of unknown output
    assert!((f.step_s(0) - 3.0).abs() < 0.1, "{}", f.step_s(0));
    f.book(99, 0, routed(0.0, 0.0, 500.0), held(&six, 0.0));
    assert!(f.first_token(99, 500.0));
    let other: Vec<u64> = (10..16).collect();
    let q = f.queue_s(0, held(&other, 0.0), 501.0);
    assert!((q - (f.step_s(0) - 1.0)).abs() < 1e-9, "{q}");
}

#[test]
fn declared_outputs_that_overstate_what_requests_generate_hold_what_they_generate() {
    // max_tokens 1,000 declared, about 100 generated at 0.01 s a token: each ends 1 s
    // after its first token, so its decode time per declared token is a tenth of the
    // decode step
    let mut f = Feedback::new(1, 1000.0, 100, 0.01);
    let five: Vec<u64> = (0..5).collect();
    for k in 0..60u64 {
        let t = k as f64 * 10.0;
        f.book(k, 0, routed(0.0, 0.0, t), held_out(&five, 1000.0, 1000));
        assert!(f.first_token(k, t) && f.finished(k, Some(t + 1.0)));
    }
    assert!((f.step_s(0) - 0.001).abs() < 1e-4, "{}", f.step_s(0));
    f.book(
        99,
        0,
        routed(0.0, 0.0, 600.0),
        held_out(&five, 1000.0, 1000),
    );
    assert!(f.first_token(99, 600.0));
    // it holds its 500 prompt tokens and about 100 generated, not 1,000: 300 fit beside
    let three: Vec<u64> = (10..13).collect();
    assert_eq!(f.queue_s(0, held(&three, 0.0), 600.0), 0.0);
    // 500 do not: they wait for its end, about 1 s after its first token
    let more: Vec<u64> = (10..15).collect();
    let q = f.queue_s(0, held(&more, 0.0), 600.0);
    assert!((q - 999.0 * f.step_s(0)).abs() < 1e-9, "{q}");
}

#[test]
fn a_page_shared_by_running_requests_is_held_once() {
    let mut f = Feedback::new(1, 1000.0, 100, 1.0);
    let system: Vec<u64> = (0..5).collect();
    let (mut a, mut b) = (system.clone(), system.clone());
    a.extend([100, 101]);
    b.extend([200, 201]);
    f.book(1, 0, routed(0.0, 0.0, 0.0), held_out(&a, 30.0, 2));
    f.book(2, 0, routed(0.0, 0.0, 0.0), held_out(&b, 30.0, 2));
    assert!(f.first_token(1, 0.0) && f.first_token(2, 0.0));
    // 5 shared + 2 + 2 own pages and 60 extra tokens: 960, not 1,460
    assert!((f.held_tokens(0) - 960.0).abs() < 1e-9);
    // a third sharing the system prompt adds its own 2 pages only: 160 over, so it waits
    // for the first end (at 1 s: one decode step at 1 s each), not for both
    let mut c = system.clone();
    c.extend([300, 301]);
    assert!((f.queue_s(0, held(&c, 0.0), 0.0) - 1.0).abs() < 1e-9);
    // the shared pages stay held until their last holder ends
    f.finished(1, None);
    assert!((f.held_tokens(0) - 730.0).abs() < 1e-9);
    f.finished(2, None);
    assert_eq!(f.held_tokens(0), 0.0);
    assert!(f.held_pages[0].is_empty());
}

#[test]
fn an_instance_whose_first_tokens_come_late_is_learnt_and_early_ones_too() {
    let mut f = Feedback::new(2, 1e6, 16, 0.0);
    for k in 0..200u64 {
        let t = k as f64;
        // instance 0: every first token 20 ms after its predicted 10 ms
        f.book(2 * k, 0, routed(0.01, 0.01, t), held(&[], 1.0));
        assert!(f.first_token(2 * k, t + 0.03));
        // instance 1: every first token 50 ms before its predicted 100 ms
        f.book(2 * k + 1, 1, routed(0.1, 0.1, t), held(&[], 1.0));
        assert!(f.first_token(2 * k + 1, t + 0.05));
    }
    // (as of instance 0's last first token: instance 1's came 20 ms later)
    let now = 199.03;
    assert!(
        (f.late_s(0, now) - 0.02).abs() < 1e-6,
        "{}",
        f.late_s(0, now)
    );
    assert!(
        (f.late_s(1, now) + 0.05).abs() < 1e-6,
        "{}",
        f.late_s(1, now)
    );
    assert_eq!(f.late_s(7, now), 0.0, "an unknown instance is never late");
    // an instance none of whose first tokens was seen: the average of those seen
    let mut g = Feedback::new(3, 1e6, 16, 0.0);
    assert_eq!(g.late_s(2, 0.0), 0.0, "nothing seen anywhere");
    for (id, inst, first) in [(1, 0, 0.21), (2, 1, 0.41)] {
        g.book(id, inst, routed(0.01, 0.01, 0.0), held(&[], 1.0));
        assert!(g.first_token(id, first));
    }
    assert!((g.late_s(0, 0.21) - 0.02).abs() < 1e-9 && (g.late_s(1, 0.41) - 0.04).abs() < 1e-9);
    assert!(
        (g.late_s(2, 0.41) - 0.03).abs() < 1e-9,
        "{}",
        g.late_s(2, 0.41)
    );
    // an instance not seen for a while: what its lateness says beyond the others' halves
    // every LATE_HALF_LIFE_S (instance 0: 0.04 + (0.02 - 0.04) / 2 one half-life on)
    let later = 0.21 + LATE_HALF_LIFE_S;
    assert!(
        (g.late_s(0, later) - 0.03).abs() < 1e-9,
        "{}",
        g.late_s(0, later)
    );
    assert!((g.late_s(0, 0.21 + 20.0 * LATE_HALF_LIFE_S) - 0.04).abs() < 1e-6);
    assert!(
        (g.late_s(0, 0.0) - 0.02).abs() < 1e-9,
        "a time before it was seen: as seen"
    );
    // a first token reported twice is learnt once
    let before = f.late_s(0, now);
    assert!(f.first_token(398, 500.0));
    assert_eq!(f.late_s(0, now), before);
}

#[test]
fn an_unseen_first_token_leaves_the_queue_when_predicted_and_teaches_nothing() {
    let mut f = Feedback::new(1, 1e6, 16, 0.0);
    let unseen = Routed {
        first: FirstToken::AtEstimate,
        ..routed(0.3, 0.5, 1.0)
    };
    f.book(1, 0, unseen, held(&[], 1.0));
    f.settle(1.4);
    assert!(
        (f.queue_s(0, held(&[], 1.0), 1.4) - 0.3).abs() < 1e-9,
        "due at 1.5"
    );
    f.settle(1.5);
    assert_eq!(f.queue_s(0, held(&[], 1.0), 1.5), 0.0);
    assert_eq!(f.late_s(0, 2.0), 0.0);
    // a cancelled booking's entry is skipped; a new booking under its id is its own
    f.book(2, 0, unseen, held(&[], 1.0));
    assert!(f.cancel(2) && !f.cancel(2));
    f.book(2, 0, routed(0.3, 0.5, 1.2), held(&[], 1.0));
    f.settle(2.0);
    assert!(
        (f.queue_s(0, held(&[], 1.0), 2.0) - 0.3).abs() < 1e-9,
        "reported: waits"
    );
    assert!(f.first_token(2, 2.1) && f.finished(2, Some(3.0)));
    assert_eq!(f.booked(), 1, "request 1 runs until its end");
    assert!(f.finished(1, Some(3.0)));
}

/// `late_s` as defined, the others' mean computed from scratch: what the kept sum must
/// give.
fn late_s_by_definition(f: &Feedback, instance: usize, now_s: f64) -> f64 {
    let Some(seen_at) = f.late_seen_at.get(instance) else {
        return 0.0;
    };
    let others: Vec<f64> = (0..f.late_s.len())
        .filter(|&j| j != instance && f.late_seen_at[j].is_some())
        .map(|j| f.late_s[j])
        .collect();
    let mean = if others.is_empty() {
        0.0
    } else {
        others.iter().sum::<f64>() / others.len() as f64
    };
    match seen_at {
        None => mean,
        Some(_) => mean + (f.late_s[instance] - mean) * f.freshness(instance, now_s),
    }
}

proptest! {
    /// The others' mean from the sum kept at each first token equals the mean computed
    /// from scratch, for every instance, at any mix of learnt and unlearnt instances.
    #[test]
    fn the_kept_lateness_sum_prices_like_the_definition(
        tokens in proptest::collection::vec((0usize..6, 0.0f64..0.5, 0.0f64..2.0), 0..60),
    ) {
        let mut f = Feedback::new(6, 1e6, 16, 0.0);
        let mut now = 0.0;
        for (id, &(inst, predicted, late)) in tokens.iter().enumerate() {
            now += 1.0;
            f.book(id as u64, inst, routed(0.01, predicted, now), held(&[], 1.0));
            prop_assert!(f.first_token(id as u64, now + predicted + late));
            for i in 0..7 {
                let (got, want) = (f.late_s(i, now + 5.0), late_s_by_definition(&f, i, now + 5.0));
                prop_assert!((got - want).abs() < 1e-9, "instance {i}: {got} vs {want}");
            }
        }
    }

    /// However far apart an instance's first tokens come (a second or ten minutes), a
    /// constant lateness is learnt exactly (the decay never pulls the estimate toward
    /// the other instances'), and the price between first tokens always lies between
    /// the instance's own estimate and the others' average.
    #[test]
    fn lateness_is_learnt_at_any_spacing_and_priced_between_own_and_others(
        gaps in prop::collection::vec(0.0f64..600.0, 100..140),
        late in -0.5f64..2.0,
        other in -0.5f64..2.0,
    ) {
        let mut f = Feedback::new(2, 1e6, 16, 0.0);
        f.book(1_000_000, 1, routed(0.01, 0.01, 0.0), held(&[], 1.0));
        prop_assert!(f.first_token(1_000_000, 0.01 + other / LATE_EWMA));
        let mut t = 0.0;
        for (k, gap) in gaps.iter().enumerate() {
            t += gap;
            let (own, others) = (f.late_s[0], f.late_s[1]);
            let priced = f.late_s(0, t);
            prop_assert!(priced >= own.min(others) - 1e-9 && priced <= own.max(others) + 1e-9);
            f.book(k as u64, 0, routed(0.01, 0.01, t), held(&[], 1.0));
            prop_assert!(f.first_token(k as u64, t + 0.01 + late));
            prop_assert!(f.finished(k as u64, Some(t + 0.1)));
        }
        prop_assert!((f.late_s(0, t + 0.01 + late) - late).abs() < 1e-3, "{} vs {late}", f.late_s(0, t));
    }

    /// Whatever the order of bookings, first tokens and ends, queues are never negative,
    /// the held pages are exactly the union of the running requests' pages, and everything
    /// returns to zero once every request ended.
    #[test]
    fn queues_stay_non_negative_and_drain(
        ops in prop::collection::vec(
            (0u64..12, 0usize..3, 0u8..4, 0.0f64..2.0, prop::collection::vec(0u64..20, 0..6)),
            1..80,
        ),
    ) {
        let mut f = Feedback::new(3, 500.0, 16, 0.01);
        let mut t = 0.0;
        let mut running: HashMap<u64, (usize, Vec<u64>)> = HashMap::new();
        for (id, inst, op, x, pages) in ops {
            t += x;
            match op {
                0 => {
                    let mut r = routed(x, x, t);
                    if id % 2 == 1 {
                        r.first = FirstToken::AtEstimate;
                    }
                    f.book(id, inst, r, held(&pages, x * 40.0));
                    running.insert(id, (inst, pages));
                }
                1 => { f.first_token(id, t); }
                2 => f.settle(t),
                _ => {
                    f.finished(id, Some(t));
                    running.remove(&id);
                }
            }
            for i in 0..3 {
                prop_assert!(f.queue_s(i, held(&[1, 2], 100.0), t) >= 0.0);
                let union: std::collections::HashSet<u64> = running
                    .values()
                    .filter(|(j, _)| *j == i)
                    .flat_map(|(_, p)| p.iter().copied())
                    .collect();
                let mine: std::collections::HashSet<u64> =
                    f.held_pages[i].keys().copied().collect();
                prop_assert_eq!(mine, union);
                prop_assert_eq!(
                    f.running(i),
                    running.values().filter(|(j, _)| *j == i).count()
                );
            }
        }
        for id in 0..12 {
            f.finished(id, Some(t));
        }
        prop_assert_eq!(f.booked(), 0);
        for i in 0..3 {
            prop_assert!(f.pending_s[i].abs() < 1e-9 && f.held_tokens(i).abs() < 1e-9);
        }
    }

    /// The replayed queue is never shorter than the waiting requests' prefill work, is
    /// exactly that work when the device has room for everything, and never shrinks when
    /// the new request needs more room.
    #[test]
    fn the_timeline_waits_at_least_for_the_prefills_ahead_and_longer_for_more_room(
        ops in prop::collection::vec(
            (0usize..2, 0.0f64..1.0, 0usize..8, 0usize..200, 0.0f64..2.0),
            1..40,
        ),
        need in 0usize..12,
        more in 0usize..6,
    ) {
        let mut f = Feedback::new(1, 1000.0, 100, 0.01);
        let mut roomy = Feedback::new(1, 1e12, 100, 0.01);
        let mut t = 0.0;
        for (id, (op, work, pages, output, gap)) in ops.into_iter().enumerate() {
            t += gap;
            let id = id as u64;
            let p: Vec<u64> = (0..pages as u64).map(|k| id * 100 + k).collect();
            for g in [&mut f, &mut roomy] {
                g.book(id, 0, routed(work, work, t), held_out(&p, output as f64, output));
                if op == 1 {
                    g.first_token(id, t + work);
                }
            }
        }
        let fresh = |n: usize| -> Vec<u64> { (0..n as u64).map(|k| 1_000_000 + k).collect() };
        let (a, b) = (fresh(need), fresh(need + more));
        let pending = f.pending_s[0];
        let q = f.queue_s(0, held(&a, 0.0), t);
        prop_assert!(q >= pending - 1e-9, "{q} < {pending}");
        prop_assert!((roomy.queue_s(0, held(&a, 0.0), t) - pending).abs() < 1e-9);
        prop_assert!(f.queue_s(0, held(&b, 0.0), t) >= q - 1e-9);
    }
}

#[test]
fn a_request_given_up_on_teaches_at_least_its_wait_and_never_less() {
    let mut f = Feedback::new(2, 1e6, 16, 0.0);
    // predicted at 10 ms, given up on after 3 s: instance 0 is learnt late, the other not
    f.book(1, 0, routed(0.01, 0.01, 0.0), held(&[], 1.0));
    assert!(f.abandoned(1, 3.0));
    assert_eq!(f.booked(), 0, "it ended");
    let late = f.late_s(0, 3.0);
    assert!((late - LATE_EWMA * 2.99).abs() < 1e-9, "{late}");
    assert_eq!(
        f.late_s(1, 3.0),
        0.0,
        "a hung instance says nothing of the others"
    );
    assert!(!f.abandoned(1, 4.0), "not booked any more");
    // given up on sooner than predicted: no lower bound past what is known, nothing learnt
    f.book(2, 0, routed(0.5, 0.5, 3.0), held(&[], 1.0));
    assert!(f.abandoned(2, 3.1));
    assert_eq!(f.late_s(0, 3.0), late);
    // more requests that never answer: it grows toward their wait
    for id in 3..40 {
        let t = id as f64 * 3.0;
        f.book(id, 0, routed(0.01, 0.01, t), held(&[], 1.0));
        assert!(f.abandoned(id, t + 3.0));
    }
    let hung = f.late_s(0, 120.0);
    assert!(hung > 2.0 && hung < 2.99, "{hung}");
    // it fades as lateness does
    let faded = f.late_s(0, 120.0 + LATE_HALF_LIFE_S);
    assert!((faded - hung / 2.0).abs() < 1e-9, "{faded}");
    // a first token: it answers, and its first tokens' lateness holds again
    f.book(50, 0, routed(0.01, 0.01, 200.0), held(&[], 1.0));
    assert!(f.first_token(50, 200.03));
    assert!(
        (f.late_s(0, 200.03) - 0.002).abs() < 1e-9,
        "{}",
        f.late_s(0, 200.03)
    );
    // an answer's end clears it too (instance 1, unseen: the others' lateness, as before)
    let base = f.late_s(1, 300.0);
    f.book(51, 1, routed(0.01, 0.01, 300.0), held(&[], 1.0));
    assert!(f.abandoned(51, 301.0));
    assert!(f.late_s(1, 301.0) > base + 0.05);
    f.book(52, 1, routed(0.01, 0.01, 302.0), held(&[], 1.0));
    assert!(f.finished(52, Some(302.5)));
    assert_eq!(f.late_s(1, 302.5), base);
}
