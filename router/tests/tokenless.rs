//! Blocks named by hash alone under `--keys tokens` (`kvtier_router::resolve`): vLLM's
//! offloading placeholders on an instance's stream, and a shared store's pages (which carry no
//! tokens) on the store's stream, keyed through the tables of the instances that computed
//! them. Events are encoded as vLLM encodes them (maps tagged by `type`, 64-bit hashes).

mod common;

use common::{PS, model, s};
use kvtier_router::cluster::{Cluster, Keys, Target};
use kvtier_router::stream::Apply;
use proptest::prelude::*;
use rmpv::Value;

fn hashes(hs: &[u64]) -> Value {
    Value::Array(hs.iter().map(|&h| Value::from(h)).collect())
}

/// vLLM's `BlockStored` with tokens: `hs` after `parent`, `PS` tokens each.
fn stored(medium: &str, hs: &[u64], parent: Option<u64>, tokens: &[u32]) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), hashes(hs)),
        (
            s("parent_block_hash"),
            parent.map_or(Value::Nil, Value::from),
        ),
        (
            s("token_ids"),
            Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        ),
        (s("block_size"), Value::from(PS as u64)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s(medium)),
        (s("lora_name"), Value::Nil),
    ])
}

/// A `BlockStored` naming one block by hash alone: vLLM's offloading placeholder
/// (`block_size` 0) or a store's page (`block_size`: the tokens its object holds).
fn tokenless(medium: &str, h: u64, block_size: u64) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), hashes(&[h])),
        (s("parent_block_hash"), Value::Nil),
        (s("token_ids"), Value::Array(Vec::new())),
        (s("block_size"), Value::from(block_size)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s(medium)),
        (s("lora_name"), Value::Nil),
    ])
}

fn removed(medium: &str, hs: &[u64]) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (s("block_hashes"), hashes(hs)),
        (s("medium"), s(medium)),
    ])
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    let v = Value::Array(vec![Value::from(0.0), Value::Array(events), Value::from(0)]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).expect("encode");
    out
}

/// A prompt of `pages` pages for `seed`, and its engine hashes (any numbers: the router
/// never computes an engine's hashes in this mode).
fn prompt(seed: u32, pages: usize) -> (Vec<u32>, Vec<u64>) {
    let toks = (0..(pages * PS) as u32).map(|i| seed * 1000 + i).collect();
    let hs = (0..pages as u64)
        .map(|i| u64::from(seed) << 32 | (i + 1))
        .collect();
    (toks, hs)
}

/// The whole prompt stored on `medium` in one event, as vLLM's block pool publishes it.
fn chain(medium: &str, toks: &[u32], hs: &[u64]) -> Value {
    stored(medium, hs, None, toks)
}

/// A cluster in `--keys tokens` mode: `instances` instance streams (0..), then the store's.
fn cluster(instances: usize) -> (Cluster, usize) {
    let mut c = Cluster::new(instances, model(), 1 << 20, Keys::Tokens).expect("cluster");
    for i in 0..instances {
        c.add_stream(&format!("i{i}"), "", Target::Instance(i));
    }
    let store = c.add_stream("store", "", Target::Storage);
    (c, store)
}

/// Instance `i`'s (GPU, host, L3) pages for the prompt.
fn pages(c: &Cluster, i: usize, toks: &[u32]) -> (usize, usize, usize) {
    let e = c
        .router()
        .estimates_of(&c.prompt_hashes(toks, None, None), toks.len());
    (e[i].gpu_pages, e[i].host_pages, e[i].l3_pages)
}

fn apply(c: &mut Cluster, stream: usize, events: Vec<Value>) {
    assert!(
        c.apply(stream, Apply::Batch(&batch(events))),
        "the batch decodes"
    );
}

fn unkeyed(c: &Cluster, stream: usize) -> u64 {
    c.streams[stream]
        .translator
        .as_ref()
        .expect("tokens")
        .unkeyed
}

