//! The store's residency as KV cache events (medium `STORAGE`), for KV-aware routers.
//!
//! Why the store publishes, not the engines: an engine knows what *it* put, not what the
//! store still holds. Pages reach the store over RPC, the transfer channel and shared memory,
//! from every engine; they leave it by removal, eviction (when no copy is left), a node's
//! death or a put that replaced them. Only the master sees all of that, in order, so the
//! master is the one place a router can learn "this page is in the shared store" from. With
//! etcd HA only the leader has a master (standbys build none until elected), so only the
//! serving leader publishes; a new leader starts a new stream (numbered from 0, its first
//! batch `AllBlocksCleared`), which a subscriber takes for a restarted publisher and
//! resyncs from with a snapshot.
//!
//! What is published (vLLM's wire format, [`kvtier_events`]):
//! - `BlockStored` (medium `STORAGE`, locality `LOCAL`, no parent, no tokens) when an object
//!   becomes readable: its put ended (every replica), or a node's rescan or remount brought
//!   it back;
//! - `BlockRemoved` (medium `STORAGE`) when it stops existing: removed, evicted with no copy
//!   left, lost with a node, replaced, revoked — exactly the keys the loss journal names;
//! - `AllBlocksCleared` as the first event of a stream (a new store or leader: whatever a
//!   subscriber held from an earlier incarnation is gone).
//!
//! Keys → block hashes (`keys.rs`): an event carries a page hash, the store holds string
//! keys. A key of kvtier's grammar `{namespace}:{64 hex digits}:{rank}` (what the scheduler
//! and the SGLang integration write) is published as its page hash, and a key of kvtier's
//! vLLM integration, `{namespace}:{72 hex digits}[:{shard}]` (vLLM's `OffloadKey`), as the
//! block hash vLLM publishes for that chunk; any other key is skipped and counted, never an
//! error for the put. The tensor-parallel ranks (and vLLM's KV groups) of one page are one
//! block: stored when the first object becomes readable, removed when the last one goes (a
//! per-page list of holders, `(tenant, namespace, part)`) — or, with
//! [`KvEventsConfig::parts_per_page`] N (the engines' ranks × KV groups), stored once N parts
//! are readable under one tenant and namespace and removed when none keeps N: an engine
//! loads a page only with every rank's part, so a page the store holds partly (one rank's
//! object evicted) is not credited to it. A router indexes `STORAGE` pages in one shared set, so
//! [`KvEventsConfig::namespaces`] restricts a stream to the namespaces (models and layouts)
//! of the engines behind that router; without it, every namespace's pages are one set.
//!
//! How: the master calls [`StorageEvents::readable`] / [`StorageEvents::gone`] under its
//! lock (a hash-map update, no I/O); a thread publishes what accumulated every
//! `flush_interval` as one batch through [`kvtier_events::Publisher`], whose mirror answers
//! snapshot requests on the replay socket.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::types::Tenant;
use kvtier_events::{HashFormat, Locality, Medium, Publisher, PublisherConfig, WireEvent};
use kvtier_radix::PageHash;

mod config;
mod keys;
mod metrics;

pub use config::{
    BlockHashes, Delivery, KvEventsConfig, KvEventsError, check_endpoint, validate_streams,
};
pub use metrics::render_metrics;

/// What the stream did (`/metrics`: `kvtier_l3_kv_events_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvEventsStats {
    /// Batches published.
    pub batches: u64,
    /// Pages published as stored.
    pub stored: u64,
    /// Pages published as removed.
    pub removed: u64,
    /// Readable keys not published: not of kvtier's key grammar.
    pub unparsed_keys: u64,
    /// Readable keys not published: of a namespace the stream does not carry.
    pub other_namespace_keys: u64,
    /// Batches the publisher refused (encoding; never expected).
    pub failed_batches: u64,
    /// Pages resident now (as published).
    pub resident_pages: u64,
}

#[derive(Debug, Clone, Copy)]
enum Change {
    Stored(PageHash),
    Removed(PageHash),
    Cleared,
}

