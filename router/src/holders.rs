//! How many of one stream's engine hashes hold each router key, per medium.
//!
//! Why: under `--keys tokens` the router keys a block by its tokens, and an engine's hash
//! covers more than the tokens (vLLM's `cache_salt`, SGLang's extra keys): two tenants' blocks
//! with equal tokens are two engine hashes, one router key. The index holds the key once per
//! (instance, medium), so the key may leave the index only when the last engine hash holding
//! it on that medium leaves; before this count the first tenant's eviction removed it while
//! another tenant's copy was still there (`router/tests/tokenless.rs`).
//!
//! How: a map key → one count per medium, kept by the [`crate::keys::Translator`] beside its
//! engine-hash table, in its byte budget. Invariant: `count(key, m)` is the number of the
//! table's entries whose key is `key` and whose media hold `m` (the property test in
//! `router/tests/tokenless.rs` checks what follows from it: a key is in the index exactly
//! while some tenant's copy is).

use std::collections::HashMap;

use crate::table::Table;

/// One entry: key, then a count per medium bit (GPU, CPU, STORAGE): 16 bytes. A count
/// that reaches `u16::MAX` stays there (the key then stays until a clear: a routing hint too
/// many, never a missing one).
type HolderEntry = (u64, [u16; 3]);

/// The slot of a medium bit (`1`, `2`, `4`: see `keys::bit`).
fn slot(bit: u8) -> usize {
    match bit {
        1 => 0,
        2 => 1,
        _ => 2,
    }
}

#[derive(Debug, Default)]
pub(crate) struct Holders {
    counts: HashMap<u64, [u16; 3]>,
    table: Table,
}

impl Holders {
    /// Bytes the map holds, as the allocator counts them.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.table.bytes::<HolderEntry>()
    }

    /// Bytes the next insert of a new key may add.
    pub(crate) fn growth(&self) -> usize {
        self.table
            .growth::<HolderEntry>(self.counts.len(), self.counts.capacity())
    }

    /// One more holder of `key` on each medium of `bits`.
    pub(crate) fn add(&mut self, key: u64, bits: u8) {
        if bits == 0 {
            return;
        }
        let is_new = !self.counts.contains_key(&key);
        let c = self.counts.entry(key).or_default();
        for b in [1u8, 2, 4] {
            if bits & b != 0 {
                c[slot(b)] = c[slot(b)].saturating_add(1);
            }
        }
        if is_new {
            self.table.inserted(self.counts.capacity());
        }
    }

    /// One holder fewer of `key` on medium `bit`; `true` when none is left there (the key
    /// leaves the index on that medium). A key no entry counted (its table was full when it
    /// came) has no holder left.
    pub(crate) fn release(&mut self, key: u64, bit: u8) -> bool {
        let Some(c) = self.counts.get_mut(&key) else {
            return true;
        };
        let n = &mut c[slot(bit)];
        if *n != u16::MAX {
            *n = n.saturating_sub(1);
        }
        let last = *n == 0;
        if c.iter().all(|&n| n == 0) {
            self.counts.remove(&key);
        }
        last
    }

    /// Forgets the media of `bits` on every key (an instance's `AllBlocksCleared`).
    pub(crate) fn forget(&mut self, bits: u8) {
        self.counts.retain(|_, c| {
            for b in [1u8, 2, 4] {
                if bits & b != 0 {
                    c[slot(b)] = 0;
                }
            }
            c.iter().any(|&n| n > 0)
        });
    }

    pub(crate) fn clear(&mut self) {
        self.counts.clear();
    }
}
