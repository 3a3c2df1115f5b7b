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

use crate::holders::Holders;
use crate::index::{DecodeError, IndexEvent, WireMap, batch_events};
use crate::table::Table;

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

/// What the table remembers of one engine hash.
#[derive(Clone, Copy, Debug)]
struct Known {
    /// The router's key of the block.
    key: u64,
    /// The engine hash of the block before it in its chain (when `flags & HAS_PARENT`).
    parent: u64,
    /// The media holding it ([`bit`]).
    media: u8,
    /// [`HAS_PARENT`], and the media whose store named this block alone for a run of
    /// `run` blocks ending here (`bit(m) << 4`: a token-less store, see [`Tokenless`]).
    flags: u8,
    /// Blocks of that run (this one and `run - 1` parents).
    run: u16,
}

const HAS_PARENT: u8 = 1;

impl Known {
    fn parent(&self) -> Option<u64> {
        (self.flags & HAS_PARENT != 0).then_some(self.parent)
    }
}

/// One entry of the table: engine hash, then what is known of it.
type Entry = (u64, Known);
/// One entry of the hashes named before any instance keyed them: hash, blocks.
type PendingEntry = (u64, u16);

/// A `BlockStored` that names blocks by hash alone — a shared store's page (it knows no
/// tokens), or vLLM's offloading placeholder (`token_ids` empty, `block_size` 0, when its
/// self-describing events are off) — for the router to key through a table that saw the
/// block's tokens ([`crate::resolve`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tokenless {
    pub medium: Medium,
    /// The last block's engine hash (a chunk's: vLLM names an offloaded chunk by its last
    /// block's hash).
    pub hash: u64,
    /// The event's `block_size` (tokens of the named run; 0: unknown, one block).
    pub block_size: usize,
    /// On a storage tier local to the instance (`STORAGE` of locality `LOCAL`).
    pub local: bool,
}

/// A decoded batch, keyed.
#[derive(Debug, Default)]
pub struct Translated {
    /// The events, in the router's keys.
    pub events: Vec<IndexEvent>,
    /// Stores of blocks named by hash alone, to resolve ([`crate::resolve`]).
    pub tokenless: Vec<Tokenless>,
    /// Engine hashes this batch keyed for the first time (a pending store may name one).
    pub fresh: Vec<u64>,
}

/// Whose stream a [`Translator`] keys: what its `AllBlocksCleared` clears.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TableOf {
    /// An engine instance's: its GPU and CPU pages (the `STORAGE` pages it published stay).
    Instance,
    /// The shared store's: everything, and every wait.
    Store,
}

/// One stream's engine-hash → key table, bounded in entries and in bytes (a router sets the
/// bytes to what its budget leaves, [`Self::set_max_bytes`]).
#[derive(Debug)]
pub struct Translator {
    keys: HashMap<u64, Known>,
    table: Table,
    /// How many entries hold each key on each medium: a key leaves the index with its last
    /// holder (two tenants' equal tokens are two engine hashes, one key).
    holders: Holders,
    /// Token-less stores whose hash no table has keyed yet (a shared store's stream, heard
    /// before the instance that computed the block): hash → blocks.
    pending: HashMap<u64, u16>,
    pending_table: Table,
    /// Whose table: an instance's, or the shared store's ([`Self::for_store`]).
    of: TableOf,
    max_entries: usize,
    max_bytes: usize,
    /// Blocks not keyed (an unknown parent, too few tokens, a token-less store no table could
    /// key nor wait for) or not remembered (the table full: the block is keyed for the index,
    /// but its removal and children cannot be).
    pub unkeyed: u64,
}

impl Translator {
    /// An instance stream's table.
    pub fn new(max_entries: usize) -> Self {
        Self::of(TableOf::Instance, max_entries)
    }

    /// The shared store's stream's table: its `AllBlocksCleared` (a new leader, a snapshot's
    /// first event) forgets every page and every wait.
    pub fn for_store(max_entries: usize) -> Self {
        Self::of(TableOf::Store, max_entries)
    }

    fn of(of: TableOf, max_entries: usize) -> Self {
        Self {
            keys: HashMap::new(),
            table: Table::default(),
            holders: Holders::default(),
            pending: HashMap::new(),
            pending_table: Table::default(),
            of,
            max_entries,
            max_bytes: usize::MAX,
            unkeyed: 0,
        }
    }

