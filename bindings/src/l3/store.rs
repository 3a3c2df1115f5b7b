//! `kvtier.L3Store`: kvtier's own store API (exceptions for whole-call failures, per-key
//! integer arrays for batches), embedded or a client of a `kvtier-l3` server.

use std::sync::Arc;

use numpy::PyArray1;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use kvtier_l3::{
    ClientOptions, EmbeddedStore, L3Error, L3Store, LossCursor, PutOptions, RemoteStore, ShmMode,
    Tenant,
};
use parking_lot::Mutex;

use super::{
    PyQueryResults, buf_list, code_of, exist_code, ms, shared_embedded, sizes_or_codes,
    store_config,
};
use crate::convert::{ByteBuf, str_list, u32_vec};
use crate::errors::l3_err;
use crate::fork::Owner;
use crate::overlap::overlapping;

/// A page call's keys and page ids, one page per key.
fn keyed_pages(
    keys: &Bound<'_, PyAny>,
    page_ids: &Bound<'_, PyAny>,
) -> PyResult<(Vec<String>, Vec<u32>)> {
    let keys = str_list(keys, "keys")?;
    let ids = u32_vec(page_ids, "page_ids")?;
    if ids.len() != keys.len() {
        return Err(PyValueError::new_err("keys and page_ids differ in length"));
    }
    Ok((keys, ids))
}

/// Checks `page_ids` against a pool of `pool_len` bytes cut in `page_bytes` pages and
/// returns the byte ranges.
fn page_ranges(
    page_ids: &[u32],
    page_bytes: usize,
    pool_len: usize,
) -> PyResult<Vec<std::ops::Range<usize>>> {
    if page_bytes == 0 {
        return Err(PyValueError::new_err("page_bytes must be positive"));
    }
    let pages = pool_len / page_bytes;
    page_ids
        .iter()
        .map(|&p| {
            let p = p as usize;
            if p >= pages {
                Err(PyValueError::new_err(format!(
                    "page {p} is outside the pool ({pages} pages of {page_bytes} bytes)"
                )))
            } else {
                Ok(p * page_bytes..(p + 1) * page_bytes)
            }
        })
        .collect()
}

/// Disjoint mutable slices of `pool` at `ranges` (duplicates refused).
fn split_pages<'a>(
    pool: &'a mut [u8],
    ranges: &[std::ops::Range<usize>],
) -> PyResult<Vec<&'a mut [u8]>> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| ranges[i].start);
    let mut out: Vec<Option<&'a mut [u8]>> = (0..ranges.len()).map(|_| None).collect();
    let mut rest: &'a mut [u8] = pool;
    let mut consumed = 0usize;
    for &i in &order {
        let r = &ranges[i];
        if r.start < consumed {
            return Err(PyValueError::new_err("the same page appears twice"));
        }
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(r.start - consumed);
        let (page, tail) = tail.split_at_mut(r.end - r.start);
        out[i] = Some(page);
        rest = tail;
        consumed = r.end;
    }
    out.into_iter()
        .map(|o| o.ok_or_else(|| PyRuntimeError::new_err("internal: page not split")))
        .collect()
}

/// A handle on an L3 store (embedded in this process, or a client of a `kvtier-l3` server),
/// bound to one tenant. Whole-call failures raise the `L3Error` subclass of their kind.
#[pyclass(frozen, module = "kvtier", name = "L3Store")]
pub struct PyL3Store {
    pub(crate) store: Arc<dyn L3Store>,
    embedded: Option<Arc<EmbeddedStore>>,
    pub(crate) tenant: Tenant,
    /// A server client: its address and the client (for what only a remote store has).
    remote: Option<(String, Arc<RemoteStore>)>,
    /// This handle's place in the store's loss journal (None: the store keeps none).
    loss_cursor: Mutex<Option<LossCursor>>,
    /// In a child forked after, calls are refused and the store is not dropped (`fork.rs`).
    owner: Owner,
}

