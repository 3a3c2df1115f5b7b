//! Page hashes and L3 keys.
//!
//! Why: a KV page is only reusable by a request whose *whole prefix* up to and including that
//! page is identical, so a page's identity must cover its prefix. We chain SHA-256 over pages,
//! byte-compatible with SGLang HiCache's page keys, so an L3 shared with SGLang instances sees
//! the same digests:
//!
//! ```text
//! h_0 = SHA-256(            tok_0[0] as u32 LE ‖ … ‖ tok_0[P-1] as u32 LE)
//! h_i = SHA-256(h_{i-1} (32 raw bytes) ‖ tok_i[0] as u32 LE ‖ … ‖ tok_i[P-1] as u32 LE)
//! ```
//!
//! (SGLang's `get_hash_str(token_ids, prior_hash)` feeds `bytes.fromhex(prior_hash)` and then
//! each token as 4 little-endian bytes; its page key is the lowercase hex digest.)
//!
//! The digest alone does not separate tenants, models or tensor-parallel layouts, so an L3 key
//! wraps it: `"{namespace}:{hex digest}:{rank}"`, where `namespace` is 16 hex digits of a
//! SHA-256 over the namespace fields and the page size (the chain does not separate page
//! sizes). Two namespaces that differ in any field or page size produce different keys for
//! the same tokens; see `docs/page-keys.md`.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The SHA-256 digest identifying one page *and its whole prefix*.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PageHash(pub [u8; 32]);

impl PageHash {
    /// Lowercase hex, exactly SGLang's page key string.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// First eight bytes as an integer: uniformly distributed, used as a hash-map key.
    #[inline]
    pub fn prefix_u64(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(b)
    }
}

/// Hashes all 32 bytes, as four words. A digest kvtier computed is uniform, and the cache's
/// own maps fold the words cheaply ([`crate::cache::PrefixHasher`]); but page hashes also
/// come from outside (an L3 key string a client chose, an engine's event), and hashed as
/// their first eight bytes alone, keys sharing those bytes all fell in one bucket chain (an
/// adversarial tester's 60,000 such keys took 7.3 s to put into the L3's event maps, against
/// 0.34 s). Equality compares all 32 bytes.
impl std::hash::Hash for PageHash {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        for w in self.0.chunks_exact(8) {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            state.write_u64(u64::from_le_bytes(b));
        }
    }
}

impl fmt::Debug for PageHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageHash({})", &self.to_hex()[..12])
    }
}

impl fmt::Display for PageHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Hash of one page given the previous page's digest (`None` for the first page).
pub fn hash_page(prev: Option<&PageHash>, tokens: &[u32]) -> PageHash {
    let mut buf = Vec::new();
    hash_page_with(prev, tokens, &mut buf)
}

fn hash_page_with(prev: Option<&PageHash>, tokens: &[u32], buf: &mut Vec<u8>) -> PageHash {
    let mut h = Sha256::new();
    if let Some(p) = prev {
        h.update(p.0);
    }
    if cfg!(target_endian = "little") {
        // The in-memory bytes of a `u32` slice already are the little-endian encoding: hash
        // them in place instead of copying (this copy was ~20% of hashing time).
        h.update(bytemuck::cast_slice::<u32, u8>(tokens));
    } else {
        buf.clear();
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..]);
    }
    PageHash(h.finalize().into())
}

/// Chained hashes of every *full* page of `tokens` (a trailing partial page is ignored),
/// continuing from `prev` (the digest of the page just before `tokens[0]`, if any).
///
/// `page_size == 0` yields no pages.
pub fn page_hashes(tokens: &[u32], page_size: usize, prev: Option<&PageHash>) -> Vec<PageHash> {
    if page_size == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(tokens.len() / page_size);
    extend_page_hashes(&mut out, tokens, page_size, prev.copied());
    out
}

