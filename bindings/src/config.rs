//! `SchedulerConfig` between Python and Rust.
//!
//! Why the Python class is a dataclass (in `kvtier/__init__.py`) and not a `#[pyclass]`: it
//! gets equality, `repr`, `dataclasses.replace`, pickling and keyword construction for free,
//! and an engine can build it from its own config dict. This module reads any object with the
//! dataclass's attributes (or a plain dict with those keys) into the Rust
//! [`SchedulerConfig`], naming the field in every type error, and writes a Rust config back as
//! a dict of the same keys — the round trip `dict → Rust → dict` is the identity.
//!
//! Policies are flattened to strings plus their parameters:
//! `prefetch_stop` ∈ {"best_effort", "wait_complete", "timeout"} with
//! `prefetch_timeout_base_ms`, `prefetch_timeout_per_1k_tokens_ms`; `write_policy` ∈
//! {"write_through", "write_through_selective", "write_back"} with `write_hit_threshold`;
//! `retraction` ∈ {"latest_arrival", "fewest_generated", "most_pages"}; `l3_sharing` ∈
//! {"per_rank", "replicated"} with `l3_leader_rank`; `eviction` ∈ {"lru", "adaptive", "freq-depth",
//! "freq-depth:CREDIT:MAX_USES:DEBIT"}; `host_admission` ∈ {"on-finish",
//! "on-device-eviction:AHEAD_PAGES", "adaptive:AHEAD_PAGES" (with eviction "adaptive")};
//! `queue_protection` ∈ {"off", "waiting"}; `shadow_sample_salt` and `shadow_full_size_pages`
//! integers (eviction "shadow");
//! `namespace` is a dict
//! with keys model, dtype, layout, tenant, adapter; `tp_ranks` is the tensor-parallel group's
//! size (above 1, direct loss reports are refused: see `kvtier_scheduler::SchedulerConfig`).

use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvtier_scheduler::{
    KeyNamespace, L3Sharing, PrefetchStopPolicy, RetractionPolicy, SchedulerConfig, WritePolicy,
};

use crate::errors::config_err;

/// Every key of the flattened configuration, in the dataclass's field order.
pub const FIELDS: &[&str] = &[
    "page_size",
    "device_pages",
    "host_pages",
    "max_batch_size",
    "token_budget",
    "chunked_prefill_size",
    "mixed_prefill_decode",
    "host_enabled",
    "l3_enabled",
    "prefetch_threshold",
    "prefetch_stop",
    "prefetch_timeout_base_ms",
    "prefetch_timeout_per_1k_tokens_ms",
    "write_policy",
    "write_hit_threshold",
    "keep_device_after_write_back",
    "retraction",
    "max_context_tokens",
    "namespace",
    "rank",
    "l3_sharing",
    "l3_leader_rank",
    "record_kv_events",
    "kv_events_max_bytes",
    "tenant_quota_device_pages",
    "tenant_quota_host_pages",
    "eviction",
    "host_admission",
    "queue_protection",
    "tp_ranks",
    "shadow_sample_salt",
    "shadow_full_size_pages",
];

/// Reads one field from a dict (by key) or any object (by attribute); `None` when absent.
fn field<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    if let Ok(d) = obj.cast::<PyDict>() {
        return d.get_item(name);
    }
    match obj.getattr(name) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(obj.py()) => Ok(None),
        Err(e) => Err(e),
    }
}

fn get<'py, T: FromPyObjectOwned<'py>>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    default: T,
) -> PyResult<T> {
    match field(obj, name)? {
        None => Ok(default),
        Some(v) => v.extract::<T>().map_err(|e| {
            let e: PyErr = e.into();
            let detail = e.value(obj.py()).to_string();
            if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) {
                pyo3::exceptions::PyOverflowError::new_err(format!(
                    "SchedulerConfig.{name}: out of range ({detail})"
                ))
            } else {
                PyTypeError::new_err(format!("SchedulerConfig.{name}: wrong type ({detail})"))
            }
        }),
    }
}

