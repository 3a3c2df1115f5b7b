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

/// Device + host pages of all instances together, at most: each pool is allocated whole
/// (about 5 bytes per page, 1.3 GB at the cap), so `--device-pages 4294967295` was a failed
/// 17 GB allocation, an abort rather than an error. The documentation's largest sweep point
/// (4 instances of 65,536 device + 262,144 host pages) is 1.3 M pages.
pub const MAX_LOCAL_PAGES: u64 = 1 << 28;

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
        for (k, v) in user.clone() {
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
        let user = toml::Value::Table(user);
        let c: SimConfig = toml::Value::Table(merged)
            .try_into()
            .map_err(|e: toml::de::Error| e.to_string())?;
        // a key the configuration does not have would be ignored: refuse it (an optional
        // field the user sets is in the configuration read back)
        let known = toml::Value::try_from(&c).map_err(|e| e.to_string())?;
        match unknown_key(&user, &known, "") {
            Some(k) => Err(format!("unknown key {k:?} (docs/sim.md lists the keys)")),
            None => Ok(c),
        }
    }

    /// Refuses what a run cannot use, before it starts: a payload too short for the integrity
    /// oracle's page stamp (8 bytes) or past 1 MiB, capacities whose bytes or sums overflow,
    /// timings and rates that are not finite and positive (or past an hour), no instances or
    /// more than 4,096 of them, device + host pages past [`MAX_LOCAL_PAGES`], a scheduler of
    /// several tensor-parallel ranks (each instance is one rank: a multi-rank scheduler's
    /// loss reports need the ranks' agreement, which nothing simulates).
    pub fn check(&self) -> Result<(), String> {
        if !(8..=1 << 20).contains(&self.payload_bytes) {
            return Err(format!(
                "payload_bytes {} must be 8 to 1048576",
                self.payload_bytes
            ));
        }
        let pb = self.payload_bytes as u64;
        for (name, pages) in [
            ("l3_pages", self.l3_pages),
            ("l3_ssd_pages", self.l3_ssd_pages),
        ] {
            if pages.checked_mul(pb).is_none_or(|b| b > 1 << 50) {
                return Err(format!("{name} {pages} × payload_bytes {pb} is past 1 PiB"));
            }
        }
        let local = u64::from(self.scheduler.device_pages) + u64::from(self.scheduler.host_pages);
        if local
            .checked_add(self.l3_pages)
            .and_then(|n| n.checked_add(self.l3_ssd_pages))
            .is_none()
        {
            return Err("device + host + l3_pages + l3_ssd_pages overflows".into());
        }
        if self.instances == 0 || self.instances > 4096 {
            return Err(format!("instances {} must be 1 to 4096", self.instances));
        }
        let s = &self.scheduler;
        let host = if s.host_enabled { s.host_pages } else { 0 };
        let pages = (u64::from(s.device_pages) + u64::from(host)) * self.instances as u64;
        if pages > MAX_LOCAL_PAGES {
            return Err(format!(
                "device_pages {} + host_pages {host} on {} instances are {pages} pages, past \
                 the cap of {MAX_LOCAL_PAGES} (pools are allocated whole, about 5 bytes each)",
                s.device_pages, self.instances
            ));
        }
        if self.scheduler.tp_ranks != 1 {
            return Err(format!(
                "tp_ranks {}: the simulator runs each instance as a single-rank engine \
                 (tp_ranks 1; a tensor-parallel model is a profile, e.g. llama3-70b-tp8)",
                self.scheduler.tp_ranks
            ));
        }
        let p = &self.profile;
        let page = p
            .kv_bytes_per_token
            .checked_mul(self.scheduler.page_size as u64);
        if p.kv_bytes_per_token == 0 || page.is_none_or(|b| b > 1 << 40) {
            return Err(format!(
                "kv_bytes_per_token {} must be positive, a page ({} tokens) at most 1 TiB",
                p.kv_bytes_per_token, self.scheduler.page_size
            ));
        }
        const HOUR_US: f64 = 3.6e9;
        let l = &self.links;
        for (name, v, most) in [
            ("prefill_tokens_per_s", p.prefill_tokens_per_s, f64::MAX),
            ("pcie_gb_per_s", l.pcie_gb_per_s, f64::MAX),
            ("l3_gb_per_s", l.l3_gb_per_s, f64::MAX),
            ("ssd_gb_per_s", l.ssd_gb_per_s, f64::MAX),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= most) {
                return Err(format!("{name} {v} must be finite and positive"));
            }
        }
        for (name, us) in [
            ("forward_base_ms", p.forward_base_ms * 1000.0),
            ("decode_row_us", p.decode_row_us),
            ("decode_ctx_us_per_ktok", p.decode_ctx_us_per_ktok),
            ("pcie_latency_us", l.pcie_latency_us),
            ("l3_latency_us", l.l3_latency_us),
            ("l3_query_us", l.l3_query_us),
            ("ssd_latency_us", l.ssd_latency_us),
        ] {
            if !(us.is_finite() && (0.0..=HOUR_US).contains(&us)) {
                return Err(format!("{name} must be finite, 0 to an hour"));
            }
        }
        Ok(())
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

