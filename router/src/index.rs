//! Where each page is: per instance its GPU and CPU pages, and the shared store's pages.
//!
//! Keys are vLLM's 64-bit block hashes (the low 64 bits of kvtier's page hash, what
//! `kvtier-events` sends by default; a 32-byte hash on the wire is reduced the same way), so
//! the index reads any vLLM-format stream. `STORAGE` pages from any instance go to the one
//! shared set: the L3 is shared, so a page one instance backed up is loadable by all; but
//! an instance's pages on a storage tier local to it (locality `LOCAL`: a node's disk) are
//! its own ([`IndexEvent::LocalStored`]), loadable by it alone.
//!
//! Bounded by a [`Budget`]: bytes (what the index's allocations hold, [`ClusterIndex::memory_bytes`],
//! counted as the allocator counts them, see `table.rs`) and, optionally, entries. A
//! store that would pass either is not indexed and is counted in [`ClusterIndex::dropped`]:
//! a table that has no free slot grows by doubling, so an insert is refused when that
//! doubling would pass the budget. A missing entry only makes the router price a page as
//! computed, a worse choice at worst; stale or unknown removals are ignored. Nothing an event
//! stream holds can make routing fail, and nothing it holds can make the index outgrow its
//! budget.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

use kvtier_events::Medium;
use rmpv::Value;

use crate::table::Table;

/// One decoded event, as the index needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexEvent {
    Stored {
        medium: Medium,
        hashes: Vec<u64>,
    },
    Removed {
        medium: Medium,
        hashes: Vec<u64>,
    },
    Cleared,
    /// Pages on a storage tier local to the instance (vLLM's `STORAGE` of locality
    /// `LOCAL`: a node's own disk), which no other instance loads from: priced at the
    /// shared store's bandwidth for that instance alone. Neither the instance's
    /// `AllBlocksCleared` (its device and host) nor the shared store's clears them.
    LocalStored {
        hashes: Vec<u64>,
    },
    LocalRemoved {
        hashes: Vec<u64>,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("not a KVEventBatch: {0}")]
    Shape(&'static str),
}

/// Decodes a vLLM `KVEventBatch` payload. Events of unknown type or medium are skipped
/// (newer publishers may send more); a malformed batch is an error and changes nothing.
pub fn decode_batch(payload: &[u8]) -> Result<Vec<IndexEvent>, DecodeError> {
    index_events(&batch_events(payload)?, false)
}

/// [`decode_batch`] of an instance's stream: its `STORAGE` pages of locality `LOCAL` are
/// its own ([`IndexEvent::LocalStored`]).
pub(crate) fn decode_instance_batch(payload: &[u8]) -> Result<Vec<IndexEvent>, DecodeError> {
    index_events(&batch_events(payload)?, true)
}

/// The event of `hashes` stored (or removed) on `medium`: an instance's own storage if
/// `local` ([`IndexEvent::LocalStored`]).
pub(crate) fn placed(stored: bool, medium: Medium, local: bool, hashes: Vec<u64>) -> IndexEvent {
    match (stored, local && medium == Medium::Storage) {
        (true, false) => IndexEvent::Stored { medium, hashes },
        (false, false) => IndexEvent::Removed { medium, hashes },
        (true, true) => IndexEvent::LocalStored { hashes },
        (false, true) => IndexEvent::LocalRemoved { hashes },
    }
}

/// A batch's payload decoded into msgpack values, not yet read as events: what a subscriber
/// does before it takes the cluster's lock, so that decoding, most of a batch's cost (a
/// 30 MB batch took over a second), never holds up routing.
pub struct DecodedBatch(pub(crate) Result<Vec<Value>, DecodeError>);

impl DecodedBatch {
    pub fn of(payload: &[u8]) -> Self {
        DecodedBatch(batch_events(payload))
    }
}

