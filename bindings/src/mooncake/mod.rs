//! The integer-code core of `kvtier.mooncake_compat.MooncakeDistributedStore`.
//!
//! Why a core in Rust under a Python class: Mooncake's store takes integer addresses, and
//! touching them is only sound after the registration check, which must live where the
//! bytes are copied (`registered.rs`); the GIL is released around every store call. Argument
//! parsing (positional or dict `setup`, sizes as text), tensors and the Python-visible types
//! live in the Python package `kvtier.mooncake_compat`.
//!
//! This core never raises for store failures: it returns Mooncake's integers, exactly as
//! `mooncake.store` does. Files: `attach.rs` (what a client is attached to, set-up), `registered.rs` (registered memory and the only type that
//! reads raw addresses), `mapped.rs` (is a range mapped read-write: the registration
//! check against wild pointers), `segment.rs` (a client's contributed global segment),
//! `pool.rs` (a dummy client's pool, shared with the server when it can be), `ranges.rs`
//! (multi-buffer and byte-range calls, replica calls), `batch.rs` (write modes, the batch
//! driver, Mooncake's result codes).

use parking_lot::{Mutex, RwLock};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use kvtier_l3::ErrorCode;

use crate::convert::ByteBuf;
use crate::l3::{PyL3Store, code_of, exist_code, l3code, ms, size_code};

mod attach;
mod batch;
mod mapped;
mod pool;
mod ranges;
mod registered;
mod segment;

use attach::{Attached, tenant_of};
use batch::{Write, WriteMode, mc_get_code};
pub use batch::{error_codes, join_parts};
use pool::Pool;
use ranges::{ReplicaRow, drop_overlapping_keys, multi_parts, scatter};
use registered::{Regions, RegisteredRange, drop_overlapping};

pub(crate) const INVALID_PARAMS: i64 = ErrorCode::InvalidParams as i64;
const NOT_INITIALIZED: i64 = ErrorCode::InternalError as i64;

#[pyclass(frozen, module = "kvtier._native", name = "MooncakeCore")]
pub struct MooncakeCore {
    state: RwLock<Option<Attached>>,
    regions: Regions,
    /// Memory of `setup_dummy`'s pool (`alloc_from_mem_pool`), registered while set up.
    pool: Mutex<Option<Pool>>,
    /// Pools a later `setup_pool` replaced, kept for this object's life: addresses handed
    /// out of them must never dangle.
    retired_pools: Mutex<Vec<Pool>>,
}

#[pymethods]
impl MooncakeCore {
    #[new]
    fn new() -> Self {
        MooncakeCore {
            state: RwLock::new(None),
            regions: Regions::default(),
            pool: Mutex::new(None),
            retired_pools: Mutex::new(Vec::new()),
        }
    }

    /// Attaches to (or creates) the embedded store `name` and mounts this client's global
    /// segment of `segment_bytes` into it (none if 0). `lease_ttl_ms` applies when this
    /// call creates the store. 0 or a negative code.
    #[pyo3(signature = (name, segment_bytes, tenant, hostname, lease_ttl_ms = 10_000))]
    fn setup_embedded(
        &self,
        py: Python<'_>,
        name: &str,
        segment_bytes: u64,
        tenant: &str,
        hostname: &str,
        lease_ttl_ms: u64,
    ) -> i64 {
        let (name, hostname) = (name.to_string(), hostname.to_string());
        let r = py.detach(move || {
            Attached::embedded(
                &name,
                segment_bytes,
                tenant_of(tenant)?,
                &hostname,
                lease_ttl_ms,
            )
        });
        match r {
            Ok(a) => {
                self.attach(py, a);
                0
            }
            Err(e) => l3code(&e),
        }
    }

    /// Connects to a `kvtier-l3` server, mounting this client's segment of `segment_bytes`
    /// there when it can (see `Attached::remote`); 0 or a negative code.
    #[pyo3(signature = (addr, tenant, token = None, segment_bytes = 0, hostname = ""))]
    fn setup_remote(
        &self,
        py: Python<'_>,
        addr: &str,
        tenant: &str,
        token: Option<String>,
        segment_bytes: u64,
        hostname: &str,
    ) -> i64 {
        // "host:port", or "etcd://a;b;c[/CLUSTER]": the leader of an etcd HA cluster,
        // followed across failovers (as Mooncake's etcd master_server_address).
        let Ok(sa) = kvtier_l3::ha::Locator::parse(addr) else {
            return INVALID_PARAMS;
        };
        let hostname = hostname.to_string();
        let t = tenant_of(tenant);
        let r = py.detach(move || Attached::remote(sa, t?, token, segment_bytes, &hostname));
        match r {
            Ok(a) => {
                self.attach(py, a);
                0
            }
            Err(e) => l3code(&e),
        }
    }

