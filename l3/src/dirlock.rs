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
//! How: a POSIX record lock (`fcntl(F_SETLK)`, write, whole file) on a lock file in the
//! directory, kept open in [`DirLock`]; the kernel drops it when the file is closed or the
//! process dies (SIGKILL included), so a crash never leaves a stale lock. The lock file is
//! never removed (removing it would let a third process lock a new inode while the second
//! still holds the old one). Not for NFS and the like, where locks may be local to the host.
//!
//! Why a record lock and not `flock`: a `flock` belongs to the open file, which a forked child
//! shares until it execs or exits, so a child forked while the lock was held (an engine's
//! worker processes, a `Command` between its fork and exec) kept the directory locked after
//! the holder let go (CI stop 63). A record lock belongs to the process and is never
//! inherited. Its two process-wide rules are kept here: two holders in one process do not
//! conflict, so [`DirLock`]s of this process are also kept in a set of `(device, inode)`,
//! refused a second time; and closing *any* descriptor of the file drops the process's lock,
//! so the file is opened only under that set's mutex, after the set said it is not held, and
//! a holder closes it under the mutex too.
//!
//! A forked child gets a copy of the set and of every holder but none of the locks, so each
//! entry and holder names the process that took it: the child ignores (and forgets) the
//! parent's entries, and a holder copied into a child never closes its descriptor there
//! (closing any descriptor of the file would drop a lock the child took on it since). Before,
//! a worker forked beside an open store could not open one on that directory even after the
//! parent let go.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
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

/// A lock file's identity: `(device, inode)`.
type FileId = (u64, u64);

/// The lock files this process holds, each with the id of the process that took it (an entry
/// of another process was copied by a fork: see the module docs; a record lock does not keep
/// two holders in one process apart). Every open and close of a lock file happens under it.
fn held() -> MutexGuard<'static, BTreeMap<FileId, u32>> {
    static HELD: Mutex<BTreeMap<FileId, u32>> = Mutex::new(BTreeMap::new());
    // The set is updated after every fallible step, so a panic elsewhere left it whole.
    HELD.lock().unwrap_or_else(|e| e.into_inner())
}

/// A held lock on a directory; dropping it releases the lock.
#[derive(Debug)]
pub struct DirLock {
    /// Always `Some` until dropped: closed under [`held`]'s mutex.
    file: Option<File>,
    id: FileId,
    path: PathBuf,
    /// The process that took the lock (a copy in a forked child holds nothing).
    pid: u32,
}

