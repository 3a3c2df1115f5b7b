//! In-place copies: the server moves a plain caller buffer (a Python `bytes`, a tensor, any
//! memory outside a shared segment) with `process_vm_readv` / `process_vm_writev`, straight
//! between the client's memory and the store's replica buffer. One copy per byte, where the
//! staging segment costs two (caller → staging in the client, staging → store in the
//! server).
//!
//! Why it is asked for (`ShmMode::InPlace`, `KVTIER_L3_SHM=inplace`) and not the default:
//! the kernel pins each page of the caller's buffer for the copy, and that cost is per page.
//! On caller memory backed by huge pages, in place measured faster than staging (puts
//! 1.2–2.6×, gets 0.9–2.0× over two runs) and 0.7–1.5× the embedded store's throughput with
//! 1–8 processes; on 4 KiB pages it measured slower than staging, whose two memcpys overlap
//! across two processes (docs/l3-bench.md, *In-place copies*). Which kind of memory a caller
//! passes is the caller's to know.
//!
//! The client names each buffer by `(addr, len)` in its own address space and blocks until
//! the reply, so its buffers stay valid for the whole transfer.
//!
//! Safety, i.e. why the server may touch another process's memory at all:
//! - **Whose memory.** The pid is the kernel's: `SO_PEERCRED` of the connected socket,
//!   never a number from a message. In-place mode is granted only when the peer's uid is the
//!   server's effective uid, so the server never does to a process more than that process's
//!   own user could; the kernel checks ptrace access on every call on top (Yama, LSMs).
//! - **Pid reuse.** The server holds a pidfd of the peer: from `SO_PEERPIDFD` (Linux ≥ 6.5:
//!   the process that connected, race-free), else `pidfd_open(pid)` followed by a check that
//!   the socket's peer is still connected (a recycled pid would need the client dead, and a
//!   dead client's socket is closed unless it handed the socket to a child). Around each
//!   transfer the pidfd must show the process alive: a pid is only recycled after its
//!   process is reaped, so between the check and the copy the client would have to be
//!   killed, reaped by its parent and its pid handed to a new process of the same user
//!   before one syscall returns — the remaining window, narrower than a context switch.
//!   After the copy the check is repeated: a put from a process found dead is discarded.
//! - **Bad numbers.** An address range that overflows is -600 for the whole call before the
//!   store is touched; one the client has not mapped (or unmapped mid-call) fails that key
//!   with -600 (`EFAULT` from the kernel, never a fault in the server), and a put whose bytes
//!   could not all be read is revoked: all-or-nothing per key, as on every path.
//! - **Deciding.** A probe at connect ([`probe`]): the server reads a client nonce at a
//!   client address and writes its complement back. Anything that stops it (another uid,
//!   `EPERM` from Yama's `ptrace_scope` or an LSM, `ENOSYS` or a seccomp filter, an old
//!   server) leaves the connection on the staging segment; under Yama's scope 1 the client
//!   first names the server as its tracer (`PR_SET_PTRACER`).

use std::mem::MaybeUninit;
use std::os::unix::net::UnixStream;

use crate::error::{L3Error, L3Result};
use crate::rpc::xfer::{read_frame, write_frame};
use crate::store::{EmbeddedStore, Filler};
use crate::types::{PutOptions, QueryResult, ReplicateConfig, Tenant};

use super::client::{ShmClient, ShmOutcome};
use super::peer::{Dir, Peer, peer_cred};
use super::segment::random16;
use super::{RemoteBuf, ShmReply, ShmRequest};

/// Every buffer's address range fits the address space: -600 for the whole call if not.
fn check_bufs(bufs: &[RemoteBuf], n: usize) -> L3Result<()> {
    if bufs.len() != n {
        return Err(L3Error::InvalidParams(
            "keys and buffers differ in length".into(),
        ));
    }
    for b in bufs {
        let end = b.addr.checked_add(b.len);
        if end.is_none_or(|e| e > isize::MAX as u64) {
            return Err(L3Error::InvalidParams(format!(
                "buffer {:#x}+{} overflows",
                b.addr, b.len
            )));
        }
    }
    Ok(())
}

