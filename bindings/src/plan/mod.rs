//! `ExecutionPlan`, `PlannedOp` and `PrefillChunk`, as Python classes (the completion events
//! are in `events`).
//!
//! Why this shape: a decode batch of 256 rows must not become 256 Python objects per step.
//! Decode rows are columns (numpy arrays: request ids, positions) and their page-table deltas
//! one CSR structure (`decode_table_from[i]` = -1 or the index the delta starts at;
//! `decode_table_pages[decode_table_offsets[i]:decode_table_offsets[i+1]]` = its pages). Page
//! ids of ops and chunks are `uint32` arrays that own the Rust vectors they came from (moved,
//! not copied). Ops and prefill chunks are few per step and stay objects. Keys are a list of
//! `str` (what store APIs take) and, on request, one fixed-width numpy `S` array over a
//! single bytes buffer.

mod events;

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use kvtier_scheduler::{
    DevicePageId, ExecutionPlan, HostPageId, OpSpec, Outcome, PageTableDelta, PlannedOp,
    PrefillChunk, TierPages,
};

use crate::convert::u32_vec;

pub use events::{
    PyBackUpDone, PyForwardDone, PyL3QueryDone, PyLoadBackDone, PyPrefetchDone, PyWriteBackDone,
    event_from_py, event_roundtrip, event_to_py, forward_columns, forward_event,
};

fn py_opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "None".to_string(), |x| x.to_string())
}

fn py_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

fn dev_ids(v: Vec<DevicePageId>) -> Vec<u32> {
    v.into_iter().map(|p| p.index()).collect()
}

fn host_ids(v: Vec<HostPageId>) -> Vec<u32> {
    v.into_iter().map(|p| p.index()).collect()
}

fn tier_pages(t: TierPages) -> (&'static str, Vec<u32>) {
    match t {
        TierPages::Device(p) => ("device", dev_ids(p)),
        TierPages::Host(p) => ("host", host_ids(p)),
    }
}

fn arr_u32(py: Python<'_>, v: Vec<u32>) -> Py<PyArray1<u32>> {
    PyArray1::from_vec(py, v).unbind()
}

fn arr_u64(py: Python<'_>, v: Vec<u64>) -> Py<PyArray1<u64>> {
    PyArray1::from_vec(py, v).unbind()
}

/// One cache operation of a plan. Answer it with exactly one completion event of its kind.
#[pyclass(frozen, module = "kvtier", name = "PlannedOp")]
pub struct PyPlannedOp {
    /// The op's id (pass it back in the completion event).
    #[pyo3(get)]
    id: u64,
    /// "LoadBack", "WriteBack", "Prefetch", "BackUp" or "L3Query".
    #[pyo3(get)]
    kind: &'static str,
    /// The request the op serves (None for cache-only backups).
    #[pyo3(get)]
    req: Option<u64>,
    /// The forward of this plan reads what this op writes: finish it first.
    #[pyo3(get)]
    before_forward: bool,
    /// Tier of `src` ("device", "host") or None (L3 is the source: L3Query, Prefetch).
    #[pyo3(get)]
    src_tier: Option<&'static str>,
    /// Tier of `dst` ("device", "host") or None (L3 is the destination: BackUp).
    #[pyo3(get)]
    dst_tier: Option<&'static str>,
    /// Source page ids (uint32).
    #[pyo3(get)]
    src: Py<PyArray1<u32>>,
    /// Destination page ids (uint32).
    #[pyo3(get)]
    dst: Py<PyArray1<u32>>,
    keys: Vec<String>,
}

#[pymethods]
impl PyPlannedOp {
    /// L3 keys (L3Query, Prefetch, BackUp), page `i` ↔ key `i`; empty otherwise.
    #[getter]
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.keys)
    }

    /// Number of keys.
    #[getter]
    fn num_keys(&self) -> usize {
        self.keys.len()
    }

    /// The keys as one numpy array of dtype `S<width>` viewing a single bytes buffer.
    fn keys_array<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let w = self.keys.iter().map(|k| k.len()).max().unwrap_or(0).max(1);
        let mut flat = vec![0u8; w * self.keys.len()];
        for (i, k) in self.keys.iter().enumerate() {
            flat[i * w..i * w + k.len()].copy_from_slice(k.as_bytes());
        }
        let b = PyBytes::new(py, &flat);
        let np = py.import("numpy")?;
        np.call_method1("frombuffer", (b, format!("S{w}")))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "PlannedOp(id={}, kind={}, req={}, before_forward={}, pages={}, keys={})",
            self.id,
            self.kind,
            py_opt(self.req),
            py_bool(self.before_forward),
            self.src
                .bind(py)
                .len()
                .unwrap_or(0)
                .max(self.dst.bind(py).len().unwrap_or(0)),
            self.keys.len()
        )
    }
}

