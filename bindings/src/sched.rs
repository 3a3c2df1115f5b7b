//! `kvtier.Scheduler`: the Rust scheduler behind a Python class.
//!
//! Why the GIL is released: `submit` hashes the whole prompt (SHA-256 per page) and
//! `next_execution_plan` walks every running request; an engine with a tokenizer or a
//! detokenizer thread keeps those running meanwhile. Between calls the scheduler is behind
//! PyO3's borrow flag, so a second thread calling in while one is inside gets a
//! `RuntimeError` (already borrowed), never a data race.

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use kvtier_scheduler::{
    ExtraKey, HashScope, KvEvent, OpKind, RequestId, RequestSpec, Scheduler, ScopeLabel, Stats,
};

use crate::config::{config_from_py, config_to_dict};
use crate::convert::u32_vec;
use crate::errors::{config_err, sched_err};
use crate::plan::{PyPlan, convert_plan, event_from_py, forward_columns, forward_event};

/// The kvtier scheduler. Each step: `plan = s.next_execution_plan(now_ms)`, run the plan's
/// ops and forward, report each completion with `on_event` (or `forward_done`).
#[pyclass(module = "kvtier", name = "Scheduler")]
pub struct PyScheduler {
    pub(crate) inner: Scheduler,
}

pub(crate) fn usage_dict<'py>(
    py: Python<'py>,
    u: &kvtier_radix::TierUsage,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("capacity", u.capacity)?;
    d.set_item("free", u.free)?;
    d.set_item("held", u.held)?;
    d.set_item("cached", u.cached)?;
    d.set_item("locked", u.locked)?;
    Ok(d)
}

fn stats_dict<'py>(py: Python<'py>, s: &Stats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("submitted", s.submitted)?;
    d.set_item("finished", s.finished)?;
    d.set_item("aborted", s.aborted)?;
    d.set_item("failed", s.failed)?;
    d.set_item("retracted", s.retracted)?;
    d.set_item("device_hit_tokens", s.device_hit_tokens)?;
    d.set_item("device_hit_pages", s.device_hit_pages)?;
    d.set_item("host_hit_tokens", s.host_hit_tokens)?;
    d.set_item("host_hit_pages", s.host_hit_pages)?;
    d.set_item("l3_hit_tokens", s.l3_hit_tokens)?;
    d.set_item("l3_hit_pages", s.l3_hit_pages)?;
    d.set_item("computed_tokens", s.computed_tokens)?;
    d.set_item("l3_lost_nodes", s.l3_lost_nodes)?;
    d.set_item("demotions", s.demotions)?;
    d.set_item("backups_retrying", s.backups_retrying)?;
    d.set_item("backups_given_up", s.backups_given_up)?;
    d.set_item("backups_retried", s.backups_retried)?;
    d.set_item("backups_probed", s.backups_probed)?;
    d.set_item("internal_errors", s.internal_errors)?;
    d.set_item("ttft_ms_sum", s.ttft_ms_sum)?;
    d.set_item("ttft_count", s.ttft_count)?;
    let ops = PyDict::new(py);
    for (k, o) in &s.ops {
        let od = PyDict::new(py);
        od.set_item("issued", o.issued)?;
        od.set_item("succeeded", o.succeeded)?;
        od.set_item("failed", o.failed)?;
        od.set_item("latency_ms_sum", o.latency_ms_sum)?;
        od.set_item("latency_ms_max", o.latency_ms_max)?;
        let name: &'static str = (*k).into();
        ops.set_item(name, od)?;
    }
    d.set_item("ops", ops)?;
    d.set_item("waiting", s.waiting)?;
    d.set_item("running", s.running)?;
    d.set_item("prefetching", s.prefetching)?;
    d.set_item("device", usage_dict(py, &s.device)?)?;
    d.set_item("host", usage_dict(py, &s.host)?)?;
    d.set_item("plans", s.plans)?;
    Ok(d)
}

fn set_label(d: &Bound<'_, PyDict>, label: Option<&ScopeLabel>) -> PyResult<()> {
    d.set_item("cache_salt", label.and_then(|l| l.cache_salt.as_deref()))?;
    d.set_item("adapter", label.and_then(|l| l.adapter.as_deref()))
}

/// `extra_keys=[(start, end, digest), ...]` (digest `bytes` or `str`) → [`ExtraKey`]s.
pub(crate) fn extra_keys_from_py(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<ExtraKey>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for item in obj.try_iter()? {
        let item = item?;
        let (start, end, digest): (u32, u32, Bound<'_, PyAny>) = item.extract().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(
                "extra_keys: each item must be (start: int, end: int, digest: bytes | str)",
            )
        })?;
        let digest = if let Ok(b) = digest.cast::<PyBytes>() {
            b.as_bytes().to_vec()
        } else if let Ok(s) = digest.extract::<String>() {
            s.into_bytes()
        } else {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "extra_keys: digest must be bytes or str",
            ));
        };
        out.push(ExtraKey { start, end, digest });
    }
    Ok(out)
}

