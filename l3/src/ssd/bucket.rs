//! Bucket files: the on-disk format of the SSD tier.
//!
//! Why buckets: one file per object (Mooncake's file-per-key backend) costs an inode and an
//! open per object; one file per batch of offloaded objects ("bucket", Mooncake's bucket
//! backend) keeps the file count small and turns many small writes into one sequential one.
//! A bucket is written once, to a temporary name, synced, then renamed: a bucket file that
//! exists under its final name is complete and durable, and a failed write leaves nothing
//! (the temporary file is removed and nothing is registered).
//!
//! Format (little endian):
//! ```text
//! file   := "KVL3BKT1" bucket_id:u64 record*
//! record := magic:u32 tenant_len:u16 key_len:u16 size:u64 crc:u32 hdr_crc:u32 tenant key payload
//! ```
//! `crc` is CRC32C of the payload (checked on every read: a mismatch is a miss, never data);
//! `hdr_crc` covers the first 20 header bytes plus tenant and key, so a rescan never trusts a
//! torn or corrupted header. Removed records are listed in a sidecar `<id>.tomb` file
//! (u32 record indices) so a restart does not bring them back.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// File magic.
pub const FILE_MAGIC: &[u8; 8] = b"KVL3BKT1";
/// Record magic.
pub const REC_MAGIC: u32 = 0x4B56_3352;
/// File header length.
pub const FILE_HDR: u64 = 16;
/// Record header length.
pub const REC_HDR: usize = 24;

/// Path of a bucket file.
pub fn bucket_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:020}.bkt"))
}

/// Path of a bucket's tombstone sidecar.
pub fn tomb_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:020}.tomb"))
}

fn tmp_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:020}.bkt.tmp"))
}

/// One object to write.
pub struct NewRecord<'a> {
    /// Tenant name.
    pub tenant: &'a str,
    /// Key.
    pub key: &'a str,
    /// Payload.
    pub data: &'a [u8],
}

/// Where a record landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// Payload offset.
    pub offset: u64,
    /// Payload CRC32C.
    pub crc: u32,
}

fn rec_header(tenant: &str, key: &str, size: u64, crc: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(REC_HDR + tenant.len() + key.len());
    h.extend_from_slice(&REC_MAGIC.to_le_bytes());
    h.extend_from_slice(&(tenant.len() as u16).to_le_bytes());
    h.extend_from_slice(&(key.len() as u16).to_le_bytes());
    h.extend_from_slice(&size.to_le_bytes());
    h.extend_from_slice(&crc.to_le_bytes());
    let mut hc = crc32c::crc32c(&h);
    hc = crc32c::crc32c_append(hc, tenant.as_bytes());
    hc = crc32c::crc32c_append(hc, key.as_bytes());
    h.extend_from_slice(&hc.to_le_bytes());
    h.extend_from_slice(tenant.as_bytes());
    h.extend_from_slice(key.as_bytes());
    h
}

/// Writes a complete bucket durably (tmp file, fsync, rename, fsync dir). On any error the
/// temporary file is removed and the error returned: nothing of it is visible afterwards.
pub fn write_bucket(dir: &Path, id: u64, recs: &[NewRecord<'_>]) -> io::Result<Vec<Written>> {
    let tmp = tmp_path(dir, id);
    let res = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        let mut out = Vec::with_capacity(recs.len());
        let mut hdr = Vec::with_capacity(16);
        hdr.extend_from_slice(FILE_MAGIC);
        hdr.extend_from_slice(&id.to_le_bytes());
        f.write_all(&hdr)?;
        let mut pos = FILE_HDR;
        for r in recs {
            let crc = crc32c::crc32c(r.data);
            let h = rec_header(r.tenant, r.key, r.data.len() as u64, crc);
            f.write_all(&h)?;
            pos += h.len() as u64;
            f.write_all(r.data)?;
            out.push(Written { offset: pos, crc });
            pos += r.data.len() as u64;
        }
        f.sync_data()?;
        drop(f);
        fs::rename(&tmp, bucket_path(dir, id))?;
        File::open(dir)?.sync_all()?;
        Ok(out)
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
        let _ = fs::remove_file(bucket_path(dir, id));
    }
    res
}