/// Appends the chained hashes of the full pages of `tokens` to `out`, continuing from `prev`.
pub fn extend_page_hashes(
    out: &mut Vec<PageHash>,
    tokens: &[u32],
    page_size: usize,
    prev: Option<PageHash>,
) {
    if page_size == 0 {
        return;
    }
    let mut buf = Vec::new();
    let mut prev = prev;
    for page in tokens.chunks_exact(page_size) {
        let h = hash_page_with(prev.as_ref(), page, &mut buf);
        out.push(h);
        prev = Some(h);
    }
}

/// Extends `hashes` (the chained hashes of the first `from` full pages of `tokens`) to cover
/// the first `to` full pages. Pages past the end of `tokens` are not hashed.
pub fn extend_hashes(
    hashes: &mut Vec<PageHash>,
    tokens: &[u32],
    page_size: usize,
    from: usize,
    to: usize,
) {
    if page_size == 0 || from >= to {
        return;
    }
    let end = (to * page_size).min(tokens.len());
    let start = from * page_size;
    if start >= end {
        return;
    }
    let prev = from.checked_sub(1).and_then(|i| hashes.get(i)).copied();
    hashes.truncate(from);
    extend_page_hashes(hashes, &tokens[start..end], page_size, prev);
}

/// A span of prompt tokens whose KV depends on more than the token ids: the placeholder tokens
/// an image, audio clip or video expands to. `digest` identifies the content (e.g. a hash of
/// the image's bytes); it enters the hash of every page the span `start .. end` overlaps.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ExtraKey {
    pub start: u32,
    pub end: u32,
    pub digest: Vec<u8>,
}

/// Everything besides the tokens that makes a request's KV its own: a per-request cache salt
/// (tenant isolation, as vLLM's `cache_salt`), an adapter (LoRA) id, and extra keys of
/// multimodal spans.
///
/// Why in the page hash and not beside it: every tier — the device and host radix tree and the
/// L3 keys — is keyed by the chained page hash, so a scope that enters the chain separates
/// requests everywhere at once, and nothing downstream can forget to compare it. The rule:
///
/// ```text
/// seed   = SHA-256("kvtier-scope-v2" ‖ field(salt) ‖ field(adapter) ‖ pad)   (only if either is set)
/// pad    = 1 to 4 zero bytes, making the seed's input 1 mod 4 bytes long (no page's input is)
/// h_0    = SHA-256(seed? ‖ tok_0 … ‖ extra(0)?)
/// h_i    = SHA-256(h_{i-1} ‖ tok_i … ‖ extra(i)?)
/// extra(i) = "kvtier-extra-v2" ‖ (start u32 ‖ end u32 ‖ len u64 ‖ digest) for each extra key
///            overlapping page i's tokens, in (start, end, digest) order ‖ pad2
/// pad2   = 1 to 4 zero bytes, making the page's input 2 mod 4 bytes long
/// field(None) = 0u8, field(Some(s)) = 1u8 ‖ len u64 ‖ s
/// ```
///
/// Input lengths keep the three kinds of input apart: a page without extra keys is 0 mod 4
/// bytes (a 32-byte parent or seed, 4-byte tokens), a seed's input 1 mod 4, a page with extra
/// keys 2 mod 4. (In v1, unpadded, a first page with one 1-byte digest was as long as a later
/// plain page, `h_{i-1} ‖ tokens`, and 8 crafted tokens made it hash as one.)
///
/// With no salt, no adapter and no extra keys this is exactly the plain chain
/// ([`page_hashes`]), byte-compatible with SGLang's keys. Because the chain covers the whole
/// prefix, two requests share page `i` only if their tokens, salt, adapter and the extra keys
/// of pages `0..=i` are all equal.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HashScope {
    seed: Option<PageHash>,
    /// Sorted by `(start, end, digest)`.
    extra: Vec<ExtraKey>,
}

/// The seed's domain tag; v2 pads the seed's input (see [`HashScope::new`]).
const SCOPE_TAG: &[u8] = b"kvtier-scope-v2";

/// The tag before a page's extra keys; v2 pads the page's input to 2 mod 4 bytes.
const EXTRA_TAG: &[u8] = b"kvtier-extra-v2";