/// One object of a page: which (tenant, namespace) holds it, and which part (hashes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    scope: u64,
    part: u64,
}

/// Whether some (tenant, namespace) holds at least `n` parts of a page (its holders are
/// distinct; a page has a few: ranks × KV groups × tenants).
fn complete(holders: &[Holder], n: u32) -> bool {
    let n = n as usize;
    holders
        .iter()
        .any(|h| holders.iter().filter(|o| o.scope == h.scope).count() >= n)
}

#[derive(Debug, Default)]
struct State {
    /// Per page with a readable object, who holds it.
    holders: HashMap<PageHash, Vec<Holder>>,
    /// Pages resident as published: complete ([`complete`]).
    resident: u64,
    /// Changes not yet published; only kept once the sockets are bound (before, the first
    /// batch is made from `holders`).
    out: Vec<Change>,
    bound: bool,
    stats: KvEventsStats,
    stop: bool,
}

impl State {
    fn count_published(&mut self, changes: &[Change]) {
        self.stats.batches += 1;
        for c in changes {
            match c {
                Change::Stored(_) => self.stats.stored += 1,
                Change::Removed(_) => self.stats.removed += 1,
                Change::Cleared => {}
            }
        }
    }
}

/// The sockets' addresses: configured until bound, then as bound (a `*` port filled in).
#[derive(Debug, Clone)]
struct Endpoints {
    events: String,
    replay: Option<String>,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    /// The publisher once bound. Held while a batch is taken and published, so batches
    /// leave in the order taken.
    publisher: Mutex<Option<Publisher>>,
    endpoints: Mutex<Endpoints>,
    cfg: KvEventsConfig,
}

/// When the sockets are bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    /// Now: an address that cannot be bound is the caller's error (a single master).
    AtStart,
    /// Now if possible, else retried every `flush_interval × 50` (at least 100 ms) until it
    /// is: an etcd HA leader, whose deposed predecessor may still hold the address (paused,
    /// not yet restarted) — a leader must serve meanwhile. Changes are kept in the page
    /// index; the first batch, once bound, holds them all.
    Retry,
}

/// The store's event publisher; dropping it publishes what is pending and closes the sockets.
pub struct StorageEvents {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StorageEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageEvents")
            .field("endpoints", &*self.shared.endpoints())
            .finish_non_exhaustive()
    }
}

/// Whether a key became readable or stopped existing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    Readable,
    Gone,
}

