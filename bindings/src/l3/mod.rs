//! The L3 store from Python: `kvtier.L3Store` (embedded or client of a `kvtier-l3` server),
//! `kvtier.L3Server` (a server in this process, for tests and single-host setups),
//! `kvtier.QueryResults` (batched query results with lease deadlines) and the integer-code
//! core of `kvtier.mooncake_compat.MooncakeDistributedStore`.
//!
//! Why two error conventions: `L3Store` is kvtier's own API and raises one exception class
//! per error kind (whole-call failures) while batch calls return per-key integer results in
//! numpy arrays (size or 0 on success, Mooncake's negative code on failure), so one missing
//! key does not hide the others. The Mooncake-compatible core never raises for store
//! failures: it returns Mooncake's integers, exactly as `mooncake.store` does.
//!
//! Safety of raw pointers: Mooncake's `put_from`/`get_into` take integer addresses. The
//! compatible core accepts an address range only inside memory registered with
//! `register_buffer` (anything else returns -600, INVALID_PARAMS, where Mooncake would read
//! or write wild memory). Registration trusts the caller to keep that memory alive, as
//! Mooncake does. Everything else goes through the buffer protocol and is bounds-checked.
//!
//! The GIL is released around every store call.
//!
//! Files: `query.rs` (`QueryResults`), `store.rs` (`L3Store`), `server.rs` (`L3Server`); this
//! one holds the named registry of embedded stores and the result-to-code helpers shared
//! with the Mooncake-compatible core (`crate::mooncake`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use kvtier_l3::{EmbeddedStore, L3Error, L3Result, SsdConfig, StoreConfig, Tenant};

use crate::convert::ByteBuf;
use crate::errors::l3_err;

mod query;
mod server;
mod store;

pub use query::PyQueryResults;
pub use server::PyL3Server;
pub use store::PyL3Store;

/// Embedded stores by name, shared by every handle of this process that names them
/// (`L3Store.embedded(name=...)`, `MooncakeDistributedStore.setup(..., "embedded://name")`).
type Registry = HashMap<String, Weak<EmbeddedStore>>;

/// One process's registry. A child forked after makes its own: the parent's stores are not
/// the child's (their copies may have locks held by threads it does not have, `crate::fork`:
/// the name opens a store of the child's own), and nor is the parent's registry, whose lock
/// may have been held at the fork (opening a store takes a while under it: the child's
/// first open waited for ever).
struct ProcessRegistry {
    pid: u32,
    map: Mutex<Registry>,
}

static REGISTRY: AtomicPtr<ProcessRegistry> = AtomicPtr::new(std::ptr::null_mut());

fn registry() -> &'static Mutex<Registry> {
    let me = std::process::id();
    loop {
        let cur = REGISTRY.load(Ordering::Acquire);
        // SAFETY: a published pointer comes from `Box::into_raw` below and is never freed
        // (a replaced registry, the parent's copy in a child, is leaked).
        if let Some(r) = unsafe { cur.as_ref() }
            && r.pid == me
        {
            return &r.map;
        }
        let mine = Box::into_raw(Box::new(ProcessRegistry {
            pid: me,
            map: Mutex::new(HashMap::new()),
        }));
        match REGISTRY.compare_exchange(cur, mine, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: just published, never freed (see above).
            Ok(_) => return unsafe { &(*mine).map },
            // SAFETY: not published: this thread's own allocation.
            Err(_) => drop(unsafe { Box::from_raw(mine) }),
        }
    }
}

