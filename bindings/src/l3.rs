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

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use numpy::PyArray1;
use parking_lot::{Mutex, RwLock};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use kvtier_l3::{
    BatchResult, ClientOptions, EmbeddedStore, ErrorCode, L3Error, L3Result, L3Store, PutOptions,
    QueryResult, RemoteStore, ServerHandle, ServerOptions, SsdConfig, StoreConfig, Tenant,
    spawn_server,
};

use crate::convert::{ByteBuf, str_list, u32_vec};
use crate::errors::l3_err;

/// Embedded stores by name, shared by every handle of this process that names them
/// (`L3Store.embedded(name=...)`, `MooncakeDistributedStore.setup(..., "embedded://name")`).
fn registry() -> &'static Mutex<HashMap<String, Weak<EmbeddedStore>>> {
    static R: OnceLock<Mutex<HashMap<String, Weak<EmbeddedStore>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The embedded store named `name`, created with `cfg` if no live one has that name.
/// An empty name always creates a private store.
pub fn shared_embedded(name: &str, cfg: StoreConfig) -> L3Result<Arc<EmbeddedStore>> {
    if name.is_empty() {
        return Ok(Arc::new(EmbeddedStore::new(cfg)?));
    }
    let mut r = registry().lock();
    if let Some(s) = r.get(name).and_then(Weak::upgrade) {
        return Ok(s);
    }
    let s = Arc::new(EmbeddedStore::new(cfg)?);
    r.retain(|_, w| w.strong_count() > 0);
    r.insert(name.to_string(), Arc::downgrade(&s));
    Ok(s)
}

fn tenant(name: &str) -> PyResult<Tenant> {
    Tenant::new(name).map_err(l3_err)
}

fn code_of<T>(r: &L3Result<T>) -> i64 {
    match r {
        Ok(_) => 0,
        Err(e) => l3code(e),
    }
}

/// A size or count (saturated to i64), or a negative code.
fn size_code(r: L3Result<u64>) -> i64 {
    match r {
        Ok(n) => i64::try_from(n).unwrap_or(i64::MAX),
        Err(e) => l3code(&e),
    }
}

fn sizes_or_codes(v: Vec<L3Result<u64>>) -> Vec<i64> {
    v.into_iter().map(size_code).collect()
}

/// 1 exists, 0 missing, or a negative code.
fn exist_code(r: L3Result<bool>) -> i64 {
    match r {
        Ok(true) => 1,
        Ok(false) => 0,
        Err(e) => l3code(&e),
    }
}

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

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
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