fn not_set_up() -> L3Error {
    L3Error::IllegalClient("in-place copies are not set up on this connection".into())
}

/// Server: the probe. `Ok(peer)` when the nonce read back and its complement was written.
pub(super) fn serve_probe(
    sock: &UnixStream,
    addr: u64,
    nonce: [u8; 16],
    back: u64,
) -> L3Result<Peer> {
    let peer = Peer::of(sock)?;
    let mut got = [0u8; 16];
    // SAFETY: `got` is 16 writable bytes.
    unsafe { peer.copy(Dir::Read, got.as_mut_ptr(), addr, 16)? };
    if got != nonce {
        return Err(L3Error::Unavailable("the probe read another nonce".into()));
    }
    let mut inv = nonce.map(|b| !b);
    // SAFETY: `inv` is 16 bytes (only read by the kernel).
    unsafe { peer.copy(Dir::Write, inv.as_mut_ptr(), back, 16)? };
    Ok(peer)
}

/// Reads each key's bytes from the client into the store's buffer.
struct FromPeer<'a> {
    peer: &'a Peer,
    bufs: &'a [RemoteBuf],
    /// Whether the client gave up on the call (`SegTable::client_gave_up`).
    gave_up: &'a dyn Fn() -> bool,
}

// SAFETY: an Ok `copy` of `dst.len()` bytes wrote every byte of `dst`.
unsafe impl Filler for FromPeer<'_> {
    fn fill(&mut self, i: usize, dst: &mut [MaybeUninit<u8>]) -> L3Result<()> {
        let b = self
            .bufs
            .get(i)
            .ok_or_else(|| L3Error::Internal("no buffer for key".into()))?;
        if b.len != dst.len() as u64 {
            return Err(L3Error::Internal("buffer length differs".into()));
        }
        // SAFETY: `dst` is writable for its length.
        unsafe {
            self.peer
                .copy(Dir::Read, dst.as_mut_ptr().cast(), b.addr, dst.len())?
        };
        // A client that gave up on the call may have put its next bytes in this buffer
        // before they were read: not stored (`tests/shm_reconnect.rs`).
        if (self.gave_up)() {
            return Err(super::server::gave_up());
        }
        Ok(())
    }
}

/// Server: `PutAt`.
#[allow(clippy::too_many_arguments)]
pub(super) fn serve_put(
    store: &EmbeddedStore,
    peer: Option<&Peer>,
    gave_up: &dyn Fn() -> bool,
    tenant: &Tenant,
    keys: &[String],
    bufs: &[RemoteBuf],
    opts: PutOptions,
    cfg: ReplicateConfig,
) -> L3Result<Vec<L3Result<()>>> {
    let peer = peer.ok_or_else(not_set_up)?;
    check_bufs(bufs, keys.len())?;
    let sizes: Vec<u64> = bufs.iter().map(|b| b.len).collect();
    let mut f = FromPeer {
        peer,
        bufs,
        gave_up,
    };
    store.batch_put_filled(tenant, keys, &sizes, &mut f, opts, cfg)
}

