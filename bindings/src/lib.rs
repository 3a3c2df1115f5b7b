//! # kvtier-bindings — kvtier from Python (`import kvtier`)
//!
//! The engines that link kvtier in run their event loop in Python; this crate is the
//! extension module `kvtier._native` that the `kvtier` package (bindings/python/kvtier/)
//! re-exports. Built with maturin as an abi3 wheel (CPython ≥ 3.9).
//!
//! - `sched.rs`: `Scheduler` (GIL released while it plans or hashes);
//! - `offload.rs`: `OffloadManager`, kvtier's host tier for an engine that owns its device
//!   tier (the scheduler crate's offloading-manager mode);
//! - `plan.rs`: `ExecutionPlan` (decode rows as numpy columns, page ids as uint32 arrays),
//!   `PlannedOp`, `PrefillChunk`, the completion events, `page_hashes`;
//! - `config.rs`: `SchedulerConfig` (a Python dataclass) ↔ Rust;
//! - `l3/`: `L3Store` (embedded / remote), `L3Server`, `QueryResults`;
//! - `mooncake/`: the integer-code core of `kvtier.mooncake_compat.MooncakeDistributedStore`
//!   (registered memory, contributed segments, byte-range and replica calls) and
//!   `ERROR_CODES`, Mooncake's code table exported from the l3 crate;
//! - `errors.rs`: one Python exception class per Rust error kind;
//! - `fork.rs`: handles a forked child inherits refuse its calls and are leaked, not torn down;
//! - `convert.rs`: checked conversion of integer arrays and byte buffers;
//! - `bench.rs`: the scheduler bench scenario timed natively, for the Python/Rust ratio.
//!
//! Nothing reachable from Python panics on bad input: every argument is converted with a
//! typed error, and every Rust error becomes a Python exception (or, in the Mooncake-compatible
//! core, Mooncake's integer code).

use pyo3::prelude::*;

mod bench;
mod config;
mod convert;
mod errors;
mod events;
mod fork;
mod l3;
mod mooncake;
mod offload;
mod overlap;
mod plan;
mod policy;
mod sched;
mod tp;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<sched::PyScheduler>()?;
    m.add_class::<events::PyKvEventPublisher>()?;
    m.add_class::<tp::PyRankAgreement>()?;
    m.add_class::<offload::PyOffloadManager>()?;
    m.add_class::<plan::PyPlan>()?;
    m.add_class::<plan::PyPlannedOp>()?;
    m.add_class::<plan::PyPrefillChunk>()?;
    m.add_class::<plan::PyL3QueryDone>()?;
    m.add_class::<plan::PyPrefetchDone>()?;
    m.add_class::<plan::PyLoadBackDone>()?;
    m.add_class::<plan::PyWriteBackDone>()?;
    m.add_class::<plan::PyBackUpDone>()?;
    m.add_class::<plan::PyForwardDone>()?;
    m.add_class::<l3::PyL3Store>()?;
    m.add_class::<l3::PyL3Server>()?;
    m.add_class::<l3::PyQueryResults>()?;
    m.add_class::<mooncake::MooncakeCore>()?;
    m.add("ERROR_CODES", mooncake::error_codes(m.py())?)?;
    m.add_function(wrap_pyfunction!(mooncake::join_parts, m)?)?;
    m.add_function(wrap_pyfunction!(plan::page_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(policy::eviction_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(plan::event_roundtrip, m)?)?;
    m.add_function(wrap_pyfunction!(config::validate_config, m)?)?;
    m.add_function(wrap_pyfunction!(config::default_config, m)?)?;
    m.add_function(wrap_pyfunction!(config::config_roundtrip, m)?)?;
    m.add_function(wrap_pyfunction!(sched::op_kinds, m)?)?;
    m.add_function(wrap_pyfunction!(sched::parse_l3_key, m)?)?;
    m.add_function(wrap_pyfunction!(l3::l3_charge, m)?)?;
    m.add_function(wrap_pyfunction!(bench::bench_native_decode_step, m)?)?;
    m.add_function(wrap_pyfunction!(bench::bench_prompt, m)?)?;
    m.add_function(wrap_pyfunction!(bench::bench_config, m)?)?;
    m.add_function(wrap_pyfunction!(bench::monotonic_ns, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
