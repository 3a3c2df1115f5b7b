//! The shared-memory listener: a Unix socket beside the RPC port, one blocking thread per
//! connection (the accept loop and limits of the transfer channel), each connection with
//! its own table of mapped segments.
//!
//! Why per connection: a segment id means something only on the connection that
//! registered it, so no request can name another client's memory, and everything a client
//! registered is unmapped when its connection ends (a killed client's socket closes).
//! Every range of a request is checked against that table ([`SegTable`]) before the store
//! is called; one bad range fails the whole call and nothing is read or written. What the
//! data requests do is the [`ShmHandler`]'s: the embedded store's is here, a store node's
//! in `cluster/node/shm.rs`.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::error::{L3Error, L3Result};
use crate::rpc::accept::{
    HELLO_TIMEOUT, Pending, ServeConn, TokenDigest, read_request, spawn_acceptor, token_ok,
};
use crate::rpc::xfer::write_frame;
use crate::store::{EmbeddedStore, Filler};
use crate::types::Blob;

use super::inplace::{serve_get, serve_probe, serve_put};
use super::peer::{ConnWatch, Peer};
use super::segment::{Mapping, Received, boot_id, random16, recv_fd};
use super::{ShmHandler, ShmOffer, ShmRange, ShmReply, ShmRequest, check_range, refuse};

/// Most segments one connection may register (a client needs its staging segment plus a
/// few registered pools).
pub const MAX_SEGMENTS_PER_CONN: usize = 64;
/// Most bytes one connection may have mapped (256 GiB of address space; memory is only used
/// as the client touches it, and is charged to the client's memfds): with at most
/// `MAX_CONNECTIONS` connections, clients cannot exhaust the server's address space.
pub const MAX_MAPPED_PER_CONN: u64 = 256 << 30;

/// A running shared-memory listener; the socket file is removed when it stops.
pub struct ShmServer {
    /// What clients are told (`shm_offer`).
    pub offer: ShmOffer,
    path: PathBuf,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl ShmServer {
    /// Binds a socket with an unguessable name in `dir` and serves `store` (the embedded
    /// store or a store node). Unavailable (-1010) where the host's boot id cannot be read
    /// (clients could not tell they share the host).
    pub fn start(
        store: Arc<dyn ShmHandler>,
        dir: &Path,
        token: Option<TokenDigest>,
        max_frame: usize,
    ) -> L3Result<Self> {
        let boot_id =
            boot_id().ok_or_else(|| L3Error::Unavailable("no boot id on this host".into()))?;
        let nonce = random16()?;
        remove_stale(dir);
        let path = dir.join(format!(
            "kvtier-l3-{}-{}.sock",
            std::process::id(),
            hex(&nonce[..8])
        ));
        let l = UnixListener::bind(&path)
            .map_err(|e| L3Error::Unavailable(format!("bind {}: {e}", path.display())))?;
        // Any local user holding the token may connect, as on the TCP port.
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666));
        let offer = ShmOffer {
            path: path.to_string_lossy().into_owned(),
            boot_id,
            nonce,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let serve: ServeConn<UnixStream> = Arc::new(move |sock, hello| {
            let mut c = ShmConn {
                store: &*store,
                segs: SegTable::default(),
            };
            c.serve(sock, token.as_ref(), max_frame, nonce, &st, hello);
        });
        let accept = spawn_acceptor(
            "kvtier-l3-shm",
            move || l.accept().map(|(s, _)| s),
            stop.clone(),
            serve,
        )?;
        Ok(ShmServer {
            offer,
            path,
            stop,
            accept: Some(accept),
        })
    }

    /// Stops accepting and removes the socket file (open connections end with their next
    /// request or when their client goes).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = UnixStream::connect(&self.path);
        if let Some(h) = self.accept.take() {
            crate::error::join_logged("shared-memory accept loop", h);
        }
        // Left behind, the next server's start removes it (no process answers there).
        crate::error::best_effort("remove the socket file", std::fs::remove_file(&self.path));
    }
}

/// Removes sockets of servers that died without cleaning up (SIGKILL): files named like
/// ours, older than a minute (a server starting right now may not listen yet), whose
/// connect is refused (nobody listens). A live server's socket always accepts.
fn remove_stale(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with("kvtier-l3-") && name.ends_with(".sock")) {
            continue;
        }
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > std::time::Duration::from_secs(60));
        if old && nobody_listens(&e.path()) {
            crate::error::best_effort(
                "remove a dead server's socket",
                std::fs::remove_file(e.path()),
            );
        }
    }
}