/// A batch refused as garbage changes nothing: here a removal of the prompt's blocks
/// followed by a store whose tokens do not decode. The table used to apply the removal
/// before the bad event refused the batch: the index kept the pages (the batch was not
/// folded), the removal sent again no longer translated, and the pages stayed for good.
/// Likewise a clear followed by a bad event.
#[test]
fn a_batch_refused_as_garbage_leaves_the_key_table_as_it_was() {
    let bad_store = Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), hashes(&[99])),
        (s("parent_block_hash"), Value::Nil),
        (s("token_ids"), s("not an array")),
        (s("block_size"), Value::from(PS as u64)),
        (s("medium"), s("GPU")),
    ]);
    for first in ["removal", "clear"] {
        let (mut c, _) = cluster(1);
        let (toks, hs) = prompt(1, 3);
        apply(&mut c, 0, vec![chain("GPU", &toks, &hs)]);
        let undo = match first {
            "removal" => removed("GPU", &hs),
            _ => Value::Map(vec![
                (s("type"), s("AllBlocksCleared")),
                (s("medium"), s("GPU")),
            ]),
        };
        assert!(
            !c.apply(
                0,
                Apply::Batch(&batch(vec![undo.clone(), bad_store.clone()]))
            ),
            "refused"
        );
        assert_eq!(pages(&c, 0, &toks), (3, 0, 0), "{first}: nothing applied");
        apply(&mut c, 0, vec![undo]);
        assert_eq!(
            pages(&c, 0, &toks),
            (0, 0, 0),
            "{first}: the undo, sent again, applies"
        );
    }
}

/// The bug: vLLM's offloading connector (self-describing events off, its default) publishes
/// each offloaded chunk as a placeholder — one hash, no tokens, `block_size` 0 — in the same
/// batch as the step's GPU events; the router refused the whole batch, GPU events too.
#[test]
fn a_placeholder_store_keeps_its_batch_and_keys_its_block() {
    let (mut c, _) = cluster(1);
    let (toks, hs) = prompt(1, 3);
    let mut events = vec![chain("GPU", &toks, &hs)];
    events.extend(hs.iter().map(|&h| tokenless("CPU", h, 0)));
    apply(&mut c, 0, events);
    assert_eq!(pages(&c, 0, &toks), (3, 0, 0));
    // the GPU copies go; the host copies, named by hash alone, stay keyed
    apply(&mut c, 0, vec![removed("GPU", &hs)]);
    assert_eq!(pages(&c, 0, &toks), (0, 3, 0));
    apply(&mut c, 0, vec![removed("CPU", &hs[2..])]);
    assert_eq!(pages(&c, 0, &toks), (0, 2, 0));
    // a placeholder of a block the stream never keyed is counted, and nothing else changes
    apply(&mut c, 0, vec![tokenless("CPU", 999, 0)]);
    assert_eq!(unkeyed(&c, 0), 1);
    assert_eq!(pages(&c, 0, &toks), (0, 2, 0));
}

/// A shared store publishes one object per chunk (here 2 blocks) as the chunk's last
/// block hash: the router keys the chunk's blocks through the instance that computed them,
/// and keeps them after that instance dropped every copy.
#[test]
fn a_stores_chunks_are_keyed_through_the_instance_that_computed_them() {
    let (mut c, store) = cluster(2);
    let (toks, hs) = prompt(2, 4);
    apply(&mut c, 1, vec![chain("GPU", &toks, &hs)]);
    let chunk = (2 * PS) as u64;
    apply(
        &mut c,
        store,
        vec![
            tokenless("STORAGE", hs[1], chunk),
            tokenless("STORAGE", hs[3], chunk),
        ],
    );
    assert_eq!(pages(&c, 1, &toks), (4, 0, 0));
    assert_eq!(
        pages(&c, 0, &toks),
        (0, 0, 4),
        "the store is every instance's"
    );
    apply(&mut c, 1, vec![removed("GPU", &hs)]);
    assert_eq!(pages(&c, 1, &toks), (0, 0, 4));
    // the second chunk goes: both its blocks
    apply(&mut c, store, vec![removed("STORAGE", &hs[3..])]);
    assert_eq!(pages(&c, 0, &toks), (0, 0, 2));
    // the first goes: nothing is left
    apply(&mut c, store, vec![removed("STORAGE", &hs[1..2])]);
    assert_eq!(pages(&c, 0, &toks), (0, 0, 0));
    assert_eq!(unkeyed(&c, store), 0);
}

