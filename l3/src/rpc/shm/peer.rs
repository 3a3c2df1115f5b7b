//! The client process on the other end of a shared-memory connection, and copies in its
//! memory (`process_vm_readv` / `process_vm_writev`) for in-place transfers.
//!
//! Why a file of its own: this is where the server touches another process's memory, and
//! every rule that makes that safe lives here, next to the syscalls (see `inplace` for the
//! protocol around it):
//! - the pid is the kernel's (`SO_PEERCRED` of the connected socket), never a message's;
//! - the peer's uid must be the server's euid (the server never does to a process more than
//!   that process's own user could; the kernel's ptrace checks apply on top);
//! - a pidfd pins the very process that connected (`SO_PEERPIDFD`, else `pidfd_open` checked
//!   against the live socket), and each copy is bracketed by a liveness check on it, so a
//!   recycled pid is refused (the remaining window is explained at [`Peer::copy`]);
//! - `EFAULT` (an address the client has not mapped) is a typed -600, never a fault here.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use crate::error::{L3Error, L3Result};

/// Which way a transfer goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dir {
    /// Client memory → server.
    Read,
    /// Server → client memory.
    Write,
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// `SO_PEERCRED` of a connected Unix socket: (pid, uid) of the peer at connect time.
pub(super) fn peer_cred(sock: &UnixStream) -> L3Result<(libc::pid_t, libc::uid_t)> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut n = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `c` is a writable ucred of `n` bytes.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut n,
        )
    };
    if r != 0 {
        return Err(L3Error::Unavailable(format!(
            "SO_PEERCRED: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok((c.pid, c.uid))
}

/// `SO_PEERPIDFD` (asm-generic value; Linux ≥ 6.5): a pidfd of the process that connected.
#[cfg(any(
    target_arch = "x86_64",
    target_arch = "aarch64",
    target_arch = "riscv64"
))]
fn peer_pidfd(sock: &UnixStream) -> Option<OwnedFd> {
    const SO_PEERPIDFD: libc::c_int = 77;
    let mut fd: libc::c_int = -1;
    let mut n = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is a writable int of `n` bytes.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut n,
        )
    };
    // SAFETY: on success the kernel returned a fresh descriptor we own.
    (r == 0 && fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "aarch64",
    target_arch = "riscv64"
)))]
fn peer_pidfd(_: &UnixStream) -> Option<OwnedFd> {
    None
}

