//! Simulation configuration: the scheduler's own config, the model and link profiles, L3
//! capacity, instances and fault injection. Loadable from TOML; every CLI flag overrides it.

use serde::{Deserialize, Serialize};

use kvtier_scheduler::SchedulerConfig;

use crate::profile::{LinkProfile, ModelProfile, builtin};
use crate::workload::Routing;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Faults {
    /// Every n-th prefetch (by op id) brings only half its pages (0: never).
    pub fail_prefetch_every: u64,
    /// Every n-th backup fails (0: never).
    pub fail_backup_every: u64,
    /// After every n-th backup, an L3 object disappears (0: never).
    pub lose_l3_every: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SimConfig {
    pub scheduler: SchedulerConfig,
    pub profile: ModelProfile,
    pub links: LinkProfile,
    pub instances: usize,
    pub routing: Routing,
    /// L3 DRAM capacity in pages (shared by all instances).
    pub l3_pages: u64,
    /// L3 SSD tier capacity in pages (0: no SSD tier). DRAM evictions are offloaded to it;
    /// prefetching an SSD-only object costs an SSD read before the network transfer.
    pub l3_ssd_pages: u64,
    /// Directory for the SSD tier's bucket files (default: a fresh temporary directory,
    /// removed at the end).
    pub l3_ssd_dir: Option<std::path::PathBuf>,
    /// Bytes kept per page in the simulated L3 (timing uses the model's real page size).
    pub payload_bytes: usize,
    pub faults: Faults,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            scheduler: SchedulerConfig {
                page_size: 64,
                device_pages: 2048,
                host_pages: 8192,
                max_batch_size: 256,
                token_budget: 16384,
                chunked_prefill_size: 8192,
                l3_enabled: true,
                prefetch_threshold: 4,
                max_context_tokens: 2048 * 64,
                ..SchedulerConfig::default()
            },
            profile: builtin("llama3-8b").unwrap_or_else(|| ModelProfile {
                name: "custom".into(),
                kv_bytes_per_token: 131_072,
                prefill_tokens_per_s: 60_000.0,
                forward_base_ms: 6.0,
                decode_row_us: 25.0,
                decode_ctx_us_per_ktok: 1.5,
            }),
            links: LinkProfile::default(),
            instances: 1,
            routing: Routing::RoundRobin,
            l3_pages: 131_072,
            l3_ssd_pages: 0,
            l3_ssd_dir: None,
            payload_bytes: 16,
            faults: Faults::default(),
        }
    }
}
