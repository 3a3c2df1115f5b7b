//! A fast, deterministic hasher for the scheduler's maps keyed by ids and page hashes.
//!
//! Why: the request table is looked up several times per row every step (a 256-row decode
//! step and its `ForwardDone` make ~1,500 lookups), and with std's SipHash those lookups were
//! about half of both calls. The keys are engine-assigned `u64` ids (`RequestId`, `OpId`) and
//! SHA-256 prefixes (`PageHash`), all hashed through one `write_u64`; two folded 128-bit
//! multiplies spread every input bit over the whole output, so structured ids (multiples of a
//! power of two, ids in the high bits) still spread over the buckets. The hash has no secret
//! key: ids come from the engine, not from end users, and a fixed hash makes the maps'
//! iteration order the same on every tensor-parallel rank.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;
pub(crate) type IdSet<K> = HashSet<K, BuildHasherDefault<IdHasher>>;

const SEED: u64 = 0x243f_6a88_85a3_08d3;
const SEED2: u64 = 0x1319_8a2e_0370_7344;
const MUL: u64 = 0x9e37_79b9_7f4a_7c15;

#[inline]
fn fold_mul(a: u64, b: u64) -> u64 {
    let m = (a as u128).wrapping_mul(b as u128);
    (m as u64) ^ ((m >> 64) as u64)
}

#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write_u64(&mut self, v: u64) {
        // Two folded multiplies: one leaves ids that differ only in high bits clustered in the
        // low bits (hashbrown's bucket index).
        self.0 = fold_mul(fold_mul(self.0 ^ v ^ SEED, MUL) ^ SEED2, MUL);
    }

    #[inline]
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }

    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            self.write_u64(u64::from_le_bytes(b));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            self.write_u64(u64::from_le_bytes(b) ^ ((rest.len() as u64) << 56));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hash};

    fn h<T: Hash>(v: T) -> u64 {
        BuildHasherDefault::<IdHasher>::default().hash_one(v)
    }

    #[test]
    fn structured_ids_spread_over_low_and_high_bits() {
        // Ids that differ only in high bits, or only by multiples of 2^20, must not collide in
        // the low bits (hashbrown's bucket index) nor in the top 7 (its tag).
        for ids in [
            (0..4096u64).map(|i| i << 32).collect::<Vec<_>>(),
            (0..4096u64).map(|i| i << 20).collect(),
            (0..4096u64).collect(),
        ] {
            // A random function hits ~2,589 of 4,096 buckets.
            let low: HashSet<u64> = ids.iter().map(|&i| h(i) & 0xfff).collect();
            assert!(low.len() > 2450, "low bits: {} distinct of 4096", low.len());
            let top: HashSet<u64> = ids.iter().map(|&i| h(i) >> 57).collect();
            assert_eq!(top.len(), 128);
        }
        assert_ne!(h(1u64), h(2u64));
        assert_eq!(h(42u64), h(42u64));
    }
}
