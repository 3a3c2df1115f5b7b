//! Property tests of per-request hash scopes (cache salt, adapter, multimodal extra keys)
//! against a model of the sharing rule: two requests share page `i` if and only if their
//! tokens of pages `0..=i`, their salts, their adapters, and the extra keys overlapping pages
//! `0..=i` are all equal.

use std::collections::BTreeSet;

use kvtier_radix::*;
use proptest::prelude::*;

const PS: usize = 4;

#[derive(Clone, Debug)]
struct Req {
    tokens: Vec<u32>,
    salt: Option<String>,
    adapter: Option<String>,
    extra: Vec<ExtraKey>,
}

fn req() -> impl Strategy<Value = Req> {
    // Small alphabets, so that equal prefixes, salts and spans are common.
    let tokens = prop::collection::vec(0..2u32, 0..24);
    let name = prop::option::of(prop_oneof![Just("a".to_string()), Just("b".to_string())]);
    let extra = prop::collection::vec((0..24u32, 1..9u32, 0..2u8), 0..3);
    (tokens, name.clone(), name, extra).prop_map(|(tokens, salt, adapter, extra)| Req {
        extra: extra
            .into_iter()
            .map(|(start, len, d)| ExtraKey {
                start,
                end: start + len,
                digest: vec![d],
            })
            .collect(),
        tokens,
        salt,
        adapter,
    })
}

fn scope(r: &Req) -> HashScope {
    HashScope::new(r.salt.as_deref(), r.adapter.as_deref(), r.extra.clone())
}

/// The model: what must be equal for page `i` to be shared.
fn shares(a: &Req, b: &Req, i: usize) -> bool {
    let end = (i + 1) * PS;
    let upto = |r: &Req| -> BTreeSet<ExtraKey> {
        r.extra
            .iter()
            .filter(|k| (k.start as usize) < end && k.end > k.start)
            .cloned()
            .collect()
    };
    a.tokens[..end] == b.tokens[..end]
        && a.salt == b.salt
        && a.adapter == b.adapter
        && upto(a) == upto(b)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn pages_are_shared_exactly_when_the_model_says(a in req(), b in req()) {
        let (ha, hb) = (scope(&a).page_hashes(&a.tokens, PS), scope(&b).page_hashes(&b.tokens, PS));
        prop_assert_eq!(ha.len(), a.tokens.len() / PS);
        for i in 0..ha.len().min(hb.len()) {
            prop_assert_eq!(ha[i] == hb[i], shares(&a, &b, i), "page {}", i);
        }
    }

    #[test]
    fn an_unscoped_request_hashes_like_sglang(tokens in prop::collection::vec(any::<u32>(), 0..40)) {
        let plain = HashScope::new(None, None, Vec::new());
        prop_assert!(plain.is_plain());
        prop_assert_eq!(plain.page_hashes(&tokens, PS), page_hashes(&tokens, PS, None));
    }

    #[test]
    fn extending_page_by_page_equals_hashing_at_once(r in req(), cut in 0..7usize) {
        let s = scope(&r);
        let all = s.page_hashes(&r.tokens, PS);
        let mut inc = Vec::new();
        let cut = cut.min(all.len());
        s.extend_hashes(&mut inc, &r.tokens, PS, 0, cut);
        s.extend_hashes(&mut inc, &r.tokens, PS, cut, all.len() + 3);
        prop_assert_eq!(inc, all);
    }
}

#[test]
fn salt_and_adapter_are_not_interchangeable() {
    let t = [1, 2, 3, 4];
    let salt = HashScope::new(Some("x"), None, Vec::new()).page_hashes(&t, PS);
    let adapter = HashScope::new(None, Some("x"), Vec::new()).page_hashes(&t, PS);
    let plain = page_hashes(&t, PS, None);
    assert_ne!(salt, adapter);
    assert_ne!(salt, plain);
    assert_ne!(adapter, plain);
}

