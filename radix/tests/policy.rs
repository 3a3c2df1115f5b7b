//! What each eviction policy evicts, on small cases where LRU's choice is the wrong one, and
//! that repeated matches of one query (a blocked request tried again) count as one use.

use kvtier_radix::*;

const PS: usize = 4;

fn cache(policy: EvictionPolicy) -> RadixCache {
    let mut c = RadixCache::new(RadixConfig {
        page_size: PS,
        device_pages: 64,
        host_pages: 8,
        record_events: false,
    })
    .unwrap();
    c.set_eviction_policy(policy);
    c
}

fn prompt(seed: u32, pages: usize) -> (Vec<u32>, Vec<PageHash>) {
    let toks: Vec<u32> = (0..(pages * PS) as u32).map(|i| seed * 1000 + i).collect();
    let hs = page_hashes(&toks, PS, None);
    (toks, hs)
}

fn put_device(c: &mut RadixCache, toks: &[u32], hs: &[PageHash]) {
    let m = c.match_prefix(hs);
    let pages = c.alloc::<Device>(hs.len() - m.device_pages).unwrap();
    c.insert::<Device>(m.device_node, m.device_pages, hs, toks, &pages)
        .unwrap();
}

/// A short prefix read three times, then a long one-off prompt: which is evicted first?
fn first_victim(policy: EvictionPolicy, repeat_same_query: bool) -> PageHash {
    let mut c = cache(policy);
    let (ta, ha) = prompt(1, 2);
    put_device(&mut c, &ta, &ha);
    for i in 0..3 {
        if repeat_same_query {
            c.match_prefix(&ha);
        } else {
            // Distinct queries through the prefix: different continuations.
            let (_, other) = prompt(100 + i, 3);
            c.match_prefix(&[ha[0], ha[1], other[2]]);
        }
    }
    let (tb, hb) = prompt(2, 12);
    put_device(&mut c, &tb, &hb);
    c.evict::<Device>(1).evicted[0].hashes[0]
}

#[test]
fn frequency_depth_keeps_a_reused_prefix_over_a_fresh_one_off() {
    let (_, ha) = prompt(1, 2);
    let (_, hb) = prompt(2, 12);
    // LRU evicts the older, reused prefix.
    assert_eq!(first_victim(EvictionPolicy::Lru, false), ha[0]);
    let p = EvictionPolicy::FrequencyDepth {
        use_credit_pages: 16,
        max_credited_uses: 4,
        depth_debit_per_page: 1,
    };
    assert_eq!(first_victim(p, false), hb[0]);
    // Depth alone (no credit) already prefers the deep one-off.
    let depth_only = EvictionPolicy::FrequencyDepth {
        use_credit_pages: 0,
        max_credited_uses: 0,
        depth_debit_per_page: 2,
    };
    assert_eq!(first_victim(depth_only, false), hb[0]);
}

#[test]
fn a_repeated_query_counts_as_one_use() {
    // Credit only (no depth): three distinct reads outweigh 12 pages of newer traffic, one
    // read repeated three times does not.
    let p = EvictionPolicy::FrequencyDepth {
        use_credit_pages: 6,
        max_credited_uses: 4,
        depth_debit_per_page: 0,
    };
    let (_, ha) = prompt(1, 2);
    let (_, hb) = prompt(2, 12);
    assert_eq!(first_victim(p, false), hb[0]);
    assert_eq!(first_victim(p, true), ha[0]);
}

#[test]
fn switching_policy_reranks_what_is_already_cached() {
    let mut c = cache(EvictionPolicy::Lru);
    let (ta, ha) = prompt(1, 2);
    put_device(&mut c, &ta, &ha);
    let (tb, hb) = prompt(2, 12);
    put_device(&mut c, &tb, &hb);
    let lru_first = c.evictable_lru::<Device>().next().unwrap();
    assert_eq!(c.node_hashes(lru_first).unwrap()[0], ha[0]);
    c.set_eviction_policy(EvictionPolicy::CONVERSATION);
    let first = c.evictable_lru::<Device>().next().unwrap();
    assert_eq!(c.node_hashes(first).unwrap()[0], hb[0]);
    c.check_invariants().unwrap();
}