/// Server: `GetAt`.
pub(super) fn serve_get(
    store: &EmbeddedStore,
    peer: Option<&Peer>,
    gave_up: &dyn Fn() -> bool,
    tenant: &Tenant,
    keys: &[String],
    queries: Option<&[QueryResult]>,
    bufs: &[RemoteBuf],
) -> L3Result<Vec<L3Result<u64>>> {
    let peer = peer.ok_or_else(not_set_up)?;
    check_bufs(bufs, queries.map_or(keys.len(), <[_]>::len))?;
    let blobs = match queries {
        Some(q) => store.batch_get_with_query_blobs(tenant, q)?,
        None => store.batch_get_blobs(tenant, keys)?,
    };
    Ok(blobs
        .into_iter()
        .zip(bufs)
        .map(|(b, dst)| {
            let b = b?;
            let src = b.as_slice();
            if src.len() as u64 > dst.len {
                return Err(L3Error::BufferOverflow {
                    needed: src.len() as u64,
                    have: dst.len,
                });
            }
            // A client that gave up on the call may have reused this buffer: not written
            // (`tests/shm_reconnect.rs`), checked before each chunk of the copy (as
            // `copy_out`).
            for (i, s) in src.chunks(super::server::GIVE_UP_CHUNK).enumerate() {
                if gave_up() {
                    return Err(super::server::gave_up_read());
                }
                let at = dst.addr + (i * super::server::GIVE_UP_CHUNK) as u64;
                // SAFETY: `s` is valid for its length and only read (process_vm_writev
                // takes a mutable pointer type but does not write local memory).
                unsafe { peer.copy(Dir::Write, s.as_ptr().cast_mut(), at, s.len())? };
            }
            Ok(src.len() as u64)
        })
        .collect())
}

/// Under Yama's `ptrace_scope` 1 a process may only be read by its ancestors or by the
/// process it names: name the server (its pid from `SO_PEERCRED` of the socket).
fn allow_server(sock: &UnixStream) {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope");
    if scope.as_deref().map(str::trim).ok() != Some("1") {
        return;
    }
    if let Ok((pid, _)) = peer_cred(sock)
        && pid > 0
    {
        // SAFETY: prctl with integer arguments; it only changes who may trace this process.
        unsafe {
            libc::prctl(libc::PR_SET_PTRACER, pid as libc::c_ulong, 0, 0, 0);
        }
    }
}

/// Client: asks for in-place copies on a fresh connection. `Ok(false)`: the server cannot
/// (or will not) copy in this process, so buffers are staged; `Err`: the socket failed.
pub(super) fn probe(sock: &mut UnixStream, max_frame: usize) -> L3Result<bool> {
    allow_server(sock);
    let nonce = random16()?;
    let mut buf = Box::new([0u8; 32]);
    buf[..16].copy_from_slice(&nonce);
    let base = buf.as_mut_ptr() as u64;
    let req = ShmRequest::Probe {
        addr: base,
        nonce,
        back: base + 16,
    };
    write_frame(sock, &req).map_err(|e| L3Error::RpcFail(format!("probe: {e}")))?;
    let reply: ShmReply =
        read_frame(sock, max_frame).map_err(|e| L3Error::RpcFail(format!("probe: {e:?}")))?;
    match reply {
        ShmReply::Done(Ok(())) => {
            // SAFETY: the server wrote these bytes while this thread waited for the reply;
            // a volatile read so the compiler does not assume them unchanged.
            let back: [u8; 16] = unsafe { std::ptr::read_volatile(buf.as_ptr().add(16).cast()) };
            Ok(back == nonce.map(|b| !b))
        }
        ShmReply::Done(Err(e)) => {
            tracing::info!(error = %e, "in-place copies unavailable; staging buffers");
            Ok(false)
        }
        _ => Err(L3Error::RpcFail("probe: unexpected reply".into())),
    }
}

/// Splits `n` keys into requests within the server's key limit and half its frame limit.
fn chunks(keys: &[String], n: usize, max_keys: usize, max_frame: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let (mut start, mut frame) = (0usize, 0usize);
    for i in 0..n {
        let fk = keys.get(i).map_or(0, String::len) + 96;
        if i > start && (i - start >= max_keys || frame + fk > max_frame / 2) {
            out.push((start, i));
            start = i;
            frame = 0;
        }
        frame += fk;
    }
    if n > start {
        out.push((start, n));
    }
    out
}

fn remote(p: *const u8, len: usize) -> RemoteBuf {
    RemoteBuf {
        addr: p as u64,
        len: len as u64,
    }
}

impl ShmClient {
    /// Whether a batch goes in place: the connection has in-place copies (asked for and
    /// probed) and some buffer is outside every shared region (a batch wholly inside
    /// regions is named by segment, no syscall).
    pub(super) fn takes_in_place(&mut self, bufs: &[(*const u8, usize)]) -> bool {
        if self.connect().and_then(|()| self.purge()).is_err() || !self.in_place() {
            return false;
        }
        bufs.iter().any(|&(p, n)| self.locate(p, n).is_none())
    }