    /// The event of `keys` stored (`stored`) or removed on `medium`: on an instance's
    /// stream, a `STORAGE` tier local to it (`local`: locality `LOCAL`, a node's disk) is
    /// its own ([`IndexEvent::LocalStored`]); on the shared store's, every page is shared.
    pub(crate) fn placed(
        &self,
        stored: bool,
        medium: Medium,
        local: bool,
        keys: Vec<u64>,
    ) -> IndexEvent {
        crate::index::placed(stored, medium, local && self.of == TableOf::Instance, keys)
    }

    pub fn entries(&self) -> usize {
        self.keys.len()
    }

    /// Token-less stores waiting for a table to key their hash.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Bytes the table holds on the heap, as the allocator counts them (32-byte entries and
    /// a control byte per slot, the pending stores' 16-byte ones and the holder counts'
    /// 16-byte ones, see `table.rs`).
    pub fn memory_bytes(&self) -> usize {
        self.table.bytes::<Entry>()
            + self.pending_table.bytes::<PendingEntry>()
            + self.holders.memory_bytes()
    }

    /// The most bytes the table may hold: an entry that would grow it past them is not
    /// remembered. It never shrinks, so a bound below [`Self::memory_bytes`] only stops growth.
    pub fn set_max_bytes(&mut self, max_bytes: usize) {
        self.max_bytes = max_bytes;
    }

    /// Forgets everything (the stream's publisher restarted or sent a snapshot).
    pub fn clear(&mut self) {
        self.keys.clear();
        self.pending.clear();
        self.holders.clear();
    }

    /// Whether one more item fits a table holding `len` items that grows by `grow` bytes to
    /// take it, in entries and in bytes.
    fn fits(&self, len: usize, grow: usize) -> bool {
        len < self.max_entries && self.memory_bytes().saturating_add(grow) <= self.max_bytes
    }

    /// Whether one more entry fits, and its key's holder count (a new key's, at worst).
    fn has_room(&self) -> bool {
        let (len, cap) = (self.keys.len(), self.keys.capacity());
        let grow = self.table.growth::<Entry>(len, cap);
        self.fits(len, grow.saturating_add(self.holders.growth()))
    }

    /// Whether one more pending store fits.
    fn has_pending_room(&self) -> bool {
        let (len, cap) = (self.pending.len(), self.pending.capacity());
        self.fits(len, self.pending_table.growth::<PendingEntry>(len, cap))
    }

    /// Remembers `h` (new) as `known`, a holder of its key on its media; `false` if the
    /// table is full.
    fn remember(&mut self, h: u64, known: Known) -> bool {
        if !self.has_room() {
            return false;
        }
        self.keys.insert(h, known);
        self.table.inserted(self.keys.capacity());
        self.holders.add(known.key, known.media);
        true
    }

    /// The run of at most `blocks` blocks ending at engine hash `h`, first block first: each
    /// one's engine hash, key and parent. Shorter where a parent is not in the table; empty
    /// if `h` is not.
    pub(crate) fn run_ending_at(&self, h: u64, blocks: usize) -> Vec<(u64, u64, Option<u64>)> {
        let mut run = Vec::new();
        let mut at = Some(h);
        while let Some(x) = at {
            if run.len() >= blocks {
                break;
            }
            let Some(k) = self.keys.get(&x) else {
                break;
            };
            run.push((x, k.key, k.parent()));
            at = k.parent();
        }
        run.reverse();
        run
    }

    /// Whether the table keys engine hash `h`.
    pub(crate) fn knows(&self, h: u64) -> bool {
        self.keys.contains_key(&h)
    }

    /// Records a token-less store of `run` (from [`Self::run_ending_at`] on the table that
    /// keyed it: this one, or an instance's for a shared store's stream) in `medium`; the
    /// keys now held there, first block first. A removal of the run's last hash removes the
    /// whole run.
    pub(crate) fn store_run(
        &mut self,
        medium: Medium,
        run: &[(u64, u64, Option<u64>)],
    ) -> Vec<u64> {
        let m = bit(medium);
        let last = run.len().saturating_sub(1);
        // the run's length, capped as it is stored: a removal walks no further
        let len = u16::try_from(run.len()).unwrap_or(u16::MAX);
        let mut keys = Vec::with_capacity(run.len());
        for (i, &(h, key, parent)) in run.iter().enumerate() {
            // the run's last block carries it: its chunk flag and length
            let (chunk, run_len) = if i == last { (m << 4, len) } else { (0, 0) };
            if let Some(k) = self.keys.get_mut(&h) {
                if k.media & m == 0 {
                    self.holders.add(k.key, m);
                }
                k.media |= m;
                if i == last {
                    k.flags |= chunk;
                    k.run = run_len;
                }
            } else {
                let known = Known {
                    key,
                    parent: parent.unwrap_or(0),
                    media: m,
                    flags: if parent.is_some() { HAS_PARENT } else { 0 } | chunk,
                    run: run_len,
                };
                if !self.remember(h, known) {
                    self.unkeyed += 1;
                }
            }
            keys.push(key);
        }
        keys
    }