/// Whether the socket's peer still holds its end (no EOF waiting).
fn still_connected(sock: &UnixStream) -> bool {
    let mut b = 0u8;
    // SAFETY: a one-byte peek into `b`; nothing is consumed.
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            (&mut b as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n > 0 || (n < 0 && errno() == libc::EAGAIN)
}

/// Whether the process `pidfd` names is alive.
fn pidfd_alive(pidfd: &OwnedFd) -> bool {
    // SAFETY: signal 0 only checks; a null siginfo and no flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    r == 0
}

/// A connection's client, watched for giving up on a call: its call timed out (a paused or
/// overloaded server), it closed the socket and got an error, and from then on the memory
/// the request named is the caller's again, to reuse. A put served after that (the request
/// was already with the server) must not store what the memory holds by then.
#[derive(Debug)]
pub(super) struct ConnWatch {
    sock: UnixStream,
    /// The client process (`SO_PEERPIDFD`, else `pidfd_open` checked against the live
    /// socket); None where neither is available: then a hang-up is never taken for giving up.
    pidfd: Option<OwnedFd>,
}

impl ConnWatch {
    /// Watches the client of `sock` (None if the socket cannot be duplicated).
    pub(super) fn of(sock: &UnixStream) -> Option<ConnWatch> {
        let sock = sock.try_clone().ok()?;
        let pidfd = peer_pidfd(&sock).or_else(|| {
            let (pid, _) = peer_cred(&sock).ok()?;
            if pid <= 0 {
                return None;
            }
            // SAFETY: pidfd_open takes a pid and flags; the result is a new descriptor.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
            // The pid was the client's while it is connected (see the module docs).
            // SAFETY: a fresh descriptor we own (it fits an int: the kernel returned it).
            (fd >= 0 && still_connected(&sock))
                .then(|| unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
        });
        Some(ConnWatch { sock, pidfd })
    }

    /// The client hung up while its process lives on: it gave up on the call in progress.
    /// A client that died is not giving up: memory it shared stays as it left it, so a put
    /// it sent whole still completes.
    pub(super) fn gave_up(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one pollfd, no wait.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        let hung_up = r > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP) != 0;
        hung_up && self.pidfd.as_ref().is_some_and(pidfd_alive)
    }
}

/// The client process on the other end of a connection, for in-place copies.
#[derive(Debug)]
pub(super) struct Peer {
    pid: libc::pid_t,
    pidfd: OwnedFd,
}

impl Peer {
    /// The socket's peer, if the server may copy in its memory: same uid as this server's
    /// euid, a pid in this namespace, and a pidfd pinned to that very process.
    pub(super) fn of(sock: &UnixStream) -> L3Result<Peer> {
        let (pid, uid) = peer_cred(sock)?;
        if pid <= 0 {
            return Err(L3Error::Unavailable(
                "the client is outside this pid namespace".into(),
            ));
        }
        // SAFETY: geteuid cannot fail.
        let euid = unsafe { libc::geteuid() };
        if uid != euid {
            return Err(L3Error::Unavailable(format!(
                "the client runs as uid {uid}, this server as {euid}"
            )));
        }
        let pidfd = match peer_pidfd(sock) {
            Some(fd) => fd,
            None => {
                // SAFETY: pidfd_open takes a pid and flags; the result is a new descriptor.
                let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
                if fd < 0 {
                    return Err(L3Error::Unavailable(format!(
                        "pidfd_open: {}",
                        std::io::Error::last_os_error()
                    )));
                }
                // The pid was the client's while it is connected (see the module docs).
                if !still_connected(sock) {
                    return Err(L3Error::Unavailable("the client went away".into()));
                }
                // SAFETY: a fresh descriptor we own (it fits an int: the kernel returned it).
                unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) }
            }
        };
        Ok(Peer { pid, pidfd })
    }

    /// Whether the process the pidfd names is alive (so its pid is still its own).
    fn alive(&self) -> bool {
        pidfd_alive(&self.pidfd)
    }

    /// Copies `len` bytes between `local` (this process) and `remote` (the client), in
    /// whatever pieces the kernel takes; typed errors, and the client checked alive around.
    ///
    /// The remaining window: a pid is only recycled after its process is reaped, so between
    /// the liveness check and the syscall the client would have to be killed, reaped by its
    /// parent and its pid handed to a new process of the same user before one syscall
    /// starts. The check after the copy turns a put from a process found dead into an error
    /// (its bytes are discarded).
    ///
    /// # Safety
    /// `local` must be valid for `len` bytes (writable for [`Dir::Read`]).
    pub(super) unsafe fn copy(
        &self,
        dir: Dir,
        local: *mut u8,
        remote: u64,
        len: usize,
    ) -> L3Result<()> {
        if len == 0 {
            return Ok(());
        }
        let gone = || L3Error::IllegalClient("the client process is gone".into());
        if !self.alive() {
            return Err(gone());
        }
        let mut done = 0usize;
        while done < len {
            let l = libc::iovec {
                // SAFETY: `done < len`, inside the caller's buffer.
                iov_base: unsafe { local.add(done) }.cast(),
                iov_len: len - done,
            };
            let r = libc::iovec {
                iov_base: (remote as usize).wrapping_add(done) as *mut libc::c_void,
                iov_len: len - done,
            };
            // SAFETY: the local iovec is inside the caller's buffer (this function's
            // contract); the remote one is the client's, checked by the kernel (EFAULT).
            let n = unsafe {
                match dir {
                    Dir::Read => libc::process_vm_readv(self.pid, &l, 1, &r, 1, 0),
                    Dir::Write => libc::process_vm_writev(self.pid, &l, 1, &r, 1, 0),
                }
            };
            if n <= 0 {
                return Err(match (n, errno()) {
                    (0, _) | (_, libc::EFAULT) => L3Error::InvalidParams(format!(
                        "client range {remote:#x}+{len} is not mapped in the client"
                    )),
                    (_, libc::ESRCH) => gone(),
                    (_, e) => L3Error::Unavailable(format!(
                        "in-place copy: {}",
                        std::io::Error::from_raw_os_error(e)
                    )),
                });
            }
            done += n as usize;
        }
        if !self.alive() {
            return Err(gone());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_reads_and_writes_this_process_and_refuses_bad_ranges() {
        let (a, _b) = UnixStream::pair().unwrap();
        let peer = Peer::of(&a).unwrap();
        let src = vec![7u8; 3 << 20];
        let mut dst = vec![0u8; 3 << 20];
        // SAFETY: `dst` is writable for its length.
        unsafe { peer.copy(Dir::Read, dst.as_mut_ptr(), src.as_ptr() as u64, src.len()) }.unwrap();
        assert_eq!(dst, src);
        let mut small = [0u8; 8];
        // SAFETY: as above.
        let r = unsafe { peer.copy(Dir::Read, small.as_mut_ptr(), 8, 8) };
        assert!(matches!(r, Err(L3Error::InvalidParams(_))), "{r:?}");
    }

    /// The pid-reuse guard: a peer whose process died is refused before any copy, also
    /// once its pid number belongs to another process (forced with `ns_last_pid` where this
    /// test may write it: root in the pid namespace).
    #[test]
    fn a_dead_peer_is_refused_even_when_its_pid_is_reused() {
        let mut kid = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = kid.id() as libc::pid_t;
        // SAFETY: pidfd_open of our own child, alive (not yet waited for).
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor.
        let peer = Peer {
            pid,
            pidfd: unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) },
        };
        assert!(peer.alive());
        kid.kill().unwrap();
        kid.wait().unwrap(); // reaped: its pid may be handed out again
        assert!(!peer.alive());
        let mut b = [0u8; 8];
        let src = [1u8; 8];
        // SAFETY: `b` is writable; `src` only read.
        let r = unsafe { peer.copy(Dir::Read, b.as_mut_ptr(), src.as_ptr() as u64, 8) };
        assert!(matches!(r, Err(L3Error::IllegalClient(_))), "{r:?}");
        let last = "/proc/sys/kernel/ns_last_pid";
        if std::fs::write(last, (pid - 1).to_string()).is_err() {
            eprintln!("{last} not writable here: pid reuse itself not forced");
            return;
        }
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        if other.id() as libc::pid_t == pid {
            // SAFETY: signal 0 only checks that the pid exists.
            assert_eq!(unsafe { libc::kill(pid, 0) }, 0, "the pid is taken again");
            assert!(!peer.alive(), "the pidfd still names the dead process");
            // SAFETY: as above.
            let r = unsafe { peer.copy(Dir::Write, src.as_ptr().cast_mut(), 4096, 8) };
            assert!(matches!(r, Err(L3Error::IllegalClient(_))), "{r:?}");
        } else {
            eprintln!("another process took pid {pid} first: reuse not checked");
        }
        let _ = other.kill();
        let _ = other.wait();
    }
}
