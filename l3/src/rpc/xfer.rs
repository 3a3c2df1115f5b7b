//! The transfer channel: a lean framed TCP protocol for the two hot paths, bulk reads
//! (`batch_get_into`, `batch_get_with_query`) and batched existence probes.
//!
//! Why a second channel beside tarpc: Mooncake itself splits control (RPC) from data (its
//! transfer engine). Through tarpc + bincode a 1 MiB object is copied about six times
//! (into a reply vector, into the bincode frame, into the codec buffer, kernel, the
//! client's frame buffer, a deserialised vector, the caller's buffer) and every call hops
//! across several tasks; that caps loopback reads near 1 GB/s and a 1,024-key probe near
//! 300 µs. Here the server writes DRAM replicas straight from their shared buffers to the
//! socket and the client reads them straight into the caller's buffers — two copies, as in
//! iperf3 — and each connection is served by one blocking thread, so a call is one write
//! and one read on each side.
//!
//! Protocol: every message is `u32 little-endian length` + a bincode 1.3 body
//! ([`XferRequest`] / [`XferReply`]). A `Get` reply is followed by the raw bytes of every
//! key whose result is `Ok(len)`, in key order. Keys travel packed (`u16 len` + bytes) in one
//! byte string, so neither side allocates a string per key. The first request of a
//! connection must be `Hello` (with the shared-secret token when the server has one).
//! Limits (frame size, keys per batch, the caller's buffer sizes) give typed errors; a
//! frame over the limit or one that does not decode gets an error reply and the connection
//! is closed, while the listener keeps serving.
//!
//! The same framing is the data channel of a store node (`kvtier-l3 --role node`): `NodePut`
//! writes (and ends) puts whose allocations the master placed on the node, `NodeRead` reads
//! replicas named by the master's descriptors. What a connection serves is an
//! [`XferHandler`]: the embedded store (bulk reads, probes) or a store node.

use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::error::{L3Error, L3Result};
use crate::store::EmbeddedStore;
use crate::types::{
    Blob, ExistOptions, PutHandle, PutOptions, QueryResult, ReplicaDescriptor, Tenant,
};

/// Most concurrent transfer connections a server accepts.
pub const MAX_CONNECTIONS: usize = 64;
/// Most connections that have not said a valid hello yet. Beyond it new connections are
/// closed at once, so unauthenticated peers can hold at most this many threads, each for
/// at most [`HELLO_TIMEOUT`]; a client refused here uses the RPC path instead.
pub const MAX_PENDING_HELLOS: usize = 8;
/// How long a new connection may take to send its hello.
pub const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Requests.
#[derive(Debug, Serialize, Deserialize)]
pub enum XferRequest {
    /// Authenticate the connection.
    Hello {
        /// Shared-secret token.
        token: Option<String>,
    },
    /// Batched existence probe.
    Exist {
        /// Tenant.
        tenant: Tenant,
        /// Options (promotion).
        opts: ExistOptions,
        /// Packed keys.
        keys: ByteBuf,
    },
    /// Batched read.
    Get {
        /// Tenant.
        tenant: Tenant,
        /// Packed keys.
        keys: ByteBuf,
        /// Size of the caller's buffer for each key.
        caps: Vec<u64>,
    },
    /// Batched read reusing query results (leases checked per key, -707).
    GetWithQuery {
        /// Tenant.
        tenant: Tenant,
        /// Query results from `BatchQuery`.
        queries: Vec<QueryResult>,
        /// Size of the caller's buffer for each key.
        caps: Vec<u64>,
    },
    /// Store node: write the bytes of placed puts (when `data` is not empty, one per handle)
    /// and, with `end`, end them (the node then tells the master and offloads to its SSD).
    NodePut {
        /// Handles from the master's `PutStart`.
        handles: Vec<PutHandle>,
        /// Bytes, one per handle, or none (end only).
        data: Vec<ByteBuf>,
        /// End the puts with these options.
        end: Option<PutOptions>,
    },
    /// Store node: read replicas named by the master's descriptors.
    NodeRead {
        /// Tenant.
        tenant: Tenant,
        /// Keys.
        keys: Vec<String>,
        /// One descriptor per key.
        replicas: Vec<ReplicaDescriptor>,
        /// Size of the caller's buffer for each key.
        caps: Vec<u64>,
    },
    /// Store node: wait until queued SSD writes are durable and registered.
    NodeFlush,
}

