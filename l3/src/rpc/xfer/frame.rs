//! The transfer channel's wire format.
//!
//! Why hand-rolled framing: a `Get` reply must be followed by raw object bytes written
//! straight from the replicas' buffers (one vectored write) and read straight into the
//! caller's, which no message codec allows.
//!
//! Protocol: every message is `u32 little-endian length` + a bincode 1.3 body
//! ([`XferRequest`](super::XferRequest) / [`XferReply`]). A `Get` reply is followed by the
//! raw bytes of every key whose result is `Ok(len)`, in key order. Keys travel packed
//! (`u16 len` + bytes) in one byte string, so neither side allocates a string per key.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;

use serde::{Deserialize, Serialize};

use crate::config::check_batch_keys;
use crate::error::{L3Error, L3Result};
use crate::types::Blob;

use super::XferReply;

/// Packs keys as `u16 len` + bytes.
pub fn pack_keys<K: AsRef<str>>(keys: &[K]) -> L3Result<Vec<u8>> {
    let total: usize = keys.iter().map(|k| k.as_ref().len() + 2).sum();
    let mut out = Vec::with_capacity(total);
    for k in keys {
        let k = k.as_ref().as_bytes();
        let len = u16::try_from(k.len())
            .map_err(|_| L3Error::InvalidKey("key longer than 65535 bytes".into()))?;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(k);
    }
    Ok(out)
}

/// Unpacks keys without copying them: InvalidParams past `max_keys` keys (the batch limit,
/// as the store says it), found before any is unpacked, so a frame of many tiny keys costs
/// no more than the frame.
pub fn unpack_keys(buf: &[u8], max_keys: usize) -> L3Result<Vec<&str>> {
    let mut n = 0usize;
    for_each_key(buf, |_| {
        n += 1;
        Ok(())
    })?;
    check_batch_keys(n, max_keys)?;
    let mut out = Vec::with_capacity(n);
    for_each_key(buf, |k| {
        out.push(
            std::str::from_utf8(k).map_err(|_| L3Error::InvalidKey("key is not UTF-8".into()))?,
        );
        Ok(())
    })?;
    Ok(out)
}

/// Calls `f` with the bytes of each packed key.
fn for_each_key<'a>(buf: &'a [u8], mut f: impl FnMut(&'a [u8]) -> L3Result<()>) -> L3Result<()> {
    let mut i = 0;
    while i < buf.len() {
        let (Some(&lo), Some(&hi)) = (buf.get(i), buf.get(i + 1)) else {
            return Err(L3Error::InvalidParams("truncated key list".into()));
        };
        let start = i + 2;
        let end = start + u16::from_le_bytes([lo, hi]) as usize;
        let k = buf
            .get(start..end)
            .ok_or_else(|| L3Error::InvalidParams("truncated key list".into()))?;
        f(k)?;
        i = end;
    }
    Ok(())
}

/// Writes one frame.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> io::Result<()> {
    let body = bincode::serialize(msg).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)
}

/// Why a frame could not be read.
#[derive(Debug)]
pub enum FrameError {
    /// Clean EOF before a frame started.
    Closed,
    /// I/O failure.
    Io(io::Error),
    /// Announced length over the limit.
    TooLarge(u64),
    /// Body does not decode.
    Malformed(String),
}

/// Reads one frame of at most `max` bytes.
pub fn read_frame<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
    max: usize,
) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(FrameError::Io(e)),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(FrameError::TooLarge(len as u64));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(FrameError::Io)?;
    bincode::deserialize(&body).map_err(|e| FrameError::Malformed(e.to_string()))
}

fn write_all_vectored(w: &mut TcpStream, parts: &[&[u8]]) -> io::Result<()> {
    // Up to 64 slices per writev; partial writes resume inside the current slice.
    let mut idx = 0;
    let mut off = 0;
    while idx < parts.len() {
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(64);
        slices.push(IoSlice::new(&parts[idx][off..]));
        for p in parts.iter().skip(idx + 1).take(63) {
            slices.push(IoSlice::new(p));
        }
        let mut n = w.write_vectored(&slices)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 && idx < parts.len() {
            let left = parts[idx].len() - off;
            if n >= left {
                n -= left;
                idx += 1;
                off = 0;
            } else {
                off += n;
                n = 0;
            }
        }
        while idx < parts.len() && parts[idx].len() == off {
            idx += 1;
            off = 0;
        }
    }
    Ok(())
}

/// Writes a `Get` reply: per-key sizes (checked against `caps`), then the raw bytes.
pub fn send_blobs(
    sock: &mut TcpStream,
    blobs: L3Result<Vec<L3Result<Blob>>>,
    caps: &[u64],
) -> io::Result<()> {
    let blobs = match blobs {
        Ok(b) => b,
        Err(e) => return write_frame(sock, &XferReply::Get(Err(e))),
    };
    let mut sizes = Vec::with_capacity(blobs.len());
    let mut parts: Vec<&[u8]> = Vec::with_capacity(blobs.len() + 1);
    for (b, cap) in blobs.iter().zip(caps) {
        sizes.push(match b {
            Ok(b) if b.len() as u64 > *cap => Err(L3Error::BufferOverflow {
                needed: b.len() as u64,
                have: *cap,
            }),
            Ok(b) => Ok(b.len() as u64),
            Err(e) => Err(e.clone()),
        });
    }
    let body = bincode::serialize(&XferReply::Get(Ok(sizes.clone()))).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    let mut head = Vec::with_capacity(4 + body.len());
    head.extend_from_slice(&len.to_le_bytes());
    head.extend_from_slice(&body);
    parts.push(&head);
    for (b, s) in blobs.iter().zip(&sizes) {
        if let (Ok(b), Ok(_)) = (b, s) {
            parts.push(b.as_slice());
        }
    }
    write_all_vectored(sock, &parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_roundtrip_and_reject_truncation() {
        let ks = vec!["a".to_string(), String::new(), "ñ-key".to_string()];
        let p = pack_keys(&ks).unwrap();
        assert_eq!(unpack_keys(&p, 3).unwrap(), vec!["a", "", "ñ-key"]);
        assert!(unpack_keys(&p[..p.len() - 1], 3).is_err());
        assert!(unpack_keys(&[5, 0, b'a'], 3).is_err());
        assert!(unpack_keys(&[2, 0, 0xFF, 0xFE], 3).is_err());
        assert!(unpack_keys(&[0], 3).is_err());
        assert_eq!(unpack_keys(&[], 0).unwrap(), Vec::<&str>::new());
    }

    #[test]
    fn keys_past_the_limit_are_refused_as_the_store_refuses_them() {
        let p = pack_keys(&["a", "b", "c"]).unwrap();
        match unpack_keys(&p, 2) {
            Err(L3Error::InvalidParams(m)) => assert_eq!(m, "3 keys in one batch; limit is 2"),
            other => panic!("{other:?}"),
        }
        // Counted before anything is unpacked: a bad key past the limit is not looked at.
        let mut bad = p.clone();
        bad.extend_from_slice(&[1, 0, 0xFF]);
        assert!(matches!(
            unpack_keys(&bad, 3),
            Err(L3Error::InvalidParams(_))
        ));
        assert!(matches!(unpack_keys(&bad, 4), Err(L3Error::InvalidKey(_))));
    }
}
