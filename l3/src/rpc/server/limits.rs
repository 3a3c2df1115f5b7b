//! Connection limits of the RPC port and the metrics endpoint (async), and the accept loop
//! they share.
//!
//! Why: nothing a peer without the token sends may hold the server's descriptors, memory or
//! a core. So:
//! - at most `max_live` connections, at most `max_pending` of them not yet authenticated;
//!   a connection past either limit closes the *oldest* unauthenticated one (a new one
//!   is refused only when every live connection is authenticated), so a peer holding idle
//!   sockets cannot lock out a client that says its hello at once;
//! - a connection that has not authenticated within its deadline is closed (the caller's
//!   select, see `serve_rpc`);
//! - until `hello` succeeds, a connection's frames are capped at [`PRE_AUTH_MAX_FRAME`]:
//!   [`FrameGuard`] reads the length of every frame as it passes and fails the read of one
//!   over the connection's current limit, so the codec never buffers (or decodes) it;
//! - an accept that fails (out of descriptors) pauses the loop instead of spinning;
//! - an authenticated connection whose replies make no progress (its peer does not read
//!   them), or that leaves a frame half-sent, for the stall limit is dropped
//!   ([`FrameGuard`]), and with it the requests it holds (at most a bounded number: `flow`).

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Notify, watch};
use tokio::time::Sleep;

use crate::rpc::accept::AcceptErrors;
pub use crate::rpc::accept::PRE_AUTH_MAX_FRAME;

/// The live connections of one listener.
pub struct Registry {
    max_live: usize,
    max_pending: usize,
    inner: Mutex<Inner>,
    /// Requests read and not yet answered on the wire, over all connections.
    in_flight: AtomicUsize,
}

#[derive(Default)]
struct Inner {
    authed: usize,
    /// Unauthenticated connections by age (id), each with its eviction signal.
    pending: BTreeMap<u64, Arc<Notify>>,
    next: u64,
}

impl Registry {
    /// At most `max_live` connections (at least 1), at most `max_pending` (at least 1, at
    /// most `max_live`) unauthenticated.
    pub fn new(max_live: usize, max_pending: usize) -> Arc<Self> {
        let max_live = max_live.max(1);
        Arc::new(Registry {
            max_live,
            max_pending: max_pending.clamp(1, max_live),
            inner: Mutex::new(Inner::default()),
            in_flight: AtomicUsize::new(0),
        })
    }

    /// Admits a new connection (unauthenticated, frames up to [`PRE_AUTH_MAX_FRAME`] or
    /// `max_frame` if smaller, `max_frame` once authenticated), closing the oldest
    /// unauthenticated one if a limit is reached; None (refuse it) when every live
    /// connection is authenticated and there are `max_live`.
    pub fn admit(self: &Arc<Self>, max_frame: usize) -> Option<ConnGuard> {
        let mut g = self.inner.lock();
        if g.authed + g.pending.len() >= self.max_live || g.pending.len() >= self.max_pending {
            let (_, oldest) = g.pending.pop_first()?;
            // Stored as a permit if its task is not waiting yet.
            oldest.notify_one();
        }
        let id = g.next;
        g.next += 1;
        let evict = Arc::new(Notify::new());
        g.pending.insert(id, evict.clone());
        Some(ConnGuard(Arc::new(ConnState {
            id,
            reg: self.clone(),
            authed: AtomicBool::new(false),
            frame_limit: AtomicUsize::new(PRE_AUTH_MAX_FRAME.min(max_frame)),
            max_frame,
            evict,
        })))
    }

    /// (authenticated, unauthenticated) connections now.
    pub fn counts(&self) -> (usize, usize) {
        let g = self.inner.lock();
        (g.authed, g.pending.len())
    }

    /// Requests read and not yet answered on the wire, over all connections.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// One connection's standing: shared by its task, its reader and its calls.
pub struct ConnState {
    id: u64,
    reg: Arc<Registry>,
    authed: AtomicBool,
    frame_limit: AtomicUsize,
    max_frame: usize,
    evict: Arc<Notify>,
}

impl ConnState {
    /// The connection said a valid hello: it no longer counts as unauthenticated and may
    /// send frames up to the configured limit. False when it was closed meanwhile (to make
    /// room for a newer one) — it must then not be served.
    pub fn authenticate(&self) -> bool {
        let mut g = self.reg.inner.lock();
        if self.authed.load(Ordering::Acquire) {
            return true;
        }
        if g.pending.remove(&self.id).is_none() {
            return false;
        }
        g.authed += 1;
        self.frame_limit.store(self.max_frame, Ordering::Release);
        self.authed.store(true, Ordering::Release);
        true
    }

    /// Whether a hello succeeded on this connection.
    pub fn is_authed(&self) -> bool {
        self.authed.load(Ordering::Acquire)
    }

