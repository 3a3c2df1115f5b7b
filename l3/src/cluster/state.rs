//! The master's durable state (`kvtier-l3 --role master --state-dir DIR`): its settle log.
//!
//! Why: a settle (tombstone a record, cancel a write) is what keeps a dropped object version
//! from coming back when its node rescans its SSD. The master answers a remove at once and
//! the node hears of it a ping later, so if settles lived only in the master's memory a
//! master killed in between forgot them, and the node's remount brought removed keys (or a
//! removed old version in place of a newer one) back (issue 19). So every issued settle is
//! appended to `settles.log` and made durable before any reply leaves the master; a
//! restart replays the log before it serves anything.
//!
//! How: one append-only file of frames `len:u32 crc32c:u32 bincode(SettleLogEntry)`. A torn
//! or corrupt tail (a crash mid-append: that reply was never sent) is cut off at open. The
//! log is compacted — the master's current settles written to `settles.log.tmp`, synced,
//! renamed over the log, directory synced — at open and whenever it has grown past four
//! times what it holds. Acknowledgements are appended without a sync of their own: losing
//! one only makes the master repeat settles, which nodes apply idempotently.
//!
//! Not here: node membership, tenants and metadata. Object metadata is rebuilt from the
//! nodes' reports at their remount; the etcd HA issue keeps this state in etcd instead.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::dirlock::DirLock;
use crate::error::{L3Error, L3Result};
use crate::master::SettleLogEntry;

const LOG: &str = "settles.log";
const TMP: &str = "settles.log.tmp";
/// The state dir's lock file (`crate::dirlock`).
const LOCK: &str = "state.lock";
/// Frames larger than this are corrupt (a settle is a few hundred bytes at most).
const MAX_FRAME: u32 = 1 << 20;
/// Below this many appended entries the log is never compacted.
const COMPACT_FLOOR: u64 = 4096;

/// The settle log of a master's state directory.
#[derive(Debug)]
pub struct SettleLog {
    dir: PathBuf,
    file: File,
    /// The state dir's lock, held for the log's life: a second master on the same dir is
    /// refused at start before it reads or changes anything (before, its startup
    /// compaction renamed a new log over the running master's, whose later settles then
    /// went to an unlinked file and were lost).
    /// None once [`SettleLog::close`]d.
    lock: Option<DirLock>,
    /// Entries appended since the last compaction.
    appended: u64,
}

fn io(what: &str, path: &Path, e: std::io::Error) -> L3Error {
    L3Error::FileWriteFail(format!("{what} {}: {e}", path.display()))
}

fn sync_dir(dir: &Path) -> L3Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io("sync directory", dir, e))
}

pub(crate) fn encode(entries: &[SettleLogEntry], out: &mut Vec<u8>) -> L3Result<()> {
    for e in entries {
        let body = bincode::serialize(e)
            .map_err(|e| L3Error::Internal(format!("encode a settle log entry: {e}")))?;
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        out.extend_from_slice(&body);
    }
    Ok(())
}

/// The entries of a log's bytes up to the first torn or corrupt frame, and where it ends.
/// A whole frame (its CRC checks) whose entry does not deserialise — it names a tenant an
/// earlier build allowed and `Tenant::parse` refuses (issue 33) — is skipped alone: nobody
/// can name that tenant any more, and the entries after it must not be lost (a lost settle
/// could bring a removed key back).
pub(crate) fn decode(bytes: &[u8]) -> (Vec<SettleLogEntry>, usize) {
    let mut out = Vec::new();
    let mut at = 0usize;
    while bytes.len() - at >= 8 {
        let len = u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        let crc = u32::from_le_bytes([bytes[at + 4], bytes[at + 5], bytes[at + 6], bytes[at + 7]]);
        if len > MAX_FRAME || bytes.len() - at - 8 < len as usize {
            break;
        }
        let body = &bytes[at + 8..at + 8 + len as usize];
        if crc32c::crc32c(body) != crc {
            break;
        }
        match bincode::deserialize::<SettleLogEntry>(body) {
            Ok(e) => out.push(e),
            Err(e) => {
                tracing::warn!(error = %e, "skipped a settle log entry that no longer parses")
            }
        }
        at += 8 + len as usize;
    }
    (out, at)
}

