//! An exclusive lock on a directory a process owns (`--state-dir`, `--ssd-dir`), held for as
//! long as the process uses it.
//!
//! Why: two masters started on one `--state-dir` both replayed and rewrote its settle log.
//! A second start that then failed (its address taken) had already compacted the log,
//! renaming a new `settles.log` over the running master's, which went on appending to the
//! unlinked file: every settle after that was lost and removed keys came back after a
//! restart (adversarial tester, 10 of 10). With the lock, the second process fails at start
//! with [`DirInUse`], before it reads or changes anything in the directory.
//!
//! How: `flock(LOCK_EX | LOCK_NB)` on a lock file in the directory,
//! kept open in [`DirLock`]; the kernel drops it when the file is closed or the process dies
//! (SIGKILL included), so a crash never leaves a stale lock. The lock is per open file, so a
//! second open in the same process is refused too. The lock file is never removed (removing
//! it would let a third process lock a new inode while the second still holds the old one).
//! Not for NFS and the like, where `flock` may be local to the host.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::L3Error;

/// The directory is locked by another process (or another open in this one).
#[derive(Debug, thiserror::Error)]
#[error(
    "{what} {dir} is in use by another process (lock {lock} is held); \
     two processes must not share it"
)]
pub struct DirInUse {
    /// What the directory is, for the message (`--state-dir`).
    pub what: &'static str,
    /// The directory.
    pub dir: PathBuf,
    /// Its lock file.
    pub lock: PathBuf,
}

impl From<DirInUse> for L3Error {
    fn from(e: DirInUse) -> Self {
        L3Error::FileOpenFail(e.to_string())
    }
}

/// A held lock on a directory; dropping it releases the lock.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    path: PathBuf,
}

impl DirLock {
    /// Takes the lock `dir/name` (creating the file, never through a symlink), or fails with
    /// [`DirInUse`] if another holder has it. `what` names the directory in the error
    /// (`--state-dir`, `--ssd-dir`).
    pub fn acquire(dir: &Path, name: &str, what: &'static str) -> Result<DirLock, L3Error> {
        DirLock::acquire_within(dir, name, what, Duration::ZERO)
    }

    /// [`Self::acquire`], waiting up to `wait` for a holder that is going away (a store just
    /// dropped whose background threads are still ending).
    pub fn acquire_within(
        dir: &Path,
        name: &str,
        what: &'static str,
        wait: Duration,
    ) -> Result<DirLock, L3Error> {
        let path = dir.join(name);
        let fail =
            |e: std::io::Error| L3Error::FileOpenFail(format!("lock {}: {e}", path.display()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(fail)?;
        if !file.metadata().map_err(fail)?.is_file() {
            return Err(fail(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file",
            )));
        }
        let until = Instant::now() + wait;
        loop {
            // `File::try_lock` is newer than the crate's MSRV (1.88).
            // SAFETY: `file` owns the descriptor for the whole call.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(DirLock { _file: file, path });
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::EWOULDBLOCK) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Some(libc::EWOULDBLOCK) => {
                    return Err(DirInUse {
                        what,
                        dir: dir.to_path_buf(),
                        lock: path,
                    }
                    .into());
                }
                _ => return Err(fail(e)),
            }
        }
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_until_the_first_is_dropped() {
        let d = tempfile::tempdir().unwrap();
        let l = DirLock::acquire(d.path(), "x.lock", "--state-dir").unwrap();
        let e = DirLock::acquire(d.path(), "x.lock", "--state-dir").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(&d.path().display().to_string()), "{msg}");
        assert!(msg.contains("in use"), "{msg}");
        drop(l);
        DirLock::acquire(d.path(), "x.lock", "--state-dir").unwrap();
    }
}
