//! Shared-memory segments: memfd files mapped by a client and by its server, and the passing
//! of their descriptors over a Unix socket (`SCM_RIGHTS`).
//!
//! Why memfd and descriptor passing rather than named `/dev/shm` files: a memfd has no name
//! another process could guess or open, the kernel frees it once the last descriptor and
//! mapping are gone (a SIGKILLed client leaks nothing once the server drops its mapping),
//! and its size can be sealed. The seal is what makes mapping a client's memory safe for the
//! server: without `F_SEAL_SHRINK`, a hostile client could truncate the file under the
//! server's mapping and turn its next copy into a SIGBUS. So [`Mapping::adopt`] accepts only
//! a sealable memfd whose shrink seal is set and whose size covers the announced length;
//! anything else (a pipe, a regular file, an unsealed memfd) is a typed error.
//!
//! This is the only file of the shared-memory path with `unsafe` code (mmap, cmsg).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use crate::error::{L3Error, L3Result};

/// Largest segment a server maps (64 GiB): bounds the address space one registration takes.
pub const MAX_SEGMENT_BYTES: u64 = 64 << 30;

/// A memfd mapped shared and read-write; unmapped (and the descriptor closed) on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory owned by this value; concurrent access is
// coordinated by the protocol (one request at a time per connection).
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only hands out raw pointers and lengths.
unsafe impl Sync for Mapping {}

fn os_err(what: &str) -> L3Error {
    L3Error::Internal(format!("{what}: {}", io::Error::last_os_error()))
}

fn map_fd(fd: &OwnedFd, len: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh shared mapping of an open descriptor; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

impl Mapping {
    /// Creates a memfd of `len` bytes named `name` (seen in `/proc/<pid>/maps` as
    /// `/memfd:<name>`), seals its size against shrinking and maps it.
    pub fn create(name: &str, len: usize) -> L3Result<Self> {
        if len == 0 || len as u64 > MAX_SEGMENT_BYTES {
            return Err(L3Error::InvalidParams(format!(
                "segment of {len} bytes: must be 1 ..= {MAX_SEGMENT_BYTES}"
            )));
        }
        let cname = std::ffi::CString::new(name)
            .map_err(|_| L3Error::InvalidParams("segment name has a NUL".into()))?;
        // SAFETY: a valid C string; the returned descriptor is owned below.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(os_err("memfd_create"));
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscalls on our own descriptor.
        unsafe {
            if libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) != 0 {
                return Err(os_err("ftruncate"));
            }
            if libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL,
            ) != 0
            {
                return Err(os_err("seal"));
            }
        }
        let ptr = map_fd(&fd, len).map_err(|e| L3Error::Internal(format!("mmap: {e}")))?;
        Ok(Mapping { ptr, len, fd })
    }

    /// Maps `len` bytes of a descriptor a client sent, after checking it is a memfd whose
    /// size is sealed against shrinking and covers `len` (typed -600 otherwise).
    pub fn adopt(fd: OwnedFd, len: u64) -> L3Result<Self> {
        if len == 0 || len > MAX_SEGMENT_BYTES {
            return Err(L3Error::InvalidParams(format!(
                "segment of {len} bytes: must be 1 ..= {MAX_SEGMENT_BYTES}"
            )));
        }
        let len_us = usize::try_from(len)
            .map_err(|_| L3Error::InvalidParams("segment larger than the address space".into()))?;
        // SAFETY: F_GET_SEALS on a descriptor we own; fails (EINVAL) unless it is a memfd
        // created with sealing allowed.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(L3Error::InvalidParams(
                "descriptor is not a sealable memfd".into(),
            ));
        }
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(L3Error::InvalidParams(
                "memfd is not sealed against shrinking (F_SEAL_SHRINK)".into(),
            ));
        }
        // SAFETY: an all-zero `stat` is a valid out-parameter for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on a descriptor we own into a local.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_err("fstat"));
        }
        if (st.st_size as u64) < len {
            return Err(L3Error::InvalidParams(format!(
                "memfd holds {} bytes, {len} announced",
                st.st_size
            )));
        }
        let ptr = map_fd(&fd, len_us)
            .map_err(|e| L3Error::InvalidParams(format!("cannot map the segment: {e}")))?;
        Ok(Mapping {
            ptr,
            len: len_us,
            fd,
        })
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (segments have at least one byte); for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The descriptor (to send to the server).
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Offset of `[ptr, ptr + len)` in this mapping, when it lies wholly inside.
    pub fn offset_of(&self, ptr: *const u8, len: usize) -> Option<u64> {
        let base = self.ptr as usize;
        let p = ptr as usize;
        let end = p.checked_add(len)?;
        (p >= base && end <= base + self.len).then(|| (p - base) as u64)
    }

    /// The bytes `[off, off + len)`, which the caller checked lie inside.
    ///
    /// # Safety
    /// `off + len <= self.len()`, and no `&mut` to the same bytes is alive in this process.
    /// (The peer may write them concurrently; callers only copy out of the slice.)
    pub unsafe fn bytes(&self, off: usize, len: usize) -> &[u8] {
        // SAFETY: in range per the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }
    }

    /// The bytes `[off, off + len)` for writing.
    ///
    /// # Safety
    /// `off + len <= self.len()`, and no other reference to the same bytes is alive in this
    /// process.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, off: usize, len: usize) -> &mut [u8] {
        // SAFETY: in range per the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map_fd` mapped; no slice outlives `self`.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Room for this many descriptors in one receive: a message carrying more is refused (and
