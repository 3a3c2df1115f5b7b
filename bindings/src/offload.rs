//! `kvtier.OffloadManager`: kvtier's radix tree as the host tier of an engine that owns its
//! device tier (vLLM's offloading manager, `kvtier.vllm.KvtierOffloadingManager`).
//!
//! Why a thin class: every decision (which chunks are kept, which slot each gets, what is
//! evicted for them, what a load pins) is `kvtier_scheduler::OffloadManager`'s; Python only
//! translates the engine's keys into page-hash chains (`kvtier.vllm.chunks`) and back.
//! How: a chain is a list of 32-byte page hashes in prefix order; slots are host page ids.
//! Errors are `OffloadError` (a `SchedulerError`); nothing changes on an error.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use kvtier_radix::{EvictionPolicy, KvEvent, PageHash, TenantId, TierKind};
use kvtier_scheduler::{JobOutcome, L3Backups, Lookup, OffloadError, OffloadManager, StorePlan};

use crate::errors::{
    FoundNeedsAgreementError, LossNeedsAgreementError, OffloadManagerError, config_msg,
};

fn chain_of(chain: &Bound<'_, PyAny>) -> PyResult<Vec<PageHash>> {
    let mut out = Vec::with_capacity(chain.len().unwrap_or(0));
    for item in chain.try_iter()? {
        let item = item?;
        // `bytes` (what kvtier.vllm passes) is read in place; anything else is converted.
        let h = match item.cast::<PyBytes>() {
            Ok(b) => page_hash(b.as_bytes())?,
            Err(_) => page_hash(&item.extract::<Vec<u8>>()?)?,
        };
        out.push(h);
    }
    Ok(out)
}

fn page_hash(b: &[u8]) -> PyResult<PageHash> {
    let h: [u8; 32] = b.try_into().map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!("a page hash is 32 bytes, got {}", b.len()))
    })?;
    Ok(PageHash(h))
}

/// `(job, from, slots, evicted page hashes)` of a store.
type StoreTuple<'py> = (u64, usize, Vec<u32>, Bound<'py, PyList>);

/// `(job, page hashes, slots)` of a backup.
type BackupTuple<'py> = (u64, Bound<'py, PyList>, Vec<u32>);

fn tenant_id(tenant: Option<&str>) -> TenantId {
    tenant.map_or(TenantId::SHARED, OffloadManager::tenant_of)
}

fn store_tuple(py: Python<'_>, plan: Option<StorePlan>) -> PyResult<Option<StoreTuple<'_>>> {
    match plan {
        None => Ok(None),
        Some(p) => Ok(Some((
            p.job,
            p.from,
            p.slots.iter().map(|s| s.index()).collect(),
            hashes(py, &p.evicted)?,
        ))),
    }
}

/// Whether a prefetch's pages stay locked once landed (`prepare_prefetch_held`).
#[derive(Clone, Copy)]
enum Hold {
    None,
    UntilReleased,
}

impl PyOffloadManager {
    fn prefetch<'py>(
        &mut self,
        py: Python<'py>,
        chain: &Bound<'py, PyAny>,
        to: usize,
        tenant: Option<&str>,
        hold: Hold,
    ) -> PyResult<Option<StoreTuple<'py>>> {
        let c = chain_of(chain)?;
        let t = tenant_id(tenant);
        let plan = match hold {
            Hold::None => self.inner_mut().prepare_prefetch_for(t, &c, to),
            Hold::UntilReleased => self.inner_mut().prepare_prefetch_held(t, &c, to),
        }
        .map_err(err)?;
        store_tuple(py, plan)
    }
}

fn outcome_of(outcome: &str) -> PyResult<JobOutcome> {
    match outcome {
        "done" => Ok(JobOutcome::Done),
        "failed" => Ok(JobOutcome::Failed),
        other => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "outcome is \"done\" or \"failed\", got {other:?}"
        ))),
    }
}

fn err(e: OffloadError) -> PyErr {
    match e {
        OffloadError::LossNeedsAgreement { .. } => LossNeedsAgreementError::new_err(e.to_string()),
        OffloadError::FoundNeedsAgreement { .. } => {
            FoundNeedsAgreementError::new_err(e.to_string())
        }
        _ => OffloadManagerError::new_err(e.to_string()),
    }
}

