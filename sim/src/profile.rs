//! Model and hardware profiles: what a forward pass and a copy cost in simulated time.
//!
//! Why: pages in the simulator are a few bytes (so long traces fit in RAM), but timing uses the
//! model's real KV size, so a load-back of 100 pages costs what 100 × 64 tokens × 128 KiB
//! would cost over PCIe, and prefetch policies, overlap and queueing behave as on hardware.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    pub name: String,
    /// KV bytes per token on one engine instance (all layers, K and V).
    pub kv_bytes_per_token: u64,
    /// Prefill throughput (tokens/s) and fixed cost per forward (ms).
    pub prefill_tokens_per_s: f64,
    pub forward_base_ms: f64,
    /// Decode cost per row (µs) and per 1K tokens of context attended (µs).
    pub decode_row_us: f64,
    pub decode_ctx_us_per_ktok: f64,
}

/// How an instance's network link to the L3 carries its reads (prefetches) and its writes
/// (backups).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum L3Link {
    /// One queue, first come first served: a prefetch waits behind the backups issued before
    /// it (the simulator's model since the start; every figure in the docs used it).
    #[default]
    Shared,
    /// Each direction its own queue at `l3_gb_per_s`, as a full-duplex NIC carries them: a
    /// prefetch waits only for the reads before it.
    Duplex,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkProfile {
    /// Host ↔ device (PCIe), each direction.
    pub pcie_gb_per_s: f64,
    pub pcie_latency_us: f64,
    /// Engine ↔ L3 (network).
    pub l3_gb_per_s: f64,
    pub l3_latency_us: f64,
    /// Metadata round trip of an L3 existence probe.
    pub l3_query_us: f64,
    /// L3's SSD tier: a prefetch of SSD-only objects reads them from SSD first.
    #[serde(default = "default_ssd_gbps")]
    pub ssd_gb_per_s: f64,
    #[serde(default = "default_ssd_latency")]
    pub ssd_latency_us: f64,
    /// Whether reads and writes share the L3 link (`[links] l3_link`, `--l3-link`).
    #[serde(default)]
    pub l3_link: L3Link,
}

fn default_ssd_gbps() -> f64 {
    3.0
}
fn default_ssd_latency() -> f64 {
    100.0
}

impl Default for LinkProfile {
    fn default() -> Self {
        LinkProfile {
            pcie_gb_per_s: 25.0,
            pcie_latency_us: 10.0,
            l3_gb_per_s: 10.0,
            l3_latency_us: 50.0,
            l3_query_us: 150.0,
            ssd_gb_per_s: default_ssd_gbps(),
            ssd_latency_us: default_ssd_latency(),
            l3_link: L3Link::default(),
        }
    }
}

/// Built-in model profiles (H100-class numbers, rounded).
pub fn builtin(name: &str) -> Option<ModelProfile> {
    let p = |name: &str, kv: u64, prefill: f64, base: f64, row: f64, ctx: f64| ModelProfile {
        name: name.into(),
        kv_bytes_per_token: kv,
        prefill_tokens_per_s: prefill,
        forward_base_ms: base,
        decode_row_us: row,
        decode_ctx_us_per_ktok: ctx,
    };
    Some(match name {
        // 32 layers × 8 KV heads × 128 dims × (K,V) × bf16
        "llama3-8b" => p(name, 131_072, 60_000.0, 6.0, 25.0, 1.5),
        // 80 layers × 8 KV heads × 128 × 2 × 2 bytes, split over 8 ranks
        "llama3-70b-tp8" => p(name, 40_960, 40_000.0, 12.0, 40.0, 2.0),
        // 28 layers × 4 KV heads × 128 × 2 × 2 bytes
        "qwen2.5-7b" => p(name, 57_344, 70_000.0, 5.0, 20.0, 1.0),
        _ => return None,
    })
}

pub const BUILTIN_PROFILES: &[&str] = &["llama3-8b", "llama3-70b-tp8", "qwen2.5-7b"];

impl ModelProfile {
    /// Duration (µs) of a forward with `prefill_tokens` prefill tokens and `decode_rows` rows
    /// attending `decode_ctx_tokens` tokens in total.
    pub fn forward_us(&self, prefill_tokens: u64, decode_rows: u64, decode_ctx_tokens: u64) -> u64 {
        let us = self.forward_base_ms * 1000.0
            + prefill_tokens as f64 / self.prefill_tokens_per_s * 1e6
            + decode_rows as f64 * self.decode_row_us
            + decode_ctx_tokens as f64 / 1000.0 * self.decode_ctx_us_per_ktok;
        us.max(1.0) as u64
    }
}

impl LinkProfile {
    pub fn pcie_us(&self, bytes: u64) -> u64 {
        (self.pcie_latency_us + bytes as f64 / (self.pcie_gb_per_s * 1e3)).max(1.0) as u64
    }
    pub fn ssd_us(&self, bytes: u64) -> u64 {
        if bytes == 0 {
            return 0;
        }
        (self.ssd_latency_us + bytes as f64 / (self.ssd_gb_per_s * 1e3)).max(1.0) as u64
    }
    pub fn l3_us(&self, bytes: u64) -> u64 {
        (self.l3_latency_us + bytes as f64 / (self.l3_gb_per_s * 1e3)).max(1.0) as u64
    }
}
