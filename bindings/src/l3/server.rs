//! `kvtier.L3Server`: a `kvtier-l3` server in this process (its own threads), for tests and
//! single-host setups where a separate binary is one process too many.

use std::net::SocketAddr;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use kvtier_l3::{EmbeddedStore, L3Result, ServerHandle, ServerOptions, spawn_server};

use super::store_config;
use crate::errors::l3_err;
use crate::fork::Owner;

/// A `kvtier-l3` server running in this process (its own threads), serving an embedded store.
#[pyclass(module = "kvtier", name = "L3Server")]
pub struct PyL3Server {
    handle: Option<ServerHandle>,
    addr: String,
    /// In a child forked after, the server is not the child's to stop (`fork.rs`).
    owner: Owner,
}

impl Drop for PyL3Server {
    fn drop(&mut self) {
        if !self.owner.is_here() {
            std::mem::forget(self.handle.take());
        }
    }
}

#[pymethods]
impl PyL3Server {
    /// Starts serving on `addr` (default: an ephemeral loopback port).
    #[new]
    #[pyo3(signature = (segment_bytes = 1 << 30, *, addr = "127.0.0.1:0", token = None,
                        lease_ttl_ms = 10_000, max_object_bytes = 1 << 30, max_batch_keys = 65_536,
                        ssd_dir = None, loss_journal_keys = 65_536, tenant_quota_bytes = None,
                        client_segments_max_bytes = None))]
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
        loss_journal_keys: usize,
        tenant_quota_bytes: Option<std::collections::HashMap<String, u64>>,
        client_segments_max_bytes: Option<u64>,
    ) -> PyResult<Self> {
        let sa: SocketAddr = addr
            .parse()
            .map_err(|e| PyValueError::new_err(format!("bad address {addr:?}: {e}")))?;
        let mut cfg = store_config(
            segment_bytes,
            lease_ttl_ms,
            max_object_bytes,
            max_batch_keys,
            ssd_dir,
            None,
        );
        cfg.loss_journal_keys = loss_journal_keys;
        cfg.tenant_quota_bytes = tenant_quota_bytes.unwrap_or_default().into_iter().collect();
        // As `kvtier-l3`: clients' mounts are capped at the host's memory unless told.
        cfg.client_segments_max_bytes =
            client_segments_max_bytes.or_else(kvtier_l3::config::host_memory_bytes);
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
            owner: Owner::here(),
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

    /// Stops serving (idempotent). In a child forked after, stops nothing: the parent's
    /// server goes on serving, and the child's handle reads as not running.
    fn shutdown(&mut self, py: Python<'_>) {
        match self.handle.take() {
            Some(h) if self.owner.is_here() => py.detach(move || h.shutdown()),
            h => std::mem::forget(h),
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
