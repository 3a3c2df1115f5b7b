//! The shadow selector (`EvictionPolicy::Shadow`): a full-size shadow of a fixed option
//! reports exactly the hits a real cache run under that option reports on the same stream
//! (a cache of another page size, with real tokens, driven by this file's own replay); a
//! sampled shadow stays near it; switching keeps every invariant of the real cache; two
//! caches fed the same stream (tensor-parallel ranks) switch at the same submission and
//! evict the same leaves.

use kvtier_radix::shadow::{Candidate, ShadowCache, ShadowSelector};
use kvtier_radix::*;
use proptest::prelude::*;

const PS: usize = 4;

/// A request: (system prompt id, conversation id, turn): its prompt is the system prompt's
/// `sys_pages`, then `turn + 1` pages of the conversation.
type Req = (u32, u32, u32);

fn tokens(r: Req, sys_pages: usize) -> Vec<u32> {
    let (sys, conv, turn) = r;
    let mut t: Vec<u32> = (0..(sys_pages * PS) as u32)
        .map(|i| 1_000_000 * (sys + 1) + i)
        .collect();
    // Conversation tokens have the top bit set (system prompts' never do), the conversation
    // in bits 8..31 and the position below (in u32 for any conversation id the tests use).
    let n = (turn as usize + 1) * PS;
    assert!(
        n <= 256 && conv < 1 << 23,
        "{n} tokens, conversation {conv}"
    );
    t.extend((0..n as u32).map(|i| (1 << 31) | (conv << 8) | i));
    t
}

fn stream() -> impl Strategy<Value = Vec<Req>> {
    proptest::collection::vec((0u32..3, 0u32..24, 0u32..6), 1..160)
}

/// A real run of one option: the cache at page size `PS` with the prompt's tokens, driven
/// as an engine drives it (match; load or compute onto device, demoting first under
/// `Demote`; copy to host at finish under `CopyAtFinish`). Returns the pages hit.
fn real_replay(c: &mut RadixCache, adm: LearntAdmission, toks: &[u32], hs: &[PageHash]) -> usize {
    let m = c.match_prefix(hs);
    let dev = c.usage(TierKind::Device).capacity;
    let n = hs.len().min(dev);
    if n > m.device_pages {
        real_fill::<Device>(
            c,
            adm,
            &hs[..n],
            &toks[..n * PS],
            m.device_node,
            m.device_pages,
        );
    }
    if adm == LearntAdmission::CopyAtFinish {
        let nh = n.min(c.usage(TierKind::Host).capacity);
        if nh > m.host_pages {
            real_fill::<Host>(
                c,
                adm,
                &hs[..nh],
                &toks[..nh * PS],
                m.host_node,
                m.host_pages,
            );
        }
    }
    m.matched_pages
}

fn real_fill<T: Tier>(
    c: &mut RadixCache,
    adm: LearntAdmission,
    hs: &[PageHash],
    toks: &[u32],
    start: NodeId,
    from: usize,
) {
    let lock = c.lock::<T>(start).unwrap();
    let need = hs.len() - from;
    if T::KIND == TierKind::Device && adm == LearntAdmission::Demote {
        real_demote(c, need);
    }
    if let Ok(pages) = c.alloc_evicting::<T>(need) {
        let o = c.insert(start, from, hs, toks, &pages).unwrap();
        let dup: Vec<_> = o.duplicates.iter().map(|d| d.1).collect();
        c.free(&dup).unwrap();
    }
    c.unlock(lock).unwrap();
}