/// [`decode_batch`] of events decoded already; `instance`: whether they are an instance's
/// (its `LOCAL` storage is its own, [`IndexEvent::LocalStored`]), not the shared store's.
pub(crate) fn index_events(
    events: &[Value],
    instance: bool,
) -> Result<Vec<IndexEvent>, DecodeError> {
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        let e = WireMap::of(e)?;
        let local = instance && e.local_storage();
        match (e.kind(), e.medium()) {
            (Some("AllBlocksCleared"), _) => out.push(IndexEvent::Cleared),
            (Some("BlockStored"), Some(medium)) => {
                out.push(placed(true, medium, local, e.hashes()?))
            }
            (Some("BlockRemoved"), Some(medium)) => {
                out.push(placed(false, medium, local, e.hashes()?))
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The events of a `KVEventBatch` payload, undecoded.
pub(crate) fn batch_events(payload: &[u8]) -> Result<Vec<Value>, DecodeError> {
    let v = rmpv::decode::read_value(&mut &payload[..])
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let Value::Array(mut top) = v else {
        return Err(DecodeError::Shape("the batch is not an array"));
    };
    if top.len() < 2 {
        return Err(DecodeError::Shape("no events array"));
    }
    match top.swap_remove(1) {
        Value::Array(events) => Ok(events),
        _ => Err(DecodeError::Shape("no events array")),
    }
}

/// One event's map (vLLM's tagged msgspec struct).
pub(crate) struct WireMap<'a>(&'a [(Value, Value)]);

impl<'a> WireMap<'a> {
    pub(crate) fn of(e: &'a Value) -> Result<Self, DecodeError> {
        match e {
            Value::Map(m) => Ok(Self(m)),
            _ => Err(DecodeError::Shape("an event is not a map")),
        }
    }

    pub(crate) fn field(&self, k: &str) -> Option<&'a Value> {
        self.0
            .iter()
            .find(|(x, _)| x.as_str() == Some(k))
            .map(|(_, v)| v)
    }

    /// The event's class name (`"type"`).
    pub(crate) fn kind(&self) -> Option<&'a str> {
        self.field("type").and_then(Value::as_str)
    }

    /// `GPU` when absent (older vLLM), `None` for a medium this index does not know.
    pub(crate) fn medium(&self) -> Option<Medium> {
        // absent or nil: GPU (vLLM before it published media); a value that is not a
        // string is skipped, as an unknown name is
        match self.field("medium") {
            None | Some(Value::Nil) => Some(Medium::Gpu),
            Some(v) => match v.as_str()? {
                "GPU" => Some(Medium::Gpu),
                "CPU" => Some(Medium::Cpu),
                "STORAGE" => Some(Medium::Storage),
                _ => None,
            },
        }
    }

    /// Whether the event's pages are on a storage tier local to its publisher (`STORAGE`
    /// of locality `LOCAL`: vLLM's tiering on a node's own disk), not a shared store.
    pub(crate) fn local_storage(&self) -> bool {
        self.medium() == Some(Medium::Storage)
            && self.field("locality").and_then(Value::as_str) == Some("LOCAL")
    }

    pub(crate) fn hashes(&self) -> Result<Vec<u64>, DecodeError> {
        let Some(Value::Array(hs)) = self.field("block_hashes") else {
            return Err(DecodeError::Shape("block_hashes is not an array"));
        };
        hs.iter().map(hash64).collect()
    }
}

pub(crate) fn hash64(v: &Value) -> Result<u64, DecodeError> {
    if let Some(n) = v.as_u64() {
        return Ok(n);
    }
    if let Some(n) = v.as_i64() {
        return Ok(n.cast_unsigned());
    }
    match v {
        Value::Binary(b) if b.len() >= 8 => {
            let mut low = [0u8; 8];
            low.copy_from_slice(&b[b.len() - 8..]);
            Ok(u64::from_be_bytes(low))
        }
        _ => Err(DecodeError::Shape(
            "a block hash is neither an integer nor 8+ bytes",
        )),
    }
}

