//! The offloading-manager mode: kvtier's radix tree deciding an engine's host tier without
//! owning its device tier.
//!
//! Why: an engine such as vLLM keeps its own GPU prefix cache and its own GPU↔host copy
//! worker, and asks an "offloading manager" four questions per step: is this chunk on host
//! (lookup), where do I read these chunks from (load), where do I write these new chunks and
//! what did you drop for them (store), and what changed (events). [`Scheduler`] answers those
//! for requests it runs itself, with device pages it owns; here the same [`RadixCache`] (its
//! prefix-closed host residency, leaf-first eviction by kvtier's [`EvictionPolicy`], locks
//! that pin what a copy reads or extends, router events) answers them for chunks the engine
//! computed. Nothing is emulated by the caller: which chunks are kept, which slot each gets
//! and which chunks are evicted for them are the tree's decisions.
//!
//! How: one radix page per engine chunk (`page_size` 1; the engine's chunk key, hashed by
//! the caller into a [`PageHash`] chain, is the page's identity). Host page ids are the
//! engine's host slots. A store is two-phase: [`OffloadManager::prepare_store`] locks the
//! deepest host-resident prefix of the chain (so neither it nor the slots can go while the
//! engine copies), evicts the policy's coldest unlocked leaves if the free slots are short,
//! and hands out held slots; [`OffloadManager::complete_store`] inserts them (success) or
//! frees them (failure). A store may start right after pages another store is still writing
//! (two requests with a common prefix computed in one step): its pages are inserted once
//! that parent store landed (its lock moves down onto the parent's pages as soon as they are
//! in the tree), and dropped if the parent failed. A load locks the path it reads until
//! [`OffloadManager::complete_load`]; a held prefetch locks what it landed until the engine
//! releases it (`offload_hold.rs`).
//! Pages being stored are not answered as hits ([`Lookup::Pending`]) until their bytes landed.
//! Every method validates before it changes anything: on `Err`, nothing changed.
//!
//! [`Scheduler`]: crate::Scheduler

use std::collections::{HashMap, HashSet};

use kvtier_radix::{
    EvictionPolicy, Host, HostPageId, KvEvent, LockHandle, PageHash, RadixCache, RadixConfig,
    RadixError, TenantId, TierKind, TierUsage,
};
use thiserror::Error;

use crate::offload_chain::{ChainBooks, Scope};

/// What the manager refused; nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum OffloadError {
    #[error("the host tier needs at least one slot")]
    NoHostSlots,
    /// The shadow selector learns from the requests a scheduler submits; a manager sees only
    /// the engine's page chains, so it would never leave its first choice.
    #[error(
        "eviction \"shadow\" needs a scheduler (it learns from submitted requests); use a fixed policy"
    )]
    ShadowNeedsRequests,
    #[error("no {kind} job has id {job}")]
    UnknownJob { kind: JobKind, job: u64 },
    /// A completion of another kind of job than `job` is (`complete_store` on a prefetch:
    /// a prefetch completes with the pages it read, [`OffloadManager::complete_prefetch`]).
    #[error("job {job} is a {kind} job, not a {called} job: complete it as what it is")]
    WrongJobKind {
        job: u64,
        kind: JobKind,
        called: JobKind,
    },
    /// A prefetch completed with more pages than it reads.
    #[error("prefetch job {job} reads {pages} pages, {completed} reported")]
    TooManyPages {
        job: u64,
        completed: usize,
        pages: usize,
    },
    #[error("store job {job} was already reported")]
    AlreadyCompleted { job: u64 },
    #[error("pages {from}..{to} are not a range of the {len}-page chain")]
    BadRange { from: usize, to: usize, len: usize },
    #[error("only {resident} leading pages of the chain are on host, {wanted} asked for")]
    NotOnHost { resident: usize, wanted: usize },
    #[error("the prefix cache refused: {0}")]
    Cache(#[from] RadixError),
    #[error("{0} is not a completion of the manager's L3 ops (PrefetchDone or BackUpDone)")]
    NotAnL3Completion(&'static str),
    /// A direct loss report (`l3_lost`, `l3_lost_all`) on a manager that plans for several
    /// tensor-parallel ranks ([`OffloadManager::set_tp_ranks`]): one rank's store heard of
    /// it, and the ranks must agree it. Nothing changed.
    #[error(
        "this manager plans for {tp_ranks} tensor-parallel ranks: record a rank's L3 losses with RankAgreement::lost_pages (lost_all) and apply them with RankAgreement::agree_losses"
    )]
    LossNeedsAgreement { tp_ranks: u32 },
    /// A direct find ([`OffloadManager::l3_found`]) on a manager that plans for several
    /// tensor-parallel ranks: one rank's probe found its shard, and a rank answering `InL3`
    /// where the others answer a miss plans other prefetches. Nothing changed.
    #[error(
        "this manager plans for {tp_ranks} tensor-parallel ranks: record a rank's L3 finds with RankAgreement::found_pages and apply the pages every rank found with RankAgreement::agree_found (or agree_found_in_process)"
    )]
    FoundNeedsAgreement { tp_ranks: u32 },
    #[error("a manager plans for at least one rank (tp_ranks 0)")]
    ZeroRanks,
    /// The list is not a chain: its page `index` follows another page here than it does
    /// earlier in the list or in a chain stored before (`offload_chain.rs`). A page hash
    /// names one prefix; the engine's chunk hashes must be chained over their prefixes.
    #[error(
        "page {index} of the list follows another page than it does elsewhere: not a chain of page hashes (each hash names one prefix)"
    )]
    NotAChain { index: usize },
}

