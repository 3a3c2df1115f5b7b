//! kvtier-l3: the L3 tier of kvtier — a Mooncake-Store-compatible KV store with DRAM and SSD
//! tiers, embedded in the caller's process by default, or served over tarpc.
//!
//! Why: the scheduler and the simulator need L3 semantics (two-phase puts, leases, eviction,
//! SSD offload, promotion, Mooncake's error codes) in-process and fast; a deployment that
//! outgrows one process runs the same store behind the `kvtier-l3` binary — in one process
//! (`--role both`) or split into a metadata-only master and store nodes holding the bytes
//! ([`cluster`]). Every form implements [`L3Store`]. Start with [`EmbeddedStore::new`] and [`StoreConfig`]; see docs/l3.md.

// A lock guard in an `if let`/`match` scrutinee lives through the whole block; re-locking
// the same (non-reentrant) mutex inside deadlocked the store once. Bind results first.
#![deny(clippy::significant_drop_in_scrutinee)]

pub mod api;
mod batch_order;
pub mod buffers;
pub mod cli;
mod cli_roles;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod dirlock;
pub mod error;
pub mod eviction;
pub mod ha;
pub mod kv_events;
pub mod master;
pub mod metrics;
pub mod pattern;
pub mod promotion;
pub mod rpc;
pub mod segment;
pub mod ssd;
pub mod store;
pub mod types;

pub use api::{BatchResult, L3Store};
pub use clock::Clock;
pub use cluster::{ClusterMaster, NodeOptions, StoreNode};
pub use config::{OffloadMode, PromotionConfig, SsdConfig, StoreConfig};
pub use error::{ErrorCode, L3Error, L3Result};
pub use kv_events::{KvEventsConfig, KvEventsError, StorageEvents};
pub use master::{LossCursor, Losses};
pub use pattern::KeyPattern;
pub use rpc::client::{ClientOptions, DataPath, RemoteStore};
pub use rpc::server::{
    ClusterMasterHandle, ServerHandle, ServerOptions, spawn_cluster_master, spawn_server,
};
pub use rpc::shm::{SHM_ENV, SharedRegion, ShmMode};
pub use segment::{Footprint, charge};
pub use store::EmbeddedStore;
pub use types::{
    Blob, ClientId, ClientStatus, ExistOptions, NameError, NameKind, NodeRef, PutHandle,
    PutOptions, QueryResult, ReplicaDescriptor, ReplicateConfig, SegmentId, StoreStats, Tenant,
};

/// The code in docs/l3.md, compiled and run as a doctest (`cargo test -p kvtier-l3 --doc`,
/// part of `scripts/test-all`), so the page cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../../docs/l3.md")]
pub struct DocsL3;

/// The code in docs/l3/ha.md (a failover in one process), a doctest as [`DocsL3`] is.
#[cfg(doctest)]
#[doc = include_str!("../../docs/l3/ha.md")]
pub struct DocsL3Ha;

/// The code in docs/l3/kv-events.md, a doctest as [`DocsL3`] is.
#[cfg(doctest)]
#[doc = include_str!("../../docs/l3/kv-events.md")]
pub struct DocsL3KvEvents;