fn hashes<'py>(py: Python<'py>, hs: &[PageHash]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, hs.iter().map(|h| PyBytes::new(py, &h.0)))
}

pub use cell::PyOffloadManager;

/// The class's fields, private to this module so that every change goes through
/// `inner_mut` and counts a generation (the compiler keeps it so).
mod cell {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::OffloadManager;
    use pyo3::prelude::*;

    /// Generations are stamps from one process-wide counter: no two managers (a manager and
    /// its replacement after a reset, say) ever show the same one, so an answer kept from one
    /// can never pass for the other's.
    static STAMPS: AtomicU64 = AtomicU64::new(1);

    fn stamp() -> u64 {
        STAMPS.fetch_add(1, Ordering::Relaxed)
    }

    /// kvtier's host tier for an engine that keeps its own device tier: `host_slots` slots
    /// (ids `0..host_slots`), evicting by `policy` ("lru", "freq-depth", "adaptive"), planning
    /// for `tp_ranks` tensor-parallel ranks (above 1: losses and L3 completions are agreed with
    /// one `RankAgreement` per rank, and the direct `l3_lost` / `l3_lost_all` are refused).
    ///
    /// `generation` is renewed by every call that may change the manager (every method that
    /// takes it mutably: the field is reachable only through [`PyOffloadManager::inner_mut`],
    /// which renews it, or through the two takers of recorded events and dropped pages, which
    /// change no answer), so a caller may keep an answer (a chain's host prefix) while it is
    /// unchanged.
    #[pyclass(module = "kvtier", name = "OffloadManager")]
    pub struct PyOffloadManager {
        inner: OffloadManager,
        generation: u64,
    }

    impl PyOffloadManager {
        /// The manager, read-only.
        pub(crate) fn inner(&self) -> &OffloadManager {
            &self.inner
        }

        /// The manager, to change: a new generation (a kept answer is stale).
        pub(crate) fn inner_mut(&mut self) -> &mut OffloadManager {
            self.generation = stamp();
            &mut self.inner
        }

        pub(crate) fn from_inner(inner: OffloadManager) -> Self {
            Self {
                inner,
                generation: stamp(),
            }
        }

        /// The stamp of the manager's last change (or of its creation).
        pub(crate) fn changes(&self) -> u64 {
            self.generation
        }

        /// The host events recorded since the last call, taken out. Not a change: no answer
        /// of the manager depends on its queue of recorded events, so the generation stays
        /// (an engine takes them every step; a kept host prefix survives that).
        pub(crate) fn take_events(&mut self) -> Vec<super::KvEvent> {
            self.inner.drain_events()
        }

        /// The pages of stores that ended without reaching the tree, taken out; not a
        /// change either (they were dropped by the call that ended the store, which renewed
        /// the generation then).
        pub(crate) fn take_dropped_pages(&mut self) -> Vec<super::PageHash> {
            self.inner.take_dropped()
        }
    }
}

#[pymethods]
impl PyOffloadManager {
    #[new]
    #[pyo3(signature = (host_slots, policy = "lru", l3_backups = "off", *, tp_ranks = 1))]
    fn new(host_slots: u32, policy: &str, l3_backups: &str, tp_ranks: u32) -> PyResult<Self> {
        let p: EvictionPolicy = policy.parse().map_err(config_msg)?;
        let b = match l3_backups {
            "off" => L3Backups::Off,
            "write-through" => L3Backups::WriteThrough,
            other => {
                return Err(config_msg(format!(
                    "l3_backups is \"off\" or \"write-through\", got {other:?}"
                )));
            }
        };
        // the host pool is allocated whole: checked first, as the Scheduler's pools are
        crate::config::check_pool_pages(u64::from(host_slots), "host_slots")?;
        let mut inner = OffloadManager::new(host_slots, p).map_err(err)?;
        inner.set_l3_backups(b);
        inner
            .set_tp_ranks(tp_ranks)
            .map_err(|e| config_msg(format!("OffloadManager tp_ranks: {e}")))?;
        Ok(Self::from_inner(inner))
    }

