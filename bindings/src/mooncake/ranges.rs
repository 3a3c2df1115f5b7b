//! The pointer-taking reads and writes of the compatible core that go beyond one key → one
//! buffer: multi-buffer puts and gets, byte-range reads (`get_into_ranges`), and the replica
//! calls (`get_replica_desc`, `batch_replica_clear`). Return conventions are Mooncake 0.3.13's
//! as measured side by side (bindings/tests/test_mooncake_real.py).

use kvtier_l3::{L3Error, L3Result, L3Store, ReplicaDescriptor, Tenant};

use super::INVALID_PARAMS;
use super::batch::{bad_segment_code, mc_get_code};
use super::registered::{RegionUse, RegisteredRange};
use super::segment::{segment_by_name, segment_name};
use crate::l3::code_of;
use crate::overlap::overlapping;

/// Per key: its parts as registered ranges, or None if any part is not registered or the
/// pointer and size lists differ in length (or are empty).
pub(crate) fn multi_parts<'u>(
    calls: &'u RegionUse<'_>,
    all_ptrs: &[Vec<u64>],
    all_sizes: &[Vec<i64>],
) -> Vec<Option<Vec<RegisteredRange<'u>>>> {
    all_ptrs
        .iter()
        .zip(all_sizes)
        .map(|(ps, ns)| {
            if ps.len() != ns.len() || ps.is_empty() {
                return None;
            }
            ps.iter()
                .zip(ns)
                .map(|(p, n)| calls.check(*p, *n))
                .collect()
        })
        .collect()
}

/// Marks as unusable (None) every key one of whose parts overlaps another part, of this key
/// or of another: a key's bytes land only where it asked, and no other key's do.
pub(crate) fn drop_overlapping_keys(parts: &mut [Option<Vec<RegisteredRange>>]) {
    let owned: Vec<(usize, (usize, usize))> = parts
        .iter()
        .enumerate()
        .flat_map(|(k, p)| p.iter().flatten().map(move |r| (k, r.span())))
        .collect();
    let spans: Vec<(usize, usize)> = owned.iter().map(|&(_, s)| s).collect();
    for (&(k, _), bad) in owned.iter().zip(overlapping(&spans)) {
        if bad {
            parts[k] = None;
        }
    }
}

/// One object's bytes: its parts concatenated in order.
pub(crate) fn gather(parts: &[RegisteredRange]) -> Vec<u8> {
    let mut out = Vec::with_capacity(parts.iter().map(|r| r.len()).sum());
    for r in parts {
        // SAFETY: every part came from `RegionUse::check`.
        out.extend_from_slice(unsafe { r.bytes() });
    }
    out
}

/// Copies `src` over `parts` in order (each part filled before the next).
pub(crate) fn scatter(mut src: &[u8], parts: &[RegisteredRange]) {
    for part in parts {
        let k = part.len().min(src.len());
        // SAFETY: registered memory; parts are written one at a time, so no two live slices
        // alias even if parts overlap.
        let dst = unsafe { part.bytes_mut() };
        dst[..k].copy_from_slice(&src[..k]);
        src = &src[k..];
    }
}

/// Mooncake's `get_into_ranges` for one buffer: per key, per range the bytes copied or a
/// negative code. Ranges are copied in order, one at a time: destinations that overlap are
/// Mooncake's semantics (a later range overwrites an earlier one; measured against Mooncake
/// 0.3.13, bindings/tests/mooncake_api_driver.py), not refused. A key whose range lists differ in length, or that is missing, gets its
/// code once per range (at least once).
#[allow(clippy::too_many_arguments)]
pub(crate) fn get_ranges_into(
    s: &dyn L3Store,
    t: &Tenant,
    calls: &RegionUse<'_>,
    buffer: u64,
    keys: &[String],
    dst: &[Vec<i64>],
    src: &[Vec<i64>],
    sizes: &[Vec<i64>],
) -> Vec<Vec<i64>> {
    if keys.len() != dst.len() || keys.len() != src.len() || keys.len() != sizes.len() {
        return keys.iter().map(|_| vec![INVALID_PARAMS]).collect();
    }
    keys.iter()
        .enumerate()
        .map(|(k, key)| {
            let (d, sr, n) = (&dst[k], &src[k], &sizes[k]);
            let fill = |c: i64| vec![c; d.len().max(1)];
            if d.len() != sr.len() || d.len() != n.len() {
                return fill(INVALID_PARAMS);
            }
            let obj = match s.get(t, key) {
                Ok(v) => v,
                Err(e) => return fill(mc_get_code(Err(e))),
            };
            (0..d.len())
                .map(|j| copy_range(calls, buffer, &obj, d[j], sr[j], n[j]))
                .collect()
        })
        .collect()
}