/// The keys are block hashes already: one multiply spreads them over the table (SipHash,
/// the default, was half the time of a routing decision).
#[derive(Default, Clone, Copy)]
pub struct PageKeyHasher(u64);

impl Hasher for PageKeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type PageSet = HashSet<u64, BuildHasherDefault<PageKeyHasher>>;

/// Where a page is held: an instance's medium (`STORAGE`: the shared set), or an
/// instance's own storage.
#[derive(Clone, Copy, Debug)]
enum Place {
    Medium(usize, Medium),
    Disk(usize),
}

/// One tier's pages and its table's allocation.
#[derive(Default, Debug)]
struct Pages {
    set: PageSet,
    table: Table,
}

impl Pages {
    fn bytes(&self) -> usize {
        self.table.bytes::<u64>()
    }

    /// Rebuilds the table smaller once removals left it empty or under an eighth of its
    /// load (to half load: no growth at the next insert): the bytes a burst took return to
    /// the budget, for every instance (they stayed allocated for good, and after one
    /// instance filled the budget and cleared, the others stayed under-indexed). The
    /// change in bytes (never more).
    fn shrink(&mut self) -> usize {
        if !self.table.oversized(self.set.len()) {
            return 0;
        }
        let before = self.bytes();
        let len = self.set.len();
        let mut set = PageSet::default();
        if len > 0 {
            set.reserve(len * 2);
            set.extend(self.set.drain());
        }
        self.set = set;
        self.table = Table::shrunk(self.set.capacity());
        before - self.bytes()
    }
}

#[derive(Default, Debug)]
struct Local {
    gpu: Pages,
    cpu: Pages,
    /// Its own storage tier's ([`IndexEvent::LocalStored`]).
    disk: Pages,
}

/// What the index may hold: bytes (its allocations, plus any [`ClusterIndex::set_shared_bytes`]
/// held by tables sharing the budget) and entries (all tiers and instances).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    pub max_bytes: usize,
    pub max_pages: usize,
}

impl Budget {
    /// No bound.
    pub const UNBOUNDED: Budget = Budget {
        max_bytes: usize::MAX,
        max_pages: usize::MAX,
    };

    /// At most `max_bytes` bytes, any number of entries.
    pub fn bytes(max_bytes: usize) -> Self {
        Budget {
            max_bytes,
            ..Self::UNBOUNDED
        }
    }

    /// At most `max_pages` entries, any number of bytes.
    pub fn pages(max_pages: usize) -> Self {
        Budget {
            max_pages,
            ..Self::UNBOUNDED
        }
    }
}

/// The cluster's page locations.
#[derive(Debug)]
pub struct ClusterIndex {
    locals: Vec<Local>,
    storage: Pages,
    budget: Budget,
    /// Bytes of other tables within the same budget.
    shared: usize,
    /// Bytes of every table (the index's, not `shared`).
    tables: usize,
    /// Entries held.
    len: usize,
    dropped: u64,
}

impl ClusterIndex {
    /// An index of at most `max_pages` entries, any number of bytes.
    pub fn new(instances: usize, max_pages: usize) -> Self {
        Self::with_budget(instances, Budget::pages(max_pages))
    }

    /// An index within `budget`. Its fixed part ([`Self::min_bytes`]) counts against the
    /// bytes: a budget below it holds no entry.
    pub fn with_budget(instances: usize, budget: Budget) -> Self {
        Self {
            locals: (0..instances).map(|_| Local::default()).collect(),
            storage: Pages::default(),
            budget,
            shared: 0,
            tables: 0,
            len: 0,
            dropped: 0,
        }
    }

    /// The bytes an empty index of `instances` instances holds: the smallest useful budget.
    pub fn min_bytes(instances: usize) -> usize {
        instances.saturating_mul(std::mem::size_of::<Local>())
    }

    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// Bytes other tables hold within this index's budget (a router's key tables): counted
    /// before any table of the index grows. Set it before applying events.
    pub fn set_shared_bytes(&mut self, bytes: usize) {
        self.shared = bytes;
    }