    /// The tensor-parallel ranks this manager plans for.
    #[getter]
    fn tp_ranks(&self) -> u32 {
        self.inner().tp_ranks()
    }

    /// BackUp jobs for stored host pages L3 lacks: `[(job, [page hash], [slot])]`; each
    /// pins its host slots until `complete_backup(job, outcome)`. Backups that failed are
    /// planned again, a bounded number of pages per call, once L3 has answered since
    /// (a backup done, a prefetch that read pages, `l3_found`).
    fn plan_backups<'py>(&mut self, py: Python<'py>) -> PyResult<Vec<BackupTuple<'py>>> {
        if !self.inner().backups_due() {
            return Ok(Vec::new()); // nothing to plan: the manager unchanged
        }
        self.inner_mut()
            .plan_backups()
            .into_iter()
            .map(|b| {
                Ok((
                    b.job,
                    hashes(py, &b.pages)?,
                    b.slots.iter().map(|s| s.index()).collect(),
                ))
            })
            .collect()
    }

    fn complete_backup(&mut self, job: u64, outcome: &str) -> PyResult<()> {
        let o = outcome_of(outcome)?;
        self.inner_mut().complete_backup(job, o).map_err(err)
    }

    /// The engine's probe found these pages. Raises ``FoundNeedsAgreementError`` (nothing
    /// changed) when the manager plans for several ranks: one rank's probe found its shard;
    /// ``RankAgreement.found_pages`` then ``RankAgreement.agree_found`` (ranks in processes
    /// of their own) or ``agree_found`` (ranks in this process) mark the pages every rank
    /// found.
    fn l3_found(&mut self, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let c = chain_of(pages)?;
        let tp_ranks = self.inner().tp_ranks();
        if tp_ranks > 1 {
            // Refused before `inner_mut`: the manager, and its generation, unchanged.
            return Err(err(OffloadError::FoundNeedsAgreement { tp_ranks }));
        }
        self.inner_mut().l3_found(&c).map_err(err)
    }

    /// Agrees the L3 finds of tensor-parallel ranks whose ``RankAgreement``s are in this
    /// process (one per rank, each holding what that rank's probe found, ``found_pages``):
    /// marks the pages every rank found and consumes every rank's finds. Returns the marks
    /// added. ``AgreementError`` (nothing changed) unless there is one agreement per rank the
    /// manager plans for (``tp_ranks``), each a different object.
    fn agree_found(
        &mut self,
        ranks: Vec<Bound<'_, crate::tp::PyRankAgreement>>,
    ) -> PyResult<usize> {
        crate::tp::with_ranks(&ranks, |r| self.inner_mut().agree_found_in_process(r))
    }

    /// L3 lost these pages. Raises ``LossNeedsAgreementError`` (nothing changed) when the
    /// manager plans for several ranks: ``RankAgreement.lost_pages`` and ``agree_losses``.
    fn l3_lost(&mut self, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner_mut().l3_lost(&chain_of(pages)?).map_err(err)
    }

    /// L3 may have lost anything (a loss report overflowed). Raises
    /// ``LossNeedsAgreementError`` when the manager plans for several ranks (``lost_all``).
    fn l3_lost_all(&mut self) -> PyResult<()> {
        self.inner_mut().l3_lost_all().map_err(err)
    }

    /// A Prefetch: slots as `prepare_store` hands them out, for bytes read from L3; `None`
    /// or `(job, from, slots, evicted)`. Reported by `complete_prefetch(job, completed)` or
    /// agreed across ranks (`agree`).
    #[pyo3(signature = (chain, to, tenant = None))]
    fn prepare_prefetch<'py>(
        &mut self,
        py: Python<'py>,
        chain: &Bound<'py, PyAny>,
        to: usize,
        tenant: Option<&str>,
    ) -> PyResult<Option<StoreTuple<'py>>> {
        self.prefetch(py, chain, to, tenant, Hold::None)
    }

    /// `prepare_prefetch` whose pages, once landed, stay locked on host until
    /// `release_hold(job)`: no store evicts them before the requester loads them.
    #[pyo3(signature = (chain, to, tenant = None))]
    fn prepare_prefetch_held<'py>(
        &mut self,
        py: Python<'py>,
        chain: &Bound<'py, PyAny>,
        to: usize,
        tenant: Option<&str>,
    ) -> PyResult<Option<StoreTuple<'py>>> {
        self.prefetch(py, chain, to, tenant, Hold::UntilReleased)
    }

    /// Gives back a held prefetch's pages (landed or not, read or not). ``OffloadManagerError``
    /// (nothing changed) for a job that is no held prefetch or was released already.
    fn release_hold(&mut self, job: u64) -> PyResult<()> {
        self.inner_mut().release_hold(job).map_err(err)
    }

    /// Held prefetches not released yet: ``(landing, holding pages, ended with nothing or
    /// displaced)``.
    fn holds(&self) -> (usize, usize, usize) {
        self.inner().holds()
    }

    /// Whether held prefetch `job` holds landed pages now.
    fn holding(&self, job: u64) -> bool {
        self.inner().holding(job)
    }

    /// Landed holds that gave way to stores of pages L3 lacks (a store short of slots
    /// displaces them, the newest first; released afterwards as ended), since the manager
    /// was made.
    #[getter]
    fn holds_displaced(&self) -> u64 {
        self.inner().holds_displaced()
    }

    /// Caps the host chunks tenant `tenant` (a name) may hold (`None`: uncapped): past it, its
    /// stores evict its own chunks first and store fewer; within it, no other tenant's store
    /// evicts its chunks.
    fn set_tenant_cap(&mut self, tenant: &str, cap: Option<usize>) {
        self.inner_mut()
            .set_tenant_cap(OffloadManager::tenant_of(tenant), cap);
    }

    /// Host chunks charged to a capped tenant (`None`: no cap).
    fn tenant_charge(&self, tenant: &str) -> Option<usize> {
        self.inner()
            .tenant_charge(OffloadManager::tenant_of(tenant))
    }

    /// A Prefetch ended with its first `completed` pages read: the rest are lost in L3.
    fn complete_prefetch(&mut self, job: u64, completed: usize) -> PyResult<()> {
        self.inner_mut()
            .complete_prefetch(job, completed)
            .map_err(err)
    }

    /// Agrees the prefetches and backups in flight across tensor-parallel ranks whose
    /// `RankAgreement`s are in this process (one per rank, each holding that rank's
    /// `PrefetchDone` / `BackUpDone` events): applies the element-wise minimum. Returns the
    /// number of ops completed. ``AgreementError`` (nothing changed) unless there is one
    /// agreement per rank the manager plans for (``tp_ranks``), each a different object, or
    /// when a rank recorded a completion of another kind than its job's.
    fn agree(&mut self, ranks: Vec<Bound<'_, crate::tp::PyRankAgreement>>) -> PyResult<usize> {
        crate::tp::with_ranks(&ranks, |r| self.inner_mut().agree_in_process(r))
    }

    /// Applies one agreed event (`PrefetchDone` or `BackUpDone`) of `RankAgreement.reduce`.
    fn apply_agreed(&mut self, event: &Bound<'_, PyAny>) -> PyResult<()> {
        let ev = crate::plan::event_from_py(event)?;
        self.inner_mut().apply_agreed(&ev).map_err(err)
    }

    /// How many leading pages of `chain` are on host.
    fn host_prefix(&self, chain: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self.inner().host_prefix(&chain_of(chain)?))
    }

    /// "hit", "pending" (being stored), "in-l3" (off host, known in L3) or "miss" for page
    /// `index` of `chain`.
    fn lookup(&self, chain: &Bound<'_, PyAny>, index: usize) -> PyResult<&'static str> {
        Ok(match self.inner().lookup(&chain_of(chain)?, index) {
            Lookup::Hit => "hit",
            Lookup::Pending => "pending",
            Lookup::InL3 => "in-l3",
            Lookup::Miss => "miss",
        })
    }

    /// Slots for pages of `chain[..to]` not on host yet: `None` (nothing to store) or
    /// `(job, from, slots, evicted)`: pages `from .. from + len(slots)` go to `slots`,
    /// `evicted` are the page hashes dropped from host to make room.
    /// On behalf of `tenant` (a name; `None`: shared) when given: its cap applies.
    #[pyo3(signature = (chain, to, tenant = None))]
    fn prepare_store<'py>(
        &mut self,
        py: Python<'py>,
        chain: &Bound<'py, PyAny>,
        to: usize,
        tenant: Option<&str>,
    ) -> PyResult<Option<StoreTuple<'py>>> {
        let c = chain_of(chain)?;
        let plan = self
            .inner_mut()
            .prepare_store_for(tenant_id(tenant), &c, to)
            .map_err(err)?;
        store_tuple(py, plan)
    }

    /// A store's bytes landed (`outcome="done"`) or not (`"failed"`).
    fn complete_store(&mut self, job: u64, outcome: &str) -> PyResult<()> {
        let o = outcome_of(outcome)?;
        self.inner_mut().complete_store(job, o).map_err(err)
    }

    /// `(job, slots)` of pages `from_..to` of `chain`, pinned until `complete_load(job)`.
    fn prepare_load(
        &mut self,
        chain: &Bound<'_, PyAny>,
        from_: usize,
        to: usize,
    ) -> PyResult<(u64, Vec<u32>)> {
        let p = self
            .inner_mut()
            .prepare_load(&chain_of(chain)?, from_, to)
            .map_err(err)?;
        Ok((p.job, p.slots.iter().map(|s| s.index()).collect()))
    }

    fn complete_load(&mut self, job: u64) -> PyResult<()> {
        self.inner_mut().complete_load(job).map_err(err)
    }

    /// The engine used the host-resident prefix of `chain`.
    fn touch(&mut self, chain: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner_mut().touch(&chain_of(chain)?);
        Ok(())
    }

    /// Host events since the last call: `(removed, [page hash, ...])` pairs in order. Taking
    /// them leaves `generation` as it was (no answer depends on them).
    fn drain_events<'py>(&mut self, py: Python<'py>) -> PyResult<Vec<(bool, Bound<'py, PyList>)>> {
        let mut out = Vec::new();
        for e in self.take_events() {
            match e {
                KvEvent::Stored {
                    tier: TierKind::Host,
                    hashes: hs,
                    ..
                } => out.push((false, hashes(py, &hs)?)),
                KvEvent::Removed {
                    tier: TierKind::Host,
                    hashes: hs,
                    ..
                } => out.push((true, hashes(py, &hs)?)),
                _ => {}
            }
        }
        Ok(out)
    }

    /// Page hashes of stores that ended without reaching the tree (failed, or their parent
    /// store failed) since the last call.
    fn take_dropped<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        hashes(py, &self.take_dropped_pages())
    }

    /// Host slots: capacity, free, held (in-flight stores), cached, locked; and in-flight
    /// store and load jobs, pages being stored.
    fn usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (stores, loads) = self.inner().in_flight();
        let d = crate::sched::usage_dict(py, &self.inner().usage())?;
        d.set_item("stores", stores)?;
        d.set_item("loads", loads)?;
        d.set_item("storing", self.inner().storing())?;
        let (queued, backups) = self.inner().backups_pending();
        d.set_item("backups_queued", queued)?;
        d.set_item("backups", backups)?;
        let (retrying, given_up) = self.inner().backups_retrying();
        d.set_item("backups_retrying", retrying)?;
        d.set_item("backups_given_up", given_up)?;
        d.set_item("backups_probed", self.inner().backups_probed())?;
        Ok(d)
    }

    /// The host slots as `(cached, free, locked, held, capacity)`: `usage()`'s occupancy
    /// without its dict, for an engine that asks every step (vLLM's stats).
    fn occupancy(&self) -> (usize, usize, usize, usize, usize) {
        let u = self.inner().usage();
        (u.cached, u.free, u.locked, u.held, u.capacity)
    }

    /// A stamp renewed by every call that may change the manager, unique in the process:
    /// while it is unchanged, so is every answer this manager gave (e.g. `host_prefix` of a
    /// chain), and a caller may keep it; no other manager ever shows the same stamp.
    #[getter]
    fn generation(&self) -> u64 {
        self.changes()
    }

    /// kvtier's full consistency check; raises `OffloadManagerError` naming what is wrong.
    fn check(&self) -> PyResult<()> {
        self.inner()
            .check()
            .map_err(|m| OffloadManagerError::new_err(format!("inconsistent: {m}")))
    }
}
