//! The blocking accept loop shared by the transfer channel (TCP) and the shared-memory
//! path (Unix socket), what every listener does when `accept` fails, the limits of a
//! connection that has not said hello yet, and the token check of every `Hello`.
//!
//! Why one loop: both serve one blocking thread per connection behind the same limits —
//! at most [`MAX_CONNECTIONS`] live, at most [`MAX_PENDING_HELLOS`] that have not
//! authenticated yet (each dropped [`HELLO_TIMEOUT`] after it connected, however it sends,
//! and its frame capped at [`PRE_AUTH_MAX_FRAME`]) — so unauthenticated peers hold a bounded
//! number of threads and bytes whichever socket they reach.
//!
//! Why a pause after a failed `accept`: the failures that persist (out of descriptors,
//! EMFILE/ENFILE, or memory) fail again at once, and a loop retrying at once spins a core
//! until they pass; [`ACCEPT_BACKOFF`] later they may have.

use std::io::{self, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{L3Error, L3Result};
use crate::rpc::xfer::{FrameError, read_frame};

/// Most concurrent connections a listener accepts.
pub const MAX_CONNECTIONS: usize = 64;
/// Most connections that have not said a valid hello yet. Beyond it new connections are
/// closed at once, so unauthenticated peers can hold at most this many threads, each for
/// at most [`HELLO_TIMEOUT`]; a client refused here uses the RPC path instead.
pub const MAX_PENDING_HELLOS: usize = 8;
/// How long a new connection may take to send its hello, from the moment it is accepted.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest frame a connection may send before its hello succeeded (a hello is a token and a
/// few bytes); the configured frame limit applies after.
pub const PRE_AUTH_MAX_FRAME: usize = 64 << 10;
/// Pause of an accept loop after `accept` failed.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// What an accept loop does when `accept` fails: pause [`ACCEPT_BACKOFF`] (the returned
/// duration), and say so in the log at most once a minute.
#[derive(Default)]
pub struct AcceptErrors {
    warned: Option<Instant>,
    unreported: u64,
}

impl AcceptErrors {
    /// `listener` failed to accept with `e`: how long to pause.
    pub fn failed(&mut self, listener: &str, e: &io::Error) -> Duration {
        self.unreported += 1;
        if self
            .warned
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(60))
        {
            tracing::warn!(
                listener,
                error = %e,
                failures = self.unreported,
                "accept failed; pausing before the next try"
            );
            self.warned = Some(Instant::now());
            self.unreported = 0;
        }
        ACCEPT_BACKOFF
    }
}

/// A blocking socket whose read timeout can be set (TCP or Unix).
pub trait TimedRead: Read {
    /// `set_read_timeout` of the socket.
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

impl TimedRead for std::net::TcpStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        std::net::TcpStream::set_read_timeout(self, t)
    }
}

impl TimedRead for std::os::unix::net::UnixStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_read_timeout(self, t)
    }
}

/// Reads from a socket until a deadline, however the bytes come: each read waits at most
/// what is left (a per-read timeout alone lets a peer sending a byte at a time hold the
/// reader for ever); past the deadline, reads fail with `TimedOut`.
pub struct ByDeadline<'a, S> {
    sock: &'a mut S,
    until: Instant,
}

impl<'a, S: TimedRead> ByDeadline<'a, S> {
    /// Reads of `sock` until `until`.
    pub fn new(sock: &'a mut S, until: Instant) -> Self {
        ByDeadline { sock, until }
    }
}

impl<S: TimedRead> Read for ByDeadline<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        self.sock.set_read_timeout(Some(left))?;
        self.sock.read(buf)
    }
}

/// The next request of a connection on the transfer channel or the shared-memory socket.
/// Until the peer's hello succeeded (`authed` false) its reads must finish by `hello_by`
/// and its frame may be at most [`PRE_AUTH_MAX_FRAME`] (nothing larger is allocated for a
/// peer without the token); then at most `max_frame`. `Err(Some(e))`: a frame the peer is
/// told about (too large, malformed) before the connection closes; `Err(None)`: the
/// connection is gone or its time ran out.
pub fn read_request<T: for<'de> serde::Deserialize<'de>, S: TimedRead>(
    sock: &mut S,
    authed: bool,
    hello_by: Instant,
    max_frame: usize,
) -> Result<T, Option<L3Error>> {
    let (limit, read) = if authed {
        (max_frame, read_frame(sock, max_frame))
    } else {
        let limit = PRE_AUTH_MAX_FRAME.min(max_frame);
        (
            limit,
            read_frame(&mut ByDeadline::new(sock, hello_by), limit),
        )
    };
    match read {
        Ok(r) => Ok(r),
        Err(FrameError::TooLarge(n)) => {
            let before = if authed { "" } else { " before hello" };
            Err(Some(L3Error::InvalidParams(format!(
                "frame of {n} bytes exceeds the {limit}-byte limit{before}"
            ))))
        }
        Err(FrameError::Malformed(m)) => Err(Some(L3Error::InvalidParams(format!(
            "malformed request: {m}"
        )))),
        Err(_) => Err(None),
    }
}