fn convert_op(py: Python<'_>, op: PlannedOp) -> PyPlannedOp {
    let (src_tier, src, dst_tier, dst, keys) = match op.spec {
        OpSpec::L3Query { keys } => (None, Vec::new(), None, Vec::new(), keys),
        OpSpec::Prefetch { keys, dst } => {
            let (t, d) = tier_pages(dst);
            (None, Vec::new(), Some(t), d, keys)
        }
        OpSpec::LoadBack { src, dst } => (
            Some("host"),
            host_ids(src),
            Some("device"),
            dev_ids(dst),
            Vec::new(),
        ),
        OpSpec::WriteBack { src, dst } => (
            Some("device"),
            dev_ids(src),
            Some("host"),
            host_ids(dst),
            Vec::new(),
        ),
        OpSpec::BackUp { keys, src } => {
            let (t, s) = tier_pages(src);
            (Some(t), s, None, Vec::new(), keys)
        }
    };
    PyPlannedOp {
        id: op.id.0,
        kind: op.kind.into(),
        req: op.req.map(|r| r.0),
        before_forward: op.before_forward,
        src_tier,
        dst_tier,
        src: arr_u32(py, src),
        dst: arr_u32(py, dst),
        keys,
    }
}

/// A prefill chunk: compute tokens `start .. start + len` of request `req`.
#[pyclass(frozen, module = "kvtier", name = "PrefillChunk")]
pub struct PyPrefillChunk {
    #[pyo3(get)]
    req: u64,
    #[pyo3(get)]
    start: u32,
    #[pyo3(get)]
    len: u32,
    /// This chunk ends the prompt (its row yields the first new token).
    #[pyo3(get)]
    last: bool,
    /// Page-table delta: entries from `table_from` on are replaced by `table_pages`
    /// (None: no change).
    #[pyo3(get)]
    table_from: Option<u32>,
    #[pyo3(get)]
    table_pages: Py<PyArray1<u32>>,
    /// The chunk's tokens (uint32).
    #[pyo3(get)]
    tokens: Py<PyArray1<u32>>,
    /// Ops writing pages this chunk reads (they complete before the forward's result).
    #[pyo3(get)]
    waits_for: Vec<u64>,
}

#[pymethods]
impl PyPrefillChunk {
    fn __repr__(&self) -> String {
        format!(
            "PrefillChunk(req={}, start={}, len={}, last={}, table_from={}, waits_for={:?})",
            self.req,
            self.start,
            self.len,
            py_bool(self.last),
            py_opt(self.table_from),
            self.waits_for
        )
    }
}

fn convert_chunk(py: Python<'_>, c: PrefillChunk) -> PyPrefillChunk {
    let (table_from, pages) = match c.table {
        Some(PageTableDelta { from, pages }) => (Some(from), dev_ids(pages)),
        None => (None, Vec::new()),
    };
    PyPrefillChunk {
        req: c.req.0,
        start: c.start,
        len: c.len,
        last: c.last,
        table_from,
        table_pages: arr_u32(py, pages),
        tokens: arr_u32(py, c.tokens),
        waits_for: c.waits_for.iter().map(|o| o.0).collect(),
    }
}

/// What the engine should do this step.
#[pyclass(frozen, module = "kvtier", name = "ExecutionPlan")]
pub struct PyPlan {
    /// The forward step's id (None: nothing to compute).
    #[pyo3(get)]
    step: Option<u64>,
    /// Cache ops to start now (list of PlannedOp).
    #[pyo3(get)]
    ops: Py<PyList>,
    /// In-flight prefetch op ids to stop now (answer them with PrefetchDone of what arrived).
    #[pyo3(get)]
    terminate_prefetch: Vec<u64>,
    /// Prefill chunks of the forward (list of PrefillChunk).
    #[pyo3(get)]
    prefill: Py<PyList>,
    /// Decode rows: request ids (uint64).
    #[pyo3(get)]
    decode_reqs: Py<PyArray1<u64>>,
    /// Decode rows: position of the token computed (uint32).
    #[pyo3(get)]
    decode_positions: Py<PyArray1<u32>>,
    /// Decode rows: -1 (no page-table change) or the index the delta starts at (int64).
    #[pyo3(get)]
    decode_table_from: Py<PyArray1<i64>>,
    /// CSR offsets into `decode_table_pages`, one more than rows (uint64).
    #[pyo3(get)]
    decode_table_offsets: Py<PyArray1<u64>>,
    /// All decode rows' delta pages, concatenated (uint32 device page ids).
    #[pyo3(get)]
    decode_table_pages: Py<PyArray1<u32>>,
    ended: Vec<(u64, &'static str)>,
    /// Requests preempted since the last plan (their page tables are void).
    #[pyo3(get)]
    retracted: Vec<u64>,
    /// `ExecutionPlan::digest()` when asked for (`next_execution_plan(..., digest=True)`):
    /// equal on every tensor-parallel rank that planned the same step; else None.
    #[pyo3(get)]
    digest: Option<u64>,
    num_decode: usize,
}

fn outcome_name(o: Outcome) -> &'static str {
    match o {
        Outcome::Finished => "finished",
        Outcome::Aborted => "aborted",
        Outcome::Failed => "failed",
    }
}

