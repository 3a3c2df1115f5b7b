//! The shared machinery of the compatible core's calls: write modes (put vs upsert), the
//! per-key batch driver that releases the GIL, and Mooncake's result-code conventions (with
//! the table of codes the package exports as `kvtier.ERROR_CODES`).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use kvtier_l3::{
    BatchResult, ErrorCode, L3Error, L3Result, L3Store, PutOptions, ReplicateConfig, Tenant,
};

use super::ranges::{gather, multi_parts, removed_or_missing};
use super::{Attached, INVALID_PARAMS, MooncakeCore, NOT_INITIALIZED};
use crate::convert::ByteBuf;
use crate::l3::{buf_list, l3code, size_code};

/// Whether a write keeps an existing object (Mooncake's put: first writer wins) or replaces
/// it (Mooncake's upsert).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum WriteMode {
    Insert,
    Upsert,
}

/// A write: its mode and the replicas it asks for (Mooncake's `ReplicateConfig.replica_num`,
/// placed on segments of distinct owners by the store).
#[derive(Clone, Copy)]
pub(super) struct Write {
    pub(super) mode: WriteMode,
    pub(super) cfg: ReplicateConfig,
}

impl Write {
    pub(super) fn new(mode: WriteMode, replica_num: u32) -> Self {
        Write {
            mode,
            cfg: ReplicateConfig::replicas(replica_num),
        }
    }
}

/// A put's code as Mooncake's Python client reports it: a key that already exists is a
/// success (first writer wins, the call returns 0), as measured against Mooncake 0.3.13.
pub(super) fn mc_put_code(r: &L3Result<()>) -> i64 {
    match r {
        Ok(()) | Err(L3Error::ObjectAlreadyExists) => 0,
        Err(e) => l3code(e),
    }
}

/// A read's result as Mooncake's Python client reports it: the size, or a negative code,
/// with a too-small buffer reported as INVALID_PARAMS (-600), as Mooncake 0.3.13 does.
pub(crate) fn mc_get_code(r: L3Result<u64>) -> i64 {
    match r {
        Err(L3Error::BufferOverflow { .. }) => INVALID_PARAMS,
        r => size_code(r),
    }
}

/// The code of a replica task naming no segment: -704 if the key is missing (Mooncake looks
/// the key up first, measured side by side), else -600.
pub(crate) fn bad_segment_code(s: &dyn L3Store, t: &Tenant, key: &str) -> i64 {
    match s.is_exist(t, key) {
        Ok(true) => ErrorCode::InvalidParams as i64,
        Ok(false) => ErrorCode::ObjectNotFound as i64,
        Err(e) => i64::from(e.code_i32()),
    }
}

/// Mooncake's error codes by name, from the one table in the l3 crate (`kvtier.ERROR_CODES`).
pub fn error_codes(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for c in ErrorCode::ALL {
        d.set_item(c.name(), c.as_i32())?;
    }
    Ok(d)
}

/// `put_parts`' value: the parts (each bytes-like, checked as every buffer argument is:
/// no object arrays, C-contiguous) concatenated in order.
#[pyfunction]
pub fn join_parts<'py>(
    py: Python<'py>,
    parts: Vec<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let bufs = parts
        .iter()
        .enumerate()
        .map(|(i, p)| ByteBuf::get(p, false, &format!("parts[{i}]")))
        .collect::<PyResult<Vec<_>>>()?;
    let mut out = Vec::with_capacity(bufs.iter().map(ByteBuf::len).sum());
    for b in &bufs {
        out.extend_from_slice(b.as_slice());
    }
    Ok(PyBytes::new(py, &out))
}

/// Puts `views` under `keys` (replacing existing objects in `Upsert` mode).
fn write_many(
    s: &dyn L3Store,
    t: &Tenant,
    keys: &[String],
    views: &[&[u8]],
    w: Write,
) -> BatchResult<()> {
    if w.mode == WriteMode::Upsert {
        let most = s.max_object_bytes();
        for (k, v) in keys.iter().zip(views) {
            // Only for a value the put can take: one of 0 bytes or past the object limit
            // is refused (-600) and must leave the old object (it removed it first, so a
            // bad call destroyed state). A failed remove shows up as the put's own error.
            if v.is_empty() || v.len() as u64 > most {
                continue;
            }
            kvtier_l3::error::best_effort(
                "upsert: remove the old object",
                removed_or_missing(s.remove(t, k, true)),
            );
        }
    }
    s.batch_put_from_with(t, keys, views, PutOptions::default(), w.cfg)
}

/// `items` in runs of at most the store's batch limit (at least one item a run).
pub(super) fn chunks<'a, T>(s: &dyn L3Store, items: &'a [T]) -> std::slice::Chunks<'a, T> {
    items.chunks(s.batch_keys_limit().max(1))
}

impl Drop for MooncakeCore {
    /// A client collected without `close`: dropped as `close` drops it, with the GIL released
    /// (its segment is unmounted on the server, an RPC: every Python thread of the process
    /// waited on a stopped server until it timed out).
    fn drop(&mut self) {
        if let Some(a) = self.state.get_mut().take() {
            Python::attach(|py| py.detach(move || drop(a)));
        }
    }
}

impl MooncakeCore {
    /// The store and tenant calls use: None before set-up, after close, and in a child
    /// forked after the set-up (`fork.rs`; [`Self::unattached`] tells which).
    pub(super) fn handle(&self) -> Option<(Arc<dyn L3Store>, Tenant)> {
        self.state
            .read()
            .as_ref()
            .filter(|a| a.owner.is_here())
            .map(|a| (a.store.clone(), a.tenant.clone()))
    }