    /// Waits for a table to key `h` (a token-less store of `blocks` blocks heard first);
    /// counted unkeyed if there is no room.
    pub(crate) fn wait_for(&mut self, h: u64, blocks: usize) {
        let blocks = u16::try_from(blocks).unwrap_or(u16::MAX);
        if let Some(b) = self.pending.get_mut(&h) {
            *b = blocks;
        } else if self.has_pending_room() {
            self.pending.insert(h, blocks);
            self.pending_table.inserted(self.pending.capacity());
        } else {
            self.unkeyed += 1;
        }
    }

    /// The pending store of `h`, taken: its blocks.
    pub(crate) fn take_pending(&mut self, h: u64) -> Option<usize> {
        self.pending.remove(&h).map(usize::from)
    }

    /// Removes `medium` from engine hash `h` (and from the run a token-less store ended
    /// there); the keys it leaves.
    fn remove(&mut self, medium: Medium, h: u64, keys: &mut Vec<u64>) {
        let m = bit(medium);
        let Some(k) = self.keys.get_mut(&h) else {
            return;
        };
        let mut rest = if k.flags & (m << 4) != 0 {
            k.flags &= !(m << 4);
            usize::from(k.run).saturating_sub(1)
        } else {
            0
        };
        let mut at = Some(h);
        while let Some(x) = at {
            let Some(k) = self.keys.get_mut(&x) else {
                break;
            };
            // the key leaves the index with its last holder on this medium (another tenant's
            // block of equal tokens may still hold it)
            if k.media & m != 0 && self.holders.release(k.key, m) {
                keys.push(k.key);
            }
            k.media &= !m;
            at = k.parent();
            if k.media == 0 {
                self.keys.remove(&x);
            }
            if rest == 0 {
                break;
            }
            rest -= 1;
        }
    }

    /// Decodes a `KVEventBatch` and translates its events to keys. A batch with an event
    /// that does not decode is refused whole, before the table changes (checked first, then
    /// applied): a refused batch that had forgotten a block's key would have left the
    /// block's page in the index for good, its later removal untranslatable.
    pub fn translate(&mut self, payload: &[u8]) -> Result<Translated, DecodeError> {
        self.translate_events(&batch_events(payload)?)
    }

    /// [`Self::translate`] of events decoded already ([`crate::index::DecodedBatch`]).
    pub(crate) fn translate_events(&mut self, events: &[Value]) -> Result<Translated, DecodeError> {
        let checked = events.iter().map(check).collect::<Result<Vec<_>, _>>()?;
        let mut out = Translated {
            events: Vec::with_capacity(checked.len()),
            ..Translated::default()
        };
        for e in checked {
            match e {
                Checked::Skip => {}
                Checked::Cleared if self.of == TableOf::Store => {
                    self.clear();
                    out.events.push(IndexEvent::Cleared);
                }
                Checked::Cleared => {
                    self.holders.forget(bit(Medium::Gpu) | bit(Medium::Cpu));
                    self.keys.retain(|_, k| {
                        k.media &= bit(Medium::Storage);
                        k.flags &= !(bit(Medium::Gpu) << 4 | bit(Medium::Cpu) << 4);
                        k.media != 0
                    });
                    out.events.push(IndexEvent::Cleared);
                }
                Checked::Tokenless {
                    medium,
                    hashes,
                    block_size,
                    local,
                } => {
                    // named by hash alone: the caller keys it through a table that saw its
                    // tokens
                    out.tokenless
                        .extend(hashes.into_iter().map(|hash| Tokenless {
                            medium,
                            hash,
                            block_size,
                            local,
                        }));
                }
                Checked::Stored(st) => self.stored(st, &mut out),
                Checked::Removed {
                    medium,
                    hashes,
                    local,
                } => {
                    let mut keys = Vec::new();
                    for h in hashes {
                        if self.pending.remove(&h).is_none() {
                            self.remove(medium, h, &mut keys);
                        }
                    }
                    out.events.push(self.placed(false, medium, local, keys));
                }
            }
        }
        Ok(out)
    }

