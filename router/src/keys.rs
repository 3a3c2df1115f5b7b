//! Token-derived page keys, for engines whose block hashes the router cannot compute.
//!
//! kvtier's engines publish kvtier's page hashes, which the router computes from a prompt's
//! tokens, salt and adapter ([`crate::Router::route`]). vLLM's hashes are its own (SHA-256
//! over its CBOR encoding of parent hash, tokens and extra keys; seeded at random per process
//! under its non-cryptographic hashes) and SGLang's differ again, so for those the router keys each page by its own chained hash of the tokens in the event
//! (`BlockStored` carries `token_ids`, `block_size`, `parent_block_hash`, `lora_name`), as
//! NVIDIA Dynamo's indexer does, and remembers each engine hash's key so that `BlockRemoved`
//! (hashes only) and children (a parent hash) can be translated. A prompt is keyed the same
//! way ([`prompt_keys`]). The salt is not in vLLM's events, so in this mode two tenants'
//! equal prompts share keys: a routing hint at worst, never a cache hit the engine would not
//! give.

use std::collections::HashMap;

use kvtier_events::Medium;
use rmpv::Value;

use crate::index::{DecodeError, IndexEvent, WireMap, batch_events};
use crate::table::Table;

/// One entry of the table: engine hash, then key and the media holding it.
type Entry = (u64, (u64, u8));

const MUL: u64 = 0x9E37_79B9_7F4A_7C15;

fn mix(mut h: u64, x: u64) -> u64 {
    h ^= x.wrapping_add(0x632B_E59B_D9B4_E019);
    h = h.wrapping_mul(MUL);
    h ^ (h >> 29)
}

/// The chain's root: no adapter, or the adapter's name.
pub fn root(lora_name: Option<&str>) -> u64 {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    if let Some(n) = lora_name {
        h = mix(h, 1);
        for b in n.bytes() {
            h = mix(h, u64::from(b));
        }
    }
    h
}

/// The key of one full page of `tokens` after a page keyed `parent`.
pub fn page_key(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = mix(parent, tokens.len() as u64);
    for &t in tokens {
        h = mix(h, u64::from(t));
    }
    h
}

/// The keys of a prompt's full pages.
pub fn prompt_keys(tokens: &[u32], page_size: usize, lora_name: Option<&str>) -> Vec<u64> {
    if page_size == 0 {
        return Vec::new();
    }
    let mut parent = root(lora_name);
    tokens
        .chunks_exact(page_size)
        .map(|c| {
            parent = page_key(parent, c);
            parent
        })
        .collect()
}

fn bit(m: Medium) -> u8 {
    match m {
        Medium::Gpu => 1,
        Medium::Cpu => 2,
        Medium::Storage => 4,
    }
}

/// One stream's engine-hash → key table, bounded in entries and in bytes (a router sets the
/// bytes to what its budget leaves, [`Self::set_max_bytes`]).
#[derive(Debug)]
pub struct Translator {
    keys: HashMap<u64, (u64, u8)>,
    table: Table,
    max_entries: usize,
    max_bytes: usize,
    /// Blocks not keyed (an unknown parent, too few tokens) or not remembered (the table
    /// full: the block is keyed for the index, but its removal and children cannot be).
    pub unkeyed: u64,
}

impl Translator {
    pub fn new(max_entries: usize) -> Self {
        Self {
            keys: HashMap::new(),
            table: Table::default(),
            max_entries,
            max_bytes: usize::MAX,
            unkeyed: 0,
        }
    }

    pub fn entries(&self) -> usize {
        self.keys.len()
    }

    /// Bytes the table holds on the heap, as the allocator counts them (24-byte entries and a
    /// control byte per slot, see `table.rs`).
    pub fn memory_bytes(&self) -> usize {
        self.table.bytes::<Entry>()
    }

    /// The most bytes the table may hold: an entry that would grow it past them is not
    /// remembered. It never shrinks, so a bound below [`Self::memory_bytes`] only stops growth.
    pub fn set_max_bytes(&mut self, max_bytes: usize) {
        self.max_bytes = max_bytes;
    }

    /// Forgets everything (the stream's publisher restarted or sent a snapshot).
    pub fn clear(&mut self) {
        self.keys.clear();
    }

    /// Whether one more entry fits, in entries and in bytes.
    fn has_room(&self) -> bool {
        let grow = self
            .table
            .growth::<Entry>(self.keys.len(), self.keys.capacity());
        self.keys.len() < self.max_entries
            && self.memory_bytes().saturating_add(grow) <= self.max_bytes
    }

    /// Decodes a `KVEventBatch` and translates its events to keys.
    pub fn translate(&mut self, payload: &[u8]) -> Result<Vec<IndexEvent>, DecodeError> {
        let events = batch_events(payload)?;
        let mut out = Vec::with_capacity(events.len());
        for e in &events {
            let e = WireMap::of(e)?;
            let Some(medium) = e.medium() else {
                continue;
            };
            match e.kind() {
                Some("AllBlocksCleared") => {
                    self.keys.retain(|_, (_, m)| {
                        *m &= bit(Medium::Storage);
                        *m != 0
                    });
                    out.push(IndexEvent::Cleared);
                }
                Some("BlockStored") => {
                    let hs = e.hashes()?;
                    let bs = e
                        .field("block_size")
                        .and_then(Value::as_u64)
                        .and_then(|b| usize::try_from(b).ok())
                        .filter(|&b| b > 0)
                        .ok_or(DecodeError::Shape("block_size is not a positive integer"))?;
                    let Some(Value::Array(toks)) = e.field("token_ids") else {
                        return Err(DecodeError::Shape("token_ids is not an array"));
                    };
                    let toks: Vec<u32> = toks
                        .iter()
                        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                        .collect::<Option<_>>()
                        .ok_or(DecodeError::Shape("a token id is not a u32"))?;
                    let lora = e.field("lora_name").and_then(Value::as_str);
                    let mut parent = match e.field("parent_block_hash") {
                        None | Some(Value::Nil) => Some(root(lora)),
                        Some(p) => {
                            let p = crate::index::hash64(p)?;
                            self.keys.get(&p).map(|k| k.0)
                        }
                    };
                    let mut keys = Vec::with_capacity(hs.len());
                    for (i, h) in hs.iter().enumerate() {
                        let page = i
                            .checked_mul(bs)
                            .and_then(|a| toks.get(a..a.checked_add(bs)?));
                        let (Some(p), Some(page)) = (parent, page) else {
                            self.unkeyed += (hs.len() - i) as u64;
                            break;
                        };
                        let k = page_key(p, page);
                        if let Some(e) = self.keys.get_mut(h) {
                            *e = (k, e.1 | bit(medium));
                        } else if self.has_room() {
                            self.keys.insert(*h, (k, bit(medium)));
                            self.table.inserted(self.keys.capacity());
                        } else {
                            self.unkeyed += 1;
                        }
                        keys.push(k);
                        parent = Some(k);
                    }
                    out.push(IndexEvent::Stored {
                        medium,
                        hashes: keys,
                    });
                }
                Some("BlockRemoved") => {
                    let mut keys = Vec::new();
                    for h in e.hashes()? {
                        if let Some(e) = self.keys.get_mut(&h) {
                            keys.push(e.0);
                            e.1 &= !bit(medium);
                            if e.1 == 0 {
                                self.keys.remove(&h);
                            }
                        }
                    }
                    out.push(IndexEvent::Removed {
                        medium,
                        hashes: keys,
                    });
                }
                _ => {}
            }
        }
        Ok(out)
    }
}