/// The two kinds of copy job the engine runs for the manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::Display)]
pub enum JobKind {
    /// Engine device → host slots.
    Store,
    /// Host slots → engine device.
    Load,
    /// Host slots → L3.
    Backup,
    /// L3 → host slots.
    Prefetch,
}

/// How a job the engine ran ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobOutcome {
    /// Every byte landed.
    Done,
    /// The copy failed: a store's slots hold nothing usable.
    Failed,
}

/// The answer to a lookup of one page of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// On host with its whole prefix: loadable now.
    Hit,
    /// Being stored: ask again once the store completed.
    Pending,
    /// Not on host, known to be in L3 (backed up or found by a probe): prefetch it.
    InL3,
    /// Not on host (nor known in L3).
    Miss,
}

/// Slots handed out for a store: pages `from .. from + slots.len()` of the chain go to
/// `slots` (in order), and `evicted` are the pages the tree dropped from host to make room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorePlan {
    pub job: u64,
    pub from: usize,
    pub slots: Vec<HostPageId>,
    pub evicted: Vec<PageHash>,
}

/// Slots to read for a load of pages `from .. from + slots.len()` of the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadPlan {
    pub job: u64,
    pub slots: Vec<HostPageId>,
}

pub(crate) struct PendingStore {
    pub(crate) chain: Vec<PageHash>,
    pub(crate) from: usize,
    pub(crate) slots: Vec<HostPageId>,
    /// On the deepest host-resident node of `chain[..from]` (moved down as it grows).
    pub(crate) lock: LockHandle<Host>,
    pub(crate) state: StoreState,
    /// Owns the nodes the store inserts (`TenantId::SHARED`: no tenant).
    pub(crate) tenant: TenantId,
}

/// Where a store stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreState {
    /// The engine is writing the slots.
    Writing,
    /// The engine reported the bytes landed; the pages wait for their parent store.
    Landed,
    /// Its parent store failed while the engine was still writing: the pages will not be
    /// inserted, and the slots stay held until the engine reports the job (a copy still in
    /// flight must not land in a slot given to someone else).
    Orphaned,
}

/// kvtier's host tier for an engine that owns its device tier. See the module docs.
pub struct OffloadManager {
    pub(crate) cache: RadixCache,
    pub(crate) stores: HashMap<u64, PendingStore>,
    loads: HashMap<u64, LockHandle<Host>>,
    /// L3 below the host tier (`offload_l3.rs`).
    pub(crate) l3: crate::offload_l3::L3Books,
    /// Pages of in-flight stores (not hits until stored; not stored twice).
    pub(crate) storing: HashSet<PageHash>,
    /// Pages of stores that ended without reaching the tree, since the last `take_dropped`.
    pub(crate) dropped: Vec<PageHash>,
    pub(crate) next_job: u64,
    /// Tree events drained early (to see a tenant allocation's evictions), not yet taken.
    pub(crate) events: Vec<KvEvent>,
    /// Frees and unlocks of slots and locks this manager held that the tree refused (a bug
    /// in these books, see `crate::release`); [`OffloadManager::check`] requires 0.
    internal_errors: u64,
    /// Tensor-parallel ranks whose shards this plan covers ([`OffloadManager::set_tp_ranks`]).
    pub(crate) tp_ranks: u32,
    /// Held prefetches by job (`offload_hold.rs`).
    pub(crate) holds: HashMap<u64, crate::offload_hold::Hold>,
    /// Landed holds a store displaced so far (`offload_hold.rs`).
    pub(crate) displaced: u64,
    /// Each known page's parent: the lists accepted are chains (`offload_chain.rs`).
    chains: ChainBooks,
}