/// Whether the bytes from `at` on (where [`decode`] stopped) are a torn tail: a crash in the
/// middle of an append leaves a prefix of the batch's frames, the last cut, so nothing whole
/// follows the first bad frame. A whole, checked, parsing frame at any later offset means a
/// frame in the middle went bad and the settles after it would be dropped.
fn tail_is_torn(bytes: &[u8], at: usize) -> bool {
    !(at + 1..bytes.len().saturating_sub(8)).any(|o| {
        let len = u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        let crc = u32::from_le_bytes([bytes[o + 4], bytes[o + 5], bytes[o + 6], bytes[o + 7]]);
        len <= MAX_FRAME
            && bytes.len() - o - 8 >= len as usize
            && crc32c::crc32c(&bytes[o + 8..o + 8 + len as usize]) == crc
            && bincode::deserialize::<SettleLogEntry>(&bytes[o + 8..o + 8 + len as usize]).is_ok()
    })
}

impl SettleLog {
    /// Opens (creating) the log in `dir` and returns the entries it holds, in order. The
    /// caller replays them, then [`SettleLog::compact`]s with the rebuilt state.
    pub fn open(dir: &Path) -> L3Result<(Self, Vec<SettleLogEntry>)> {
        std::fs::create_dir_all(dir).map_err(|e| io("create", dir, e))?;
        let lock = DirLock::acquire(dir, LOCK, "--state-dir")?;
        let path = dir.join(LOG);
        let mut bytes = Vec::new();
        match File::open(&path) {
            Ok(mut f) => {
                f.read_to_end(&mut bytes)
                    .map_err(|e| L3Error::FileReadFail(format!("{}: {e}", path.display())))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(L3Error::FileOpenFail(format!("{}: {e}", path.display()))),
        }
        let (entries, end) = decode(&bytes);
        if end < bytes.len() && !tail_is_torn(&bytes, end) {
            // Going on would drop every settle after the bad frame (and the compaction that
            // follows would make it permanent): removed keys could come back.
            return Err(L3Error::FileReadFail(format!(
                "{}: corrupt frame at byte {end} with whole settles after it; refusing to \
                 start (the settles after it would be lost and removed keys could come \
                 back): restore the file, or move it aside to accept that",
                path.display()
            )));
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| L3Error::FileOpenFail(format!("{}: {e}", path.display())))?;
        Ok((
            SettleLog {
                dir: dir.to_path_buf(),
                file,
                lock: Some(lock),
                appended: 0,
            },
            entries,
        ))
    }

    /// Appends entries (written, not yet synced) and returns the file to sync — a handle
    /// of its own, so the caller syncs without holding the log (group commit).
    pub fn append(&mut self, entries: &[SettleLogEntry]) -> L3Result<File> {
        let mut buf = Vec::new();
        encode(entries, &mut buf)?;
        let path = self.dir.join(LOG);
        self.file
            .write_all(&buf)
            .map_err(|e| io("append to", &path, e))?;
        self.appended += entries.len() as u64;
        self.file.try_clone().map_err(|e| io("clone", &path, e))
    }

    /// Gives the state dir up (its master is shut down): the lock is released, so another
    /// master may open the dir, and this log takes no more entries ([`Self::is_closed`]).
    pub fn close(&mut self) {
        self.lock = None;
    }

    /// Whether [`Self::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.lock.is_none()
    }

    /// Whether the log holds far more than the `live` entries of the current state.
    pub fn wants_compaction(&self, live: usize) -> bool {
        self.appended > COMPACT_FLOOR.max(4 * live as u64)
    }

    /// Replaces the log by `snapshot` (the master's current settles), durably: a crash at
    /// any point leaves either the old log or the new one.
    pub fn compact(&mut self, snapshot: &[SettleLogEntry]) -> L3Result<()> {
        let tmp = self.dir.join(TMP);
        let path = self.dir.join(LOG);
        let mut buf = Vec::new();
        encode(snapshot, &mut buf)?;
        {
            let mut f = File::create(&tmp).map_err(|e| io("create", &tmp, e))?;
            f.write_all(&buf).map_err(|e| io("write", &tmp, e))?;
            f.sync_all().map_err(|e| io("sync", &tmp, e))?;
        }
        std::fs::rename(&tmp, &path).map_err(|e| io("rename", &tmp, e))?;
        sync_dir(&self.dir)?;
        self.file = OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| L3Error::FileOpenFail(format!("{}: {e}", path.display())))?;
        self.appended = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master::{DiskLoc, Settle};
    use crate::types::{ClientId, Tenant};
    use proptest::prelude::*;

