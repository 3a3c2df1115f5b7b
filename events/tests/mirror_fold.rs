//! The mirror against any event stream, not only a cache's: whatever batches were
//! published (stores with or without tokens and parents, of any medium, adapter, locality
//! and block size, removals, clears, blocks stored again), folding the snapshot into an
//! empty index gives what folding the stream gives, and the snapshot lists every block
//! after its parent wherever the parent is resident.

use std::collections::{BTreeMap, HashSet};

use kvtier_events::{Locality, Medium, Mirror, WireEvent};
use kvtier_radix::PageHash;
use proptest::prelude::*;

/// What a subscriber keeps of a block: its parent, tokens, block size, adapter, locality.
type Entry = (
    Option<PageHash>,
    Vec<u32>,
    u32,
    Option<String>,
    Option<Locality>,
);

/// A subscriber's index: the stream folded the way vLLM's events read (a `BlockStored`'s
/// blocks are a chain from its parent, `block_size` tokens each, in order).
#[derive(Default, Debug, PartialEq)]
struct Index(BTreeMap<(&'static str, [u8; 32]), Entry>);

impl Index {
    fn apply(&mut self, e: &WireEvent) {
        match e {
            WireEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_name,
                locality,
            } => {
                let bs = *block_size as usize;
                let mut parent = *parent_block_hash;
                for (i, h) in block_hashes.iter().enumerate() {
                    let tokens = token_ids
                        .get(i * bs..(i + 1) * bs)
                        .map(<[u32]>::to_vec)
                        .unwrap_or_default();
                    self.0.insert(
                        (medium.as_str(), h.0),
                        (parent, tokens, *block_size, lora_name.clone(), *locality),
                    );
                    parent = Some(*h);
                }
            }
            WireEvent::BlockRemoved {
                block_hashes,
                medium,
                ..
            } => {
                for h in block_hashes {
                    self.0.remove(&(medium.as_str(), h.0));
                }
            }
            WireEvent::AllBlocksCleared => self.0.clear(),
        }
    }

    fn resident(&self, h: &PageHash) -> bool {
        self.0.keys().any(|(_, k)| *k == h.0)
    }
}

const MEDIA: [Medium; 3] = [Medium::Gpu, Medium::Cpu, Medium::Storage];

fn hash(i: u8) -> PageHash {
    PageHash([i; 32])
}

fn event() -> impl Strategy<Value = WireEvent> {
    let store = (
        prop::collection::vec(0u8..8, 1..4),
        prop::option::of(0u8..8),
        0usize..3, // tokens: none, every block's, or one short
        prop::sample::select(vec![2u32, 4]),
        0usize..3,
        prop::option::of(prop::sample::select(vec!["a", "b"])),
        prop::option::of(prop::sample::select(vec![
            Locality::Local,
            Locality::Remote,
        ])),
    )
        .prop_map(|(mut hs, parent, toks, bs, m, lora, locality)| {
            // a child's hash above its parent's, as a hash covers its parent's: no cycle
            // (a block may still be stored again under another parent)
            hs.sort_unstable();
            hs.dedup();
            let parent = parent.filter(|p| *p < hs[0]);
            let n = hs.len() * bs as usize;
            let len = [0, n, n.saturating_sub(1)][toks];
            WireEvent::BlockStored {
                block_hashes: hs.into_iter().map(hash).collect(),
                parent_block_hash: parent.map(hash),
                token_ids: (0..len as u32).map(|t| t + 100 * len as u32).collect(),
                block_size: bs,
                medium: MEDIA[m],
                lora_name: lora.map(str::to_string),
                locality,
            }
        });
    let remove = (prop::collection::vec(0u8..8, 1..3), 0usize..3).prop_map(|(hs, m)| {
        WireEvent::BlockRemoved {
            block_hashes: hs.into_iter().map(hash).collect(),
            medium: MEDIA[m],
            locality: None,
        }
    });
    prop_oneof![
        6 => store,
        3 => remove,
        1 => Just(WireEvent::AllBlocksCleared),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn a_snapshot_folds_into_what_the_stream_folds_into(
        events in prop::collection::vec(event(), 1..24)
    ) {
        let mut mirror = Mirror::new();
        let mut stream = Index::default();
        for e in &events {
            mirror.apply(e);
            stream.apply(e);
        }
        let snap = mirror.snapshot();
        prop_assert_eq!(snap.first(), Some(&WireEvent::AllBlocksCleared));
        let mut rebuilt = Index::default();
        let mut listed: HashSet<[u8; 32]> = HashSet::new();
        for e in &snap {
            if let WireEvent::BlockStored { block_hashes, parent_block_hash, .. } = e {
                // a block after its parent wherever the parent is resident
                if let Some(p) = parent_block_hash
                    && stream.resident(p)
                    && !block_hashes.contains(p)
                {
                    prop_assert!(listed.contains(&p.0), "{:?} listed before its parent", block_hashes);
                }
                listed.extend(block_hashes.iter().map(|h| h.0));
            }
            rebuilt.apply(e);
        }
        prop_assert_eq!(&rebuilt, &stream, "snapshot {:?}", snap);
        prop_assert_eq!(mirror.blocks(), stream.0.len());
    }
}