/// Whether this process holds `id`, forgetting an entry a fork copied from the parent.
fn held_here(held: &mut BTreeMap<FileId, u32>, id: &FileId) -> bool {
    match held.get(id) {
        Some(&pid) if pid == std::process::id() => true,
        Some(_) => {
            held.remove(id);
            false
        }
        None => false,
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        let mut held = held();
        if self.pid != std::process::id() {
            // A copy a fork made: it holds no lock here, and closing the descriptor would
            // drop one this process may have taken on the file since.
            std::mem::forget(self.file.take());
            return;
        }
        // Closing drops the record lock; no other descriptor of the file is open here.
        drop(self.file.take());
        if held.get(&self.id) == Some(&self.pid) {
            held.remove(&self.id);
        }
    }
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
        let until = Instant::now() + wait;
        loop {
            if let Some(lock) = DirLock::try_take(&path)? {
                return Ok(lock);
            }
            if Instant::now() >= until {
                return Err(DirInUse {
                    what,
                    dir: dir.to_path_buf(),
                    lock: path,
                }
                .into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// One try: the lock, or `None` when a holder (this process or another) has it.
    fn try_take(path: &Path) -> Result<Option<DirLock>, L3Error> {
        let fail =
            |e: std::io::Error| L3Error::FileOpenFail(format!("lock {}: {e}", path.display()));
        let mut held = held();
        // Before opening: opening and closing a file this process holds drops its lock.
        match std::fs::symlink_metadata(path) {
            Ok(m) if held_here(&mut held, &(m.dev(), m.ino())) => return Ok(None),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail(e)),
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(fail)?;
        let meta = file.metadata().map_err(fail)?;
        let id = (meta.dev(), meta.ino());
        if held_here(&mut held, &id) {
            // Renamed over by another process since the check above: closing it would drop
            // this process's lock, so the descriptor is kept open (leaked) instead.
            std::mem::forget(file);
            return Ok(None);
        }
        if !meta.is_file() {
            return Err(fail(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file",
            )));
        }
        // SAFETY: a zeroed `flock` is a valid value of the plain C struct.
        let mut want: libc::flock = unsafe { std::mem::zeroed() };
        want.l_type = libc::F_WRLCK as libc::c_short;
        want.l_whence = libc::SEEK_SET as libc::c_short;
        // `l_start` and `l_len` zero: the whole file, however long.
        loop {
            // SAFETY: `file` owns the descriptor for the whole call and `want` outlives it.
            if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLK, &want) } == 0 {
                let pid = std::process::id();
                held.insert(id, pid);
                return Ok(Some(DirLock {
                    file: Some(file),
                    id,
                    path: path.to_path_buf(),
                    pid,
                }));
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::EACCES) | Some(libc::EAGAIN) => return Ok(None),
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

    /// CI stop 63: a child forked while the lock was held kept it after the holder let go
    /// (a `flock` belongs to the open file, which the child's copy of the descriptor shares
    /// until it execs or exits): the reopen was refused, "in use by another process". A test
    /// spawning `sleep` beside the settle log's proptest hit the window; an engine that forks
    /// workers (Python multiprocessing) would hold an embedded store's directories for as long
    /// as its workers live, past a restart of the store. The child here never execs until the
    /// holder has dropped the lock and taken it again.
    #[test]
    fn a_forked_child_does_not_hold_the_lock() {
        let d = tempfile::tempdir().unwrap();
        let l = DirLock::acquire(d.path(), "x.lock", "--state-dir").unwrap();
        // SAFETY: the child only calls `_exit` and `nanosleep`, both async-signal-safe.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            unsafe {
                let t = libc::timespec {
                    tv_sec: 30,
                    tv_nsec: 0,
                };
                libc::nanosleep(&t, std::ptr::null_mut());
                libc::_exit(0);
            }
        }
        drop(l);
        let again = DirLock::acquire(d.path(), "x.lock", "--state-dir");
        // SAFETY: `pid` is this test's own child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        again.unwrap();
    }

    /// Whether a process other than this one can take a write lock on `path` now (a forked
    /// child tries and reports by its exit code).
    fn another_process_can_lock(path: &Path) -> bool {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: the child only calls `open`, `fcntl` and `_exit`, all async-signal-safe.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            unsafe {
                let fd = libc::open(c.as_ptr(), libc::O_RDWR);
                let mut want: libc::flock = std::mem::zeroed();
                want.l_type = libc::F_WRLCK as libc::c_short;
                want.l_whence = libc::SEEK_SET as libc::c_short;
                let took = fd >= 0 && libc::fcntl(fd, libc::F_SETLK, &want) == 0;
                libc::_exit(if took { 0 } else { 1 });
            }
        }
        let mut status = 0;
        // SAFETY: `pid` is this test's own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status), "child status {status}");
        libc::WEXITSTATUS(status) == 0
    }

    /// A record lock is dropped when the process closes any descriptor of its file: a second
    /// acquire in this process, by the same name or another (a hard link), is refused without
    /// opening the file, and the first holder's lock stays in force for other processes.
    #[test]
    fn a_refused_second_acquire_in_this_process_keeps_the_first_lock() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("x.lock");
        let l = DirLock::acquire(d.path(), "x.lock", "--ssd-dir").unwrap();
        assert!(!another_process_can_lock(&path), "not locked while held");
        std::fs::hard_link(&path, d.path().join("y.lock")).unwrap();
        for name in ["x.lock", "y.lock"] {
            let e = DirLock::acquire(d.path(), name, "--ssd-dir").unwrap_err();
            assert!(e.to_string().contains("in use"), "{e}");
            assert!(
                !another_process_can_lock(&path),
                "a refused acquire of {name} dropped the holder's lock"
            );
        }
        drop(l);
        assert!(
            another_process_can_lock(&path),
            "still locked after the drop"
        );
    }

    /// Waits up to 20 s for this test's child `pid`: its exit code, or `None` (killed) if it
    /// did not end (a child that hangs fails the test instead of hanging it).
    fn exit_code_of(pid: libc::pid_t) -> Option<i32> {
        let until = Instant::now() + Duration::from_secs(20);
        let mut status = 0;
        loop {
            // SAFETY: `pid` is this test's own child.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                return libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
            }
            if Instant::now() >= until {
                // SAFETY: as above.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, std::ptr::null_mut(), 0);
                }
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A worker forked while this process held the lock (Python multiprocessing beside an
    /// embedded store) inherited the set of held locks: after the parent let go it still could
    /// not open a store on the directory ("in use"), though no process held it. The child
    /// tries while the parent holds it, tells the parent, and waits for the parent's drop
    /// (two pipes); it then takes the lock, drops its inherited copy of the parent's holder
    /// (which must not release the child's own lock), and reports whether another process is
    /// kept out. Exit 0: all as it should be.
    #[test]
    fn a_forked_child_takes_the_lock_once_the_parent_let_go() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("x.lock");
        let l = DirLock::acquire(d.path(), "x.lock", "--ssd-dir").unwrap();
        let (mut go, mut tried) = ([0; 2], [0; 2]);
        // SAFETY: each array has room for a pipe's two descriptors.
        unsafe {
            assert_eq!(libc::pipe(go.as_mut_ptr()), 0);
            assert_eq!(libc::pipe(tried.as_mut_ptr()), 0);
        }
        // SAFETY: the child reads the pipe, takes locks and forks; it ends with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let code = (|| {
                // While the parent holds it: refused (the parent's record lock).
                if DirLock::acquire(d.path(), "x.lock", "--ssd-dir").is_ok() {
                    return 2;
                }
                let mut b = [0u8; 1];
                // SAFETY: one byte from and into live buffers.
                if unsafe { libc::write(tried[1], b"t".as_ptr().cast(), 1) } != 1
                    || unsafe { libc::read(go[0], b.as_mut_ptr().cast(), 1) } != 1
                {
                    return 3;
                }
                let Ok(mine) = DirLock::acquire(d.path(), "x.lock", "--ssd-dir") else {
                    return 4; // refused though the parent let go
                };
                drop(l);
                if another_process_can_lock(&path) {
                    return 5; // dropping the inherited holder released the child's lock
                }
                drop(mine);
                if !another_process_can_lock(&path) {
                    return 6;
                }
                0
            })();
            // SAFETY: ends the child without running the test harness's exit.
            unsafe { libc::_exit(code) };
        }
        let mut b = [0u8; 1];
        // SAFETY: our copy of the write end closed, a child that dies ends the read (0 bytes).
        unsafe {
            libc::close(tried[1]);
            libc::read(tried[0], b.as_mut_ptr().cast(), 1);
        }
        drop(l);
        // SAFETY: one byte from a live buffer; then the pipes' descriptors left, ours.
        let code = unsafe {
            libc::write(go[1], b"g".as_ptr().cast(), 1);
            let code = exit_code_of(pid);
            for fd in [go[0], go[1], tried[0]] {
                libc::close(fd);
            }
            code
        };
        assert_eq!(
            code,
            Some(0),
            "child: 2 took it while the parent held it, 3 pipe failed, 4 refused after the parent let go, \
             5 lost its own lock when its copy of the parent's holder dropped, 6 kept it"
        );
    }

    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        /// Acquire lock file `0..3` (2 is a hard link to 0: the same lock).
        Acquire(usize),
        /// Drop the `n`th live holder (modulo how many there are).
        Drop(usize),
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Whatever the order of acquires and drops, under any name of a lock file: an
        /// acquire succeeds exactly when no live holder in this process has that file, and
        /// another process can lock a file exactly when no live holder has it (a refused
        /// acquire never drops a holder's lock, a drop always releases it).
        #[test]
        fn holders_and_other_processes_see_the_lock_as_the_live_holders_say(
            ops in proptest::collection::vec(
                prop_oneof![(0usize..3).prop_map(Op::Acquire), any::<usize>().prop_map(Op::Drop)],
                1..16,
            ),
        ) {
            let d = tempfile::tempdir().unwrap();
            let names = ["a.lock", "b.lock", "c.lock"];
            std::fs::write(d.path().join("a.lock"), b"").unwrap();
            std::fs::hard_link(d.path().join("a.lock"), d.path().join("c.lock")).unwrap();
            let file_of = |name: usize| if name == 2 { 0 } else { name };
            let mut live: Vec<(usize, DirLock)> = Vec::new(); // (file, holder)
            for op in ops {
                match op {
                    Op::Acquire(name) => {
                        let held = live.iter().any(|(f, _)| *f == file_of(name));
                        match DirLock::acquire(d.path(), names[name], "--ssd-dir") {
                            Ok(l) => {
                                prop_assert!(!held, "{} acquired while held", names[name]);
                                live.push((file_of(name), l));
                            }
                            Err(e) => {
                                prop_assert!(held, "{} refused while free: {e}", names[name]);
                            }
                        }
                    }
                    Op::Drop(n) if !live.is_empty() => {
                        let n = n % live.len();
                        drop(live.remove(n));
                    }
                    Op::Drop(_) => {}
                }
                for file in [0, 1] {
                    let path = d.path().join(names[file]);
                    if !path.exists() {
                        continue; // b.lock before its first acquire
                    }
                    let held = live.iter().any(|(f, _)| *f == file);
                    prop_assert_eq!(another_process_can_lock(&path), !held, "{}", names[file]);
                }
            }
        }
    }
}
