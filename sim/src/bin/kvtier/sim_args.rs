//! `kvtier sim`'s flags and how they make a [`SimConfig`]: every flag checked, and a flag the
//! configured run would not use refused, before anything runs.

use std::path::PathBuf;

use clap::Parser;

use kvtier_radix::EvictionPolicy;
use kvtier_scheduler::{PrefetchStopPolicy, WritePolicy};
use kvtier_sim::SimConfig;
use kvtier_sim::profile::{BUILTIN_PROFILES, builtin};
use kvtier_sim::workload::Routing;

#[derive(Parser, Debug)]
pub(crate) struct SimArgs {
    /// Mooncake trace (JSON lines); without it a built-in multi-turn chat workload runs.
    #[arg(long)]
    pub(crate) trace: Option<PathBuf>,
    /// Use only the first N requests of the trace.
    #[arg(long, requires = "trace")]
    pub(crate) limit: Option<usize>,
    /// TOML file with a SimConfig (flags override it).
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Model profile: llama3-8b, llama3-70b-tp8, qwen2.5-7b.
    #[arg(long)]
    pub(crate) profile: Option<String>,
    #[arg(long)]
    pub(crate) page_size: Option<usize>,
    #[arg(long)]
    pub(crate) device_pages: Option<u32>,
    #[arg(long)]
    pub(crate) host_pages: Option<u32>,
    /// Disable the host tier.
    #[arg(long)]
    pub(crate) no_host: bool,
    /// L3 capacity in pages (shared by all instances).
    #[arg(long)]
    pub(crate) l3_pages: Option<u64>,
    /// Disable L3.
    #[arg(long)]
    pub(crate) no_l3: bool,
    /// L3 SSD tier capacity in pages (DRAM evictions go there; 0: none).
    #[arg(long)]
    pub(crate) l3_ssd_pages: Option<u64>,
    /// Override the profile: KV bytes per token, prefill tokens/s.
    #[arg(long)]
    pub(crate) kv_bytes_per_token: Option<u64>,
    #[arg(long)]
    pub(crate) prefill_tokens_per_s: Option<f64>,
    /// Link bandwidths (GB/s): PCIe, L3 network, L3 SSD.
    #[arg(long)]
    pub(crate) pcie_gbps: Option<f64>,
    #[arg(long)]
    pub(crate) l3_gbps: Option<f64>,
    #[arg(long)]
    pub(crate) ssd_gbps: Option<f64>,
    /// Whether an instance's L3 reads and backups share its network link (`shared`: one
    /// queue) or each use one direction of it (`duplex`).
    #[arg(long, value_enum)]
    pub(crate) l3_link: Option<kvtier_sim::profile::L3Link>,
    /// Engine instances sharing one L3.
    #[arg(long)]
    pub(crate) instances: Option<usize>,
    /// Which instance serves each request (`--routing` is an alias).
    #[arg(long, value_enum, alias = "routing")]
    pub(crate) router: Option<Routing>,
    /// write-through | selective:HITS | write-back
    #[arg(long)]
    pub(crate) write_policy: Option<String>,
    /// best-effort | wait-complete | timeout:BASE_MS:PER_1K_MS
    #[arg(long)]
    pub(crate) prefetch_stop: Option<String>,
    #[arg(long)]
    pub(crate) prefetch_threshold: Option<u32>,
    /// Eviction policy: lru | freq-depth (the setting tuned on the conversation trace) |
    /// freq-depth:CREDIT_PAGES:MAX_USES:DEBIT_PER_PAGE
    #[arg(long)]
    pub(crate) eviction: Option<String>,
    /// When device pages get a host copy: on-finish (default, inclusive tiers) |
    /// on-device-eviction:AHEAD_PAGES (demotion: mostly exclusive tiers)
    #[arg(long)]
    pub(crate) host_admission: Option<String>,
    /// Whether waiting requests' prefixes are evicted last: waiting (default) | off.
    #[arg(long)]
    pub(crate) queue_protection: Option<String>,
    /// Under --eviction shadow at capacities where its shadows are sampled: which 1-in-R
    /// sample (0 by default; the selector's figures there move with it).
    #[arg(long)]
    pub(crate) shadow_sample_salt: Option<u64>,
    /// Under --eviction shadow: device + host pages up to which its shadows are exact; above,
    /// sampled 1 prefix in ceil(capacity / N) (default 65536; memory stays within 4 × N pages).
    #[arg(long)]
    pub(crate) shadow_full_size_pages: Option<u64>,
    /// Do not also run the other online policies (LRU, freq-depth) at the same capacity.
    #[arg(long)]
    pub(crate) no_compare: bool,
    /// Chat workload (without --trace): clients and rounds.
    #[arg(long, conflicts_with = "trace")]
    pub(crate) clients: Option<u32>,
    #[arg(long, conflicts_with = "trace")]
    pub(crate) rounds: Option<u32>,
    /// Sweep the local cache capacity (×1/8 … ×4) and plot the hit rate (all tiers) beside
    /// Belady's ceiling for the local tiers (device + host only: with L3 on, the hit rate also
    /// counts L3 hits the ceiling leaves out).
    #[arg(long)]
    pub(crate) sweep: bool,
    /// Where the sweep writes sweep.json, sweep.svg and sweep.png (a directory, made if
    /// missing; checked before the sweep runs).
    #[arg(long, default_value = "sweep", requires = "sweep")]
    pub(crate) sweep_out: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// No progress bar.
    #[arg(long)]
    pub(crate) quiet: bool,
    /// Check the flags, the configuration and the whole workload, say what would run, and
    /// run nothing (the documentation's commands are tested this way).
    #[arg(long)]
    pub(crate) dry_run: bool,
}

