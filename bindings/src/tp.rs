//! `kvtier.RankAgreement`: tensor-parallel agreement from Python (see
//! `kvtier_scheduler::RankAgreement` for the contract).
//!
//! Why the reduction is the caller's: kvtier does not own the process group. One call per
//! step gives the engine an int64 numpy array (one value per op in flight); it reduces it
//! in place with the element-wise minimum over ranks — e.g.
//! `t = torch.from_numpy(v); torch.distributed.all_reduce(t, op=ReduceOp.MIN)` — and gets the
//! agreed completion events back to feed to its scheduler.

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;

use kvtier_scheduler::{AgreementError, OpId, RankAgreement};

use crate::plan::{event_from_py, event_to_py};
use crate::sched::PyScheduler;

fn agree_err(e: AgreementError) -> PyErr {
    crate::errors::base::AgreementError::new_err(e.to_string())
}

/// One rank's completions, reduced with the other ranks' once per step.
#[pyclass(module = "kvtier", name = "RankAgreement")]
#[derive(Default)]
pub struct PyRankAgreement {
    inner: RankAgreement,
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

    /// This rank's contribution (int64, one value per op in flight in `scheduler`).
    fn values<'py>(&self, py: Python<'py>, scheduler: &PyScheduler) -> Bound<'py, PyArray1<i64>> {
        let v: Vec<i64> = self
            .inner
            .values(&scheduler.inner)
            .into_iter()
            .map(|x| x as i64)
            .collect();
        PyArray1::from_vec(py, v)
    }

    /// Reduces: calls `all_reduce_min(values)` with this rank's int64 array, which must
    /// leave (in place, or return) the element-wise minimum over all ranks; returns the agreed
    /// events to feed to `scheduler` (`on_event` each, in order).
    fn reduce(
        &mut self,
        py: Python<'_>,
        scheduler: &PyScheduler,
        all_reduce_min: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let arr = self.values(py, scheduler);
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
        let evs = self
            .inner
            .apply_reduced(&scheduler.inner, &v)
            .map_err(agree_err)?;
        evs.into_iter().map(|e| event_to_py(py, e)).collect()
    }
}