impl StorageEvents {
    /// Binds the sockets (see [`Binding`]) and starts the publishing thread; the stream's
    /// first batch starts with `AllBlocksCleared`.
    pub fn start(cfg: &KvEventsConfig, binding: Binding) -> Result<Self, KvEventsError> {
        cfg.validate()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            publisher: Mutex::new(None),
            endpoints: Mutex::new(Endpoints {
                events: cfg.endpoint.clone(),
                replay: cfg.replay_endpoint.clone(),
            }),
            cfg: cfg.clone(),
        });
        if cfg.delivery == Delivery::Pull {
            let mut st = shared.lock();
            st.bound = true;
            st.out.push(Change::Cleared);
            drop(st);
            return Ok(Self {
                shared,
                thread: None,
            });
        }
        match shared.try_bind() {
            Ok(()) => {}
            Err(e) if binding == Binding::AtStart => return Err(e),
            Err(e) => tracing::warn!(error = %e, "kv events: not bound yet, retrying"),
        }
        let s = Arc::clone(&shared);
        let every = cfg.flush_interval;
        let retry_every = (every * 50).max(Duration::from_millis(100));
        let thread = std::thread::Builder::new()
            .name("kvtier-l3-kv-events".into())
            .spawn(move || {
                let mut last_try = std::time::Instant::now();
                while !s.wait(every) {
                    if !s.lock().bound && last_try.elapsed() >= retry_every {
                        last_try = std::time::Instant::now();
                        if let Err(e) = s.try_bind() {
                            tracing::debug!(error = %e, "kv events: still not bound");
                        }
                    }
                    s.flush();
                }
            })
            .map_err(|e| KvEventsError::Bind(format!("cannot start the publishing thread: {e}")))?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// `key` of `t` became readable, or stopped existing.
    pub fn note(&self, r: Residency, t: &Tenant, key: &str) {
        let Some(k) = keys::stream_key(key) else {
            if r == Residency::Readable {
                self.shared.lock().stats.unparsed_keys += 1;
            }
            return;
        };
        let ns = &self.shared.cfg.namespaces;
        if !ns.is_empty() && !ns.iter().any(|n| n == k.namespace) {
            if r == Residency::Readable {
                self.shared.lock().stats.other_namespace_keys += 1;
            }
            return;
        }
        let mut h = std::hash::DefaultHasher::new();
        (t.as_str(), k.namespace).hash(&mut h);
        let holder = Holder {
            scope: h.finish(),
            part: k.part,
        };
        let n = self.shared.cfg.parts_per_page;
        let mut st = self.shared.lock();
        let State {
            holders,
            resident,
            out,
            bound,
            ..
        } = &mut *st;
        match r {
            Residency::Readable => {
                let hs = holders.entry(k.page).or_default();
                if !hs.contains(&holder) {
                    let was = complete(hs, n);
                    hs.push(holder);
                    if !was && complete(hs, n) {
                        *resident += 1;
                        if *bound {
                            out.push(Change::Stored(k.page));
                        }
                    }
                }
            }
            Residency::Gone => {
                if let Some(hs) = holders.get_mut(&k.page)
                    && let Some(i) = hs.iter().position(|x| *x == holder)
                {
                    let was = complete(hs, n);
                    hs.swap_remove(i);
                    if was && !complete(hs, n) {
                        *resident -= 1;
                        if *bound {
                            out.push(Change::Removed(k.page));
                        }
                    }
                    if hs.is_empty() {
                        holders.remove(&k.page);
                    }
                }
            }
        }
    }

    /// A handle for the store's owner (endpoints, flush, counters), usable without the
    /// master's lock.
    pub fn handle(&self) -> KvEventsHandle {
        KvEventsHandle {
            shared: Arc::clone(&self.shared),
        }
    }
}

/// The store's view of its event stream ([`StorageEvents::handle`]).
#[derive(Clone)]
pub struct KvEventsHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for KvEventsHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventsHandle")
            .field("endpoints", &*self.shared.endpoints())
            .finish_non_exhaustive()
    }
}

impl KvEventsHandle {
    /// The PUB socket's address: as bound (a `*` port filled in), or as configured while
    /// not bound yet ([`Binding::Retry`]).
    pub fn endpoint(&self) -> String {
        self.shared.endpoints().events.clone()
    }

    /// The replay socket's address (as [`KvEventsHandle::endpoint`]).
    pub fn replay_endpoint(&self) -> Option<String> {
        self.shared.endpoints().replay.clone()
    }

    /// Whether the sockets are bound.
    pub fn bound(&self) -> bool {
        self.shared.lock().bound
    }

    /// Publishes what is pending now (the thread does it every `flush_interval`).
    pub fn flush(&self) {
        self.shared.flush();
    }

    /// [`Delivery::Pull`]: the changes since the last call, as one batch's events (empty
    /// when nothing changed; the first batch starts with `AllBlocksCleared`). Counted in
    /// [`KvEventsHandle::stats`] as a published batch.
    pub fn take_batch(&self) -> Result<Vec<WireEvent>, KvEventsError> {
        if self.shared.cfg.delivery != Delivery::Pull {
            return Err(KvEventsError::NotPull);
        }
        let mut st = self.shared.lock();
        let changes = std::mem::take(&mut st.out);
        if !changes.is_empty() {
            st.count_published(&changes);
        }
        drop(st);
        Ok(self.shared.wire(&changes))
    }

    pub fn stats(&self) -> KvEventsStats {
        let st = self.shared.lock();
        KvEventsStats {
            resident_pages: st.resident,
            ..st.stats
        }
    }