    pub fn instances(&self) -> usize {
        self.locals.len()
    }

    /// Entries held, all tiers and instances.
    pub fn pages(&self) -> usize {
        self.len
    }

    /// Stores not indexed because the index was full (its bytes or its entries).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Bytes the index holds on the heap, as the allocator counts them: its hash tables
    /// (slots of 8-byte keys, one control byte per slot, see `table.rs`) and its
    /// per-instance part. At most the budget's bytes less the shared bytes, once at least
    /// [`Self::min_bytes`].
    pub fn memory_bytes(&self) -> usize {
        self.fixed_bytes() + self.tables
    }

    fn fixed_bytes(&self) -> usize {
        self.locals.capacity() * std::mem::size_of::<Local>()
    }

    /// Folds one event of `instance` in; `false` if there is no such instance (ignored).
    pub fn apply(&mut self, instance: usize, e: &IndexEvent) -> bool {
        if instance >= self.locals.len() {
            return false;
        }
        self.fold(instance, e);
        true
    }

    /// [`Self::apply`] for a known instance (or any, for a `STORAGE` store or removal:
    /// those touch the shared set only).
    fn fold(&mut self, instance: usize, e: &IndexEvent) {
        match e {
            IndexEvent::Cleared => {
                let l = &mut self.locals[instance];
                self.len -= l.gpu.set.len() + l.cpu.set.len();
                l.gpu.set.clear();
                l.cpu.set.clear();
                self.tables -= l.gpu.shrink() + l.cpu.shrink();
            }
            IndexEvent::LocalStored { hashes } => self.store(Place::Disk(instance), hashes),
            IndexEvent::LocalRemoved { hashes } => self.remove(Place::Disk(instance), hashes),
            IndexEvent::Stored { medium, hashes } => {
                self.store(Place::Medium(instance, *medium), hashes)
            }
            IndexEvent::Removed { medium, hashes } => {
                self.remove(Place::Medium(instance, *medium), hashes)
            }
        }
    }

    /// Stores `hashes` at `place`, within the budget (counted dropped past it).
    fn store(&mut self, place: Place, hashes: &[u64]) {
        let Budget {
            max_bytes,
            max_pages,
        } = self.budget;
        let held = self.fixed_bytes().saturating_add(self.shared);
        let (mut len, mut tables, mut dropped) = (self.len, self.tables, self.dropped);
        let p = self.pages_mut(place);
        for &h in hashes {
            if p.set.contains(&h) {
                continue;
            }
            let grow = p.table.growth::<u64>(p.set.len(), p.set.capacity());
            if len >= max_pages || held.saturating_add(tables).saturating_add(grow) > max_bytes {
                dropped += 1;
                continue;
            }
            let before = p.bytes();
            p.set.insert(h);
            p.table.inserted(p.set.capacity());
            tables = tables - before + p.bytes();
            len += 1;
        }
        (self.len, self.tables, self.dropped) = (len, tables, dropped);
    }

    /// Removes `hashes` from `place` (those not there are ignored).
    fn remove(&mut self, place: Place, hashes: &[u64]) {
        let p = self.pages_mut(place);
        let had = p.set.len();
        for h in hashes {
            p.set.remove(h);
        }
        let (gone, freed) = (had - p.set.len(), p.shrink());
        self.len -= gone;
        self.tables -= freed;
    }

