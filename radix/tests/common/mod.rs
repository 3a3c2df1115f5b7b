//! The radix tests' one set of fixtures: a cache of a given page size and capacities, prompts
//! whose pages differ per seed, and a device insert as the scheduler does it.
#![allow(dead_code)] // each test file uses its own subset

use kvtier_radix::*;

pub fn cache_with(page_size: usize, dev: u32, host: u32, events: bool) -> RadixCache {
    RadixCache::new(RadixConfig {
        page_size,
        device_pages: dev,
        host_pages: host,
        record_events: events,
    })
    .expect("a valid test config")
}

/// `pages` pages of tokens `seed * 1000 + i` and their page hashes.
pub fn prompt_with(page_size: usize, seed: u32, pages: usize) -> (Vec<u32>, Vec<PageHash>) {
    let toks: Vec<u32> = (0..(pages * page_size) as u32)
        .map(|i| seed * 1000 + i)
        .collect();
    let hs = page_hashes(&toks, page_size, None);
    (toks, hs)
}

/// Inserts the whole prompt on device from what already matches; returns the end node.
pub fn put_device(c: &mut RadixCache, toks: &[u32], hs: &[PageHash]) -> NodeId {
    let m = c.match_prefix(hs);
    let pages = c
        .alloc::<Device>(hs.len() - m.device_pages)
        .expect("room on device");
    c.insert::<Device>(m.device_node, m.device_pages, hs, toks, &pages)
        .expect("a valid insert")
        .end_node
}