/// The first key of `user` (dotted path) that `known` lacks, tables compared key by key.
fn unknown_key(user: &toml::Value, known: &toml::Value, path: &str) -> Option<String> {
    let (toml::Value::Table(u), toml::Value::Table(k)) = (user, known) else {
        return None;
    };
    u.iter().find_map(|(key, v)| match k.get(key) {
        None => Some(format!("{path}{key}")),
        Some(kv) => unknown_key(v, kv, &format!("{path}{key}.")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values a run cannot use are refused before it starts: a payload too short for the
    /// oracle's page stamp (it panicked), capacities whose bytes overflow (the L3 silently
    /// held nothing, the Belady capacity wrapped to 63 pages), timings that are not finite
    /// and positive (a NaN or huge forward time made TTFTs *faster*: the clock wrapped), and
    /// keys that do not exist (a misspelt key was ignored).
    #[test]
    fn values_a_run_cannot_use_are_refused() {
        let bad = |toml: &str, what: &str| {
            let e = SimConfig::from_toml(toml)
                .and_then(|c| c.check().map(|_| c))
                .err()
                .unwrap_or_else(|| panic!("{toml:?} accepted"));
            assert!(e.contains(what), "{toml:?}: {e}");
        };
        bad("payload_bytes = 7\n", "payload_bytes");
        bad("payload_bytes = 1099511627776\n", "payload_bytes");
        bad("l3_pages = 1152921504606846976\n", "l3_pages");
        bad("l3_ssd_pages = 1152921504606846976\n", "l3_ssd_pages");
        bad("[profile]\nforward_base_ms = 1e300\n", "forward_base_ms");
        bad("[profile]\nforward_base_ms = -6.0\n", "forward_base_ms");
        bad("[profile]\ndecode_row_us = nan\n", "decode_row_us");
        bad(
            "[profile]\nkv_bytes_per_token = 288230376151711744\n",
            "kv_bytes_per_token",
        );
        bad("[links]\nl3_gb_per_s = -10.0\n", "l3_gb_per_s");
        bad("[links]\npcie_gb_per_s = nan\n", "pcie_gb_per_s");
        bad("instances = 0\n", "instances");
        bad("l3_page = 5\n", "l3_page");
        bad("[scheduler]\ndevice_page = 5\n", "device_page");
        bad("[schedular]\ndevice_pages = 5\n", "schedular");
        bad("[links]\nl3_gbps = 5.0\n", "l3_gbps");
        let ok = SimConfig::from_toml("payload_bytes = 8\n[links]\nl3_gb_per_s = 12.5\n").unwrap();
        ok.check().unwrap();
        SimConfig::default().check().unwrap();
    }

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