/// Hashes one optional field; returns the bytes it added.
fn scope_field(h: &mut Sha256, v: Option<&str>) -> usize {
    match v {
        None => {
            h.update([0u8]);
            1
        }
        Some(s) => {
            h.update([1u8]);
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
            9 + s.len()
        }
    }
}

impl HashScope {
    /// A scope from a salt, an adapter id and extra keys (any order; spans are not validated
    /// here — the scheduler checks them against the prompt).
    pub fn new(salt: Option<&str>, adapter: Option<&str>, mut extra: Vec<ExtraKey>) -> HashScope {
        let seed = (salt.is_some() || adapter.is_some()).then(|| {
            let mut h = Sha256::new();
            h.update(SCOPE_TAG);
            let mut len = SCOPE_TAG.len();
            len += scope_field(&mut h, salt);
            len += scope_field(&mut h, adapter);
            // Padded to 1 mod 4 bytes: a plain page's input (a 32-byte parent hash, then
            // tokens of 4 bytes) is 0 mod 4, so no plain page hashes to the seed (with v1, a
            // 7-byte salt made a 32-byte input that one page of 8 crafted tokens equalled:
            // that unsalted prompt then walked the salted chain one page behind).
            h.update(&[0u8; 4][..4 - (len + 3) % 4]);
            PageHash(h.finalize().into())
        });
        extra.sort();
        extra.dedup();
        HashScope { seed, extra }
    }

    /// No salt, adapter or extra key: the plain (SGLang-compatible) chain.
    pub fn is_plain(&self) -> bool {
        self.seed.is_none() && self.extra.is_empty()
    }

    /// The extra keys, sorted.
    pub fn extra_keys(&self) -> &[ExtraKey] {
        &self.extra
    }

    /// Extends `hashes` (the scoped hashes of the first `from` full pages of `tokens`) to the
    /// first `to` full pages, like [`extend_hashes`].
    pub fn extend_hashes(
        &self,
        hashes: &mut Vec<PageHash>,
        tokens: &[u32],
        page_size: usize,
        from: usize,
        to: usize,
    ) {
        if self.is_plain() {
            return extend_hashes(hashes, tokens, page_size, from, to);
        }
        if page_size == 0 || from >= to {
            return;
        }
        let to = to.min(tokens.len() / page_size);
        hashes.truncate(from);
        let mut prev = match from.checked_sub(1) {
            Some(i) => match hashes.get(i) {
                Some(h) => Some(*h),
                None => return,
            },
            None => self.seed,
        };
        for i in from..to {
            let (lo, hi) = (i * page_size, (i + 1) * page_size);
            let mut h = Sha256::new();
            if let Some(p) = &prev {
                h.update(p.0);
            }
            for t in &tokens[lo..hi] {
                h.update(t.to_le_bytes());
            }
            let mut extra_len: Option<usize> = None;
            for k in self
                .extra
                .iter()
                .filter(|k| (k.start as usize) < hi && (k.end as usize) > lo)
            {
                let len = extra_len.get_or_insert_with(|| {
                    h.update(EXTRA_TAG);
                    EXTRA_TAG.len()
                });
                h.update(k.start.to_le_bytes());
                h.update(k.end.to_le_bytes());
                h.update((k.digest.len() as u64).to_le_bytes());
                h.update(&k.digest);
                *len += 16 + k.digest.len();
            }
            if let Some(len) = extra_len {
                // The rest of the input is 0 mod 4 bytes: the whole is 2 mod 4.
                h.update(&[0u8; 4][..4 - (len + 2) % 4]);
            }
            let d = PageHash(h.finalize().into());
            hashes.push(d);
            prev = Some(d);
        }
    }

    /// The scoped hashes of every full page of `tokens`.
    pub fn page_hashes(&self, tokens: &[u32], page_size: usize) -> Vec<PageHash> {
        let mut out = Vec::new();
        if page_size > 0 {
            self.extend_hashes(&mut out, tokens, page_size, 0, tokens.len() / page_size);
        }
        out
    }
}