pub(crate) fn config(a: &SimArgs) -> Result<SimConfig, String> {
    let mut c = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
            SimConfig::from_toml(&text).map_err(|e| format!("{}: {e}", p.display()))?
        }
        None => SimConfig::default(),
    };
    if let Some(p) = &a.profile {
        c.profile = builtin(p).ok_or_else(|| {
            format!(
                "unknown profile `{p}` (known: {})",
                BUILTIN_PROFILES.join(", ")
            )
        })?;
    }
    if let Some(v) = a.kv_bytes_per_token {
        c.profile.kv_bytes_per_token = v;
    }
    if let Some(v) = a.prefill_tokens_per_s {
        c.profile.prefill_tokens_per_s = v;
    }
    if let Some(v) = a.l3_ssd_pages {
        c.l3_ssd_pages = v;
    }
    if let Some(v) = a.l3_link {
        c.links.l3_link = v;
    }
    for (v, dst) in [
        (a.pcie_gbps, &mut c.links.pcie_gb_per_s),
        (a.l3_gbps, &mut c.links.l3_gb_per_s),
        (a.ssd_gbps, &mut c.links.ssd_gb_per_s),
    ] {
        if let Some(v) = v {
            if !(v > 0.0 && v.is_finite()) {
                return Err(format!("bandwidth must be positive, got {v}"));
            }
            *dst = v;
        }
    }
    let rate_ok =
        c.profile.prefill_tokens_per_s.is_finite() && c.profile.prefill_tokens_per_s > 0.0;
    if !rate_ok || c.profile.kv_bytes_per_token == 0 {
        return Err("profile: prefill_tokens_per_s and kv_bytes_per_token must be positive".into());
    }
    let s = &mut c.scheduler;
    if let Some(v) = a.page_size {
        s.page_size = v;
    }
    if let Some(v) = a.device_pages {
        s.device_pages = v;
    }
    if let Some(v) = a.host_pages {
        s.host_pages = v;
    }
    if a.no_host {
        s.host_enabled = false;
        s.host_pages = 0;
    }
    if a.no_l3 {
        s.l3_enabled = false;
    }
    if let Some(v) = a.prefetch_threshold {
        s.prefetch_threshold = v;
    }
    if let Some(w) = &a.write_policy {
        s.write_policy = match w.split_once(':') {
            None if w == "write-through" => WritePolicy::WriteThrough,
            None if w == "write-back" => WritePolicy::WriteBack,
            Some(("selective", n)) => WritePolicy::WriteThroughSelective {
                hit_threshold: n.parse().map_err(|_| format!("bad hit threshold `{n}`"))?,
            },
            _ => return Err(format!("unknown write policy `{w}`")),
        };
    }
    if let Some(e) = &a.eviction {
        s.eviction = parse_eviction(e)?;
    }
    if let Some(h) = &a.host_admission {
        s.host_admission = h.parse()?;
    }
    if let Some(q) = &a.queue_protection {
        s.queue_protection = q.parse()?;
    }
    if let Some(salt) = a.shadow_sample_salt {
        s.shadow_sample_salt = salt;
    }
    if let Some(n) = a.shadow_full_size_pages {
        s.shadow_full_size_pages = n;
    }
    if let Some(p) = &a.prefetch_stop {
        let parts: Vec<&str> = p.split(':').collect();
        s.prefetch_stop = match parts.as_slice() {
            ["best-effort"] => PrefetchStopPolicy::BestEffort,
            ["wait-complete"] => PrefetchStopPolicy::WaitComplete,
            ["timeout", b, k] => PrefetchStopPolicy::Timeout {
                base_ms: b.parse().map_err(|_| format!("bad timeout `{b}`"))?,
                per_1k_tokens_ms: k.parse().map_err(|_| format!("bad timeout `{k}`"))?,
            },
            _ => return Err(format!("unknown prefetch stop policy `{p}`")),
        };
    }
    if let Some(v) = a.l3_pages {
        c.l3_pages = v;
    }
    if let Some(v) = a.instances {
        if v == 0 {
            return Err("--instances 0: at least 1 engine instance".into());
        }
        c.instances = v;
    }
    if let Some(r) = a.router {
        c.routing = r;
    }
    refuse_ignored_flags(a, &c)?;
    c.effective_scheduler()
        .validate()
        .map_err(|e| format!("configuration: {e}"))?;
    c.check().map_err(|e| format!("configuration: {e}"))?;
    Ok(c)
}