fn tier_name(t: kvtier_radix::TierKind) -> &'static str {
    match t {
        kvtier_radix::TierKind::Device => "device",
        _ => "host",
    }
}

fn hashes_array<'py>(
    py: Python<'py>,
    hs: &[kvtier_radix::PageHash],
) -> PyResult<Bound<'py, PyAny>> {
    let flat: Vec<u8> = hs.iter().flat_map(|h| h.0).collect();
    let n = hs.len();
    Ok(PyArray1::from_vec(py, flat).reshape([n, 32])?.into_any())
}

/// KV events as the Python dicts of `Scheduler.drain_kv_events`.
fn kv_events_list<'py>(py: Python<'py>, evs: Vec<KvEvent>) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for e in evs {
        let d = PyDict::new(py);
        match e {
            KvEvent::Stored {
                tier,
                parent,
                hashes,
                tokens,
                label,
            } => {
                set_label(&d, label.as_deref())?;
                d.set_item("type", "stored")?;
                d.set_item("tier", tier_name(tier))?;
                match parent {
                    Some(p) => d.set_item("parent", PyBytes::new(py, &p.0))?,
                    None => d.set_item("parent", py.None())?,
                }
                d.set_item("hashes", hashes_array(py, &hashes)?)?;
                d.set_item("tokens", PyArray1::from_vec(py, tokens))?;
            }
            KvEvent::Removed {
                tier,
                hashes,
                label,
            } => {
                set_label(&d, label.as_deref())?;
                d.set_item("type", "removed")?;
                d.set_item("tier", tier_name(tier))?;
                d.set_item("parent", py.None())?;
                d.set_item("hashes", hashes_array(py, &hashes)?)?;
            }
            // the events since the last drain overflowed: the "stored" ones that follow are
            // every copy held now
            KvEvent::Cleared => d.set_item("type", "cleared")?,
        }
        out.append(d)?;
    }
    Ok(out)
}

#[pymethods]
impl PyScheduler {
    /// Builds a scheduler from a `SchedulerConfig` (or a dict with its fields).
    /// Raises `ConfigError` naming the offending field.
    #[new]
    #[pyo3(signature = (config = None))]
    fn new(config: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let cfg = match config {
            Some(c) if !c.is_none() => config_from_py(c)?,
            _ => kvtier_scheduler::SchedulerConfig::default(),
        };
        cfg.validate().map_err(config_err)?;
        crate::config::check_memory(&cfg)?;
        let inner = Scheduler::new(cfg).map_err(config_err)?;
        Ok(PyScheduler { inner })
    }

