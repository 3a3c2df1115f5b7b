//! kvtier's eviction policies as a ranking function, for caches kvtier does not own.
//!
//! Why: an engine that keeps its own host cache (vLLM's offloading `CachePolicy`) can still
//! evict by kvtier's policies (`lru`, `freq-depth`) if it can ask for their ranks; the rank
//! is `EvictionPolicy::rank_of` of `kvtier-radix`, the same code the radix tree evicts by.
//! How: one call ranks a whole set of candidates (numpy columns in, one column out), so the
//! caller's Python does one vectorized call per eviction, not one per entry.

use numpy::PyArray1;
use pyo3::prelude::*;

use crate::convert::{u32_vec, u64_vec};

/// `kvtier.eviction_ranks(policy, last_access, last_use, uses, end_pages)`: the rank of each
/// entry under `policy` ("lru", "freq-depth", "freq-depth:C:M:D"); lowest is evicted first.
/// A bad policy is a `ConfigError`, columns of different lengths a `ValueError`.
#[pyfunction]
pub fn eviction_ranks<'py>(
    py: Python<'py>,
    policy: &str,
    last_access: &Bound<'py, PyAny>,
    last_use: &Bound<'py, PyAny>,
    uses: &Bound<'py, PyAny>,
    end_pages: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let p: kvtier_radix::EvictionPolicy = policy.parse().map_err(crate::errors::config_msg)?;
    let (a, l) = (
        u64_vec(last_access, "last_access")?,
        u64_vec(last_use, "last_use")?,
    );
    let (u, e) = (u32_vec(uses, "uses")?, u64_vec(end_pages, "end_pages")?);
    if l.len() != a.len() || u.len() != a.len() || e.len() != a.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "last_access, last_use, uses and end_pages must have the same length",
        ));
    }
    let out: Vec<u64> = (0..a.len())
        .map(|i| p.rank_of(a[i], l[i], u[i], e[i]))
        .collect();
    Ok(PyArray1::from_vec(py, out))
}
