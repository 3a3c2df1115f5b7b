//! Property tests of the radix cache against a simple page-level model.
//!
//! The model knows, for every page (identified by its chained hash), on which tiers it has a
//! copy, when it was last used, and which locks cover it. After every random operation the
//! cache must agree with the model on what matches, must pass `check_invariants` (prefix-closed
//! residency, pool accounting, no page owned twice, lock counts), and every eviction must pick
//! an unlocked leaf, under LRU the one with the oldest last use. Every eviction policy runs
//! the same operations (and the policy may change mid-run): a policy only ranks the
//! evictable leaves, so prefix closure, locks and pool balance must hold under each.

use std::collections::{HashMap, HashSet};

use kvtier_radix::*;
use proptest::prelude::*;

const PS: usize = 2;

#[derive(Debug, Clone)]
enum Op {
    Match(usize),
    Insert {
        prompt: usize,
        pages: usize,
        host: bool,
    },
    Lock {
        prompt: usize,
        host: bool,
    },
    Unlock(usize),
    /// Moves lock `lock` to the node the *other* tier matched for `prompt`: held on the
    /// lock's tier or not, so both an accepted and a refused relock happen.
    Relock {
        lock: usize,
        prompt: usize,
    },
    Evict {
        host: bool,
    },
    LoadBack(usize),
    /// Switch to policy `i` of [`policies`].
    SetPolicy(usize),
}

/// LRU and frequency/depth-aware settings, including extreme ones (huge credit, huge debit).
fn policies() -> Vec<EvictionPolicy> {
    vec![
        EvictionPolicy::Lru,
        EvictionPolicy::CONVERSATION,
        EvictionPolicy::Adaptive,
        EvictionPolicy::FrequencyDepth {
            use_credit_pages: 3,
            max_credited_uses: 2,
            depth_debit_per_page: 1,
        },
        EvictionPolicy::FrequencyDepth {
            use_credit_pages: u64::MAX,
            max_credited_uses: u32::MAX,
            depth_debit_per_page: u64::MAX,
        },
        EvictionPolicy::FrequencyDepth {
            use_credit_pages: 0,
            max_credited_uses: 0,
            depth_debit_per_page: 0,
        },
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..8usize).prop_map(Op::Match),
        4 => (0..8usize, 1..6usize, any::<bool>()).prop_map(|(prompt, pages, host)| Op::Insert { prompt, pages, host }),
        2 => (0..8usize, any::<bool>()).prop_map(|(prompt, host)| Op::Lock { prompt, host }),
        2 => (0..16usize).prop_map(Op::Unlock),
        2 => (0..16usize, 0..8usize).prop_map(|(lock, prompt)| Op::Relock { lock, prompt }),
        3 => any::<bool>().prop_map(|host| Op::Evict { host }),
        1 => (0..8usize).prop_map(Op::LoadBack),
        1 => (0..6usize).prop_map(Op::SetPolicy),
    ]
}

/// Prompts over a tiny alphabet so that they share prefixes and diverge mid-node.
fn prompts() -> impl Strategy<Value = Vec<Vec<u32>>> {
    prop::collection::vec(prop::collection::vec(0u32..2, PS * 6..=PS * 6), 8)
}

#[derive(Default)]
struct Model {
    /// page hash → (parent page hash, depth)
    pages: HashMap<PageHash, (Option<PageHash>, usize)>,
    resident: [HashSet<PageHash>; 2],
    access: HashMap<PageHash, u64>,
    tick: u64,
}

enum AnyLock {
    Dev(LockHandle<Device>, Vec<PageHash>),
    Host(LockHandle<Host>, Vec<PageHash>),
}

impl Model {
    fn matched(&self, t: usize, hs: &[PageHash]) -> usize {
        hs.iter()
            .take_while(|h| self.resident[t].contains(h))
            .count()
    }
    fn is_leaf(&self, t: usize, h: &PageHash) -> bool {
        !self.resident[t]
            .iter()
            .any(|c| self.pages.get(c).and_then(|p| p.0) == Some(*h))
    }
}

