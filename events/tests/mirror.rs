//! The publisher's mirror against the real radix cache: folding the cache's events gives
//! exactly the blocks the cache holds, tier by tier, and a snapshot replayed into an empty
//! mirror gives the same index (what a late subscriber rebuilds).

use std::collections::BTreeSet;

use kvtier_events::{Medium, Mirror, WireEvent};
use kvtier_radix::*;
use proptest::prelude::*;

mod common;
use common::*;

#[derive(Clone, Debug)]
enum Op {
    Put {
        seed: u32,
        shared: usize,
        pages: usize,
    },
    BackUp {
        seed: u32,
        shared: usize,
        pages: usize,
        upto: usize,
    },
    EvictDevice(usize),
    EvictHost(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u32..6, 0usize..3, 1usize..6).prop_map(|(seed, shared, pages)| Op::Put {
            seed,
            shared,
            pages
        }),
        (1u32..6, 0usize..3, 1usize..6, 1usize..6).prop_map(|(seed, shared, pages, upto)| {
            Op::BackUp {
                seed,
                shared,
                pages,
                upto,
            }
        }),
        (1usize..8).prop_map(Op::EvictDevice),
        (1usize..8).prop_map(Op::EvictHost),
    ]
}

fn apply(c: &mut RadixCache, op: &Op) {
    match *op {
        Op::Put {
            seed,
            shared,
            pages,
        } => put_device(c, &tokens(seed, shared.min(pages), pages)),
        Op::BackUp {
            seed,
            shared,
            pages,
            upto,
        } => back_up(c, &tokens(seed, shared.min(pages), pages), upto),
        Op::EvictDevice(n) => {
            c.evict::<Device>(n);
        }
        Op::EvictHost(n) => {
            c.evict::<Host>(n);
        }
    }
}

fn resident(c: &RadixCache, tier: TierKind) -> BTreeSet<PageHash> {
    c.resident_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::Stored {
                tier: t, hashes, ..
            } if t == tier => Some(hashes),
            _ => None,
        })
        .flatten()
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]
    #[test]
    fn mirror_of_the_events_is_the_cache_and_its_snapshot_rebuilds_it(ops in prop::collection::vec(op(), 1..40)) {
        let mut c = RadixCache::new(RadixConfig { page_size: PS, device_pages: 12, host_pages: 16, record_events: true })
            .expect("config");
        let mut mirror = Mirror::new();
        for o in &ops {
            apply(&mut c, o);
            for e in c.drain_events() {
                mirror.apply(&WireEvent::from_kv(&e, PS as u32));
            }
            for (tier, medium) in [(TierKind::Device, Medium::Gpu), (TierKind::Host, Medium::Cpu)] {
                let got: BTreeSet<_> = mirror.hashes(medium).into_iter().collect();
                prop_assert_eq!(&got, &resident(&c, tier), "{:?} after {:?}", tier, o);
            }
        }
        let mut late = Mirror::new();
        late.apply(&WireEvent::BlockStored {
            block_hashes: vec![PageHash([9; 32])], parent_block_hash: None, token_ids: vec![0; PS],
            block_size: PS as u32, medium: Medium::Gpu, lora_name: None, locality: None,
        }); // stale state the snapshot's AllBlocksCleared must drop
        for e in mirror.snapshot() {
            late.apply(&e);
        }
        for m in [Medium::Gpu, Medium::Cpu] {
            prop_assert_eq!(late.hashes(m), mirror.hashes(m));
        }
        // every stored block's tokens came along: a snapshot event carries block_size tokens a block
        for e in mirror.snapshot() {
            if let WireEvent::BlockStored { block_hashes, token_ids, .. } = e {
                prop_assert_eq!(token_ids.len(), block_hashes.len() * PS);
            }
        }
    }
}

#[test]
fn resident_events_list_parents_before_children() {
    let mut c = RadixCache::new(RadixConfig {
        page_size: PS,
        device_pages: 32,
        host_pages: 0,
        record_events: false,
    })
    .expect("config");
    for (seed, shared, pages) in [(1, 0, 3), (2, 2, 5), (3, 1, 4), (4, 4, 6)] {
        apply(
            &mut c,
            &Op::Put {
                seed,
                shared,
                pages,
            },
        );
    }
    let mut seen: BTreeSet<PageHash> = BTreeSet::new();
    for e in c.resident_events() {
        if let KvEvent::Stored {
            parent,
            hashes,
            tokens,
            ..
        } = e
        {
            if let Some(p) = parent {
                assert!(seen.contains(&p), "a child listed before its parent");
            }
            assert_eq!(tokens.len(), hashes.len() * PS);
            seen.extend(hashes);
        }
    }
    assert!(seen.len() >= 6);
}

/// A snapshot lists every block's parent before it, whatever the order the blocks were
/// stored in, across media too: a subscriber that keys blocks by their parents (a router
/// hashing tokens, as Dynamo's and `kvtier-router --keys tokens` do) keys a child whose
/// parent comes later as nothing. The bug: blocks were listed per medium in the order they
/// were last stored, `CPU` before `GPU`, so a parent stored again after its child (a
/// publisher's re-announcement of a resident block) came after it, and a block offloaded
/// to host whose parent stayed on the device only came before it.
#[test]
fn a_snapshot_lists_each_parent_before_its_children() {
    let h = |b: u8| PageHash([b; 32]);
    let stored = |hs: &[u8], parent: Option<u8>, medium: Medium| WireEvent::BlockStored {
        block_hashes: hs.iter().map(|&b| h(b)).collect(),
        parent_block_hash: parent.map(h),
        token_ids: vec![0; hs.len() * PS],
        block_size: PS as u32,
        medium,
        lora_name: None,
        locality: None,
    };
    let mut m = Mirror::new();
    for e in [
        stored(&[1, 2], None, Medium::Gpu),
        stored(&[1], None, Medium::Gpu), // re-stored after its child
        stored(&[3], Some(2), Medium::Cpu), // its parent on the device only
        stored(&[4], Some(3), Medium::Cpu),
    ] {
        m.apply(&e);
    }
    let mut seen = BTreeSet::new();
    for e in m.snapshot() {
        if let WireEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            ..
        } = e
        {
            if let Some(p) = parent_block_hash {
                assert!(
                    seen.contains(&p),
                    "{:?} listed before its parent",
                    block_hashes[0].0[0]
                );
            }
            seen.extend(block_hashes);
        }
    }
    assert_eq!(seen.len(), 4);
}