/// Replies.
#[derive(Debug, Serialize, Deserialize)]
pub enum XferReply {
    /// Hello accepted or refused.
    Hello(L3Result<()>),
    /// One byte per key: 0 absent, 1 present, 2 invalid key.
    Exist(L3Result<ByteBuf>),
    /// Per-key sizes; raw bytes of the `Ok` ones follow.
    Get(L3Result<Vec<L3Result<u64>>>),
    /// Per-item outcome (`NodePut`, `NodeFlush`).
    Batch(L3Result<Vec<L3Result<()>>>),
}

/// What a transfer connection serves once authenticated: one request, written reply.
/// Returns false to close the connection.
pub trait XferHandler: Send + Sync + 'static {
    /// Serves `req` on `sock`.
    fn handle(&self, sock: &mut TcpStream, req: XferRequest) -> bool;
}

/// Replies to a request this handler does not serve with a typed error (-1010) of the
/// reply kind the request expects.
pub fn refuse(sock: &mut TcpStream, req: &XferRequest, why: &str) -> bool {
    let e = L3Error::Unavailable(why.to_string());
    let reply = match req {
        XferRequest::Exist { .. } => XferReply::Exist(Err(e)),
        XferRequest::NodePut { .. } | XferRequest::NodeFlush => XferReply::Batch(Err(e)),
        _ => XferReply::Get(Err(e)),
    };
    write_frame(sock, &reply).is_ok()
}

/// Packs keys as `u16 len` + bytes.
pub fn pack_keys<K: AsRef<str>>(keys: &[K]) -> L3Result<Vec<u8>> {
    let total: usize = keys.iter().map(|k| k.as_ref().len() + 2).sum();
    let mut out = Vec::with_capacity(total);
    for k in keys {
        let k = k.as_ref().as_bytes();
        let len = u16::try_from(k.len())
            .map_err(|_| L3Error::InvalidKey("key longer than 65535 bytes".into()))?;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(k);
    }
    Ok(out)
}

/// Unpacks keys without copying them.
pub fn unpack_keys(buf: &[u8]) -> L3Result<Vec<&str>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < buf.len() {
        if i + 2 > buf.len() {
            return Err(L3Error::InvalidParams("truncated key list".into()));
        }
        let len = u16::from_le_bytes([buf[i], buf[i + 1]]) as usize;
        i += 2;
        let end = i + len;
        if end > buf.len() {
            return Err(L3Error::InvalidParams("truncated key list".into()));
        }
        let k = std::str::from_utf8(&buf[i..end])
            .map_err(|_| L3Error::InvalidKey("key is not UTF-8".into()))?;
        out.push(k);
        i = end;
    }
    Ok(out)
}

/// Writes one frame.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> io::Result<()> {
    let body = bincode::serialize(msg).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)
}

/// Why a frame could not be read.
#[derive(Debug)]
pub enum FrameError {
    /// Clean EOF before a frame started.
    Closed,
    /// I/O failure.
    Io(io::Error),
    /// Announced length over the limit.
    TooLarge(u64),
    /// Body does not decode.
    Malformed(String),
}

/// Reads one frame of at most `max` bytes.
pub fn read_frame<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
    max: usize,
) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(FrameError::Io(e)),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(FrameError::TooLarge(len as u64));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(FrameError::Io)?;
    bincode::deserialize(&body).map_err(|e| FrameError::Malformed(e.to_string()))
}

fn write_all_vectored(w: &mut TcpStream, parts: &[&[u8]]) -> io::Result<()> {
    // Up to 64 slices per writev; partial writes resume inside the current slice.
    let mut idx = 0;
    let mut off = 0;
    while idx < parts.len() {
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(64);
        slices.push(IoSlice::new(&parts[idx][off..]));
        for p in parts.iter().skip(idx + 1).take(63) {
            slices.push(IoSlice::new(p));
        }
        let mut n = w.write_vectored(&slices)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 && idx < parts.len() {
            let left = parts[idx].len() - off;
            if n >= left {
                n -= left;
                idx += 1;
                off = 0;
            } else {
                off += n;
                n = 0;
            }
        }
        while idx < parts.len() && parts[idx].len() == off {
            idx += 1;
            off = 0;
        }
    }
    Ok(())
}

// ---- server ----------------------------------------------------------------------------------

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