    /// A checked `BlockStored` with tokens: its blocks keyed after their parent's key.
    fn stored(&mut self, st: StoredBlocks<'_>, out: &mut Translated) {
        let StoredBlocks {
            medium,
            local,
            hashes: hs,
            tokens: toks,
            extra,
            block_size: bs,
            lora,
            lora_id,
            parent,
        } = st;
        let first = match (lora, lora_id) {
            (None, Some(id)) => mix(mix(root(None), 2), id),
            _ => root(lora),
        };
        let (mut parent, mut parent_hash) = match parent {
            None => (Some(first), None),
            Some((p, sent)) => {
                let known = self.keys.get(&p).or_else(|| self.keys.get(&sent));
                (known.map(|k| k.key), Some(p))
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
            let k = match extra.get(i) {
                Some(&x) if x != 0 => mix(page_key(p, page), x),
                _ => page_key(p, page),
            };
            if let Some(e) = self.keys.get_mut(h) {
                if e.key != k {
                    // the hash names other tokens now (a parent keyed anew): its copies
                    // under the old key are forgotten, and the old key leaves the index
                    // with its last holder
                    for b in [Medium::Gpu, Medium::Cpu, Medium::Storage] {
                        if e.media & bit(b) != 0 && self.holders.release(e.key, bit(b)) {
                            out.events.push(IndexEvent::Removed {
                                medium: b,
                                hashes: vec![e.key],
                            });
                            // a storage copy may have been the instance's own
                            if b == Medium::Storage && self.of == TableOf::Instance {
                                out.events.push(IndexEvent::LocalRemoved {
                                    hashes: vec![e.key],
                                });
                            }
                        }
                    }
                    e.media = 0;
                    e.key = k;
                }
                if e.media & bit(medium) == 0 {
                    self.holders.add(k, bit(medium));
                }
                e.media |= bit(medium);
                if let Some(ph) = parent_hash {
                    e.parent = ph;
                    e.flags |= HAS_PARENT;
                }
            } else {
                let known = Known {
                    key: k,
                    parent: parent_hash.unwrap_or(0),
                    media: bit(medium),
                    flags: if parent_hash.is_some() { HAS_PARENT } else { 0 },
                    run: 0,
                };
                if self.remember(*h, known) {
                    out.fresh.push(*h);
                } else {
                    self.unkeyed += 1;
                }
            }
            keys.push(k);
            parent = Some(k);
            parent_hash = Some(*h);
        }
        out.events.push(self.placed(true, medium, local, keys));
    }
}

/// A `BlockStored` with tokens, checked.
struct StoredBlocks<'a> {
    medium: Medium,
    /// On a storage tier local to its publisher ([`Translator::placed`]).
    local: bool,
    hashes: Vec<u64>,
    tokens: Vec<u32>,
    block_size: usize,
    lora: Option<&'a str>,
    /// The adapter's number (`lora_id`): vLLM before `lora_name` (up to 0.10) named an
    /// adapter by it alone. Such a block (no `lora_name`) is keyed apart from the base
    /// model's and from every named adapter's: its request's name cannot be told.
    lora_id: Option<u64>,
    /// Per block, what its extra hash keys name beyond its tokens ([`foreign_keys`]; 0:
    /// nothing, or no entry).
    extra: Vec<u64>,
    /// The parent block's hash in the event's KV cache group ([`in_group`]) and as sent
    /// (`None`: the first block of a prompt). Its key is its tokens', in any group: a
    /// parent this group evicted already (a sliding window's) is keyed through group 0's.
    parent: Option<(u64, u64)>,
}

/// One event of a batch, decoded and checked; nothing of a table touched yet.
enum Checked<'a> {
    /// An event type or medium the router does not index.
    Skip,
    Cleared,
    Stored(StoredBlocks<'a>),
    /// Blocks stored without tokens (vLLM's offloading placeholders).
    Tokenless {
        medium: Medium,
        hashes: Vec<u64>,
        block_size: usize,
        local: bool,
    },
    Removed {
        medium: Medium,
        hashes: Vec<u64>,
        local: bool,
    },
}