/// Whether no server listens on the socket at `path` (a dead server's leftover): the
/// connection is refused. The probe does not block: a live server whose backlog is full (it is
/// stopped, say, with clients queued) answers `EAGAIN` at once, where a blocking `connect`
/// waited for room, and the new server's start with it, as long as the old one stayed stopped.
fn nobody_listens(path: &Path) -> bool {
    let probe = || -> std::io::Result<()> {
        let s = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
        s.set_nonblocking(true)?;
        s.connect(&socket2::SockAddr::unix(path)?)
    };
    matches!(probe(), Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused)
}

impl Drop for ShmServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One connection: its segments, dropped (unmapped) with it.
struct ShmConn<'a> {
    store: &'a dyn ShmHandler,
    segs: SegTable,
}

/// A connection's registered segments by id; ids mean nothing on another connection.
pub struct SegTable {
    segs: HashMap<u32, Mapping>,
    next: u32,
    /// The client process, once the in-place probe passed (see `inplace`).
    peer: Option<Peer>,
    /// The client, watched for giving up on a call ([`SegTable::client_gave_up`]).
    watch: Option<ConnWatch>,
}

impl Default for SegTable {
    fn default() -> Self {
        SegTable {
            segs: HashMap::new(),
            next: 1,
            peer: None,
            watch: None,
        }
    }
}

impl ShmConn<'_> {
    fn serve(
        &mut self,
        mut sock: UnixStream,
        token: Option<&TokenDigest>,
        max_frame: usize,
        nonce: [u8; 16],
        stop: &AtomicBool,
        hello: &mut Pending<'_>,
    ) {
        // Until it authenticates, the peer has HELLO_TIMEOUT from now however it sends, and
        // frames of PRE_AUTH_MAX_FRAME (as on the transfer channel).
        let hello_by = Instant::now() + HELLO_TIMEOUT;
        if sock.set_write_timeout(Some(HELLO_TIMEOUT)).is_err() {
            return;
        }
        let mut authed = false;
        while !stop.load(Ordering::Acquire) {
            let req: ShmRequest = match read_request(&mut sock, authed, hello_by, max_frame) {
                Ok(r) => r,
                Err(Some(e)) => {
                    let _ = write_frame(&mut sock, &ShmReply::Done(Err(e)));
                    return;
                }
                Err(None) => return,
            };
            // Stopped while this thread waited for the request: not served.
            if stop.load(Ordering::Acquire) {
                return;
            }
            let reply = match req {
                ShmRequest::Hello { token: got } => {
                    authed = token_ok(token, got.as_deref());
                    if !authed {
                        let e = L3Error::IllegalClient("bad token".into());
                        let _ = write_frame(&mut sock, &ShmReply::Hello(Err(e)));
                        return;
                    }
                    hello.release();
                    self.segs.watch = ConnWatch::of(&sock);
                    if sock.set_read_timeout(None).is_err() || sock.set_write_timeout(None).is_err()
                    {
                        return;
                    }
                    ShmReply::Hello(Ok(nonce))
                }
                _ if !authed => {
                    let e = L3Error::IllegalClient("hello first".into());
                    let _ = write_frame(&mut sock, &ShmReply::Done(Err(e)));
                    return;
                }
                ShmRequest::Register { len } => match recv_fd(&sock) {
                    Ok(Received::One(fd)) => ShmReply::Registered(self.segs.register(fd, len)),
                    Ok(Received::Bad(why)) => {
                        ShmReply::Registered(Err(L3Error::InvalidParams(why)))
                    }
                    Ok(Received::Closed) | Err(_) => return,
                },
                ShmRequest::Unregister { seg } => ShmReply::Done(
                    self.segs
                        .segs
                        .remove(&seg)
                        .map(drop)
                        .ok_or(L3Error::SegmentNotFound),
                ),
                ShmRequest::Probe { addr, nonce, back } => {
                    self.segs.peer = None;
                    ShmReply::Done(
                        serve_probe(&sock, addr, nonce, back).map(|p| self.segs.peer = Some(p)),
                    )
                }
                req => self.store.handle(req, &self.segs),
            };
            if write_frame(&mut sock, &reply).is_err() {
                return;
            }
        }
    }
}

