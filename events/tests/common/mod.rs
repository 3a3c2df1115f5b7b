//! The events tests' one set of fixtures: prompts sharing prefixes, and a real radix cache
//! served the way the scheduler serves it (device inserts, host backups).
#![allow(dead_code)] // each test file uses its own subset

use kvtier_radix::*;

pub const PS: usize = 4;

/// `pages` pages of tokens, the first `shared` common to every seed (tokens of seed 0).
pub fn tokens(seed: u32, shared: usize, pages: usize) -> Vec<u32> {
    (0..pages * PS)
        .map(|i| {
            if i < shared * PS {
                i as u32
            } else {
                seed * 1000 + i as u32
            }
        })
        .collect()
}

/// Inserts the held pages when they still fit the match, else gives them back; duplicates
/// the tree already had are given back too.
fn insert_or_free<T: Tier>(
    c: &mut RadixCache,
    fits: bool,
    start: NodeId,
    from: usize,
    hs: &[PageHash],
    toks: &[u32],
    pages: Vec<PageId<T>>,
) {
    if !fits {
        c.free(&pages).expect("free");
        return;
    }
    let out = c
        .insert::<T>(start, from, hs, toks, &pages)
        .expect("insert");
    let dup: Vec<_> = out.duplicates.iter().map(|d| d.1).collect();
    c.free(&dup).expect("free duplicates");
}

/// Serves a prompt on device: matches, allocates (evicting), inserts; pages stay cached.
pub fn put_device(c: &mut RadixCache, toks: &[u32]) {
    let hs = page_hashes(toks, PS, None);
    let m = c.match_prefix(&hs);
    if let Ok(p) = c.alloc_evicting::<Device>(hs.len() - m.device_pages) {
        let m = c.match_prefix(&hs); // eviction may have changed the match
        let fits = p.len() == hs.len() - m.device_pages;
        insert_or_free(c, fits, m.device_node, m.device_pages, &hs, toks, p);
    }
}

/// Backs up to host the first `upto` pages of a prompt cached on device (as a write-back does).
pub fn back_up(c: &mut RadixCache, toks: &[u32], upto: usize) {
    let hs = page_hashes(toks, PS, None);
    let m = c.match_prefix(&hs);
    let n = m.device_pages.min(upto);
    if n > m.host_pages
        && let Ok(p) = c.alloc_evicting::<Host>(n - m.host_pages)
    {
        let m = c.match_prefix(&hs);
        let fits = m.device_pages >= n && p.len() == n - m.host_pages;
        insert_or_free(
            c,
            fits,
            m.host_node,
            m.host_pages,
            &hs[..n],
            &toks[..n * PS],
            p,
        );
    }
}