    /// Folds one event of the shared store's own stream in: whatever medium it names, its
    /// blocks are the store's (`STORAGE`); `AllBlocksCleared` forgets the store's pages and
    /// no instance's.
    pub fn apply_storage(&mut self, e: &IndexEvent) {
        let e = match e {
            IndexEvent::Cleared => return self.clear_storage(),
            IndexEvent::Stored { hashes, .. } | IndexEvent::LocalStored { hashes } => {
                IndexEvent::Stored {
                    medium: Medium::Storage,
                    hashes: hashes.clone(),
                }
            }
            IndexEvent::Removed { hashes, .. } | IndexEvent::LocalRemoved { hashes } => {
                IndexEvent::Removed {
                    medium: Medium::Storage,
                    hashes: hashes.clone(),
                }
            }
        };
        // a `STORAGE` event touches the shared set only: no instance is read
        self.fold(0, &e);
    }

    /// Forgets the shared store's pages (its stream restarted or sent a snapshot).
    pub fn clear_storage(&mut self) {
        self.len -= self.storage.set.len();
        self.storage.set.clear();
        self.tables -= self.storage.shrink();
    }

    /// The shared store's page hashes.
    pub fn storage_hashes(&self) -> Vec<u64> {
        self.storage.set.iter().copied().collect()
    }

    /// Entries per tier: `(gpu, cpu)` of each instance, and the store's.
    pub fn tier_pages(&self) -> (Vec<(usize, usize)>, usize) {
        let locals = self
            .locals
            .iter()
            .map(|l| (l.gpu.set.len(), l.cpu.set.len()));
        (locals.collect(), self.storage.set.len())
    }

    /// Every entry, sorted: `(instance, medium, hash)`, the store's under instance
    /// `usize::MAX` (for comparing two indexes).
    pub fn entries(&self) -> Vec<(usize, &'static str, u64)> {
        let mut out: Vec<_> = self
            .storage
            .set
            .iter()
            .map(|&h| (usize::MAX, "STORAGE", h))
            .collect();
        for (i, l) in self.locals.iter().enumerate() {
            out.extend(l.gpu.set.iter().map(|&h| (i, "GPU", h)));
            out.extend(l.cpu.set.iter().map(|&h| (i, "CPU", h)));
            out.extend(l.disk.set.iter().map(|&h| (i, "LOCAL", h)));
        }
        out.sort_unstable();
        out
    }

    fn pages_mut(&mut self, place: Place) -> &mut Pages {
        match place {
            Place::Medium(i, Medium::Gpu) => &mut self.locals[i].gpu,
            Place::Medium(i, Medium::Cpu) => &mut self.locals[i].cpu,
            Place::Medium(_, Medium::Storage) => &mut self.storage,
            Place::Disk(i) => &mut self.locals[i].disk,
        }
    }

    /// For each page of the prompt, whether the shared store holds it (computed once per
    /// decision, used for every instance by [`Self::prefix_with`]).
    pub fn in_storage(&self, hashes: &[u64]) -> Vec<bool> {
        hashes
            .iter()
            .map(|h| self.storage.set.contains(h))
            .collect()
    }

    /// The prompt's pages `instance` would serve from each tier, in prefix order: its GPU run,
    /// then pages in its host memory, then pages in the shared store.
    pub fn prefix(&self, instance: usize, hashes: &[u64]) -> (usize, usize, usize) {
        self.prefix_with(instance, hashes, &self.in_storage(hashes))
    }

    /// [`Self::prefix`] with the store's answer given (`in_storage`, as long as `hashes`).
    pub fn prefix_with(
        &self,
        instance: usize,
        hashes: &[u64],
        in_storage: &[bool],
    ) -> (usize, usize, usize) {
        let Some(l) = self.locals.get(instance) else {
            return (0, 0, 0);
        };
        let gpu = hashes.iter().take_while(|h| l.gpu.set.contains(h)).count();
        let host = hashes[gpu..]
            .iter()
            .take_while(|h| l.cpu.set.contains(h))
            .count();
        // the shared store's pages, and the instance's own storage's
        let l3 = in_storage
            .get(gpu + host..)
            .unwrap_or_default()
            .iter()
            .zip(&hashes[gpu + host..])
            .take_while(|&(&s, h)| s || l.disk.set.contains(h))
            .count();
        (gpu, host, l3)
    }
}
