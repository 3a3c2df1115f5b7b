//! The expected time to first token of a request on one instance.
//!
//! `ttft = queue + computed_tokens / prefill_rate + host_pages * page_bytes / host_bw
//!         + l3_pages * page_bytes / l3_bw`
//!
//! Loads are counted serially with the compute: kvtier overlaps a load with the forward pass
//! layer by layer, but a prefix that must be loaded is loaded before the tokens after it can
//! run, so the sum is the cautious estimate (and the one that stays right when the load is
//! the larger part). The constants are per deployment: measure them (docs/torch.md has the
//! GPU figures; the simulator's profile the compute).

/// Rates of one instance class.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Tokens per page.
    pub page_size: usize,
    /// Bytes of one page's KV (all layers).
    pub page_bytes: u64,
    /// Prefill throughput, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Host-to-device load bandwidth, bytes per second.
    pub host_bytes_per_s: f64,
    /// L3-to-device load bandwidth, bytes per second.
    pub l3_bytes_per_s: f64,
}

impl CostModel {
    /// Refuses a model whose estimates would be meaningless: a page of no tokens (the router
    /// would see no cached page), or a rate that is not a finite number above 0 (an infinite
    /// or NaN compute time makes every instance equal, and a NaN queue sends every later
    /// request to instance 0).
    pub fn check(&self) -> Result<(), crate::RouteError> {
        let bad = |what: &str, v: String| Err(crate::RouteError::BadModel(format!("{what} {v}")));
        if self.page_size == 0 {
            return bad("page size", "0".into());
        }
        if self.page_bytes == 0 {
            return bad("page bytes", "0".into());
        }
        for (what, v) in [
            ("prefill tokens per second", self.prefill_tokens_per_s),
            ("host bytes per second", self.host_bytes_per_s),
            ("L3 bytes per second", self.l3_bytes_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(what, v.to_string());
            }
        }
        Ok(())
    }

    /// Llama-3-8B-like pages (16 tokens, 2 MiB) on an H100: 20K prefill tokens/s, host loads
    /// at 50 GB/s, L3 at 10 GB/s.
    pub fn h100_llama8b() -> Self {
        Self {
            page_size: 16,
            page_bytes: 2 << 20,
            prefill_tokens_per_s: 20_000.0,
            host_bytes_per_s: 50e9,
            l3_bytes_per_s: 10e9,
        }
    }

    /// Seconds to serve `tokens` prompt tokens of which `gpu`, `host` and `l3` pages (in
    /// prefix order) are cached on each tier, after `queue_s` seconds of queued work.
    pub fn estimate(
        &self,
        tokens: usize,
        gpu: usize,
        host: usize,
        l3: usize,
        queue_s: f64,
    ) -> Estimate {
        let cached_tokens = ((gpu + host + l3) * self.page_size).min(tokens);
        let compute_s = (tokens - cached_tokens) as f64 / self.prefill_tokens_per_s;
        let load_s = host as f64 * self.page_bytes as f64 / self.host_bytes_per_s
            + l3 as f64 * self.page_bytes as f64 / self.l3_bytes_per_s;
        Estimate {
            gpu_pages: gpu,
            host_pages: host,
            l3_pages: l3,
            queue_s,
            compute_s,
            load_s,
        }
    }
}

/// One instance's estimate for one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    pub gpu_pages: usize,
    pub host_pages: usize,
    pub l3_pages: usize,
    pub queue_s: f64,
    pub compute_s: f64,
    pub load_s: f64,
}

impl Estimate {
    pub fn ttft_s(&self) -> f64 {
        self.queue_s + self.compute_s + self.load_s
    }

    /// The work this request adds to the instance's queue (what it will keep busy).
    pub fn work_s(&self) -> f64 {
        self.compute_s + self.load_s
    }

    /// What routing the request here costs: its TTFT plus `delay_weight` × its work, the delay
    /// it imposes on the requests behind it (`crate::route`'s module docs).
    pub fn cost_s(&self, delay_weight: f64) -> f64 {
        self.ttft_s() + delay_weight * self.work_s()
    }
}