    /// The configuration in force, as a dict of `SchedulerConfig` fields.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_to_dict(py, self.inner.config())
    }

    /// Adds a request. `prompt`: token ids (numpy integer array or sequence).
    /// `now_ms`: arrival time for latency statistics (default: the latest plan's clock).
    ///
    /// Scope (keyword-only): `cache_salt` (a tenant's salt: requests of different salts never
    /// share KV), `adapter` (a LoRA id), `extra_keys` (a sequence of `(start, end, digest)`
    /// multimodal spans, `digest` bytes or str). Unscoped requests share under SGLang keys.
    #[pyo3(signature = (req, prompt, max_new_tokens, now_ms = None, *, cache_salt = None, adapter = None, extra_keys = None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        py: Python<'_>,
        req: u64,
        prompt: &Bound<'_, PyAny>,
        max_new_tokens: u32,
        now_ms: Option<u64>,
        cache_salt: Option<String>,
        adapter: Option<String>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let prompt = u32_vec(prompt, "prompt")?;
        let spec = RequestSpec {
            cache_salt,
            adapter,
            extra_keys: extra_keys_from_py(extra_keys)?,
            ..RequestSpec::new(RequestId(req), prompt, max_new_tokens)
        };
        let s = &mut self.inner;
        py.detach(|| match now_ms {
            Some(t) => s.submit_at(spec, t),
            None => s.submit(spec),
        })
        .map_err(sched_err)
    }

    /// Aborts a request (deferred while one of its ops or forwards is in flight).
    fn abort(&mut self, req: u64) -> PyResult<()> {
        self.inner.abort(RequestId(req)).map_err(sched_err)
    }

    /// Feeds one completion event back. On error nothing changed.
    fn on_event(&mut self, py: Python<'_>, event: &Bound<'_, PyAny>) -> PyResult<()> {
        let ev = event_from_py(event)?;
        let s = &mut self.inner;
        py.detach(|| s.on_event(ev)).map_err(sched_err)
    }

    /// Reports a forward's results from columns (same as `on_event(ForwardDone(...))`).
    #[pyo3(signature = (step, reqs, tokens, stops = None))]
    fn forward_done(
        &mut self,
        py: Python<'_>,
        step: u64,
        reqs: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        stops: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (r, t, st) = forward_columns(reqs, tokens, stops)?;
        let ev = forward_event(step, &r, &t, &st);
        let s = &mut self.inner;
        py.detach(|| s.on_event(ev)).map_err(sched_err)
    }

    /// Reports the completion of many ops at once: `results[i]` answers `ops[i]`
    /// (hit pages for L3Query, completed pages for Prefetch, 0/1 success otherwise).
    /// The whole batch is checked before any of it is applied: on error nothing changed
    /// (resend the valid ones). Returns the number applied.
    fn ops_done(
        &mut self,
        py: Python<'_>,
        ops: &Bound<'_, PyAny>,
        kinds: Vec<String>,
        results: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let ops = crate::convert::u64_vec(ops, "ops")?;
        let res = crate::convert::u32_vec(results, "results")?;
        if ops.len() != kinds.len() || ops.len() != res.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "ops, kinds and results differ in length",
            ));
        }
        let mut evs = Vec::with_capacity(ops.len());
        for ((op, kind), r) in ops.iter().zip(&kinds).zip(&res) {
            let op = kvtier_scheduler::OpId(*op);
            use kvtier_scheduler::Event as E;
            evs.push(match kind.as_str() {
                "L3Query" => E::L3QueryDone { op, hit_pages: *r },
                "Prefetch" => E::PrefetchDone { op, completed: *r },
                "LoadBack" => E::LoadBackDone {
                    op,
                    success: *r != 0,
                },
                "WriteBack" => E::WriteBackDone {
                    op,
                    success: *r != 0,
                },
                "BackUp" => E::BackUpDone {
                    op,
                    success: *r != 0,
                },
                other => {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!(
                        "unknown op kind {other:?}"
                    )));
                }
            });
        }
        let s = &mut self.inner;
        py.detach(|| s.on_op_events(evs)).map_err(sched_err)
    }

    /// What the engine should do now (`now_ms`: the engine's clock, for prefetch timeouts).
    /// `digest=True` also computes `plan.digest` (tensor-parallel debug mode: compare it
    /// across ranks every step).
    #[pyo3(signature = (now_ms = 0, *, digest = false))]
    fn next_execution_plan(
        &mut self,
        py: Python<'_>,
        now_ms: u64,
        digest: bool,
    ) -> PyResult<PyPlan> {
        let s = &mut self.inner;
        let (plan, d) = py.detach(|| {
            let plan = s.next_execution_plan(now_ms);
            let d = digest.then(|| plan.digest());
            (plan, d)
        });
        convert_plan(py, plan, d)
    }

    /// Ids and kinds of the ops issued and not yet completed, by id: the same on every
    /// tensor-parallel rank (what `RankAgreement` reduces over).
    fn in_flight_ops(&self) -> Vec<(u64, &'static str)> {
        self.inner
            .in_flight_ops()
            .into_iter()
            .map(|(o, k)| (o.0, k.into()))
            .collect()
    }

    /// Whether this rank runs `op` (under `l3_sharing="replicated"` only the leader runs
    /// L3Query and BackUp; the others `RankAgreement.skip` them).
    fn runs_here(&self, op: &crate::plan::PyPlannedOp) -> bool {
        ALL_KINDS
            .into_iter()
            .find(|k| <&'static str>::from(*k) == op.kind_name())
            .is_none_or(|k| self.inner.runs_here(k))
    }

    /// Counters, queue lengths and pool usage, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.inner.stats())
    }

    /// Store/remove events of cached pages since the last call (needs
    /// `record_kv_events=True`): list of dicts `{"type": "stored" | "removed", "tier":
    /// "device" | "host", "parent": bytes | None, "hashes": (n, 32) uint8 array,
    /// "cache_salt": str | None, "adapter": str | None}` (the scope the pages belong to); a
    /// stored event also has "tokens": the pages' token ids, a uint32 array. If the events
    /// since the last call passed `kv_events_max_bytes` (nobody drained them), the list is
    /// `{"type": "cleared"}` (forget every copy) and then every copy held now, as "stored"
    /// events. To publish them to a router instead, see `KvEventPublisher.publish_from`.
    fn drain_kv_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        kv_events_list(py, self.inner.drain_kv_events())
    }

    /// Every copy the cache holds now, as "stored" events in `drain_kv_events`' format,
    /// parents before children (what a subscriber that missed the history rebuilds from).
    fn resident_kv_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        kv_events_list(py, self.inner.resident_kv_events())
    }

    /// L3 keys of a prompt's full pages under this scheduler's namespace and rank, for a
    /// request of the given scope (the same keywords as `submit`).
    #[pyo3(signature = (prompt, *, cache_salt = None, adapter = None, extra_keys = None))]
    fn l3_keys(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        cache_salt: Option<String>,
        adapter: Option<String>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<String>> {
        let toks = u32_vec(prompt, "prompt")?;
        let extra = extra_keys_from_py(extra_keys)?;
        let cfg = self.inner.config();
        let (ps, ns, rank) = (cfg.page_size, cfg.namespace.clone(), cfg.rank);
        Ok(py.detach(|| {
            let scope = HashScope::new(cache_salt.as_deref(), adapter.as_deref(), extra);
            let hs = scope.page_hashes(&toks, ps);
            ns.keys_for(ps, rank).keys(&hs)
        }))
    }

    /// L3 lost these objects (the store reported them evicted or removed): their pages are no
    /// longer taken to be in L3, so they are backed up again before host drops them. Keys of
    /// other namespaces or ranks are ignored. Returns the number of tree nodes cleared.
    /// Raises ``LossNeedsAgreementError`` (nothing changed) on one rank of several
    /// (``tp_ranks`` > 1): record the keys with ``RankAgreement.lost`` and agree them with
    /// ``RankAgreement.agree_losses``.
    fn l3_lost(&mut self, keys: Vec<String>) -> PyResult<usize> {
        self.inner.l3_lost(&keys).map_err(sched_err)
    }

    /// The store's loss report was incomplete (``L3Store.drain_losses`` said it overflowed):
    /// every L3 mark is cleared. Returns the number of tree nodes cleared. Raises
    /// ``LossNeedsAgreementError`` on one rank of several (``RankAgreement.lost_all``).
    fn l3_lost_all(&mut self) -> PyResult<usize> {
        self.inner.l3_lost_all().map_err(sched_err)
    }

    /// Number of live requests.
    fn live_requests(&self) -> usize {
        self.inner.live_requests()
    }

    /// Nothing in flight and nothing live.
    fn is_idle(&self) -> bool {
        self.inner.is_idle()
    }

    /// Ops not yet completed: those issued (``in_flight_ops``) and those created since the
    /// last plan (a finished request's write-back), which the next plan issues; an engine
    /// plans again while this is non-zero rather than wait for it to drop.
    fn ops_in_flight(&self) -> usize {
        self.inner.ops_in_flight()
    }

    /// The state name of a live request ("Submitted", "Prefetching", "Decoding", ...) or None.
    fn request_state(&self, req: u64) -> Option<String> {
        self.inner
            .request_state(RequestId(req))
            .map(|s| s.kind().to_string())
    }

    /// Tokens (prompt + generated) of a live request, or None.
    fn request_tokens<'py>(&self, py: Python<'py>, req: u64) -> Option<Bound<'py, PyArray1<u32>>> {
        self.inner
            .request_tokens(RequestId(req))
            .map(|t| PyArray1::from_slice(py, t))
    }

    /// Full consistency check (tests): raises `RuntimeError` describing the first violation.
    fn check(&self) -> PyResult<()> {
        self.inner
            .check()
            .map_err(pyo3::exceptions::PyRuntimeError::new_err)
    }

    fn __repr__(&self) -> String {
        let s = self.inner.stats();
        format!(
            "Scheduler(waiting={}, running={}, ops_in_flight={})",
            s.waiting,
            s.running,
            self.inner.ops_in_flight()
        )
    }
}

/// `kvtier.parse_l3_key(key)`: `(namespace, page_hash: bytes, rank)` of a kvtier L3 key
/// `"{namespace}:{hex digest}:{rank}"`, or `None` for anything else (the one key parser).
#[pyfunction]
pub fn parse_l3_key(py: Python<'_>, key: &str) -> Option<(String, Py<PyBytes>, u32)> {
    kvtier_radix::parse_l3_key(key).map(|k| {
        (
            k.namespace.to_string(),
            PyBytes::new(py, &k.page.0).unbind(),
            k.rank,
        )
    })
}

/// Op kind names in `OpKind` order (for stubs and tests).
#[pyfunction]
pub fn op_kinds() -> Vec<&'static str> {
    ALL_KINDS.into_iter().map(|k| k.into()).collect()
}

const ALL_KINDS: [OpKind; 5] = [
    OpKind::LoadBack,
    OpKind::WriteBack,
    OpKind::Prefetch,
    OpKind::BackUp,
    OpKind::L3Query,
];
