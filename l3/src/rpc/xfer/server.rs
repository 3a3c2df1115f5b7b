//! The transfer listener: one blocking thread per connection, each a loop of one request
//! and one written reply, and the embedded store's [`XferHandler`] (bulk reads, probes).
//!
//! Why blocking threads: a call is then one read and one write on each side, with no task
//! hops; the connection limits below bound the threads.
//!
//! The first request of a connection must be `Hello` (with the shared-secret token when the
//! server has one). Limits (frame size, keys per batch, the caller's buffer sizes) give typed
//! errors; a frame over the limit or one that does not decode gets an error reply and the
//! connection is closed, while the listener keeps serving.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use serde_bytes::ByteBuf;

use crate::error::{L3Error, L3Result};
use crate::store::EmbeddedStore;

use super::frame::{FrameError, read_frame, send_blobs, unpack_keys, write_frame};
use super::{XferHandler, XferReply, XferRequest, refuse};

/// Most concurrent transfer connections a server accepts.
pub const MAX_CONNECTIONS: usize = 64;
/// Most connections that have not said a valid hello yet. Beyond it new connections are
/// closed at once, so unauthenticated peers can hold at most this many threads, each for
/// at most [`HELLO_TIMEOUT`]; a client refused here uses the RPC path instead.
pub const MAX_PENDING_HELLOS: usize = 8;
/// How long a new connection may take to send its hello.
pub const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// A running transfer listener.
pub struct XferServer {
    /// Bound address.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl XferServer {
    /// Binds `addr` and serves `store` on blocking threads.
    pub fn start(
        store: Arc<dyn XferHandler>,
        addr: SocketAddr,
        token: Option<Arc<str>>,
        max_frame: usize,
    ) -> L3Result<Self> {
        let l = TcpListener::bind(addr)
            .map_err(|e| L3Error::Unavailable(format!("bind {addr}: {e}")))?;
        let bound = l
            .local_addr()
            .map_err(|e| L3Error::Internal(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let live = Arc::new(AtomicUsize::new(0));
        let pending = Arc::new(AtomicUsize::new(0));
        let st = stop.clone();
        let accept = std::thread::Builder::new()
            .name("kvtier-l3-xfer-accept".into())
            .spawn(move || {
                for conn in l.incoming() {
                    if st.load(Ordering::Acquire) {
                        return;
                    }
                    let Ok(sock) = conn else { continue };
                    if live.load(Ordering::Acquire) >= MAX_CONNECTIONS
                        || pending.load(Ordering::Acquire) >= MAX_PENDING_HELLOS
                    {
                        drop(sock);
                        continue;
                    }
                    live.fetch_add(1, Ordering::AcqRel);
                    pending.fetch_add(1, Ordering::AcqRel);
                    let store = store.clone();
                    let token = token.clone();
                    let (live2, pending2) = (live.clone(), pending.clone());
                    let st2 = st.clone();
                    let spawned = std::thread::Builder::new()
                        .name("kvtier-l3-xfer".into())
                        .spawn(move || {
                            let mut hello = Pending(Some(&pending2));
                            serve_conn(
                                sock,
                                &*store,
                                token.as_deref(),
                                max_frame,
                                &st2,
                                &mut hello,
                            );
                            drop(hello);
                            live2.fetch_sub(1, Ordering::AcqRel);
                        });
                    if spawned.is_err() {
                        live.fetch_sub(1, Ordering::AcqRel);
                        pending.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            })
            .map_err(|e| L3Error::Internal(format!("spawn xfer: {e}")))?;
        Ok(XferServer {
            addr: bound,
            stop,
            accept: Some(accept),
        })
    }

    /// Stops accepting (open connections end with their next request).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect(self.addr);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

impl Drop for XferServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A connection's slot among those awaiting hello; released once (hello or close).
struct Pending<'a>(Option<&'a AtomicUsize>);

impl Pending<'_> {
    fn release(&mut self) {
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

fn serve_conn(
    mut sock: TcpStream,
    store: &dyn XferHandler,
    token: Option<&str>,
    max_frame: usize,
    stop: &AtomicBool,
    hello: &mut Pending<'_>,
) {
    let _ = sock.set_nodelay(true);
    // A silent peer is dropped after HELLO_TIMEOUT; without a timeout set, it would hold
    // this thread forever.
    if sock.set_read_timeout(Some(HELLO_TIMEOUT)).is_err() {
        return;
    }
    let mut authed = false;
    loop {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let req: XferRequest = match read_frame(&mut sock, max_frame) {
            Ok(r) => r,
            Err(FrameError::TooLarge(n)) => {
                let e = L3Error::InvalidParams(format!(
                    "frame of {n} bytes exceeds the {max_frame}-byte limit"
                ));
                let _ = write_frame(&mut sock, &XferReply::Get(Err(e)));
                return;
            }
            Err(FrameError::Malformed(m)) => {
                let _ = write_frame(
                    &mut sock,
                    &XferReply::Get(Err(L3Error::InvalidParams(format!(
                        "malformed request: {m}"
                    )))),
                );
                return;
            }
            Err(_) => return,
        };
        let ok = match req {
            XferRequest::Hello { token: got } => {
                authed = match (token, got.as_deref()) {
                    (None, _) => true,
                    (Some(w), Some(g)) => {
                        w.len() == g.len()
                            && w.bytes().zip(g.bytes()).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0
                    }
                    (Some(_), None) => false,
                };
                let r = if authed {
                    Ok(())
                } else {
                    Err(L3Error::IllegalClient("bad token".into()))
                };
                if authed {
                    // Authenticated: no longer pending, and reads may block (an
                    // authenticated client between calls is idle by design).
                    hello.release();
                    if sock.set_read_timeout(None).is_err() {
                        return;
                    }
                }
                write_frame(&mut sock, &XferReply::Hello(r)).is_ok() && authed
            }
            _ if !authed => {
                let _ = write_frame(
                    &mut sock,
                    &XferReply::Get(Err(L3Error::IllegalClient("hello first".into()))),
                );
                false
            }
            req => store.handle(&mut sock, req),
        };
        if !ok {
            return;
        }
    }
}

impl XferHandler for EmbeddedStore {
    fn handle(&self, sock: &mut TcpStream, req: XferRequest) -> bool {
        let store = self;
        match req {
            XferRequest::Exist { tenant, opts, keys } => {
                let r = unpack_keys(&keys)
                    .and_then(|ks| store.exist_many(&tenant, &ks, opts))
                    .map(|v| {
                        ByteBuf::from(
                            v.into_iter()
                                .map(|x| match x {
                                    Ok(false) => 0u8,
                                    Ok(true) => 1,
                                    Err(_) => 2,
                                })
                                .collect::<Vec<u8>>(),
                        )
                    });
                write_frame(sock, &XferReply::Exist(r)).is_ok()
            }
            XferRequest::Get { tenant, keys, caps } => {
                let blobs = unpack_keys(&keys).and_then(|ks| {
                    if ks.len() != caps.len() {
                        return Err(L3Error::InvalidParams(
                            "keys and capacities differ in length".into(),
                        ));
                    }
                    store.batch_get_blobs(&tenant, &ks)
                });
                send_blobs(sock, blobs, &caps).is_ok()
            }
            XferRequest::GetWithQuery {
                tenant,
                queries,
                caps,
            } => {
                let blobs = if queries.len() != caps.len() {
                    Err(L3Error::InvalidParams(
                        "queries and capacities differ in length".into(),
                    ))
                } else {
                    store.batch_get_with_query_blobs(&tenant, &queries)
                };
                send_blobs(sock, blobs, &caps).is_ok()
            }
            other => refuse(
                sock,
                &other,
                "not a store node (node requests go to `kvtier-l3 --role node`)",
            ),
        }
    }
}