/// Writes a `Get` reply: per-key sizes (checked against `caps`), then the raw bytes.
pub fn send_blobs(
    sock: &mut TcpStream,
    blobs: L3Result<Vec<L3Result<Blob>>>,
    caps: &[u64],
) -> io::Result<()> {
    let blobs = match blobs {
        Ok(b) => b,
        Err(e) => return write_frame(sock, &XferReply::Get(Err(e))),
    };
    let mut sizes = Vec::with_capacity(blobs.len());
    let mut parts: Vec<&[u8]> = Vec::with_capacity(blobs.len() + 1);
    for (b, cap) in blobs.iter().zip(caps) {
        sizes.push(match b {
            Ok(b) if b.len() as u64 > *cap => Err(L3Error::BufferOverflow {
                needed: b.len() as u64,
                have: *cap,
            }),
            Ok(b) => Ok(b.len() as u64),
            Err(e) => Err(e.clone()),
        });
    }
    let body = bincode::serialize(&XferReply::Get(Ok(sizes.clone()))).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    let mut head = Vec::with_capacity(4 + body.len());
    head.extend_from_slice(&len.to_le_bytes());
    head.extend_from_slice(&body);
    parts.push(&head);
    for (b, s) in blobs.iter().zip(&sizes) {
        if let (Ok(b), Ok(_)) = (b, s) {
            parts.push(b.as_slice());
        }
    }
    write_all_vectored(sock, &parts)
}

// ---- client ----------------------------------------------------------------------------------

/// One client connection on the transfer channel.
pub struct XferClient {
    sock: TcpStream,
    max_frame: usize,
}

fn io_err(e: io::Error) -> L3Error {
    L3Error::RpcFail(format!("transfer channel: {e}"))
}

fn frame_err(e: FrameError) -> L3Error {
    match e {
        FrameError::Closed => L3Error::RpcFail("transfer channel closed".into()),
        FrameError::Io(e) => io_err(e),
        FrameError::TooLarge(n) => {
            L3Error::RpcFail(format!("reply frame of {n} bytes over the limit"))
        }
        FrameError::Malformed(m) => L3Error::RpcFail(format!("malformed reply: {m}")),
    }
}

impl XferClient {
    /// Connects and says hello.
    pub fn connect(addr: SocketAddr, token: Option<String>, max_frame: usize) -> L3Result<Self> {
        let sock = TcpStream::connect(addr).map_err(io_err)?;
        let _ = sock.set_nodelay(true);
        let mut c = XferClient { sock, max_frame };
        write_frame(&mut c.sock, &XferRequest::Hello { token }).map_err(io_err)?;
        match read_frame(&mut c.sock, c.max_frame).map_err(frame_err)? {
            XferReply::Hello(r) => r?,
            XferReply::Get(Err(e)) | XferReply::Exist(Err(e)) => return Err(e),
            _ => return Err(L3Error::RpcFail("unexpected reply".into())),
        }
        Ok(c)
    }

    fn check_request(&self, approx: usize) -> L3Result<()> {
        if approx > self.max_frame {
            return Err(L3Error::InvalidParams(format!(
                "request of about {approx} bytes exceeds the {}-byte frame limit",
                self.max_frame
            )));
        }
        Ok(())
    }

    /// Batched existence probe.
    pub fn exist(
        &mut self,
        tenant: &Tenant,
        keys: &[String],
        opts: ExistOptions,
    ) -> L3Result<Vec<L3Result<bool>>> {
        let packed = pack_keys(keys)?;
        self.check_request(packed.len() + 512)?;
        let req = XferRequest::Exist {
            tenant: tenant.clone(),
            opts,
            keys: ByteBuf::from(packed),
        };
        write_frame(&mut self.sock, &req).map_err(io_err)?;
        match read_frame(&mut self.sock, self.max_frame).map_err(frame_err)? {
            XferReply::Exist(r) => {
                let flags = r?;
                if flags.len() != keys.len() {
                    return Err(L3Error::RpcFail("reply length mismatch".into()));
                }
                Ok(flags
                    .iter()
                    .map(|f| match f {
                        0 => Ok(false),
                        1 => Ok(true),
                        _ => Err(L3Error::InvalidKey("invalid key".into())),
                    })
                    .collect())
            }
            XferReply::Get(Err(e)) => Err(e),
            _ => Err(L3Error::RpcFail("unexpected reply".into())),
        }
    }

