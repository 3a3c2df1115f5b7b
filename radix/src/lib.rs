//! # kvtier-radix — the tiered radix prefix cache
//!
//! An LLM engine recomputes the KV of every prompt token it cannot find cached. This crate
//! remembers, for every page of every cached prefix, whether a copy is on the **device** (GPU),
//! on the **host** (pinned DRAM), and whether it is known to be in **L3**, so the scheduler can
//! reuse device pages, load host pages back, and prefetch from L3.
//!
//! - [`hash`]: SGLang-compatible chained SHA-256 page hashes and namespaced L3 keys;
//! - [`RadixCache`]: match / insert / split over page runs in a `slotmap` arena;
//! - per-tier typed page pools ([`PageId<Device>`] vs [`PageId<Host>`]);
//! - locks through [`LockHandle`]s that must be given back;
//! - leaf-first eviction per tier in O(log n), deterministic across tensor-parallel ranks, by
//!   LRU or a frequency- and depth-aware [`EvictionPolicy`];
//! - [`KvEvent`]s for KV-aware routers.
//!
//! Every fallible method validates before it mutates: on `Err`, nothing changed.

mod adaptive;
mod audit;
mod cache;
mod copies;
mod error;
mod events;
mod evict;
pub mod hash;
mod lock;
mod memory;
mod node;
mod policy;
mod pool;
mod protect;
mod query;
pub mod shadow;
pub mod tenant;
mod tier;

pub use adaptive::{AdaptiveSnapshot, LEVELS as ADAPTIVE_LEVELS, LearntAdmission};
pub use cache::{InsertOutcome, InsertOwner, PrefixMatch, RadixCache, RadixConfig, TierUsage};
pub use error::{RadixError, Refused};
pub use events::{KvEvent, ScopeLabel};
pub use evict::{EvictOutcome, EvictedNode};
pub use hash::{
    ExtraKey, HashScope, KeyNamespace, L3KeyBuilder, PageHash, ParsedKey, extend_hashes,
    page_hashes, parse_l3_key,
};
pub use lock::{LockHandle, LockId};
pub use node::NodeId;
pub use policy::EvictionPolicy;
pub use pool::PageState;
pub use protect::Protection;
pub use shadow::{Candidate, ShadowConfig, ShadowConfigError, ShadowSnapshot};
pub use tenant::TenantId;
pub use tier::{Device, DevicePageId, Host, HostPageId, PageId, Tier, TierKind};
