//! What publishers send. Whatever bytes or msgpack values a publisher sends, the router's
//! decoding and indexing hold: a payload is a batch or a typed error (never a panic), a
//! refused batch changes nothing, the index and the key tables stay within their byte
//! budget, and every prompt still routes (both key modes, instance streams and the shared
//! store's). And the fields newer vLLM versions add to the events (vLLM 0.34's
//! `group_idx` and `extra_keys`, the `locality` of a `STORAGE` tier) are read as they
//! mean.

mod common;

use common::{PS, model, s};
use kvtier_router::cluster::{Cluster, Keys, Target};
use kvtier_router::stream::Apply;
use kvtier_router::{Budget, decode_batch};
use proptest::prelude::*;
use rmpv::Value;

/// The byte budget: small, so that floods reach it.
const BUDGET: usize = 4096;

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("encode");
    out
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    encode(&Value::Array(vec![
        Value::from(0.0),
        Value::Array(events),
        Value::from(0),
    ]))
}

/// Any msgpack value of a few levels, of every kind.
fn any_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Nil),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop::sample::select(vec![
            "GPU",
            "CPU",
            "STORAGE",
            "DISK",
            "",
            "BlockStored",
            "é😀"
        ])
        .prop_map(Value::from),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((inner.clone(), inner), 0..4).prop_map(Value::Map),
        ]
    })
}

/// A value for `field`: mostly one a publisher would send (from small pools, so that events
/// name each other's blocks), sometimes any value at all.
fn field(name: &'static str) -> BoxedStrategy<Value> {
    let hash = prop_oneof![
        (0u64..8).prop_map(Value::from),
        (-3i64..0).prop_map(Value::from),
        Just(Value::from(u64::MAX)),
        prop::collection::vec(any::<u8>(), 0..33).prop_map(Value::from),
    ];
    let plausible: BoxedStrategy<Value> = match name {
        "type" => prop::sample::select(vec![
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
            "BlockPinned",
        ])
        .prop_map(Value::from)
        .boxed(),
        "block_hashes" => prop::collection::vec(hash, 0..5)
            .prop_map(Value::Array)
            .boxed(),
        "parent_block_hash" => prop_oneof![Just(Value::Nil), hash].boxed(),
        "token_ids" => prop::collection::vec(0u32..6, 0..(4 * PS))
            .prop_map(|t| Value::Array(t.into_iter().map(Value::from).collect()))
            .boxed(),
        "block_size" => prop_oneof![
            Just(Value::from(PS as u64)),
            Just(Value::from(0)),
            Just(Value::from(1)),
            Just(Value::from(2 * PS as u64)),
            Just(Value::from(-1)),
            Just(Value::from(u64::MAX)),
        ]
        .boxed(),
        "medium" => prop::sample::select(vec!["GPU", "CPU", "STORAGE", "DISK"])
            .prop_map(Value::from)
            .boxed(),
        "lora_name" => prop_oneof![Just(Value::Nil), Just(s("a")), Just(s("é"))].boxed(),
        _ => any_value().boxed(),
    };
    prop_oneof![8 => plausible, 1 => any_value()].boxed()
}

/// One event: a map of a publisher's fields, some absent, some of another type, and
/// sometimes a field of a newer vLLM, or not a map at all.
fn event() -> impl Strategy<Value = Value> {
    let names = [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
        "extra_keys",
    ];
    let fields: Vec<_> = names
        .iter()
        .map(|&n| prop::option::weighted(0.9, field(n)).prop_map(move |v| v.map(|v| (s(n), v))))
        .collect();
    prop_oneof![
        20 => fields.prop_map(|fs| Value::Map(fs.into_iter().flatten().collect())),
        1 => any_value(),
    ]
}

/// What a refused batch must leave as it was: the index's pages, its bytes, each stream's
/// key table, and every probe prompt's estimate.
fn state(c: &Cluster, probes: &[Vec<u32>]) -> String {
    let tables: Vec<_> = c
        .streams
        .iter()
        .filter_map(|s| s.translator.as_ref())
        .map(|t| (t.entries(), t.pending(), t.memory_bytes()))
        .collect();
    let estimates: Vec<_> = probes
        .iter()
        .map(|p| {
            let e = c
                .router()
                .estimates_of(&c.prompt_hashes(p, None, None), p.len());
            e.iter()
                .map(|e| (e.gpu_pages, e.host_pages, e.l3_pages))
                .collect::<Vec<_>>()
        })
        .collect();
    format!(
        "{} {} {tables:?} {estimates:?}",
        c.router().index().pages(),
        c.router().index().memory_bytes()
    )
}