impl Drop for PyL3Store {
    fn drop(&mut self) {
        if !self.owner.is_here() {
            std::mem::forget((
                self.store.clone(),
                self.embedded.clone(),
                self.remote.clone(),
            ));
        }
    }
}

impl PyL3Store {
    /// A handle subscribed to the store's loss journal from now on (if it keeps one).
    fn new(
        store: Arc<dyn L3Store>,
        embedded: Option<Arc<EmbeddedStore>>,
        tenant: Tenant,
        remote: Option<(String, Arc<RemoteStore>)>,
    ) -> Self {
        let cursor = store.losses_since(&tenant, None).ok().map(|l| l.next);
        PyL3Store {
            store,
            embedded,
            tenant,
            remote,
            loss_cursor: Mutex::new(cursor),
            owner: Owner::here(),
        }
    }

    /// The store, unless this is a child forked after the handle was made (`fork.rs`).
    fn live(&self) -> kvtier_l3::L3Result<&Arc<dyn L3Store>> {
        self.owner.check("L3Store handle")?;
        Ok(&self.store)
    }

    pub fn dyn_store(&self) -> Arc<dyn L3Store> {
        self.store.clone()
    }

    /// Puts `views[i]` under `keys[i]` with the GIL released; per key 0 or a negative code.
    fn put_views<'py>(
        &self,
        py: Python<'py>,
        keys: &[String],
        views: &[&[u8]],
        opts: PutOptions,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let v = py
            .detach(|| self.live()?.batch_put_from(&self.tenant, keys, views, opts))
            .map_err(l3_err)?;
        Ok(PyArray1::from_vec(py, v.iter().map(code_of).collect()))
    }

    /// Reads `keys[i]` into `views[i]` with the GIL released; per key its size or a code.
    fn get_views<'py>(
        &self,
        py: Python<'py>,
        keys: &[String],
        views: &mut [&mut [u8]],
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let v = py
            .detach(|| self.live()?.batch_get_into(&self.tenant, keys, views))
            .map_err(l3_err)?;
        Ok(PyArray1::from_vec(py, sizes_or_codes(v)))
    }
}

