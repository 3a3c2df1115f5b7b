//! What a request costs the instance beyond its prefill: the device memory it holds while it
//! decodes.
//!
//! Why: an instance's queue does not drain at its prefill rate. Each running request holds
//! its KV (prompt + output tokens) on the device for as many decode steps as it has output
//! tokens, and an instance whose device memory is full admits the next request only when one
//! ends. In the simulator, at its default sizes, that bound halves what four instances
//! sustain compared with their prefill rate, and a router whose queues drained at the prefill
//! rate saw busy instances as idle and stacked requests on the instance holding their prefix.
//!
//! So a routed request adds to its instance's queue the larger of its prefill work (compute
//! and loads, [`crate::CostModel`]) and its share of the device's memory-time:
//! `(prompt + output tokens) × output tokens × decode_step_s / device_tokens`. The two overlap
//! (decode rows ride in the same forward passes as prefill chunks), hence the maximum, not
//! the sum. A cache hit shortens the prefill, never the memory held: the reason a hot prefix
//! must spread once its instance is full.

/// One instance class's device memory and decode speed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Occupancy {
    /// Tokens of KV the device holds for running requests.
    pub device_tokens: f64,
    /// Seconds of one decode step (a forward pass with decode rows only).
    pub decode_step_s: f64,
}

impl Occupancy {
    /// Seconds of the device's memory a request of `tokens` prompt and `output` output tokens
    /// holds, as a share of the whole device.
    pub fn memory_s(&self, tokens: usize, output: usize) -> f64 {
        if self.device_tokens <= 0.0 {
            return 0.0;
        }
        tokens.saturating_add(output) as f64 * output as f64 * self.decode_step_s
            / self.device_tokens
    }
}