/// A store heard before any instance names the hash (a router that starts after the
/// store's snapshot, an instance stream still replaying) waits, and is keyed when an instance
/// first keys the hash; a removal before that cancels the wait; a reset forgets it.
#[test]
fn a_store_heard_before_its_instance_waits_for_it() {
    let (mut c, store) = cluster(2);
    let (toks, hs) = prompt(3, 2);
    let (other, ohs) = prompt(4, 2);
    let (third, ths) = prompt(5, 2);
    apply(
        &mut c,
        store,
        vec![
            tokenless("STORAGE", hs[1], (2 * PS) as u64),
            tokenless("STORAGE", ohs[0], PS as u64),
            tokenless("STORAGE", ths[1], PS as u64),
        ],
    );
    assert_eq!(pages(&c, 0, &toks), (0, 0, 0));
    assert_eq!(
        c.stats()["streams"][store]["waiting"],
        3,
        "/stats shows the waits"
    );
    apply(&mut c, store, vec![removed("STORAGE", &ohs[..1])]);
    assert!(c.apply(store, Apply::Batch(&batch(vec![]))));
    apply(&mut c, 0, vec![chain("GPU", &toks, &hs)]);
    apply(&mut c, 1, vec![chain("GPU", &other, &ohs)]);
    assert_eq!(
        pages(&c, 1, &toks),
        (0, 0, 2),
        "keyed once instance 0 named it"
    );
    assert_eq!(pages(&c, 0, &other), (0, 0, 0), "removed while it waited");
    // a reset of the store's stream forgets what waits
    assert!(c.apply(store, Apply::Reset));
    apply(&mut c, 0, vec![chain("GPU", &third, &ths)]);
    assert_eq!(pages(&c, 1, &third), (0, 0, 0));
    assert_eq!(
        pages(&c, 1, &toks),
        (0, 0, 0),
        "the reset cleared the store's pages"
    );
}

/// One step of a random history: an instance stores a whole prompt on GPU or drops it, or
/// the store gains or loses one of a prompt's chunks.
#[derive(Clone, Debug)]
enum Op {
    Compute { instance: usize, prompt: usize },
    Evict { instance: usize, prompt: usize },
    Put { prompt: usize, chunk: usize },
    Drop { prompt: usize, chunk: usize },
}