impl ShmHandler for EmbeddedStore {
    fn handle(&self, req: ShmRequest, segs: &SegTable) -> ShmReply {
        match req {
            ShmRequest::PutAt {
                tenant,
                keys,
                bufs,
                opts,
                cfg,
            } => ShmReply::Put(serve_put(
                self,
                segs.peer.as_ref(),
                &|| segs.client_gave_up(),
                &tenant,
                &keys,
                &bufs,
                opts,
                cfg,
            )),
            ShmRequest::GetAt {
                tenant,
                keys,
                queries,
                bufs,
            } => ShmReply::Get(serve_get(
                self,
                segs.peer.as_ref(),
                &|| segs.client_gave_up(),
                &tenant,
                &keys,
                queries.as_deref(),
                &bufs,
            )),
            ShmRequest::Put {
                tenant,
                keys,
                ranges,
                opts,
                cfg,
            } => ShmReply::Put(segs.sources(&ranges, keys.len()).and_then(|bufs| {
                let sizes: Vec<u64> = bufs.iter().map(|b| b.len() as u64).collect();
                let mut f = FromSegments { bufs, segs };
                self.batch_put_filled(&tenant, &keys, &sizes, &mut f, opts, cfg)
            })),
            ShmRequest::Get {
                tenant,
                keys,
                queries,
                ranges,
            } => {
                let n = queries.as_ref().map_or(keys.len(), Vec::len);
                ShmReply::Get(segs.resolve(&ranges, n).and_then(|rs| {
                    let blobs = match &queries {
                        Some(q) => self.batch_get_with_query_blobs(&tenant, q)?,
                        None => self.batch_get_blobs(&tenant, &keys)?,
                    };
                    Ok(blobs
                        .into_iter()
                        .zip(rs)
                        .map(|(b, (m, r))| b.and_then(|b| copy_out(&b, m, r, segs)))
                        .collect())
                }))
            }
            other => refuse(
                &other,
                "a store node's request: this server holds its own data",
            ),
        }
    }
}

/// A put's bytes from the connection's segments, each key checked after its copy: if the
/// client gave up on the call by then ([`SegTable::client_gave_up`]) the key is revoked, as
/// its memory may hold the caller's next bytes (`tests/shm_reconnect.rs`).
struct FromSegments<'a> {
    bufs: Vec<&'a [u8]>,
    segs: &'a SegTable,
}

// SAFETY: an Ok fill copied `bufs[i]`, of `dst.len()` bytes (the sizes given), into `dst`.
unsafe impl Filler for FromSegments<'_> {
    fn fill(&mut self, i: usize, dst: &mut [std::mem::MaybeUninit<u8>]) -> L3Result<()> {
        let src = self.bufs.get(i).copied().unwrap_or_default();
        if src.len() != dst.len() {
            return Err(L3Error::Internal("a put's source and buffer differ".into()));
        }
        // SAFETY: `src` and `dst` are valid for `dst.len()` bytes and do not overlap (the
        // store's buffer, a segment's mapping).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), dst.len())
        };
        if self.segs.client_gave_up() {
            return Err(gave_up());
        }
        Ok(())
    }
}

/// Why a get whose client gave up on the call writes nothing into the caller's memory.
pub(super) fn gave_up_read() -> L3Error {
    L3Error::RpcFail("the client gave up on this call: its memory is not written".into())
}

/// Why a put whose client gave up on the call is not stored.
pub(crate) fn gave_up() -> L3Error {
    L3Error::RpcFail(
        "the client gave up on this call before its bytes were read: not stored".into(),
    )
}

impl SegTable {
    /// The client closed this connection while its process lives: it gave up on the call
    /// being served (timed out), and memory the call named is the caller's again.
    pub fn client_gave_up(&self) -> bool {
        self.watch.as_ref().is_some_and(ConnWatch::gave_up)
    }

    fn register(&mut self, fd: std::os::fd::OwnedFd, len: u64) -> L3Result<u32> {
        if self.segs.len() >= MAX_SEGMENTS_PER_CONN {
            return Err(L3Error::InvalidParams(format!(
                "at most {MAX_SEGMENTS_PER_CONN} segments per connection"
            )));
        }
        let mapped: u64 = self.segs.values().map(|m| m.len() as u64).sum();
        if mapped.saturating_add(len) > MAX_MAPPED_PER_CONN {
            return Err(L3Error::InvalidParams(format!(
                "at most {MAX_MAPPED_PER_CONN} bytes mapped per connection"
            )));
        }
        let m = Mapping::adopt(fd, len)?;
        let id = self.next;
        self.next = self.next.wrapping_add(1).max(1);
        self.segs.insert(id, m);
        Ok(id)
    }

    /// The bytes of `ranges` (one per key, `n` keys), each checked inside its segment.
    pub fn sources(&self, ranges: &[ShmRange], n: usize) -> L3Result<Vec<&[u8]>> {
        // SAFETY: every range was checked inside its mapping; callers only copy out of
        // these slices.
        Ok(self
            .resolve(ranges, n)?
            .iter()
            .map(|(m, r)| unsafe { m.bytes(r.start, r.len()) })
            .collect())
    }

