//! The completion events, as Python classes, and their conversions to and from the
//! scheduler's `Event`.
//!
//! Why their own classes: an engine answers every op of a plan with exactly one event of its
//! kind, so each event is a small frozen class that compares by value; `ForwardDone` carries
//! its rows as columns (request ids, tokens, stop flags) for the same reason a plan's decode
//! rows are columns: a batch of 256 rows must not become 256 Python objects. Anything else
//! passed as an event is a `TypeError`.

use numpy::PyArray1;
use pyo3::prelude::*;

use kvtier_scheduler::{Event, OpId, RequestId, StepId, TokenOutput};

use super::py_bool;
use crate::convert::{bool_vec, u32_vec, u64_vec};

/// An `L3Query` came back: the first `hit_pages` keys exist in L3.
#[pyclass(frozen, eq, get_all, module = "kvtier", name = "L3QueryDone")]
#[derive(Clone, PartialEq, Eq)]
pub struct PyL3QueryDone {
    op: u64,
    hit_pages: u32,
}

#[pymethods]
impl PyL3QueryDone {
    #[new]
    fn new(op: u64, hit_pages: u32) -> Self {
        PyL3QueryDone { op, hit_pages }
    }
    fn __repr__(&self) -> String {
        format!("L3QueryDone(op={}, hit_pages={})", self.op, self.hit_pages)
    }
}

/// A `Prefetch` came back: its first `completed` pages arrived.
#[pyclass(frozen, eq, get_all, module = "kvtier", name = "PrefetchDone")]
#[derive(Clone, PartialEq, Eq)]
pub struct PyPrefetchDone {
    op: u64,
    completed: u32,
}

#[pymethods]
impl PyPrefetchDone {
    #[new]
    fn new(op: u64, completed: u32) -> Self {
        PyPrefetchDone { op, completed }
    }
    fn __repr__(&self) -> String {
        format!("PrefetchDone(op={}, completed={})", self.op, self.completed)
    }
}

macro_rules! success_event {
    ($rs:ident, $py:literal, $doc:literal) => {
        #[doc = $doc]
        #[pyclass(frozen, eq, get_all, module = "kvtier", name = $py)]
        #[derive(Clone, PartialEq, Eq)]
        pub struct $rs {
            op: u64,
            success: bool,
        }

        #[pymethods]
        impl $rs {
            #[new]
            #[pyo3(signature = (op, success = true))]
            fn new(op: u64, success: bool) -> Self {
                $rs { op, success }
            }
            fn __repr__(&self) -> String {
                format!(
                    concat!($py, "(op={}, success={})"),
                    self.op,
                    py_bool(self.success)
                )
            }
        }
    };
}

success_event!(
    PyLoadBackDone,
    "LoadBackDone",
    "A host → device copy finished."
);
success_event!(
    PyWriteBackDone,
    "WriteBackDone",
    "A device → host copy finished."
);
success_event!(PyBackUpDone, "BackUpDone", "A backup to L3 finished.");

/// A forward batch ran: one row per chunk/decode row, `tokens[i]` produced for `reqs[i]`
/// (ignored for non-final prefill chunks), `stops[i]` the engine's stop condition.
#[pyclass(frozen, module = "kvtier", name = "ForwardDone")]
pub struct PyForwardDone {
    #[pyo3(get)]
    step: u64,
    reqs: Vec<u64>,
    tokens: Vec<u32>,
    stops: Vec<bool>,
}

#[pymethods]
impl PyForwardDone {
    #[new]
    #[pyo3(signature = (step, reqs, tokens, stops = None))]
    fn new(
        step: u64,
        reqs: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        stops: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let (reqs, tokens, stops) = forward_columns(reqs, tokens, stops)?;
        Ok(PyForwardDone {
            step,
            reqs,
            tokens,
            stops,
        })
    }
    #[getter]
    fn reqs<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        PyArray1::from_slice(py, &self.reqs)
    }
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_slice(py, &self.tokens)
    }
    #[getter]
    fn stops<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        PyArray1::from_slice(py, &self.stops)
    }
    fn __len__(&self) -> usize {
        self.reqs.len()
    }
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        match other.cast::<PyForwardDone>() {
            Ok(o) => {
                let o = o.get();
                self.step == o.step
                    && self.reqs == o.reqs
                    && self.tokens == o.tokens
                    && self.stops == o.stops
            }
            Err(_) => false,
        }
    }
    fn __repr__(&self) -> String {
        format!("ForwardDone(step={}, rows={})", self.step, self.reqs.len())
    }
}

