//! The router's top-level integration tests' fixtures: the page size and cost model they
//! route with, and a msgpack string.
#![allow(dead_code)]

use kvtier_router::CostModel;
use rmpv::Value;

pub const PS: usize = 4;

pub fn model() -> CostModel {
    CostModel {
        page_size: PS,
        page_bytes: 1 << 20,
        prefill_tokens_per_s: 1000.0,
        host_bytes_per_s: 1e9,
        l3_bytes_per_s: 2.5e8,
    }
}

pub fn s(x: &str) -> Value {
    Value::from(x)
}