    /// Attaches to the store behind a `kvtier.L3Store` handle (same tenant).
    fn setup_from(&self, py: Python<'_>, store: &PyL3Store) -> i64 {
        self.attach(
            py,
            Attached::over(store.store.clone(), store.tenant.clone()),
        );
        0
    }

    /// Allocates `pool_bytes` for `alloc_from_mem_pool` (a dummy client's shared pool in
    /// Mooncake). 0, or -1 when the host cannot give that much memory (nothing changed).
    /// Each allocation is registered on its own, so a
    /// pointer call through one can never reach its neighbour (Mooncake checks a range
    /// against the buffer it was given, not against the whole pool).
    fn setup_pool(&self, py: Python<'_>, pool_bytes: u64) -> i64 {
        let Ok(n) = usize::try_from(pool_bytes) else {
            return INVALID_PARAMS;
        };
        if n == 0 {
            return 0;
        }
        let remote = self.state.read().as_ref().and_then(|a| a.remote.clone());
        // The server maps a shared region: an RPC, so without the GIL
        let Some(pool) = py.detach(|| Pool::new(remote.as_deref(), n)) else {
            return ErrorCode::InternalError as i64;
        };
        let old = self.pool.lock().replace(pool);
        // Its allocations stay registered (until close or unregister_buffer): its memory
        // lives as long as this object (it was freed here, under pointers still handed in).
        self.retired_pools.lock().extend(old);
        0
    }

    /// `size` bytes of the pool (64-byte aligned), registered: their address, or 0 when the
    /// pool is exhausted.
    fn alloc_from_mem_pool(&self, size: u64) -> u64 {
        let (Ok(n), Ok(len)) = (usize::try_from(size), i64::try_from(size)) else {
            return 0;
        };
        let mut g = self.pool.lock();
        let Some(pool) = g.as_mut() else {
            return 0;
        };
        pool.alloc(n, |addr| self.regions.register(addr, len) == 0)
            .unwrap_or(0)
    }

    /// Whether `alloc_from_mem_pool` memory is shared with the server.
    fn pool_is_shared(&self) -> bool {
        self.pool.lock().as_ref().is_some_and(Pool::is_shared)
    }

    /// Whether this client contributed a segment (see `setup_embedded`, `setup_remote`).
    fn has_segment(&self) -> bool {
        self.state
            .read()
            .as_ref()
            .is_some_and(|a| a.segment.is_some())
    }

    fn is_setup(&self) -> bool {
        self.state.read().is_some()
    }

    /// Unmounts this client's segment (its objects are gone), detaches, forgets registered
    /// memory. The pool's memory stays allocated until the object is dropped (a pointer
    /// handed out earlier must never dangle), but is no longer registered.
    fn close(&self, py: Python<'_>) -> i64 {
        let a = self.state.write().take();
        py.detach(move || drop(a));
        // returns once no call still copies into registered memory (registered.rs)
        py.detach(|| self.regions.clear());
        0
    }

    fn register_buffer(&self, ptr: u64, size: i64) -> i64 {
        self.regions.register(ptr, size)
    }

    /// 0 once no pointer call can touch the buffer any more (calls that began before it
    /// have ended), or -600 for a pointer that is not registered.
    fn unregister_buffer(&self, py: Python<'_>, ptr: u64) -> i64 {
        py.detach(|| self.regions.unregister(ptr))
    }

