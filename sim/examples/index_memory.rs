//! Index memory, measured: NVIDIA Dynamo's KV index (crate `dynamo-kv-router` 1.6.1) and
//! kvtier's `ClusterIndex` holding the same pages, in live heap bytes.
//!
//! Why a counting allocator and not the structures' own figures: Dynamo reports no memory
//! size, and kvtier's `memory_bytes()` is a model of its tables that the byte budget relies
//! on; the allocator is what both really cost. So this binary (and only it) wraps the system
//! allocator and counts every live byte of every thread (Dynamo's lower tiers apply events
//! on their own threads); each index is built alone, and its cost is the live bytes it added.
//!
//! How Dynamo is fed is how `sim/src/routing/dynamo.rs` feeds it: device (GPU) blocks to its
//! `RadixTree`, host (CPU) blocks to its `LowerTierIndexers`. Events are `RouterEvent`s built
//! directly (what its ZMQ normalizer produces), one per prefill: a chain of 64 blocks, or only
//! the blocks past a prefix the instance already holds (with the prefix's last block as the
//! parent), as an engine publishes them. Workloads, 8 instances, chains spread round-robin:
//! - `distinct`: 15,625 chains of 64 pages, nothing shared, all on GPU (1,000,000 entries);
//! - `shared`: 30,738 chains of 64 pages whose first 32 are one of 64 common prefixes (a
//!   system prompt), all on GPU: 1,000,000 (instance, page) entries over 985,664 pages;
//! - `tiers`: the `distinct` chains with their last 32 pages in host memory (500,000 GPU and
//!   500,000 CPU entries).
//!
//! Run: `cargo run --release -p kvtier-sim --example index_memory` (prints a markdown table,
//! at 0.9 and 1.0 times those chains: kvtier's tables are then nearly full and half full;
//! `-- --chains-scale 0.1` for one scale, here a tenth of the pages).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use dynamo_kv_router::indexer::{LowerTierIndexers, RadixTree};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, StorageTier,
};
use kvtier_events::Medium;
use kvtier_router::{Budget, ClusterIndex, IndexEvent};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

const INSTANCES: usize = 8;
const CHAIN: usize = 64;
const PREFIX: usize = 32;
const PREFIXES: u64 = 64;
const BLOCK_SIZE: u32 = 16;

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// One block: its sequence hash (the engine's block hash, kvtier's key) and its tokens' hash
/// (Dynamo's tree key).
#[derive(Clone, Copy)]
struct Block {
    hash: u64,
    tokens: u64,
}

/// Page `j` of prefix `p` or of chain `c`'s own part.
fn block(space: u64, id: u64, j: usize) -> Block {
    let tokens = mix(mix(space << 48 ^ id) ^ j as u64);
    Block {
        hash: mix(tokens ^ 0x5EED),
        tokens,
    }
}

/// One stored event: an instance, a medium, the parent's hash, the blocks.
struct Stored {
    instance: usize,
    medium: Medium,
    parent: Option<u64>,
    blocks: Vec<Block>,
}

fn workload(name: &str, scale: f64) -> Vec<Stored> {
    let mut out = Vec::new();
    match name {
        "distinct" | "tiers" => {
            let chains = (15_625.0 * scale).round() as u64;
            for c in 0..chains {
                let inst = (c % INSTANCES as u64) as usize;
                let blocks: Vec<Block> = (0..CHAIN).map(|j| block(1, c, j)).collect();
                if name == "distinct" {
                    out.push(Stored {
                        instance: inst,
                        medium: Medium::Gpu,
                        parent: None,
                        blocks,
                    });
                } else {
                    let (gpu, cpu) = blocks.split_at(CHAIN / 2);
                    out.push(Stored {
                        instance: inst,
                        medium: Medium::Gpu,
                        parent: None,
                        blocks: gpu.to_vec(),
                    });
                    out.push(Stored {
                        instance: inst,
                        medium: Medium::Cpu,
                        parent: gpu.last().map(|b| b.hash),
                        blocks: cpu.to_vec(),
                    });
                }
            }
        }
        _ => {
            let chains = (30_738.0 * scale).round() as u64;
            let mut held = vec![[false; PREFIXES as usize]; INSTANCES];
            for c in 0..chains {
                let inst = (c % INSTANCES as u64) as usize;
                let p = (c / INSTANCES as u64) % PREFIXES;
                let own = (0..CHAIN - PREFIX).map(|j| block(2, c, j));
                let prefix: Vec<Block> = (0..PREFIX).map(|j| block(3, p, j)).collect();
                let (parent, blocks) = if held[inst][p as usize] {
                    (prefix.last().map(|b| b.hash), own.collect())
                } else {
                    held[inst][p as usize] = true;
                    (None, prefix.iter().copied().chain(own).collect())
                };
                out.push(Stored {
                    instance: inst,
                    medium: Medium::Gpu,
                    parent,
                    blocks,
                });
            }
        }
    }
    out
}