fn real_demote(c: &mut RadixCache, need: usize) {
    let mut covered = c.usage(TierKind::Device).free;
    let mut victims = Vec::new();
    for leaf in c.evictable_lru::<Device>() {
        if covered >= need {
            break;
        }
        covered += c.node_hashes(leaf).unwrap().len();
        if !c.is_resident(leaf, TierKind::Host).unwrap() {
            victims.push(leaf);
        }
    }
    for leaf in victims {
        let path = c.path_nodes(leaf).unwrap();
        let i = path
            .iter()
            .position(|&(n, ..)| !c.is_resident(n, TierKind::Host).unwrap())
            .unwrap();
        let above = if i == 0 { c.root() } else { path[i - 1].0 };
        let (from, end) = (path[i].1, path[path.len() - 1].2);
        let lock = c.lock::<Host>(above).unwrap();
        if let Ok(pages) = c.alloc_for_copy::<Host>(leaf, TierKind::Device, end - from) {
            let unused = c.add_copies(leaf, from, &pages).unwrap();
            c.free(&unused).unwrap();
        }
        c.unlock(lock).unwrap();
    }
}

fn quick(decide_every: u64) -> ShadowConfig {
    ShadowConfig {
        decide_every,
        ..ShadowConfig::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Each full-size shadow inside a selector (which switches meanwhile) reports, request by
    /// request, the hits of a real run of its option at page size 4 with real tokens.
    #[test]
    fn full_size_shadow_reports_a_real_runs_hits(reqs in stream(), dev in 4u32..24, host in 0u32..48, sys_pages in 1usize..4) {
        let mut sel = ShadowSelector::new(quick(4), dev, host).unwrap();
        let cands: Vec<Candidate> = ShadowConfig::matrix_candidates();
        let mut real: Vec<RadixCache> = cands.iter().map(|c| {
            let mut r = RadixCache::new(RadixConfig { page_size: PS, device_pages: dev, host_pages: host, record_events: false }).unwrap();
            r.set_eviction_policy(c.eviction);
            r
        }).collect();
        let mut real_hits = vec![0u64; cands.len()];
        for &q in &reqs {
            let toks = tokens(q, sys_pages);
            let hs = page_hashes(&toks, PS, None);
            sel.observe(&hs);
            for (i, c) in cands.iter().enumerate() {
                real_hits[i] += real_replay(&mut real[i], c.admission, &toks, &hs) as u64;
                prop_assert_eq!(sel.shadows()[i].hits().0, real_hits[i], "{} after {:?}", c, q);
                real[i].check_invariants().map_err(TestCaseError::fail)?;
            }
            sel.check().map_err(TestCaseError::fail)?;
        }
    }

    /// A cache under the shadow policy keeps every invariant while the selector switches
    /// (checked after every request, the selector's own bounds included); its ranking is
    /// always its choice's.
    #[test]
    fn switching_keeps_the_caches_invariants(reqs in stream(), dev in 4u32..24, host in 0u32..48) {
        let mut c = RadixCache::new(RadixConfig { page_size: PS, device_pages: dev, host_pages: host, record_events: false }).unwrap();
        c.set_shadow_config(quick(2)).unwrap();
        c.set_eviction_policy(EvictionPolicy::Shadow);
        for &q in &reqs {
            let toks = tokens(q, 2);
            let hs = page_hashes(&toks, PS, None);
            c.observe_request(&hs);
            let adm = c.learnt_admission().unwrap();
            real_replay(&mut c, adm, &toks, &hs);
            c.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(c.outstanding_locks(), (0, 0));
        }
    }

    /// Two ranks fed the same stream switch at the same submissions and evict the same leaves,
    /// with full-size or sampled shadows (keyed past the stream's hot prefixes, which each
    /// rank learns from the stream alone).
    #[test]
    fn ranks_switch_in_the_same_step(reqs in stream(), dev in 4u32..24, host in 0u32..48, sampled in any::<bool>()) {
        let cfg = if sampled {
            ShadowConfig { full_size_pages: u64::from((dev + host) / 2), hot_fanout: 2, ..quick(2) }
        } else {
            quick(2)
        };
        let mk = || {
            let mut c = RadixCache::new(RadixConfig { page_size: PS, device_pages: dev, host_pages: host, record_events: false }).unwrap();
            c.set_shadow_config(cfg.clone()).unwrap();
            c.set_eviction_policy(EvictionPolicy::Shadow);
            c
        };
        let (mut a, mut b) = (mk(), mk());
        for &q in &reqs {
            let toks = tokens(q, 2);
            let hs = page_hashes(&toks, PS, None);
            for c in [&mut a, &mut b] {
                c.observe_request(&hs);
                let adm = c.learnt_admission().unwrap();
                real_replay(c, adm, &toks, &hs);
            }
            let (sa, sb) = (a.shadow_snapshot().unwrap(), b.shadow_snapshot().unwrap());
            prop_assert_eq!(&sa.switch_log, &sb.switch_log);
            prop_assert_eq!(sa.replayed, sb.replayed);
            prop_assert_eq!(sa.sample > 1, sampled);
            let order = |c: &RadixCache| -> Vec<Vec<PageHash>> {
                c.evictable_lru::<Device>().map(|n| c.node_hashes(n).unwrap().to_vec()).collect()
            };
            prop_assert_eq!(order(&a), order(&b));
        }
    }
}

/// A stream where frequency beats recency: a few hot prompts read again and again between
/// scans of one-off prompts longer than the cache. The selector leaves LRU for freq-depth
/// (it starts at LRU), once, and ends on the option whose shadow hit most.
#[test]
fn the_selector_follows_the_better_option() {
    let mut sel = ShadowSelector::new(
        ShadowConfig {
            candidates: ShadowConfig::matrix_candidates()
                .into_iter()
                .filter(|c| c.admission == LearntAdmission::CopyAtFinish)
                .collect(),
            ..quick(16)
        },
        32,
        0,
    )
    .unwrap();
    let mut one_off = 1000;
    for round in 0..200u32 {
        for hot in 0..3 {
            let hs = page_hashes(&tokens((hot, hot, 2), 1), PS, None);
            sel.observe(&hs);
        }
        for _ in 0..(2 + round % 3) {
            one_off += 1;
            let hs = page_hashes(&tokens((9, one_off, 5), 1), PS, None);
            sel.observe(&hs);
        }
    }
    let snap = sel.snapshot();
    assert_eq!(snap.choice, "freq-depth", "{snap:?}");
    assert_eq!(snap.switches, 1, "{snap:?}");
    let best = snap
        .shadows
        .iter()
        .max_by(|a, b| a.hit_rate.total_cmp(&b.hit_rate))
        .unwrap();
    assert_eq!(best.candidate, snap.choice);
}

/// Under a capacity above `full_size_pages`, shadows are sampled: 1 request prefix in R is
/// replayed on 1/R of the capacity. Keyed past the shared system prompts, on many
/// independent conversations the sampled shadows'
/// hit rates stay within 2 points of the full-size ones (measured: under 1) (the stated error of this test's
/// stream), and their trees are at most 1/R of the pages.
#[test]
fn a_sampled_shadow_stays_near_the_full_size_one() {
    let (dev, host) = (256u32, 1024u32);
    let full = ShadowSelector::new(quick(64), dev, host).unwrap();
    let sampled_cfg = ShadowConfig {
        full_size_pages: 160,
        ..quick(64)
    };
    let mut sampled = ShadowSelector::new(sampled_cfg, dev, host).unwrap();
    let mut full = full;
    assert_eq!(sampled.snapshot().sample, 8);
    // 2,000 conversations over 2 system prompts, turns of each a few hundred requests apart.
    let mut x: u64 = 7;
    for i in 0..20_000u32 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let conv = (x >> 33) as u32 % 2000;
        let q = (conv % 2, conv, (i / 4000 + conv % 3) % 6);
        let hs = page_hashes(&tokens(q, 2), PS, None);
        full.observe(&hs);
        sampled.observe(&hs);
    }
    let (f, s) = (full.snapshot(), sampled.snapshot());
    assert!(s.replayed > 1500 && s.replayed < 3500, "{}", s.replayed);
    for (a, b) in f.shadows.iter().zip(&s.shadows) {
        let err = (a.hit_rate - b.hit_rate).abs() * 100.0;
        eprintln!(
            "{}: full {:.2} %, sampled {:.2} %",
            a.candidate,
            a.hit_rate * 100.0,
            b.hit_rate * 100.0
        );
        assert!(
            err < 5.0,
            "{}: {:.2} vs {:.2}",
            a.candidate,
            a.hit_rate,
            b.hit_rate
        );
        assert!(b.nodes <= (dev + host) as usize / 8);
    }
}

