//! The native side of the Python-vs-Rust benchmark: the scheduler bench's own scenario
//! (`scheduler/benches/scenario/mod.rs`, compiled in here unchanged) timed in Rust, so the
//! Python figure and the native one come from the same build, process and machine.

use std::time::Instant;

use pyo3::prelude::*;

#[path = "../../scheduler/benches/scenario/mod.rs"]
#[allow(dead_code, clippy::all)]
mod scenario;

/// `kvtier._native.bench_native_decode_step(n, iters)`: sets up `n` requests decoding
/// (256 distinct 4,096-token prompts, page 64, budget 8,192, host = 2 × device, ops
/// acknowledged at once) and times `iters` calls of `next_execution_plan` for the decode step
/// (each followed by its untimed ForwardDone). Returns the per-call times in nanoseconds.
#[pyfunction]
#[pyo3(signature = (n = 256, iters = 200))]
pub fn bench_native_decode_step(py: Python<'_>, n: usize, iters: usize) -> PyResult<Vec<u64>> {
    if n == 0 || n > 4096 || iters == 0 || iters > 1800 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "n must be in 1..=4096 and iters in 1..=1800",
        ));
    }
    Ok(py.detach(|| {
        let mut d = scenario::decoding(n);
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters {
            let (t_plan, _) = scenario::timed_decode_step(&mut d);
            out.push(u64::try_from(t_plan.as_nanos()).unwrap_or(u64::MAX));
        }
        out
    }))
}

/// `kvtier._native.bench_prompt(i)`: request `i`'s prompt in that scenario (uint32 tokens).
#[pyfunction]
pub fn bench_prompt(py: Python<'_>, i: u64) -> Bound<'_, numpy::PyArray1<u32>> {
    numpy::PyArray1::from_vec(py, scenario::prompt(i))
}

/// `kvtier._native.bench_config(n, max_new)`: the scenario's configuration as a dict.
#[pyfunction]
pub fn bench_config(
    py: Python<'_>,
    n: usize,
    max_new: u32,
) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    crate::config::config_to_dict(py, &scenario::config(n, max_new))
}

/// Wall-clock helper for the Python side of the benchmark (monotonic ns).
#[pyfunction]
pub fn monotonic_ns() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    u64::try_from(START.get_or_init(Instant::now).elapsed().as_nanos()).unwrap_or(u64::MAX)
}
