//! Page-hash chains for the offloading-manager tests (`OffloadManager` takes an engine's
//! chunk chains as page hashes): one fixture for every test binary that needs them.

#![allow(dead_code)]

use kvtier_radix::PageHash;

/// A chain of `n` pages: prompt `p`'s pages share their first `shared` with every prompt.
pub fn shared_chain(p: u8, n: usize, shared: usize) -> Vec<PageHash> {
    (0..n)
        .map(|i| {
            let mut h = [0u8; 32];
            h[0] = i as u8;
            h[1] = if i < shared { 0xff } else { p };
            h[2] = 0x5a;
            PageHash(h)
        })
        .collect()
}

/// A chain of `n` pages of prompt `p`, sharing nothing with other prompts.
pub fn chain(p: u8, n: usize) -> Vec<PageHash> {
    shared_chain(p, n, 0)
}

/// Every one of `m`'s ranks found `pages` in L3, agreed in process (a manager of several
/// ranks refuses a direct `l3_found`): they are marked in L3.
pub fn found_by_every_rank(m: &mut kvtier_scheduler::OffloadManager, pages: &[PageHash]) {
    let mut ranks: Vec<kvtier_scheduler::RankAgreement> = (0..m.tp_ranks())
        .map(|_| {
            let mut r = kvtier_scheduler::RankAgreement::new();
            r.found_pages(pages);
            r
        })
        .collect();
    m.agree_found_in_process(&mut ranks).unwrap();
}