/// Python object (dataclass, any object with the attributes, or dict) → Rust config.
/// Unknown dict keys are an error (a typo would otherwise be silently ignored).
pub fn config_from_py(obj: &Bound<'_, PyAny>) -> PyResult<SchedulerConfig> {
    if obj.cast::<PyDict>().is_err() {
        let missing: Vec<&str> = FIELDS
            .iter()
            .copied()
            .filter(|f| !obj.hasattr(*f).unwrap_or(false))
            .collect();
        if !missing.is_empty() {
            return Err(PyTypeError::new_err(format!(
                "expected a SchedulerConfig or a dict, got {} (missing {})",
                obj.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default(),
                missing.join(", ")
            )));
        }
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        for k in d.keys() {
            let k: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err("SchedulerConfig keys must be str"))?;
            if !FIELDS.contains(&k.as_str()) {
                return Err(PyKeyError::new_err(format!(
                    "unknown SchedulerConfig field {k:?}"
                )));
            }
        }
    }
    let d = SchedulerConfig::default();
    let (def_base, def_per_1k) = match d.prefetch_stop {
        PrefetchStopPolicy::Timeout {
            base_ms,
            per_1k_tokens_ms,
        } => (base_ms, per_1k_tokens_ms),
        _ => (50, 10),
    };
    let stop: String = get(obj, "prefetch_stop", "timeout".to_string())?;
    let base_ms: u64 = get(obj, "prefetch_timeout_base_ms", def_base)?;
    let per_1k: u64 = get(obj, "prefetch_timeout_per_1k_tokens_ms", def_per_1k)?;
    let prefetch_stop = match stop.as_str() {
        "best_effort" => PrefetchStopPolicy::BestEffort,
        "wait_complete" => PrefetchStopPolicy::WaitComplete,
        "timeout" => PrefetchStopPolicy::Timeout {
            base_ms,
            per_1k_tokens_ms: per_1k,
        },
        other => {
            return Err(PyValueError::new_err(format!(
                "SchedulerConfig.prefetch_stop: {other:?} is not one of best_effort, wait_complete, timeout"
            )));
        }
    };
    let wp: String = get(obj, "write_policy", "write_through".to_string())?;
    let hit_threshold: u32 = get(obj, "write_hit_threshold", 1)?;
    let write_policy = match wp.as_str() {
        "write_through" => WritePolicy::WriteThrough,
        "write_through_selective" => WritePolicy::WriteThroughSelective { hit_threshold },
        "write_back" => WritePolicy::WriteBack,
        other => {
            return Err(PyValueError::new_err(format!(
                "SchedulerConfig.write_policy: {other:?} is not one of write_through, write_through_selective, write_back"
            )));
        }
    };
    let rp: String = get(obj, "retraction", "latest_arrival".to_string())?;
    let retraction = match rp.as_str() {
        "latest_arrival" => RetractionPolicy::LatestArrival,
        "fewest_generated" => RetractionPolicy::FewestGenerated,
        "most_pages" => RetractionPolicy::MostPages,
        other => {
            return Err(PyValueError::new_err(format!(
                "SchedulerConfig.retraction: {other:?} is not one of latest_arrival, fewest_generated, most_pages"
            )));
        }
    };
    let namespace = match field(obj, "namespace")? {
        None => d.namespace.clone(),
        Some(v) if v.is_none() => d.namespace.clone(),
        Some(v) => {
            let nd = v.cast::<PyDict>().map_err(|_| {
                PyTypeError::new_err("SchedulerConfig.namespace: expected a dict of str")
            })?;
            let mut ns = KeyNamespace::default();
            for (k, val) in nd.iter() {
                let k: String = k.extract().map_err(|_| {
                    PyTypeError::new_err("SchedulerConfig.namespace: keys must be str")
                })?;
                let val: String = val.extract().map_err(|_| {
                    PyTypeError::new_err(format!("SchedulerConfig.namespace[{k:?}]: expected str"))
                })?;
                match k.as_str() {
                    "model" => ns.model = val,
                    "dtype" => ns.dtype = val,
                    "layout" => ns.layout = val,
                    "tenant" => ns.tenant = val,
                    "adapter" => ns.adapter = val,
                    _ => {
                        return Err(PyKeyError::new_err(format!(
                            "SchedulerConfig.namespace: unknown key {k:?} (model, dtype, layout, tenant, adapter)"
                        )));
                    }
                }
            }
            ns
        }
    };
    let sharing: String = get(obj, "l3_sharing", "per_rank".to_string())?;
    let leader: u32 = get(obj, "l3_leader_rank", 0)?;
    let l3_sharing = match sharing.as_str() {
        "per_rank" => L3Sharing::PerRank,
        "replicated" => L3Sharing::Replicated { leader },
        other => {
            return Err(PyValueError::new_err(format!(
                "SchedulerConfig.l3_sharing: {other:?} is not one of per_rank, replicated"
            )));
        }
    };
    Ok(SchedulerConfig {
        page_size: get(obj, "page_size", d.page_size)?,
        device_pages: get(obj, "device_pages", d.device_pages)?,
        host_pages: get(obj, "host_pages", d.host_pages)?,
        max_batch_size: get(obj, "max_batch_size", d.max_batch_size)?,
        token_budget: get(obj, "token_budget", d.token_budget)?,
        chunked_prefill_size: get(obj, "chunked_prefill_size", d.chunked_prefill_size)?,
        mixed_prefill_decode: get(obj, "mixed_prefill_decode", d.mixed_prefill_decode)?,
        host_enabled: get(obj, "host_enabled", d.host_enabled)?,
        l3_enabled: get(obj, "l3_enabled", d.l3_enabled)?,
        prefetch_threshold: get(obj, "prefetch_threshold", d.prefetch_threshold)?,
        prefetch_stop,
        write_policy,
        keep_device_after_write_back: get(
            obj,
            "keep_device_after_write_back",
            d.keep_device_after_write_back,
        )?,
        retraction,
        max_context_tokens: get(obj, "max_context_tokens", d.max_context_tokens)?,
        namespace,
        rank: get(obj, "rank", d.rank)?,
        tp_ranks: get(obj, "tp_ranks", d.tp_ranks)?,
        shadow_sample_salt: get(obj, "shadow_sample_salt", d.shadow_sample_salt)?,
        shadow_full_size_pages: get(obj, "shadow_full_size_pages", d.shadow_full_size_pages)?,
        l3_sharing,
        tenant_quota: kvtier_scheduler::TenantQuota {
            device_pages: get(obj, "tenant_quota_device_pages", None)?,
            host_pages: get(obj, "tenant_quota_host_pages", None)?,
        },
        record_kv_events: get(obj, "record_kv_events", d.record_kv_events)?,
        kv_events_max_bytes: get(obj, "kv_events_max_bytes", d.kv_events_max_bytes)?,
        eviction: {
            let e: String = get(obj, "eviction", d.eviction.to_string())?;
            e.parse().map_err(|m: String| {
                PyValueError::new_err(format!("SchedulerConfig.eviction: {m}"))
            })?
        },
        host_admission: {
            let h: String = get(obj, "host_admission", d.host_admission.to_string())?;
            h.parse().map_err(|m: String| {
                PyValueError::new_err(format!("SchedulerConfig.host_admission: {m}"))
            })?
        },
        queue_protection: {
            let q: String = get(obj, "queue_protection", d.queue_protection.to_string())?;
            q.parse().map_err(|m: String| {
                PyValueError::new_err(format!("SchedulerConfig.queue_protection: {m}"))
            })?
        },
    })
}

