//! Is an address range mapped, readable and writable, in this process right now?
//!
//! Why: `register_buffer(ptr, size)` takes an integer the caller computed; before this check
//! a wild value (`0x1000`, a freed buffer's old address, a device pointer) was accepted, and
//! the next `get_into` into it killed the process with SIGSEGV. Registration is where the
//! promise "pointers lie in registered memory, never wild memory" (docs/bindings.md) is
//! made, so it is where the range is checked: it must be covered, without a gap, by mappings
//! that are readable and writable (the pointer calls both read from and write to it).
//!
//! How: the kernel's list of this process's mappings, `/proc/self/maps` (sorted by address,
//! one `start-end perms ...` line per mapping). Reading it costs a few hundred microseconds
//! for a large process, which registration (rare) can afford and a per-call check could not.
//!
//! What it does not promise: memory unmapped *after* registration is not noticed (a check at
//! each call would race the unmapping anyway); a caller frees a buffer only after
//! `unregister_buffer`, as Mooncake requires. On systems without `/proc/self/maps` the
//! range is refused (nothing could vouch for it).

/// Whether `[start, start + len)` lies entirely in readable and writable mappings.
pub(crate) fn is_mapped_rw(start: usize, len: usize) -> bool {
    let Some(end) = start.checked_add(len) else {
        return false;
    };
    match std::fs::read_to_string("/proc/self/maps") {
        Ok(maps) => covered(&maps, start, end),
        Err(_) => false,
    }
}

/// Whether the mappings listed in `maps` cover `[start, end)` with `rw` permissions.
fn covered(maps: &str, start: usize, end: usize) -> bool {
    if start >= end {
        return false;
    }
    let mut at = start;
    for line in maps.lines() {
        let Some((lo, hi, perms)) = parse_line(line) else {
            continue;
        };
        if hi <= at {
            continue;
        }
        if lo > at || !perms.starts_with("rw") {
            return false; // a gap, or a mapping that is not readable and writable
        }
        at = hi;
        if at >= end {
            return true;
        }
    }
    false
}

/// `(start, end, perms)` of one line of `/proc/self/maps`.
fn parse_line(line: &str) -> Option<(usize, usize, &str)> {
    let mut it = line.split_ascii_whitespace();
    let (lo, hi) = it.next()?.split_once('-')?;
    let perms = it.next()?;
    Some((
        usize::from_str_radix(lo, 16).ok()?,
        usize::from_str_radix(hi, 16).ok()?,
        perms,
    ))
}