    fn entry() -> impl Strategy<Value = SettleLogEntry> {
        prop_oneof![
            (1u64..4, 1u64..100, 0u64..1000, any::<bool>()).prop_map(|(n, seq, x, tomb)| {
                SettleLogEntry::Issued {
                    node: ClientId(n),
                    seq,
                    settle: if tomb {
                        Settle::Tombstone(DiskLoc {
                            bucket: x,
                            offset: x * 7,
                            size: 64,
                            crc: x as u32,
                        })
                    } else {
                        Settle::Cancel {
                            tenant: Tenant::new("t").unwrap(),
                            key: format!("k{x}"),
                            token: x,
                        }
                    },
                }
            }),
            (1u64..4, 0u64..100).prop_map(|(n, applied)| SettleLogEntry::Acked {
                node: ClientId(n),
                applied
            }),
            any::<u64>().prop_map(|floor| SettleLogEntry::TokensBelow { floor }),
        ]
    }

    proptest! {
        /// Whatever was appended reads back in order; a torn tail (any cut) loses only the
        /// entries after the cut, and a flipped byte never yields an entry that was not
        /// written.
        #[test]
        fn appended_entries_read_back_and_a_torn_tail_is_cut(
            entries in proptest::collection::vec(entry(), 0..40),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
        ) {
            let d = tempfile::tempdir().unwrap();
            {
                let (mut log, old) = SettleLog::open(d.path()).unwrap();
                prop_assert!(old.is_empty());
                log.append(&entries).unwrap().sync_data().unwrap();
            }
            let (_, back) = SettleLog::open(d.path()).unwrap();
            prop_assert_eq!(&back, &entries);
            let path = d.path().join(LOG);
            let bytes = std::fs::read(&path).unwrap();
            if !bytes.is_empty() {
                let n = cut.index(bytes.len());
                let (torn, _) = decode(&bytes[..n]);
                prop_assert!(torn.len() <= entries.len());
                prop_assert_eq!(&torn[..], &entries[..torn.len()]);
                let mut bad = bytes.clone();
                let i = flip.index(bad.len());
                bad[i] ^= 0x5A;
                let (read, _) = decode(&bad);
                for (a, b) in read.iter().zip(&entries) {
                    prop_assert_eq!(a, b);
                }
                // Opened, a flipped byte loses at most the last settle (a bad last frame
                // is a torn write); anywhere else the log is refused and left as it was.
                std::fs::write(&path, &bad).unwrap();
                match SettleLog::open(d.path()) {
                    Ok((_, read)) => {
                        prop_assert!(read.len() + 1 >= entries.len(), "{} of {}", read.len(), entries.len());
                        prop_assert_eq!(&read[..], &entries[..read.len()]);
                    }
                    Err(_) => prop_assert_eq!(std::fs::read(&path).unwrap(), bad),
                }
            }
        }
    }

