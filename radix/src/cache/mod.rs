//! The tiered radix prefix cache: matching, inserting and splitting.
//!
//! Why a radix tree over *page hashes*: a page's hash covers its whole prefix (see
//! [`crate::hash`]), so the child of a node that starts with hash `h` is simply "the node whose
//! first page hash is `h`". One global map from first-page hash to node replaces per-node child
//! maps; matching a prompt costs one map lookup per branch point plus one 32-byte comparison per
//! page.
//!
//!
//! Invariants kept here (checked by [`RadixCache::check_invariants`] and the property tests):
//! - **prefix-closed residency**: if a node has a copy on a tier, so does its parent (or the
//!   parent is the root);
//! - **every non-root node has at least one copy** (a node losing its last copy is removed);
//! - **locks propagate to the root**: a tier's `lock` count on a node is the number of live locks
//!   held on it or on a descendant, so a locked node and all its ancestors are never evicted;
//! - **ownership**: every cached page id belongs to exactly one node, and the pool marks it
//!   `Cached`; pages held by callers are `Held`; `free + held + cached == capacity`;
//! - **no partial mutation**: every fallible public method validates first, then mutates.
//!
//! This file holds the configuration and result types, the cache's state, its construction
//! and the pages held by callers; the rest:
//! - `matching`: matching a prompt's page hashes against the tree,
//! - `insert`: inserting a prompt's pages on one tier (validate, then mutate),
//! - `tree`: splitting nodes, giving nodes pages, and keeping recency and the evictable sets
//!   current.
//!
//! Read queries, locks, eviction, copies between tiers, tenants and the invariant audit live in
//! sibling modules of the crate, as further `impl RadixCache` blocks.

mod insert;
mod matching;
mod tree;

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use slotmap::SlotMap;
use smallvec::SmallVec;

use crate::error::RadixError;
use crate::events::ScopeLabel;
use crate::hash::PageHash;
use crate::lock::LockRecord;
use crate::node::{EvictKey, Node, NodeId, TierSlot};
use crate::policy::EvictionPolicy;
use crate::pool::{PagePool, PageState};
use crate::tenant::{TenantBooks, TenantId};
use crate::tier::{PageId, Tier, TierKind};

/// Sizing of a cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RadixConfig {
    /// Tokens per page (> 0).
    pub page_size: usize,
    pub device_pages: u32,
    pub host_pages: u32,
    /// Record [`KvEvent`]s for an external router (drained with [`RadixCache::drain_events`]).
    pub record_events: bool,
}

/// Result of [`RadixCache::match_prefix`].
///
/// Pages `0..device_pages` are on device; pages `device_pages..host_pages` (if any) are on host
/// only and need a load-back before a forward can read them. `matched_pages` is
/// `max(device_pages, host_pages)`. The nodes are the deepest matched node on each tier, whose
/// end depth equals the matched length (the match splits a node if it ends inside one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    pub matched_pages: usize,
    pub device_pages: usize,
    pub device_node: NodeId,
    pub host_pages: usize,
    pub host_node: NodeId,
}

/// Who an insert is for: the tenant that owns the nodes it creates and the scope label
/// recorded on them.
#[derive(Clone, Copy, Debug, Default)]
pub struct InsertOwner<'a> {
    pub tenant: crate::tenant::TenantId,
    pub label: Option<&'a Arc<ScopeLabel>>,
}

/// Result of [`RadixCache::insert`].
#[derive(Debug, PartialEq, Eq)]
pub struct InsertOutcome<T: Tier> {
    /// Node whose end depth is `from_page + pages.len()`.
    pub end_node: NodeId,
    /// Pages the tree took ownership of.
    pub inserted: usize,
    /// The caller's pages that duplicated copies the tree already had, as
    /// `(page index in the prompt, caller's page, tree's page)`. They stay held by the caller,
    /// who should switch to the tree's page and free its own.
    pub duplicates: Vec<(usize, PageId<T>, PageId<T>)>,
}

/// Occupancy of one tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierUsage {
    pub capacity: usize,
    pub free: usize,
    /// Allocated to callers (running requests, in-flight copies), not in the tree.
    pub held: usize,
    /// Owned by the tree.
    pub cached: usize,
    /// Cached pages under a lock.
    pub locked: usize,
}