    /// Largest frame this connection may send now.
    pub fn frame_limit(&self) -> usize {
        self.frame_limit.load(Ordering::Acquire)
    }

    /// The connection's requests in flight went from `old` to `new`.
    pub fn in_flight_changed(&self, old: usize, new: usize) {
        if new >= old {
            self.reg.in_flight.fetch_add(new - old, Ordering::Relaxed);
        } else {
            self.reg.in_flight.fetch_sub(old - new, Ordering::Relaxed);
        }
    }

    /// Completes when the connection is to be closed to make room for a newer one.
    pub async fn evicted(&self) {
        self.evict.notified().await
    }
}

/// A connection's place in its [`Registry`], given back when dropped (the connection ends).
pub struct ConnGuard(Arc<ConnState>);

impl ConnGuard {
    /// The connection's state.
    pub fn state(&self) -> &Arc<ConnState> {
        &self.0
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        let s = &self.0;
        let mut g = s.reg.inner.lock();
        if s.authed.load(Ordering::Acquire) {
            g.authed = g.authed.saturating_sub(1);
        } else {
            g.pending.remove(&s.id);
        }
    }
}

/// A socket whose reads fail at the header of a frame (a big-endian u32 length, as tarpc's
/// length-delimited codec reads it) longer than its connection's current limit, before the
/// codec sees the header and reserves room for the frame; and whose reads and writes fail
/// once they have waited `stall` without progress — a write for the peer to read, a read in
/// the middle of a frame (between frames a connection may idle for ever).
pub struct FrameGuard<S> {
    inner: S,
    state: Arc<ConnState>,
    head: [u8; 4],
    head_len: usize,
    body_left: usize,
    stall: Duration,
    read_stall: Option<Pin<Box<Sleep>>>,
    write_stall: Option<Pin<Box<Sleep>>>,
}

impl<S> FrameGuard<S> {
    /// Guards reads of `inner` by `state`'s frame limit, reads and writes by `stall`.
    pub fn new(inner: S, state: Arc<ConnState>, stall: Duration) -> Self {
        FrameGuard {
            inner,
            state,
            head: [0; 4],
            head_len: 0,
            body_left: 0,
            stall,
            read_stall: None,
            write_stall: None,
        }
    }

    /// Whether a frame has begun and not ended.
    fn mid_frame(&self) -> bool {
        self.head_len > 0 || self.body_left > 0
    }

    /// The socket.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Follows frame boundaries through `bytes` (the next bytes of the stream); an error
    /// at a header over the limit.
    fn scan(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            if self.body_left > 0 {
                let n = self.body_left.min(bytes.len());
                self.body_left -= n;
                bytes = &bytes[n..];
                continue;
            }
            self.head[self.head_len] = bytes[0];
            self.head_len += 1;
            bytes = &bytes[1..];
            if self.head_len == self.head.len() {
                self.head_len = 0;
                let len = u32::from_be_bytes(self.head) as usize;
                let limit = self.state.frame_limit();
                if len > limit {
                    let when = if self.state.is_authed() {
                        ""
                    } else {
                        " before hello"
                    };
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("frame of {len} bytes exceeds the {limit}-byte limit{when}"),
                    ));
                }
                self.body_left = len;
            }
        }
        Ok(())
    }
}

/// An I/O that returned Pending: Pending until `timer` (armed now if it is not) fires, then
/// a `TimedOut` error saying `what`.
fn stalled<T>(
    timer: &mut Option<Pin<Box<Sleep>>>,
    limit: Duration,
    cx: &mut Context<'_>,
    what: &str,
) -> Poll<io::Result<T>> {
    let t = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
    match t.as_mut().poll(cx) {
        Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{what} for {limit:?}: connection dropped"),
        ))),
        Poll::Pending => Poll::Pending,
    }
}

