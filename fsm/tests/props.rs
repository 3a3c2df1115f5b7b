//! Property tests of both machines.

mod common;

use std::collections::{BTreeSet, HashSet, VecDeque};

use common::{all_events, all_states, completion_for};
use kvtier_fsm::{
    FailReason, IllegalReason, OpEvent, OpState, RequestEvent, RequestEventKind, RequestState,
    RequestStateKind, request_row,
};
use proptest::prelude::*;
use strum::IntoEnumIterator;

// ---- strategies -------------------------------------------------------------------------------

/// `u32`s biased towards the edges that break arithmetic.
fn count() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => 0u32..12,
        1 => Just(u32::MAX),
        1 => Just(u32::MAX - 1),
        1 => any::<u32>(),
    ]
}

fn fail_reason() -> impl Strategy<Value = FailReason> {
    prop::sample::select(FailReason::iter().collect::<Vec<_>>())
}

/// Any state, consistent or not.
fn any_state() -> impl Strategy<Value = RequestState> {
    use RequestState as S;
    prop_oneof![
        Just(S::Submitted),
        any::<bool>().prop_map(|abort_pending| S::Querying { abort_pending }),
        (count(), count(), any::<bool>()).prop_map(|(start_page, pages, abort_pending)| {
            S::Prefetching {
                start_page,
                pages,
                abort_pending,
            }
        }),
        (count(), count()).prop_map(|(start_page, completed)| S::PrefetchDone {
            start_page,
            completed
        }),
        (count(), count(), count(), count(), any::<bool>()).prop_map(
            |(total, done, scheduled, chunks, abort_pending)| S::Prefilling {
                total,
                done,
                scheduled,
                chunks,
                abort_pending
            }
        ),
        (count(), any::<bool>(), any::<bool>()).prop_map(
            |(generated, in_flight, abort_pending)| S::Decoding {
                generated,
                in_flight,
                abort_pending
            }
        ),
        count().prop_map(|pages| S::Draining { pages }),
        (count(), any::<bool>()).prop_map(|(pages, abort_pending)| S::WritingBack {
            pages,
            abort_pending
        }),
        (count(), any::<bool>()).prop_map(|(outstanding, abort_pending)| S::BackingUp {
            outstanding,
            abort_pending
        }),
        (count(), any::<bool>()).prop_map(|(pages, abort_pending)| S::Retracting {
            pages,
            abort_pending
        }),
        any::<bool>().prop_map(|saved| S::Retracted { saved }),
        Just(S::Finished),
        Just(S::Aborted),
        fail_reason().prop_map(|reason| S::Failed { reason }),
    ]
}

/// Any event, with arbitrary fields.
fn any_event() -> impl Strategy<Value = RequestEvent> {
    use RequestEvent as E;
    prop_oneof![
        Just(E::ScheduleQuery),
        count().prop_map(|hit_pages| E::QueryDone { hit_pages }),
        (count(), count())
            .prop_map(|(start_page, pages)| E::SchedulePrefetch { start_page, pages }),
        count().prop_map(|completed| E::PrefetchDone { completed }),
        (count(), count(), count()).prop_map(|(total, cached, tokens)| E::ScheduleFirstChunk {
            total,
            cached,
            tokens
        }),
        count().prop_map(|tokens| E::ScheduleNextChunk { tokens }),
        Just(E::PrefillDone),
        Just(E::ScheduleDecode),
        Just(E::DecodeStep),
        count().prop_map(|pages_to_write_back| E::Finish {
            pages_to_write_back
        }),
        Just(E::CommitDraining),
        (any::<bool>(), count())
            .prop_map(|(success, backups)| E::WriteBackDone { success, backups }),
        Just(E::BackupDone),
        count().prop_map(|write_back_pages| E::Retract { write_back_pages }),
        Just(E::ResumeFromRetracted),
        Just(E::Abort),
        fail_reason().prop_map(|reason| E::Fail { reason }),
    ]
}

