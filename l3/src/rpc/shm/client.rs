//! The client side of the shared-memory path: [`ShmClient`], held by a `RemoteStore` whose
//! server offered a socket on the same host.
//!
//! Why a staging segment: a caller's buffer that is not in memory the server mapped (a
//! Python `bytes`, a tensor) must be copied once into memory it did map; one memcpy there
//! plus one in the server beats the socket's kernel copies. Buffers inside a
//! [`SharedRegion`] this client handed out (a Mooncake dummy client's
//! `alloc_from_mem_pool`) are named in place, with no copy in the client at all. Where the
//! client asked for it (`ShmMode::InPlace`) and the probe at connect allowed it (`inplace`),
//! plain buffers skip the staging segment too: the server copies them itself, in place.
//!
//! Batches larger than half the staging segment go in several requests, alternating
//! between its halves and pipelined (the client copies one chunk while the server works on
//! the previous); a batch with one staged object larger than half the staging segment goes
//! over TCP (`UseTcp`), as does every call while the socket cannot be reached (tried again
//! after [`RETRY_AFTER`]). Regions outlive nothing: the client keeps only weak references,
//! and a region dropped by its owner is unregistered at the next call.

use std::os::unix::net::UnixStream;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::error::{L3Error, L3Result};
use crate::rpc::xfer::{FrameError, read_frame, write_frame};
use crate::types::{PutOptions, QueryResult, ReplicateConfig, Tenant};

use super::segment::{Mapping, boot_id, send_fd};
use super::{ShmMode, ShmOffer, ShmRange, ShmReply, ShmRequest, inplace};

/// Memory this client shares with its server: a sealed memfd mapped by both.
#[derive(Debug)]
pub struct SharedRegion {
    map: Mapping,
}

impl SharedRegion {
    /// A new region of `len` bytes, not yet registered with any server (see
    /// [`ShmClient::adopt`]).
    pub(crate) fn create(len: usize) -> L3Result<Arc<Self>> {
        Ok(Arc::new(SharedRegion {
            map: Mapping::create("kvtier-shm-region", len)?,
        }))
    }

    /// Start of the region (valid for [`Self::len`] bytes while the region lives).
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Never true.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// What a shared-memory call did.
#[derive(Debug)]
pub enum ShmOutcome<T> {
    /// Served (or failed) over shared memory.
    Done(L3Result<T>),
    /// Not for this path (socket unreachable, an object bigger than the staging segment):
    /// the caller uses TCP.
    UseTcp,
}

/// A live socket and the id of the staging segment on it.
struct Live {
    sock: UnixStream,
    staging_seg: u32,
    /// The server copies plain buffers in place (the probe passed; see `inplace`).
    in_place: bool,
}

/// Where one key's bytes are: in place in a region, or at an offset of the staging segment.
#[derive(Clone, Copy)]
enum Place {
    InPlace(ShmRange),
    Staged(usize),
}

/// Requests of a batch: per request, (index in the batch, place) of its keys.
type Plan = Vec<Vec<(usize, Place)>>;

/// A `RemoteStore`'s shared-memory path to its server.
pub struct ShmClient {
    offer: ShmOffer,
    token: Option<String>,
    pub(super) max_frame: usize,
    pub(super) max_keys: usize,
    staging_bytes: usize,
    mode: ShmMode,
    live: Option<Live>,
    staging: Option<Mapping>,
    /// Regions handed out, and their segment id on the live socket.
    regions: Vec<(Weak<SharedRegion>, Option<u32>)>,
    /// After a failed connect, calls use TCP without trying again until then.
    down_until: Option<Instant>,
    /// Bounds every read and write on the socket (the client's `rpc_timeout`): a paused
    /// server fails the call instead of blocking it.
    timeout: Duration,
}

/// How long calls stay on TCP after the socket could not be reached.
const RETRY_AFTER: Duration = Duration::from_secs(2);

fn io_fail(e: impl std::fmt::Display) -> L3Error {
    L3Error::RpcFail(format!("shared-memory channel: {e}"))
}

fn frame_fail(e: FrameError) -> L3Error {
    match e {
        FrameError::Io(e) => io_fail(e),
        FrameError::Closed => io_fail("closed"),
        FrameError::TooLarge(n) => io_fail(format!("reply of {n} bytes")),
        FrameError::Malformed(m) => io_fail(m),
    }
}

const ALIGN: usize = 64;

impl ShmClient {
    /// A client for `offer`, or None when the server runs under another kernel.
    pub fn new(
        offer: ShmOffer,
        token: Option<String>,
        max_frame: usize,
        max_keys: usize,
        staging_bytes: usize,
        timeout: Duration,
    ) -> Option<Self> {
        if boot_id().as_deref() != Some(offer.boot_id.as_str()) {
            return None;
        }
        Some(ShmClient {
            offer,
            token,
            max_frame,
            max_keys: max_keys.max(1),
            staging_bytes: staging_bytes.max(ALIGN),
            mode: ShmMode::Auto,
            live: None,
            staging: None,
            regions: Vec::new(),
            down_until: None,
            timeout,
        })
    }