    /// The code of a call [`Self::handle`] gave nothing: -1011 in a child forked after the
    /// set-up (as a server client's calls there), else -1 (not set up, closed).
    pub(super) fn unattached(&self) -> i64 {
        match self.state.read().as_ref() {
            Some(a) if !a.owner.is_here() => ErrorCode::UnavailableInCurrentMode as i64,
            _ => NOT_INITIALIZED,
        }
    }

    /// Sets up `a`, dropping the client it replaces with the GIL released (its segment is
    /// unmounted in the store: an RPC to a server).
    pub(super) fn attach(&self, py: Python<'_>, a: Attached) {
        let old = self.state.write().replace(a);
        py.detach(move || drop(old));
    }

    /// The shared part of the batch calls: keys whose range is valid go to `call` (with
    /// their indices) with the GIL released, at most the store's batch limit at a time
    /// (Mooncake takes any number of keys; past the limit every key was -600); each result
    /// goes back to its key's slot as `code` reports it. An invalid key is INVALID_PARAMS;
    /// a whole-call failure gives its code to every valid key of that call.
    pub(super) fn mc_batch<T: Send>(
        &self,
        py: Python<'_>,
        keys: &[String],
        valid: impl Fn(usize) -> bool,
        mut call: impl FnMut(&dyn L3Store, &Tenant, &[usize], &[String]) -> BatchResult<T> + Send,
        code: impl Fn(L3Result<T>) -> i64 + Sync,
    ) -> Vec<i64> {
        let Some((s, t)) = self.handle() else {
            return vec![self.unattached(); keys.len()];
        };
        let idx: Vec<usize> = (0..keys.len()).filter(|&i| valid(i)).collect();
        let sel: Vec<String> = idx.iter().map(|&i| keys[i].clone()).collect();
        let mut out = vec![INVALID_PARAMS; keys.len()];
        py.detach(|| {
            for (ic, kc) in chunks(s.as_ref(), &idx).zip(chunks(s.as_ref(), &sel)) {
                match call(s.as_ref(), &t, ic, kc) {
                    Ok(v) => ic.iter().zip(v).for_each(|(&i, r)| out[i] = code(r)),
                    Err(e) => ic.iter().for_each(|&i| out[i] = l3code(&e)),
                }
            }
        });
        out
    }

    pub(super) fn put_bytes(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        mode: Write,
    ) -> PyResult<i64> {
        let b = ByteBuf::get(value, false, "value")?;
        let Some((s, t)) = self.handle() else {
            return Ok(self.unattached());
        };
        let keys = [key.to_string()];
        Ok(py.detach(
            || match write_many(s.as_ref(), &t, &keys, &[b.as_slice()], mode) {
                Ok(v) => v.iter().map(mc_put_code).next().unwrap_or(NOT_INITIALIZED),
                Err(e) => l3code(&e),
            },
        ))
    }

    /// Mooncake's `put_batch`/`upsert_batch`: one code for the whole batch (the first failure).
    pub(super) fn put_many(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: &Bound<'_, PyAny>,
        mode: Write,
    ) -> PyResult<i64> {
        let bufs = buf_list(values, false)?;
        if bufs.len() != keys.len() {
            return Ok(INVALID_PARAMS);
        }
        let Some((s, t)) = self.handle() else {
            return Ok(self.unattached());
        };
        let views: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
        Ok(py.detach(|| {
            // every run is written; the first failure is the batch's code
            let codes = chunks(s.as_ref(), &keys)
                .zip(chunks(s.as_ref(), &views))
                .map(|(k, v)| match write_many(s.as_ref(), &t, k, v, mode) {
                    Ok(v) => v.iter().map(mc_put_code).find(|c| *c != 0).unwrap_or(0),
                    Err(e) => l3code(&e),
                });
            codes.fold(0, |first, c| if first != 0 { first } else { c })
        }))
    }

    pub(super) fn put_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<u64>,
        sizes: Vec<i64>,
        mode: Write,
    ) -> Vec<i64> {
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            return vec![INVALID_PARAMS; keys.len()];
        }
        let calls = self.regions.enter();
        let ranges = calls.check_all(&ptrs, &sizes);
        self.mc_batch(
            py,
            &keys,
            |i| ranges[i].is_some(),
            |s, t, idx, sel| {
                // SAFETY: every range came from `RegionUse::check`, used while it lasts.
                let views: Vec<&[u8]> = idx
                    .iter()
                    .filter_map(|&i| ranges[i].map(|r| unsafe { r.bytes() }))
                    .collect();
                write_many(s, t, sel, &views, mode)
            },
            |r| mc_put_code(&r),
        )
    }

    pub(super) fn put_multi(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<i64>>,
        mode: Write,
    ) -> Vec<i64> {
        if keys.len() != all_ptrs.len() || keys.len() != all_sizes.len() {
            return vec![INVALID_PARAMS; keys.len()];
        }
        let calls = self.regions.enter();
        let parts = multi_parts(&calls, &all_ptrs, &all_sizes);
        self.mc_batch(
            py,
            &keys,
            |i| parts[i].is_some(),
            |s, t, idx, sel| {
                let objs: Vec<Vec<u8>> = idx
                    .iter()
                    .map(|&i| parts[i].as_deref().map(gather).unwrap_or_default())
                    .collect();
                let views: Vec<&[u8]> = objs.iter().map(|o| o.as_slice()).collect();
                write_many(s, t, sel, &views, mode)
            },
            |r| mc_put_code(&r),
        )
    }
}
