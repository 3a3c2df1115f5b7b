//! `kvtier.RankAgreement`: tensor-parallel agreement from Python (see
//! `kvtier_scheduler::RankAgreement` for the contract).
//!
//! Why the reduction is the caller's: kvtier does not own the process group. One call per
//! step gives the engine an int64 numpy array (one value per op in flight); it reduces it
//! in place with the element-wise minimum over ranks — e.g.
//! `t = torch.from_numpy(v); torch.distributed.all_reduce(t, op=ReduceOp.MIN)` — and gets the
//! agreed completion events back to feed to its scheduler.
//!
//! L3 losses are agreed the same way (`lost`, `lost_all`, then once per step on every rank
//! `agree_losses(scheduler, all_gather)`): the union of every rank's losses is applied on every
//! rank, so that no rank backs up or refetches a page the others still take to be in L3. The
//! engine's `all_gather` gets this rank's int64 words and returns every rank's (e.g.
//! `torch.distributed.all_gather_object`, or `all_gather` of arrays zero-padded to the longest).
//! A scheduler (or offloading manager) that is one rank of several (`tp_ranks` > 1) refuses
//! the direct `l3_lost` / `l3_lost_all` (`LossNeedsAgreementError`), and the agreement refuses
//! words gathered from another number of ranks than its `tp_ranks` (`AgreementError`).

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;

use kvtier_scheduler::{AgreedOps, AgreementError, OpId, RankAgreement};

use crate::offload::PyOffloadManager;
use crate::plan::{event_from_py, event_to_py};
use crate::sched::PyScheduler;

pub(crate) fn agree_err(e: AgreementError) -> PyErr {
    crate::errors::base::AgreementError::new_err(e.to_string())
}

