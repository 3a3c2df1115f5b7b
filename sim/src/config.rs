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
    /// With an SSD tier: `L3Query` probes ask the store to promote SSD-only hits to DRAM
    /// (`prefetch_to_memory`), so the prefetch that follows reads DRAM (default: on).
    pub l3_promote_on_probe: bool,
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
                // Clamped to the device capacity by `effective_scheduler`.
                max_context_tokens: 1 << 30,
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
            l3_promote_on_probe: true,
            l3_ssd_dir: None,
            payload_bytes: 16,
            faults: Faults::default(),
        }
    }
}

impl SimConfig {
    /// Reads a TOML config: every table present is laid over the defaults field by field, so
    /// a `[scheduler]` table that names only `device_pages` keeps every other scheduler
    /// default (a field's own value, e.g. an enum, is replaced whole).
    pub fn from_toml(text: &str) -> Result<SimConfig, String> {
        let user: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut merged = toml::Table::try_from(SimConfig::default()).map_err(|e| e.to_string())?;
        for (k, v) in user {
            match (merged.get_mut(&k), v) {
                (Some(toml::Value::Table(base)), toml::Value::Table(over)) => {
                    for (field, value) in over {
                        base.insert(field, value);
                    }
                }
                (_, v) => {
                    merged.insert(k, v);
                }
            }
        }
        toml::Value::Table(merged)
            .try_into()
            .map_err(|e: toml::de::Error| e.to_string())
    }

    /// The scheduler configuration a simulation runs with: the longest request accepted is
    /// at most what the device tier can hold (`device_pages × page_size`), so by default it
    /// *is* the device capacity, and a trace's long prompts run instead of being rejected by
    /// a fixed limit.
    pub fn effective_scheduler(&self) -> SchedulerConfig {
        let mut s = self.scheduler.clone();
        s.max_context_tokens = s
            .max_context_tokens
            .min((s.device_pages as usize).saturating_mul(s.page_size))
            .max(1);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_merge_over_the_defaults() {
        let c = SimConfig::from_toml(
            "[scheduler]\ndevice_pages = 100\n[faults]\nfail_backup_every = 3\n",
        )
        .unwrap();
        let d = SimConfig::default();
        assert_eq!(c.scheduler.device_pages, 100);
        assert_eq!(c.scheduler.host_pages, d.scheduler.host_pages);
        assert_eq!(c.scheduler.prefetch_stop, d.scheduler.prefetch_stop);
        assert_eq!(c.faults.fail_backup_every, 3);
        assert_eq!(c.profile, d.profile);
        let e = SimConfig::from_toml("[scheduler]\npage_size = -1\n").unwrap_err();
        assert!(e.contains("page_size"), "{e}");
        assert!(SimConfig::from_toml("[scheduler\n").is_err());
    }

    #[test]
    fn the_context_limit_defaults_to_the_device_capacity() {
        let mut c = SimConfig::default();
        c.scheduler.device_pages = 4096;
        assert_eq!(c.effective_scheduler().max_context_tokens, 4096 * 64);
        c.scheduler.max_context_tokens = 1000;
        assert_eq!(c.effective_scheduler().max_context_tokens, 1000);
    }
}