const PROMPTS: usize = 4;
const CHUNKS: usize = 3;
const CHUNK_PAGES: usize = 2;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..2usize, 0..PROMPTS).prop_map(|(instance, prompt)| Op::Compute { instance, prompt }),
        (0..2usize, 0..PROMPTS).prop_map(|(instance, prompt)| Op::Evict { instance, prompt }),
        (0..PROMPTS, 0..CHUNKS).prop_map(|(prompt, chunk)| Op::Put { prompt, chunk }),
        (0..PROMPTS, 0..CHUNKS).prop_map(|(prompt, chunk)| Op::Drop { prompt, chunk }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever the order of the instances' and the store's events, the router credits L3
    /// for exactly the pages of the chunks the store holds that an instance keyed: one
    /// holding the prompt when the chunk was stored, or computing it while the chunk waited.
    /// Never a page the store does not hold.
    #[test]
    fn the_store_set_is_exactly_the_chunks_held_and_once_known(
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let (mut c, store) = cluster(2);
        let prompts: Vec<_> = (0..PROMPTS)
            .map(|p| prompt(10 + p as u32, CHUNKS * CHUNK_PAGES))
            .collect();
        let mut held = [[false; CHUNKS]; PROMPTS];
        let mut known = [[false; CHUNKS]; PROMPTS];
        let mut on_gpu = [[false; PROMPTS]; 2];
        for op in &ops {
            match *op {
                Op::Compute { instance, prompt } => {
                    if !on_gpu[instance][prompt] {
                        let (toks, hs) = &prompts[prompt];
                        apply(&mut c, instance, vec![chain("GPU", toks, hs)]);
                        on_gpu[instance][prompt] = true;
                        for ch in 0..CHUNKS {
                            known[prompt][ch] |= held[prompt][ch];
                        }
                    }
                }
                Op::Evict { instance, prompt } => {
                    if on_gpu[instance][prompt] {
                        apply(&mut c, instance, vec![removed("GPU", &prompts[prompt].1)]);
                        on_gpu[instance][prompt] = false;
                    }
                }
                Op::Put { prompt, chunk } => {
                    if !held[prompt][chunk] {
                        let last = prompts[prompt].1[(chunk + 1) * CHUNK_PAGES - 1];
                        let bs = (CHUNK_PAGES * PS) as u64;
                        apply(&mut c, store, vec![tokenless("STORAGE", last, bs)]);
                        held[prompt][chunk] = true;
                        known[prompt][chunk] = on_gpu.iter().any(|g| g[prompt]);
                    }
                }
                Op::Drop { prompt, chunk } => {
                    if held[prompt][chunk] {
                        let last = prompts[prompt].1[(chunk + 1) * CHUNK_PAGES - 1];
                        apply(&mut c, store, vec![removed("STORAGE", &[last])]);
                        held[prompt][chunk] = false;
                        known[prompt][chunk] = false;
                    }
                }
            }
            for (p, (toks, _)) in prompts.iter().enumerate() {
                let keys = c.prompt_hashes(toks, None, None);
                let in_store = c.router().index().in_storage(&keys);
                for (page, &credited) in in_store.iter().enumerate() {
                    let ch = page / CHUNK_PAGES;
                    prop_assert!(!credited || held[p][ch], "prompt {p} page {page} credited, not held");
                    prop_assert_eq!(credited, held[p][ch] && known[p][ch], "prompt {} page {}", p, page);
                }
            }
        }
        prop_assert_eq!(unkeyed(&c, store), 0);
    }
}

/// The store's `AllBlocksCleared` (a new leader's stream, a snapshot's first event) means
/// it holds nothing: the store stream's table forgets every page and every wait, and a
/// snapshot after it keys its pages again.
#[test]
fn the_stores_clear_forgets_its_table_and_waits() {
    let (mut c, store) = cluster(1);
    let (toks, hs) = prompt(6, 2);
    let (late, lhs) = prompt(7, 1);
    apply(&mut c, 0, vec![chain("GPU", &toks, &hs)]);
    let cleared = Value::Map(vec![(s("type"), s("AllBlocksCleared"))]);
    apply(
        &mut c,
        store,
        vec![
            tokenless("STORAGE", hs[1], (2 * PS) as u64),
            tokenless("STORAGE", lhs[0], PS as u64),
        ],
    );
    let table = |c: &Cluster| {
        let t = c.streams[store].translator.as_ref().expect("tokens");
        (t.entries(), t.pending())
    };
    assert_eq!(table(&c), (2, 1));
    apply(&mut c, store, vec![cleared.clone()]);
    assert_eq!(table(&c), (0, 0));
    apply(
        &mut c,
        0,
        vec![removed("GPU", &hs), chain("GPU", &late, &lhs)],
    );
    assert_eq!(
        pages(&c, 0, &late),
        (1, 0, 0),
        "no wait left to key it in L3"
    );
    // a snapshot: the clear, then every page held
    apply(&mut c, 0, vec![chain("GPU", &toks, &hs)]);
    apply(
        &mut c,
        store,
        vec![cleared, tokenless("STORAGE", hs[1], (2 * PS) as u64)],
    );
    apply(&mut c, 0, vec![removed("GPU", &hs)]);
    assert_eq!(pages(&c, 0, &toks), (0, 0, 2));
    assert_eq!(table(&c), (2, 0));
}

