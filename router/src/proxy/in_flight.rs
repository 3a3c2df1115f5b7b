//! A request in flight on an instance, from the send until its answer's body ends or its
//! client goes away: counted on the instance, and its booking in the router's closed-loop
//! queue told of its first token, its end, or that it was cancelled or given up on. Why a
//! guard: a client that goes away drops the answer's stream mid-way, and only a `Drop` sees
//! every such end (the booking and the count return to zero whatever clients and engines do).

use std::sync::{Arc, Mutex, PoisonError};

use crate::cluster::{Cluster, Decision};
use crate::feedback::FirstToken;
use crate::request_fields::Kind;

/// Counts a request in flight on an instance until dropped, and reports a tracked request's
/// first token (its answer's first chunk, when streamed) and end (the drop) to the router.
/// Dropped before its first token (streamed) or its answer's head (sent whole), the request
/// was given up on (its client went away): the instance is learnt to be at least that late.
pub(super) struct InFlight {
    pub(super) cluster: Arc<Mutex<Cluster>>,
    pub(super) instance: usize,
    pub(super) booking: Option<u64>,
    /// Whether the first chunk is the first token (a streamed answer).
    pub(super) streamed: bool,
    /// Which endpoint's answer it is (how its stream's events read, [`super::chunk_of`]).
    pub(super) kind: Kind,
    /// Whether the first chunk is the first token and not seen yet.
    pub(super) awaiting_first: bool,
    /// The answer's head came (for an answer sent whole: the answer).
    pub(super) answered: bool,
    /// The answer's body ended.
    pub(super) done: bool,
}

impl InFlight {
    pub(super) fn new(
        cluster: &Arc<Mutex<Cluster>>,
        d: &Decision,
        first: FirstToken,
        kind: Kind,
    ) -> Self {
        cluster
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .started(d.instance);
        let streamed = d.booking.is_some() && first == FirstToken::Reported;
        Self {
            cluster: Arc::clone(cluster),
            instance: d.instance,
            booking: d.booking,
            streamed,
            kind,
            awaiting_first: streamed,
            answered: false,
            done: false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A chunk of the answer arrived.
    pub(super) fn chunk(&mut self) {
        if std::mem::take(&mut self.awaiting_first)
            && let Some(b) = self.booking
        {
            self.lock().first_token(b);
        }
    }

    /// The request did not run on the instance as booked (it refused the connection, answered
    /// an error status, or failed): its booking goes, nothing learnt from it.
    pub(super) fn cancel(&mut self) {
        self.awaiting_first = false;
        if let Some(b) = self.booking.take() {
            self.lock().cancel(b);
        }
    }

    /// The proxy stopped waiting for the answer's head: the booking goes, and the instance
    /// is learnt to be at least as late as it waited.
    pub(super) fn abandon(&mut self) {
        self.awaiting_first = false;
        if let Some(b) = self.booking.take() {
            self.lock().abandoned(b);
        }
    }

    /// The answer's body failed midway: the booking goes, and an answer whose status said
    /// success is counted as the instance's error after all (an error status was already).
    pub(super) fn failed(&mut self, answered_ok: bool) {
        self.cancel();
        if answered_ok {
            self.lock().answered(self.instance, false);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let booking = self.booking;
        // given up on before the first token, or before a whole answer came
        let waiting = !self.done
            && if self.streamed {
                self.awaiting_first
            } else {
                !self.answered
            };
        let mut c = self.lock();
        c.finished(self.instance);
        match booking {
            Some(b) if waiting => c.abandoned(b),
            Some(b) => c.ended(b),
            None => {}
        }
    }
}