impl std::fmt::Debug for OffloadManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadManager")
            .field("host", &self.cache.usage(TierKind::Host))
            .field("stores", &self.stores.len())
            .field("loads", &self.loads.len())
            .finish()
    }
}

/// The token run the tree keeps for a page (`page_size` 1): a function of the page's hash,
/// so the tree's runs stay consistent with its hashes.
pub(crate) fn token_of(h: &PageHash) -> u32 {
    u32::from_le_bytes([h.0[0], h.0[1], h.0[2], h.0[3]])
}

impl OffloadManager {
    /// A manager of `host_slots` host slots (ids `0..host_slots`), evicting by `policy`.
    pub fn new(host_slots: u32, policy: EvictionPolicy) -> Result<Self, OffloadError> {
        if host_slots == 0 {
            return Err(OffloadError::NoHostSlots);
        }
        if policy == EvictionPolicy::Shadow {
            return Err(OffloadError::ShadowNeedsRequests);
        }
        let mut cache = RadixCache::new(RadixConfig {
            page_size: 1,
            device_pages: 0,
            host_pages: host_slots,
            record_events: true,
        })?;
        cache.set_eviction_policy(policy);
        Ok(Self {
            cache,
            stores: HashMap::new(),
            loads: HashMap::new(),
            storing: HashSet::new(),
            dropped: Vec::new(),
            l3: Default::default(),
            next_job: 1,
            events: Vec::new(),
            internal_errors: 0,
            tp_ranks: 1,
            holds: HashMap::new(),
            displaced: 0,
            chains: ChainBooks::new(host_slots),
        })
    }

    /// The number of tensor-parallel ranks whose shards this manager's plan covers (1, the
    /// default: a single rank). Above 1 the ranks' L3 outcomes must be agreed: the direct
    /// loss reports ([`Self::l3_lost`], [`Self::l3_lost_all`]) are refused
    /// ([`OffloadError::LossNeedsAgreement`]), and an agreement over another number of ranks
    /// ([`Self::agree_in_process`], `RankAgreement::agree_losses`) too.
    pub fn set_tp_ranks(&mut self, tp_ranks: u32) -> Result<(), OffloadError> {
        if tp_ranks == 0 {
            return Err(OffloadError::ZeroRanks);
        }
        self.tp_ranks = tp_ranks;
        Ok(())
    }

    /// See [`Self::set_tp_ranks`].
    pub fn tp_ranks(&self) -> u32 {
        self.tp_ranks
    }

    /// How many leading pages of `chain` are on host (read-only: no recency change). Of a
    /// list that is not a chain, only the part before its first conflict is matched.
    pub fn host_prefix(&self, chain: &[PageHash]) -> usize {
        self.cache.peek_prefix(self.consistent(chain)).1
    }