fn ti(host: bool) -> usize {
    host as usize
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn cache_agrees_with_model(prompts in prompts(), ops in prop::collection::vec(op(), 1..80),
                               dev_cap in 4u32..24, host_cap in 4u32..24, first_policy in 0..6usize) {
        let mut cache = RadixCache::new(RadixConfig {
            page_size: PS, device_pages: dev_cap, host_pages: host_cap, record_events: false,
        }).unwrap();
        cache.set_eviction_policy(policies()[first_policy]);
        let hashes: Vec<Vec<PageHash>> = prompts.iter().map(|p| page_hashes(p, PS, None)).collect();
        let mut m = Model::default();
        for hs in &hashes {
            for (i, h) in hs.iter().enumerate() {
                m.pages.insert(*h, (i.checked_sub(1).map(|j| hs[j]), i));
            }
        }
        let mut locks: Vec<AnyLock> = Vec::new();

        for op in ops {
            match op {
                Op::SetPolicy(i) => {
                    cache.set_eviction_policy(policies()[i]);
                    prop_assert_eq!(cache.eviction_policy(), policies()[i]);
                }
                Op::Match(i) => {
                    let r = cache.match_prefix(&hashes[i]);
                    let (d, h) = (m.matched(0, &hashes[i]), m.matched(1, &hashes[i]));
                    prop_assert_eq!((r.device_pages, r.host_pages), (d, h));
                    prop_assert_eq!(r.matched_pages, d.max(h));
                    prop_assert_eq!(cache.node_end(r.device_node).unwrap(), d);
                    prop_assert_eq!(cache.node_end(r.host_node).unwrap(), h);
                    m.tick += 1;
                    for x in &hashes[i][..d.max(h)] { m.access.insert(*x, m.tick); }
                }
                Op::Insert { prompt, pages, host } => {
                    let r = cache.match_prefix(&hashes[prompt]);
                    m.tick += 1;
                    for x in &hashes[prompt][..r.matched_pages] { m.access.insert(*x, m.tick); }
                    let (from, node) = if host { (r.host_pages, r.host_node) } else { (r.device_pages, r.device_node) };
                    if pages <= from { continue; }
                    let n = pages - from;
                    // The start node is pinned while pages are obtained, as the scheduler does.
                    let ok = if host {
                        let l = cache.lock::<Host>(node).unwrap();
                        let r = cache.alloc_evicting::<Host>(n).map(|p| insert_and_free(&mut cache, node, from, &hashes[prompt], &prompts[prompt], &p));
                        cache.unlock(l).unwrap();
                        r
                    } else {
                        let l = cache.lock::<Device>(node).unwrap();
                        let r = cache.alloc_evicting::<Device>(n).map(|p| insert_and_free(&mut cache, node, from, &hashes[prompt], &prompts[prompt], &p));
                        cache.unlock(l).unwrap();
                        r
                    };
                    match ok {
                        Ok(dups) => {
                            prop_assert_eq!(dups, 0, "insert right after match never duplicates");
                            // Eviction may have happened inside alloc_evicting: resync the model
                            // with the cache's residency for evicted pages only by re-deriving.
                            resync_evictions(&cache, &mut m, &hashes);
                            m.tick += 1;
                            for x in &hashes[prompt][from..pages] {
                                m.resident[ti(host)].insert(*x);
                                m.access.insert(*x, m.tick);
                            }
                            let (d, h) = cache.peek_prefix(&hashes[prompt]);
                            prop_assert!(if host { h >= pages } else { d >= pages }, "match after insert finds it");
                        }
                        Err(RadixError::PoolExhausted { requested, available, .. }) => {
                            prop_assert_eq!(requested, n);
                            prop_assert!(available < n);
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Lock { prompt, host } => {
                    let r = cache.match_prefix(&hashes[prompt]);
                    m.tick += 1;
                    for x in &hashes[prompt][..r.matched_pages] { m.access.insert(*x, m.tick); }
                    if host {
                        let hl = cache.lock::<Host>(r.host_node).unwrap();
                        locks.push(AnyLock::Host(hl, hashes[prompt][..r.host_pages].to_vec()));
                    } else {
                        let dl = cache.lock::<Device>(r.device_node).unwrap();
                        locks.push(AnyLock::Dev(dl, hashes[prompt][..r.device_pages].to_vec()));
                    }
                }
                Op::Unlock(i) => {
                    if i < locks.len() {
                        match locks.swap_remove(i) {
                            AnyLock::Dev(h, _) => { cache.unlock(h).unwrap(); }
                            AnyLock::Host(h, _) => { cache.unlock(h).unwrap(); }
                        }
                    }
                }
                Op::Relock { lock, prompt } => {
                    if lock >= locks.len() { continue; }
                    let r = cache.match_prefix(&hashes[prompt]);
                    m.tick += 1;
                    for x in &hashes[prompt][..r.matched_pages] { m.access.insert(*x, m.tick); }
                    let (d, h) = (r.device_pages, r.host_pages);
                    let moved = match locks.swap_remove(lock) {
                        AnyLock::Dev(l, held) => {
                            let old = l.node();
                            match cache.relock(l, r.host_node) {
                                Ok(nl) => { prop_assert!(d >= h, "a device lock moved to a node without device pages"); AnyLock::Dev(nl, hashes[prompt][..h].to_vec()) }
                                Err(refused) => {
                                    prop_assert!(d < h, "refused a node with device pages: {}", refused.error);
                                    prop_assert_eq!(refused.error.clone(), RadixError::NotResident { tier: TierKind::Device });
                                    prop_assert_eq!(refused.handle.node(), old);
                                    AnyLock::Dev(refused.handle, held)
                                }
                            }
                        }
                        AnyLock::Host(l, held) => {
                            let old = l.node();
                            match cache.relock(l, r.device_node) {
                                Ok(nl) => { prop_assert!(h >= d, "a host lock moved to a node without host pages"); AnyLock::Host(nl, hashes[prompt][..d].to_vec()) }
                                Err(refused) => {
                                    prop_assert!(h < d, "refused a node with host pages: {}", refused.error);
                                    prop_assert_eq!(refused.error.clone(), RadixError::NotResident { tier: TierKind::Host });
                                    prop_assert_eq!(refused.handle.node(), old);
                                    AnyLock::Host(refused.handle, held)
                                }
                            }
                        }
                    };
                    locks.push(moved);
                }
                Op::Evict { host } => {
                    let t = ti(host);
                    let out = if host { cache.evict::<Host>(1) } else { cache.evict::<Device>(1) };
                    let locked: HashSet<PageHash> = locks.iter().filter_map(|l| match l {
                        AnyLock::Dev(_, hs) if !host => Some(hs.clone()),
                        AnyLock::Host(_, hs) if host => Some(hs.clone()),
                        _ => None,
                    }).flatten().collect();
                    // Oldest last-use among the model's unlocked leaf pages on this tier; on
                    // device, among those host also holds if there are any (backed copies go
                    // before sole ones).
                    let candidates: Vec<PageHash> = m.resident[t].iter()
                        .filter(|h| !locked.contains(*h) && m.is_leaf(t, h)).copied().collect();
                    let backed: Vec<PageHash> = candidates.iter()
                        .filter(|h| t == 0 && m.resident[1].contains(*h)).copied().collect();
                    let first_class = if backed.is_empty() { &candidates } else { &backed };
                    let oldest = first_class.iter().map(|h| m.access[h]).min();
                    let lru = cache.eviction_policy() == EvictionPolicy::Lru;
                    prop_assert!(out.evicted.len() <= 1);
                    match (out.evicted.first(), oldest) {
                        (None, None) => {}
                        (Some(ev), Some(oldest)) => {
                            // The node's last page is an unlocked leaf page of the model.
                            let last = ev.hashes.last().unwrap();
                            prop_assert!(candidates.contains(last), "evicted a locked page or a non-leaf");
                            prop_assert!(first_class.contains(last), "a sole device copy went before a backed one");
                            for h in &ev.hashes {
                                prop_assert!(!locked.contains(h), "locked page evicted");
                                prop_assert!(m.resident[t].remove(h));
                                if lru {
                                    prop_assert_eq!(m.access[h], oldest, "eviction is LRU");
                                }
                            }
                            prop_assert_eq!(ev.removed, !m.resident[1 - t].contains(&ev.hashes[0]));
                        }
                        (ev, oldest) => prop_assert!(false, "evicted {ev:?} but model oldest {oldest:?}"),
                    }
                }
                Op::LoadBack(i) => {
                    // Host-only pages get a device copy (what the scheduler's load-back does).
                    let r = cache.match_prefix(&hashes[i]);
                    m.tick += 1;
                    for x in &hashes[i][..r.matched_pages] { m.access.insert(*x, m.tick); }
                    if r.host_pages > r.device_pages {
                        let n = r.host_pages - r.device_pages;
                        let hl = cache.lock::<Host>(r.host_node).unwrap();
                        let dl = cache.lock::<Device>(r.device_node).unwrap();
                        if let Ok(p) = cache.alloc_evicting::<Device>(n) {
                            resync_evictions(&cache, &mut m, &hashes);
                            let d = insert_and_free(&mut cache, r.device_node, r.device_pages, &hashes[i], &prompts[i], &p);
                            prop_assert_eq!(d, 0);
                            m.tick += 1;
                            for x in &hashes[i][r.device_pages..r.host_pages] {
                                m.resident[0].insert(*x);
                                m.access.insert(*x, m.tick);
                            }
                        }
                        cache.unlock(hl).unwrap();
                        cache.unlock(dl).unwrap();
                    }
                }
            }
            if let Err(e) = cache.check_invariants() { prop_assert!(false, "invariant: {e}"); }
            for t in [TierKind::Device, TierKind::Host] {
                let u = cache.usage(t);
                prop_assert_eq!(u.free + u.held + u.cached, u.capacity);
                prop_assert_eq!(u.held, 0);
                prop_assert_eq!(u.cached, m.resident[t as usize].len());
            }
        }
        // Quiescence: give every lock back, then everything can be evicted.
        for l in locks.drain(..) {
            match l { AnyLock::Dev(h, _) => { cache.unlock(h).unwrap(); } AnyLock::Host(h, _) => { cache.unlock(h).unwrap(); } }
        }
        prop_assert_eq!(cache.outstanding_locks(), (0, 0));
        cache.evict::<Device>(usize::MAX);
        cache.evict::<Host>(usize::MAX);
        prop_assert_eq!(cache.usage(TierKind::Device).free, dev_cap as usize);
        prop_assert_eq!(cache.usage(TierKind::Host).free, host_cap as usize);
        prop_assert_eq!(cache.node_count(), 1);
        cache.check_invariants().unwrap();
    }
}

fn insert_and_free<T: Tier>(
    cache: &mut RadixCache,
    node: NodeId,
    from: usize,
    hashes: &[PageHash],
    tokens: &[u32],
    pages: &[PageId<T>],
) -> usize {
    let out = cache
        .insert::<T>(node, from, hashes, tokens, pages)
        .unwrap();
    let dups: Vec<PageId<T>> = out.duplicates.iter().map(|d| d.1).collect();
    cache.free(&dups).unwrap();
    dups.len()
}

/// `alloc_evicting` may evict; drop from the model whatever the cache no longer holds.
fn resync_evictions(cache: &RadixCache, m: &mut Model, hashes: &[Vec<PageHash>]) {
    for hs in hashes {
        let (d, h) = cache.peek_prefix(hs);
        for (i, x) in hs.iter().enumerate() {
            if i >= d {
                m.resident[0].remove(x);
            }
            if i >= h {
                m.resident[1].remove(x);
            }
        }
    }
}