/// What makes two identical token sequences *different* KV: the model, the KV dtype, the
/// tensor-parallel layout, the tenant (or a per-tenant salt) and the adapter (LoRA).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KeyNamespace {
    pub model: String,
    pub dtype: String,
    /// e.g. `"tp8"` or `"tp4-pp2"`: how KV heads are sharded across ranks.
    pub layout: String,
    pub tenant: String,
    pub adapter: String,
}

impl KeyNamespace {
    /// 16 lowercase hex digits identifying the namespace's fields alone (`kvtier-ns-v1`):
    /// what `kvtier.namespace.l3_namespace` computes without a page size, for integrations
    /// whose `layout` names their page geometry. A scheduler's keys use
    /// [`KeyNamespace::keys_for`], which adds the page size.
    ///
    /// Fields are length-prefixed before hashing, so no two distinct field tuples can
    /// produce the same byte string (`("ab","c")` vs `("a","bc")`).
    pub fn fingerprint(&self) -> String {
        self.digest(b"kvtier-ns-v1", None)
    }

    /// [`KeyNamespace::fingerprint`] of the fields and the page size in tokens
    /// (`kvtier-ns-v2`, the page size a sixth field, in decimal): engines of one model with
    /// other page sizes never share a key, although a first page of `P + 8` tokens can
    /// have the digest of a later page of `P` tokens (docs/page-keys.md).
    pub fn fingerprint_paged(&self, page_size: usize) -> String {
        self.digest(b"kvtier-ns-v2", Some(page_size))
    }

    fn digest(&self, tag: &[u8], page_size: Option<usize>) -> String {
        let mut h = Sha256::new();
        h.update(tag);
        let page = page_size.map(|p| p.to_string());
        for field in [
            &self.model,
            &self.dtype,
            &self.layout,
            &self.tenant,
            &self.adapter,
        ]
        .into_iter()
        .chain(page.as_ref())
        {
            h.update((field.len() as u64).to_le_bytes());
            h.update(field.as_bytes());
        }
        let d: [u8; 32] = h.finalize().into();
        hex::encode(&d[..8])
    }

    /// A key builder for pages of `page_size` tokens on one tensor-parallel rank (caches
    /// the fingerprint, [`KeyNamespace::fingerprint_paged`]).
    pub fn keys_for(&self, page_size: usize, rank: u32) -> L3KeyBuilder {
        L3KeyBuilder {
            prefix: self.fingerprint_paged(page_size),
            rank,
        }
    }
}

/// Formats L3 keys `"{namespace}:{hex digest}:{rank}"` for one namespace and rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L3KeyBuilder {
    prefix: String,
    rank: u32,
}

impl L3KeyBuilder {
    pub fn key(&self, page: &PageHash) -> String {
        let mut s = String::with_capacity(self.prefix.len() + 64 + 12);
        s.push_str(&self.prefix);
        s.push(':');
        s.push_str(&page.to_hex());
        s.push(':');
        s.push_str(&self.rank.to_string());
        s
    }

    pub fn keys<'a>(&self, pages: impl IntoIterator<Item = &'a PageHash>) -> Vec<String> {
        pages.into_iter().map(|p| self.key(p)).collect()
    }

    /// The page hash of `key` if it is a key of this namespace and rank.
    pub fn page_of(&self, key: &str) -> Option<PageHash> {
        let k = parse_l3_key(key)?;
        (k.namespace == self.prefix && k.rank == self.rank).then_some(k.page)
    }
}

/// The parts of an L3 key `"{namespace}:{hex digest}:{rank}"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParsedKey<'a> {
    pub namespace: &'a str,
    pub page: PageHash,
    pub rank: u32,
}