#[pymethods]
impl PyL3Store {
    /// An in-process store. `name`: share the store with every other handle of this process
    /// naming it (empty: a private store). Other arguments apply when the store is created.
    #[staticmethod]
    #[pyo3(signature = (segment_bytes = 1 << 30, *, lease_ttl_ms = 10_000, max_object_bytes = 1 << 30,
                        max_batch_keys = 65_536, ssd_dir = None, ssd_capacity_bytes = None,
                        tenant = "default", name = "", loss_journal_keys = 0,
                        tenant_quota_bytes = None))]
    #[allow(clippy::too_many_arguments)]
    fn embedded(
        py: Python<'_>,
        segment_bytes: u64,
        lease_ttl_ms: u64,
        max_object_bytes: u64,
        max_batch_keys: usize,
        ssd_dir: Option<String>,
        ssd_capacity_bytes: Option<u64>,
        tenant: &str,
        name: &str,
        loss_journal_keys: usize,
        tenant_quota_bytes: Option<std::collections::HashMap<String, u64>>,
    ) -> PyResult<Self> {
        let t = super::tenant(tenant)?;
        if segment_bytes == 0 && name.is_empty() {
            // No name: no Mooncake client can mount a segment into it, so it could hold nothing.
            return Err(l3_err(L3Error::InvalidParams(
                "segment_bytes must be positive for a private embedded store (name it to let \
                 a Mooncake-compatible client mount a segment into it)"
                    .into(),
            )));
        }
        if ssd_capacity_bytes.is_some() && ssd_dir.is_none() {
            // It was ignored: a DRAM-only store where a capacity of SSD was asked for.
            return Err(l3_err(L3Error::InvalidParams(
                "ssd_capacity_bytes needs ssd_dir (no SSD tier)".into(),
            )));
        }
        let mut cfg = store_config(
            segment_bytes,
            lease_ttl_ms,
            max_object_bytes,
            max_batch_keys,
            ssd_dir,
            ssd_capacity_bytes,
        );
        cfg.loss_journal_keys = loss_journal_keys;
        cfg.tenant_quota_bytes = tenant_quota_bytes.unwrap_or_default().into_iter().collect();
        let name = name.to_string();
        let s = py
            .detach(move || shared_embedded(&name, cfg))
            .map_err(l3_err)?;
        Ok(PyL3Store::new(s.clone(), Some(s), t, None))
    }

    /// A client of a `kvtier-l3` server at `addr` ("host:port"), or of the leader of an etcd
    /// HA cluster (`"etcd://h:p;h:p[/CLUSTER]"`), followed across failovers.
    /// With `shm` (the default) a server on this host is reached through shared memory
    /// (see docs/l3-bench.md); `shm=False` or `KVTIER_L3_SHM=off` keeps it on TCP, and
    /// `KVTIER_L3_SHM=inplace` asks the server to copy plain buffers in place.
    #[staticmethod]
    #[pyo3(signature = (addr, *, token = None, tenant = "default", rpc_timeout_ms = 120_000, shm = true))]
    fn connect(
        py: Python<'_>,
        addr: &str,
        token: Option<String>,
        tenant: &str,
        rpc_timeout_ms: u64,
        shm: bool,
    ) -> PyResult<Self> {
        let t = super::tenant(tenant)?;
        let sa = kvtier_l3::ha::Locator::parse(addr)
            .map_err(|e| PyValueError::new_err(format!("bad address {addr:?}: {e}")))?;
        let opts = ClientOptions {
            token,
            rpc_timeout: ms(rpc_timeout_ms),
            shm: if shm {
                ClientOptions::default().shm
            } else {
                ShmMode::Off
            },
            ..ClientOptions::default()
        };
        let s = py
            .detach(move || RemoteStore::connect_to(sa, opts))
            .map_err(l3_err)?;
        let s = Arc::new(s);
        let remote = Some((addr.to_string(), s.clone()));
        Ok(py.detach(move || PyL3Store::new(s, None, t, remote)))
    }

    /// Another handle on the same store for another tenant (keys never meet across tenants).
    fn with_tenant(&self, py: Python<'_>, tenant: &str) -> PyResult<Self> {
        let t = super::tenant(tenant)?;
        let (store, embedded, remote) = (
            self.live().map_err(l3_err)?.clone(),
            self.embedded.clone(),
            self.remote.clone(),
        );
        Ok(py.detach(move || PyL3Store::new(store, embedded, t, remote)))
    }

    /// Whether this handle moves bytes through shared memory (a server on this host).
    #[getter]
    fn uses_shm(&self) -> bool {
        self.remote.as_ref().is_some_and(|(_, r)| r.uses_shm())
    }

    /// Whether the server copies this handle's plain buffers (`bytes`, arrays, tensors) in
    /// place, one copy: asked for with `KVTIER_L3_SHM=inplace` (by default they are staged).
    #[getter]
    fn uses_shm_in_place(&self) -> bool {
        self.remote.as_ref().is_some_and(|(_, r)| r.shm_in_place())
    }

    /// The tenant of this handle.
    #[getter]
    fn tenant(&self) -> String {
        self.tenant.as_str().to_string()
    }

    /// The largest object a put accepts (the server's, for a remote store). Checking a page
    /// size against it (and `stats()["mem_capacity_bytes"]`) writes nothing, where a probe put
    /// on a full store evicts a real object.
    #[getter]
    fn max_object_bytes(&self) -> u64 {
        self.store.max_object_bytes()
    }

    /// Whether the store runs in this process.
    #[getter]
    fn is_embedded(&self) -> bool {
        self.embedded.is_some()
    }

    /// The store's clock in ms (lease deadlines are on it). None for a remote store, whose
    /// deadlines are on the server's clock.
    fn now_ms(&self) -> Option<u64> {
        self.embedded.as_ref().map(|s| s.clock().now_ms())
    }

    /// Keys of this handle's tenant that stopped existing since the handle was made or last
    /// asked (evicted with no copy left, removed, lost with an SSD bucket or a node) and
    /// whether some went unreported, as ``(keys, overflowed)``. Every handle reads the
    /// store's loss journal with its own cursor: handles never take entries from each other.
    /// An engine passes the keys to ``Scheduler.l3_lost`` (``l3_lost_all`` when overflowed).
    /// Raises ``UnavailableError`` (-1011) when the store keeps no journal (an embedded store
    /// made without ``loss_journal_keys``, a server started with ``--loss-journal-keys 0``).
    fn drain_losses(&self, py: Python<'_>) -> PyResult<(Vec<String>, bool)> {
        py.detach(|| {
            let mut cur = self.loss_cursor.lock();
            let l = self
                .live()
                .map_err(l3_err)?
                .losses_since(&self.tenant, *cur)
                .map_err(l3_err)?;
            // Not subscribed before (the subscription at creation failed): what was lost
            // since the handle was made is unknown.
            let overflowed = l.overflowed || cur.is_none();
            *cur = Some(l.next);
            Ok((l.keys, overflowed))
        })
    }

    /// Moves an embedded store's clock forward (tests: expire leases without sleeping).
    fn advance_clock_ms(&self, ms_: u64) -> PyResult<()> {
        match &self.embedded {
            Some(s) => {
                s.clock().advance(ms(ms_));
                Ok(())
            }
            None => Err(PyRuntimeError::new_err(
                "only an embedded store has a local clock",
            )),
        }
    }

    /// Stores `data` (any bytes-like object) under `key`. First writer wins (-705).
    /// With `wait_persisted`, returns only once the SSD copy is durable (an SSD write
    /// failure raises; without an SSD tier it is the plain put).
    #[pyo3(signature = (key, data, *, soft_pin = false, wait_persisted = false))]
    fn put(
        &self,
        py: Python<'_>,
        key: &str,
        data: &Bound<'_, PyAny>,
        soft_pin: bool,
        wait_persisted: bool,
    ) -> PyResult<()> {
        let b = ByteBuf::get(data, false, "data")?;
        let opts = PutOptions {
            soft_pin,
            wait_persisted,
        };
        py.detach(|| self.live()?.put(&self.tenant, key, b.as_slice(), opts))
            .map_err(l3_err)
    }

    /// Reads an object into new bytes.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        let v = py
            .detach(|| self.live()?.get(&self.tenant, key))
            .map_err(l3_err)?;
        Ok(PyBytes::new(py, &v))
    }

    /// Reads an object into a writable buffer; returns its size (BufferOverflowError if the
    /// buffer is too small).
    fn get_into(&self, py: Python<'_>, key: &str, buf: &Bound<'_, PyAny>) -> PyResult<u64> {
        let mut b = ByteBuf::get(buf, true, "buf")?;
        py.detach(|| self.live()?.get_into(&self.tenant, key, b.as_mut_slice()))
            .map_err(l3_err)
    }

    /// Size of an object in bytes.
    fn get_size(&self, py: Python<'_>, key: &str) -> PyResult<u64> {
        py.detach(|| self.live()?.get_size(&self.tenant, key))
            .map_err(l3_err)
    }

    /// Whether the key exists (takes no lease).
    fn is_exist(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        py.detach(|| self.live()?.is_exist(&self.tenant, key))
            .map_err(l3_err)
    }

    /// Per key: 1 exists, 0 missing, negative code on error (int64 array). Takes no lease;
    /// `prefetch_to_memory=True` also asks the store to promote SSD-only keys to DRAM (what
    /// an `L3Query` probe does, so the prefetch that follows reads DRAM).
    #[pyo3(signature = (keys, *, prefetch_to_memory = false))]
    fn batch_is_exist<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        prefetch_to_memory: bool,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let keys = str_list(keys, "keys")?;
        let opts = kvtier_l3::ExistOptions { prefetch_to_memory };
        let v = py
            .detach(|| self.live()?.batch_exist_key(&self.tenant, &keys, opts))
            .map_err(l3_err)?;
        let out: Vec<i64> = v.into_iter().map(exist_code).collect();
        Ok(PyArray1::from_vec(py, out))
    }

    /// Puts `bufs[i]` under `keys[i]`; per key 0 or a negative code (int64 array).
    /// `wait_persisted` as for `put`.
    #[pyo3(signature = (keys, bufs, *, soft_pin = false, wait_persisted = false))]
    fn batch_put_from<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        bufs: &Bound<'py, PyAny>,
        soft_pin: bool,
        wait_persisted: bool,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let keys = str_list(keys, "keys")?;
        let bufs = buf_list(bufs, false)?;
        let views: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
        let opts = PutOptions {
            soft_pin,
            wait_persisted,
        };
        self.put_views(py, &keys, &views, opts)
    }

    /// Reads `keys[i]` into writable `bufs[i]`; per key its size or a negative code.
    fn batch_get_into<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        bufs: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let keys = str_list(keys, "keys")?;
        let mut bufs = buf_list(bufs, true)?;
        let spans: Vec<(usize, usize)> = bufs
            .iter()
            .map(|b| (b.as_slice().as_ptr() as usize, b.len()))
            .collect();
        if let Some(i) = overlapping(&spans).iter().position(|&o| o) {
            return Err(PyValueError::new_err(format!(
                "bufs[{i}] overlaps another buffer: one read cannot write two keys' bytes in one place"
            )));
        }
        let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        self.get_views(py, &keys, &mut views)
    }

    /// Puts pages of a pool: key `i` ← bytes of page `page_ids[i]` of `pool` (a C-contiguous
    /// buffer cut in `page_bytes` pages). Per key 0 or a negative code.
    /// `wait_persisted` as for `put`.
    #[pyo3(signature = (keys, pool, page_ids, page_bytes, *, soft_pin = false, wait_persisted = false))]
    #[allow(clippy::too_many_arguments)]
    fn batch_put_pages<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        pool: &Bound<'py, PyAny>,
        page_ids: &Bound<'py, PyAny>,
        page_bytes: usize,
        soft_pin: bool,
        wait_persisted: bool,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let (keys, ids) = keyed_pages(keys, page_ids)?;
        let b = ByteBuf::get(pool, false, "pool")?;
        let ranges = page_ranges(&ids, page_bytes, b.len())?;
        let src = b.as_slice();
        let views: Vec<&[u8]> = ranges.iter().map(|r| &src[r.clone()]).collect();
        let opts = PutOptions {
            soft_pin,
            wait_persisted,
        };
        self.put_views(py, &keys, &views, opts)
    }

    /// Reads key `i` into page `page_ids[i]` of `pool`. Per key its size or a negative code.
    fn batch_get_pages<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        pool: &Bound<'py, PyAny>,
        page_ids: &Bound<'py, PyAny>,
        page_bytes: usize,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let (keys, ids) = keyed_pages(keys, page_ids)?;
        let mut b = ByteBuf::get(pool, true, "pool")?;
        let ranges = page_ranges(&ids, page_bytes, b.len())?;
        let mut views = split_pages(b.as_mut_slice(), &ranges)?;
        self.get_views(py, &keys, &mut views)
    }

    /// One batched metadata query: replica descriptors with lease deadlines.
    fn batch_query(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<PyQueryResults> {
        let keys = str_list(keys, "keys")?;
        let v = py
            .detach(|| self.live()?.batch_query(&self.tenant, &keys))
            .map_err(l3_err)?;
        Ok(PyQueryResults { results: v })
    }

    /// Reads keys `offset .. offset + n` of `results` into pages `page_ids` (n of them) of
    /// `pool`, reusing the query's metadata (no second lookup). A key whose lease expired gives -707 and is not
    /// read. Per key its size or a negative code.
    #[pyo3(signature = (results, pool, page_ids, page_bytes, offset = 0))]
    fn batch_get_pages_with_query<'py>(
        &self,
        py: Python<'py>,
        results: &PyQueryResults,
        pool: &Bound<'py, PyAny>,
        page_ids: &Bound<'py, PyAny>,
        page_bytes: usize,
        offset: usize,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let ids = u32_vec(page_ids, "page_ids")?;
        let end = offset
            .checked_add(ids.len())
            .filter(|e| *e <= results.results.len())
            .ok_or_else(|| PyValueError::new_err("offset + pages exceeds the query results"))?;
        let mut qs = Vec::with_capacity(ids.len());
        for r in &results.results[offset..end] {
            match r {
                Ok(q) => qs.push(q.clone()),
                Err(_) => {
                    return Err(PyValueError::new_err(
                        "a query result in range is a miss; read only the hit prefix",
                    ));
                }
            }
        }
        let mut b = ByteBuf::get(pool, true, "pool")?;
        let ranges = page_ranges(&ids, page_bytes, b.len())?;
        let mut views = split_pages(b.as_mut_slice(), &ranges)?;
        let v = py
            .detach(|| {
                self.live()?
                    .batch_get_with_query(&self.tenant, &qs, &mut views)
            })
            .map_err(l3_err)?;
        Ok(PyArray1::from_vec(py, sizes_or_codes(v)))
    }

    /// Removes a key (ObjectHasLeaseError while leased, unless `force`).
    #[pyo3(signature = (key, force = false))]
    fn remove(&self, py: Python<'_>, key: &str, force: bool) -> PyResult<()> {
        py.detach(|| self.live()?.remove(&self.tenant, key, force))
            .map_err(l3_err)
    }

    /// Removes every key of the tenant (leased ones stay unless `force`); returns the count.
    #[pyo3(signature = (force = false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> PyResult<u64> {
        py.detach(|| self.live()?.remove_all(&self.tenant, force))
            .map_err(l3_err)
    }

    /// Removes the tenant's keys in which the (ECMAScript) pattern is found, as Mooncake's
    /// `RemoveByRegex` (leased ones stay unless `force`); returns the count. An invalid
    /// pattern raises the -600 error class and removes nothing.
    #[pyo3(signature = (pattern, force = false))]
    fn remove_by_regex(&self, py: Python<'_>, pattern: String, force: bool) -> PyResult<u64> {
        py.detach(|| self.live()?.remove_by_regex(&self.tenant, &pattern, force))
            .map_err(l3_err)
    }

    /// Waits until queued SSD writes are durable.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.live()?.flush()).map_err(l3_err)
    }

    /// Store-wide numbers (objects, bytes in memory and on disk).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.live()?.stats()).map_err(l3_err)?;
        let d = PyDict::new(py);
        d.set_item("objects", s.objects)?;
        d.set_item("mem_objects", s.mem_objects)?;
        d.set_item("mem_used_bytes", s.mem_used_bytes)?;
        d.set_item("mem_capacity_bytes", s.mem_capacity_bytes)?;
        d.set_item("disk_objects", s.disk_objects)?;
        d.set_item("disk_used_bytes", s.disk_used_bytes)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        match &self.remote {
            Some((a, _)) => format!("L3Store(remote={a:?}, tenant={:?})", self.tenant.as_str()),
            None => format!("L3Store(embedded, tenant={:?})", self.tenant.as_str()),
        }
    }
}
