//! Unit tests of the cache's individual behaviours and of every misuse error.

mod common;
use common::*;
use kvtier_radix::*;

const PS: usize = 4;

fn cache(dev: u32, host: u32) -> RadixCache {
    cache_with(PS, dev, host, true)
}

fn prompt(seed: u32, pages: usize) -> (Vec<u32>, Vec<PageHash>) {
    prompt_with(PS, seed, pages)
}

#[test]
fn zero_page_size_is_an_error() {
    let e = RadixCache::new(RadixConfig {
        page_size: 0,
        device_pages: 1,
        host_pages: 1,
        record_events: false,
    });
    assert!(matches!(e, Err(RadixError::ZeroPageSize)));
}

#[test]
fn match_splits_inside_a_node_and_handles_stay_valid() {
    let mut c = cache(16, 16);
    let (toks, hs) = prompt(1, 6);
    let end = put_device(&mut c, &toks, &hs);
    assert_eq!(c.node_count(), 2);
    let lock = c.lock::<Device>(end).unwrap();
    // A prompt sharing 3 pages then diverging.
    let mut other = toks[..3 * PS].to_vec();
    other.extend(std::iter::repeat_n(7, 2 * PS));
    let ohs = page_hashes(&other, PS, None);
    let m = c.match_prefix(&ohs);
    assert_eq!((m.device_pages, m.host_pages, m.matched_pages), (3, 0, 3));
    assert_eq!(c.node_count(), 3, "split into [0,3) and [3,6)");
    assert_eq!(c.node_end(m.device_node).unwrap(), 3);
    // The original handle still names the end of the 6-page prefix.
    assert_eq!(c.node_end(lock.node()).unwrap(), 6);
    assert_eq!(c.path_pages::<Device>(end).unwrap().len(), 6);
    c.check_invariants().unwrap();
    c.unlock(lock).unwrap();
}

#[test]
fn peek_node_finds_the_deepest_whole_node_without_splitting() {
    let mut c = cache(16, 16);
    let (toks, hs) = prompt(1, 6);
    let end = put_device(&mut c, &toks, &hs);
    let mid = c.node_at_depth(end, 2).unwrap();
    let nodes = c.node_count();
    assert_eq!(c.peek_node(&hs), (end, 6));
    assert_eq!(
        c.peek_node(&hs[..4]),
        (mid, 2),
        "pages 2..4 are inside a node"
    );
    assert_eq!(c.peek_node(&hs[..2]), (mid, 2));
    assert_eq!(c.peek_node(&[]), (c.root(), 0));
    let (_, other) = prompt(2, 3);
    assert_eq!(c.peek_node(&other), (c.root(), 0));
    assert_eq!(c.node_count(), nodes, "nothing split");
    c.check_invariants().unwrap();
}

#[test]
fn evicting_device_keeps_host_copy_and_removes_copyless_nodes() {
    let mut c = cache(8, 8);
    let (toks, hs) = prompt(1, 4);
    let end = put_device(&mut c, &toks, &hs);
    // Back the first two pages up to host.
    let mid = c.node_at_depth(end, 2).unwrap();
    let hp = c.alloc::<Host>(2).unwrap();
    c.insert::<Host>(c.root(), 0, &hs, &toks, &hp).unwrap();
    let out = c.evict::<Device>(8);
    assert_eq!(out.freed_pages, 4);
    assert_eq!(
        c.peek_prefix(&hs),
        (0, 2),
        "host copy of the first two pages stays"
    );
    assert!(
        out.evicted.iter().any(|e| e.removed && e.start == 2),
        "pages 2..4 had no other copy and their node was removed"
    );
    assert!(c.node_end(mid).is_ok());
    assert!(matches!(c.node_end(end), Err(RadixError::UnknownNode)));
    c.check_invariants().unwrap();
    let ev = c.drain_events();
    assert!(ev.iter().any(|e| matches!(
        e,
        KvEvent::Removed {
            tier: TierKind::Device,
            ..
        }
    )));
    assert!(ev.iter().any(|e| matches!(
        e,
        KvEvent::Stored {
            tier: TierKind::Host,
            ..
        }
    )));
}