    /// The topic frame this stream publishes ([`KvEventsConfig::wire_topic`]).
    pub fn topic(&self) -> String {
        self.shared.cfg.wire_topic()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn endpoints(&self) -> MutexGuard<'_, Endpoints> {
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Binds the sockets; the stream then starts with `AllBlocksCleared` and every page
    /// resident now.
    fn try_bind(&self) -> Result<(), KvEventsError> {
        let mut slot = self
            .publisher
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() {
            return Ok(());
        }
        let cfg = &self.cfg;
        let p = Publisher::bind(PublisherConfig {
            endpoint: cfg.endpoint.clone(),
            replay_endpoint: cfg.replay_endpoint.clone(),
            topic: cfg.wire_topic(),
            buffer_steps: cfg.buffer_steps,
            block_size: cfg.block_size,
            hash_format: match cfg.block_hashes {
                BlockHashes::Int64 => HashFormat::Int64,
                BlockHashes::Bytes => HashFormat::Bytes,
            },
            ..PublisherConfig::default()
        })
        .map_err(|e| KvEventsError::Bind(e.to_string()))?;
        *self.endpoints() = Endpoints {
            events: p.endpoint().to_string(),
            replay: p.replay_endpoint().map(str::to_string),
        };
        *slot = Some(p);
        let mut st = self.lock();
        st.bound = true;
        let n = cfg.parts_per_page;
        let first = std::iter::once(Change::Cleared).chain(
            st.holders
                .iter()
                .filter(|(_, hs)| complete(hs, n))
                .map(|(p, _)| Change::Stored(*p)),
        );
        st.out = first.collect();
        Ok(())
    }

    /// Waits up to `d`; true once stopped.
    fn wait(&self, d: Duration) -> bool {
        let st = self.lock();
        if st.stop {
            return true;
        }
        let (st, _) = self
            .wake
            .wait_timeout(st, d)
            .unwrap_or_else(PoisonError::into_inner);
        st.stop
    }

    fn flush(&self) {
        let publisher = self
            .publisher
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(p) = publisher.as_ref() else {
            return;
        };
        let changes = std::mem::take(&mut self.lock().out);
        if changes.is_empty() {
            return;
        }
        let events = self.wire(&changes);
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let published = p.publish(ts, &events);
        let mut st = self.lock();
        match published {
            Ok(_) => st.count_published(&changes),
            Err(e) => {
                st.stats.failed_batches += 1;
                tracing::warn!(error = %e, "kv events: a batch was not published");
            }
        }
    }

    /// One `BlockStored` per page (the store knows no chain: no parent, no tokens), one
    /// `BlockRemoved` per run of removals.
    fn wire(&self, changes: &[Change]) -> Vec<WireEvent> {
        let mut out: Vec<WireEvent> = Vec::with_capacity(changes.len());
        for c in changes {
            match *c {
                Change::Cleared => out.push(WireEvent::AllBlocksCleared),
                Change::Stored(h) => out.push(WireEvent::BlockStored {
                    block_hashes: vec![h],
                    parent_block_hash: None,
                    token_ids: Vec::new(),
                    block_size: self.cfg.block_size,
                    medium: Medium::Storage,
                    lora_name: None,
                    locality: Some(Locality::Local),
                }),
                Change::Removed(h) => {
                    if let Some(WireEvent::BlockRemoved { block_hashes, .. }) = out.last_mut() {
                        block_hashes.push(h);
                    } else {
                        out.push(WireEvent::BlockRemoved {
                            block_hashes: vec![h],
                            medium: Medium::Storage,
                            locality: Some(Locality::Local),
                        });
                    }
                }
            }
        }
        out
    }
}

impl Drop for StorageEvents {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("kv events: the publishing thread panicked");
        }
        // what the master changed last still goes out before the sockets close
        self.shared.flush();
        // the handles may outlive the store: the sockets close with it
        let publisher = self
            .shared
            .publisher
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(publisher);
    }
}
