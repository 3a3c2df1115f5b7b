//! The server's wire codec: tarpc's bincode, with every request's deadline clamped before
//! tarpc turns it into an `Instant`.
//!
//! Why: a request carries its deadline as a relative `Duration`; tarpc adds it to
//! `Instant::now()` (a panic on overflow) and files the request in a timer wheel that panics
//! for deadlines past ~2^36 ms. Both happen inside tarpc, on bytes any peer controls, before
//! our code sees the request. So the codec rewrites an out-of-range deadline in the frame
//! itself to [`MAX_REQUEST_DEADLINE`]; in-range frames (all of them, in practice) are
//! deserialized in place, with no copy.
//!
//! How: with bincode's default options (varint integers), a request frame starts with the
//! `ClientMessage` variant (varint 0 = `Request`), then the context's deadline as
//! `secs: u64` (varint) and `nanos: u32` (varint).

use std::io;
use std::marker::PhantomData;
use std::pin::Pin;
use std::time::Duration;

use bincode::Options;
use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tarpc::tokio_serde::{Deserializer, Serializer};

/// Longest deadline a request may ask for; longer ones are cut to this (one day).
pub const MAX_REQUEST_DEADLINE: Duration = Duration::from_secs(86_400);

/// Bincode with request deadlines clamped (server side).
/// Same options as tarpc's `Bincode::default()` (bincode's `DefaultOptions`).
pub struct ClampedBincode<Item, SinkItem>(PhantomData<fn() -> (Item, SinkItem)>);

impl<Item, SinkItem> Default for ClampedBincode<Item, SinkItem> {
    fn default() -> Self {
        ClampedBincode(PhantomData)
    }
}

fn invalid(e: bincode::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// A varint as bincode writes it: (value, encoded length). None: not a valid u64 varint.
fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let first = *b.first()?;
    let le = |n: usize| -> Option<u64> {
        let s = b.get(1..1 + n)?;
        let mut a = [0u8; 8];
        a[..n].copy_from_slice(s);
        Some(u64::from_le_bytes(a))
    };
    match first {
        0..=250 => Some((first as u64, 1)),
        251 => Some((le(2)?, 3)),
        252 => Some((le(4)?, 5)),
        253 => Some((le(8)?, 9)),
        _ => None, // 254 (u128) cannot be a u64; 255 is reserved
    }
}

fn write_varint(out: &mut Vec<u8>, v: u64) {
    match v {
        0..=250 => out.push(v as u8),
        251..=0xFFFF => {
            out.push(251);
            out.extend_from_slice(&(v as u16).to_le_bytes());
        }
        0x1_0000..=0xFFFF_FFFF => {
            out.push(252);
            out.extend_from_slice(&(v as u32).to_le_bytes());
        }
        _ => {
            out.push(253);
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// The frame with its request deadline clamped, or None when it needs no change (not a
/// request, in range, or malformed: bincode reports malformed frames itself).
pub fn clamp_deadline(src: &[u8]) -> Option<Vec<u8>> {
    let (variant, vl) = varint(src)?;
    if variant != 0 {
        return None;
    }
    let (secs, sl) = varint(&src[vl..])?;
    let (nanos, nl) = varint(&src[vl + sl..])?;
    let max = MAX_REQUEST_DEADLINE;
    if secs < max.as_secs() || (secs == max.as_secs() && nanos <= max.subsec_nanos() as u64) {
        return None;
    }
    let mut out = Vec::with_capacity(src.len());
    write_varint(&mut out, 0);
    write_varint(&mut out, max.as_secs());
    write_varint(&mut out, max.subsec_nanos() as u64);
    out.extend_from_slice(&src[vl + sl + nl..]);
    Some(out)
}

impl<Item, SinkItem> Deserializer<Item> for ClampedBincode<Item, SinkItem>
where
    for<'a> Item: Deserialize<'a>,
{
    type Error = io::Error;

    fn deserialize(self: Pin<&mut Self>, src: &BytesMut) -> Result<Item, io::Error> {
        let opts = bincode::DefaultOptions::new();
        match clamp_deadline(src) {
            None => opts.deserialize(src),
            Some(fixed) => opts.deserialize(&fixed),
        }
        .map_err(invalid)
    }
}

impl<Item, SinkItem> Serializer<SinkItem> for ClampedBincode<Item, SinkItem>
where
    SinkItem: Serialize,
{
    type Error = io::Error;

    fn serialize(self: Pin<&mut Self>, item: &SinkItem) -> Result<Bytes, io::Error> {
        bincode::DefaultOptions::new()
            .serialize(item)
            .map(Bytes::from)
            .map_err(invalid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_clamp_only_long_deadlines() {
        for v in [
            0u64,
            250,
            251,
            65_535,
            65_536,
            u32::MAX as u64,
            u32::MAX as u64 + 1,
            u64::MAX,
        ] {
            let mut b = Vec::new();
            write_varint(&mut b, v);
            assert_eq!(varint(&b), Some((v, b.len())));
        }
        let frame = |secs: u64, nanos: u64| {
            let mut b = Vec::new();
            write_varint(&mut b, 0);
            write_varint(&mut b, secs);
            write_varint(&mut b, nanos);
            b.extend_from_slice(b"rest");
            b
        };
        assert_eq!(clamp_deadline(&frame(10, 5)), None);
        assert_eq!(clamp_deadline(&frame(86_400, 0)), None);
        assert_eq!(clamp_deadline(&frame(86_400, 1)), Some(frame(86_400, 0)));
        assert_eq!(
            clamp_deadline(&frame(u64::MAX, 999)),
            Some(frame(86_400, 0))
        );
        // Not a request (Cancel is variant 1), or truncated: untouched.
        let mut cancel = frame(u64::MAX, 0);
        cancel[0] = 1;
        assert_eq!(clamp_deadline(&cancel), None);
        assert_eq!(clamp_deadline(&[0, 253, 1]), None);
        assert_eq!(clamp_deadline(&[]), None);
    }
}