#[test]
fn locked_pages_are_never_evicted_and_alloc_fails_cleanly() {
    let mut c = cache(4, 4);
    let (toks, hs) = prompt(1, 4);
    let end = put_device(&mut c, &toks, &hs);
    let lock = c.lock::<Device>(end).unwrap();
    assert_eq!(c.evict::<Device>(4).freed_pages, 0);
    let before = c.usage(TierKind::Device);
    let e = c.alloc_evicting::<Device>(1);
    assert!(matches!(
        e,
        Err(RadixError::PoolExhausted {
            requested: 1,
            available: 0,
            ..
        })
    ));
    assert_eq!(
        c.usage(TierKind::Device),
        before,
        "failed alloc changed nothing"
    );
    c.unlock(lock).unwrap();
    assert_eq!(c.alloc_evicting::<Device>(1).unwrap().len(), 1);
    c.check_invariants().unwrap();
}

#[test]
fn insert_under_wrong_prefix_is_rejected() {
    // Regression guard for "prefetched suffix pages inserted under the wrong prefix": pages
    // computed against prompt A cannot be attached below prompt B's node.
    let mut c = cache(16, 16);
    let (ta, ha) = prompt(1, 4);
    let (tb, hb) = prompt(2, 2);
    put_device(&mut c, &ta, &ha);
    let b_end = put_device(&mut c, &tb, &hb);
    let pages = c.alloc::<Device>(2).unwrap();
    let before = c.usage(TierKind::Device);
    let nodes = c.node_count();
    let e = c.insert::<Device>(b_end, 2, &ha, &ta, &pages);
    assert!(matches!(e, Err(RadixError::NotAContinuation { page: 1 })));
    // Wrong offset.
    let e = c.insert::<Device>(b_end, 1, &hb, &tb, &pages[..1]);
    assert!(matches!(
        e,
        Err(RadixError::OffsetMismatch {
            expected: 2,
            got: 1
        })
    ));
    // Too few hashes / tokens.
    let e = c.insert::<Device>(b_end, 2, &hb, &tb, &pages);
    assert!(matches!(e, Err(RadixError::LengthMismatch { .. })));
    assert_eq!(c.usage(TierKind::Device), before);
    assert_eq!(c.node_count(), nodes);
    c.check_invariants().unwrap();
}

#[test]
fn insert_rejects_pages_not_held_by_caller() {
    let mut c = cache(8, 8);
    let (t, h) = prompt(1, 2);
    let end = put_device(&mut c, &t, &h);
    let tree_pages = c.path_pages::<Device>(end).unwrap();
    let (t2, h2) = prompt(2, 2);
    let e = c.insert::<Device>(c.root(), 0, &h2, &t2, &tree_pages);
    assert!(matches!(
        e,
        Err(RadixError::NotOwned {
            state: PageState::Cached,
            ..
        })
    ));
    let e = c.insert::<Device>(c.root(), 0, &h2, &t2, &[PageId::new(99), PageId::new(98)]);
    assert!(matches!(e, Err(RadixError::InvalidPage { .. })));
    let p = c.alloc::<Device>(1).unwrap();
    let e = c.insert::<Device>(c.root(), 0, &h2, &t2, &[p[0], p[0]]);
    assert!(matches!(e, Err(RadixError::DuplicatePage { .. })));
    assert!(matches!(
        c.free::<Device>(&tree_pages),
        Err(RadixError::NotOwned { .. })
    ));
    c.free(&p).unwrap();
    assert!(matches!(
        c.free(&p),
        Err(RadixError::NotOwned {
            state: PageState::Free,
            ..
        })
    ));
    c.check_invariants().unwrap();
}

