//! A small tour of the tiered radix cache: two conversations share a system prompt, the device
//! fills up, pages fall back to host, and a returning conversation loads them back.
//!
//! Run: `cargo run --release -p kvtier-radix --example radix_demo`

use kvtier_radix::*;

const PS: usize = 16;

fn tokens(seed: u32, n_pages: usize) -> Vec<u32> {
    (0..(n_pages * PS) as u32)
        .map(|i| seed.wrapping_mul(2_654_435_761).wrapping_add(i) % 50_000)
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut cache = RadixCache::new(RadixConfig {
        page_size: PS,
        device_pages: 24,
        host_pages: 64,
        record_events: true,
    })?;
    let system = tokens(1, 8);
    let convo = |seed: u32, pages: usize| {
        let mut t = system.clone();
        t.extend(tokens(seed, pages));
        t
    };
    let report = |cache: &RadixCache, what: &str| {
        let d = cache.usage(TierKind::Device);
        let h = cache.usage(TierKind::Host);
        println!(
            "{what:<44} device {:>2}/{:<2} cached ({:>2} locked)  host {:>2}/{:<2} cached  nodes {}",
            d.cached,
            d.capacity,
            d.locked,
            h.cached,
            h.capacity,
            cache.node_count()
        );
    };

    // Conversation A: computed on device, then written back to host when it finishes.
    let a = convo(2, 8);
    let ha = page_hashes(&a, PS, None);
    let m = cache.match_prefix(&ha);
    println!(
        "A: {} pages, match device={} host={}",
        ha.len(),
        m.device_pages,
        m.host_pages
    );
    let pages = cache.alloc_evicting::<Device>(ha.len())?;
    let ins = cache.insert::<Device>(m.device_node, 0, &ha, &a, &pages)?;
    let lock_a = cache.lock::<Device>(ins.end_node)?;
    report(&cache, "A prefilled on device (locked while running)");
    let host = cache.alloc_evicting::<Host>(ha.len())?;
    cache.insert::<Host>(cache.root(), 0, &ha, &a, &host)?;
    cache.unlock(lock_a)?;
    report(&cache, "A finished, written back to host");

    // Conversation B shares the system prompt: only its own pages are computed.
    let b = convo(3, 12);
    let hb = page_hashes(&b, PS, None);
    let m = cache.match_prefix(&hb);
    println!(
        "B: {} pages, match device={} (the shared system prompt)",
        hb.len(),
        m.device_pages
    );
    let lock_prefix = cache.lock::<Device>(m.device_node)?;
    let new = hb.len() - m.device_pages;
    let pages = cache.alloc_evicting::<Device>(new)?;
    report(&cache, "B allocated: device full, A's tail evicted");
    let ins = cache.insert::<Device>(m.device_node, m.device_pages, &hb, &b, &pages)?;
    let lock_b = cache.relock(lock_prefix, ins.end_node)?;
    cache.unlock(lock_b)?;

    // A returns: its tail is on host only, so it is loaded back instead of recomputed.
    let m = cache.match_prefix(&ha);
    println!(
        "A again: match device={} host={} -> load back {} pages instead of recomputing them",
        m.device_pages,
        m.host_pages,
        m.host_pages - m.device_pages
    );
    let hold = cache.lock::<Host>(m.host_node)?;
    let dev_lock = cache.lock::<Device>(m.device_node)?;
    let dst = cache.alloc_evicting::<Device>(m.host_pages - m.device_pages)?;
    let src = cache.path_pages_from::<Host>(m.host_node, m.device_pages)?;
    println!(
        "  load-back copies host {:?}.. -> device {:?}..",
        &src[..2],
        &dst[..2]
    );
    cache.insert::<Device>(m.device_node, m.device_pages, &ha, &a, &dst)?;
    cache.unlock(dev_lock)?;
    cache.unlock(hold)?;
    report(&cache, "A loaded back");

    let events = cache.drain_events();
    let stored = events
        .iter()
        .filter(|e| matches!(e, KvEvent::Stored { .. }))
        .count();
    println!(
        "router events: {stored} stored, {} removed; outstanding locks {:?}",
        events.len() - stored,
        cache.outstanding_locks()
    );
    match cache.check_invariants() {
        Ok(()) => println!("invariants hold"),
        Err(e) => {
            eprintln!("invariant violated: {e}");
            std::process::exit(1);
        }
    }
    Ok(())
}