    /// `InPlace`: ask for in-place copies of plain buffers (the other modes: stage them).
    pub fn with_mode(mut self, mode: ShmMode) -> Self {
        self.mode = mode;
        self
    }

    /// Whether plain buffers are copied in place by the server on the live connection.
    pub fn in_place(&self) -> bool {
        self.live.as_ref().is_some_and(|l| l.in_place)
    }

    /// The server restarted: a new offer (the old socket and its segments are gone).
    pub fn reoffer(&mut self, offer: ShmOffer) {
        if offer != self.offer {
            self.offer = offer;
            self.live = None;
            self.down_until = None;
        }
    }

    /// Whether the socket is connected now.
    pub fn is_live(&self) -> bool {
        self.live.is_some()
    }

    fn call(&mut self, req: &ShmRequest) -> L3Result<ShmReply> {
        self.send(req)?;
        self.recv()
    }

    /// Writes a request; a failure drops the connection (the stream is out of step).
    pub(super) fn send(&mut self, req: &ShmRequest) -> L3Result<()> {
        let live = self.live.as_mut().ok_or_else(|| io_fail("not connected"))?;
        let r = write_frame(&mut live.sock, req).map_err(io_fail);
        if r.is_err() {
            self.live = None;
        }
        r
    }

    /// Reads the next reply; a failure drops the connection.
    fn recv(&mut self) -> L3Result<ShmReply> {
        let live = self.live.as_mut().ok_or_else(|| io_fail("not connected"))?;
        let r = read_frame(&mut live.sock, self.max_frame).map_err(frame_fail);
        if r.is_err() {
            self.live = None;
        }
        r
    }

    /// Reads the reply to a `Put` of `n` keys. Any failure drops the connection: with
    /// requests pipelined, a reply may still be on its way.
    pub(super) fn recv_put(&mut self, n: usize) -> L3Result<Vec<L3Result<()>>> {
        let r = match self.recv()? {
            ShmReply::Put(Ok(v)) if v.len() == n => Ok(v),
            ShmReply::Put(Err(e)) | ShmReply::Done(Err(e)) => Err(e),
            _ => Err(io_fail("unexpected reply")),
        };
        if r.is_err() {
            self.live = None;
        }
        r
    }

    /// Reads the reply to a `Get` of `n` keys (as [`Self::recv_put`]).
    pub(super) fn recv_get(&mut self, n: usize) -> L3Result<Vec<L3Result<u64>>> {
        let r = match self.recv()? {
            ShmReply::Get(Ok(v)) if v.len() == n => Ok(v),
            ShmReply::Get(Err(e)) | ShmReply::Done(Err(e)) => Err(e),
            _ => Err(io_fail("unexpected reply")),
        };
        if r.is_err() {
            self.live = None;
        }
        r
    }

    fn register_on(sock: &mut UnixStream, map: &Mapping, max_frame: usize) -> L3Result<u32> {
        write_frame(
            sock,
            &ShmRequest::Register {
                len: map.len() as u64,
            },
        )
        .map_err(io_fail)?;
        send_fd(sock, map.fd()).map_err(io_fail)?;
        match read_frame(sock, max_frame).map_err(frame_fail)? {
            ShmReply::Registered(r) => r,
            ShmReply::Done(Err(e)) => Err(e),
            _ => Err(io_fail("unexpected reply")),
        }
    }

    /// Connects (when not connected), authenticates, checks the nonce, registers the
    /// staging segment and every live region again.
    pub fn connect(&mut self) -> L3Result<()> {
        if self.live.is_some() {
            return Ok(());
        }
        if self.down_until.is_some_and(|t| Instant::now() < t) {
            return Err(L3Error::Unavailable(
                "shared-memory socket unreachable".into(),
            ));
        }
        let r = self.dial();
        self.down_until = r.is_err().then(|| Instant::now() + RETRY_AFTER);
        r
    }

