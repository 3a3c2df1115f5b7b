//! `kvtier.QueryResults`: what one batched metadata query found (sizes, replica metadata,
//! lease deadlines), held in Rust so a prefetch can read with it later without a second lookup.

use numpy::PyArray1;
use pyo3::prelude::*;

use kvtier_l3::{L3Result, QueryResult};

use super::code_of;

/// Results of `L3Store.batch_query`: replica metadata and lease deadlines, reusable by
/// `batch_get_with_query` until the lease passes (then -707 and a new query is needed).
#[pyclass(frozen, module = "kvtier", name = "QueryResults")]
pub struct PyQueryResults {
    pub(super) results: Vec<L3Result<QueryResult>>,
}

#[pymethods]
impl PyQueryResults {
    fn __len__(&self) -> usize {
        self.results.len()
    }

    /// Per key: 0 if found, else Mooncake's negative code (-704 not found, ...), int64.
    #[getter]
    fn codes<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_vec(py, self.results.iter().map(code_of).collect())
    }

    /// Per key: object size in bytes (0 if not found), uint64.
    #[getter]
    fn sizes<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        PyArray1::from_vec(
            py,
            self.results
                .iter()
                .map(|r| r.as_ref().map(|q| q.size).unwrap_or(0))
                .collect(),
        )
    }

    /// Per key: lease deadline (ms on the store's clock, see `L3Store.now_ms`), 0 if not found.
    #[getter]
    fn lease_deadline_ms<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        PyArray1::from_vec(
            py,
            self.results
                .iter()
                .map(|r| r.as_ref().map(|q| q.lease_deadline_ms).unwrap_or(0))
                .collect(),
        )
    }

    /// Number of leading keys found (the L3 hit of a prefix).
    fn hit_prefix(&self) -> usize {
        self.results.iter().take_while(|r| r.is_ok()).count()
    }

    /// Number of leading keys found whose lease still holds at `now_ms`.
    fn valid_prefix(&self, now_ms: u64) -> usize {
        self.results
            .iter()
            .take_while(|r| matches!(r, Ok(q) if q.lease_deadline_ms > now_ms))
            .count()
    }

    /// Earliest lease deadline among keys `offset .. offset + n` (None if any is missing,
    /// out of range, or n = 0).
    #[pyo3(signature = (n, offset = 0))]
    fn min_deadline(&self, n: usize, offset: usize) -> Option<u64> {
        let end = offset.checked_add(n)?;
        if n == 0 || end > self.results.len() {
            return None;
        }
        self.results[offset..end]
            .iter()
            .map(|r| r.as_ref().ok().map(|q| q.lease_deadline_ms))
            .try_fold(u64::MAX, |acc, d| d.map(|d| acc.min(d)))
    }

    /// The keys queried.
    #[getter]
    fn keys(&self) -> Vec<Option<String>> {
        self.results
            .iter()
            .map(|r| r.as_ref().ok().map(|q| q.key.clone()))
            .collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "QueryResults(keys={}, hit_prefix={})",
            self.results.len(),
            self.hit_prefix()
        )
    }
}