    /// Checks `ranges` (one per key, `n` keys) against this connection's segments.
    pub fn resolve(
        &self,
        ranges: &[ShmRange],
        n: usize,
    ) -> L3Result<Vec<(&Mapping, std::ops::Range<usize>)>> {
        if ranges.len() != n {
            return Err(L3Error::InvalidParams(
                "keys and ranges differ in length".into(),
            ));
        }
        ranges
            .iter()
            .map(|r| {
                let m = self.segs.get(&r.seg).ok_or_else(|| {
                    L3Error::IllegalClient(format!(
                        "segment {} is not registered on this connection",
                        r.seg
                    ))
                })?;
                Ok((m, check_range(m.len() as u64, r.off, r.len)?))
            })
            .collect()
    }
}

/// Bytes copied into a client's memory between two checks that it has not given up on the
/// call ([`copy_out`], the in-place `GetAt`): what a server stopped in the middle of a copy
/// may still write into the caller's memory after the call returned.
pub(crate) const GIVE_UP_CHUNK: usize = 1 << 20;

/// Copies an object into a checked range of the connection's segments: its size, or -10
/// when the range is too small. Nothing is written once the client gave up on the call
/// ([`SegTable::client_gave_up`], checked before each [`GIVE_UP_CHUNK`] of the copy): the
/// range may be memory the caller has reused since (a region), and the late write would
/// corrupt it (`tests/shm_reconnect.rs`). A server stopped in the middle of a chunk still
/// writes the rest of that chunk when it resumes (`tests/shm_copy_giveup.rs`: before, the
/// rest of the object, 240 MB of 256 MB, over the caller's reused region).
pub fn copy_out(
    b: &Blob,
    m: &Mapping,
    r: std::ops::Range<usize>,
    segs: &SegTable,
) -> L3Result<u64> {
    let src = b.as_slice();
    if src.len() > r.len() {
        return Err(L3Error::BufferOverflow {
            needed: src.len() as u64,
            have: r.len() as u64,
        });
    }
    if segs.client_gave_up() {
        return Err(gave_up_read());
    }
    // SAFETY: `r` was checked inside the mapping; no other reference to it lives here.
    let dst = unsafe { m.bytes_mut(r.start, src.len()) };
    for (i, (d, s)) in dst
        .chunks_mut(GIVE_UP_CHUNK)
        .zip(src.chunks(GIVE_UP_CHUNK))
        .enumerate()
    {
        if i > 0 && segs.client_gave_up() {
            return Err(gave_up_read());
        }
        d.copy_from_slice(s);
    }
    Ok(src.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server whose socket's backlog is full (stopped, say, with clients queued on it):
    /// `remove_stale`'s blocking `connect` waited for room in that backlog, so a new server
    /// in the same directory hung at start for as long as the old one stayed stopped. The
    /// probe must answer at once, and keep the live server's socket.
    #[test]
    fn a_stale_looking_socket_with_a_full_backlog_does_not_stall_the_start() {
        let d = tempfile::tempdir().expect("tempdir");
        let path = d.path().join("kvtier-l3-busy.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        // fill its backlog: connects that are never accepted, until one would block
        let mut queued = Vec::new();
        loop {
            let s = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)
                .expect("socket");
            s.set_nonblocking(true).expect("nonblocking");
            match s.connect(&socket2::SockAddr::unix(&path).expect("addr")) {
                Ok(()) => queued.push(s),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling the backlog: {e}"),
            }
            assert!(queued.len() < 100_000, "the backlog never filled");
        }
        // older than the 60 s after which a socket is probed
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
        let t = libc::timespec {
            tv_sec: old
                .duration_since(std::time::UNIX_EPOCH)
                .expect("epoch")
                .as_secs() as libc::time_t,
            tv_nsec: 0,
        };
        // SAFETY: `c` is a NUL-terminated path, `times` two valid timespecs.
        let rc = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), [t, t].as_ptr(), 0) };
        assert_eq!(rc, 0, "utimensat");
        let (tx, rx) = std::sync::mpsc::channel();
        let dir = d.path().to_path_buf();
        std::thread::spawn(move || {
            remove_stale(&dir);
            tx.send(()).ok();
        });
        assert!(
            rx.recv_timeout(std::time::Duration::from_secs(5)).is_ok(),
            "remove_stale blocked on a live server's full backlog"
        );
        assert!(path.exists(), "a live server's socket was removed");
        drop((listener, queued));
    }
}