    fn dial(&mut self) -> L3Result<()> {
        let mut sock = UnixStream::connect(&self.offer.path)
            .map_err(|e| L3Error::Unavailable(format!("{}: {e}", self.offer.path)))?;
        sock.set_read_timeout(Some(self.timeout)).map_err(io_fail)?;
        sock.set_write_timeout(Some(self.timeout))
            .map_err(io_fail)?;
        write_frame(
            &mut sock,
            &ShmRequest::Hello {
                token: self.token.clone(),
            },
        )
        .map_err(io_fail)?;
        match read_frame(&mut sock, self.max_frame).map_err(frame_fail)? {
            ShmReply::Hello(Ok(n)) if n == self.offer.nonce => {}
            ShmReply::Hello(Ok(_)) => {
                return Err(L3Error::Unavailable(
                    "another server answers at the offered socket".into(),
                ));
            }
            ShmReply::Hello(Err(e)) | ShmReply::Done(Err(e)) => return Err(e),
            _ => return Err(io_fail("unexpected reply")),
        }
        // A fresh staging segment on every connection, never the last one's: a request of a
        // connection that ended (a call that timed out) may still be served, reading the
        // bytes it named from that segment or writing them there. Registered again here, the
        // old segment received this connection's bytes too, and a put that timed out was
        // stored late with the next call's bytes (`tests/shm_reconnect.rs`).
        self.staging = None;
        let staging = Mapping::create("kvtier-shm-staging", self.staging_bytes)?;
        let seg = Self::register_on(&mut sock, &staging, self.max_frame);
        self.staging = Some(staging);
        let staging_seg = seg?;
        let in_place = self.mode == ShmMode::InPlace && inplace::probe(&mut sock, self.max_frame)?;
        self.regions.retain(|(w, _)| w.strong_count() > 0);
        for (w, id) in &mut self.regions {
            *id = match w.upgrade() {
                Some(r) => Some(Self::register_on(&mut sock, &r.map, self.max_frame)?),
                None => None,
            };
        }
        self.live = Some(Live {
            sock,
            staging_seg,
            in_place,
        });
        Ok(())
    }

    /// Unregisters regions whose owners dropped them.
    pub(super) fn purge(&mut self) -> L3Result<()> {
        let dead: Vec<u32> = self
            .regions
            .iter()
            .filter(|(w, _)| w.strong_count() == 0)
            .filter_map(|(_, id)| *id)
            .collect();
        self.regions.retain(|(w, _)| w.strong_count() > 0);
        for seg in dead {
            if let ShmReply::Done(Err(e)) = self.call(&ShmRequest::Unregister { seg })? {
                tracing::debug!(error = %e, seg, "unregister");
            }
        }
        Ok(())
    }

    /// `len` bytes of memory shared with the server: buffers inside it move with no copy.
    pub fn alloc(&mut self, len: usize) -> L3Result<Arc<SharedRegion>> {
        self.connect()?;
        let r = SharedRegion::create(len)?;
        self.adopt(&r)?;
        Ok(r)
    }

    /// Shares `region` (made for another connection too: a split deployment's region is
    /// registered with every node on this host) with this server: registered now when the
    /// socket is live, else at the next connect. Until it is registered, buffers in it are
    /// staged like any other. An error drops the connection (it is out of step); the region
    /// is kept and registered again on reconnect.
    pub(crate) fn adopt(&mut self, region: &Arc<SharedRegion>) -> L3Result<()> {
        let mine = Arc::downgrade(region);
        if self.regions.iter().any(|(w, _)| w.ptr_eq(&mine)) {
            return Ok(()); // already shared here (or registered again at the next connect)
        }
        let seg = match self.live.as_mut() {
            Some(live) => {
                let seg = Self::register_on(&mut live.sock, &region.map, self.max_frame);
                if seg.is_err() {
                    self.live = None;
                }
                Some(seg)
            }
            None => None,
        };
        let id = seg.as_ref().and_then(|s| s.as_ref().ok().copied());
        self.regions.push((mine, id));
        seg.transpose().map(|_| ())
    }

    /// The in-place range of `[ptr, ptr + len)`, when it lies inside a live region.
    pub(super) fn locate(&self, ptr: *const u8, len: usize) -> Option<ShmRange> {
        self.regions.iter().find_map(|(w, id)| {
            let r = w.upgrade()?;
            let off = r.map.offset_of(ptr, len)?;
            Some(ShmRange {
                seg: (*id)?,
                off,
                len: len as u64,
            })
        })
    }

    /// Connects, drops dead regions and plans the batch; None: use TCP.
    fn prepare(&mut self, bufs: &[(*const u8, usize)], meta: &[usize]) -> Option<Plan> {
        self.connect().and_then(|()| self.purge()).ok()?;
        self.plan(bufs, meta)
    }