    /// A copy of `[ptr, ptr + size)` if it lies inside registered memory (the tensor calls
    /// read a buffer's tensor header through this), else None.
    fn read_registered<'py>(
        &self,
        py: Python<'py>,
        ptr: u64,
        size: i64,
    ) -> Option<Bound<'py, PyBytes>> {
        let calls = self.regions.enter();
        let r = calls.check(ptr, size)?;
        // SAFETY: a checked range, read while its use lasts.
        Some(PyBytes::new(py, unsafe { r.bytes() }))
    }

    #[pyo3(signature = (key, value, replica_num = 1))]
    fn put(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        replica_num: u32,
    ) -> PyResult<i64> {
        self.put_bytes(py, key, value, Write::new(WriteMode::Insert, replica_num))
    }

    #[pyo3(signature = (key, value, replica_num = 1))]
    fn upsert(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        replica_num: u32,
    ) -> PyResult<i64> {
        self.put_bytes(py, key, value, Write::new(WriteMode::Upsert, replica_num))
    }

    #[pyo3(signature = (keys, values, replica_num = 1))]
    fn put_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: &Bound<'_, PyAny>,
        replica_num: u32,
    ) -> PyResult<i64> {
        self.put_many(py, keys, values, Write::new(WriteMode::Insert, replica_num))
    }

    #[pyo3(signature = (keys, values, replica_num = 1))]
    fn upsert_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: &Bound<'_, PyAny>,
        replica_num: u32,
    ) -> PyResult<i64> {
        self.put_many(py, keys, values, Write::new(WriteMode::Upsert, replica_num))
    }

    fn get<'py>(&self, py: Python<'py>, key: &str) -> Bound<'py, PyBytes> {
        let r = match self.handle() {
            Some((s, t)) => py.detach(|| s.get(&t, key).unwrap_or_default()),
            None => Vec::new(),
        };
        PyBytes::new(py, &r)
    }

    fn get_batch<'py>(&self, py: Python<'py>, keys: Vec<String>) -> PyResult<Bound<'py, PyList>> {
        let vals: Vec<Vec<u8>> = match self.handle() {
            Some((s, t)) => py.detach(|| {
                keys.iter()
                    .map(|k| s.get(&t, k).unwrap_or_default())
                    .collect()
            }),
            None => vec![Vec::new(); keys.len()],
        };
        PyList::new(py, vals.iter().map(|v| PyBytes::new(py, v)))
    }

    /// Reads `key` into a writable buffer object (what `get_buffer` hands out): its size or
    /// a negative code (-10 when the buffer is too small: the object grew; read again).
    fn get_into_buffer(&self, py: Python<'_>, key: &str, buf: &Bound<'_, PyAny>) -> PyResult<i64> {
        let mut b = ByteBuf::get(buf, true, "buf")?;
        let Some((s, t)) = self.handle() else {
            return Ok(self.unattached());
        };
        Ok(py.detach(|| size_code(s.get_into(&t, key, b.as_mut_slice()))))
    }

    #[pyo3(signature = (key, ptr, size, replica_num = 1))]
    fn put_from(&self, py: Python<'_>, key: String, ptr: u64, size: i64, replica_num: u32) -> i64 {
        let w = Write::new(WriteMode::Insert, replica_num);
        self.put_ranges(py, vec![key], vec![ptr], vec![size], w)[0]
    }

    #[pyo3(signature = (key, ptr, size, replica_num = 1))]
    fn upsert_from(
        &self,
        py: Python<'_>,
        key: String,
        ptr: u64,
        size: i64,
        replica_num: u32,
    ) -> i64 {
        let w = Write::new(WriteMode::Upsert, replica_num);
        self.put_ranges(py, vec![key], vec![ptr], vec![size], w)[0]
    }

    #[pyo3(signature = (keys, ptrs, sizes, replica_num = 1))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<u64>,
        sizes: Vec<i64>,
        replica_num: u32,
    ) -> Vec<i64> {
        let w = Write::new(WriteMode::Insert, replica_num);
        self.put_ranges(py, keys, ptrs, sizes, w)
    }

    #[pyo3(signature = (keys, ptrs, sizes, replica_num = 1))]
    fn batch_upsert_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<u64>,
        sizes: Vec<i64>,
        replica_num: u32,
    ) -> Vec<i64> {
        let w = Write::new(WriteMode::Upsert, replica_num);
        self.put_ranges(py, keys, ptrs, sizes, w)
    }

    fn get_into(&self, py: Python<'_>, key: String, ptr: u64, size: i64) -> i64 {
        self.batch_get_into(py, vec![key], vec![ptr], vec![size])[0]
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
        let calls = self.regions.enter();
        let mut ranges: Vec<Option<RegisteredRange>> = calls.check_all(&ptrs, &sizes);
        drop_overlapping(&mut ranges);
        self.mc_batch(
            py,
            &keys,
            |i| ranges[i].is_some(),
            |s, t, idx, sel| {
                // SAFETY: registered, pairwise disjoint ranges.
                let mut views: Vec<&mut [u8]> = idx
                    .iter()
                    .filter_map(|&i| ranges[i].map(|r| unsafe { r.bytes_mut() }))
                    .collect();
                s.batch_get_into(t, sel, &mut views)
            },
            mc_get_code,
        )
    }

    /// Stores each key from several registered buffers, concatenated in order.
    #[pyo3(signature = (keys, all_ptrs, all_sizes, replica_num = 1))]
    fn batch_put_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<i64>>,
        replica_num: u32,
    ) -> Vec<i64> {
        let w = Write::new(WriteMode::Insert, replica_num);
        self.put_multi(py, keys, all_ptrs, all_sizes, w)
    }

    /// As `batch_put_from_multi_buffers`, replacing existing objects.
    #[pyo3(signature = (keys, all_ptrs, all_sizes, replica_num = 1))]
    fn batch_upsert_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<i64>>,
        replica_num: u32,
    ) -> Vec<i64> {
        let w = Write::new(WriteMode::Upsert, replica_num);
        self.put_multi(py, keys, all_ptrs, all_sizes, w)
    }

    /// Reads each key and scatters its bytes over several registered buffers in order.
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
        let calls = self.regions.enter();
        let mut parts = multi_parts(&calls, &all_ptrs, &all_sizes);
        drop_overlapping_keys(&mut parts);
        self.mc_batch(
            py,
            &keys,
            |i| parts[i].is_some(),
            |s, t, idx, sel| {
                let cap = |i: usize| parts[i].iter().flatten().map(|r| r.len()).sum::<usize>();
                let mut tmp: Vec<Vec<u8>> = idx.iter().map(|&i| vec![0u8; cap(i)]).collect();
                let mut views: Vec<&mut [u8]> = tmp.iter_mut().map(|v| v.as_mut_slice()).collect();
                let r = s.batch_get_into(t, sel, &mut views);
                if let Ok(v) = &r {
                    for (j, res) in v.iter().enumerate() {
                        if let (Ok(n), Some(&i), Some(src)) = (res, idx.get(j), tmp.get(j)) {
                            let n = (*n as usize).min(src.len());
                            scatter(&src[..n], parts[i].as_deref().unwrap_or_default());
                        }
                    }
                }
                r
            },
            mc_get_code,
        )
    }

    /// Mooncake's `get_into_ranges`: per buffer, per key, per range the bytes copied from
    /// `src_offsets` of the object to `dst_offsets` of the buffer, or a negative code.
    fn get_into_ranges(
        &self,
        py: Python<'_>,
        buffer_ptrs: Vec<u64>,
        all_keys: Vec<Vec<String>>,
        all_dst_offsets: Vec<Vec<Vec<i64>>>,
        all_src_offsets: Vec<Vec<Vec<i64>>>,
        all_sizes: Vec<Vec<Vec<i64>>>,
    ) -> Vec<Vec<Vec<i64>>> {
        let n = buffer_ptrs.len();
        let per_key = |c: i64, i: usize| -> Vec<Vec<i64>> {
            all_keys
                .get(i)
                .map(|ks| ks.iter().map(|_| vec![c]).collect())
                .unwrap_or_default()
        };
        if all_keys.len() != n
            || all_dst_offsets.len() != n
            || all_src_offsets.len() != n
            || all_sizes.len() != n
        {
            return (0..n).map(|i| per_key(INVALID_PARAMS, i)).collect();
        }
        let Some((s, t)) = self.handle() else {
            return (0..n).map(|i| per_key(self.unattached(), i)).collect();
        };
        let calls = self.regions.enter();
        py.detach(|| {
            (0..n)
                .map(|i| {
                    ranges::get_ranges_into(
                        s.as_ref(),
                        &t,
                        &calls,
                        buffer_ptrs[i],
                        &all_keys[i],
                        &all_dst_offsets[i],
                        &all_src_offsets[i],
                        &all_sizes[i],
                    )
                })
                .collect()
        })
    }

    /// Per key its replicas as rows (see `ranges::ReplicaRow`); empty for a missing key.
    fn replica_rows(&self, py: Python<'_>, keys: Vec<String>) -> Vec<Vec<ReplicaRow>> {
        let Some((s, t)) = self.handle() else {
            return vec![Vec::new(); keys.len()];
        };
        py.detach(|| {
            keys.iter()
                .map(|k| ranges::replica_rows(s.as_ref(), &t, k))
                .collect()
        })
    }

    /// The keys whose replicas were cleared (see `ranges::replica_clear`).
    fn batch_replica_clear(&self, py: Python<'_>, keys: Vec<String>, segment: &str) -> Vec<String> {
        // Not under the state lock: close() takes it holding the GIL, which this call
        // needs back at its end (the two threads waited on each other for ever).
        let Some((s, t)) = self.handle() else {
            return Vec::new();
        };
        py.detach(|| ranges::replica_clear(s.as_ref(), &t, &keys, segment))
    }

    fn is_exist(&self, py: Python<'_>, key: String) -> i64 {
        self.batch_is_exist(py, vec![key])[0]
    }

    fn batch_is_exist(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        let Some((s, t)) = self.handle() else {
            return vec![self.unattached(); keys.len()];
        };
        py.detach(|| {
            batch::chunks(s.as_ref(), &keys)
                .flat_map(|k| match s.batch_is_exist(&t, k) {
                    Ok(v) => v.into_iter().map(exist_code).collect(),
                    Err(e) => vec![l3code(&e); k.len()],
                })
                .collect()
        })
    }

    fn get_size(&self, py: Python<'_>, key: &str) -> i64 {
        let Some((s, t)) = self.handle() else {
            return self.unattached();
        };
        py.detach(|| size_code(s.get_size(&t, key)))
    }

    fn remove(&self, py: Python<'_>, key: String, force: bool) -> i64 {
        self.batch_remove(py, vec![key], force)[0]
    }

    fn batch_remove(&self, py: Python<'_>, keys: Vec<String>, force: bool) -> Vec<i64> {
        let Some((s, t)) = self.handle() else {
            return vec![self.unattached(); keys.len()];
        };
        py.detach(|| {
            keys.iter()
                .map(|k| code_of(&s.remove(&t, k, force)))
                .collect()
        })
    }

    fn remove_all(&self, py: Python<'_>, force: bool) -> i64 {
        let Some((s, t)) = self.handle() else {
            return self.unattached();
        };
        py.detach(|| size_code(s.remove_all(&t, force)))
    }

    /// Mooncake's `remove_by_regex`: the count removed, or a negative code (-600 for an
    /// invalid pattern). The store filters its own keys: nothing is listed to Python.
    fn remove_by_regex(&self, py: Python<'_>, pattern: String, force: bool) -> i64 {
        let Some((s, t)) = self.handle() else {
            return self.unattached();
        };
        py.detach(|| size_code(s.remove_by_regex(&t, &pattern, force)))
    }

    /// Mooncake's `create_copy_task(key, targets)`, run to completion: 0, or the first
    /// negative code (-600 for no target, or for a name that is no segment when the key
    /// exists, checked before any copy; -704 for a missing key). A target that already
    /// holds a replica is skipped.
    fn copy_replica(&self, py: Python<'_>, key: String, targets: Vec<String>) -> i64 {
        let Some((s, t)) = self.handle() else {
            return self.unattached();
        };
        py.detach(|| ranges::copy_replica(s.as_ref(), &t, &key, &targets))
    }

    /// Mooncake's `create_move_task(key, source, target)`, run to completion: 0 or a
    /// negative code (-600 for a name that is no segment).
    fn move_replica(&self, py: Python<'_>, key: String, source: &str, target: &str) -> i64 {
        let Some((s, t)) = self.handle() else {
            return self.unattached();
        };
        py.detach(|| ranges::move_replica(s.as_ref(), &t, &key, source, target))
    }

    /// 0 when the store answers, else a negative code.
    fn health_check(&self, py: Python<'_>) -> i64 {
        let Some((s, _)) = self.handle() else {
            return self.unattached();
        };
        py.detach(|| code_of(&s.stats()))
    }

    /// The embedded store's lease TTL in ms (None for a remote store).
    fn lease_ttl_ms(&self) -> Option<u64> {
        let g = self.state.read();
        let e = g.as_ref()?.embedded.as_ref()?;
        Some(e.config().lease_ttl.as_millis() as u64)
    }

    /// Moves an embedded store's clock forward (tests: expire leases without sleeping);
    /// false on a remote store.
    fn advance_clock_ms(&self, v: u64) -> bool {
        let g = self.state.read();
        match g.as_ref().and_then(|a| a.embedded.as_ref()) {
            Some(e) => {
                e.clock().advance(ms(v));
                true
            }
            None => false,
        }
    }
}