fn clusters() -> Vec<Cluster> {
    [Keys::Tokens, Keys::Engine]
        .into_iter()
        .map(|keys| {
            let mut c =
                Cluster::with_budget(2, model(), Budget::bytes(BUDGET), keys).expect("cluster");
            c.add_stream("i0", "", Target::Instance(0));
            c.add_stream("i1", "", Target::Instance(1));
            c.add_stream("store", "", Target::Storage);
            c
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any bytes at all: an error or a batch, never a panic.
    #[test]
    fn any_bytes_decode_to_a_batch_or_an_error(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode_batch(&bytes);
        for mut c in clusters() {
            for st in 0..3 {
                let _ = c.apply(st, Apply::Batch(&bytes));
            }
            prop_assert!(c.route(&[0, 1, 2, 3], None, None, &[]).is_some());
        }
    }

    /// Batches of plausible and implausible events on every stream: each is folded or
    /// refused whole (a refused batch changes nothing), the budget holds, and every prompt
    /// routes after each.
    #[test]
    fn hostile_batches_are_folded_or_refused_whole_within_the_budget(
        batches in prop::collection::vec(
            (0..3usize, prop::collection::vec(event(), 0..5), 0..4usize),
            1..20,
        ),
    ) {
        let probes: Vec<Vec<u32>> = vec![vec![0; 2 * PS], (0..(3 * PS) as u32).map(|t| t % 6).collect()];
        for mut c in clusters() {
            for (st, events, corrupt) in &batches {
                let mut payload = batch(events.clone());
                // sometimes a batch cut short, or a top level of another shape
                match corrupt {
                    1 => payload.truncate(payload.len() / 2),
                    2 => payload = encode(&Value::Array(vec![Value::from(0.0), Value::Array(events.clone())])),
                    _ => {}
                }
                let before = state(&c, &probes);
                if !c.apply(*st, Apply::Batch(&payload)) {
                    prop_assert_eq!(state(&c, &probes), before, "a refused batch changed the state");
                }
                prop_assert!(c.memory_bytes() <= BUDGET, "{} bytes past the budget", c.memory_bytes());
                for p in &probes {
                    prop_assert!(c.route(p, None, Some("a"), &[]).is_some());
                }
            }
        }
    }
}

/// vLLM's `BlockStored` (0.34: with its KV cache group): `hs` after `parent`, `PS` tokens
/// each.
fn stored(hs: &[u64], parent: Option<u64>, tokens: &[u32], group: Option<u64>) -> Value {
    let mut m = vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            Value::Array(hs.iter().map(|&h| Value::from(h)).collect()),
        ),
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
        (s("medium"), s("GPU")),
        (s("lora_name"), Value::Nil),
    ];
    m.extend(group.map(|g| (s("group_idx"), Value::from(g))));
    Value::Map(m)
}

fn removed(hs: &[u64], group: Option<u64>) -> Value {
    let mut m = vec![
        (s("type"), s("BlockRemoved")),
        (
            s("block_hashes"),
            Value::Array(hs.iter().map(|&h| Value::from(h)).collect()),
        ),
        (s("medium"), s("GPU")),
    ];
    m.extend(group.map(|g| (s("group_idx"), Value::from(g))));
    Value::Map(m)
}