/// One step of a random walk: with probability ~0.85 a *guided* step (one of the sample events
/// that is legal in the current state, `Abort` and `Fail` excluded so walks get deep), otherwise
/// the arbitrary event (legal or not, `Abort` and `Fail` included).
#[derive(Debug, Clone)]
struct Step {
    guided: bool,
    index: prop::sample::Index,
    event: RequestEvent,
}

impl Step {
    fn event_for(&self, state: &RequestState, samples: &[RequestEvent]) -> RequestEvent {
        if self.guided {
            let legal: Vec<&RequestEvent> = samples
                .iter()
                .filter(|e| {
                    !matches!(e.kind(), RequestEventKind::Abort | RequestEventKind::Fail)
                        && state.next_state(e).is_ok()
                })
                .collect();
            if !legal.is_empty() {
                return self.index.get(&legal).to_owned().clone();
            }
        }
        self.event.clone()
    }
}

fn walk(max_len: usize) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (
            prop::bool::weighted(0.85),
            any::<prop::sample::Index>(),
            any_event(),
        )
            .prop_map(|(guided, index, event)| Step {
                guided,
                index,
                event,
            }),
        0..max_len,
    )
}

fn op_event() -> impl Strategy<Value = OpEvent> {
    prop_oneof![
        Just(OpEvent::Issue),
        any::<bool>().prop_map(|success| OpEvent::Complete { success }),
        Just(OpEvent::Cancel),
    ]
}

