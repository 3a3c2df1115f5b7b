//! Tombstone sidecars: which records of a bucket were removed.
//!
//! Why a sidecar and not a rewrite: a bucket is written once and never changed, so a remove
//! appends the record's index to `<id>.tomb` and syncs it before it is acknowledged; a
//! restart reads the sidecar and does not bring the record back. Each entry carries a CRC
//! over the bucket id and the index, so a flipped bit or an entry copied from another
//! bucket's sidecar is seen, and the whole bucket is then untrusted (see the format's docs
//! in [`super`]).

use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::path::Path;

use super::{TOMB_REC, open_regular, sync_dir, tomb_path};

fn tomb_crc(id: u64, index: u32) -> u32 {
    let c = crc32c::crc32c(&id.to_le_bytes());
    crc32c::crc32c_append(c, &index.to_le_bytes())
}

/// Appends tombstones (record indices) to a bucket's sidecar and syncs them (and the
/// directory, when the sidecar is new) before returning: a remove acknowledged after this
/// survives a crash.
pub fn append_tombstones(dir: &Path, id: u64, indices: &[u32]) -> io::Result<()> {
    let path = tomb_path(dir, id);
    let (mut f, created) = match OpenOptions::new().append(true).create_new(true).open(&path) {
        Ok(f) => (f, true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            use std::os::unix::fs::OpenOptionsExt;
            // Never through a symlink, never into anything but a regular file.
            let f = OpenOptions::new()
                .append(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(&path)?;
            if !f.metadata()?.is_file() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "tombstone file is not a regular file",
                ));
            }
            (f, false)
        }
        Err(e) => return Err(e),
    };
    // A torn record of an append that failed part-way (never acknowledged) is cut first, so
    // this one lands aligned (a misaligned one failed every checksum past the tear at restart,
    // and the whole bucket was dropped).
    let len = f.metadata()?.len();
    let whole = len - len % TOMB_REC as u64;
    if whole != len {
        f.set_len(whole)?;
    }
    let mut buf = Vec::with_capacity(indices.len() * TOMB_REC);
    for &i in indices {
        buf.extend_from_slice(&i.to_le_bytes());
        buf.extend_from_slice(&tomb_crc(id, i).to_le_bytes());
    }
    if let Err(e) = f.write_all(&buf) {
        // what was written of this append goes (best effort: the next append cuts it too)
        if let Err(cut) = f.set_len(whole) {
            tracing::warn!(
                "tombstones {}: cutting a failed append: {cut}",
                path.display()
            );
        }
        return Err(e);
    }
    f.sync_data()?;
    if created {
        sync_dir(dir)?;
    }
    Ok(())
}

/// A bucket's tombstones as read at restart.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tombstones {
    /// Indices of removed records.
    pub dead: Vec<u32>,
    /// A complete record failed its checksum: which record it removed is unknown, so no
    /// record of the bucket can be trusted to be alive.
    pub corrupt: bool,
}

/// Reads a bucket's tombstones (missing file = none). A torn last record (a crash inside
/// the append, never acknowledged) is ignored and cut off, so later appends stay aligned.
pub fn read_tombstones(dir: &Path, id: u64) -> io::Result<Tombstones> {
    let path = tomb_path(dir, id);
    // Not a regular file (a symlink, a directory, a FIFO): an error, so the bucket is dropped
    // and nothing outside the directory is read or cut.
    let mut b = Vec::new();
    match open_regular(&path, false) {
        Ok(mut f) => f.read_to_end(&mut b)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Tombstones::default()),
        Err(e) => return Err(e),
    };
    let whole = b.len() - b.len() % TOMB_REC;
    if whole != b.len() {
        let f = open_regular(&path, true)?;
        f.set_len(whole as u64)?;
        f.sync_data()?;
    }
    let mut out = Tombstones::default();
    for c in b[..whole].chunks_exact(TOMB_REC) {
        let index = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        let crc = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
        if crc == tomb_crc(id, index) {
            out.dead.push(index);
        } else {
            out.corrupt = true;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An append that failed part-way while the server ran (`write_all` past a full disk or
    /// `RLIMIT_FSIZE`: the remove was refused, -1103) leaves a torn record; the next append
    /// used to land after it, misaligned, so at restart every record past the tear failed its
    /// checksum and the whole bucket was dropped (its live records lost). The torn bytes are
    /// cut before appending.
    #[test]
    fn an_append_after_a_torn_one_stays_aligned() {
        let d = tempfile::tempdir().expect("tempdir");
        append_tombstones(d.path(), 9, &[3]).expect("append");
        // the torn half of a record whose append failed
        let mut f = OpenOptions::new()
            .append(true)
            .open(tomb_path(d.path(), 9))
            .expect("open");
        f.write_all(&[0xAB; TOMB_REC / 2]).expect("tear");
        drop(f);
        append_tombstones(d.path(), 9, &[5, 7]).expect("append after the tear");
        let t = read_tombstones(d.path(), 9).expect("read");
        assert_eq!(
            t,
            Tombstones {
                dead: vec![3, 5, 7],
                corrupt: false
            }
        );
    }
}