    /// Places each buffer (in place or staged) and splits the batch into requests that fit
    /// half the staging segment, the server's key limit and the frame limit; requests
    /// alternate between the two halves, so the client copies one while the server works on
    /// the other. None when a staged buffer alone exceeds half the staging segment.
    /// `meta[i]`: the request bytes item `i` takes besides its range (its key, handle…).
    fn plan(
        &self,
        bufs: &[(*const u8, usize)],
        meta: &[usize],
    ) -> Option<Vec<Vec<(usize, Place)>>> {
        let cap = self.staging_bytes / 2 / ALIGN * ALIGN;
        let mut out = Vec::new();
        let mut cur: Vec<(usize, Place)> = Vec::new();
        let (mut used, mut frame) = (0usize, 0usize);
        for (i, &(p, n)) in bufs.iter().enumerate() {
            let place = self.locate(p, n);
            let need = if place.is_some() { 0 } else { n };
            if need > cap {
                return None;
            }
            let fk = meta.get(i).copied().unwrap_or(0) + 96;
            let at = used.div_ceil(ALIGN) * ALIGN;
            if !cur.is_empty()
                && (at + need > cap
                    || cur.len() >= self.max_keys
                    || frame + fk > self.max_frame / 2)
            {
                out.push(std::mem::take(&mut cur));
                used = 0;
                frame = 0;
            }
            let at = used.div_ceil(ALIGN) * ALIGN;
            let base = (out.len() % 2) * cap;
            cur.push((i, place.map_or(Place::Staged(base + at), Place::InPlace)));
            if place.is_none() {
                used = at + n;
            }
            frame += fk;
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        Some(out)
    }

    fn range_of(&self, p: Place, len: usize) -> ShmRange {
        match p {
            Place::InPlace(r) => r,
            Place::Staged(at) => ShmRange {
                seg: self.live.as_ref().map_or(0, |l| l.staging_seg),
                off: at as u64,
                len: len as u64,
            },
        }
    }

    #[allow(clippy::mut_from_ref)]
    fn staging_mut(&self, at: usize, len: usize) -> L3Result<&mut [u8]> {
        let s = self.staging.as_ref().ok_or_else(|| io_fail("no staging"))?;
        if at + len > s.len() {
            return Err(L3Error::Internal("staging overrun".into()));
        }
        // SAFETY: in range (checked above); the staging segment is touched only by this
        // client, one call at a time (`&mut self` on every caller).
        Ok(unsafe { s.bytes_mut(at, len) })
    }

    /// Batched put from the caller's buffers: in place, staged, or named in a region.
    pub fn put(
        &mut self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &[&[u8]],
        opts: PutOptions,
        cfg: ReplicateConfig,
    ) -> ShmOutcome<Vec<L3Result<()>>> {
        let ptrs: Vec<(*const u8, usize)> = bufs.iter().map(|b| (b.as_ptr(), b.len())).collect();
        if self.takes_in_place(&ptrs) {
            return self.put_at(tenant, keys, bufs, opts, cfg);
        }
        let meta: Vec<usize> = keys.iter().map(String::len).collect();
        self.put_by(bufs, &meta, |idx, ranges| ShmRequest::Put {
            tenant: tenant.clone(),
            keys: idx.iter().map(|&i| keys[i].clone()).collect(),
            ranges,
            opts,
            cfg,
        })
    }

    /// A batched write of `bufs` (staged or in place, pipelined), each request built by
    /// `request(indices in the batch, their ranges)`: a `Put`, or a store node's `NodePut`.
    /// `meta` as in [`Self::plan`].
    pub(crate) fn put_by(
        &mut self,
        bufs: &[&[u8]],
        meta: &[usize],
        mut request: impl FnMut(&[usize], Vec<ShmRange>) -> ShmRequest,
    ) -> ShmOutcome<Vec<L3Result<()>>> {
        let ptrs: Vec<(*const u8, usize)> = bufs.iter().map(|b| (b.as_ptr(), b.len())).collect();
        let Some(plan) = self.prepare(&ptrs, meta) else {
            return ShmOutcome::UseTcp;
        };
        let mut out = Vec::with_capacity(bufs.len());
        // The reply to request k-1 is read after request k is sent: the client copies chunk
        // k into one half of the staging segment while the server reads chunk k-1 from the
        // other (chunk k+1 reuses chunk k-1's half only once that reply is in).
        let mut pending: Option<usize> = None;
        for chunk in &plan {
            let mut ranges = Vec::with_capacity(chunk.len());
            for &(i, p) in chunk {
                if let Place::Staged(at) = p {
                    match self.staging_mut(at, bufs[i].len()) {
                        Ok(dst) => dst.copy_from_slice(bufs[i]),
                        Err(e) => {
                            self.live = None; // a request may be outstanding
                            return ShmOutcome::Done(Err(e));
                        }
                    }
                }
                ranges.push(self.range_of(p, bufs[i].len()));
            }
            let idx: Vec<usize> = chunk.iter().map(|&(i, _)| i).collect();
            let req = request(&idx, ranges);
            if let Err(e) = self.send(&req) {
                return ShmOutcome::Done(Err(e));
            }
            if let Some(n) = pending.replace(chunk.len()) {
                match self.recv_put(n) {
                    Ok(v) => out.extend(v),
                    Err(e) => return ShmOutcome::Done(Err(e)),
                }
            }
        }
        if let Some(n) = pending {
            match self.recv_put(n) {
                Ok(v) => out.extend(v),
                Err(e) => return ShmOutcome::Done(Err(e)),
            }
        }
        ShmOutcome::Done(Ok(out))
    }

    /// Batched read into the caller's buffers (by keys, or by query results).
    pub fn get(
        &mut self,
        tenant: &Tenant,
        keys: &[String],
        queries: Option<&[QueryResult]>,
        bufs: &mut [&mut [u8]],
    ) -> ShmOutcome<Vec<L3Result<u64>>> {
        let ptrs: Vec<(*const u8, usize)> = bufs.iter().map(|b| (b.as_ptr(), b.len())).collect();
        if self.takes_in_place(&ptrs) {
            return self.get_at(tenant, keys, queries, bufs);
        }
        let meta: Vec<usize> = keys.iter().map(String::len).collect();
        self.get_by(bufs, &meta, |idx, ranges| ShmRequest::Get {
            tenant: tenant.clone(),
            keys: match queries {
                Some(_) => Vec::new(),
                None => idx.iter().map(|&i| keys[i].clone()).collect(),
            },
            queries: queries.map(|q| idx.iter().map(|&i| q[i].clone()).collect()),
            ranges,
        })
    }

    /// A batched read into `bufs` (staged or in place, pipelined), each request built by
    /// `build(indices in the batch, their ranges)`: a `Get`, or a store node's `NodeRead`.
    pub(crate) fn get_by(
        &mut self,
        bufs: &mut [&mut [u8]],
        meta: &[usize],
        mut build: impl FnMut(&[usize], Vec<ShmRange>) -> ShmRequest,
    ) -> ShmOutcome<Vec<L3Result<u64>>> {
        let ptrs: Vec<(*const u8, usize)> = bufs.iter().map(|b| (b.as_ptr(), b.len())).collect();
        let Some(plan) = self.prepare(&ptrs, meta) else {
            return ShmOutcome::UseTcp;
        };
        let mut request = |me: &Self, chunk: &[(usize, Place)], bufs: &[&mut [u8]]| {
            let idx: Vec<usize> = chunk.iter().map(|&(i, _)| i).collect();
            let ranges = chunk
                .iter()
                .map(|&(i, p)| me.range_of(p, bufs[i].len()))
                .collect();
            build(&idx, ranges)
        };
        let mut out = Vec::with_capacity(bufs.len());
        // Request k+1 is sent before chunk k is copied out: the server fills one half of the
        // staging segment while the client empties the other.
        if let Some(first) = plan.first() {
            let req = request(self, first, bufs);
            if let Err(e) = self.send(&req) {
                return ShmOutcome::Done(Err(e));
            }
        }
        for (k, chunk) in plan.iter().enumerate() {
            if let Some(next) = plan.get(k + 1) {
                let req = request(self, next, bufs);
                if let Err(e) = self.send(&req) {
                    return ShmOutcome::Done(Err(e));
                }
            }
            let sizes = match self.recv_get(chunk.len()) {
                Ok(v) => v,
                Err(e) => return ShmOutcome::Done(Err(e)),
            };
            for (&(i, p), s) in chunk.iter().zip(&sizes) {
                if let (Place::Staged(at), Ok(n)) = (p, s) {
                    let n = *n as usize;
                    if n > bufs[i].len() {
                        self.live = None;
                        return ShmOutcome::Done(Err(io_fail("server wrote past the buffer")));
                    }
                    match self.staging_mut(at, n) {
                        Ok(src) => bufs[i][..n].copy_from_slice(src),
                        Err(e) => {
                            self.live = None; // a request may be outstanding
                            return ShmOutcome::Done(Err(e));
                        }
                    }
                }
            }
            out.extend(sizes);
        }
        ShmOutcome::Done(Ok(out))
    }
}