impl<S: AsyncWrite + Unpin> FrameGuard<S> {
    /// A write's outcome: progress disarms the stall timer, none arms it.
    fn wrote(
        &mut self,
        r: Poll<io::Result<usize>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<usize>> {
        match r {
            Poll::Pending => stalled(
                &mut self.write_stall,
                self.stall,
                cx,
                "replies not read by the peer",
            ),
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.write_stall = None;
                }
                Poll::Ready(Ok(n))
            }
            err => err,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FrameGuard<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {}
            Poll::Pending if this.mid_frame() => {
                return stalled(
                    &mut this.read_stall,
                    this.stall,
                    cx,
                    "a frame left half-sent",
                );
            }
            Poll::Pending => {
                this.read_stall = None;
                return Poll::Pending;
            }
            other => return other,
        }
        if buf.filled().len() > before {
            this.read_stall = None;
        }
        let r = this.scan(&buf.filled()[before..]);
        if r.is_err() {
            // The refused bytes are not handed on.
            buf.set_filled(before);
        }
        Poll::Ready(r)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FrameGuard<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(r, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.wrote(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A listener the accept loop can take connections from.
pub trait Accept: Send + 'static {
    /// A connection.
    type Conn: Send + 'static;
    /// The next connection.
    fn accept(&mut self) -> impl Future<Output = io::Result<Self::Conn>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Conn = tokio::net::TcpStream;
    async fn accept(&mut self) -> io::Result<tokio::net::TcpStream> {
        tokio::net::TcpListener::accept(self).await.map(|(s, _)| s)
    }
}

/// Accepts connections of `listener` and hands each to `serve` until `stop` turns true;
/// after a failed accept (out of descriptors) it pauses rather than trying again at once.
pub async fn accept_loop<A: Accept>(
    name: &str,
    mut listener: A,
    mut stop: watch::Receiver<bool>,
    mut serve: impl FnMut(A::Conn),
) {
    let mut errors = AcceptErrors::default();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        match accepted {
            Ok(c) => serve(c),
            Err(e) => {
                let pause = errors.failed(name, &e);
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_connection_closes_the_oldest_unauthenticated_one() {
        let r = Registry::new(4, 2);
        let a = r.admit(1 << 20).unwrap();
        let b = r.admit(1 << 20).unwrap();
        assert_eq!(r.counts(), (0, 2));
        // Past the unauthenticated limit: `a`, the oldest, is evicted.
        let c = r.admit(1 << 20).unwrap();
        assert_eq!(r.counts(), (0, 2));
        assert!(
            !a.state().authenticate(),
            "an evicted connection cannot authenticate"
        );
        assert!(b.state().authenticate() && c.state().authenticate());
        assert!(b.state().authenticate(), "a second hello is fine");
        assert_eq!(r.counts(), (2, 0));
        assert_eq!(b.state().frame_limit(), 1 << 20);
        drop(a);
        assert_eq!(r.counts(), (2, 0));
        // Live limit 4: two more fit, then the oldest unauthenticated one makes room...
        let d = r.admit(1 << 20).unwrap();
        let e = r.admit(1 << 20).unwrap();
        let f = r.admit(1 << 20).unwrap();
        assert_eq!(r.counts(), (2, 2));
        assert!(!d.state().authenticate());
        // ...and with every connection authenticated, a new one is refused.
        assert!(e.state().authenticate() && f.state().authenticate());
        assert_eq!(r.counts(), (4, 0));
        assert!(r.admit(1 << 20).is_none());
        drop(c);
        assert_eq!(r.counts(), (3, 0));
        let g = r.admit(1 << 20).unwrap();
        assert_eq!(g.state().frame_limit(), PRE_AUTH_MAX_FRAME);
        assert_eq!(r.counts(), (3, 1));
        drop(g);
        assert_eq!(r.counts(), (3, 0));
    }

    #[test]
    fn the_guard_refuses_a_frame_over_the_limit_at_its_header() {
        let r = Registry::new(4, 4);
        let conn = r.admit(1 << 20).unwrap();
        let mut g = FrameGuard::new((), conn.state().clone(), Duration::from_secs(60));
        let frame = |n: usize| {
            let mut f = (n as u32).to_be_bytes().to_vec();
            f.resize(4 + n, 7);
            f
        };
        // Frames up to the limit pass, split anywhere (here a byte at a time).
        let ok = [frame(0), frame(10), frame(PRE_AUTH_MAX_FRAME)].concat();
        for b in ok.chunks(1) {
            g.scan(b).unwrap();
        }
        let e = g.scan(&frame(PRE_AUTH_MAX_FRAME + 1)[..4]).unwrap_err();
        assert!(e.to_string().contains("before hello"), "{e}");
        // Once authenticated, up to the configured limit.
        let mut g = FrameGuard::new((), conn.state().clone(), Duration::from_secs(60));
        assert!(conn.state().authenticate());
        g.scan(&frame(PRE_AUTH_MAX_FRAME + 1)).unwrap();
        g.scan(&((1u32 << 20) + 1).to_be_bytes()).unwrap_err();
    }

    #[test]
    fn a_failing_accept_pauses_the_loop() {
        struct Emfile(Arc<AtomicUsize>);
        impl Accept for Emfile {
            type Conn = ();
            async fn accept(&mut self) -> io::Result<()> {
                self.0.fetch_add(1, Ordering::Relaxed);
                Err(io::Error::from_raw_os_error(libc::EMFILE))
            }
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let (stop, stop_rx) = watch::channel(false);
        let c = calls.clone();
        rt.block_on(async move {
            let l = tokio::spawn(accept_loop("emfile", Emfile(c), stop_rx, |_| {}));
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            let _ = stop.send(true);
            l.await.unwrap();
        });
        let n = calls.load(Ordering::Relaxed);
        assert!(n < 1000, "{n} failed accepts in a second");
    }
}
