//! What the publisher has told its subscribers is resident, so it can answer a snapshot.
//!
//! Why the publisher keeps its own copy instead of asking the cache: a snapshot must match a
//! sequence number exactly (a subscriber applies it, then the live stream from the next
//! number on). The publisher thread is the one place where "every batch up to seq N" is
//! known; folding those batches into a block index there makes the snapshot consistent by
//! construction, with no lock on the engine's cache. The cost is one entry per resident block
//! (its hash, parent, tokens): the cache's own metadata, once more.
//!
//! Invariant: the blocks of a medium are listed in the order they were (last) stored, so a
//! parent always comes before its children (a cache never stores a child before its parent
//! on the same tier), and replaying [`Mirror::snapshot`] into an empty index gives this one.

use std::collections::{BTreeMap, HashMap};

use kvtier_radix::PageHash;

use crate::wire::{Locality, Medium, WireEvent};

#[derive(Clone, Debug)]
struct Block {
    order: u64,
    parent: Option<PageHash>,
    tokens: Vec<u32>,
    block_size: u32,
    lora_name: Option<String>,
    locality: Option<Locality>,
}

#[derive(Default, Debug)]
struct MediumIndex {
    order: BTreeMap<u64, PageHash>,
    blocks: HashMap<PageHash, Block>,
}

/// The resident blocks per medium, as folded from the published events.
#[derive(Default, Debug)]
pub struct Mirror {
    media: HashMap<Medium, MediumIndex>,
    next: u64,
}

impl Mirror {
    pub fn new() -> Self {
        Self::default()
    }

    /// Folds one published event in.
    pub fn apply(&mut self, e: &WireEvent) {
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
                let idx = self.media.entry(*medium).or_default();
                let bs = *block_size as usize;
                let mut parent = *parent_block_hash;
                for (i, h) in block_hashes.iter().enumerate() {
                    let tokens = token_ids
                        .get(i * bs..(i + 1) * bs)
                        .map(<[u32]>::to_vec)
                        .unwrap_or_default();
                    if let Some(old) = idx.blocks.remove(h) {
                        idx.order.remove(&old.order);
                    }
                    let order = self.next;
                    self.next += 1;
                    idx.order.insert(order, *h);
                    idx.blocks.insert(
                        *h,
                        Block {
                            order,
                            parent,
                            tokens,
                            block_size: *block_size,
                            lora_name: lora_name.clone(),
                            locality: *locality,
                        },
                    );
                    parent = Some(*h);
                }
            }
            WireEvent::BlockRemoved {
                block_hashes,
                medium,
                ..
            } => {
                if let Some(idx) = self.media.get_mut(medium) {
                    for h in block_hashes {
                        if let Some(old) = idx.blocks.remove(h) {
                            idx.order.remove(&old.order);
                        }
                    }
                }
            }
            WireEvent::AllBlocksCleared => self.media.clear(),
        }
    }

    /// Resident blocks, all media together.
    pub fn blocks(&self) -> usize {
        self.media.values().map(|m| m.blocks.len()).sum()
    }

    /// Resident block hashes of one medium, in stored order.
    pub fn hashes(&self, medium: Medium) -> Vec<PageHash> {
        self.media
            .get(&medium)
            .map(|m| m.order.values().copied().collect())
            .unwrap_or_default()
    }

    /// `AllBlocksCleared`, then a `BlockStored` per run of blocks (a run: consecutive in stored
    /// order, each the previous one's child, same medium, adapter and block size).
    pub fn snapshot(&self) -> Vec<WireEvent> {
        let mut out = vec![WireEvent::AllBlocksCleared];
        let mut media: Vec<_> = self.media.iter().collect();
        media.sort_by_key(|(m, _)| m.as_str());
        for (medium, idx) in media {
            let mut run: Option<WireEvent> = None;
            for h in idx.order.values() {
                let b = &idx.blocks[h];
                if let Some(WireEvent::BlockStored {
                    block_hashes,
                    token_ids,
                    block_size,
                    lora_name,
                    locality,
                    ..
                }) = run.as_mut()
                    && block_hashes.last() == b.parent.as_ref()
                    && *block_size == b.block_size
                    && *lora_name == b.lora_name
                    && *locality == b.locality
                {
                    block_hashes.push(*h);
                    token_ids.extend_from_slice(&b.tokens);
                    continue;
                }
                out.extend(run.take());
                run = Some(WireEvent::BlockStored {
                    block_hashes: vec![*h],
                    parent_block_hash: b.parent,
                    token_ids: b.tokens.clone(),
                    block_size: b.block_size,
                    medium: *medium,
                    lora_name: b.lora_name.clone(),
                    locality: b.locality,
                });
            }
            out.extend(run);
        }
        out
    }
}