/// Sampled shadows key a request past its hot shared prefix: under system prompts longer than
/// any fixed key depth (24 pages here), the sample is 1 conversation in R with every turn of
/// a conversation in or out together — not 1 system prompt in R, which puts all or none of
/// the conversations under it in the sample (before: 0, 1/3 or 2/3 of the requests here,
/// and the cost bound of 1/R of the requests did not hold).
#[test]
fn sampling_keys_each_conversation_past_its_shared_system_prompt() {
    let (dev, host) = (256u32, 1024u32);
    let cfg = ShadowConfig {
        full_size_pages: 256,
        ..quick(64)
    };
    let mut sel = ShadowSelector::new(cfg, dev, host).unwrap();
    assert_eq!(sel.snapshot().sample, 5);
    let sys_pages = 24;
    let mut x: u64 = 11;
    let mut turns = vec![0u32; 3000];
    // conversation -> replayed or not, for every turn after the system prompts are known hot
    let mut member: Vec<Option<bool>> = vec![None; 3000];
    let (mut counted, mut replayed) = (0u32, 0u32);
    for i in 0..20_000u32 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let conv = (x >> 33) as usize % 3000;
        let turn = turns[conv] % 6;
        turns[conv] += 1;
        let hs = page_hashes(
            &tokens((conv as u32 % 3, conv as u32, turn), sys_pages),
            PS,
            None,
        );
        let before = sel.snapshot().replayed;
        sel.observe(&hs);
        let was = sel.snapshot().replayed > before;
        if i < 500 {
            continue; // the first conversations under each system prompt make it hot
        }
        counted += 1;
        replayed += u32::from(was);
        match member[conv] {
            None => member[conv] = Some(was),
            Some(m) => assert_eq!(m, was, "conversation {conv}: turns sampled apart"),
        }
    }
    let share = f64::from(replayed) / f64::from(counted);
    eprintln!("{replayed} of {counted} requests replayed ({share:.3})");
    assert!(
        (0.12..0.28).contains(&share),
        "{replayed} of {counted} requests replayed ({share:.3}), expected about 1 in 5"
    );
}

