//! The order in which a batch touches its keys: last to first, so the batch's **first key
//! ranks as the most recent** and its last as the least.
//!
//! Why: every engine lists a prompt's pages head first (vLLM's offloading jobs, SGLang's
//! HiCache, kvtier's own backups), and a page is reusable only together with every page
//! before it. The master's eviction takes the least recently used first; touching a batch in
//! list order made a prefix's head its oldest page, so an eviction took the heads of the
//! oldest prefixes and left tails that no lookup can reach (found by the vLLM suite: under
//! concurrent stores an evicting store kept no whole prefix at all). Touched last to first,
//! an eviction that reaches a batch's pages takes its tail first and what survives of it is a
//! prefix.
//!
//! Only the order of the touches changes: allocation still goes first to last (a batch that
//! does not fit keeps its head, not its tail), and answers come back in the batch's order.

/// `f(i)` for every index of a batch of `n`, called from the last index to the first; the
/// answers in index order.
pub(crate) fn last_to_first<T>(n: usize, mut f: impl FnMut(usize) -> T) -> Vec<T> {
    let mut out: Vec<T> = (0..n).rev().map(&mut f).collect();
    out.reverse();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_last_to_first_and_answers_in_order() {
        let mut calls = Vec::new();
        let out = last_to_first(4, |i| {
            calls.push(i);
            i * 10
        });
        assert_eq!(calls, vec![3, 2, 1, 0]);
        assert_eq!(out, vec![0, 10, 20, 30]);
        assert!(last_to_first(0, |i| i).is_empty());
    }
}
