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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

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

    /// `AllBlocksCleared`, then a `BlockStored` per run of blocks (a run: consecutive in the
    /// listing, each the previous one's child, same medium, adapter and block size). Every
    /// block comes after its parent wherever the parent is resident (its medium first, then
    /// any other): media in name order, each in stored order, but a block whose parent is
    /// not listed yet is preceded by it (a parent stored again after its child, or a child
    /// offloaded to host whose parent is on the device only, came after it, and a
    /// subscriber keying blocks by their parents keyed the child as nothing).
    pub fn snapshot(&self) -> Vec<WireEvent> {
        let mut media: Vec<_> = self.media.iter().collect();
        media.sort_by_key(|(m, _)| m.as_str());
        let mut listed: HashSet<(Medium, PageHash), BuildHasherDefault<Folded>> =
            HashSet::with_capacity_and_hasher(self.blocks(), BuildHasherDefault::default());
        let mut order: Vec<(Medium, PageHash, &Block)> = Vec::with_capacity(self.blocks());
        for &(medium, idx) in &media {
            for h in idx.order.values() {
                let block = &idx.blocks[h];
                if block.parent.is_none_or(|p| listed.contains(&(*medium, p))) {
                    // the common case: a root, or its parent listed
                    listed.insert((*medium, *h));
                    order.push((*medium, *h, block));
                    continue;
                }
                // the chain of parents not listed yet, nearest first
                let mut chain = vec![(*medium, *h)];
                let mut at = (*medium, *h);
                while let Some(parent) = self.media[&at.0].blocks[&at.1].parent {
                    let here = std::iter::once(at.0).chain(media.iter().map(|(m, _)| **m));
                    let Some(m) = here
                        .into_iter()
                        .find(|m| self.media[m].blocks.contains_key(&parent))
                    else {
                        break;
                    };
                    let p = (m, parent);
                    if listed.contains(&p) || chain.contains(&p) {
                        break; // listed, or a cycle (a publisher's garbage)
                    }
                    chain.push(p);
                    at = p;
                }
                for (m, h) in chain.into_iter().rev() {
                    if listed.insert((m, h)) {
                        order.push((m, h, &self.media[&m].blocks[&h]));
                    }
                }
            }
        }
        let mut out = vec![WireEvent::AllBlocksCleared];
        let mut run: Option<WireEvent> = None;
        for (medium, h, b) in order {
            if let Some(WireEvent::BlockStored {
                block_hashes,
                token_ids,
                block_size,
                lora_name,
                locality,
                medium: run_medium,
                ..
            }) = run.as_mut()
                && *run_medium == medium
                && block_hashes.last() == b.parent.as_ref()
                && *block_size == b.block_size
                && tokens_align(token_ids, block_hashes.len(), b)
                && *lora_name == b.lora_name
                && *locality == b.locality
            {
                block_hashes.push(h);
                token_ids.extend_from_slice(&b.tokens);
                continue;
            }
            out.extend(run.take());
            run = Some(WireEvent::BlockStored {
                block_hashes: vec![h],
                parent_block_hash: b.parent,
                token_ids: b.tokens.clone(),
                block_size: b.block_size,
                medium,
                lora_name: b.lora_name.clone(),
                locality: b.locality,
            });
        }
        out.extend(run);
        out
    }
}

/// Whether `b` can join a run of `blocks` blocks holding `tokens` so that each block's
/// tokens stay its own: a subscriber reads block i's tokens at `i * block_size` of the run,
/// so a run whose blocks all had their `block_size` tokens takes one that has them too, and
/// a run without tokens one without (a block stored without tokens, then a child with them,
/// made one run whose tokens a subscriber read as the parent's).
fn tokens_align(tokens: &[u32], blocks: usize, b: &Block) -> bool {
    let bs = b.block_size as usize;
    (tokens.is_empty() && b.tokens.is_empty())
        || (b.tokens.len() == bs && blocks.checked_mul(bs) == Some(tokens.len()))
}

/// A hasher for page hashes (already uniform): each 8 bytes folded in with one multiply, a
/// few times faster than SipHash on the snapshot's 500K-block listings.
#[derive(Default)]
struct Folded(u64);

impl Hasher for Folded {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            self.0 = (self.0.rotate_left(29) ^ u64::from_le_bytes(b))
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
}