/// The embedded store named `name`, created with `cfg` if no live one has that name.
/// An empty name always creates a private store. An open store is not opened again with
/// another SSD tier than it has (InvalidParams): the opener's tier was ignored, so a caller
/// asking for persistence got none, silently. `cfg` without a tier attaches.
pub fn shared_embedded(name: &str, cfg: StoreConfig) -> L3Result<Arc<EmbeddedStore>> {
    if name.is_empty() {
        return Ok(Arc::new(EmbeddedStore::new(cfg)?));
    }
    let mut r = registry().lock();
    if let Some(s) = r.get(name).and_then(Weak::upgrade) {
        if let Some(want) = &cfg.ssd {
            let same = |d: &std::path::Path| {
                let canon = |p: &std::path::Path| std::fs::canonicalize(p).ok();
                d.components().eq(want.dir.components())
                    || canon(d).is_some_and(|c| Some(c) == canon(&want.dir))
            };
            if !s.config().ssd.as_ref().is_some_and(|has| same(&has.dir)) {
                let has = s.config().ssd.as_ref().map(|h| h.dir.display().to_string());
                return Err(L3Error::InvalidParams(format!(
                    "embedded store {name:?} is open with ssd_dir {has:?}, not {:?} (one store \
                     per name: open it with its own tier, or without ssd_dir to attach)",
                    want.dir.display().to_string()
                )));
            }
        }
        return Ok(s);
    }
    let s = Arc::new(EmbeddedStore::new(cfg)?);
    r.retain(|_, w| w.strong_count() > 0);
    r.insert(name.to_string(), Arc::downgrade(&s));
    Ok(s)
}

pub(crate) fn tenant(name: &str) -> PyResult<Tenant> {
    Tenant::new(name).map_err(l3_err)
}

pub(crate) fn code_of<T>(r: &L3Result<T>) -> i64 {
    match r {
        Ok(_) => 0,
        Err(e) => l3code(e),
    }
}

/// A size or count (saturated to i64), or a negative code.
pub(crate) fn size_code(r: L3Result<u64>) -> i64 {
    match r {
        Ok(n) => i64::try_from(n).unwrap_or(i64::MAX),
        Err(e) => l3code(&e),
    }
}

pub(crate) fn sizes_or_codes(v: Vec<L3Result<u64>>) -> Vec<i64> {
    v.into_iter().map(size_code).collect()
}

/// 1 exists, 0 missing, or a negative code.
pub(crate) fn exist_code(r: L3Result<bool>) -> i64 {
    match r {
        Ok(true) => 1,
        Ok(false) => 0,
        Err(e) => l3code(&e),
    }
}

/// What one memory replica of a `value_bytes` value under a `key_len`-byte key is charged
/// against an L3 store's DRAM capacity (`stats()["mem_capacity_bytes"]`): its value, its key
/// and the store's metadata per object (`kvtier_l3::charge`).
#[pyfunction]
pub fn l3_charge(value_bytes: u64, key_len: usize) -> u64 {
    kvtier_l3::charge(value_bytes, key_len)
}

/// Mooncake's integer code of an error (e.g. -704).
pub(crate) fn l3code(e: &L3Error) -> i64 {
    i64::from(e.code_i32())
}

pub(crate) fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// Builds a store config from keyword values.
#[allow(clippy::too_many_arguments)]
pub fn store_config(
    segment_bytes: u64,
    lease_ttl_ms: u64,
    max_object_bytes: u64,
    max_batch_keys: usize,
    ssd_dir: Option<String>,
    ssd_capacity_bytes: Option<u64>,
) -> StoreConfig {
    let mut cfg = StoreConfig {
        local_segment_bytes: segment_bytes,
        lease_ttl: ms(lease_ttl_ms),
        max_object_bytes,
        max_batch_keys,
        ..StoreConfig::default()
    };
    if let Some(d) = ssd_dir {
        let mut s = SsdConfig::new(d);
        if let Some(c) = ssd_capacity_bytes {
            s.capacity_bytes = c;
        }
        cfg.ssd = Some(s);
    }
    cfg
}

/// A list of buffers (each bytes-like), refusing a single buffer passed where a list is due.
pub(crate) fn buf_list(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Vec<ByteBuf>> {
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<pyo3::types::PyByteArray>() {
        return Err(PyTypeError::new_err("bufs: expected a list of buffers"));
    }
    let list = obj
        .cast::<PyList>()
        .map(|l| l.iter().collect::<Vec<_>>())
        .or_else(|_| {
            obj.try_iter()
                .and_then(|it| it.collect::<PyResult<Vec<_>>>())
        })
        .map_err(|_| PyTypeError::new_err("bufs: expected a list of buffers"))?;
    list.iter()
        .enumerate()
        .map(|(i, b)| ByteBuf::get(b, writable, &format!("bufs[{i}]")))
        .collect()
}
