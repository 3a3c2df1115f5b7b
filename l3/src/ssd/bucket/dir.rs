//! What a bucket directory holds, and the durable bound on bucket ids.
//!
//! Why a scan at start: the directory is the tier's only index after a crash. The scan
//! lists buckets, finds sidecars whose bucket is gone (a crash between the two unlinks of
//! [`delete_bucket`]) and removes temporary files of interrupted writes; only regular files
//! whose names parse as ids below [`MAX_BUCKET_ID`] are the tier's, anything else is left
//! alone. Bucket ids are never reused: `next-bucket-id` records, durably, a bound below
//! which ids may have been used.

use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::path::Path;

use super::{
    MAX_BUCKET_ID, NEXT_ID_FILE, NEXT_ID_MAGIC, bucket_path, open_regular, sync_dir, tomb_path,
};

/// Removes a bucket and its sidecar.
pub fn delete_bucket(dir: &Path, id: u64) -> io::Result<()> {
    // The bucket goes first: a crash between the two unlinks leaves an orphan sidecar
    // (removed at startup), never a bucket without its tombstones.
    match fs::remove_file(bucket_path(dir, id)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let tomb = tomb_path(dir, id);
    match fs::symlink_metadata(&tomb) {
        Ok(m) if !m.is_file() => {
            // Not one kvtier wrote (a symlink, a directory, a FIFO): left alone.
            tracing::warn!(
                bucket = id,
                "tombstone path is not a regular file: left alone"
            );
            return Ok(());
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        _ => {}
    }
    match fs::remove_file(&tomb) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// What a directory holds: bucket ids, tombstone sidecars without a bucket (orphans of a
/// crash between the two unlinks of [`delete_bucket`]) and the highest id any file names.

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DirScan {
    /// Bucket ids, ascending.
    pub buckets: Vec<u64>,
    /// Ids of `.tomb` files whose bucket is gone.
    pub orphan_tombs: Vec<u64>,
    /// Highest id named by any bucket, sidecar or temporary file.
    pub max_id: Option<u64>,
}

/// Lists a directory; removes leftover temporary files of interrupted writes.
pub fn scan_dir(dir: &Path) -> io::Result<DirScan> {
    let mut out = DirScan::default();
    let mut tombs = Vec::new();
    for e in fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let (stem, kind) = if let Some(s) = name.strip_suffix(".bkt.tmp") {
            (s, 0)
        } else if let Some(s) = name.strip_suffix(".bkt") {
            (s, 1)
        } else if let Some(s) = name.strip_suffix(".tomb") {
            (s, 2)
        } else {
            continue;
        };
        let Ok(id) = stem.parse::<u64>() else {
            continue;
        };
        if id >= MAX_BUCKET_ID {
            tracing::warn!(
                file = name,
                "bucket id out of range (not kvtier's): skipped, left alone"
            );
            continue;
        }
        // Counted even when skipped below, so a new bucket never collides with its name.
        out.max_id = Some(out.max_id.map_or(id, |m| m.max(id)));
        // Only regular files are buckets, tombstones or temporary files (`file_type` does
        // not follow symlinks): a directory, FIFO or symlink is skipped and left alone.
        if !e.file_type()?.is_file() {
            tracing::warn!(file = name, "not a regular file: skipped, left alone");
            continue;
        }
        match kind {
            0 => {
                if let Err(e) = fs::remove_file(e.path()) {
                    tracing::warn!(bucket = id, error = %e, "could not remove a temporary bucket");
                }
            }
            1 => out.buckets.push(id),
            _ => tombs.push(id),
        }
    }
    out.buckets.sort_unstable();
    out.orphan_tombs = tombs
        .into_iter()
        .filter(|t| out.buckets.binary_search(t).is_err())
        .collect();
    out.orphan_tombs.sort_unstable();
    Ok(out)
}

/// Bucket ids in a directory; removes leftover temporary files of interrupted writes.
pub fn list_buckets(dir: &Path) -> io::Result<Vec<u64>> {
    Ok(scan_dir(dir)?.buckets)
}

/// The reserved id bound stored in the directory (None: missing or unreadable).
pub fn read_next_id(dir: &Path) -> Option<u64> {
    let mut b = Vec::new();
    open_regular(&dir.join(NEXT_ID_FILE), false)
        .ok()?
        .read_to_end(&mut b)
        .ok()?;
    if b.len() != 20 || &b[..8] != NEXT_ID_MAGIC {
        return None;
    }
    let crc = u32::from_le_bytes([b[16], b[17], b[18], b[19]]);
    if crc32c::crc32c(&b[..16]) != crc {
        return None;
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&b[8..16]);
    Some(u64::from_le_bytes(n))
}

/// Durably records that ids below `bound` may have been used (tmp file, fsync, rename,
/// fsync dir): a restart starts at or above it.
pub fn write_next_id(dir: &Path, bound: u64) -> io::Result<()> {
    let mut b = Vec::with_capacity(20);
    b.extend_from_slice(NEXT_ID_MAGIC);
    b.extend_from_slice(&bound.to_le_bytes());
    b.extend_from_slice(&crc32c::crc32c(&b).to_le_bytes());
    let tmp = dir.join(format!("{NEXT_ID_FILE}.tmp"));
    let res = (|| {
        // A leftover (or planted) temporary name is unlinked, never written through.
        match fs::remove_file(&tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(&b)?;
        f.sync_data()?;
        fs::rename(&tmp, dir.join(NEXT_ID_FILE))?;
        sync_dir(dir)
    })();
    if res.is_err()
        && let Err(e) = fs::remove_file(&tmp)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(error = %e, "could not remove {NEXT_ID_FILE}.tmp");
    }
    res
}