mod spelling {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every policy prints as a spelling that parses back to itself (CLI, TOML and Python
        /// all use it).
        #[test]
        fn display_parses_back(c in any::<u64>(), m in any::<u32>(), d in any::<u64>()) {
            for p in [
                EvictionPolicy::Lru,
                EvictionPolicy::FrequencyDepth {
                    use_credit_pages: c,
                    max_credited_uses: m,
                    depth_debit_per_page: d,
                },
            ] {
                prop_assert_eq!(p.to_string().parse::<EvictionPolicy>(), Ok(p));
            }
        }

        /// Any other text is a typed error, never a panic.
        #[test]
        fn garbage_is_an_error(s in "\\PC{0,40}") {
            let ok = s == "lru" || s.starts_with("freq-depth");
            if !ok {
                prop_assert!(s.parse::<EvictionPolicy>().is_err());
            }
        }
    }

    #[test]
    fn short_spelling_is_the_conversation_setting() {
        assert_eq!(
            "freq-depth".parse::<EvictionPolicy>(),
            Ok(EvictionPolicy::CONVERSATION)
        );
        assert!(
            "freq-depth:1:4294967296:2"
                .parse::<EvictionPolicy>()
                .is_err()
        );
        assert!("freq-depth:1:2".parse::<EvictionPolicy>().is_err());
    }
}

fn put_host(c: &mut RadixCache, toks: &[u32], hs: &[PageHash]) {
    let m = c.match_prefix(hs);
    let pages = c.alloc::<Host>(hs.len() - m.host_pages).unwrap();
    c.insert::<Host>(m.host_node, m.host_pages, hs, toks, &pages)
        .unwrap();
}

/// A prefix read three times, evicted (no copy left), computed again; then a one-off prompt of
/// the same length, newer: which goes first?
fn victim_after_a_reread(policy: EvictionPolicy) -> (PageHash, PageHash) {
    let mut c = cache(policy);
    let (ta, ha) = prompt(1, 4);
    put_device(&mut c, &ta, &ha);
    for i in 0..3 {
        let (_, other) = prompt(100 + i, 5);
        c.match_prefix(&[ha[0], ha[1], ha[2], ha[3], other[4]]);
    }
    let gone = c.evict::<Device>(64);
    assert!(
        gone.evicted.iter().all(|e| e.removed),
        "no copy left of the prefix"
    );
    put_device(&mut c, &ta, &ha);
    let (tb, hb) = prompt(2, 4);
    put_device(&mut c, &tb, &hb);
    c.check_invariants().unwrap();
    (c.evict::<Device>(1).evicted[0].hashes[0], ha[0])
}

#[test]
fn a_page_read_again_after_its_eviction_keeps_its_uses() {
    // Credit only: the prefix's three reads and the read that brought it back outweigh four
    // pages of newer traffic; without the use memory it came back with none and went first.
    let p = EvictionPolicy::FrequencyDepth {
        use_credit_pages: 8,
        max_credited_uses: 4,
        depth_debit_per_page: 0,
    };
    let (victim, reread) = victim_after_a_reread(p);
    assert_ne!(victim, reread, "the re-read prefix was ranked as new");
    // LRU keeps no memory: the older prefix goes first.
    let (victim, reread) = victim_after_a_reread(EvictionPolicy::Lru);
    assert_eq!(victim, reread);
}

#[test]
fn device_drops_a_copy_host_also_holds_before_a_sole_copy() {
    for policy in [EvictionPolicy::Lru, EvictionPolicy::CONVERSATION] {
        let mut c = cache(policy);
        let (ty, hy) = prompt(1, 2);
        put_device(&mut c, &ty, &hy);
        let (tx, hx) = prompt(2, 2);
        put_device(&mut c, &tx, &hx);
        put_host(&mut c, &tx, &hx);
        // Y is older and device-only; X is newer but host holds it too.
        let first = c.evictable_lru::<Device>().next().unwrap();
        assert_eq!(c.node_hashes(first).unwrap()[0], hx[0], "{policy}");
        // Once host drops X, its device copy is a sole copy again: the policy decides.
        let out = c.evict::<Host>(1);
        assert_eq!(out.evicted[0].hashes[0], hx[0]);
        let first = c.evictable_lru::<Device>().next().unwrap();
        assert_eq!(c.node_hashes(first).unwrap()[0], hy[0], "{policy}");
        c.check_invariants().unwrap();
    }
}