/// Found by an adversarial tester: the seed's input for a salt of 7 bytes is 32 bytes
/// ("kvtier-scope-v1" ‖ 0x01 ‖ LE64(7) ‖ salt ‖ 0x00), one page of 8 tokens; an unsalted
/// prompt whose first page is those bytes had `h_0 == seed`, so its page `i + 1` hashed as
/// the salted prompt's page `i` (another tenant's KV, and the offload manager's chain check
/// raised inside SGLang's scheduler). For every salt and adapter length, and any page size,
/// no plain prompt made of the seed's own input bytes shares a page with the scoped one.
#[test]
fn no_plain_prompt_reaches_a_scoped_chain_through_the_seed_input() {
    for ps in [1usize, 2, 4, 8, 16] {
        for n in 0..24 {
            for (salt, adapter) in [
                (Some("a".repeat(n)), None),
                (None, Some("b".repeat(n))),
                (Some("c".repeat(n)), Some("d".repeat(n % 5))),
            ] {
                // the bytes the first version hashed into the seed, as tokens when they fit
                let field = |v: &Option<String>| match v {
                    None => vec![0u8],
                    Some(s) => [&[1u8][..], &(s.len() as u64).to_le_bytes(), s.as_bytes()].concat(),
                };
                let bytes = [b"kvtier-scope-v1".to_vec(), field(&salt), field(&adapter)].concat();
                if bytes.len() % 4 != 0 || (bytes.len() / 4) % ps != 0 {
                    continue;
                }
                let first: Vec<u32> = bytes
                    .chunks(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let rest: Vec<u32> = (0..3 * ps as u32).collect();
                let scoped = HashScope::new(salt.as_deref(), adapter.as_deref(), Vec::new())
                    .page_hashes(&rest, ps);
                let plain = page_hashes(&[first.clone(), rest.clone()].concat(), ps, None);
                for h in &scoped {
                    assert!(
                        !plain.contains(h),
                        "page size {ps}, salt {salt:?}, adapter {adapter:?}: a plain page equals a scoped one"
                    );
                }
            }
        }
    }
}

/// Found by an adversarial tester: an unsalted page with one extra key of a 1-byte digest
/// hashed `tokens ‖ "kvtier-extra-v1" ‖ LE32(start) ‖ LE32(end) ‖ LE64(1) ‖ digest`, which is
/// `4 * page_size + 32` bytes: the length of a plain (or salted) page after the first,
/// `h_{i-1} ‖ tokens`. A first page whose first 8 tokens are the words of another prompt's
/// `h_0` (plain or salted) then hashed as that prompt's page 1 when that page's tokens are
/// the rest of the image page's input: the image request's page 0 and the other prompt's
/// page 1 had one L3 key (and one tree identity), so each read the other's KV, across
/// tenants too. For page sizes from 8 (the smallest where such a page exists), salted and
/// not, any 1-byte digest and small spans, the crafted prompt shares no page with the image.
#[test]
fn no_plain_or_salted_page_equals_an_extra_keyed_page_built_from_its_input() {
    let words = |b: &[u8]| -> Vec<u32> {
        b.chunks(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    for ps in [8usize, 16, 64] {
        for salt in [None, Some("tenant-a")] {
            // The prompt whose page 1 the image page imitates: its h_0 becomes the image
            // page's first 8 tokens.
            let first: Vec<u32> = (0..ps as u32).map(|i| 100 + i).collect();
            let victim_scope = HashScope::new(salt, None, Vec::new());
            let prev = victim_scope.page_hashes(&first, ps)[0];
            for start in 0..3u32 {
                for len in 1..3u32 {
                    for d in 0..3u8 {
                        let key = ExtraKey {
                            start,
                            end: start + len,
                            digest: vec![d],
                        };
                        let mut image: Vec<u32> = words(&prev.0);
                        image.extend((8..ps as u32).map(|i| 7 + i));
                        // What the first version appended to the image page's tokens.
                        let extra = [
                            &b"kvtier-extra-v1"[..],
                            &start.to_le_bytes(),
                            &(start + len).to_le_bytes(),
                            &1u64.to_le_bytes(),
                            &[d],
                        ]
                        .concat();
                        assert_eq!(extra.len(), 32);
                        let second: Vec<u32> = [image[8..].to_vec(), words(&extra)].concat();
                        assert_eq!(second.len(), ps);
                        let other = victim_scope.page_hashes(&[first.clone(), second].concat(), ps);
                        let scoped =
                            HashScope::new(None, None, vec![key.clone()]).page_hashes(&image, ps);
                        assert!(
                            !other.contains(&scoped[0]),
                            "page size {ps}, salt {salt:?}, key {key:?}: the image page is page {} of another prompt",
                            other.iter().position(|h| *h == scoped[0]).unwrap_or(0)
                        );
                    }
                }
            }
        }
    }
}
