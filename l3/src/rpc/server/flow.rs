//! Flow control of one RPC connection: at most `limit` requests held at once.
//!
//! Why: tarpc's `BaseChannel` reads requests as fast as they come and spawns a handler for
//! each, whether or not the replies can be written. A client that pipelines requests and
//! never reads a reply made the server hold every request and every answer (an adversarial
//! tester: 169 MiB → 5.8 GiB in 20 s of `batch_exist`s; `batch_get`s pinned their objects).
//! tarpc's own `max_concurrent_requests` still reads the requests past the limit (to answer
//! them with an error), and refuses a well-behaved client's calls beyond it.
//!
//! So: [`Bounded`] counts the connection's requests in flight (read and not yet written back,
//! which includes the answers waiting for the socket); at `limit` it stops the transport
//! below it ([`Gated`]) from reading. tarpc still processes cancellations and expirations
//! meanwhile, and writes the replies it has; each reply written makes room for a request.
//! A client that reads nothing then holds `limit` requests, and its socket's buffers; the
//! write timeout of `limits::FrameGuard` drops it. Calls past the limit wait their turn
//! (in the socket), none is refused.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use futures::{Sink, Stream};
use tarpc::server::{Channel, Config};

use super::limits::ConnState;

/// A transport that reads nothing while its gate is closed (its sink is untouched).
pub struct Gated<T> {
    inner: T,
    closed: Arc<AtomicBool>,
}

impl<T> Gated<T> {
    /// `inner`, and the gate [`Bounded`] closes at its limit.
    pub fn new(inner: T) -> (Self, Arc<AtomicBool>) {
        let closed = Arc::new(AtomicBool::new(false));
        (
            Gated {
                inner,
                closed: closed.clone(),
            },
            closed,
        )
    }
}

impl<T: Stream + Unpin> Stream for Gated<T> {
    type Item = T::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T::Item>> {
        let this = self.get_mut();
        if this.closed.load(Ordering::Acquire) {
            // No waker: `Bounded` polls again whenever it opens the gate.
            return Poll::Pending;
        }
        Pin::new(&mut this.inner).poll_next(cx)
    }
}

impl<I, T: Sink<I> + Unpin> Sink<I> for Gated<T> {
    type Error = T::Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), T::Error>> {
        Pin::new(&mut self.get_mut().inner).poll_ready(cx)
    }

    fn start_send(self: Pin<&mut Self>, item: I) -> Result<(), T::Error> {
        Pin::new(&mut self.get_mut().inner).start_send(item)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), T::Error>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), T::Error>> {
        Pin::new(&mut self.get_mut().inner).poll_close(cx)
    }
}

/// A channel over a [`Gated`] transport that closes the gate while `limit` requests are in
/// flight, and reports its count to the connection's registry.
pub struct Bounded<C> {
    inner: Pin<Box<C>>,
    gate: Arc<AtomicBool>,
    limit: usize,
    state: Arc<ConnState>,
    counted: usize,
}

impl<C: Channel> Bounded<C> {
    /// `inner` (whose transport is gated by `gate`) with at most `limit` (at least 1)
    /// requests in flight.
    pub fn new(inner: C, gate: Arc<AtomicBool>, limit: usize, state: Arc<ConnState>) -> Self {
        Bounded {
            inner: Box::pin(inner),
            gate,
            limit: limit.max(1),
            state,
            counted: 0,
        }
    }

    fn full(&self) -> bool {
        self.inner.in_flight_requests() >= self.limit
    }

    fn report(&mut self) {
        let now = self.inner.in_flight_requests();
        self.state.in_flight_changed(self.counted, now);
        self.counted = now;
    }
}

impl<C> Drop for Bounded<C> {
    fn drop(&mut self) {
        self.state.in_flight_changed(self.counted, 0);
    }
}

impl<C: Channel> Stream for Bounded<C> {
    type Item = <C as Stream>::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            let full = this.full();
            this.gate.store(full, Ordering::Release);
            let r = this.inner.as_mut().poll_next(cx);
            this.report();
            // At the limit, the channel may have made room meanwhile (a cancellation, an
            // expired request): then read now, as nothing else will wake this task for it.
            if r.is_pending() && full && !this.full() {
                continue;
            }
            return r;
        }
    }
}

impl<C: Channel> Sink<tarpc::Response<C::Resp>> for Bounded<C> {
    type Error = <C as Sink<tarpc::Response<C::Resp>>>::Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.get_mut().inner.as_mut().poll_ready(cx)
    }

    fn start_send(self: Pin<&mut Self>, item: tarpc::Response<C::Resp>) -> Result<(), Self::Error> {
        let this = self.get_mut();
        let r = this.inner.as_mut().start_send(item);
        this.report();
        r
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.get_mut().inner.as_mut().poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.get_mut().inner.as_mut().poll_close(cx)
    }
}

impl<C: Channel> Channel for Bounded<C> {
    type Req = C::Req;
    type Resp = C::Resp;
    type Transport = C::Transport;

    fn config(&self) -> &Config {
        self.inner.config()
    }

    fn in_flight_requests(&self) -> usize {
        self.inner.in_flight_requests()
    }

    fn transport(&self) -> &Self::Transport {
        self.inner.transport()
    }
}