/// every descriptor it carried closed).
const MAX_FDS: usize = 4;

fn cmsg_space(fds: usize) -> usize {
    // SAFETY: pure arithmetic macro.
    unsafe { libc::CMSG_SPACE((fds * std::mem::size_of::<libc::c_int>()) as u32) as usize }
}

/// One byte and room for `fds` descriptors: the buffers of a `sendmsg`/`recvmsg`.
struct FdMsg {
    byte: [u8; 1],
    iov: libc::iovec,
    cbuf: Vec<u64>,
    msg: libc::msghdr,
}

impl FdMsg {
    fn new(fds: usize) -> Box<Self> {
        let space = cmsg_space(fds);
        // SAFETY: all-zero iovec and msghdr are valid; the pointers are set below, into
        // this box, which does not move while the message is used.
        let mut m = Box::new(FdMsg {
            byte: [0],
            iov: unsafe { std::mem::zeroed() },
            cbuf: vec![0u64; space.div_ceil(8)],
            msg: unsafe { std::mem::zeroed() },
        });
        m.iov.iov_base = m.byte.as_mut_ptr().cast();
        m.iov.iov_len = 1;
        m.msg.msg_iov = &mut m.iov;
        m.msg.msg_iovlen = 1;
        m.msg.msg_control = m.cbuf.as_mut_ptr().cast();
        m.msg.msg_controllen = space as _;
        m
    }
}

/// Sends one byte carrying `fd` (`SCM_RIGHTS`).
pub fn send_fd(sock: &UnixStream, fd: &OwnedFd) -> io::Result<()> {
    let m = FdMsg::new(1);
    // SAFETY: the control buffer holds one header plus one int, as sized above.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&m.msg);
        if c.is_null() {
            return Err(io::Error::other("no room for the descriptor"));
        }
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>(), fd.as_raw_fd());
        if libc::sendmsg(sock.as_raw_fd(), &m.msg, libc::MSG_NOSIGNAL) != 1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// What came with the one byte [`recv_fd`] read.
#[derive(Debug)]
pub enum Received {
    /// The peer closed the connection.
    Closed,
    /// Exactly one descriptor.
    One(OwnedFd),
    /// No descriptor, or more than one (all closed): a protocol error.
    Bad(String),
}

/// Reads one byte and the descriptors sent with it.
pub fn recv_fd(sock: &UnixStream) -> io::Result<Received> {
    let mut m = FdMsg::new(MAX_FDS);
    // SAFETY: recvmsg into the buffers above.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut m.msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n == 0 {
        return Ok(Received::Closed);
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote, within `msg_controllen`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&m.msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    let raw = std::ptr::read_unaligned(data.add(i));
                    // Owned at once, so every received descriptor is closed when dropped.
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            c = libc::CMSG_NXTHDR(&m.msg, c);
        }
    }
    if m.msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Ok(Received::Bad("too many descriptors".into()));
    }
    if fds.len() != 1 {
        return Ok(Received::Bad(format!(
            "{} descriptors sent with a registration, 1 expected",
            fds.len()
        )));
    }
    Ok(fds
        .pop()
        .map_or(Received::Bad("no descriptor".into()), Received::One))
}

/// This host's boot id (`/proc/sys/kernel/random/boot_id`): equal on both sides means the
/// same kernel, the first condition for sharing memory. None where it cannot be read.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// 16 random bytes from the kernel (the server's nonce, the socket's unguessable name).
pub fn random16() -> L3Result<[u8; 16]> {
    let mut out = [0u8; 16];
    // SAFETY: getrandom into a local buffer of the given length.
    let n = unsafe { libc::getrandom(out.as_mut_ptr().cast(), out.len(), 0) };
    if n != out.len() as isize {
        return Err(os_err("getrandom"));
    }
    Ok(out)
}