impl TierUsage {
    /// Pages an allocation can obtain: free now plus cached-and-unlocked (evictable).
    pub fn obtainable(&self) -> usize {
        self.free + self.cached - self.locked
    }
}

/// The cache's maps' hasher: a `u64` key as it is (already uniform), a [`PageHash`] its four
/// words folded.
#[derive(Default)]
pub(crate) struct PrefixHasher(u64);
impl Hasher for PrefixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    /// A `u64` key as it is; a [`PageHash`]'s four words folded (each word rotated in), so
    /// hashes differing anywhere hash apart.
    fn write_u64(&mut self, v: u64) {
        self.0 = self.0.rotate_left(23) ^ v;
    }
    fn write(&mut self, bytes: &[u8]) {
        // Not used by PageHash (which writes u64 words); fold anything else FNV-style.
        for b in bytes {
            self.0 = (self.0 ^ *b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
}

/// Per-tier bookkeeping beside the pool.
#[derive(Debug, Default)]
pub(crate) struct TierBook {
    /// Nodes with a copy on this tier, no lock, and no child with a copy on this tier.
    pub evictable: BTreeSet<EvictKey>,
    /// Cached pages of this tier in nodes with `lock > 0`.
    pub locked_pages: usize,
}

static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

/// Whether giving a node pages counts as a use of it (for eviction order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recency {
    /// The pages were just computed or loaded for a request: the node is fresh.
    Touch,
    /// A copy of pages the node already has elsewhere: its rank stays as it was.
    Keep,
}

/// The tiered radix prefix cache. See the module docs for its invariants.
pub struct RadixCache {
    pub(crate) id: u64,
    pub(crate) page_size: usize,
    pub(crate) nodes: SlotMap<NodeId, Node>,
    pub(crate) root: NodeId,
    /// First page hash of every non-root node → the node.
    pub(crate) index: HashMap<PageHash, NodeId, BuildHasherDefault<PrefixHasher>>,
    /// Page hash → waiting prompts containing it (`protect.rs`).
    pub(crate) protected: HashMap<PageHash, u32, BuildHasherDefault<PrefixHasher>>,
    pub(crate) device_pool: PagePool,
    pub(crate) host_pool: PagePool,
    pub(crate) books: [TierBook; 2],
    pub(crate) locks: SlotMap<crate::lock::LockId, LockRecord>,
    /// Logical clock for LRU (deterministic, unlike wall time).
    pub(crate) tick: u64,
    pub(crate) next_seq: u64,
    /// The configured eviction policy.
    pub(crate) policy: EvictionPolicy,
    /// The policy leaves are ranked by now: `policy`, or the adaptive policy's current level.
    pub(crate) ranking: EvictionPolicy,
    /// The adaptive policy's learnt state (`Some` iff `policy` is `Adaptive`).
    pub(crate) adaptive: Option<crate::adaptive::AdaptiveState>,
    /// The shadow selector (`Some` iff `policy` is `Shadow`).
    pub(crate) shadow: Option<Box<crate::shadow::ShadowSelector>>,
    /// The constants a `Shadow` policy starts with.
    pub(crate) shadow_config: crate::shadow::ShadowConfig,
    /// Pages given to the device tier so far (the policies' clock).
    pub(crate) traffic: u64,
    /// The previous match's query (length, last hash), to count repeated queries once.
    pub(crate) last_query: Option<(usize, PageHash)>,
    /// Tenants with a cap on some tier, and their books.
    pub(crate) tenants: TenantBooks,
    /// Held pages allocated on behalf of a capped tenant, per tier (`[device, host]`): they
    /// count against its cap until freed or given to the tree.
    pub(crate) held_for: [std::collections::HashMap<u32, TenantId>; 2],
    /// Owner of the nodes the insert in progress creates.
    pub(crate) insert_owner: TenantId,
    pub(crate) record_events: bool,
    pub(crate) events: crate::events::EventLog,
    /// Uses of pages that left the cache (`memory.rs`); `None` when off.
    pub(crate) memory: Option<crate::memory::UseMemory>,
}

impl std::fmt::Debug for RadixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RadixCache")
            .field("page_size", &self.page_size)
            .field("nodes", &self.nodes.len())
            .field("device", &self.usage(TierKind::Device))
            .field("host", &self.usage(TierKind::Host))
            .field("locks", &self.locks.len())
            .finish()
    }
}

