//! `kvtier.KvEventPublisher`: kvtier's KV cache events on a ZMQ socket in vLLM's wire format.
//!
//! Why a class of its own rather than a scheduler method: the publisher owns sockets and a
//! thread, lives as long as the engine, and may publish for several schedulers (one per data
//! parallel rank has its own publisher, as in vLLM). `publish_from(scheduler)` drains the
//! scheduler's events and publishes them in one call, so no event crosses into Python.

use pyo3::prelude::*;

use pyo3::exceptions::PyValueError;

use kvtier_events::{HashFormat, PublishError, Publisher, PublisherConfig};

use crate::errors::base::{ConfigError, EventsError};
use crate::sched::PyScheduler;

fn events_err(e: PublishError) -> PyErr {
    EventsError::new_err(e.to_string())
}

/// Publishes KV events: a PUB socket (topic, 8-byte big-endian sequence number, msgpack
/// `KVEventBatch`) and a ROUTER replay socket, as vLLM's `ZmqEventPublisher`; a replay request
/// of -2 returns a snapshot of every resident block. The device tier is published as medium
/// `GPU`, the host tier as `CPU`. Block hashes go as vLLM sends them by default, the low 64
/// bits of the hash as an integer (`block_hashes="int"`), or as the whole 32 bytes
/// (`block_hashes="bytes"`). Binds loopback ephemeral ports by default (`endpoint`
/// and `replay_endpoint` say which); `replay_endpoint=None` disables replay and snapshots.
#[pyclass(module = "kvtier", name = "KvEventPublisher")]
pub struct PyKvEventPublisher {
    inner: Option<Publisher>,
    endpoint: String,
    replay_endpoint: Option<String>,
}

impl PyKvEventPublisher {
    /// The publisher, if open and bound by this process (a child forked after may not use
    /// it: `Publisher::same_process`).
    fn live(&self) -> PyResult<&Publisher> {
        let p = self
            .inner
            .as_ref()
            .ok_or_else(|| EventsError::new_err("the publisher is closed"))?;
        p.same_process().map_err(events_err)?;
        Ok(p)
    }
}

#[pymethods]
impl PyKvEventPublisher {
    // one keyword argument per PublisherConfig field, as vLLM's KVEventsConfig has them
    #[allow(clippy::too_many_arguments)]
    #[new]
    #[pyo3(signature = (endpoint="tcp://127.0.0.1:*".to_string(), replay_endpoint=Some("tcp://127.0.0.1:*".to_string()),
                        topic=String::new(), block_size=16, data_parallel_rank=0, buffer_steps=10_000, hwm=100_000,
                        block_hashes="int", buffer_bytes=kvtier_events::DEFAULT_BUFFER_BYTES))]
    fn new(
        py: Python<'_>,
        endpoint: String,
        replay_endpoint: Option<String>,
        topic: String,
        block_size: u32,
        data_parallel_rank: i64,
        buffer_steps: usize,
        hwm: i32,
        block_hashes: &str,
        buffer_bytes: usize,
    ) -> PyResult<Self> {
        let hash_format = match block_hashes {
            "int" => HashFormat::Int64,
            "bytes" => HashFormat::Bytes,
            other => {
                return Err(PyValueError::new_err(format!(
                    "block_hashes must be \"int\" (vLLM's default) or \"bytes\", not {other:?}"
                )));
            }
        };
        let cfg = PublisherConfig {
            endpoint,
            replay_endpoint,
            topic,
            buffer_steps,
            buffer_bytes,
            hwm,
            data_parallel_rank,
            block_size,
            hash_format,
        };
        let p = py.detach(|| Publisher::bind(cfg)).map_err(events_err)?;
        Ok(Self {
            endpoint: p.endpoint().to_string(),
            replay_endpoint: p.replay_endpoint().map(str::to_string),
            inner: Some(p),
        })
    }

    /// The PUB socket's bound address (e.g. `tcp://127.0.0.1:43117`).
    #[getter]
    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    #[getter]
    fn replay_endpoint(&self) -> Option<String> {
        self.replay_endpoint.clone()
    }

    /// Drains `scheduler`'s KV events (it needs `record_kv_events=True`) and publishes them as
    /// one batch stamped `ts` (seconds); returns the batch's sequence number, or None when
    /// there was nothing to publish. Refused, draining nothing: a `ts` that is not finite
    /// (`ValueError`), a scheduler whose `page_size` is not this publisher's `block_size`
    /// (`ConfigError`: every event would misstate its blocks' size), a closed publisher or
    /// one bound by the parent of this forked process (`EventsError`).
    fn publish_from(
        &self,
        py: Python<'_>,
        scheduler: &mut PyScheduler,
        ts: f64,
    ) -> PyResult<Option<u64>> {
        let p = self.live()?;
        // checked before the events are drained: a refused call leaves them to the next one
        if !ts.is_finite() {
            return Err(PyValueError::new_err(format!(
                "ts {ts} is not a finite time in seconds"
            )));
        }
        let page_size = scheduler.inner.config().page_size;
        if usize::try_from(p.block_size()).ok() != Some(page_size) {
            return Err(ConfigError::new_err(format!(
                "this publisher's block_size {} is not the scheduler's page_size {page_size}: \
                 each BlockStored event would carry {page_size} tokens a block and say {}",
                p.block_size(),
                p.block_size()
            )));
        }
        let events = scheduler.inner.drain_kv_events();
        if events.is_empty() {
            return Ok(None);
        }
        py.detach(|| p.publish_kv(ts, &events))
            .map(Some)
            .map_err(events_err)
    }

    /// Blocks the publisher's mirror holds: what a snapshot would list. Waits (without the
    /// GIL) until the publisher thread has folded every batch published before the call.
    #[getter]
    fn resident_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        let p = self.live()?;
        Ok(py.detach(|| p.resident_blocks()))
    }

    /// Stops the publisher thread and closes the sockets (idempotent).
    fn close(&mut self, py: Python<'_>) {
        if let Some(mut p) = self.inner.take() {
            py.detach(|| p.shutdown());
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &mut self,
        py: Python<'_>,
        _t: Option<Bound<'_, PyAny>>,
        _v: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }
}