/// Results of `L3Store.batch_query`: replica metadata and lease deadlines, reusable by
/// `batch_get_with_query` until the lease passes (then -707 and a new query is needed).
#[pyclass(frozen, module = "kvtier", name = "QueryResults")]
pub struct PyQueryResults {
    results: Vec<L3Result<QueryResult>>,
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

/// A handle on an L3 store (embedded in this process, or a client of a `kvtier-l3` server),
/// bound to one tenant. Whole-call failures raise the `L3Error` subclass of their kind.
#[pyclass(frozen, module = "kvtier", name = "L3Store")]
pub struct PyL3Store {
    store: Arc<dyn L3Store>,
    embedded: Option<Arc<EmbeddedStore>>,
    tenant: Tenant,
    remote_addr: Option<String>,
}

impl PyL3Store {
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
            .detach(|| self.store.batch_put_from(&self.tenant, keys, views, opts))
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
            .detach(|| self.store.batch_get_into(&self.tenant, keys, views))
            .map_err(l3_err)?;
        Ok(PyArray1::from_vec(py, sizes_or_codes(v)))
    }
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

#[pymethods]
impl PyL3Store {
    /// An in-process store. `name`: share the store with every other handle of this process
    /// naming it (empty: a private store). Other arguments apply when the store is created.
    #[staticmethod]
    #[pyo3(signature = (segment_bytes = 1 << 30, *, lease_ttl_ms = 10_000, max_object_bytes = 1 << 30,
                        max_batch_keys = 65_536, ssd_dir = None, ssd_capacity_bytes = None,
                        tenant = "default", name = ""))]
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
    ) -> PyResult<Self> {
        let t = self::tenant(tenant)?;
        let cfg = store_config(
            segment_bytes,
            lease_ttl_ms,
            max_object_bytes,
            max_batch_keys,
            ssd_dir,
            ssd_capacity_bytes,
        );
        let name = name.to_string();
        let s = py
            .detach(move || shared_embedded(&name, cfg))
            .map_err(l3_err)?;
        Ok(PyL3Store {
            store: s.clone(),
            embedded: Some(s),
            tenant: t,
            remote_addr: None,
        })
    }

    /// A client of a `kvtier-l3` server at `addr` ("host:port").
    #[staticmethod]
    #[pyo3(signature = (addr, *, token = None, tenant = "default", rpc_timeout_ms = 120_000))]
    fn connect(
        py: Python<'_>,
        addr: &str,
        token: Option<String>,
        tenant: &str,
        rpc_timeout_ms: u64,
    ) -> PyResult<Self> {
        let t = self::tenant(tenant)?;
        let sa: SocketAddr = addr
            .parse()
            .map_err(|e| PyValueError::new_err(format!("bad address {addr:?}: {e}")))?;
        let opts = ClientOptions {
            token,
            rpc_timeout: ms(rpc_timeout_ms),
            ..ClientOptions::default()
        };
        let s = py
            .detach(move || RemoteStore::connect(sa, opts))
            .map_err(l3_err)?;
        Ok(PyL3Store {
            store: Arc::new(s),
            embedded: None,
            tenant: t,
            remote_addr: Some(addr.to_string()),
        })
    }

    /// Another handle on the same store for another tenant (keys never meet across tenants).
    fn with_tenant(&self, tenant: &str) -> PyResult<Self> {
        Ok(PyL3Store {
            store: self.store.clone(),
            embedded: self.embedded.clone(),
            tenant: self::tenant(tenant)?,
            remote_addr: self.remote_addr.clone(),
        })
    }

    /// The tenant of this handle.
    #[getter]
    fn tenant(&self) -> String {
        self.tenant.as_str().to_string()
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
        py.detach(|| self.store.put(&self.tenant, key, b.as_slice(), opts))
            .map_err(l3_err)
    }

    /// Reads an object into new bytes.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        let v = py
            .detach(|| self.store.get(&self.tenant, key))
            .map_err(l3_err)?;
        Ok(PyBytes::new(py, &v))
    }

    /// Reads an object into a writable buffer; returns its size (BufferOverflowError if the
    /// buffer is too small).
    fn get_into(&self, py: Python<'_>, key: &str, buf: &Bound<'_, PyAny>) -> PyResult<u64> {
        let mut b = ByteBuf::get(buf, true, "buf")?;
        py.detach(|| self.store.get_into(&self.tenant, key, b.as_mut_slice()))
            .map_err(l3_err)
    }

    /// Size of an object in bytes.
    fn get_size(&self, py: Python<'_>, key: &str) -> PyResult<u64> {
        py.detach(|| self.store.get_size(&self.tenant, key))
            .map_err(l3_err)
    }

    /// Whether the key exists (takes no lease).
    fn is_exist(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        py.detach(|| self.store.is_exist(&self.tenant, key))
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
            .detach(|| self.store.batch_exist_key(&self.tenant, &keys, opts))
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
            .detach(|| self.store.batch_query(&self.tenant, &keys))
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
                self.store
                    .batch_get_with_query(&self.tenant, &qs, &mut views)
            })
            .map_err(l3_err)?;
        Ok(PyArray1::from_vec(py, sizes_or_codes(v)))
    }

    /// Removes a key (ObjectHasLeaseError while leased, unless `force`).
    #[pyo3(signature = (key, force = false))]
    fn remove(&self, py: Python<'_>, key: &str, force: bool) -> PyResult<()> {
        py.detach(|| self.store.remove(&self.tenant, key, force))
            .map_err(l3_err)
    }

    /// Removes every key of the tenant (leased ones stay unless `force`); returns the count.
    #[pyo3(signature = (force = false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> PyResult<u64> {
        py.detach(|| self.store.remove_all(&self.tenant, force))
            .map_err(l3_err)
    }

    /// Waits until queued SSD writes are durable.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.store.flush()).map_err(l3_err)
    }

    /// Store-wide numbers (objects, bytes in memory and on disk).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.store.stats()).map_err(l3_err)?;
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
        match &self.remote_addr {
            Some(a) => format!("L3Store(remote={a:?}, tenant={:?})", self.tenant.as_str()),
            None => format!("L3Store(embedded, tenant={:?})", self.tenant.as_str()),
        }
    }
}