    /// Put, the server reading the caller's buffers in place. The caller's borrow of `bufs`
    /// lasts until every reply is in, so the memory stays valid while the server reads it.
    pub(super) fn put_at(
        &mut self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &[&[u8]],
        opts: PutOptions,
        cfg: ReplicateConfig,
    ) -> ShmOutcome<Vec<L3Result<()>>> {
        let mut out = Vec::with_capacity(keys.len());
        for (a, b) in chunks(keys, keys.len(), self.max_keys, self.max_frame) {
            let req = ShmRequest::PutAt {
                tenant: tenant.clone(),
                keys: keys[a..b].to_vec(),
                bufs: bufs[a..b]
                    .iter()
                    .map(|x| remote(x.as_ptr(), x.len()))
                    .collect(),
                opts,
                cfg,
            };
            let r = self.send(&req).and_then(|()| self.recv_put(b - a));
            match r {
                Ok(v) => out.extend(v),
                Err(e) => return ShmOutcome::Done(Err(e)),
            }
        }
        ShmOutcome::Done(Ok(out))
    }

    /// Get, the server writing into the caller's buffers in place (borrowed mutably until
    /// every reply is in; nothing here touches them meanwhile).
    pub(super) fn get_at(
        &mut self,
        tenant: &Tenant,
        keys: &[String],
        queries: Option<&[QueryResult]>,
        bufs: &mut [&mut [u8]],
    ) -> ShmOutcome<Vec<L3Result<u64>>> {
        let n = queries.map_or(keys.len(), <[_]>::len);
        let mut out = Vec::with_capacity(n);
        for (a, b) in chunks(keys, n, self.max_keys, self.max_frame) {
            let req = ShmRequest::GetAt {
                tenant: tenant.clone(),
                keys: match queries {
                    Some(_) => Vec::new(),
                    None => keys[a..b].to_vec(),
                },
                queries: queries.map(|q| q[a..b].to_vec()),
                bufs: bufs[a..b]
                    .iter_mut()
                    .map(|x| remote(x.as_mut_ptr(), x.len()))
                    .collect(),
            };
            let r = self.send(&req).and_then(|()| self.recv_get(b - a));
            match r {
                Ok(v) => {
                    if v.iter()
                        .zip(&bufs[a..b])
                        .any(|(s, d)| s.as_ref().is_ok_and(|&s| s > d.len() as u64))
                    {
                        return ShmOutcome::Done(Err(L3Error::RpcFail(
                            "the server reported more bytes than the buffer holds".into(),
                        )));
                    }
                    out.extend(v)
                }
                Err(e) => return ShmOutcome::Done(Err(e)),
            }
        }
        ShmOutcome::Done(Ok(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn chunks_cover_every_key_once_within_limits(
            lens in proptest::collection::vec(0usize..300, 0..200),
            max_keys in 1usize..40,
            max_frame in 256usize..8192,
        ) {
            let keys: Vec<String> = lens.iter().map(|&l| "k".repeat(l)).collect();
            let c = chunks(&keys, keys.len(), max_keys, max_frame);
            let mut next = 0;
            for &(a, b) in &c {
                prop_assert_eq!(a, next);
                prop_assert!(b > a);
                prop_assert!(b - a <= max_keys);
                let frame: usize = keys[a..b].iter().map(|k| k.len() + 96).sum();
                prop_assert!(b - a == 1 || frame <= max_frame / 2);
                next = b;
            }
            prop_assert_eq!(next, keys.len());
        }

        #[test]
        fn overflowing_ranges_are_refused(addr in any::<u64>(), len in any::<u64>()) {
            let b = RemoteBuf { addr, len };
            let fits = addr.checked_add(len).is_some_and(|e| e <= isize::MAX as u64);
            prop_assert_eq!(check_bufs(&[b], 1).is_ok(), fits);
        }
    }
}