/// Reads a payload into `buf` (exactly `buf.len()` bytes at `offset`) and checks its CRC.
/// Returns `Ok(false)` on a checksum mismatch or a short file: the caller treats it as a miss.
pub fn read_verified(f: &File, offset: u64, crc: u32, buf: &mut [u8]) -> io::Result<bool> {
    match f.read_exact_at(buf, offset) {
        Ok(()) => Ok(crc32c::crc32c(buf) == crc),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// A record found by a rescan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedRecord {
    /// Index in the bucket.
    pub index: u32,
    /// Tenant name.
    pub tenant: String,
    /// Key.
    pub key: String,
    /// Payload offset.
    pub offset: u64,
    /// Payload size.
    pub size: u64,
    /// Payload CRC32C.
    pub crc: u32,
}

/// Parses a bucket's record headers (payloads are verified later, on read). Stops at the
/// first torn or corrupt header: records before it stay usable. Returns (records, file size).
pub fn scan_bucket(path: &Path) -> io::Result<(Vec<ScannedRecord>, u64)> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    let mut hdr = [0u8; 16];
    if len < FILE_HDR || f.read_exact(&mut hdr).is_err() || &hdr[..8] != FILE_MAGIC {
        return Ok((Vec::new(), len));
    }
    let mut out = Vec::new();
    let mut pos = FILE_HDR;
    let mut index = 0u32;
    loop {
        if pos + REC_HDR as u64 > len {
            break;
        }
        let mut h = [0u8; REC_HDR];
        f.seek(SeekFrom::Start(pos))?;
        if f.read_exact(&mut h).is_err() {
            break;
        }
        let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
        let tl = u16::from_le_bytes([h[4], h[5]]) as usize;
        let kl = u16::from_le_bytes([h[6], h[7]]) as usize;
        let mut s8 = [0u8; 8];
        s8.copy_from_slice(&h[8..16]);
        let size = u64::from_le_bytes(s8);
        let crc = u32::from_le_bytes([h[16], h[17], h[18], h[19]]);
        let hcrc = u32::from_le_bytes([h[20], h[21], h[22], h[23]]);
        if magic != REC_MAGIC {
            break;
        }
        let mut tk = vec![0u8; tl + kl];
        if f.read_exact(&mut tk).is_err() {
            break;
        }
        let mut c = crc32c::crc32c(&h[..20]);
        c = crc32c::crc32c_append(c, &tk);
        if c != hcrc {
            break;
        }
        let payload = pos + (REC_HDR + tl + kl) as u64;
        if payload.saturating_add(size) > len {
            break;
        }
        let (Ok(tenant), Ok(key)) = (
            String::from_utf8(tk[..tl].to_vec()),
            String::from_utf8(tk[tl..].to_vec()),
        ) else {
            break;
        };
        out.push(ScannedRecord {
            index,
            tenant,
            key,
            offset: payload,
            size,
            crc,
        });
        index += 1;
        pos = payload + size;
    }
    Ok((out, len))
}

/// Appends a tombstone (record index) to a bucket's sidecar.
pub fn append_tombstone(dir: &Path, id: u64, index: u32) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(tomb_path(dir, id))?;
    f.write_all(&index.to_le_bytes())
}

/// Reads a bucket's tombstones (missing file = none).
pub fn read_tombstones(dir: &Path, id: u64) -> Vec<u32> {
    match fs::read(tomb_path(dir, id)) {
        Ok(b) => b
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Removes a bucket and its sidecar.
pub fn delete_bucket(dir: &Path, id: u64) -> io::Result<()> {
    let r = fs::remove_file(bucket_path(dir, id));
    let _ = fs::remove_file(tomb_path(dir, id));
    match r {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Bucket ids in a directory; removes leftover temporary files of interrupted writes.
pub fn list_buckets(dir: &Path) -> io::Result<Vec<u64>> {
    let mut ids = Vec::new();
    for e in fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.ends_with(".bkt.tmp") {
            let _ = fs::remove_file(e.path());
        } else if let Some(stem) = name.strip_suffix(".bkt")
            && let Ok(id) = stem.parse::<u64>()
        {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_corruption() {
        let d = tempfile::tempdir().unwrap();
        let recs = [
            NewRecord {
                tenant: "t",
                key: "a",
                data: b"hello",
            },
            NewRecord {
                tenant: "t",
                key: "bb",
                data: &[7u8; 1000],
            },
        ];
        let w = write_bucket(d.path(), 3, &recs).unwrap();
        let (scan, _) = scan_bucket(&bucket_path(d.path(), 3)).unwrap();
        assert_eq!(scan.len(), 2);
        assert_eq!(scan[1].key, "bb");
        assert_eq!(scan[1].offset, w[1].offset);
        let f = File::open(bucket_path(d.path(), 3)).unwrap();
        let mut buf = vec![0u8; 5];
        assert!(read_verified(&f, w[0].offset, w[0].crc, &mut buf).unwrap());
        assert_eq!(&buf, b"hello");
        // Flip one payload byte: the read is a miss.
        let f2 = OpenOptions::new()
            .write(true)
            .open(bucket_path(d.path(), 3))
            .unwrap();
        f2.write_all_at(b"J", w[0].offset).unwrap();
        assert!(!read_verified(&f, w[0].offset, w[0].crc, &mut buf).unwrap());
        assert_eq!(list_buckets(d.path()).unwrap(), vec![3]);
    }
}