/// Parses an L3 key built by [`L3KeyBuilder`] (the one parser: test engines, the simulator's
/// oracle and the Python executor all use it). `None` for anything else.
pub fn parse_l3_key(key: &str) -> Option<ParsedKey<'_>> {
    let mut parts = key.split(':');
    let (namespace, digest, rank) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || digest.len() != 64 {
        return None;
    }
    let mut page = [0u8; 32];
    hex::decode_to_slice(digest, &mut page).ok()?;
    Some(ParsedKey {
        namespace,
        page: PageHash(page),
        rank: rank.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An adversarial tester's slowdown: the L3's event maps take page hashes from key
    /// strings its clients choose, and a page hash hashed as its first eight bytes put 60,000
    /// keys sharing them in one bucket chain (7.3 s to put them, against 0.34 s). Hashes that
    /// differ anywhere hash apart, under a keyed hasher and under the cache's own.
    #[test]
    fn hashes_differing_past_the_first_eight_bytes_hash_apart() {
        use std::hash::BuildHasher;
        let keyed = std::collections::hash_map::RandomState::new();
        let cache = std::hash::BuildHasherDefault::<crate::cache::PrefixHasher>::default();
        for at in [8usize, 15, 16, 24, 31] {
            let a = PageHash([0; 32]);
            let mut b = a;
            b.0[at] = 1;
            assert_ne!(keyed.hash_one(a), keyed.hash_one(b), "byte {at}");
            assert_ne!(cache.hash_one(a), cache.hash_one(b), "byte {at}");
        }
        // the cache's own hasher keeps a plain u64 key as it is (its maps of u64 keys)
        assert_eq!(cache.hash_one(42u64), 42);
    }

    /// Reference values computed with Python's hashlib, exactly as SGLang's
    /// `get_hash_str` does it:
    /// ```python
    /// h0 = sha256(b"".join(t.to_bytes(4,"little") for t in [1,2,3,4])).hexdigest()
    /// h1 = sha256(bytes.fromhex(h0) + b"".join(t.to_bytes(4,"little") for t in [5,6,7,8])).hexdigest()
    /// ```
    #[test]
    fn matches_sglang_get_hash_str() {
        let hs = page_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, None);
        assert_eq!(hs.len(), 2, "trailing partial page is not hashed");
        assert_eq!(hs[0].to_hex(), SGLANG_H0);
        assert_eq!(hs[1].to_hex(), SGLANG_H1);
    }

    const SGLANG_H0: &str = include_str!("../testdata/sglang_h0.txt");
    const SGLANG_H1: &str = include_str!("../testdata/sglang_h1.txt");

    #[test]
    fn chain_continues_from_prev() {
        let all = page_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, None);
        let tail = page_hashes(&[5, 6, 7, 8], 4, Some(&all[0]));
        assert_eq!(tail[0], all[1]);
        assert_ne!(page_hashes(&[5, 6, 7, 8], 4, None)[0], all[1]);
    }

    #[test]
    fn namespaces_separate_keys() {
        let h = hash_page(None, &[1, 2, 3]);
        let a = KeyNamespace {
            model: "m".into(),
            tenant: "a".into(),
            ..Default::default()
        };
        let b = KeyNamespace {
            model: "m".into(),
            tenant: "b".into(),
            ..Default::default()
        };
        let shifted = KeyNamespace {
            model: "ma".into(),
            tenant: "".into(),
            ..Default::default()
        };
        assert_ne!(a.keys_for(16, 0).key(&h), b.keys_for(16, 0).key(&h));
        assert_ne!(a.fingerprint(), shifted.fingerprint());
        assert_ne!(a.keys_for(16, 0).key(&h), a.keys_for(16, 1).key(&h));
        let k = a.keys_for(16, 3).key(&h);
        assert!(k.ends_with(":3"));
        assert!(k.contains(&h.to_hex()));
        let p = parse_l3_key(&k).expect("parses");
        assert_eq!(
            (p.namespace, p.page, p.rank),
            (&a.fingerprint_paged(16)[..], h, 3)
        );
        assert_eq!(a.keys_for(16, 3).page_of(&k), Some(h));
        assert_eq!(a.keys_for(16, 2).page_of(&k), None, "other rank");
        assert_eq!(b.keys_for(16, 3).page_of(&k), None, "other namespace");
        for bad in [
            "",
            "x:y:z",
            &k[..k.len() - 2],
            &format!("{k}:1"),
            &k.replace(":3", ":-1"),
        ] {
            assert_eq!(parse_l3_key(bad), None, "{bad}");
        }
    }
}