fn dynamo_event(id: u64, s: &Stored) -> RouterEvent {
    let mut ev = RouterEvent::new(
        s.instance as u64,
        KvCacheEvent {
            event_id: id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: s.parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: s
                    .blocks
                    .iter()
                    .map(|b| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(b.hash),
                        tokens_hash: LocalBlockHash(b.tokens),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
            dp_rank: 0,
        },
    );
    ev.storage_tier = match s.medium {
        Medium::Gpu => StorageTier::Device,
        Medium::Cpu => StorageTier::HostPinned,
        Medium::Storage => StorageTier::Disk,
    };
    ev
}

/// Dynamo's index of `events`: its live bytes, its device tree's (worker, block) entries
/// (`current_size`), and the events it rejected.
fn dynamo(events: &[Stored]) -> (isize, usize, usize) {
    let before = live();
    let mut device = RadixTree::new();
    let lower = LowerTierIndexers::new(1, BLOCK_SIZE);
    let mut rejected = 0;
    for (id, s) in events.iter().enumerate() {
        let ev = dynamo_event(id as u64, s);
        if ev.storage_tier.is_gpu() {
            rejected += usize::from(device.apply_event(ev).is_err());
        } else {
            let tier = ev.storage_tier;
            rejected += usize::from(lower.get_or_create(tier).enqueue_event(ev).is_err());
        }
    }
    for idx in lower.all() {
        if futures::executor::block_on(idx.flush_and_wait()).is_err() {
            rejected += 1;
        }
    }
    let bytes = live() - before;
    let nodes = device.current_size();
    drop(device);
    drop(lower);
    (bytes, nodes, rejected)
}

/// kvtier's index of `events`: its live bytes, its `memory_bytes()`, its entries.
fn kvtier(events: &[Stored]) -> (isize, usize, usize) {
    let before = live();
    let mut idx = ClusterIndex::with_budget(INSTANCES, Budget::UNBOUNDED);
    for s in events {
        let e = IndexEvent::Stored {
            medium: s.medium,
            hashes: s.blocks.iter().map(|b| b.hash).collect(),
        };
        idx.apply(s.instance, &e);
    }
    (live() - before, idx.memory_bytes(), idx.pages())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn per_m(bytes: isize, entries: usize) -> f64 {
    bytes as f64 * 1e6 / entries.max(1) as f64 / 1e6
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let scales = match args.iter().position(|a| a == "--chains-scale") {
        // 1.0 puts kvtier's tables just past a doubling (half full), 0.9 just before one
        None => vec![0.9, 1.0],
        Some(i) => match args.get(i + 1).and_then(|s| s.parse::<f64>().ok()) {
            Some(s) if s > 0.0 && s.is_finite() => vec![s],
            _ => {
                eprintln!("index_memory: --chains-scale takes a positive number");
                std::process::exit(2);
            }
        },
    };
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    println!(
        "machine: {cpus} CPUs ({}), {INSTANCES} instances, chains of {CHAIN} pages",
        cpu_model()
    );
    println!();
    println!(
        "| workload | scale | entries (instance, tier, page) | Dynamo device entries | \
         Dynamo live bytes | Dynamo MB / M entries | kvtier live bytes | kvtier MB / M entries | \
         kvtier memory_bytes() | Dynamo / kvtier |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for scale in scales {
        for name in ["distinct", "shared", "tiers"] {
            let events = workload(name, scale);
            let start = live();
            let (kv_live, kv_counted, entries) = kvtier(&events);
            assert_eq!(live(), start, "kvtier's index freed everything");
            let (dy_live, nodes, rejected) = dynamo(&events);
            assert_eq!(rejected, 0, "{name}: Dynamo rejected {rejected} events");
            let leaked = live() - start;
            println!(
                "| {name} | {scale} | {entries} | {nodes} | {dy_live} | {:.1} | {kv_live} | {:.1} | \
                 {kv_counted} | {:.1}x |",
                per_m(dy_live, entries),
                per_m(kv_live, entries),
                dy_live as f64 / kv_live.max(1) as f64,
            );
            if leaked != 0 {
                eprintln!("{name}: {leaked} bytes still live after Dynamo's index was dropped");
            }
        }
    }
}