/// A publisher's garbage must not hang the router: blocks whose parents form a cycle, then a
/// token-less store claiming a run of 2^62 tokens. The walk is bounded by the longest run
/// a table records (65,535 blocks), so the store keys the cycle's blocks and returns.
#[test]
fn a_parent_cycle_and_a_huge_run_end_promptly() {
    let (mut c, store) = cluster(1);
    let toks: Vec<u32> = (0..PS as u32).collect();
    apply(
        &mut c,
        0,
        vec![
            stored("GPU", &[1], None, &toks),
            stored("GPU", &[2], Some(1), &toks),
            stored("GPU", &[1], Some(2), &toks),
        ],
    );
    apply(&mut c, store, vec![tokenless("STORAGE", 1, 1 << 62)]);
    apply(&mut c, store, vec![removed("STORAGE", &[1])]);
    assert_eq!(c.router().index().tier_pages().1, 0);
}

/// A `medium` that is not a string (7) was indexed as GPU, as an absent one is (vLLM before
/// it published media): it is skipped, as an unknown medium name is, in both key modes. An
/// absent or nil medium is still GPU.
#[test]
fn a_medium_that_is_not_a_string_is_skipped() {
    let (toks, hs) = prompt(3, 2);
    for keys in [Keys::Tokens, Keys::Engine] {
        let mut c = Cluster::new(1, model(), 1 << 20, keys).expect("cluster");
        let st = c.add_stream("i0", "", Target::Instance(0));
        let with = |medium: Option<Value>| {
            let mut e = chain("GPU", &toks, &hs);
            if let Value::Map(m) = &mut e {
                m.retain(|(k, _)| k.as_str() != Some("medium"));
                m.extend(medium.map(|v| (s("medium"), v)));
            }
            batch(vec![e])
        };
        c.apply(st, Apply::Batch(&with(Some(Value::from(7)))));
        assert_eq!(c.router().index().pages(), 0, "{keys:?}: medium 7");
        c.apply(st, Apply::Batch(&with(Some(Value::Nil))));
        assert_eq!(c.router().index().pages(), 2, "{keys:?}: medium nil");
        c.apply(st, Apply::Batch(&with(None)));
        assert_eq!(c.router().index().pages(), 2, "{keys:?}: no medium");
    }
}

/// Two tenants' prompts with equal tokens (vLLM's `cache_salt` changes the block hashes, not
/// the tokens) share the router's keys in this mode. The bug: the key table counted no
/// holders, so the first tenant's eviction removed the key while the other tenant's copy was
/// still on the instance (a multi-tenant deployment with one system prompt lost its GPU
/// credit at every eviction of any tenant's copy). Likewise on the store's stream.
/// Which of the prompt's pages the index holds, per medium ("GPU", "CPU", "STORAGE"), for
/// instance 0 and the store.
fn held_pages(c: &Cluster, toks: &[u32]) -> Vec<(&'static str, usize)> {
    let keys = c.prompt_hashes(toks, None, None);
    let mut out: Vec<_> = c
        .router()
        .index()
        .entries()
        .into_iter()
        .filter(|&(i, _, _)| i == 0 || i == usize::MAX)
        .filter_map(|(_, m, h)| keys.iter().position(|&k| k == h).map(|p| (m, p)))
        .collect();
    out.sort_unstable();
    out
}

fn on(medium: &'static str, pages: std::ops::Range<usize>) -> Vec<(&'static str, usize)> {
    pages.map(|p| (medium, p)).collect()
}