/// What one block's extra hash keys (vLLM 0.34's `extra_keys` entry) name that a
/// request's tokens do not: a hash of its multimodal items (`(mm_identifier, offset)`) and
/// prompt-embeds digests, 0 if none (no entry, or only the LoRA name and cache salt, which
/// vLLM publishes as bare strings, or tagged `("lora", …)`, `("cache_salt", …)`). Such a
/// block is keyed with it, and so its children: two images behind equal placeholder tokens
/// are different blocks to the engine, and no prompt's tokens alone are a hit on them.
fn foreign_keys(entry: &Value) -> u64 {
    let Value::Array(keys) = entry else {
        return 0;
    };
    let mut h = 0;
    for k in keys {
        let named = match k {
            Value::String(_) => true,
            Value::Array(t) => matches!(
                t.first().and_then(Value::as_str),
                Some("lora" | "cache_salt")
            ),
            _ => false,
        };
        if !named {
            let mut bytes = Vec::new();
            // writing to a Vec cannot fail
            let _ = rmpv::encode::write_value(&mut bytes, k);
            h = bytes
                .iter()
                .fold(mix(h, 0x6D6D), |h, &b| mix(h, u64::from(b)));
        }
    }
    h
}

/// The table's name for engine hash `h` of KV cache group `group`: `h` itself in group 0
/// (and for an event naming no group), another number in each other group. A hybrid model's
/// engine (vLLM 0.34's `group_idx`: full attention beside sliding-window or Mamba layers)
/// stores a block once per group under one block hash and evicts each copy on its own, so
/// each group's copy is a holder of the block's key of its own: the key leaves the index
/// with the last group's copy, and a group's parents are its own.
fn in_group(h: u64, group: u64) -> u64 {
    if group == 0 {
        h
    } else {
        mix(mix(h, 0x6B76_7469_6572_6770), group)
    }
}

/// The event's KV cache group (`group_idx`; absent or nil: 0).
fn group_of(e: &WireMap<'_>) -> Result<u64, DecodeError> {
    match e.field("group_idx") {
        None | Some(Value::Nil) => Ok(0),
        Some(g) => g
            .as_u64()
            .ok_or(DecodeError::Shape("group_idx is not an integer from 0")),
    }
}

fn check(e: &Value) -> Result<Checked<'_>, DecodeError> {
    let e = WireMap::of(e)?;
    let Some(medium) = e.medium() else {
        return Ok(Checked::Skip);
    };
    let group = group_of(&e)?;
    let local = e.local_storage();
    let hashes = || -> Result<Vec<u64>, DecodeError> {
        Ok(e.hashes()?
            .into_iter()
            .map(|h| in_group(h, group))
            .collect())
    };
    Ok(match e.kind() {
        Some("AllBlocksCleared") => Checked::Cleared,
        Some("BlockStored") => {
            let hashes = hashes()?;
            let Some(Value::Array(toks)) = e.field("token_ids") else {
                return Err(DecodeError::Shape("token_ids is not an array"));
            };
            let block_size = e
                .field("block_size")
                .and_then(Value::as_u64)
                .and_then(|b| usize::try_from(b).ok())
                .ok_or(DecodeError::Shape("block_size is not an integer"))?;
            if toks.is_empty() {
                return Ok(Checked::Tokenless {
                    medium,
                    hashes,
                    block_size,
                    local,
                });
            }
            if block_size == 0 {
                return Err(DecodeError::Shape("block_size is 0 with tokens"));
            }
            let tokens: Vec<u32> = toks
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<_>>()
                .ok_or(DecodeError::Shape("a token id is not a u32"))?;
            let parent = match e.field("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(p) => Some(crate::index::hash64(p)?),
            };
            let extra = match e.field("extra_keys") {
                None | Some(Value::Nil) => Vec::new(),
                Some(Value::Array(per_block)) => per_block.iter().map(foreign_keys).collect(),
                Some(_) => return Err(DecodeError::Shape("extra_keys is not an array")),
            };
            Checked::Stored(StoredBlocks {
                medium,
                local,
                hashes,
                tokens,
                extra,
                block_size,
                lora: e.field("lora_name").and_then(Value::as_str),
                lora_id: e.field("lora_id").and_then(Value::as_u64),
                parent: parent.map(|p| (in_group(p, group), p)),
            })
        }
        Some("BlockRemoved") => Checked::Removed {
            medium,
            hashes: hashes()?,
            local,
        },
        _ => Checked::Skip,
    })
}