#[pymethods]
impl PyPlan {
    /// Requests that ended since the last plan: list of (request id, "finished" | "aborted" |
    /// "failed"); their page tables are void.
    #[getter]
    fn ended<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items: Vec<Bound<'py, PyTuple>> = self
            .ended
            .iter()
            .map(|(r, o)| {
                PyTuple::new(
                    py,
                    [
                        r.into_pyobject(py)?.into_any(),
                        o.into_pyobject(py)?.into_any(),
                    ],
                )
            })
            .collect::<PyResult<_>>()?;
        PyList::new(py, items)
    }

    /// Number of decode rows.
    #[getter]
    fn num_decode(&self) -> usize {
        self.num_decode
    }

    /// Rows in the forward (prefill chunks + decode rows).
    #[getter]
    fn num_rows(&self, py: Python<'_>) -> usize {
        self.num_decode + self.prefill.bind(py).len()
    }

    /// Whether the plan asks for nothing (no op, no forward, nothing to stop).
    fn is_empty(&self, py: Python<'_>) -> bool {
        self.step.is_none() && self.ops.bind(py).is_empty() && self.terminate_prefetch.is_empty()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "ExecutionPlan(step={}, ops={}, prefill={}, decode={}, terminate_prefetch={}, ended={}, retracted={})",
            py_opt(self.step),
            self.ops.bind(py).len(),
            self.prefill.bind(py).len(),
            self.num_decode,
            self.terminate_prefetch.len(),
            self.ended.len(),
            self.retracted.len()
        )
    }
}

impl PyPlannedOp {
    pub(crate) fn kind_name(&self) -> &'static str {
        self.kind
    }
}

/// Builds the Python plan: columns for decode rows, objects for ops and chunks.
pub fn convert_plan(py: Python<'_>, plan: ExecutionPlan, digest: Option<u64>) -> PyResult<PyPlan> {
    let n = plan.forward.decode.len();
    let mut reqs = Vec::with_capacity(n);
    let mut pos = Vec::with_capacity(n);
    let mut from = Vec::with_capacity(n);
    let mut offs = Vec::with_capacity(n + 1);
    let mut pages: Vec<u32> = Vec::new();
    offs.push(0u64);
    for d in plan.forward.decode {
        reqs.push(d.req.0);
        pos.push(d.position);
        match d.table {
            Some(t) => {
                from.push(i64::from(t.from));
                pages.extend(t.pages.iter().map(|p| p.index()));
            }
            None => from.push(-1),
        }
        offs.push(pages.len() as u64);
    }
    let ops: Vec<Bound<'_, PyPlannedOp>> = plan
        .ops
        .into_iter()
        .map(|o| Bound::new(py, convert_op(py, o)))
        .collect::<PyResult<_>>()?;
    let chunks: Vec<Bound<'_, PyPrefillChunk>> = plan
        .forward
        .prefill
        .into_iter()
        .map(|c| Bound::new(py, convert_chunk(py, c)))
        .collect::<PyResult<_>>()?;
    Ok(PyPlan {
        step: plan.forward.step.map(|s| s.0),
        ops: PyList::new(py, ops)?.unbind(),
        terminate_prefetch: plan.terminate_prefetch.iter().map(|o| o.0).collect(),
        prefill: PyList::new(py, chunks)?.unbind(),
        decode_reqs: arr_u64(py, reqs),
        decode_positions: arr_u32(py, pos),
        decode_table_from: PyArray1::from_vec(py, from).unbind(),
        decode_table_offsets: arr_u64(py, offs),
        decode_table_pages: arr_u32(py, pages),
        digest,
        ended: plan
            .ended
            .iter()
            .map(|(r, o)| (r.0, outcome_name(*o)))
            .collect(),
        retracted: plan.retracted.iter().map(|r| r.0).collect(),
        num_decode: n,
    })
}

/// `kvtier.page_hashes(tokens, page_size, *, cache_salt=None, adapter=None, extra_keys=None)`:
/// the chained SHA-256 of every full page, as an `(n, 32)` uint8 array. Unscoped it is
/// SGLang's chain (see docs/page-keys.md); a scope seeds and marks it as `submit` does.
#[pyfunction]
#[pyo3(signature = (tokens, page_size, *, cache_salt = None, adapter = None, extra_keys = None))]
pub fn page_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    page_size: usize,
    cache_salt: Option<String>,
    adapter: Option<String>,
    extra_keys: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray2<u8>>> {
    if page_size == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "page_size must be positive",
        ));
    }
    let toks = u32_vec(tokens, "tokens")?;
    let extra = crate::sched::extra_keys_from_py(extra_keys)?;
    let hs = py.detach(|| {
        kvtier_radix::HashScope::new(cache_salt.as_deref(), adapter.as_deref(), extra)
            .page_hashes(&toks, page_size)
    });
    let flat: Vec<u8> = hs.iter().flat_map(|h| h.0).collect();
    let n = hs.len();
    PyArray1::from_vec(py, flat).reshape([n, 32])
}
