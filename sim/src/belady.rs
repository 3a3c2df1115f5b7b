//! The offline-optimal hit rate (Belady's MIN) for a cache of a given capacity: the ceiling
//! any eviction policy can reach on a workload.
//!
//! Model: the sequence of prompt pages in arrival order; a page access hits if the page is in
//! the cache; on a miss the page may be admitted, evicting the cached page whose next use is
//! farthest in the future (or not admitted at all if its own next use is farther: MIN with
//! bypass). A prefix cache can only use a page whose whole prefix is cached too, so its hit
//! count is at most its page-level hit count, which is at most MIN's: the bound holds.

use std::collections::{BTreeSet, HashMap};

/// Hit pages of MIN over `seq` with `capacity` pages (`u64::MAX`: unlimited). Each access is
/// `(page id, counted)`: uncounted accesses are pages *written* (a finished request's output
/// pages entering the cache), which MIN may admit but which score no hit.
pub fn belady_hits(seq: &[(u64, bool)], capacity: u64) -> u64 {
    if capacity == 0 || seq.is_empty() {
        return 0;
    }
    // next[i]: index of the next access of seq[i], or usize::MAX.
    let mut next = vec![usize::MAX; seq.len()];
    let mut last: HashMap<u64, usize> = HashMap::with_capacity(seq.len() / 2);
    for i in (0..seq.len()).rev() {
        if let Some(&j) = last.get(&seq[i].0) {
            next[i] = j;
        }
        last.insert(seq[i].0, i);
    }
    drop(last);
    let mut cached: HashMap<u64, usize> = HashMap::new(); // page -> its next use
    let mut by_next: BTreeSet<(usize, u64)> = BTreeSet::new();
    let mut hits = 0;
    for (i, &(p, counted)) in seq.iter().enumerate() {
        let nu = next[i];
        if let Some(old) = cached.get_mut(&p) {
            hits += counted as u64;
            by_next.remove(&(*old, p));
            *old = nu;
            by_next.insert((nu, p));
            continue;
        }
        if nu == usize::MAX {
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