/// What a server checks a `Hello`'s token against: the SHA-256 of the shared secret, domain
/// separated. A server given the token hashes it once; an HA leader started without it
/// loads the digest a previous leader stored in etcd (`crate::ha::tenants`), so the
/// plaintext never has to sit in etcd (which has neither TLS nor auth here).
///
/// Why a plain (unsalted, fast) hash is enough: the token is a random shared secret, not a
/// password; the digest only has to keep an etcd reader from learning it, and preimage
/// resistance does that for any secret with the entropy a generated token has.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TokenDigest([u8; 32]);

impl std::fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenDigest(..)")
    }
}

impl TokenDigest {
    /// The digest of `token`.
    pub fn of(token: &str) -> Self {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(b"kvtier-l3 token v1\0");
        h.update(token.as_bytes());
        TokenDigest(h.finalize().into())
    }

    /// Lower-case hex, the form stored in etcd.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`Self::to_hex`]'s form (64 hex digits); anything else is a typed error.
    pub fn from_hex(s: &str) -> L3Result<Self> {
        let bad = || L3Error::Internal(format!("a token digest must be 64 hex digits, got {s:?}"));
        if s.len() != 64 || !s.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(TokenDigest(out))
    }

    /// Whether `got` hashes to this digest (compared in constant time).
    pub fn accepts(&self, got: Option<&str>) -> bool {
        match got {
            Some(g) => {
                let d = TokenDigest::of(g);
                self.0
                    .iter()
                    .zip(d.0.iter())
                    .fold(0u8, |a, (x, y)| a | (x ^ y))
                    == 0
            }
            None => false,
        }
    }
}

/// Whether `got` is the token a server configured with `want` accepts (constant time).
pub fn token_ok(want: Option<&TokenDigest>, got: Option<&str>) -> bool {
    match want {
        None => true,
        Some(w) => w.accepts(got),
    }
}

/// A connection's slot among those awaiting hello; released once (hello or close).
pub struct Pending<'a>(Option<&'a AtomicUsize>);

impl Pending<'_> {
    /// The connection authenticated: it no longer counts as pending.
    pub fn release(&mut self) {
        if let Some(p) = self.0.take() {
            p.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Serves one accepted connection (its hello slot released once it authenticates).
pub type ServeConn<S> = Arc<dyn Fn(S, &mut Pending<'_>) + Send + Sync>;

/// Spawns the accept thread: `accept` blocks for the next connection; each one accepted
/// within the limits is served by `serve` on a thread of its own. The loop ends at the
/// first connection accepted after `stop` turned true.
pub fn spawn_acceptor<S: Send + 'static>(
    name: &str,
    mut accept: impl FnMut() -> io::Result<S> + Send + 'static,
    stop: Arc<AtomicBool>,
    serve: ServeConn<S>,
) -> L3Result<JoinHandle<()>> {
    let live = Arc::new(AtomicUsize::new(0));
    let pending = Arc::new(AtomicUsize::new(0));
    let conn_name = name.to_string();
    std::thread::Builder::new()
        .name(format!("{name}-accept"))
        .spawn(move || {
            let mut errors = AcceptErrors::default();
            loop {
                let conn = accept();
                if stop.load(Ordering::Acquire) {
                    return;
                }
                let sock = match conn {
                    Ok(s) => s,
                    Err(e) => {
                        std::thread::sleep(errors.failed(&conn_name, &e));
                        continue;
                    }
                };
                if live.load(Ordering::Acquire) >= MAX_CONNECTIONS
                    || pending.load(Ordering::Acquire) >= MAX_PENDING_HELLOS
                {
                    drop(sock);
                    continue;
                }
                live.fetch_add(1, Ordering::AcqRel);
                pending.fetch_add(1, Ordering::AcqRel);
                let serve = serve.clone();
                let (live2, pending2) = (live.clone(), pending.clone());
                let spawned =
                    std::thread::Builder::new()
                        .name(conn_name.clone())
                        .spawn(move || {
                            let mut hello = Pending(Some(&pending2));
                            serve(sock, &mut hello);
                            drop(hello);
                            live2.fetch_sub(1, Ordering::AcqRel);
                        });
                if spawned.is_err() {
                    live.fetch_sub(1, Ordering::AcqRel);
                    pending.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })
        .map_err(|e| L3Error::Internal(format!("spawn {name}: {e}")))
}