/// Rust config → dict with the dataclass's keys.
pub fn config_to_dict<'py>(py: Python<'py>, c: &SchedulerConfig) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("page_size", c.page_size)?;
    d.set_item("device_pages", c.device_pages)?;
    d.set_item("host_pages", c.host_pages)?;
    d.set_item("max_batch_size", c.max_batch_size)?;
    d.set_item("token_budget", c.token_budget)?;
    d.set_item("chunked_prefill_size", c.chunked_prefill_size)?;
    d.set_item("mixed_prefill_decode", c.mixed_prefill_decode)?;
    d.set_item("host_enabled", c.host_enabled)?;
    d.set_item("l3_enabled", c.l3_enabled)?;
    d.set_item("prefetch_threshold", c.prefetch_threshold)?;
    let (stop, base, per_1k) = match c.prefetch_stop {
        PrefetchStopPolicy::BestEffort => ("best_effort", 50, 10),
        PrefetchStopPolicy::WaitComplete => ("wait_complete", 50, 10),
        PrefetchStopPolicy::Timeout {
            base_ms,
            per_1k_tokens_ms,
        } => ("timeout", base_ms, per_1k_tokens_ms),
    };
    d.set_item("prefetch_stop", stop)?;
    d.set_item("prefetch_timeout_base_ms", base)?;
    d.set_item("prefetch_timeout_per_1k_tokens_ms", per_1k)?;
    let (wp, thr) = match c.write_policy {
        WritePolicy::WriteThrough => ("write_through", 1),
        WritePolicy::WriteThroughSelective { hit_threshold } => {
            ("write_through_selective", hit_threshold)
        }
        WritePolicy::WriteBack => ("write_back", 1),
    };
    d.set_item("write_policy", wp)?;
    d.set_item("write_hit_threshold", thr)?;
    d.set_item(
        "keep_device_after_write_back",
        c.keep_device_after_write_back,
    )?;
    d.set_item(
        "retraction",
        match c.retraction {
            RetractionPolicy::LatestArrival => "latest_arrival",
            RetractionPolicy::FewestGenerated => "fewest_generated",
            RetractionPolicy::MostPages => "most_pages",
        },
    )?;
    d.set_item("max_context_tokens", c.max_context_tokens)?;
    let ns = PyDict::new(py);
    ns.set_item("model", &c.namespace.model)?;
    ns.set_item("dtype", &c.namespace.dtype)?;
    ns.set_item("layout", &c.namespace.layout)?;
    ns.set_item("tenant", &c.namespace.tenant)?;
    ns.set_item("adapter", &c.namespace.adapter)?;
    d.set_item("namespace", ns)?;
    d.set_item("rank", c.rank)?;
    let (sharing, leader) = match c.l3_sharing {
        L3Sharing::PerRank => ("per_rank", 0),
        L3Sharing::Replicated { leader } => ("replicated", leader),
    };
    d.set_item("l3_sharing", sharing)?;
    d.set_item("l3_leader_rank", leader)?;
    d.set_item("record_kv_events", c.record_kv_events)?;
    d.set_item("kv_events_max_bytes", c.kv_events_max_bytes)?;
    d.set_item("tenant_quota_device_pages", c.tenant_quota.device_pages)?;
    d.set_item("tenant_quota_host_pages", c.tenant_quota.host_pages)?;
    d.set_item("eviction", c.eviction.to_string())?;
    d.set_item("host_admission", c.host_admission.to_string())?;
    d.set_item("queue_protection", c.queue_protection.to_string())?;
    d.set_item("tp_ranks", c.tp_ranks)?;
    d.set_item("shadow_sample_salt", c.shadow_sample_salt)?;
    d.set_item("shadow_full_size_pages", c.shadow_full_size_pages)?;
    Ok(d)
}