/// Runs `f` over the ranks' agreements (in one process), given back to their Python objects
/// after: ``AgreementError`` if one is passed twice, nothing run.
pub(crate) fn with_ranks<R>(
    ranks: &[Bound<'_, PyRankAgreement>],
    f: impl FnOnce(&mut [RankAgreement]) -> Result<R, AgreementError>,
) -> PyResult<R> {
    for (j, r) in ranks.iter().enumerate() {
        if let Some(i) = ranks[..j].iter().position(|q| q.is(r)) {
            return Err(crate::errors::base::AgreementError::new_err(format!(
                "ranks {i} and {j} passed the same RankAgreement: a rank's agreement was passed twice (one agreement per rank); nothing changed"
            )));
        }
    }
    let mut held = Vec::with_capacity(ranks.len());
    for r in ranks {
        held.push(r.try_borrow_mut()?);
    }
    let mut taken: Vec<_> = held
        .iter_mut()
        .map(|r| std::mem::take(&mut r.inner))
        .collect();
    let out = f(&mut taken);
    for (r, a) in held.iter_mut().zip(taken) {
        r.inner = a;
    }
    out.map_err(agree_err)
}

/// This rank's `words`, all-gathered by the caller's `all_gather` (the agreement is not
/// held while it runs: an in-process stand-in may read every rank's words).
fn gather(
    slf: &Bound<'_, PyRankAgreement>,
    words: impl FnOnce(&mut RankAgreement) -> Vec<u64>,
    all_gather: &Bound<'_, PyAny>,
) -> PyResult<Vec<Vec<u64>>> {
    let w = words(&mut slf.try_borrow_mut()?.inner);
    gathered_words(&all_gather.call1((words_to_py(slf.py(), w),))?)
}

/// One rank's completions, reduced with the other ranks' once per step.
#[pyclass(module = "kvtier", name = "RankAgreement")]
#[derive(Default)]
pub struct PyRankAgreement {
    pub(crate) inner: RankAgreement,
}

/// What an agreement reads: a `Scheduler` or an `OffloadManager`, borrowed shared (an
/// `OffloadManager` keeps its generation: reading its ops in flight changes nothing).
fn with_agreed_ref<R>(
    target: &Bound<'_, PyAny>,
    f: impl FnOnce(&dyn AgreedOps) -> R,
) -> PyResult<R> {
    if let Ok(s) = target.cast::<PyScheduler>() {
        return Ok(f(&s.try_borrow()?.inner));
    }
    if let Ok(m) = target.cast::<PyOffloadManager>() {
        return Ok(f(m.try_borrow()?.inner()));
    }
    Err(pyo3::exceptions::PyTypeError::new_err(
        "an agreement reduces over a kvtier Scheduler or OffloadManager",
    ))
}

/// What an agreement changes (L3 losses): a `Scheduler` or an `OffloadManager`.
fn with_agreed<R>(
    target: &Bound<'_, PyAny>,
    f: impl FnOnce(&mut dyn AgreedOps) -> R,
) -> PyResult<R> {
    if let Ok(s) = target.cast::<PyScheduler>() {
        return Ok(f(&mut s.try_borrow_mut()?.inner));
    }
    if let Ok(m) = target.cast::<PyOffloadManager>() {
        return Ok(f(m.try_borrow_mut()?.inner_mut()));
    }
    Err(pyo3::exceptions::PyTypeError::new_err(
        "an agreement reduces over a kvtier Scheduler or OffloadManager",
    ))
}

#[pymethods]
impl PyRankAgreement {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Records this rank's completion event of an op (not `ForwardDone`). With `scheduler`
    /// (the `Scheduler` or `OffloadManager` it is reduced over) it is checked at once: refused
    /// (``AgreementError``, nothing recorded) unless it completes an op in flight there, of
    /// that op's kind, within its count. Without it, `reduce` refuses a completion of another
    /// kind or above the op's count, and drops one of an op not in flight (``dropped()``).
    #[pyo3(signature = (event, scheduler = None))]
    fn push(
        &mut self,
        event: &Bound<'_, PyAny>,
        scheduler: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let ev = event_from_py(event)?;
        match scheduler {
            None => self.inner.push(ev),
            Some(s) => with_agreed_ref(s, |s| self.inner.push_checked(s, ev))?,
        }
        .map_err(agree_err)
    }

    /// This rank does not run op `op` (`Scheduler.runs_here(op)` is False). With `scheduler`,
    /// refused unless `op` is in flight there and does not run there (an `OffloadManager`'s
    /// jobs run on every rank); without, a skip of an op that runs here is refused by the
    /// reduction (`AgreementError`, after the collective).
    #[pyo3(signature = (op, scheduler = None))]
    fn skip(&mut self, op: u64, scheduler: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        match scheduler {
            None => self.inner.skip(OpId(op)),
            Some(s) => with_agreed_ref(s, |s| self.inner.skip_checked(s, OpId(op)))?,
        }
        .map_err(agree_err)
    }

    /// Completions recorded and not yet agreed.
    fn pending(&self) -> usize {
        self.inner.pending()
    }

    /// Records reductions dropped because their op was not in flight (pushed twice, after
    /// the op was agreed, or for an op not issued): none completes an op. Cumulative.
    fn dropped(&self) -> u64 {
        self.inner.dropped()
    }

    /// This rank's contribution (int64, one value per op in flight in `scheduler`, a
    /// `Scheduler` or an `OffloadManager`). When `reduce` would refuse a record, every
    /// value is 0 (not done): no rank agrees anything this step (this rank applies nothing,
    /// and ranks that applied different events would plan differently).
    fn values<'py>(
        &self,
        py: Python<'py>,
        scheduler: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let v = with_agreed_ref(scheduler, |s| self.inner.values(s))?;
        Ok(words_to_py(py, v))
    }

    /// Reduces: calls `all_reduce_min(values)` with this rank's int64 array, which must
    /// leave (in place, or return) the element-wise minimum over all ranks; returns the agreed
    /// events to feed to `scheduler` (`on_event` each, in order). Raises ``AgreementError``
    /// (nothing changed) when this rank recorded a completion of another kind than its op's,
    /// or above its count, or when the reduced values are not a minimum: always *after*
    /// calling `all_reduce_min` once, so the other ranks are never left waiting in the
    /// collective (this rank then enters it with every op "not done": no rank agrees
    /// anything this step).
    /// `all_reduce_min` may read this agreement (an in-process stand-in computing every
    /// rank's values): it is not held while the collective runs. Ops another thread
    /// completed or issued meanwhile are not agreed by it (each reduced value goes to its op).
    fn reduce(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        scheduler: &Bound<'_, PyAny>,
        all_reduce_min: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let (v, ops) = {
            let me = slf.try_borrow()?;
            with_agreed_ref(scheduler, |s| (me.inner.values(s), s.agreed_ops()))?
        };
        let arr = words_to_py(py, v);
        let ret = all_reduce_min.call1((arr.clone(),))?;
        let reduced: PyReadonlyArray1<'_, i64> = if ret.is_none() {
            arr.readonly()
        } else {
            ret.extract().map_err(|_| {
                pyo3::exceptions::PyTypeError::new_err(
                    "all_reduce_min must reduce its int64 array in place or return one",
                )
            })?
        };
        let mut v = Vec::with_capacity(reduced.len()?);
        for &x in reduced.as_slice()? {
            if x < 0 {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "reduced values must not be negative",
                ));
            }
            v.push(x as u64);
        }
        if v.len() != ops.len() {
            let (expected, got) = (ops.len(), v.len());
            return Err(agree_err(AgreementError::Length { expected, got }));
        }
        let mut me = slf.try_borrow_mut()?;
        let evs = with_agreed_ref(scheduler, |s| {
            // The values are those of `ops`, read before the collective; another thread may
            // have completed or issued ops meanwhile. Each value goes to its op, by id: one
            // issued since is not agreed this time (0, not done: its record stays), the
            // record of one completed since is dropped. Applied index by index, ops took
            // the values of the ops they replaced.
            let now = s.agreed_ops();
            let v: Vec<u64> = if now == ops {
                v
            } else {
                let of = |op| ops.binary_search_by_key(op, |(o, _)| *o).ok();
                let value = |op| of(op).and_then(|i| v.get(i).copied()).unwrap_or(0);
                now.iter().map(|(op, _)| value(op)).collect()
            };
            me.inner.apply_reduced(s, &v)
        })?
        .map_err(agree_err)?;
        evs.into_iter().map(|e| event_to_py(py, e)).collect()
    }

    /// Records keys this rank's store reported lost (``L3Store.drain_losses``), to be agreed
    /// with the other ranks by ``agree_losses``; keys of other namespaces or ranks are
    /// ignored. Returns the number recorded. (``Scheduler.l3_lost`` on one rank of a
    /// tensor-parallel group raises ``LossNeedsAgreementError``: the ranks would diverge.)
    fn lost(&mut self, scheduler: &PyScheduler, keys: Vec<String>) -> usize {
        self.inner.lost(&scheduler.inner, &keys)
    }

    /// Records page hashes (32 bytes each) this rank found lost in its store, for an
    /// `OffloadManager` (whose engine keys are not the scheduler's); agreed by
    /// ``agree_losses``. Returns how many were new.
    fn lost_pages(&mut self, pages: Vec<Vec<u8>>) -> PyResult<usize> {
        Ok(self.inner.lost_pages(&page_hashes(pages)?))
    }

    /// Records page hashes (32 bytes each) this rank's L3 probe found (its shard of each is
    /// in its store), for an ``OffloadManager`` of several ranks (whose ``l3_found`` raises
    /// ``FoundNeedsAgreementError``); agreed by ``agree_found``, which marks only the pages
    /// every rank found. Returns how many were new. A hash of another size is a
    /// ``ValueError``, nothing recorded.
    fn found_pages(&mut self, pages: Vec<Vec<u8>>) -> PyResult<usize> {
        Ok(self.inner.found_pages(&page_hashes(pages)?))
    }

    /// Finds recorded and not yet agreed.
    fn pending_found(&self) -> usize {
        self.inner.pending_found()
    }

    /// This rank's found words (int64; as ``loss_words``, under another tag): what
    /// ``agree_found`` all-gathers. The next agreement checks and consumes exactly these.
    fn found_words<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        words_to_py(py, self.inner.found_words())
    }

    /// Agrees L3 finds across ranks: calls ``all_gather(words)`` with this rank's int64 found
    /// words, which must return every rank's (this rank's included; zero padding allowed),
    /// and marks in ``manager`` (an ``OffloadManager``) the pages every rank found: of runs
    /// probed from the same page, the shortest. Collective: every rank calls it at the same
    /// point, found or not. Raises ``AgreementError`` (nothing changed) on malformed words,
    /// when this rank's own are missing, or when they are not ``tp_ranks`` ranks' words.
    /// Returns the marks added.
    fn agree_found(
        slf: &Bound<'_, Self>,
        manager: &Bound<'_, PyOffloadManager>,
        all_gather: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let gathered = gather(slf, RankAgreement::found_words, all_gather)?;
        let mut me = slf.try_borrow_mut()?;
        let mut m = manager.try_borrow_mut()?;
        me.inner
            .apply_found(m.inner_mut(), &gathered)
            .map_err(agree_err)
    }

    /// This rank's loss journal overflowed: at the next agreement every rank clears every L3
    /// mark.
    fn lost_all(&mut self) {
        self.inner.lost_all()
    }

    /// Losses recorded and not yet agreed: ``(pages, overflowed)``.
    fn pending_losses(&self) -> (usize, bool) {
        self.inner.pending_losses()
    }

    /// This rank's loss words (int64; page hashes as bit patterns): what ``agree_losses``
    /// all-gathers. The next agreement checks and consumes exactly these; losses recorded
    /// meanwhile (another thread's ``lost`` while the words are gathered) wait for the next.
    fn loss_words<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        words_to_py(py, self.inner.loss_words())
    }

    /// Agrees L3 losses across ranks: calls ``all_gather(words)`` with this rank's int64
    /// words, which must return every rank's words (this rank's included; a list of int64
    /// arrays, zero padding allowed), and applies their union to ``scheduler`` (every L3 mark
    /// if some rank overflowed). Collective: every rank calls it once per step, at the same
    /// point. Raises ``AgreementError`` (nothing changed) on malformed words, when this
    /// rank's own are missing, or when they are not ``tp_ranks`` ranks' words. Returns the
    /// number of tree nodes whose L3 mark was cleared.
    fn agree_losses(
        slf: &Bound<'_, Self>,
        scheduler: &Bound<'_, PyAny>,
        all_gather: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let gathered = gather(slf, RankAgreement::loss_words, all_gather)?;
        let mut me = slf.try_borrow_mut()?;
        with_agreed(scheduler, |s| me.inner.apply_losses(s, &gathered))?.map_err(agree_err)
    }
}

