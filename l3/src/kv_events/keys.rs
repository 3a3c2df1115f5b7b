//! Which store keys the stream publishes, and as which block hash.
//!
//! Why two grammars: the store holds the pages of two kinds of writer, and a router knows
//! each page by the hash its engine publishes for it on GPU and CPU, so the store must
//! publish that same hash for `STORAGE`:
//! - kvtier's scheduler and the SGLang integration write `{namespace}:{64 hex}:{rank}`
//!   ([`kvtier_radix::parse_l3_key`]): the page hash is the 32-byte digest, the hash kvtier's
//!   engines publish and the router computes from tokens (`--keys engine`).
//! - kvtier's vLLM integration writes `{namespace}:{72 hex}[:{shard}]`
//!   (`kvtier.vllm.keys.l3_key`): the hex is vLLM's `OffloadKey`, the 32-byte block hash of
//!   the chunk's last block followed by the KV group's index (4 bytes, big-endian). The page
//!   hash is that block hash: what vLLM's offloading connector publishes for the same chunk on
//!   CPU (`get_offload_block_hash`, then `maybe_convert_block_hash`: the low 64 bits under
//!   vLLM's default integer hashes, which is the wire's [`super::BlockHashes::Int64`]). With
//!   vLLM's default `sha256` hashing every vLLM process computes the same block hashes for
//!   the same tokens (its `NONE_HASH` seed is fixed for cryptographic hashes), so one
//!   published hash names the chunk for every engine that shares the store.
//!
//! A page is one block on the wire however many objects hold it: the holders of a page are
//! told apart by [`StreamKey::part`] (kvtier's rank; vLLM's group and shard), and the page is
//! resident while any holder is.

use std::hash::{Hash, Hasher};

use kvtier_radix::{PageHash, parse_l3_key};

/// A key the stream publishes: its namespace, the block hash it is published as, and which
/// part of the page the object holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamKey<'a> {
    pub namespace: &'a str,
    pub page: PageHash,
    pub part: u64,
}

/// Bytes of vLLM's block hash (`sha256`, `sha256_cbor`) and of its group index.
const VLLM_HASH_BYTES: usize = 32;
const VLLM_GROUP_BYTES: usize = 4;

/// The key's namespace, block hash and part, if it is of either grammar; `None` for any
/// other key (stored as always, not published).
pub(crate) fn stream_key(key: &str) -> Option<StreamKey<'_>> {
    if let Some(k) = parse_l3_key(key) {
        return Some(StreamKey {
            namespace: k.namespace,
            page: k.page,
            part: part(&(0u8, k.rank)),
        });
    }
    vllm_key(key)
}

/// `{namespace}:{72 hex}` or `{namespace}:{72 hex}:{shard}`.
fn vllm_key(key: &str) -> Option<StreamKey<'_>> {
    let mut parts = key.split(':');
    let (namespace, digest) = (parts.next()?, parts.next()?);
    let shard: Option<u32> = match parts.next() {
        None => None,
        Some(s) => Some(s.parse().ok()?),
    };
    if parts.next().is_some() || digest.len() != 2 * (VLLM_HASH_BYTES + VLLM_GROUP_BYTES) {
        return None;
    }
    let mut raw = [0u8; VLLM_HASH_BYTES + VLLM_GROUP_BYTES];
    hex::decode_to_slice(digest, &mut raw).ok()?;
    let mut page = [0u8; VLLM_HASH_BYTES];
    page.copy_from_slice(&raw[..VLLM_HASH_BYTES]);
    let mut group = [0u8; VLLM_GROUP_BYTES];
    group.copy_from_slice(&raw[VLLM_HASH_BYTES..]);
    Some(StreamKey {
        namespace,
        page: PageHash(page),
        part: part(&(1u8, u32::from_be_bytes(group), shard)),
    })
}

fn part(x: &impl Hash) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    x.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_grammars_and_nothing_else() {
        let page = "ab".repeat(32);
        let k = format!("5f2c0e1a9b3d4c7e:{page}:1");
        let s = stream_key(&k).expect("kvtier's grammar");
        assert_eq!(
            (s.namespace, s.page.to_hex()),
            ("5f2c0e1a9b3d4c7e", page.clone())
        );
        let v = format!("ns:{page}00000002");
        let sv = stream_key(&v).expect("vLLM's grammar");
        assert_eq!(sv.page.to_hex(), page);
        let (vs, vg) = (format!("{v}:1"), format!("ns:{page}00000003"));
        let shard = stream_key(&vs).expect("vLLM's grammar, a shard");
        assert_eq!(shard.page, sv.page);
        let group = stream_key(&vg).expect("another group");
        assert!(sv.part != shard.part && sv.part != group.part && shard.part != group.part);
        for bad in [
            format!("ns:{page}0000000"),    // 71 hex digits
            format!("ns:{page}000000zz"),   // not hex
            format!("ns:{page}00000002:x"), // a shard that is not a number
            format!("ns:{page}00000002:1:2"),
            format!("ns:{page}"), // kvtier's digest without its rank
            "not-a-page-key".to_string(),
        ] {
            assert_eq!(stream_key(&bad), None, "{bad}");
        }
    }
}