    /// `chain` up to its first page the chain books contradict.
    fn consistent<'c>(&self, chain: &'c [PageHash]) -> &'c [PageHash] {
        let end = self.chains.first_conflict(chain, Scope::Known);
        &chain[..end.unwrap_or(chain.len())]
    }

    /// Entries of the chain books (`offload_chain.rs`): at most twice the host slots + 64.
    pub fn chain_book_entries(&self) -> usize {
        self.chains.len()
    }

    /// Whether page `index` of `chain` can be loaded now.
    pub fn lookup(&self, chain: &[PageHash], index: usize) -> Lookup {
        let Some(page) = chain.get(index) else {
            return Lookup::Miss;
        };
        if self.host_prefix(&chain[..=index]) > index {
            Lookup::Hit
        } else if self.storing.contains(page) {
            Lookup::Pending
        } else if self.l3.holds(page) {
            Lookup::InL3
        } else {
            Lookup::Miss
        }
    }

    /// The engine computed pages `..to` of `chain`: hands out slots for those of them not on
    /// host yet, after the deepest host-resident prefix, as many as the tree can make room for
    /// (its coldest unlocked leaves evicted), stopping before a page another store is
    /// writing. `None`: nothing to store.
    pub fn prepare_store(
        &mut self,
        chain: &[PageHash],
        to: usize,
    ) -> Result<Option<StorePlan>, OffloadError> {
        self.prepare_store_for(TenantId::SHARED, chain, to)
    }

    /// [`Self::prepare_store`] on behalf of `tenant`, whose host cap (`offload_tenant.rs`)
    /// bounds what it keeps: it evicts its own leaves past its cap, and never the leaves of
    /// another capped tenant within its cap.
    ///
    /// Pages L3 does not hold are never left short of slots by held prefetches: landed holds
    /// give way to them (`offload_hold.rs`, [`Self::holds_displaced`]).
    pub fn prepare_store_for(
        &mut self,
        tenant: TenantId,
        chain: &[PageHash],
        to: usize,
    ) -> Result<Option<StorePlan>, OffloadError> {
        self.plan_store(tenant, chain, to, true)
    }

    /// [`Self::prepare_store_for`]; `displace`: whether landed holds give way to pages L3
    /// lacks (a store's; never a prefetch's, whose pages L3 holds).
    pub(crate) fn plan_store(
        &mut self,
        tenant: TenantId,
        chain: &[PageHash],
        to: usize,
        displace: bool,
    ) -> Result<Option<StorePlan>, OffloadError> {
        if to > chain.len() {
            return Err(OffloadError::BadRange {
                from: 0,
                to,
                len: chain.len(),
            });
        }
        if let Some(index) = self.chains.first_conflict(&chain[..to], Scope::Whole) {
            return Err(OffloadError::NotAChain { index });
        }
        let (_, host) = self.cache.peek_prefix(&chain[..to]);
        let from = host
            + chain[host..to]
                .iter()
                .take_while(|h| self.storing.contains(h))
                .count();
        let want = chain[from..to]
            .iter()
            .take_while(|h| !self.storing.contains(h))
            .count();
        if want == 0 {
            return Ok(None);
        }
        let m = self.cache.match_prefix(&chain[..host]);
        let lock = self.cache.lock::<Host>(m.host_node)?;
        if displace {
            self.displace_holds(tenant, &chain[from..from + want]);
        }
        let Some((slots, evicted)) = self.alloc_slots(tenant, want) else {
            self.release(lock);
            return Ok(None);
        };
        let n = slots.len();
        let job = self.next_job;
        self.next_job += 1;
        self.chains.record(&chain[..from + n], from);
        self.storing.extend(chain[from..from + n].iter().copied());
        self.stores.insert(
            job,
            PendingStore {
                chain: chain[..from + n].to_vec(),
                from,
                slots: slots.clone(),
                lock,
                state: StoreState::Writing,
                tenant,
            },
        );
        let in_flight = self.stores.values().map(|p| (p.chain.as_slice(), p.from));
        self.chains
            .prune(|| self.cache.resident_events(), in_flight);
        Ok(Some(StorePlan {
            job,
            from,
            slots,
            evicted,
        }))
    }

    /// Slots of pages `from..to` of `chain` for a load; they stay pinned until
    /// [`Self::complete_load`].
    pub fn prepare_load(
        &mut self,
        chain: &[PageHash],
        from: usize,
        to: usize,
    ) -> Result<LoadPlan, OffloadError> {
        if from >= to || to > chain.len() {
            return Err(OffloadError::BadRange {
                from,
                to,
                len: chain.len(),
            });
        }
        if let Some(index) = self.chains.first_conflict(&chain[..to], Scope::Known) {
            return Err(OffloadError::NotAChain { index });
        }
        let resident = self.host_prefix(&chain[..to]);
        if resident < to {
            return Err(OffloadError::NotOnHost {
                resident,
                wanted: to,
            });
        }
        let m = self.cache.match_prefix(&chain[..to]);
        let lock = self.cache.lock::<Host>(m.host_node)?;
        let slots = match self.cache.path_pages::<Host>(m.host_node) {
            Ok(p) => p[from..to].to_vec(),
            Err(e) => {
                self.release(lock);
                return Err(e.into());
            }
        };
        let job = self.next_job;
        self.next_job += 1;
        self.loads.insert(job, lock);
        Ok(LoadPlan { job, slots })
    }

    /// A load finished (either way: the engine recomputes what failed); its pages unpinned.
    pub fn complete_load(&mut self, job: u64) -> Result<(), OffloadError> {
        let Some(lock) = self.loads.remove(&job) else {
            return Err(OffloadError::UnknownJob {
                kind: JobKind::Load,
                job,
            });
        };
        self.release(lock);
        Ok(())
    }

    /// The engine used the host-resident prefix of `chain`: refreshes its rank.
    pub fn touch(&mut self, chain: &[PageHash]) {
        let chain = self.consistent(chain);
        let (_, host) = self.cache.peek_prefix(chain);
        if host > 0 {
            self.cache.match_prefix(&chain[..host]);
        }
    }

    /// Host `Stored` / `Removed` events since the last call.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        let mut out = std::mem::take(&mut self.events);
        out.extend(self.cache.drain_events());
        out
    }

    /// Pages of stores that ended without reaching the tree (failed, or their parent store
    /// failed) since the last call: never hits, their slots free (or freed when reported).
    pub fn take_dropped(&mut self) -> Vec<PageHash> {
        std::mem::take(&mut self.dropped)
    }

    pub(crate) fn storing_page(&self, page: &PageHash) -> bool {
        self.storing.contains(page)
    }

    /// Pages being stored now.
    pub fn storing(&self) -> usize {
        self.storing.len()
    }

    /// Host occupancy.
    pub fn usage(&self) -> TierUsage {
        self.cache.usage(TierKind::Host)
    }

    /// Jobs the engine has not reported yet: (stores, loads).
    pub fn in_flight(&self) -> (usize, usize) {
        let stores = self
            .stores
            .values()
            .filter(|p| p.state != StoreState::Landed)
            .count();
        (stores, self.loads.len())
    }

    /// The full consistency check: the tree's own invariants, one lock per in-flight job,
    /// the held slots exactly those of in-flight stores, `storing` exactly their pages.
    pub fn check(&self) -> Result<(), String> {
        if self.internal_errors != 0 {
            return Err(format!(
                "{} releases refused by the tree (internal errors)",
                self.internal_errors
            ));
        }
        self.cache.check_invariants()?;
        let (_, host_locks) = self.cache.outstanding_locks();
        let holds = self.check_holds(|job| self.stores.contains_key(&job))?;
        let jobs = self.stores.len() + self.loads.len() + self.l3.backups();
        if host_locks != jobs + holds {
            return Err(format!(
                "{host_locks} host locks for {jobs} in-flight jobs and {holds} held prefetches"
            ));
        }
        let held: usize = self.stores.values().map(|p| p.slots.len()).sum();
        let u = self.cache.usage(TierKind::Host);
        if u.held != held {
            return Err(format!(
                "{} held slots, in-flight stores hold {held}",
                u.held
            ));
        }
        let storing: usize = self
            .stores
            .values()
            .filter(|p| p.state != StoreState::Orphaned)
            .map(|p| p.chain.len() - p.from)
            .sum();
        if storing != self.storing.len() {
            return Err(format!(
                "{} pages marked storing, in-flight stores write {storing}",
                self.storing.len()
            ));
        }
        if let Some(job) = self
            .l3
            .prefetch_jobs()
            .find(|j| !self.stores.contains_key(j))
        {
            return Err(format!("prefetch {job} has no store job"));
        }
        if u.free + u.held + u.cached != u.capacity {
            return Err(format!("host slots do not add up: {u:?}"));
        }
        self.chains.check(self.cache.resident_events())
    }

    /// Gives a lock back. Our handles are of this cache and tier and given back once, so the
    /// tree cannot refuse; a refusal would leave the handle held, which `check` reports.
    pub(crate) fn release(&mut self, lock: LockHandle<Host>) {
        let r = self.cache.unlock(lock).map_err(|refused| refused.error);
        crate::release::checked(&mut self.internal_errors, "unlock", r);
    }

    /// Frees host slots this manager holds (see [`Self::release`]).
    pub(crate) fn free_held(&mut self, slots: &[HostPageId]) {
        if !slots.is_empty() {
            let r = self.cache.free::<Host>(slots);
            crate::release::checked(&mut self.internal_errors, "free", r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A release the tree refuses (a slot this manager does not hold) is a bug in its books:
    /// counted, and `check` fails, release builds included (debug builds assert at once).
    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "internal: free failed"))]
    fn a_refused_release_is_counted_and_fails_the_check() {
        let mut m = OffloadManager::new(4, EvictionPolicy::default()).unwrap();
        assert_eq!(m.check(), Ok(()));
        m.free_held(&[HostPageId::new(2)]);
        assert_eq!(m.internal_errors, 1);
        assert!(m.check().unwrap_err().contains("internal errors"));
    }
}
