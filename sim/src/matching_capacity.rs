//! The capacity each policy of a sweep needs to reach LRU's hit rate at the sweep's middle
//! point, and which fixed policy was best at each point.
//!
//! Why: a hit-rate difference at one capacity does not say what it is worth; "policy X matches
//! LRU with 30 % less cache" does, and is what a sizing decision needs. Between two sweep
//! points the hit rate is interpolated linearly in log2(capacity) (the sweep doubles the
//! capacity at each point, and hit rates grow roughly linearly in its log there).

use serde::Serialize;

use crate::plot::SweepPoint;

/// One policy's capacity to match the target.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MatchingCapacity {
    pub policy: String,
    /// Device + host pages at which the policy's interpolated hit rate reaches the target;
    /// `None` when it stays below the target over the whole sweep.
    pub capacity_pages: Option<f64>,
}

/// LRU's hit rate at the sweep's middle point, and the capacity each line needs to reach it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MatchLru {
    /// The middle point's capacity and LRU's hit rate there.
    pub at_capacity_pages: u64,
    pub lru_hit_rate: f64,
    pub policies: Vec<MatchingCapacity>,
    /// Points left out of every line: they ran another set of requests than the middle
    /// point (a smaller device tier rejects the longest prompts), so their hit rates are not
    /// comparable with its.
    pub left_out_capacity_pages: Vec<u64>,
}

/// The capacity at which the line `(capacity, hit rate)` (in increasing capacity) first
/// reaches `target`: the first point at or above it, interpolated in log2(capacity) from the
/// point before; `None` if no point reaches it.
pub fn capacity_for(line: &[(u64, f64)], target: f64) -> Option<f64> {
    let i = line.iter().position(|&(_, r)| r >= target)?;
    let (c1, r1) = line[i];
    let Some(&(c0, r0)) = i.checked_sub(1).map(|j| &line[j]) else {
        return Some(c1 as f64);
    };
    if r1 <= r0 || c0 == 0 {
        return Some(c1 as f64);
    }
    let (l0, l1) = ((c0 as f64).log2(), (c1 as f64).log2());
    let t = (target - r0) / (r1 - r0);
    Some((l0 + t * (l1 - l0)).exp2())
}

/// For every line of the sweep (the configured policy named `policy`, then each compared
/// one), the capacity to match LRU at the middle point, over the points that ran the middle
/// point's requests (the others are named); `None` without an LRU line or when the middle
/// point rejected every request.
pub fn match_lru(policy: &str, pts: &[SweepPoint]) -> Option<MatchLru> {
    let mid = pts.get(pts.len().checked_sub(1)? / 2)?;
    if !mid.measured() {
        return None;
    }
    let (pts, other): (Vec<&SweepPoint>, Vec<&SweepPoint>) = pts
        .iter()
        .partition(|p| p.request_set() == mid.request_set());
    let lru_at = |p: &SweepPoint| -> Option<f64> {
        if policy == "lru" {
            return Some(p.hit_rate);
        }
        p.compared
            .iter()
            .find(|c| c.policy == "lru")
            .map(|c| c.hit_rate)
    };
    let target = lru_at(mid)?;
    let mut names = vec![policy.to_string()];
    names.extend(mid.compared.iter().map(|c| c.policy.clone()));
    let policies = names
        .into_iter()
        .map(|name| {
            let line: Vec<(u64, f64)> = pts
                .iter()
                .filter_map(|p| {
                    let r = if name == policy {
                        Some(p.hit_rate)
                    } else {
                        p.compared
                            .iter()
                            .find(|c| c.policy == name)
                            .map(|c| c.hit_rate)
                    };
                    r.map(|r| (p.capacity_pages, r))
                })
                .collect();
            MatchingCapacity {
                capacity_pages: capacity_for(&line, target),
                policy: name,
            }
        })
        .collect();
    Some(MatchLru {
        at_capacity_pages: mid.capacity_pages,
        lru_hit_rate: target,
        policies,
        left_out_capacity_pages: other.iter().map(|p| p.capacity_pages).collect(),
    })
}

/// The best compared (fixed) policy at a point: name and hit rate.
pub fn best_fixed(p: &SweepPoint) -> Option<(&str, f64)> {
    if !p.measured() {
        return None;
    }
    p.compared
        .iter()
        .max_by(|a, b| a.hit_rate.total_cmp(&b.hit_rate))
        .map(|c| (c.policy.as_str(), c.hit_rate))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn interpolates_in_log_capacity() {
        let line = [(100, 0.1), (400, 0.3)];
        // Halfway in rate is halfway in log2: 200 pages.
        let c = capacity_for(&line, 0.2).unwrap();
        assert!((c - 200.0).abs() < 1e-9, "{c}");
        assert_eq!(capacity_for(&line, 0.05), Some(100.0));
        assert_eq!(capacity_for(&line, 0.31), None);
    }

    proptest! {
        /// The matching capacity lies between the bracketing points, and a target the line
        /// reaches at a point gives at most that point's capacity.
        #[test]
        fn within_the_bracket(rates in prop::collection::vec(0.0f64..1.0, 1..8), target in 0.0f64..1.0) {
            let mut rates = rates;
            rates.sort_by(f64::total_cmp);
            let line: Vec<(u64, f64)> = rates.iter().enumerate().map(|(i, &r)| (1u64 << (i + 4), r)).collect();
            match capacity_for(&line, target) {
                None => prop_assert!(rates.iter().all(|&r| r < target)),
                Some(c) => {
                    let i = line.iter().position(|&(_, r)| r >= target).unwrap();
                    prop_assert!(c <= line[i].0 as f64 + 1e-6);
                    if i > 0 {
                        prop_assert!(c >= line[i - 1].0 as f64 - 1e-6);
                    }
                }
            }
        }
    }
}
