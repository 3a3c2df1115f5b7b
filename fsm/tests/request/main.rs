//! Happy paths and targeted illegal cases of the request machine, one test binary:
//! - `lifecycle`: whole lives of a request (plain, prefetched, chunked, retracted, backed up),
//! - `abort`: aborts (immediate or deferred to the completion) and failures,
//! - `refused`: events refused for their counters or a broken state, and the error API.
//!
//! The helpers below are shared by all three.

use kvtier_fsm::{RequestEvent as E, RequestState as S, RequestTransitionError};

/// Applies `events` in order, panicking with context on the first illegal one.
fn run(start: S, events: &[E]) -> S {
    events.iter().fold(start, |s, e| match s.apply(e.clone()) {
        Ok(next) => next,
        Err(err) => panic!("unexpected illegal transition: {err}"),
    })
}

fn illegal(state: S, event: E) -> RequestTransitionError {
    let before = state.clone();
    match state.apply(event) {
        Ok(next) => panic!("expected an illegal transition, got {next:?}"),
        Err(err) => {
            assert_eq!(err.state, before, "an illegal event changed the state");
            err
        }
    }
}

fn decoding(generated: u32) -> S {
    S::Decoding {
        generated,
        in_flight: false,
        abort_pending: false,
    }
}

mod abort;
mod lifecycle;
mod refused;
