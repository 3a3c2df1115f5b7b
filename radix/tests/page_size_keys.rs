//! The page size is part of what an L3 key is derived from. Two engines of one model with
//! other page sizes (one namespace otherwise) must never share a key: a first page of
//! `P + 8` tokens hashes `4P + 32` bytes, exactly as long as a later page of `P` tokens
//! (`h_{i-1} ‖ tokens`), so a first page whose first 8 tokens are another prompt's `h_0`
//! and whose rest is that prompt's page 1 has that page's digest. Under one key the
//! `P + 8` engine read the `P` engine's page (and its other geometry) as its own.

use kvtier_radix::*;
use proptest::prelude::*;

fn ns() -> KeyNamespace {
    KeyNamespace {
        model: "m".into(),
        dtype: "bf16".into(),
        layout: "tp1".into(),
        tenant: "t".into(),
        adapter: String::new(),
    }
}

/// The crafted first page of `p + 8` tokens whose digest is the `p`-token prompt's page 1.
fn crafted(b: &[u32], p: usize) -> (Vec<PageHash>, Vec<PageHash>) {
    let hb = page_hashes(b, p, None);
    let mut a: Vec<u32> = hb[0]
        .0
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect();
    a.extend_from_slice(&b[p..2 * p]);
    (hb, page_hashes(&a, p + 8, None))
}

/// Before, both engines' keys were `{namespace}:{digest}:{rank}` with one namespace: the
/// crafted page's key was the other engine's page-1 key.
#[test]
fn a_first_page_of_p_plus_8_tokens_never_takes_the_key_of_a_p_token_page() {
    for p in [8usize, 16, 64] {
        let b: Vec<u32> = (0..2 * p as u32).map(|i| i * 7 + 1).collect();
        let (hb, ha) = crafted(&b, p);
        // The digests are one (SGLang-compatible chains cannot tell them apart) ...
        assert_eq!(
            ha[0], hb[1],
            "page size {p}: the crafted page no longer collides"
        );
        // ... the keys are not.
        let (kb, ka) = (ns().keys_for(p, 0), ns().keys_for(p + 8, 0));
        assert_ne!(
            ka.key(&ha[0]),
            kb.key(&hb[1]),
            "page sizes {} and {p}",
            p + 8
        );
    }
}

fn field() -> impl Strategy<Value = String> {
    "[a-c]{0,3}"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Two key builders name a page alike only when their namespace fields and page sizes
    /// are all equal (and their namespace is never the field-only `kvtier-ns-v1` one).
    #[test]
    fn keys_are_shared_only_by_one_namespace_and_page_size(
        a in (field(), field(), field(), 1usize..200),
        b in (field(), field(), field(), 1usize..200),
        digest in any::<[u8; 32]>(),
    ) {
        let mk = |(model, layout, tenant, _): &(String, String, String, usize)| KeyNamespace {
            model: model.clone(),
            dtype: "bf16".into(),
            layout: layout.clone(),
            tenant: tenant.clone(),
            adapter: String::new(),
        };
        let (na, nb) = (mk(&a), mk(&b));
        let h = PageHash(digest);
        let same = na == nb && a.3 == b.3;
        prop_assert_eq!(na.keys_for(a.3, 0).key(&h) == nb.keys_for(b.3, 0).key(&h), same);
        prop_assert_ne!(na.fingerprint_paged(a.3), nb.fingerprint());
    }
}