impl RadixCache {
    pub fn new(cfg: RadixConfig) -> Result<Self, RadixError> {
        if cfg.page_size == 0 {
            return Err(RadixError::ZeroPageSize);
        }
        let mut nodes = SlotMap::with_key();
        let root = nodes.insert(Node {
            parent: None,
            start: 0,
            hashes: SmallVec::new(),
            tokens: Vec::new(),
            children: 0,
            device: TierSlot {
                pages: Some(SmallVec::new()),
                ..TierSlot::default()
            },
            host: TierSlot {
                pages: Some(SmallVec::new()),
                ..TierSlot::default()
            },
            in_l3: true,
            last_access: 0,
            hit_count: 0,
            uses: 0,
            last_use: 0,
            tenant: TenantId::SHARED,
            seq: 0,
            label: None,
        });
        Ok(RadixCache {
            id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
            page_size: cfg.page_size,
            nodes,
            root,
            index: HashMap::default(),
            protected: HashMap::default(),
            device_pool: PagePool::new(TierKind::Device, cfg.device_pages),
            host_pool: PagePool::new(TierKind::Host, cfg.host_pages),
            books: [TierBook::default(), TierBook::default()],
            locks: SlotMap::with_key(),
            tick: 0,
            next_seq: 1,
            policy: EvictionPolicy::Lru,
            ranking: EvictionPolicy::Lru,
            adaptive: None,
            shadow: None,
            shadow_config: crate::shadow::ShadowConfig::default(),
            traffic: 0,
            last_query: None,
            tenants: TenantBooks::new(),
            memory: None,
            held_for: Default::default(),
            insert_owner: TenantId::SHARED,
            record_events: cfg.record_events,
            events: Default::default(),
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn root(&self) -> NodeId {
        self.root
    }
    /// Number of nodes, the root included.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub(crate) fn pool(&self, t: TierKind) -> &PagePool {
        match t {
            TierKind::Device => &self.device_pool,
            TierKind::Host => &self.host_pool,
        }
    }
    pub(crate) fn pool_mut(&mut self, t: TierKind) -> &mut PagePool {
        match t {
            TierKind::Device => &mut self.device_pool,
            TierKind::Host => &mut self.host_pool,
        }
    }

    pub fn usage(&self, t: TierKind) -> TierUsage {
        let p = self.pool(t);
        TierUsage {
            capacity: p.capacity(),
            free: p.free_count(),
            held: p.held_count(),
            cached: p.cached_count(),
            locked: self.books[t as usize].locked_pages,
        }
    }

    pub(crate) fn node(&self, id: NodeId) -> Result<&Node, RadixError> {
        self.nodes.get(id).ok_or(RadixError::UnknownNode)
    }

    // ----- pages held by callers -------------------------------------------------------

    /// Allocates `n` pages from the free list only (no eviction).
    pub fn alloc<T: Tier>(&mut self, n: usize) -> Result<Vec<PageId<T>>, RadixError> {
        Ok(self
            .pool_mut(T::KIND)
            .alloc(n)?
            .into_iter()
            .map(PageId::new)
            .collect())
    }

    /// Allocates `n` pages, evicting least-recently-used unlocked cached pages if the free list
    /// is short. Fails without evicting anything if `n` pages cannot be obtained.
    pub fn alloc_evicting<T: Tier>(&mut self, n: usize) -> Result<Vec<PageId<T>>, RadixError> {
        let u = self.usage(T::KIND);
        if n > u.obtainable() {
            return Err(RadixError::PoolExhausted {
                tier: T::KIND,
                requested: n,
                available: u.obtainable(),
            });
        }
        if n > u.free {
            self.evict::<T>(n - u.free);
        }
        self.alloc::<T>(n)
    }

    /// Returns pages held by the caller to the pool (all-or-nothing).
    pub fn free<T: Tier>(&mut self, pages: &[PageId<T>]) -> Result<(), RadixError> {
        let raw: Vec<u32> = pages.iter().map(|p| p.index()).collect();
        self.pool_mut(T::KIND).free_held(&raw)?;
        self.untag_held(T::KIND, &raw);
        Ok(())
    }

    /// Who owns `page` (None if out of range).
    pub fn page_state<T: Tier>(&self, page: PageId<T>) -> Option<PageState> {
        self.pool(T::KIND).state(page.index())
    }
}