    /// Batched read straight into the caller's buffers.
    pub fn get(
        &mut self,
        tenant: &Tenant,
        keys: &[String],
        queries: Option<&[QueryResult]>,
        bufs: &mut [&mut [u8]],
    ) -> L3Result<Vec<L3Result<u64>>> {
        let caps: Vec<u64> = bufs.iter().map(|b| b.len() as u64).collect();
        let req = match queries {
            Some(q) => XferRequest::GetWithQuery {
                tenant: tenant.clone(),
                queries: q.to_vec(),
                caps,
            },
            None => XferRequest::Get {
                tenant: tenant.clone(),
                keys: ByteBuf::from(pack_keys(keys)?),
                caps,
            },
        };
        let approx = keys.iter().map(|k| k.len() + 96).sum::<usize>() + 512;
        self.check_request(approx)?;
        write_frame(&mut self.sock, &req).map_err(io_err)?;
        self.read_blobs(bufs)
    }

    /// Store node: reads the replicas named by `replicas` into `bufs`.
    pub fn node_read(
        &mut self,
        tenant: &Tenant,
        keys: &[String],
        replicas: &[ReplicaDescriptor],
        bufs: &mut [&mut [u8]],
    ) -> L3Result<Vec<L3Result<u64>>> {
        let approx = keys.iter().map(|k| k.len() + 160).sum::<usize>() + 512;
        self.check_request(approx)?;
        let req = XferRequest::NodeRead {
            tenant: tenant.clone(),
            keys: keys.to_vec(),
            replicas: replicas.to_vec(),
            caps: bufs.iter().map(|b| b.len() as u64).collect(),
        };
        write_frame(&mut self.sock, &req).map_err(io_err)?;
        self.read_blobs(bufs)
    }

    /// Store node: writes and/or ends puts (see [`XferRequest::NodePut`]).
    pub fn node_put(
        &mut self,
        handles: &[PutHandle],
        data: &[&[u8]],
        end: Option<PutOptions>,
    ) -> L3Result<Vec<L3Result<()>>> {
        let approx = handles.iter().map(|h| h.key.len() + 256).sum::<usize>()
            + data.iter().map(|d| d.len() + 8).sum::<usize>()
            + 512;
        self.check_request(approx)?;
        let req = XferRequest::NodePut {
            handles: handles.to_vec(),
            data: data.iter().map(|d| ByteBuf::from(d.to_vec())).collect(),
            end,
        };
        write_frame(&mut self.sock, &req).map_err(io_err)?;
        match read_frame(&mut self.sock, self.max_frame).map_err(frame_err)? {
            XferReply::Batch(r) => {
                let v = r?;
                if v.len() != handles.len() {
                    return Err(L3Error::RpcFail("reply length mismatch".into()));
                }
                Ok(v)
            }
            XferReply::Get(Err(e)) | XferReply::Exist(Err(e)) => Err(e),
            _ => Err(L3Error::RpcFail("unexpected reply".into())),
        }
    }

    /// Store node: waits for its queued SSD writes.
    pub fn node_flush(&mut self) -> L3Result<()> {
        write_frame(&mut self.sock, &XferRequest::NodeFlush).map_err(io_err)?;
        match read_frame(&mut self.sock, self.max_frame).map_err(frame_err)? {
            XferReply::Batch(r) => r.map(|_| ()),
            XferReply::Get(Err(e)) | XferReply::Exist(Err(e)) => Err(e),
            _ => Err(L3Error::RpcFail("unexpected reply".into())),
        }
    }

    fn read_blobs(&mut self, bufs: &mut [&mut [u8]]) -> L3Result<Vec<L3Result<u64>>> {
        let sizes = match read_frame(&mut self.sock, self.max_frame).map_err(frame_err)? {
            XferReply::Get(r) => r?,
            _ => return Err(L3Error::RpcFail("unexpected reply".into())),
        };
        if sizes.len() != bufs.len() {
            return Err(L3Error::RpcFail("reply length mismatch".into()));
        }
        for (s, buf) in sizes.iter().zip(bufs.iter_mut()) {
            if let Ok(n) = s {
                let n = *n as usize;
                if n > buf.len() {
                    return Err(L3Error::RpcFail(
                        "server sent more than the buffer holds".into(),
                    ));
                }
                self.sock.read_exact(&mut buf[..n]).map_err(io_err)?;
            }
        }
        Ok(sizes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_roundtrip_and_reject_truncation() {
        let ks = vec!["a".to_string(), String::new(), "ñ-key".to_string()];
        let p = pack_keys(&ks).unwrap();
        assert_eq!(unpack_keys(&p).unwrap(), vec!["a", "", "ñ-key"]);
        assert!(unpack_keys(&p[..p.len() - 1]).is_err());
        assert!(unpack_keys(&[5, 0, b'a']).is_err());
        assert!(unpack_keys(&[2, 0, 0xFF, 0xFE]).is_err());
    }
}