/// Bad constants are refused with a typed error, nothing changed.
#[test]
fn bad_configs_are_refused() {
    let mut c = RadixCache::new(RadixConfig {
        page_size: PS,
        device_pages: 8,
        host_pages: 8,
        record_events: false,
    })
    .unwrap();
    let none = ShadowConfig {
        candidates: Vec::new(),
        ..ShadowConfig::default()
    };
    assert_eq!(
        c.set_shadow_config(none),
        Err(ShadowConfigError::NoCandidate)
    );
    let zero = ShadowConfig {
        decide_every: 0,
        ..ShadowConfig::default()
    };
    assert_eq!(
        c.set_shadow_config(zero),
        Err(ShadowConfigError::Zero("decide_every"))
    );
    let cold = ShadowConfig {
        hot_fanout: 0,
        ..ShadowConfig::default()
    };
    assert_eq!(
        c.set_shadow_config(cold),
        Err(ShadowConfigError::Zero("hot_fanout"))
    );
    let learnt = ShadowConfig {
        candidates: vec![Candidate {
            eviction: EvictionPolicy::Adaptive,
            admission: LearntAdmission::Demote,
        }],
        ..ShadowConfig::default()
    };
    assert!(matches!(
        c.set_shadow_config(learnt),
        Err(ShadowConfigError::NotFixed(_))
    ));
    assert_eq!("shadow".parse(), Ok(EvictionPolicy::Shadow));
    assert_eq!(EvictionPolicy::Shadow.to_string(), "shadow");
    let _ = ShadowCache::new(ShadowConfig::matrix_candidates()[0], 0, 0).unwrap();
}
