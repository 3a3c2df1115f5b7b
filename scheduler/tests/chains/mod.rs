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