/// The columns of a forward result, checked for equal lengths.
pub fn forward_columns(
    reqs: &Bound<'_, PyAny>,
    tokens: &Bound<'_, PyAny>,
    stops: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Vec<u64>, Vec<u32>, Vec<bool>)> {
    let reqs = u64_vec(reqs, "reqs")?;
    let tokens = u32_vec(tokens, "tokens")?;
    let stops = match stops {
        Some(s) if !s.is_none() => bool_vec(s, "stops")?,
        _ => vec![false; reqs.len()],
    };
    if tokens.len() != reqs.len() || stops.len() != reqs.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "ForwardDone: reqs ({}), tokens ({}) and stops ({}) differ in length",
            reqs.len(),
            tokens.len(),
            stops.len()
        )));
    }
    Ok((reqs, tokens, stops))
}

/// The Rust `ForwardDone` event from columns.
pub fn forward_event(step: u64, reqs: &[u64], tokens: &[u32], stops: &[bool]) -> Event {
    Event::ForwardDone {
        step: StepId(step),
        outputs: reqs
            .iter()
            .zip(tokens)
            .zip(stops)
            .map(|((r, t), s)| TokenOutput {
                req: RequestId(*r),
                token: *t,
                stop: *s,
            })
            .collect(),
    }
}

/// Python event object → Rust event (TypeError for anything else).
pub fn event_from_py(ev: &Bound<'_, PyAny>) -> PyResult<Event> {
    if let Ok(e) = ev.cast::<PyForwardDone>() {
        let e = e.get();
        return Ok(forward_event(e.step, &e.reqs, &e.tokens, &e.stops));
    }
    if let Ok(e) = ev.cast::<PyL3QueryDone>() {
        let e = e.get();
        return Ok(Event::L3QueryDone {
            op: OpId(e.op),
            hit_pages: e.hit_pages,
        });
    }
    if let Ok(e) = ev.cast::<PyPrefetchDone>() {
        let e = e.get();
        return Ok(Event::PrefetchDone {
            op: OpId(e.op),
            completed: e.completed,
        });
    }
    if let Ok(e) = ev.cast::<PyLoadBackDone>() {
        let e = e.get();
        return Ok(Event::LoadBackDone {
            op: OpId(e.op),
            success: e.success,
        });
    }
    if let Ok(e) = ev.cast::<PyWriteBackDone>() {
        let e = e.get();
        return Ok(Event::WriteBackDone {
            op: OpId(e.op),
            success: e.success,
        });
    }
    if let Ok(e) = ev.cast::<PyBackUpDone>() {
        let e = e.get();
        return Ok(Event::BackUpDone {
            op: OpId(e.op),
            success: e.success,
        });
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "expected a kvtier event (L3QueryDone, PrefetchDone, LoadBackDone, WriteBackDone, BackUpDone, ForwardDone), got {}",
        ev.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    )))
}

/// Rust event → Python event object.
pub fn event_to_py(py: Python<'_>, ev: Event) -> PyResult<Py<PyAny>> {
    Ok(match ev {
        Event::L3QueryDone { op, hit_pages } => Py::new(
            py,
            PyL3QueryDone {
                op: op.0,
                hit_pages,
            },
        )?
        .into_any(),
        Event::PrefetchDone { op, completed } => Py::new(
            py,
            PyPrefetchDone {
                op: op.0,
                completed,
            },
        )?
        .into_any(),
        Event::LoadBackDone { op, success } => {
            Py::new(py, PyLoadBackDone { op: op.0, success })?.into_any()
        }
        Event::WriteBackDone { op, success } => {
            Py::new(py, PyWriteBackDone { op: op.0, success })?.into_any()
        }
        Event::BackUpDone { op, success } => {
            Py::new(py, PyBackUpDone { op: op.0, success })?.into_any()
        }
        Event::ForwardDone { step, outputs } => Py::new(
            py,
            PyForwardDone {
                step: step.0,
                reqs: outputs.iter().map(|o| o.req.0).collect(),
                tokens: outputs.iter().map(|o| o.token).collect(),
                stops: outputs.iter().map(|o| o.stop).collect(),
            },
        )?
        .into_any(),
    })
}

/// `kvtier._native.event_roundtrip(ev)`: Python → Rust → Python (tests).
#[pyfunction]
pub fn event_roundtrip(ev: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let e = event_from_py(ev)?;
    event_to_py(ev.py(), e)
}
