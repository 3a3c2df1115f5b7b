//! Which destinations of one read share bytes with another.
//!
//! Why: a read into caller memory with two destinations that overlap writes two keys' bytes
//! into one place and reports both read (and in Rust holds two aliasing `&mut [u8]`). Every
//! multi-destination read refuses them: `L3Store.batch_get_into` before reading anything,
//! the Mooncake-compatible reads per key or range (-600), as Mooncake's callers expect.

/// For each span `(start, len)`, whether it shares a byte with another span; empty spans
/// share none. Sorted by start, a span overlaps an earlier one iff it starts before the
/// furthest end so far, and a later one iff the next start lies before its end (every later
/// start is at or past the next one). O(n log n); ends saturate at `usize::MAX`.
pub(crate) fn overlapping(spans: &[(usize, usize)]) -> Vec<bool> {
    let mut order: Vec<usize> = (0..spans.len()).filter(|&i| spans[i].1 > 0).collect();
    order.sort_unstable_by_key(|&i| spans[i].0);
    let end = |i: usize| spans[i].0.saturating_add(spans[i].1);
    let mut out = vec![false; spans.len()];
    let mut furthest = 0usize;
    for (k, &i) in order.iter().enumerate() {
        let after = order.get(k + 1).is_some_and(|&j| spans[j].0 < end(i));
        out[i] = spans[i].0 < furthest || after;
        furthest = furthest.max(end(i));
    }
    out
}
