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

/// One rank's completions, reduced with the other ranks' once per step.
#[pyclass(module = "kvtier", name = "RankAgreement")]
#[derive(Default)]
pub struct PyRankAgreement {
    pub(crate) inner: RankAgreement,
}

/// What an agreement reduces over: a `Scheduler` or an `OffloadManager`.
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

    /// Records this rank's completion event of an op (not `ForwardDone`).
    fn push(&mut self, event: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.push(event_from_py(event)?).map_err(agree_err)
    }

    /// This rank does not run op `op` (`Scheduler.runs_here(op)` is False).
    fn skip(&mut self, op: u64) -> PyResult<()> {
        self.inner.skip(OpId(op)).map_err(agree_err)
    }

    /// Completions recorded and not yet agreed.
    fn pending(&self) -> usize {
        self.inner.pending()
    }

    /// This rank's contribution (int64, one value per op in flight in `scheduler`, a
    /// `Scheduler` or an `OffloadManager`).
    fn values<'py>(
        &self,
        py: Python<'py>,
        scheduler: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let v = with_agreed(scheduler, |s| self.inner.values(s))?;
        Ok(words_to_py(py, v))
    }

    /// Reduces: calls `all_reduce_min(values)` with this rank's int64 array, which must
    /// leave (in place, or return) the element-wise minimum over all ranks; returns the agreed
    /// events to feed to `scheduler` (`on_event` each, in order).
    fn reduce(
        &mut self,
        py: Python<'_>,
        scheduler: &Bound<'_, PyAny>,
        all_reduce_min: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let arr = self.values(py, scheduler)?;
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
        let evs =
            with_agreed(scheduler, |s| self.inner.apply_reduced(s, &v))?.map_err(agree_err)?;
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
        Ok(self.inner.lost_pages(&hs))
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
    /// all-gathers.
    fn loss_words<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
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
        &mut self,
        py: Python<'_>,
        scheduler: &Bound<'_, PyAny>,
        all_gather: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let words = self.loss_words(py);
        let ret = all_gather.call1((words,))?;
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
        with_agreed(scheduler, |s| self.inner.apply_losses(s, &gathered))?.map_err(agree_err)
    }
}

/// u64 words as the int64 array collectives exchange (bit patterns kept).
fn words_to_py(py: Python<'_>, words: Vec<u64>) -> Bound<'_, PyArray1<i64>> {
    PyArray1::from_vec(py, words.into_iter().map(|x| x as i64).collect())
}