/// Flags the configured run would not use are refused, naming the flag: ignored, they gave
/// a report byte for byte the same as without them (as the other workload's flags did).
fn refuse_ignored_flags(a: &SimArgs, c: &SimConfig) -> Result<(), String> {
    let s = &c.scheduler;
    if !s.l3_enabled {
        let l3_flags = [
            ("--l3-pages", a.l3_pages.is_some()),
            ("--l3-ssd-pages", a.l3_ssd_pages.is_some()),
            ("--l3-gbps", a.l3_gbps.is_some()),
            ("--ssd-gbps", a.ssd_gbps.is_some()),
            ("--l3-link", a.l3_link.is_some()),
            ("--write-policy", a.write_policy.is_some()),
            ("--prefetch-stop", a.prefetch_stop.is_some()),
            ("--prefetch-threshold", a.prefetch_threshold.is_some()),
        ];
        let given: Vec<&str> = l3_flags
            .iter()
            .filter(|(_, given)| *given)
            .map(|(flag, _)| *flag)
            .collect();
        if !given.is_empty() {
            return Err(format!(
                "{} configure{} L3, which is off (--no-l3, or l3_enabled = false in \
                 --config): ignored, the run would be the same without",
                given.join(", "),
                if given.len() == 1 { "s" } else { "" }
            ));
        }
    }
    if a.ssd_gbps.is_some() && c.l3_ssd_pages == 0 {
        return Err(
            "--ssd-gbps is the L3 SSD tier's bandwidth, and there is no SSD tier \
             (--l3-ssd-pages N or l3_ssd_pages in --config): ignored, the run would be the \
             same without"
                .into(),
        );
    }
    if s.eviction != EvictionPolicy::Shadow {
        for (flag, given) in [
            (
                "--shadow-full-size-pages",
                a.shadow_full_size_pages.is_some(),
            ),
            ("--shadow-sample-salt", a.shadow_sample_salt.is_some()),
        ] {
            if given {
                return Err(format!(
                    "{flag} configures the shadow selector, which runs only under \
                     --eviction shadow (the eviction is {}): ignored, the run would be the \
                     same without",
                    s.eviction
                ));
            }
        }
    }
    Ok(())
}

fn parse_eviction(e: &str) -> Result<EvictionPolicy, String> {
    e.parse()
}