/// Applies `event`, checking the contract on the way: an illegal event returns exactly the state
/// it got; `next_state` and `apply_mut` agree with `apply`; a legal event from a consistent state
/// yields a consistent state in a kind the table allows.
fn checked_apply(state: RequestState, event: RequestEvent) -> Result<RequestState, TestCaseError> {
    let before = state.clone();
    let peek = before.next_state(&event);
    let mut in_place = before.clone();
    let in_place_result = in_place.apply_mut(event.clone());
    match state.apply(event.clone()) {
        Ok(next) => {
            prop_assert_eq!(peek, Ok(next.clone()));
            prop_assert!(in_place_result.is_ok());
            prop_assert_eq!(&in_place, &next);
            prop_assert_eq!(
                next.check_invariants(),
                Ok(()),
                "{:?} + {:?}",
                before,
                event
            );
            let row = request_row(before.kind(), event.kind());
            prop_assert!(
                row.is_some_and(|r| r.to.contains(&next.kind())),
                "{:?} + {:?} -> {:?} not in the table",
                before,
                event,
                next
            );
            Ok(next)
        }
        Err(err) => {
            prop_assert_eq!(&err.state, &before, "an illegal event changed the state");
            prop_assert_eq!(&err.event, &event);
            prop_assert_eq!(peek, Err(err.reason));
            prop_assert_eq!(&in_place, &before);
            prop_assert_eq!(in_place_result.map_err(|e| e.reason), Err(err.reason));
            Ok(err.into_state())
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random event sequences from `Submitted` never panic, every legal step keeps the
    /// invariants and lands where the table says, and every illegal step changes nothing.
    #[test]
    fn random_sequences_never_panic(steps in walk(80)) {
        let samples = all_events();
        let mut state = RequestState::new();
        for step in steps {
            let event = step.event_for(&state, &samples);
            state = checked_apply(state, event)?;
        }
    }

    /// From any state at all (consistent or not), any event either makes a legal transition or
    /// returns exactly the state it got.
    #[test]
    fn illegal_event_returns_the_untouched_state(state in any_state(), event in any_event()) {
        let consistent = state.check_invariants().is_ok();
        let before = state.clone();
        let result = checked_apply(state, event)?;
        if !consistent && !before.is_terminal() {
            prop_assert_eq!(result, before, "an inconsistent state made a transition");
        }
    }

    /// Terminal states absorb every event and stay as they are.
    #[test]
    fn terminal_states_absorb(reason in fail_reason(), event in any_event()) {
        for state in [RequestState::Finished, RequestState::Aborted, RequestState::Failed { reason }] {
            let err = state.clone().apply(event.clone()).unwrap_err();
            prop_assert_eq!(err.reason, IllegalReason::Terminal);
            prop_assert_eq!(err.state, state);
        }
    }

    /// Abort deferral, on states reached by random walks: whenever something is in flight and no
    /// abort is pending, `Abort` keeps the work in flight, leaves the completion as the only
    /// accepted kind of event, and draining the completions ends in `Aborted`.
    #[test]
    fn abort_waits_for_the_completion(
        steps in walk(40),
        picks in prop::collection::vec(any::<u32>(), 8),
    ) {
        let samples = all_events();
        let mut state = RequestState::new();
        for step in steps {
            let event = step.event_for(&state, &samples);
            state = checked_apply(state, event)?;
            if state.has_in_flight() && !state.abort_pending() {
                check_abort_deferral(&state, &picks)?;
            }
        }
    }

    /// The op machine: whatever the event sequence, an op is issued at most once, completes at
    /// most once, and once issued can only end in `Done` or `Failed` (never `Cancelled`).
    #[test]
    fn op_completes_exactly_once(events in prop::collection::vec(op_event(), 0..12)) {
        let mut state = OpState::Pending;
        let mut issued = false;
        let mut completions = 0u32;
        for event in events {
            let before = state;
            match state.apply(event) {
                Ok(next) => {
                    match event {
                        OpEvent::Issue => issued = true,
                        OpEvent::Complete { success } => {
                            completions += 1;
                            prop_assert_eq!(next, if success { OpState::Done } else { OpState::Failed });
                        }
                        OpEvent::Cancel => prop_assert!(!issued, "cancelled after issue"),
                    }
                    state = next;
                }
                Err(err) => {
                    prop_assert_eq!(err.state, before);
                    if issued && event == OpEvent::Cancel {
                        prop_assert!(matches!(err.reason, IllegalReason::AlreadyIssued | IllegalReason::Terminal));
                    }
                }
            }
        }
        prop_assert!(completions <= 1);
        prop_assert_eq!(completions == 1, matches!(state, OpState::Done | OpState::Failed));
        if issued {
            prop_assert!(matches!(state, OpState::Issued | OpState::Done | OpState::Failed));
        }
    }
}

/// `state` has work in flight and no abort pending.
fn check_abort_deferral(state: &RequestState, picks: &[u32]) -> Result<(), TestCaseError> {
    let mut s = checked_apply(state.clone(), RequestEvent::Abort)?;
    prop_assert!(s.abort_pending() && s.has_in_flight(), "{:?}", s);
    prop_assert_eq!(s.kind(), state.kind(), "abort changed the phase");
    let mut picks = picks.iter().copied().cycle();
    // Bounded: each completion brings the request closer to the end (BackingUp counts down).
    for _ in 0..64 {
        if !s.has_in_flight() {
            break;
        }
        // The completion is the only kind of event still accepted.
        for e in all_events() {
            if s.next_state(&e).is_ok() {
                prop_assert!(e.kind().is_completion(), "{:?} accepted {:?}", s, e);
            }
        }
        let pick = picks.next().unwrap_or(0);
        let Some(completion) = completion_for(&s, pick) else {
            return Err(TestCaseError::fail(format!("no completion for {s:?}")));
        };
        s = s
            .apply(completion)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    // A walk may have scheduled billions of backups (`WriteBackDone { backups: n }` with any
    // n): after 64 completions such a request is still backing up with the abort pending, which
    // is correct (the abort is deferred, not lost); anything else must have ended Aborted.
    if let RequestState::BackingUp {
        outstanding,
        abort_pending,
    } = s
    {
        prop_assert!(abort_pending && outstanding > 0, "{:?}", s);
        return Ok(());
    }
    prop_assert_eq!(s, RequestState::Aborted);
    Ok(())
}

/// Every sample state with work in flight: `Abort` then the matching completion(s) ends in
/// `Aborted`, for every completion variant the samples offer.
#[test]
fn abort_deferral_from_every_in_flight_sample() {
    let mut covered = BTreeSet::new();
    for state in all_states() {
        if !state.has_in_flight() || state.abort_pending() {
            continue;
        }
        covered.insert(state.kind());
        for pick in [0, 1, 2, 3, 4, 7, u32::MAX] {
            check_abort_deferral(&state, &[pick]).unwrap();
        }
    }
    let expected: BTreeSet<_> = [
        RequestStateKind::Querying,
        RequestStateKind::Prefetching,
        RequestStateKind::Prefilling,
        RequestStateKind::Decoding,
        RequestStateKind::WritingBack,
        RequestStateKind::BackingUp,
        RequestStateKind::Retracting,
    ]
    .into_iter()
    .collect();
    assert_eq!(covered, expected);
}

/// Breadth-first search from `Submitted` over the sample events: every state kind is reachable
/// through legal events only.
#[test]
fn every_state_kind_is_reachable_from_submitted() {
    let events = all_events();
    let mut seen: HashSet<RequestState> = HashSet::new();
    let mut kinds = BTreeSet::new();
    let mut queue = VecDeque::from([(RequestState::new(), 0u32)]);
    seen.insert(RequestState::new());
    while let Some((state, depth)) = queue.pop_front() {
        kinds.insert(state.kind());
        // Counters grow without bound; a short horizon reaches every phase.
        if depth >= 10 {
            continue;
        }
        for e in &events {
            if let Ok(next) = state.clone().apply(e.clone())
                && seen.insert(next.clone())
            {
                queue.push_back((next, depth + 1));
            }
        }
    }
    let all: BTreeSet<_> = RequestStateKind::iter().collect();
    assert_eq!(kinds, all, "unreachable: {:?}", all.difference(&kinds));
}

/// Every op state is reachable from `Pending`, and `Cancel` after `Issue` is illegal.
#[test]
fn op_states_reachable_and_no_cancel_after_issue() {
    let mut seen = BTreeSet::from([OpState::Pending]);
    let mut frontier = vec![OpState::Pending];
    while let Some(s) = frontier.pop() {
        for e in [
            OpEvent::Issue,
            OpEvent::Cancel,
            OpEvent::Complete { success: true },
            OpEvent::Complete { success: false },
        ] {
            if let Ok(n) = s.apply(e)
                && seen.insert(n)
            {
                frontier.push(n);
            }
        }
    }
    assert_eq!(seen, OpState::iter().collect());
    let issued = OpState::Pending.apply(OpEvent::Issue).unwrap();
    assert_eq!(
        issued.apply(OpEvent::Cancel).unwrap_err().reason,
        IllegalReason::AlreadyIssued
    );
}

/// The walks used above are only worth something if they get deep: over a fixed-seed batch of
/// walks, every state kind is visited, and the deep ones often enough.
#[test]
fn random_walks_visit_every_state_kind() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    use std::collections::BTreeMap;

    let samples = all_events();
    let mut runner = TestRunner::deterministic();
    let strategy = walk(80);
    let mut visits: BTreeMap<RequestStateKind, u32> = BTreeMap::new();
    let walks = 256;
    for _ in 0..walks {
        let steps = strategy.new_tree(&mut runner).unwrap().current();
        let mut state = RequestState::new();
        let mut kinds = BTreeSet::from([state.kind()]);
        for step in steps {
            let event = step.event_for(&state, &samples);
            if let Ok(next) = state.clone().apply(event) {
                state = next;
            }
            kinds.insert(state.kind());
        }
        for k in kinds {
            *visits.entry(k).or_default() += 1;
        }
    }
    eprintln!("walks visiting each kind (of {walks}): {visits:?}");
    for k in RequestStateKind::iter() {
        let n = visits.get(&k).copied().unwrap_or(0);
        assert!(n >= walks / 32, "only {n} of {walks} walks visit {k}");
    }
}