/// Copies `obj[src .. src + n]` to `buffer + dst`; n, or INVALID_PARAMS for a range outside
/// the object or outside registered memory.
fn copy_range(calls: &RegionUse<'_>, buffer: u64, obj: &[u8], dst: i64, src: i64, n: i64) -> i64 {
    let (Ok(d), Ok(sr), Ok(len)) = (u64::try_from(dst), usize::try_from(src), usize::try_from(n))
    else {
        return INVALID_PARAMS;
    };
    let Some(from) = sr.checked_add(len).and_then(|end| obj.get(sr..end)) else {
        return INVALID_PARAMS;
    };
    let Some(to) = buffer.checked_add(d).and_then(|p| calls.check(p, n)) else {
        return INVALID_PARAMS;
    };
    // SAFETY: a checked range; one live slice at a time.
    unsafe { to.bytes_mut() }.copy_from_slice(from);
    n
}

/// One replica as the Python layer builds its `ReplicaDescriptor`:
/// (is_memory, segment or file name, address or offset, size).
pub(crate) type ReplicaRow = (bool, String, u64, u64);

/// The replicas of `key` (empty if it is missing or the query fails, as Mooncake returns).
pub(crate) fn replica_rows(s: &dyn L3Store, t: &Tenant, key: &str) -> Vec<ReplicaRow> {
    let Ok(q) = s.get_replica_list(t, key) else {
        return Vec::new();
    };
    q.replicas
        .iter()
        .map(|r| match r {
            ReplicaDescriptor::Memory {
                segment,
                alloc,
                size,
                ..
            } => (true, segment_name(*segment), *alloc, *size),
            ReplicaDescriptor::Disk {
                bucket,
                offset,
                size,
                ..
            } => (false, format!("bucket-{bucket}"), *offset, *size),
        })
        .collect()
}

/// Mooncake's `batch_replica_clear`: the keys whose replicas were cleared, a leased object
/// kept (Mooncake: "requires lease to be expired"). Without `segment` every replica goes
/// (the object is removed); with one, only the key's replica in that segment
/// (`L3Store::batch_replica_clear`): a replica in another segment keeps the object readable,
/// as in Mooncake. A name that is no segment clears nothing.
pub(crate) fn replica_clear(
    s: &dyn L3Store,
    t: &Tenant,
    keys: &[String],
    segment: &str,
) -> Vec<String> {
    if segment.is_empty() {
        return keys
            .iter()
            .filter(|k| s.remove(t, k, false).is_ok())
            .cloned()
            .collect();
    }
    let Some(seg) = segment_by_name(segment) else {
        return Vec::new();
    };
    let valid: Vec<String> = keys
        .iter()
        .filter(|k| kvtier_l3::types::validate_key(k).is_ok())
        .cloned()
        .collect();
    match s.batch_replica_clear(t, &valid, seg) {
        Ok(v) => valid
            .into_iter()
            .zip(v)
            .filter(|(_, r)| matches!(r, Ok(true)))
            .map(|(k, _)| k)
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Mooncake's `create_copy_task(key, targets)` (see `MooncakeCore::copy_replica`).
pub(crate) fn copy_replica(s: &dyn L3Store, t: &Tenant, key: &str, targets: &[String]) -> i64 {
    if targets.is_empty() {
        // Refused before the key is looked up (Mooncake: -600 even for a missing key).
        return INVALID_PARAMS;
    }
    let segs: Option<Vec<_>> = targets.iter().map(|n| segment_by_name(n)).collect();
    let Some(segs) = segs else {
        return bad_segment_code(s, t, key);
    };
    for seg in segs {
        if let Err(e) = s.copy_replica(t, key, seg) {
            return i64::from(e.code_i32());
        }
    }
    0
}

/// Mooncake's `create_move_task(key, source, target)` (see `MooncakeCore::move_replica`).
pub(crate) fn move_replica(
    s: &dyn L3Store,
    t: &Tenant,
    key: &str,
    source: &str,
    target: &str,
) -> i64 {
    match (segment_by_name(source), segment_by_name(target)) {
        (Some(src), Some(dst)) => code_of(&s.move_replica(t, key, src, dst)),
        _ => bad_segment_code(s, t, key),
    }
}

/// Ignores a missing key (an upsert of a new key has nothing to remove).
pub(crate) fn removed_or_missing(r: L3Result<()>) -> L3Result<()> {
    match r {
        Err(L3Error::ObjectNotFound) => Ok(()),
        r => r,
    }
}