/// A list of buffers (each bytes-like), refusing a single buffer passed where a list is due.
fn buf_list(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Vec<ByteBuf>> {
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

/// A `kvtier-l3` server running in this process (its own threads), serving an embedded store.
#[pyclass(module = "kvtier", name = "L3Server")]
pub struct PyL3Server {
    handle: Option<ServerHandle>,
    addr: String,
}

#[pymethods]
impl PyL3Server {
    /// Starts serving on `addr` (default: an ephemeral loopback port).
    #[new]
    #[pyo3(signature = (segment_bytes = 1 << 30, *, addr = "127.0.0.1:0", token = None,
                        lease_ttl_ms = 10_000, max_object_bytes = 1 << 30, max_batch_keys = 65_536,
                        ssd_dir = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        segment_bytes: u64,
        addr: &str,
        token: Option<String>,
        lease_ttl_ms: u64,
        max_object_bytes: u64,
        max_batch_keys: usize,
        ssd_dir: Option<String>,
    ) -> PyResult<Self> {
        let sa: SocketAddr = addr
            .parse()
            .map_err(|e| PyValueError::new_err(format!("bad address {addr:?}: {e}")))?;
        let cfg = store_config(
            segment_bytes,
            lease_ttl_ms,
            max_object_bytes,
            max_batch_keys,
            ssd_dir,
            None,
        );
        let h = py
            .detach(move || -> L3Result<ServerHandle> {
                let store = Arc::new(EmbeddedStore::new(cfg)?);
                spawn_server(
                    store,
                    ServerOptions {
                        addr: sa,
                        token,
                        ..ServerOptions::default()
                    },
                )
            })
            .map_err(l3_err)?;
        let addr = h.addr.to_string();
        Ok(PyL3Server {
            handle: Some(h),
            addr,
        })
    }

    /// The bound address ("127.0.0.1:PORT").
    #[getter]
    fn addr(&self) -> String {
        self.addr.clone()
    }

    /// Whether it still serves.
    #[getter]
    fn running(&self) -> bool {
        self.handle.is_some()
    }

    /// Stops serving (idempotent).
    fn shutdown(&mut self, py: Python<'_>) {
        if let Some(h) = self.handle.take() {
            py.detach(move || h.shutdown());
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &mut self,
        py: Python<'_>,
        _t: &Bound<'_, PyAny>,
        _v: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) {
        self.shutdown(py);
    }
}

// ----- Mooncake-compatible core --------------------------------------------------------------

const INVALID_PARAMS: i64 = ErrorCode::InvalidParams as i64;
const NOT_INITIALIZED: i64 = ErrorCode::InternalError as i64;

/// The integer-returning core of `kvtier.mooncake_compat.MooncakeDistributedStore`.
/// Argument parsing (positional or dict `setup`) lives in the Python wrapper.
#[pyclass(frozen, module = "kvtier._native", name = "MooncakeCore")]
pub struct MooncakeCore {
    store: RwLock<Option<(Arc<dyn L3Store>, Tenant)>>,
    /// Registered memory: start address → length.
    regions: Mutex<BTreeMap<usize, usize>>,
}

impl MooncakeCore {
    fn with_store<T>(&self, f: impl FnOnce(&dyn L3Store, &Tenant) -> T) -> Option<T> {
        let g = self.store.read();
        g.as_ref().map(|(s, t)| f(s.as_ref(), t))
    }

    fn handle(&self) -> Option<(Arc<dyn L3Store>, Tenant)> {
        self.store.read().clone()
    }

    /// Per key: its parts as registered raw ranges, or None if any part is not registered or
    /// the pointer and size lists differ in length.
    fn multi_parts(&self, all_ptrs: &[Vec<u64>], all_sizes: &[Vec<i64>]) -> Vec<Option<Vec<Raw>>> {
        all_ptrs
            .iter()
            .zip(all_sizes)
            .map(|(ps, ns)| {
                if ps.len() != ns.len() || ps.is_empty() {
                    return None;
                }
                ps.iter()
                    .zip(ns)
                    .map(|(p, n)| {
                        self.registered(*p, *n)
                            .then_some(Raw(*p as usize, *n as usize))
                    })
                    .collect()
            })
            .collect()
    }

    /// Per buffer: whether it lies inside one registered region.
    fn registered_all(&self, ptrs: &[u64], sizes: &[i64]) -> Vec<bool> {
        ptrs.iter()
            .zip(sizes)
            .map(|(p, n)| self.registered(*p, *n))
            .collect()
    }

    /// The shared part of the Mooncake batch calls: the keys `valid` accepts go to `call`
    /// (with their indices, in order) with the GIL released, and each per-key result goes
    /// back to its key's slot as `code` reports it. A key not accepted is INVALID_PARAMS; a
    /// call that fails as a whole gives its code to every accepted key.
    fn mc_batch<T: Send>(
        &self,
        py: Python<'_>,
        keys: &[String],
        valid: impl Fn(usize) -> bool,
        call: impl FnOnce(&dyn L3Store, &Tenant, &[usize], &[String]) -> BatchResult<T> + Send,
        code: impl Fn(L3Result<T>) -> i64,
    ) -> Vec<i64> {
        let Some((s, t)) = self.handle() else {
            return vec![NOT_INITIALIZED; keys.len()];
        };
        let idx: Vec<usize> = (0..keys.len()).filter(|&i| valid(i)).collect();
        let sel_keys: Vec<String> = idx.iter().map(|&i| keys[i].clone()).collect();
        let res = py.detach(|| call(s.as_ref(), &t, &idx, &sel_keys));
        let mut out = vec![INVALID_PARAMS; keys.len()];
        match res {
            Ok(v) => {
                for (j, r) in v.into_iter().enumerate() {
                    if let Some(&i) = idx.get(j) {
                        out[i] = code(r);
                    }
                }
            }
            Err(e) => {
                for &i in &idx {
                    out[i] = l3code(&e);
                }
            }
        }
        out
    }

    /// Whether `[ptr, ptr + size)` lies inside one registered region.
    fn registered(&self, ptr: u64, size: i64) -> bool {
        if size < 0 {
            return false;
        }
        let (Ok(p), Ok(n)) = (usize::try_from(ptr), usize::try_from(size)) else {
            return false;
        };
        let Some(end) = p.checked_add(n) else {
            return false;
        };
        let r = self.regions.lock();
        match r.range(..=p).next_back() {
            Some((&start, &len)) => p >= start && end <= start + len,
            None => false,
        }
    }
}

/// Raw memory range checked against registered regions (Send for `detach`).
struct Raw(usize, usize);

impl Raw {
    /// SAFETY: the caller checked the range is inside registered memory, which the
    /// registering caller promised to keep alive.
    unsafe fn slice<'a>(&self) -> &'a [u8] {
        if self.1 == 0 {
            return &[];
        }
        unsafe { std::slice::from_raw_parts(self.0 as *const u8, self.1) }
    }
    /// SAFETY: as `slice`, and the memory is writable.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut<'a>(&self) -> &'a mut [u8] {
        if self.1 == 0 {
            return &mut [];
        }
        unsafe { std::slice::from_raw_parts_mut(self.0 as *mut u8, self.1) }
    }
}

/// The ranges of the buffers at `idx`.
fn raw_ranges(idx: &[usize], ptrs: &[u64], sizes: &[i64]) -> Vec<Raw> {
    idx.iter()
        .map(|&i| Raw(ptrs[i] as usize, sizes[i] as usize))
        .collect()
}

fn l3code(e: &L3Error) -> i64 {
    i64::from(e.code_i32())
}

/// A put's code as Mooncake's Python client reports it: a key that already exists is a
/// success (first writer wins, the call returns 0), as measured against Mooncake 0.3.13.
fn mc_put_code(r: &L3Result<()>) -> i64 {
    match r {
        Ok(()) | Err(L3Error::ObjectAlreadyExists) => 0,
        Err(e) => l3code(e),
    }
}

/// A read's result as Mooncake's Python client reports it: the size, or a negative code,
/// with a too-small buffer reported as INVALID_PARAMS (-600), as Mooncake 0.3.13 does.
fn mc_get_code(r: L3Result<u64>) -> i64 {
    match r {
        Err(L3Error::BufferOverflow { .. }) => INVALID_PARAMS,
        r => size_code(r),
    }
}

#[pymethods]
impl MooncakeCore {
    #[new]
    fn new() -> Self {
        MooncakeCore {
            store: RwLock::new(None),
            regions: Mutex::new(BTreeMap::new()),
        }
    }

    /// Attaches to (or creates) the embedded store `name`; 0 or a negative code.
    fn setup_embedded(&self, py: Python<'_>, name: &str, segment_bytes: u64, tenant: &str) -> i64 {
        let t = match Tenant::new(tenant) {
            Ok(t) => t,
            Err(e) => return l3code(&e),
        };
        let cfg = StoreConfig {
            local_segment_bytes: segment_bytes,
            ..StoreConfig::default()
        };
        let name = name.to_string();
        match py.detach(move || shared_embedded(&name, cfg)) {
            Ok(s) => {
                *self.store.write() = Some((s, t));
                0
            }
            Err(e) => l3code(&e),
        }
    }

    /// Connects to a `kvtier-l3` server; 0 or a negative code.
    #[pyo3(signature = (addr, tenant, token = None))]
    fn setup_remote(&self, py: Python<'_>, addr: &str, tenant: &str, token: Option<String>) -> i64 {
        let t = match Tenant::new(tenant) {
            Ok(t) => t,
            Err(e) => return l3code(&e),
        };
        let Ok(sa) = addr.parse::<SocketAddr>() else {
            return INVALID_PARAMS;
        };
        let opts = ClientOptions {
            token,
            ..ClientOptions::default()
        };
        match py.detach(move || RemoteStore::connect(sa, opts)) {
            Ok(s) => {
                *self.store.write() = Some((Arc::new(s), t));
                0
            }
            Err(e) => l3code(&e),
        }
    }

    /// Attaches to the store behind a `kvtier.L3Store` handle (same tenant).
    fn setup_from(&self, store: &PyL3Store) -> i64 {
        *self.store.write() = Some((store.store.clone(), store.tenant.clone()));
        0
    }

    fn is_setup(&self) -> bool {
        self.store.read().is_some()
    }

    fn close(&self) -> i64 {
        *self.store.write() = None;
        self.regions.lock().clear();
        0
    }

    fn register_buffer(&self, ptr: u64, size: i64) -> i64 {
        if ptr == 0 || size <= 0 {
            return INVALID_PARAMS;
        }
        let (Ok(p), Ok(n)) = (usize::try_from(ptr), usize::try_from(size)) else {
            return INVALID_PARAMS;
        };
        if p.checked_add(n).is_none() {
            return INVALID_PARAMS;
        }
        let mut r = self.regions.lock();
        // Refuse overlaps with an existing registration (Mooncake refuses double registration).
        if let Some((&s, &l)) = r.range(..p.saturating_add(n)).next_back()
            && s + l > p
        {
            return INVALID_PARAMS;
        }
        r.insert(p, n);
        0
    }

    fn unregister_buffer(&self, ptr: u64) -> i64 {
        let Ok(p) = usize::try_from(ptr) else {
            return INVALID_PARAMS;
        };
        match self.regions.lock().remove(&p) {
            Some(_) => 0,
            None => INVALID_PARAMS,
        }
    }

    fn put(&self, py: Python<'_>, key: &str, value: &Bound<'_, PyAny>) -> PyResult<i64> {
        let b = ByteBuf::get(value, false, "value")?;
        let Some((s, t)) = self.handle() else {
            return Ok(NOT_INITIALIZED);
        };
        Ok(py.detach(|| mc_put_code(&s.put(&t, key, b.as_slice(), PutOptions::default()))))
    }

    fn put_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: &Bound<'_, PyAny>,
    ) -> PyResult<i64> {
        let bufs = buf_list(values, false)?;
        if bufs.len() != keys.len() {
            return Ok(INVALID_PARAMS);
        }
        let Some((s, t)) = self.handle() else {
            return Ok(NOT_INITIALIZED);
        };
        let views: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
        Ok(py.detach(
            || match s.batch_put_from(&t, &keys, &views, PutOptions::default()) {
                Ok(v) => v.iter().map(mc_put_code).find(|c| *c != 0).unwrap_or(0),
                Err(e) => l3code(&e),
            },
        ))
    }

    fn get<'py>(&self, py: Python<'py>, key: &str) -> Bound<'py, PyBytes> {
        let r = match self.handle() {
            Some((s, t)) => py.detach(|| s.get(&t, key).unwrap_or_default()),
            None => Vec::new(),
        };
        PyBytes::new(py, &r)
    }

    fn get_batch<'py>(&self, py: Python<'py>, keys: Vec<String>) -> PyResult<Bound<'py, PyList>> {
        let Some((s, t)) = self.handle() else {
            return PyList::new(py, keys.iter().map(|_| PyBytes::new(py, b"")));
        };
        let vals: Vec<Vec<u8>> = py.detach(|| {
            keys.iter()
                .map(|k| s.get(&t, k).unwrap_or_default())
                .collect()
        });
        PyList::new(py, vals.iter().map(|v| PyBytes::new(py, v)))
    }

    fn put_from(&self, py: Python<'_>, key: &str, ptr: u64, size: i64) -> i64 {
        if !self.registered(ptr, size) {
            return INVALID_PARAMS;
        }
        let Some((s, t)) = self.handle() else {
            return NOT_INITIALIZED;
        };
        let raw = Raw(ptr as usize, size as usize);
        py.detach(|| {
            // SAFETY: checked against registered memory above.
            let data = unsafe { raw.slice() };
            mc_put_code(&s.put(&t, key, data, PutOptions::default()))
        })
    }

    fn get_into(&self, py: Python<'_>, key: &str, ptr: u64, size: i64) -> i64 {
        if !self.registered(ptr, size) {
            return INVALID_PARAMS;
        }
        let Some((s, t)) = self.handle() else {
            return NOT_INITIALIZED;
        };
        let raw = Raw(ptr as usize, size as usize);
        py.detach(|| {
            // SAFETY: checked against registered memory above.
            let buf = unsafe { raw.slice_mut() };
            mc_get_code(s.get_into(&t, key, buf))
        })
    }

    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<u64>,
        sizes: Vec<i64>,
    ) -> Vec<i64> {
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            return vec![INVALID_PARAMS; keys.len()];
        }
        let ok = self.registered_all(&ptrs, &sizes);
        self.mc_batch(
            py,
            &keys,
            |i| ok[i],
            |s, t, idx, sel_keys| {
                let raws = raw_ranges(idx, &ptrs, &sizes);
                // SAFETY: every range was checked against registered memory.
                let views: Vec<&[u8]> = raws.iter().map(|r| unsafe { r.slice() }).collect();
                s.batch_put_from(t, sel_keys, &views, PutOptions::default())
            },
            |r| mc_put_code(&r),
        )
    }

    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<u64>,
        sizes: Vec<i64>,
    ) -> Vec<i64> {
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            return vec![INVALID_PARAMS; keys.len()];
        }
        let ok = self.registered_all(&ptrs, &sizes);
        // Overlapping destinations would alias; refuse them like unregistered memory.
        let mut spans: Vec<(usize, usize, usize)> = (0..keys.len())
            .filter(|i| ok[*i])
            .map(|i| (ptrs[i] as usize, sizes[i] as usize, i))
            .collect();
        spans.sort();
        let mut bad = vec![false; keys.len()];
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                bad[w[0].2] = true;
                bad[w[1].2] = true;
            }
        }
        self.mc_batch(
            py,
            &keys,
            |i| ok[i] && !bad[i],
            |s, t, idx, sel_keys| {
                let raws = raw_ranges(idx, &ptrs, &sizes);
                // SAFETY: registered, pairwise disjoint ranges.
                let mut views: Vec<&mut [u8]> =
                    raws.iter().map(|r| unsafe { r.slice_mut() }).collect();
                s.batch_get_into(t, sel_keys, &mut views)
            },
            mc_get_code,
        )
    }

    /// Puts each key from several registered buffers, concatenated in order (Mooncake's
    /// `batch_put_from_multi_buffers`, e.g. a page's K and V halves).
    fn batch_put_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<i64>>,
    ) -> Vec<i64> {
        if keys.len() != all_ptrs.len() || keys.len() != all_sizes.len() {
            return vec![INVALID_PARAMS; keys.len()];
        }
        let parts = self.multi_parts(&all_ptrs, &all_sizes);
        self.mc_batch(
            py,
            &keys,
            |i| parts[i].is_some(),
            |s, t, idx, sel_keys| {
                // SAFETY: every part was checked against registered memory.
                let objs: Vec<Vec<u8>> = idx
                    .iter()
                    .map(|&i| {
                        parts[i]
                            .iter()
                            .flatten()
                            .flat_map(|r| unsafe { r.slice() }.iter().copied())
                            .collect()
                    })
                    .collect();
                let views: Vec<&[u8]> = objs.iter().map(|o| o.as_slice()).collect();
                s.batch_put_from(t, sel_keys, &views, PutOptions::default())
            },
            |r| mc_put_code(&r),
        )
    }

    /// Reads each key and scatters its bytes over several registered buffers in order
    /// (Mooncake's `batch_get_into_multi_buffers`); per key the bytes read or a code.
    fn batch_get_into_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<i64>>,
    ) -> Vec<i64> {
        if keys.len() != all_ptrs.len() || keys.len() != all_sizes.len() {
            return vec![INVALID_PARAMS; keys.len()];
        }
        let parts = self.multi_parts(&all_ptrs, &all_sizes);
        self.mc_batch(
            py,
            &keys,
            |i| parts[i].is_some(),
            |s, t, idx, sel_keys| {
                let mut tmp: Vec<Vec<u8>> = idx
                    .iter()
                    .map(|&i| vec![0u8; parts[i].iter().flatten().map(|r| r.1).sum()])
                    .collect();
                let mut views: Vec<&mut [u8]> = tmp.iter_mut().map(|v| v.as_mut_slice()).collect();
                let r = s.batch_get_into(t, sel_keys, &mut views);
                if let Ok(v) = &r {
                    for (j, res) in v.iter().enumerate() {
                        let (Ok(n), Some(&i)) = (res, idx.get(j)) else {
                            continue;
                        };
                        let mut src = &tmp[j][..*n as usize];
                        for part in parts[i].iter().flatten() {
                            let k = part.1.min(src.len());
                            // SAFETY: registered memory, checked above.
                            let dst = unsafe { part.slice_mut() };
                            dst[..k].copy_from_slice(&src[..k]);
                            src = &src[k..];
                        }
                    }
                }
                r
            },
            mc_get_code,
        )
    }

    fn is_exist(&self, py: Python<'_>, key: &str) -> i64 {
        py.detach(|| {
            self.with_store(|s, t| exist_code(s.is_exist(t, key)))
                .unwrap_or(NOT_INITIALIZED)
        })
    }

    fn batch_is_exist(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        let n = keys.len();
        py.detach(|| {
            self.with_store(|s, t| match s.batch_is_exist(t, &keys) {
                Ok(v) => v.into_iter().map(exist_code).collect(),
                Err(e) => vec![l3code(&e); n],
            })
            .unwrap_or_else(|| vec![NOT_INITIALIZED; n])
        })
    }

    fn get_size(&self, py: Python<'_>, key: &str) -> i64 {
        py.detach(|| {
            self.with_store(|s, t| size_code(s.get_size(t, key)))
                .unwrap_or(NOT_INITIALIZED)
        })
    }

    fn remove(&self, py: Python<'_>, key: &str, force: bool) -> i64 {
        py.detach(|| {
            self.with_store(|s, t| code_of(&s.remove(t, key, force)))
                .unwrap_or(NOT_INITIALIZED)
        })
    }

    fn batch_remove(&self, py: Python<'_>, keys: Vec<String>, force: bool) -> Vec<i64> {
        let n = keys.len();
        py.detach(|| {
            self.with_store(|s, t| {
                keys.iter()
                    .map(|k| code_of(&s.remove(t, k, force)))
                    .collect()
            })
            .unwrap_or_else(|| vec![NOT_INITIALIZED; n])
        })
    }

    fn remove_all(&self, py: Python<'_>, force: bool) -> i64 {
        py.detach(|| {
            self.with_store(|s, t| size_code(s.remove_all(t, force)))
                .unwrap_or(NOT_INITIALIZED)
        })
    }

    fn health_check(&self, py: Python<'_>) -> i64 {
        py.detach(|| {
            self.with_store(|s, _| match s.stats() {
                Ok(_) => 0,
                Err(e) => l3code(&e),
            })
            .unwrap_or(NOT_INITIALIZED)
        })
    }
}
