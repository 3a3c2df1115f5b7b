//! The transfer listener: one blocking thread per connection, each a loop of one request
//! and one written reply, and the embedded store's [`XferHandler`] (bulk reads, probes).
//!
//! Why blocking threads: a call is then one read and one write on each side, with no task
//! hops; the connection limits below bound the threads.
//!
//! The first request of a connection must be `Hello` (with the shared-secret token when the
//! server has one), within `HELLO_TIMEOUT` of the accept and in a frame of at most
//! `PRE_AUTH_MAX_FRAME`. After it, a write that makes no progress for the write timeout
//! (`ServerOptions::xfer_write_timeout`, 60 s) drops the connection. Limits (frame size,
//! keys per batch, the caller's buffer sizes) give typed errors; a frame over the limit or
//! one that does not decode gets an error reply and the connection is closed, while the
//! listener keeps serving.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_bytes::ByteBuf;

use crate::error::{L3Error, L3Result};
use crate::store::EmbeddedStore;

use crate::rpc::accept::{
    HELLO_TIMEOUT, Pending, ServeConn, TokenDigest, read_request, spawn_acceptor, token_ok,
};

use super::frame::{send_blobs, unpack_keys, write_frame};
use super::{XferHandler, XferReply, XferRequest, refuse};

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
        token: Option<TokenDigest>,
        max_frame: usize,
        write_timeout: Duration,
    ) -> L3Result<Self> {
        if write_timeout.is_zero() {
            return Err(L3Error::InvalidParams(
                "the transfer channel's write timeout must be positive".into(),
            ));
        }
        let l = TcpListener::bind(addr)
            .map_err(|e| L3Error::Unavailable(format!("bind {addr}: {e}")))?;
        let bound = l
            .local_addr()
            .map_err(|e| L3Error::Internal(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let serve: ServeConn<TcpStream> = Arc::new(move |sock, hello| {
            let limits = ConnLimits {
                max_frame,
                write_timeout,
            };
            serve_conn(sock, &*store, token.as_ref(), limits, &st, hello)
        });
        let accept = spawn_acceptor(
            "kvtier-l3-xfer",
            move || l.accept().map(|(s, _)| s),
            stop.clone(),
            serve,
        )?;
        Ok(XferServer {
            addr: bound,
            stop,
            accept: Some(accept),
        })
    }

    /// Stops accepting; an open connection is closed at its next request, unserved.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect(self.addr);
        if let Some(h) = self.accept.take() {
            crate::error::join_logged("transfer channel accept loop", h);
        }
    }
}

impl Drop for XferServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What one connection may send and how long its writes may stall.
#[derive(Clone, Copy)]
struct ConnLimits {
    max_frame: usize,
    write_timeout: Duration,
}

fn serve_conn(
    mut sock: TcpStream,
    store: &dyn XferHandler,
    token: Option<&TokenDigest>,
    limits: ConnLimits,
    stop: &AtomicBool,
    hello: &mut Pending<'_>,
) {
    let max_frame = limits.max_frame;
    let _ = sock.set_nodelay(true);
    // Until it authenticates, the peer has HELLO_TIMEOUT from now, however it sends (a
    // per-read timeout alone would let it dribble a byte at a time for ever), and frames of
    // PRE_AUTH_MAX_FRAME: nothing larger is allocated for a peer without the token.
    let hello_by = Instant::now() + HELLO_TIMEOUT;
    if sock.set_write_timeout(Some(HELLO_TIMEOUT)).is_err() {
        return;
    }
    let mut authed = false;
    loop {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let req: XferRequest = match read_request(&mut sock, authed, hello_by, max_frame) {
            Ok(r) => r,
            Err(Some(e)) => {
                let _ = write_frame(&mut sock, &XferReply::Get(Err(e)));
                return;
            }
            Err(None) => return,
        };
        // Stopped while this thread waited for the request: not served (the client sees
        // the connection close, an error, never an answer from a stopped server).
        if stop.load(Ordering::Acquire) {
            return;
        }
        let ok = match req {
            XferRequest::Hello { token: got } => {
                authed = token_ok(token, got.as_deref());
                let r = if authed {
                    Ok(())
                } else {
                    Err(L3Error::IllegalClient("bad token".into()))
                };
                if authed {
                    // Authenticated: no longer pending, and reads may block (an
                    // authenticated client between calls is idle by design); a write
                    // that stalls for the write timeout (a peer that does not read its
                    // reply) fails, and the connection goes with the reply's objects.
                    hello.release();
                    if sock.set_read_timeout(None).is_err()
                        || sock.set_write_timeout(Some(limits.write_timeout)).is_err()
                    {
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
                let r = unpack_keys(&keys, store.config().max_batch_keys)
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
                let blobs = unpack_keys(&keys, store.config().max_batch_keys).and_then(|ks| {
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