#[test]
fn a_key_two_salted_copies_share_stays_until_both_are_gone() {
    let (mut c, store) = cluster(1);
    let (toks, a) = prompt(1, 3);
    let b: Vec<u64> = a.iter().map(|h| h ^ 0xABCD_0000_0000_0000).collect();
    apply(
        &mut c,
        0,
        vec![chain("GPU", &toks, &a), chain("GPU", &toks, &b)],
    );
    apply(&mut c, 0, vec![chain("CPU", &toks, &a)]);
    let both = [on("CPU", 0..3), on("GPU", 0..3)].concat();
    assert_eq!(held_pages(&c, &toks), both);
    apply(&mut c, 0, vec![removed("GPU", &a)]);
    assert_eq!(
        held_pages(&c, &toks),
        both,
        "tenant b's copy is still on the GPU"
    );
    apply(&mut c, 0, vec![removed("GPU", &b[1..])]);
    assert_eq!(
        held_pages(&c, &toks),
        [on("CPU", 0..3), on("GPU", 0..1)].concat()
    );
    apply(&mut c, 0, vec![removed("CPU", &a)]);
    assert_eq!(held_pages(&c, &toks), on("GPU", 0..1));
    // the store holds both tenants' 3-block chunk: one dropped, the other still counts
    apply(
        &mut c,
        0,
        vec![chain("CPU", &toks, &a), chain("CPU", &toks, &b)],
    );
    let bs = (3 * PS) as u64;
    apply(
        &mut c,
        store,
        vec![
            tokenless("STORAGE", a[2], bs),
            tokenless("STORAGE", b[2], bs),
        ],
    );
    let stored = [on("CPU", 0..3), on("GPU", 0..1), on("STORAGE", 0..3)].concat();
    assert_eq!(held_pages(&c, &toks), stored);
    apply(&mut c, store, vec![removed("STORAGE", &[a[2]])]);
    assert_eq!(
        held_pages(&c, &toks),
        stored,
        "tenant b's chunk is still stored"
    );
    apply(&mut c, store, vec![removed("STORAGE", &[b[2]])]);
    assert_eq!(
        held_pages(&c, &toks),
        [on("CPU", 0..3), on("GPU", 0..1)].concat()
    );
}

#[derive(Clone, Debug)]
enum TenantOp {
    Store {
        tenant: usize,
        medium: usize,
        pages: usize,
    },
    Remove {
        tenant: usize,
        medium: usize,
        from: usize,
    },
    Clear,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Tenants storing and removing runs of one shared prompt (equal tokens, their own block
    /// hashes) on GPU and CPU, and the instance's `AllBlocksCleared`: the router credits a
    /// page on a medium exactly while some tenant's copy of it is there.
    #[test]
    fn a_shared_key_is_held_exactly_while_some_tenant_holds_it(
        ops in proptest::collection::vec(
            prop_oneof![
                (0..3usize, 0..2usize, 1..=4usize)
                    .prop_map(|(tenant, medium, pages)| TenantOp::Store { tenant, medium, pages }),
                (0..3usize, 0..2usize, 0..4usize)
                    .prop_map(|(tenant, medium, from)| TenantOp::Remove { tenant, medium, from }),
                Just(TenantOp::Clear),
            ],
            1..50,
        ),
    ) {
        const MEDIA: [&str; 2] = ["GPU", "CPU"];
        let (mut c, _) = cluster(1);
        let (toks, base) = prompt(7, 4);
        let tenant_hashes = |t: usize| -> Vec<u64> {
            base.iter().map(|h| h ^ ((t as u64 + 1) << 48)).collect()
        };
        // held[tenant][medium][page]
        let mut held = [[[false; 4]; 2]; 3];
        for op in &ops {
            match *op {
                TenantOp::Store { tenant, medium, pages } => {
                    let hs = tenant_hashes(tenant);
                    apply(&mut c, 0, vec![chain(MEDIA[medium], &toks[..pages * PS], &hs[..pages])]);
                    held[tenant][medium][..pages].fill(true);
                }
                TenantOp::Remove { tenant, medium, from } => {
                    let hs = tenant_hashes(tenant);
                    apply(&mut c, 0, vec![removed(MEDIA[medium], &hs[from..])]);
                    held[tenant][medium][from..].fill(false);
                }
                TenantOp::Clear => {
                    apply(&mut c, 0, vec![Value::Map(vec![
                        (s("type"), s("AllBlocksCleared")),
                        (s("medium"), s("GPU")),
                    ])]);
                    held = [[[false; 4]; 2]; 3];
                }
            }
            let mut want: Vec<(&'static str, usize)> = (0..2)
                .flat_map(|m| (0..4).map(move |p| (m, p)))
                .filter(|&(m, p)| held.iter().any(|t| t[m][p]))
                .map(|(m, p)| (MEDIA[m], p))
                .collect();
            want.sort_unstable();
            prop_assert_eq!(held_pages(&c, &toks), want, "{:?}", op);
        }
    }
}