/// A hybrid model's engine (vLLM 0.34: full attention and sliding-window layers, two KV
/// cache groups) stores each block once per group, with the same block hash and tokens and
/// its `group_idx`, and evicts each group's copy on its own: the sliding-window group frees
/// the blocks that fall out of its window long before the full-attention group lets go of
/// the prefix, which is still a cache hit (the window needs only the last blocks). The bug:
/// `--keys tokens` took the two copies for one block, so the sliding-window group's first
/// eviction took the prefix out of the index while the full-attention group still held it.
/// A key now leaves the index with the last group holding it.
#[test]
fn a_blocks_copy_in_one_kv_cache_group_stays_while_another_group_evicts_its_own() {
    let mut c =
        Cluster::with_budget(1, model(), Budget::bytes(1 << 20), Keys::Tokens).expect("cluster");
    let st = c.add_stream("i0", "", Target::Instance(0));
    let toks: Vec<u32> = (0..(3 * PS) as u32).collect();
    let hs = [11, 12, 13];
    let gpu = |c: &Cluster| {
        let e = c
            .router()
            .estimates_of(&c.prompt_hashes(&toks, None, None), toks.len());
        e[0].gpu_pages
    };
    let both = vec![
        stored(&hs, None, &toks, Some(0)),
        stored(&hs, None, &toks, Some(1)),
    ];
    assert!(c.apply(st, Apply::Batch(&batch(both))));
    assert_eq!(gpu(&c), 3);
    // the sliding-window group evicts the blocks that left its window
    assert!(c.apply(st, Apply::Batch(&batch(vec![removed(&hs[..2], Some(1))]))));
    assert_eq!(
        gpu(&c),
        3,
        "the full-attention group still holds the prefix"
    );
    // the last block leaves both groups, one after the other
    assert!(c.apply(st, Apply::Batch(&batch(vec![removed(&hs[2..], Some(1))]))));
    assert_eq!(gpu(&c), 3);
    assert!(c.apply(st, Apply::Batch(&batch(vec![removed(&hs[2..], None)]))));
    assert_eq!(gpu(&c), 2, "events without a group are group 0's");
    // stored again in the sliding-window group, after a parent that group evicted already
    // (keyed by its tokens: the full-attention group's copy keys it)
    let again = stored(&hs[2..], Some(hs[1]), &toks[2 * PS..], Some(1));
    assert!(c.apply(st, Apply::Batch(&batch(vec![again]))));
    assert_eq!(gpu(&c), 3);
    let gone = vec![removed(&hs[..2], Some(0)), removed(&hs[2..], Some(1))];
    assert!(c.apply(st, Apply::Batch(&batch(gone))));
    assert_eq!(gpu(&c), 0);
    assert_eq!(c.router().index().pages(), 0);
}

/// [`stored`] with vLLM 0.34's `extra_keys`: one entry per block.
fn with_extra_keys(mut e: Value, keys: Vec<Value>) -> Value {
    if let Value::Map(m) = &mut e {
        m.push((s("extra_keys"), Value::Array(keys)));
    }
    e
}

/// vLLM 0.34 publishes each block's extra hash keys (`extra_keys`): a multimodal item's
/// `(mm_identifier, offset)` pairs, prompt-embeds digests, the LoRA name and the cache salt.
/// Two prompts whose tokens are equal (an image is its placeholder tokens) but whose images
/// differ share no block past the image in the engine; the bug: `--keys tokens` keyed the
/// blocks by their tokens alone, so a request with any other image was priced as a GPU hit
/// of the whole prefix where the engine computes it (a vision model's requests sharing a
/// system prompt and the image's place were all drawn to one instance, for hits that never
/// come). A block whose extra keys name what a request's tokens do not (a multimodal item,
/// prompt embeddings) is keyed with them, and so are its children: no prompt's tokens match
/// it. The LoRA name and the salt are the strings vLLM publishes, keyed as before.
#[test]
fn blocks_of_an_image_are_no_hit_for_another_images_equal_tokens() {
    let mut c =
        Cluster::with_budget(1, model(), Budget::bytes(1 << 20), Keys::Tokens).expect("cluster");
    let st = c.add_stream("i0", "", Target::Instance(0));
    // a system prompt's block, then two blocks of image placeholders, then the question
    let toks: Vec<u32> = [vec![1; PS], vec![9; 2 * PS], vec![5; PS]].concat();
    let gpu = |c: &Cluster| {
        let e = c
            .router()
            .estimates_of(&c.prompt_hashes(&toks, None, None), toks.len());
        e[0].gpu_pages
    };
    let image = |id: &str| {
        let pair = |off: u64| Value::Array(vec![Value::Array(vec![s(id), Value::from(off)])]);
        vec![s("salt-a"), pair(0), pair(PS as u64), Value::Nil]
    };
    let ev = with_extra_keys(stored(&[1, 2, 3, 4], None, &toks, None), image("img-a"));
    assert!(c.apply(st, Apply::Batch(&batch(vec![ev]))));
    assert_eq!(
        gpu(&c),
        1,
        "the system prompt's block is a hit; the image's and the rest are not"
    );
    // tagged keys (vLLM names the untagged shape a transition): the same
    let tagged = |v: &[&str]| Value::Array(vec![Value::Array(v.iter().map(|&x| s(x)).collect())]);
    let ev = with_extra_keys(
        stored(&[11, 12], None, &toks[..2 * PS], None),
        vec![tagged(&["cache_salt", "a"]), tagged(&["mm", "img-b", "0"])],
    );
    assert!(c.apply(
        st,
        Apply::Batch(&batch(vec![removed(&[1, 2, 3, 4], None), ev]))
    ));
    assert_eq!(gpu(&c), 1);
    // extra keys naming only a salt or an adapter's name: keyed by the tokens, as before
    let ev = with_extra_keys(
        stored(&[21, 22, 23, 24], None, &toks, None),
        vec![s("salt-a"), Value::Nil, Value::Nil, Value::Nil],
    );
    assert!(c.apply(st, Apply::Batch(&batch(vec![ev]))));
    assert_eq!(gpu(&c), 4);
}

