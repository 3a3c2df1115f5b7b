//! The tiered radix prefix cache: matching, inserting and splitting.
//!
//! Why a radix tree over *page hashes*: a page's hash covers its whole prefix (see
//! [`crate::hash`]), so the child of a node that starts with hash `h` is simply "the node whose
//! first page hash is `h`". One global map from first-page hash to node replaces per-node child
//! maps; matching a prompt costs one map lookup per branch point plus one 32-byte comparison per
//! page.
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

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use slotmap::SlotMap;
use smallvec::SmallVec;

use crate::error::RadixError;
use crate::events::{KvEvent, ScopeLabel};
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

/// Identity hasher: the key is already a uniformly distributed SHA-256 prefix.
#[derive(Default)]
pub(crate) struct PrefixHasher(u64);
impl Hasher for PrefixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
    fn write(&mut self, bytes: &[u8]) {
        // Not used by PageHash (which writes one u64); fold anything else FNV-style.
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
    pub(crate) device_pool: PagePool,
    pub(crate) host_pool: PagePool,
    pub(crate) books: [TierBook; 2],
    pub(crate) locks: SlotMap<crate::lock::LockId, LockRecord>,
    /// Logical clock for LRU (deterministic, unlike wall time).
    pub(crate) tick: u64,
    pub(crate) next_seq: u64,
    /// How evictable leaves are ranked.
    pub(crate) policy: EvictionPolicy,
    /// Pages given to the device tier so far (the policies' clock).
    pub(crate) traffic: u64,
    /// The previous match's query (length, last hash), to count repeated queries once.
    pub(crate) last_query: Option<(usize, PageHash)>,
    /// Tenants with a cap on some tier, and their books.
    pub(crate) tenants: TenantBooks,
    /// Owner of the nodes the insert in progress creates.
    pub(crate) insert_owner: TenantId,
    pub(crate) record_events: bool,
    pub(crate) events: Vec<KvEvent>,
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
            device_pool: PagePool::new(TierKind::Device, cfg.device_pages),
            host_pool: PagePool::new(TierKind::Host, cfg.host_pages),
            books: [TierBook::default(), TierBook::default()],
            locks: SlotMap::with_key(),
            tick: 0,
            next_seq: 1,
            policy: EvictionPolicy::Lru,
            traffic: 0,
            last_query: None,
            tenants: TenantBooks::new(),
            insert_owner: TenantId::SHARED,
            record_events: cfg.record_events,
            events: Vec::new(),
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
        self.pool_mut(T::KIND).free_held(&raw)
    }

    /// Who owns `page` (None if out of range).
    pub fn page_state<T: Tier>(&self, page: PageId<T>) -> Option<PageState> {
        self.pool(T::KIND).state(page.index())
    }

    // ----- matching --------------------------------------------------------------------

    /// Finds the longest cached prefix of a prompt given its page hashes, on each tier.
    ///
    /// Marks the matched nodes as used (LRU); splits the last node if
    /// the prompt diverges inside it, so the returned nodes end exactly at the matched depths.
    pub fn match_prefix(&mut self, hashes: &[PageHash]) -> PrefixMatch {
        self.tick += 1;
        let mut m = PrefixMatch {
            matched_pages: 0,
            device_pages: 0,
            device_node: self.root,
            host_pages: 0,
            host_node: self.root,
        };
        let query = hashes.last().map(|h| (hashes.len(), *h));
        let repeated = query.is_some() && query == self.last_query;
        self.last_query = query;
        let mut node = self.root;
        let mut depth = 0usize;
        while depth < hashes.len() {
            let Some(child) = self.child_at(node, depth, &hashes[depth]) else {
                break;
            };
            let c = &self.nodes[child];
            let n = common_prefix(&c.hashes, &hashes[depth..]);
            let full = n == c.len();
            let child = if full { child } else { self.split(child, n) };
            let c = &mut self.nodes[child];
            if !repeated {
                c.uses = c.uses.saturating_add(1);
            }
            let (has_dev, has_host) = (c.has(TierKind::Device), c.has(TierKind::Host));
            self.touch(child);
            depth += n;
            if has_dev {
                m.device_pages = depth;
                m.device_node = child;
            }
            if has_host {
                m.host_pages = depth;
                m.host_node = child;
            }
            node = child;
            if !full {
                break;
            }
        }
        m.matched_pages = depth;
        m
    }

    /// Read-only match: `(device_pages, host_pages)` matched, without touching LRU or
    /// splitting. For routers and what-if queries.
    pub fn peek_prefix(&self, hashes: &[PageHash]) -> (usize, usize) {
        let (mut dev, mut host) = (0, 0);
        let mut node = self.root;
        let mut depth = 0usize;
        while depth < hashes.len() {
            let Some(child) = self.child_at(node, depth, &hashes[depth]) else {
                break;
            };
            let c = &self.nodes[child];
            let n = common_prefix(&c.hashes, &hashes[depth..]);
            depth += n;
            if c.has(TierKind::Device) {
                dev = depth;
            }
            if c.has(TierKind::Host) {
                host = depth;
            }
            if n < c.len() {
                break;
            }
            node = child;
        }
        (dev, host)
    }

    /// The child of `parent` starting at `depth` with first page hash `h`, if any. A map hit
    /// whose node sits elsewhere (only possible with hashes that are not a chain) is no child.
    fn child_at(&self, parent: NodeId, depth: usize, h: &PageHash) -> Option<NodeId> {
        let &id = self.index.get(h)?;
        let c = self.nodes.get(id)?;
        (c.parent == Some(parent) && c.start as usize == depth).then_some(id)
    }

    // ----- inserting -------------------------------------------------------------------

    /// Inserts a copy on tier `T` of pages `from_page .. from_page + pages.len()` of a prompt.
    ///
    /// `start` must be a node ending at depth `from_page` that has a copy on `T` (or the root),
    /// and `hashes`/`tokens` are the whole prompt's page hashes and token ids. Along the path,
    /// nodes that lack a copy on `T` receive the caller's pages; nodes that already have one
    /// report the caller's page as a duplicate. New pages past the path become a new leaf.
    ///
    /// Errors (nothing changed): unknown `start`; `start` not ending at `from_page`
    /// ([`RadixError::OffsetMismatch`]); `start` not holding a copy on `T`; `hashes[from_page-1]`
    /// not being `start`'s last hash ([`RadixError::NotAContinuation`]: the pages were computed
    /// against another prefix); too few hashes or tokens; pages not held by the caller.
    pub fn insert<T: Tier>(
        &mut self,
        start: NodeId,
        from_page: usize,
        hashes: &[PageHash],
        tokens: &[u32],
        pages: &[PageId<T>],
    ) -> Result<InsertOutcome<T>, RadixError> {
        self.insert_owner = TenantId::SHARED;
        self.insert_impl(start, from_page, hashes, tokens, pages, None)
    }

    /// [`Self::insert`] on behalf of `tenant`, who owns the nodes it creates (see
    /// [`crate::tenant`]).
    pub fn insert_for<T: Tier>(
        &mut self,
        tenant: TenantId,
        start: NodeId,
        from_page: usize,
        hashes: &[PageHash],
        tokens: &[u32],
        pages: &[PageId<T>],
    ) -> Result<InsertOutcome<T>, RadixError> {
        self.insert_owner = tenant;
        self.insert_impl(start, from_page, hashes, tokens, pages, None)
    }

    /// [`Self::insert`] for a scoped request: `owner.tenant` owns the nodes it creates (see
    /// [`crate::tenant`]); a new leaf directly below the root records `owner.label` (deeper
    /// leaves inherit their parent's), and KV events carry it.
    pub fn insert_labelled<T: Tier>(
        &mut self,
        start: NodeId,
        from_page: usize,
        hashes: &[PageHash],
        tokens: &[u32],
        pages: &[PageId<T>],
        owner: InsertOwner<'_>,
    ) -> Result<InsertOutcome<T>, RadixError> {
        self.insert_owner = owner.tenant;
        self.insert_impl(start, from_page, hashes, tokens, pages, owner.label)
    }

    /// The insert itself; the owner of new nodes is `self.insert_owner`.
    fn insert_impl<T: Tier>(
        &mut self,
        start: NodeId,
        from_page: usize,
        hashes: &[PageHash],
        tokens: &[u32],
        pages: &[PageId<T>],
        label: Option<&Arc<ScopeLabel>>,
    ) -> Result<InsertOutcome<T>, RadixError> {
        let t = T::KIND;
        let end = from_page + pages.len();
        let s = self.node(start)?;
        if s.end() != from_page {
            return Err(RadixError::OffsetMismatch {
                expected: s.end(),
                got: from_page,
            });
        }
        if !s.has(t) {
            return Err(RadixError::NotResident { tier: t });
        }
        if hashes.len() < end {
            return Err(RadixError::LengthMismatch {
                what: "page hashes",
                expected: end,
                got: hashes.len(),
            });
        }
        if tokens.len() < end * self.page_size {
            return Err(RadixError::LengthMismatch {
                what: "tokens",
                expected: end * self.page_size,
                got: tokens.len(),
            });
        }
        if from_page > 0 && s.hashes.last() != Some(&hashes[from_page - 1]) {
            return Err(RadixError::NotAContinuation {
                page: from_page - 1,
            });
        }
        let raw: Vec<u32> = pages.iter().map(|p| p.index()).collect();
        self.pool(t).check(&raw, PageState::Held)?;
        self.validate_path(start, from_page, &hashes[..end])?;

        // Validated: from here on nothing fails.
        self.tick += 1;
        let mut out = InsertOutcome {
            end_node: start,
            inserted: 0,
            duplicates: Vec::new(),
        };
        let mut node = start;
        let mut depth = from_page;
        while depth < end {
            let Some(child) = self.child_at(node, depth, &hashes[depth]) else {
                let leaf = self.new_leaf(
                    node,
                    depth,
                    &hashes[depth..end],
                    &tokens[depth * self.page_size..end * self.page_size],
                    label,
                );
                self.give_pages(leaf, t, &raw[depth - from_page..], Recency::Touch);
                out.inserted += end - depth;
                node = leaf;
                break;
            };
            let n = common_prefix(&self.nodes[child].hashes, &hashes[depth..end]);
            let child = if n < self.nodes[child].len() {
                self.split(child, n)
            } else {
                child
            };
            let mine = &raw[depth - from_page..depth - from_page + n];
            if let Some(theirs) = &self.nodes[child].slot(t).pages {
                out.duplicates.extend(
                    mine.iter()
                        .zip(theirs.iter())
                        .enumerate()
                        .map(|(i, (&a, &b))| (depth + i, PageId::new(a), PageId::new(b))),
                );
            } else {
                self.give_pages(child, t, mine, Recency::Touch);
                out.inserted += n;
            }
            self.touch(child);
            node = child;
            depth += n;
        }
        out.end_node = node;
        Ok(out)
    }

    /// Read-only walk of the path an insert would take, rejecting inconsistent hash chains
    /// before anything is mutated.
    fn validate_path(
        &self,
        start: NodeId,
        from_page: usize,
        hashes: &[PageHash],
    ) -> Result<(), RadixError> {
        let mut node = start;
        let mut depth = from_page;
        while depth < hashes.len() {
            match self.child_at(node, depth, &hashes[depth]) {
                Some(child) => {
                    let c = &self.nodes[child];
                    let n = common_prefix(&c.hashes, &hashes[depth..]);
                    depth += n;
                    node = child;
                    if n < c.len() {
                        // The rest becomes a new leaf under the split point.
                        break;
                    }
                }
                None => break,
            }
        }
        if depth < hashes.len() && self.index.contains_key(&hashes[depth]) {
            return Err(RadixError::NotAContinuation { page: depth });
        }
        Ok(())
    }

    /// Creates a leaf under `parent` (without pages: the caller gives them).
    fn new_leaf(
        &mut self,
        parent: NodeId,
        start: usize,
        hashes: &[PageHash],
        tokens: &[u32],
        label: Option<&Arc<ScopeLabel>>,
    ) -> NodeId {
        let label = if parent == self.root {
            label.cloned()
        } else {
            self.nodes[parent].label.clone()
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let leaf = self.nodes.insert(Node {
            parent: Some(parent),
            start: start as u32,
            hashes: hashes.iter().copied().collect(),
            tokens: tokens.to_vec(),
            children: 0,
            device: TierSlot::default(),
            host: TierSlot::default(),
            in_l3: false,
            last_access: self.tick,
            hit_count: 0,
            uses: 0,
            last_use: self.traffic,
            tenant: self.insert_owner,
            seq,
            label,
        });
        self.index.insert(hashes[0], leaf);
        self.nodes[parent].children += 1;
        leaf
    }

    /// Gives a node that lacks a copy on `t` the caller's (held, validated) pages.
    pub(crate) fn give_pages(&mut self, id: NodeId, t: TierKind, pages: &[u32], recency: Recency) {
        if t == TierKind::Device && recency == Recency::Touch {
            self.traffic += pages.len() as u64;
        }
        self.pool_mut(t).mark_cached(pages);
        let owner = self.nodes[id].tenant;
        self.tenant_pages(owner, t, pages.len(), 0);
        let node = &mut self.nodes[id];
        match recency {
            Recency::Touch => node.last_use = self.traffic,
            Recency::Keep => node.slot_mut(t).copied_at = (self.tick, self.traffic),
        }
        node.slot_mut(t).pages = Some(pages.iter().copied().collect());
        let parent = node.parent;
        if self.record_events {
            let parent_hash = parent.and_then(|p| self.nodes[p].hashes.last().copied());
            let hashes = self.nodes[id].hashes.to_vec();
            self.events.push(KvEvent::Stored {
                tier: t,
                parent: parent_hash,
                hashes,
                label: self.nodes[id].label.clone(),
            });
        }
        if let Some(p) = parent {
            self.nodes[p].slot_mut(t).resident_children += 1;
            self.refresh_evictable(p, t);
        }
        // The last use changed: both tiers rank the node again.
        self.refresh_evictable(id, TierKind::Device);
        self.refresh_evictable(id, TierKind::Host);
    }

    /// Splits `id` after its first `k` pages (0 < k < len). The new node holds the front part
    /// and becomes `id`'s parent; `id` keeps its end depth, its children and its lock records.
    pub(crate) fn split(&mut self, id: NodeId, k: usize) -> NodeId {
        let seq = self.next_seq;
        self.next_seq += 1;
        let ps = self.page_size;
        let n = &mut self.nodes[id];
        debug_assert!(k > 0 && k < n.len());
        // The front part keeps the node's buffers (truncated) and only the back part is copied
        // out: a prompt matching all but the last pages of a long run (the common split) costs
        // a copy of those last pages, not of the whole run plus a shift (and no fresh
        // allocation the size of the run).
        let back_hashes = SmallVec::from_slice(&n.hashes[k..]);
        n.hashes.truncate(k);
        let front_hashes = std::mem::replace(&mut n.hashes, back_hashes);
        let back_tokens = n.tokens.split_off(k * ps);
        let front_tokens = std::mem::replace(&mut n.tokens, back_tokens);
        let front_slot = |slot: &mut TierSlot| TierSlot {
            pages: slot.pages.as_mut().map(|p| {
                let back = SmallVec::from_slice(&p[k..]);
                p.truncate(k);
                std::mem::replace(p, back)
            }),
            lock: slot.lock,
            resident_children: slot.pages.is_some() as u32,
            evict_key: None,
            copied_at: slot.copied_at,
        };
        let device = front_slot(&mut n.device);
        let host = front_slot(&mut n.host);
        let front = Node {
            parent: n.parent,
            start: n.start,
            hashes: front_hashes,
            tokens: front_tokens,
            children: 1,
            device,
            host,
            in_l3: n.in_l3,
            last_access: n.last_access,
            hit_count: n.hit_count,
            uses: n.uses,
            last_use: n.last_use,
            tenant: n.tenant,
            seq,
            label: n.label.clone(),
        };
        n.start += k as u32;
        let back_first = n.hashes[0];
        let front_first = front.hashes[0];
        let fid = self.nodes.insert(front);
        self.nodes[id].parent = Some(fid);
        self.index.insert(front_first, fid);
        self.index.insert(back_first, id);
        fid
    }

    /// Marks `id` as used now.
    pub(crate) fn touch(&mut self, id: NodeId) {
        let traffic = self.traffic;
        let n = &mut self.nodes[id];
        n.last_access = self.tick;
        n.last_use = traffic;
        self.refresh_evictable(id, TierKind::Device);
        self.refresh_evictable(id, TierKind::Host);
    }

    /// Puts `id` into, or takes it out of, tier `t`'s evictable set as its state requires.
    pub(crate) fn refresh_evictable(&mut self, id: NodeId, t: TierKind) {
        let root = self.root;
        let Some(node) = self.nodes.get_mut(id) else {
            return;
        };
        let key = (self.policy.rank(node, t), node.seq, id);
        let slot = node.slot_mut(t);
        let should =
            id != root && slot.pages.is_some() && slot.lock == 0 && slot.resident_children == 0;
        let want = should.then_some(key);
        if slot.evict_key != want {
            let set = &mut self.books[t as usize].evictable;
            let old = slot.evict_key.take();
            if let Some(old) = old {
                set.remove(&old);
            }
            if let Some(k) = want {
                set.insert(k);
            }
            slot.evict_key = want;
            let owner = node.tenant;
            self.tenant_key_changed(owner, t, old, want);
        }
    }

    /// Takes the recorded router events.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }
}

/// Length of the common prefix of two runs of chained page hashes that start at the same
/// depth below the same parent.
///
/// Because each hash covers its whole prefix, equality is monotone along a run: if page `i`
/// matches, every page before it does. So the last page decides a full match in one
/// comparison, and a divergence is found by binary search — O(log n) 32-byte comparisons and
/// cache lines touched instead of O(n). (Hashes that are not a chain break this precondition
/// of the public API; they cannot describe cached KV anyway.)
fn common_prefix(a: &[PageHash], b: &[PageHash]) -> usize {
    let n = a.len().min(b.len());
    if n == 0 || a[0] != b[0] {
        return 0;
    }
    if a[n - 1] == b[n - 1] {
        return n;
    }
    // a[..lo] == b[..lo] (lo ≥ 1) and a[hi] != b[hi].
    let (mut lo, mut hi) = (1, n - 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if a[mid] == b[mid] {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}