#[test]
fn duplicate_insert_reports_tree_pages() {
    let mut c = cache(16, 16);
    let (t, h) = prompt(1, 3);
    put_device(&mut c, &t, &h);
    let mine = c.alloc::<Device>(3).unwrap();
    let out = c.insert::<Device>(c.root(), 0, &h, &t, &mine).unwrap();
    assert_eq!(out.inserted, 0);
    assert_eq!(out.duplicates.len(), 3);
    assert!(out.duplicates.iter().all(|(_, m, t)| m != t));
    assert_eq!(out.duplicates[2].0, 2);
    c.free(&mine).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn lock_misuse_errors() {
    let mut a = cache(8, 8);
    let mut b = cache(8, 8);
    let (t, h) = prompt(1, 2);
    let end = put_device(&mut a, &t, &h);
    assert!(matches!(
        a.lock::<Host>(end),
        Err(RadixError::NotResident {
            tier: TierKind::Host
        })
    ));
    let l = a.lock::<Device>(end).unwrap();
    let refused = b.unlock(l).unwrap_err();
    assert_eq!(refused.error, RadixError::ForeignHandle);
    assert_eq!(a.outstanding_locks(), (1, 0), "the lock is still held");
    // The failed unlock handed the handle back: it can still be given to its own cache.
    assert_eq!(a.unlock(refused.handle).unwrap(), end);
    assert_eq!(a.outstanding_locks(), (0, 0));
    let (t2, h2) = prompt(2, 1);
    let e2 = put_device(&mut a, &t2, &h2);
    let l2 = a.lock::<Device>(e2).unwrap();
    let l3 = a.relock(l2, end).unwrap();
    assert_eq!(l3.node(), end);
    assert_eq!(a.outstanding_locks(), (1, 0));
    a.unlock(l3).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn refused_relock_hands_the_old_lock_back_still_held() {
    let mut a = cache(8, 8);
    let (t, h) = prompt(1, 2);
    let dev_only = put_device(&mut a, &t, &h);
    let (t2, h2) = prompt(2, 1);
    let m = a.match_prefix(&h2);
    let pages = a.alloc::<Host>(1).unwrap();
    let host_node = a
        .insert::<Host>(m.host_node, m.host_pages, &h2, &t2, &pages)
        .unwrap()
        .end_node;
    let hl = a.lock::<Host>(host_node).unwrap();
    // The target holds no host copy: refused, and the old lock comes back still held.
    let refused = a.relock(hl, dev_only).unwrap_err();
    assert_eq!(
        refused.error,
        RadixError::NotResident {
            tier: TierKind::Host
        }
    );
    assert_eq!(refused.handle.node(), host_node);
    assert_eq!(a.outstanding_locks(), (0, 1));
    assert_eq!(a.evict::<Host>(1).freed_pages, 0, "the path stays pinned");
    assert!(a.is_resident(host_node, TierKind::Host).unwrap());
    // A handle of another cache is refused and handed back as well.
    let mut b = cache(8, 8);
    let root = b.root();
    let refused = b.relock(refused.handle, root).unwrap_err();
    assert_eq!(refused.error, RadixError::ForeignHandle);
    assert_eq!(a.unlock(refused.handle).unwrap(), host_node);
    assert_eq!(a.outstanding_locks(), (0, 0));
    a.check_invariants().unwrap();
}

#[test]
fn path_pages_from_and_node_at_depth() {
    let mut c = cache(16, 16);
    let (t, h) = prompt(3, 5);
    let end = put_device(&mut c, &t, &h);
    let all = c.path_pages::<Device>(end).unwrap();
    assert_eq!(c.path_pages_from::<Device>(end, 2).unwrap(), all[2..]);
    let n2 = c.node_at_depth(end, 2).unwrap();
    assert_eq!(c.node_end(n2).unwrap(), 2);
    assert_eq!(c.path_nodes(end).unwrap().len(), 2);
    assert!(c.node_at_depth(end, 9).is_err());
    assert!(matches!(
        c.path_pages::<Host>(end),
        Err(RadixError::NotResident { .. })
    ));
    c.check_invariants().unwrap();
}

#[test]
fn eviction_ties_break_by_creation_order() {
    // Two caches fed the same calls evict the same nodes (tensor-parallel ranks agree).
    let run = || {
        let mut c = cache(64, 8);
        for s in 0..8 {
            let (t, h) = prompt(s, 2);
            put_device(&mut c, &t, &h);
        }
        c.evict::<Device>(6)
            .evicted
            .into_iter()
            .map(|e| e.hashes[0])
            .collect::<Vec<_>>()
    };
    assert_eq!(run(), run());
}