/// A `STORAGE` event of an instance's offloading tier (vLLM 0.34's tiering: its `fs`
/// tier on a node's own disk is `locality: "LOCAL"`, on a shared file system `"REMOTE"`).
fn on_storage(stored: bool, hs: &[u64], tokens: &[u32], locality: Option<&str>) -> Value {
    let hashes = Value::Array(hs.iter().map(|&h| Value::from(h)).collect());
    let mut m = vec![
        (
            s("type"),
            s(if stored {
                "BlockStored"
            } else {
                "BlockRemoved"
            }),
        ),
        (s("block_hashes"), hashes),
        (s("medium"), s("STORAGE")),
    ];
    if stored {
        m.extend([
            (s("parent_block_hash"), Value::Nil),
            (
                s("token_ids"),
                Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
            ),
            // vLLM's offloading placeholder names a chunk by hash alone: block_size 0
            (
                s("block_size"),
                Value::from(if tokens.is_empty() { 0 } else { PS as u64 }),
            ),
            (s("lora_id"), Value::Nil),
            (s("lora_name"), Value::Nil),
        ]);
    }
    m.extend(locality.map(|l| (s("locality"), s(l))));
    Value::Map(m)
}

/// An instance's `STORAGE` pages are the shared store's, loadable by every instance, unless
/// the event says they are local to it: a node's own disk (vLLM 0.34's tiering, `locality:
/// "LOCAL"`). The bug: every instance was priced as loading them (the router sent a prompt
/// whose pages sat on one node's disk to another node, for an L3 hit it never had). Such
/// pages are the instance's own now: priced at the L3's bandwidth for it alone, and a
/// removal takes them away. Both key modes; `REMOTE` and no locality are shared, as before.
#[test]
fn pages_on_an_instances_local_disk_are_loadable_by_it_alone() {
    for keys in [Keys::Tokens, Keys::Engine] {
        let mut c =
            Cluster::with_budget(2, model(), Budget::bytes(1 << 20), keys).expect("cluster");
        let (i0, i1) = (
            c.add_stream("i0", "", Target::Instance(0)),
            c.add_stream("i1", "", Target::Instance(1)),
        );
        let toks: Vec<u32> = (0..(3 * PS) as u32).collect();
        let l3 = |c: &Cluster| {
            let e = c
                .router()
                .estimates_of(&c.prompt_hashes(&toks, None, None), toks.len());
            (e[0].l3_pages, e[1].l3_pages)
        };
        // the engine's hashes: in --keys engine the router's own keys, in --keys tokens any
        let hs = match keys {
            Keys::Engine => c.prompt_hashes(&toks, None, None),
            Keys::Tokens => vec![31, 32, 33],
        };
        let apply = |c: &mut Cluster, st, events| {
            assert!(c.apply(st, Apply::Batch(&batch(events))), "{keys:?}");
        };
        // computed on instance 0, offloaded to its own disk, then dropped from its GPU
        let stored_here = match keys {
            // in --keys tokens the offload names each block by hash alone, after the GPU
            // store named it with its tokens
            Keys::Tokens => hs
                .iter()
                .map(|&h| on_storage(true, &[h], &[], Some("LOCAL")))
                .collect(),
            Keys::Engine => vec![on_storage(true, &hs, &toks, Some("LOCAL"))],
        };
        let mut events = vec![stored(&hs, None, &toks, None)];
        events.extend(stored_here);
        apply(&mut c, i0, events);
        apply(&mut c, i0, vec![removed(&hs, None)]);
        assert_eq!(
            l3(&c),
            (3, 0),
            "{keys:?}: instance 1 cannot read instance 0's disk"
        );
        // the shared store's stream starting over (a new leader, a snapshot) clears the
        // shared store's pages, not an instance's own disk
        let store = c.add_stream("store", "", Target::Storage);
        let cleared = Value::Map(vec![(s("type"), s("AllBlocksCleared"))]);
        apply(&mut c, store, vec![cleared]);
        assert!(c.apply(store, Apply::Reset));
        assert_eq!(l3(&c), (3, 0), "{keys:?}: the store's clear");
        apply(
            &mut c,
            i0,
            vec![on_storage(false, &hs[2..], &[], Some("LOCAL"))],
        );
        assert_eq!(l3(&c), (2, 0), "{keys:?}");
        // a tier shared by the instances (REMOTE, or no locality): every instance loads it
        for locality in [Some("REMOTE"), None] {
            apply(
                &mut c,
                i1,
                vec![
                    stored(&hs, None, &toks, None),
                    on_storage(true, &hs, &toks, locality),
                ],
            );
            apply(&mut c, i1, vec![removed(&hs, None)]);
            assert_eq!(l3(&c), (3, 3), "{keys:?} {locality:?}");
            apply(&mut c, i1, vec![on_storage(false, &hs, &[], locality)]);
            assert_eq!(l3(&c), (2, 0), "{keys:?} {locality:?}");
        }
    }
}