/// The int64 arrays an ``all_gather`` returned, as words.
fn gathered_words(ret: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u64>>> {
    let type_err = || {
        pyo3::exceptions::PyTypeError::new_err(
            "all_gather must return a list of int64 arrays, one per rank",
        )
    };
    let mut gathered: Vec<Vec<u64>> = Vec::new();
    for item in ret.try_iter().map_err(|_| type_err())? {
        let a: PyReadonlyArray1<'_, i64> = item?.extract().map_err(|_| type_err())?;
        gathered.push(a.as_slice()?.iter().map(|&x| x as u64).collect());
    }
    Ok(gathered)
}

/// Page hashes (32 bytes each) from Python bytes.
fn page_hashes(pages: Vec<Vec<u8>>) -> PyResult<Vec<kvtier_radix::PageHash>> {
    let mut hs = Vec::with_capacity(pages.len());
    for b in pages {
        let h: [u8; 32] = b.as_slice().try_into().map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "a page hash is 32 bytes, got {}",
                b.len()
            ))
        })?;
        hs.push(kvtier_radix::PageHash(h));
    }
    Ok(hs)
}

/// u64 words as the int64 array collectives exchange (bit patterns kept).
fn words_to_py(py: Python<'_>, words: Vec<u64>) -> Bound<'_, PyArray1<i64>> {
    PyArray1::from_vec(py, words.into_iter().map(|x| x as i64).collect())
}
