//! The offline-optimal hit rate (Belady's MIN) for a cache of a given capacity: the ceiling
//! any eviction policy can reach on a workload.
//!
//! Model: the sequence of prompt pages in arrival order; a page access hits if the page is in
//! the cache; on a miss the page may be admitted, evicting the cached page whose next use is
//! farthest in the future (or not admitted at all if its own next use is farther: MIN with
//! bypass). A prefix cache can only use a page whose whole prefix is cached too, so its hit
//! count is at most its page-level hit count, which is at most MIN's: the bound holds.
//!
//! Memory: the access log is the only thing a simulation keeps that grows with the trace, so it
//! is packed into 8 bytes per access (a 63-bit page fingerprint and the counted bit), and MIN
//! is computed with 4 more bytes per access (the index of the next use, found bucket by bucket
//! so that no table of every distinct page is ever built).

use std::collections::{BTreeSet, HashMap};

/// Page accesses in the order the engine saw them, packed: `fingerprint << 1 | counted`.
#[derive(Clone, Debug, Default)]
pub struct AccessLog {
    packed: Vec<u64>,
    /// More accesses than MIN can index (2^32 − 1) were offered; the log is unusable.
    overflowed: bool,
}

/// "No next use" in the next-use array.
const NEVER: u32 = u32::MAX;

impl AccessLog {
    /// Logs an access of the page with fingerprint `page` (its top bit is ignored). Counted
    /// accesses are prompt pages looked up; uncounted ones are pages written.
    pub fn push(&mut self, page: u64, counted: bool) {
        if self.packed.len() >= NEVER as usize - 1 {
            self.overflowed = true;
            return;
        }
        self.packed.push(page << 1 | counted as u64);
    }

    pub fn len(&self) -> usize {
        self.packed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.packed.is_empty()
    }

    /// Hit pages of MIN with `capacity` pages (`u64::MAX`: unlimited); `None` if the log
    /// overflowed.
    pub fn belady_hits(&self, capacity: u64) -> Option<u64> {
        if self.overflowed {
            return None;
        }
        Some(min_hits(&self.packed, capacity))
    }
}

/// Hit pages of MIN over `seq` with `capacity` pages (`u64::MAX`: unlimited). Each access is
/// `(page id, counted)`: uncounted accesses are pages *written* (a finished request's output
/// pages entering the cache), which MIN may admit but which score no hit.
pub fn belady_hits(seq: &[(u64, bool)], capacity: u64) -> u64 {
    let mut log = AccessLog::default();
    for &(p, c) in seq {
        log.push(p, c);
    }
    log.belady_hits(capacity).unwrap_or(0)
}

/// `next[i]`: the index of the next access of the page of access `i`, or [`NEVER`]. Accesses
/// are split into 16 buckets by page; each bucket's indices are sorted by (page, index), so
/// equal pages are adjacent and in order.
fn next_uses(packed: &[u64]) -> Vec<u32> {
    const BUCKETS: u64 = 16;
    let mut next = vec![NEVER; packed.len()];
    let page = |i: u32| packed[i as usize] >> 1;
    for b in 0..BUCKETS {
        let mut idx: Vec<u32> = (0..packed.len() as u32)
            .filter(|&i| page(i) % BUCKETS == b)
            .collect();
        idx.sort_unstable_by_key(|&i| (page(i), i));
        for w in idx.windows(2) {
            if page(w[0]) == page(w[1]) {
                next[w[0] as usize] = w[1];
            }
        }
    }
    next
}

fn min_hits(packed: &[u64], capacity: u64) -> u64 {
    if capacity == 0 || packed.is_empty() {
        return 0;
    }
    let next = next_uses(packed);
    let mut cached: HashMap<u64, u32> = HashMap::new(); // page -> its next use
    let mut by_next: BTreeSet<(u32, u64)> = BTreeSet::new();
    let mut hits = 0;
    for (&a, &nu) in packed.iter().zip(&next) {
        let (p, counted) = (a >> 1, a & 1 == 1);
        if let Some(old) = cached.get_mut(&p) {
            hits += counted as u64;
            by_next.remove(&(*old, p));
            *old = nu;
            by_next.insert((nu, p));
            continue;
        }
        if nu == NEVER {
            continue; // never used again: do not admit
        }
        if (cached.len() as u64) < capacity {
            cached.insert(p, nu);
            by_next.insert((nu, p));
            continue;
        }
        if let Some(&(far, q)) = by_next.last()
            && far > nu
        {
            by_next.pop_last();
            cached.remove(&q);
            cached.insert(p, nu);
            by_next.insert((nu, p));
        }
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force over all eviction choices on tiny inputs.
    fn brute(seq: &[u64], cap: usize, i: usize, cache: &mut Vec<u64>) -> u64 {
        if i == seq.len() {
            return 0;
        }
        let p = seq[i];
        if cache.contains(&p) {
            return 1 + brute(seq, cap, i + 1, cache);
        }
        let mut best = brute(seq, cap, i + 1, cache); // bypass
        if cache.len() < cap {
            cache.push(p);
            best = best.max(brute(seq, cap, i + 1, cache));
            cache.pop();
        } else {
            for k in 0..cache.len() {
                let old = std::mem::replace(&mut cache[k], p);
                best = best.max(brute(seq, cap, i + 1, cache));
                cache[k] = old;
            }
        }
        best
    }

    #[test]
    fn min_is_optimal_on_small_sequences() {
        let mut x = 1u64;
        for _ in 0..200 {
            let len = 1 + (x % 10) as usize;
            let seq: Vec<u64> = (0..len)
                .map(|_| {
                    x = crate::workload::mix(x);
                    x % 5
                })
                .collect();
            for cap in 1..4 {
                let counted: Vec<(u64, bool)> = seq.iter().map(|&p| (p, true)).collect();
                assert_eq!(
                    belady_hits(&counted, cap as u64),
                    brute(&seq, cap, 0, &mut Vec::new()),
                    "{seq:?} cap {cap}"
                );
            }
        }
    }

    #[test]
    fn unlimited_capacity_hits_every_repeat() {
        let s: Vec<(u64, bool)> = [1, 2, 1, 3, 2, 1].iter().map(|&p| (p, true)).collect();
        assert_eq!(belady_hits(&s, u64::MAX), 3);
        // A written (uncounted) page makes the later read a hit.
        assert_eq!(belady_hits(&[(9, false), (9, true)], 1), 1);
    }
}