/// Bytes of bookkeeping per pool page assumed by [`check_memory`] (measured ≈ 5; margin
/// for growth).
const BYTES_PER_PAGE: u64 = 16;

fn mem_total_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Refuses pools whose page bookkeeping alone would not fit in this machine's memory: the
/// allocation would abort the interpreter instead of raising (a Rust allocation failure is
/// not recoverable).
pub fn check_memory(c: &SchedulerConfig) -> PyResult<()> {
    let host = if c.host_enabled { c.host_pages } else { 0 };
    check_pool_pages(
        u64::from(c.device_pages) + u64::from(host),
        "device_pages + host_pages",
    )
}

/// Refuses `pages` pool pages (named `what`) whose bookkeeping would take more than half of
/// this machine's memory ([`check_memory`], and `OffloadManager`'s host slots).
pub fn check_pool_pages(pages: u64, what: &str) -> PyResult<()> {
    let need = pages.saturating_mul(BYTES_PER_PAGE);
    let have = mem_total_bytes().unwrap_or(16 << 30);
    if need > have / 2 {
        return Err(crate::errors::base::ConfigError::new_err(format!(
            "{what} = {pages} pages need ~{} MiB of bookkeeping; this machine has {} MiB",
            need >> 20,
            have >> 20
        )));
    }
    Ok(())
}

/// `kvtier._native.validate_config(cfg)`: raises `ConfigError` (or `TypeError`) if invalid.
#[pyfunction]
pub fn validate_config(cfg: &Bound<'_, PyAny>) -> PyResult<()> {
    let c = config_from_py(cfg)?;
    c.validate().map_err(config_err)?;
    check_memory(&c)
}

/// `kvtier._native.default_config()`: the Rust defaults as a dict.
#[pyfunction]
pub fn default_config(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    config_to_dict(py, &SchedulerConfig::default())
}

/// `kvtier._native.config_roundtrip(cfg)`: Python → Rust → dict (tests).
#[pyfunction]
pub fn config_roundtrip<'py>(cfg: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
    let c = config_from_py(cfg)?;
    config_to_dict(cfg.py(), &c)
}