    /// Issue 33: an entry naming a tenant that `Tenant::parse` now refuses (written when
    /// such names got in) is skipped alone; the entries after it still replay.
    #[test]
    fn an_entry_naming_a_refused_tenant_is_skipped_alone() {
        let cancel = |t: &str| SettleLogEntry::Issued {
            node: ClientId(1),
            seq: 1,
            settle: Settle::Cancel {
                tenant: Tenant::new(t).unwrap(),
                key: "k".into(),
                token: 9,
            },
        };
        let acked = SettleLogEntry::Acked {
            node: ClientId(2),
            applied: 7,
        };
        let mut bytes = Vec::new();
        encode(&[cancel("ok"), cancel("zq"), acked.clone()], &mut bytes).unwrap();
        // Make the second entry's tenant "z/", its frame's CRC still right.
        let at = bytes.windows(2).position(|w| w == b"zq").unwrap();
        bytes[at + 1] = b'/';
        let mut frames = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            let len = u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
            frames.push((i, len as usize));
            i += 8 + len as usize;
        }
        let (f, len) = frames[1];
        let crc = crc32c::crc32c(&bytes[f + 8..f + 8 + len]);
        bytes[f + 4..f + 8].copy_from_slice(&crc.to_le_bytes());
        let (read, end) = decode(&bytes);
        assert_eq!(read, vec![cancel("ok"), acked]);
        assert_eq!(end, bytes.len());
    }

    /// Found by an adversarial tester: one flipped byte in a frame with whole frames after
    /// it dropped every later settle silently (decode stops at the first bad frame, and the
    /// startup compaction made it permanent): removed keys came back. A bad frame with a
    /// good one after it is corruption, and the master refuses to start, naming the file and
    /// the offset, with the log left as it was; a bad tail with nothing whole after it is a
    /// torn write (a crash mid-append) and is cut as before.
    #[test]
    fn a_corrupt_frame_with_settles_after_it_refuses_the_log() {
        let e = |applied| SettleLogEntry::Acked {
            node: ClientId(1),
            applied,
        };
        let entries: Vec<_> = (1..=5).map(e).collect();
        let mut bytes = Vec::new();
        encode(&entries, &mut bytes).unwrap();
        let frame = bytes.len() / 5;
        for (what, at, refused) in [
            ("second frame's body", frame + 9, true),
            ("second frame's length", frame, true),
            ("second frame's crc", frame + 5, true),
            ("last frame's body", 4 * frame + 9, false),
        ] {
            let d = tempfile::tempdir().unwrap();
            let mut bad = bytes.clone();
            bad[at] ^= 0x5A;
            std::fs::write(d.path().join(LOG), &bad).unwrap();
            match SettleLog::open(d.path()) {
                Err(err) => {
                    assert!(refused, "{what}: {err}");
                    let msg = err.to_string();
                    assert!(
                        msg.contains(LOG) && msg.contains("corrupt"),
                        "{what}: {msg}"
                    );
                    assert_eq!(std::fs::read(d.path().join(LOG)).unwrap(), bad, "{what}");
                }
                Ok((_, read)) => {
                    assert!(!refused, "{what}: opened with {} entries", read.len());
                    assert_eq!(read, entries[..4], "{what}");
                }
            }
        }
        // a torn tail (any cut inside the last frame) still opens
        for cut in 4 * frame + 1..bytes.len() {
            let d = tempfile::tempdir().unwrap();
            std::fs::write(d.path().join(LOG), &bytes[..cut]).unwrap();
            let (_, read) = SettleLog::open(d.path()).unwrap();
            assert_eq!(read, entries[..4]);
        }
    }

    /// A second open of a state dir in use is refused, naming the dir, and leaves the log
    /// as it was; once the first is closed the dir opens again.
    #[test]
    fn a_state_dir_in_use_is_refused_and_left_alone() {
        let d = tempfile::tempdir().unwrap();
        let e = SettleLogEntry::Acked {
            node: ClientId(1),
            applied: 1,
        };
        let (mut log, _) = SettleLog::open(d.path()).unwrap();
        log.append(std::slice::from_ref(&e))
            .unwrap()
            .sync_data()
            .unwrap();
        let before = std::fs::read(d.path().join(LOG)).unwrap();
        let err = SettleLog::open(d.path()).unwrap_err().to_string();
        assert!(err.contains(&d.path().display().to_string()), "{err}");
        assert_eq!(std::fs::read(d.path().join(LOG)).unwrap(), before);
        drop(log);
        let (_, back) = SettleLog::open(d.path()).unwrap();
        assert_eq!(back, vec![e]);
    }

    #[test]
    fn compaction_replaces_the_log_and_appends_continue() {
        let d = tempfile::tempdir().unwrap();
        let e = |seq| SettleLogEntry::Acked {
            node: ClientId(1),
            applied: seq,
        };
        let (mut log, _) = SettleLog::open(d.path()).unwrap();
        log.append(&[e(1), e(2), e(3)]).unwrap();
        log.compact(&[e(3)]).unwrap();
        log.append(&[e(4)]).unwrap().sync_data().unwrap();
        drop(log);
        let (_, back) = SettleLog::open(d.path()).unwrap();
        assert_eq!(back, vec![e(3), e(4)]);
        assert!(!d.path().join(TMP).exists());
    }
}
