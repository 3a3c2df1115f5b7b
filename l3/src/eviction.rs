//! Choosing DRAM eviction victims: near-LRU, never leased, soft-pinned last, and among
//! equally pinned objects those whose bytes exist nowhere else (no SSD copy) after those
//! that keep one.
//!
//! Why a separate pure function: the rules ("a leased object is never evicted", "pinned
//! objects go only after every unpinned candidate") are the invariants property tests check,
//! and they are easiest to check on a function with no locks and no I/O.
//!
//! Why copies first: evicting an object that has a registered SSD copy loses nothing (it
//! reads back from SSD); evicting one without loses it. Under a write flood in write-through
//! mode the SSD writer lags, and plain LRU evicted objects whose copy was still queued — a
//! `wait_persisted` put then found its object gone (issue 19). LRU still orders each class.
//!
//! How: candidates are sorted by (pinned, no copy, last access) and taken until enough bytes
//! are freed. Leased or pending objects are filtered out *here*, so no caller can forget it.
//! Existence probes never renew leases or touch `last_access` (see docs/l3.md), so probing
//! can never keep an object from being chosen.

/// One object that might be evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Bytes freed by evicting it.
    pub size: u64,
    /// Has a read lease that has not expired.
    pub leased: bool,
    /// Soft-pinned with an unexpired pin.
    pub pinned: bool,
    /// No copy of its bytes survives its eviction (no registered SSD copy).
    pub unsaved: bool,
    /// Logical time of last read/write (higher = more recent).
    pub last_access: u64,
}

/// Indices of the candidates to evict to free at least `need` bytes (fewer if impossible).
/// Invariant: no returned index is leased; a pinned one is returned only if every unleased
/// unpinned candidate is returned too; an unsaved one only if every unleased saved candidate
/// of the same pin class is returned too.
pub fn select_victims(cands: &[Candidate], need: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..cands.len()).filter(|&i| !cands[i].leased).collect();
    order.sort_by_key(|&i| (cands[i].pinned, cands[i].unsaved, cands[i].last_access));
    let mut freed = 0u64;
    let mut out = Vec::new();
    for i in order {
        if freed >= need {
            break;
        }
        freed = freed.saturating_add(cands[i].size);
        out.push(i);
    }
    out
}

/// [`select_victims`]'s choice when the candidates come already ordered by (unsaved, last
/// access), as the master keeps them: `walk(visit)` hands `visit` the candidates in that
/// order until `visit` returns `false`; it is walked once for the unpinned candidates and,
/// only if they free less than `need`, again for the pinned ones; each walk stops as soon as
/// `need` bytes are chosen, so the cost is the victims (and the leased or pinned candidates
/// before them), not every candidate. The victims' handles, in the order [`select_victims`]
/// gives them.
pub fn take_in_order<H>(
    mut walk: impl FnMut(&mut dyn FnMut(H, Candidate) -> bool),
    need: u64,
) -> Vec<H> {
    let mut freed = 0u64;
    let mut out = Vec::new();
    for pinned in [false, true] {
        if freed >= need {
            break;
        }
        walk(&mut |h, c| {
            if freed >= need {
                return false;
            }
            if !c.leased && c.pinned == pinned {
                freed = freed.saturating_add(c.size);
                out.push(h);
            }
            freed < need
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cand() -> impl Strategy<Value = Candidate> {
        (
            1u64..1000,
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            0u64..100,
        )
            .prop_map(|(size, leased, pinned, unsaved, last_access)| Candidate {
                size,
                leased,
                pinned,
                unsaved,
                last_access,
            })
    }

    proptest! {
        #[test]
        fn never_leased_and_pinned_last(cands in proptest::collection::vec(cand(), 0..60), need in 0u64..20_000) {
            let v = select_victims(&cands, need);
            for &i in &v {
                prop_assert!(!cands[i].leased);
            }
            if v.iter().any(|&i| cands[i].pinned) {
                for (i, c) in cands.iter().enumerate() {
                    if !c.leased && !c.pinned {
                        prop_assert!(v.contains(&i));
                    }
                }
            }
            // Within a pin class, an object without a copy goes only after every one with.
            for &i in &v {
                if cands[i].unsaved {
                    for (j, c) in cands.iter().enumerate() {
                        if !c.leased && c.pinned == cands[i].pinned && !c.unsaved {
                            prop_assert!(v.contains(&j));
                        }
                    }
                }
            }
            let freed: u64 = v.iter().map(|&i| cands[i].size).sum();
            let avail: u64 = cands.iter().filter(|c| !c.leased).map(|c| c.size).sum();
            prop_assert!(freed >= need.min(avail));
        }
    }

    proptest! {
        /// The walk of an ordered index chooses exactly what sorting every candidate does
        /// (last accesses distinct, as the master's ticks make them within a tenant's
        /// order: ties are broken by key there, arbitrarily here).
        #[test]
        fn taking_in_order_chooses_what_sorting_chooses(
            cands in proptest::collection::vec(cand(), 0..60),
            need in 0u64..20_000,
        ) {
            let cands: Vec<Candidate> = cands
                .into_iter()
                .enumerate()
                .map(|(i, c)| Candidate { last_access: c.last_access * 64 + i as u64, ..c })
                .collect();
            let mut ordered: Vec<usize> = (0..cands.len()).collect();
            ordered.sort_by_key(|&i| (cands[i].unsaved, cands[i].last_access));
            let walked = take_in_order(
                |visit| {
                    for &i in &ordered {
                        if !visit(i, cands[i]) {
                            break;
                        }
                    }
                },
                need,
            );
            prop_assert_eq!(walked, select_victims(&cands, need));
        }
    }

    #[test]
    fn lru_order() {
        let c = |a| Candidate {
            size: 10,
            leased: false,
            pinned: false,
            unsaved: false,
            last_access: a,
        };
        let cands = [c(5), c(1), c(3)];
        assert_eq!(select_victims(&cands, 15), vec![1, 2]);
    }

    #[test]
    fn copies_before_unsaved() {
        let c = |a, unsaved| Candidate {
            size: 10,
            leased: false,
            pinned: false,
            unsaved,
            last_access: a,
        };
        // The oldest has no copy: the two with copies go first, newest included.
        let cands = [c(1, true), c(5, false), c(3, false)];
        assert_eq!(select_victims(&cands, 15), vec![2, 1]);
    }
}