/// `--page-size` must be the engines' block size: a router given 16 in front of engines of
/// 32-token blocks keys their pages in blocks no prompt is cut into, and no page is ever a
/// hit. The bug: nothing said so (`/stats` showed the pages indexed, every decision priced
/// them as computed). Each `BlockStored` names its block size; a stream whose stores name
/// another than the router's now counts them and shows the latest (`/stats`:
/// `other_block_size`, `block_size`). Token-less stores (a chunk, a store's object, vLLM's
/// placeholder of size 0) name their run's size, not a block's, and are not counted.
#[test]
fn stores_of_another_block_size_than_the_routers_are_counted() {
    for keys in [Keys::Tokens, Keys::Engine] {
        let mut c =
            Cluster::with_budget(1, model(), Budget::bytes(1 << 20), keys).expect("cluster");
        let st = c.add_stream("i0", "", Target::Instance(0));
        let toks: Vec<u32> = (0..(4 * PS) as u32).collect();
        let mut wide = stored(&[1, 2], None, &toks, None);
        if let Value::Map(m) = &mut wide {
            for (k, v) in m.iter_mut() {
                if k.as_str() == Some("block_size") {
                    *v = Value::from(2 * PS as u64);
                }
            }
        }
        let events = vec![
            stored(&[3], None, &toks[..PS], None),
            wide,
            on_storage(true, &[3], &[], None),
        ];
        assert!(c.apply(st, Apply::Batch(&batch(events))));
        let stats = c.stats();
        let s = &stats["streams"][0];
        assert_eq!(s["other_block_size"], 1, "{keys:?}: {s}");
        assert_eq!(s["block_size"], 2 * PS, "{keys:?}: {s}");
    }
}

/// vLLM before `lora_name` (up to 0.10) named a LoRA request's blocks by `lora_id` alone.
/// The bug: `--keys tokens` read such a block as the base model's (no `lora_name`), so a
/// base-model request with the same prompt was priced as a GPU hit on blocks the engine
/// keys by the adapter (a miss). A block naming an adapter by number only is keyed apart
/// from the base model's (and from every adapter named by name: the router cannot tell
/// which it is); `lora_name`, where sent, keys it as before.
#[test]
fn a_block_of_an_adapter_named_by_number_only_is_no_hit_for_the_base_model() {
    let mut c =
        Cluster::with_budget(1, model(), Budget::bytes(1 << 20), Keys::Tokens).expect("cluster");
    let st = c.add_stream("i0", "", Target::Instance(0));
    let toks: Vec<u32> = (0..(2 * PS) as u32).collect();
    let gpu = |c: &Cluster, lora: Option<&str>| {
        let e = c
            .router()
            .estimates_of(&c.prompt_hashes(&toks, None, lora), toks.len());
        e[0].gpu_pages
    };
    let with = |hs: &[u64], id: Value, name: Value| {
        let mut e = stored(hs, None, &toks, None);
        if let Value::Map(m) = &mut e {
            for (k, v) in m.iter_mut() {
                match k.as_str() {
                    Some("lora_id") => *v = id.clone(),
                    Some("lora_name") => *v = name.clone(),
                    _ => {}
                }
            }
        }
        e
    };
    let old_vllm = with(&[1, 2], Value::from(3), Value::Nil);
    assert!(c.apply(st, Apply::Batch(&batch(vec![old_vllm]))));
    assert_eq!(gpu(&c, None), 0, "the base model's request");
    let named = with(&[5, 6], Value::from(3), s("sql"));
    assert!(c.apply(st, Apply::Batch(&batch(vec![named]))));
    assert_eq!(gpu(&c, Some("sql")), 2, "named: keyed by the name");
    assert_eq!(gpu(&c, None), 0);
}
