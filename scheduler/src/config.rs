//! Scheduler configuration and its validation.
//!
//! Why validate up front: a scheduler that starts with a contradictory configuration (a
//! write-back-to-L3-on-host-eviction policy without a host tier, a zero token budget) fails
//! much later and far from the cause. `Scheduler::new` checks every combination here and
//! returns a [`ConfigError`] naming the field.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use kvtier_radix::{EvictionPolicy, KeyNamespace};

/// When to stop waiting for an L3 → host prefetch and start prefilling with what arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PrefetchStopPolicy {
    /// Stop as soon as the request could be admitted (the prefetch only gets the time the
    /// request would have waited in the queue anyway).
    BestEffort,
    /// Wait until the prefetch completes.
    WaitComplete,
    /// Wait at most `base_ms + per_1k_tokens_ms × prompt_tokens / 1000` after issuing.
    Timeout { base_ms: u64, per_1k_tokens_ms: u64 },
}

/// Which host pages are backed up to L3, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WritePolicy {
    /// Back up every finished request's pages that L3 does not have yet.
    WriteThrough,
    /// Like `WriteThrough`, but only nodes matched at least `hit_threshold` times.
    WriteThroughSelective { hit_threshold: u32 },
    /// Back up only when host evicts a page L3 does not have.
    WriteBack,
}

/// Which running request gives its device pages back when decode runs out of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RetractionPolicy {
    /// The most recently admitted request (least work lost in queue order).
    LatestArrival,
    /// The request with the fewest generated tokens (least decode work lost).
    FewestGenerated,
    /// The request holding the most device pages (frees the most at once).
    MostPages,
}

/// When pages computed on device get a host copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostAdmission {
    /// When the request that computed them finishes (the default). The tiers are inclusive:
    /// device's cached pages are on host too, so device + host hold what host alone holds.
    #[default]
    OnFinish,
    /// When device is about to evict them (demotion): every plan writes the coldest
    /// device-only leaves back to host until at least `ahead_pages` of device's free and
    /// evictable pages have a host copy, so eviction drops a copy instead of the page. Device
    /// and host then hold mostly different pages (a page loaded back keeps its host copy);
    /// under pressure faster than the write-backs, device drops uncopied leaves as before.
    OnDeviceEviction { ahead_pages: u32 },
    /// Learnt by the adaptive eviction policy (`EvictionPolicy::Adaptive`): copies at
    /// finish until its ghost hits say demotion would have kept more, then demotes with
    /// `ahead_pages`, and back (`kvtier_radix::LearntAdmission`); or chosen by the shadow
    /// selector (`EvictionPolicy::Shadow`): the admission of the option it follows.
    Adaptive { ahead_pages: u32 },
}

impl HostAdmission {
    /// Demotion's read-ahead, for the admissions that demote.
    pub fn ahead_pages(&self) -> Option<u32> {
        match *self {
            HostAdmission::OnFinish => None,
            HostAdmission::OnDeviceEviction { ahead_pages }
            | HostAdmission::Adaptive { ahead_pages } => Some(ahead_pages),
        }
    }
}

/// `"on-finish"` or `"on-device-eviction:AHEAD_PAGES"`: the spelling of the CLI and Python.
impl std::str::FromStr for HostAdmission {
    type Err = String;

    fn from_str(s: &str) -> Result<HostAdmission, String> {
        match s.split_once(':') {
            None if s == "on-finish" => Ok(HostAdmission::OnFinish),
            Some((kind, n)) => {
                let ahead_pages = n
                    .parse()
                    .map_err(|_| format!("bad page count `{n}` in host admission `{s}`"))?;
                match kind {
                    "on-device-eviction" => Ok(HostAdmission::OnDeviceEviction { ahead_pages }),
                    "adaptive" => Ok(HostAdmission::Adaptive { ahead_pages }),
                    _ => Err(unknown_admission(s)),
                }
            }
            _ => Err(unknown_admission(s)),
        }
    }
}

fn unknown_admission(s: &str) -> String {
    format!(
        "unknown host admission `{s}` (on-finish | on-device-eviction:AHEAD_PAGES | \
         adaptive:AHEAD_PAGES)"
    )
}

impl std::fmt::Display for HostAdmission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostAdmission::OnFinish => f.write_str("on-finish"),
            HostAdmission::OnDeviceEviction { ahead_pages } => {
                write!(f, "on-device-eviction:{ahead_pages}")
            }
            HostAdmission::Adaptive { ahead_pages } => write!(f, "adaptive:{ahead_pages}"),
        }
    }
}

/// Whether the prefixes waiting requests will match are evicted last (`kvtier_radix`'s
/// `protect.rs`): soft protection from submission to admission, so that under overload the
/// policy does not evict a queued request's prefix for the running requests' new pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum QueueProtection {
    /// The policy alone ranks every leaf.
    Off,
    /// Leaves holding pages of a waiting request's prompt go after every other leaf (the
    /// default: on the policy matrix it is never more than 0.004 point below the policy
    /// alone and up to 11.8 points above it; docs/sim/shadow.md, "Queue-aware protection").
    #[default]
    Waiting,
}

impl std::str::FromStr for QueueProtection {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(QueueProtection::Off),
            "waiting" => Ok(QueueProtection::Waiting),
            _ => Err(format!("unknown queue protection `{s}` (off | waiting)")),
        }
    }
}

impl std::fmt::Display for QueueProtection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            QueueProtection::Off => "off",
            QueueProtection::Waiting => "waiting",
        })
    }
}

/// How tensor-parallel ranks share L3.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum L3Sharing {
    /// Each rank stores its own shard of every page under its own keys (suffix `:{rank}`), and
    /// runs every L3 op (the default: KV heads are sharded across ranks).
    #[default]
    PerRank,
    /// Every rank holds the same KV (MLA's latent cache): all ranks use the `leader`'s keys,
    /// only the leader probes (`L3Query`) and backs up (`BackUp`), every rank prefetches its
    /// own copy. The others skip those ops and take the leader's answer through the agreement
    /// (see `RankAgreement::skip`).
    Replicated { leader: u32 },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// Tokens per KV page.
    pub page_size: usize,
    pub device_pages: u32,
    /// Host pages (ignored, and must be 0 or host disabled, when `host_enabled` is false).
    pub host_pages: u32,
    /// Most rows (prefill chunks + decode rows) in one forward batch, and most running requests.
    pub max_batch_size: usize,
    /// Most tokens computed in one forward (decode rows count one each).
    pub token_budget: usize,
    /// Most prompt tokens of one request in one prefill chunk.
    pub chunked_prefill_size: usize,
    /// Mix prefill chunks and decode rows in one batch.
    pub mixed_prefill_decode: bool,
    pub host_enabled: bool,
    pub l3_enabled: bool,
    /// Fewest L3-hit pages (beyond the local match) worth a prefetch.
    pub prefetch_threshold: u32,
    pub prefetch_stop: PrefetchStopPolicy,
    pub write_policy: WritePolicy,
    /// Keep the device copy of pages after they were written back to host.
    pub keep_device_after_write_back: bool,
    pub retraction: RetractionPolicy,
    /// Longest request (prompt + new tokens) accepted; at most `device_pages × page_size`
    /// (a request must fit on device). The default, 131,072 (a 128K-context model), fits the
    /// default 4,096 device pages of 64 tokens.
    pub max_context_tokens: usize,
    /// L3 key namespace and this scheduler's tensor-parallel rank.
    pub namespace: KeyNamespace,
    pub rank: u32,
    /// The number of tensor-parallel ranks whose schedulers plan together, this one included
    /// (1: a single-rank engine). Above 1 the scheduler is one rank of several: L3 losses
    /// must be agreed (`RankAgreement::lost` + `agree_losses`), and a direct
    /// `Scheduler::l3_lost` / `l3_lost_all` / `l3_lost_pages` is refused
    /// (`SchedulerError::LossNeedsAgreement`); the agreement refuses loss words gathered from
    /// another number of ranks. `rank` must be below it.
    #[serde(default = "one_rank")]
    pub tp_ranks: u32,
    /// Per-rank keys (default) or one replicated copy written by a leader rank (MLA).
    #[serde(default)]
    pub l3_sharing: L3Sharing,
    /// Record KV store/remove events for an external router.
    pub record_kv_events: bool,
    /// Bytes the recorded events may hold between two `drain_kv_events` (64 MiB by
    /// default: about 230K pages of 64 tokens). Past it they are discarded and the next drain
    /// answers `KvEvent::Cleared` and every copy held now, a resync for the subscriber
    /// instead of memory growing while nobody drains.
    #[serde(default = "default_kv_events_max_bytes")]
    pub kv_events_max_bytes: u64,
    /// How the device and host tiers choose what to evict.
    #[serde(default)]
    pub eviction: EvictionPolicy,
    /// Pages each tenant (each distinct `cache_salt`) may hold per tier, cached or in use, so
    /// that one tenant's burst cannot flush another's prefixes (default: no caps).
    #[serde(default)]
    pub tenant_quota: TenantQuota,
    /// When device pages get a host copy: at finish (inclusive tiers) or on demotion.
    #[serde(default)]
    pub host_admission: HostAdmission,
    /// Whether waiting requests' prefixes are evicted last.
    #[serde(default)]
    pub queue_protection: QueueProtection,
    /// Under the `shadow` policy, which 1-in-R sample its shadows replay when sampled
    /// (`ShadowConfig::sample_salt`; 0 by default).
    #[serde(default)]
    pub shadow_sample_salt: u64,
    /// Under the `shadow` policy, device + host pages up to which its shadows are full-size
    /// (exact); above, each is sampled 1 request prefix in ⌈capacity / this⌉ on shadows of
    /// that fraction of the capacity (`ShadowConfig::full_size_pages`; 65,536 by default).
    /// The shadows' memory is at most 4 × this many pages of tree metadata.
    #[serde(default = "default_shadow_full_size_pages")]
    pub shadow_full_size_pages: u64,
}

fn default_kv_events_max_bytes() -> u64 {
    64 << 20
}

fn default_shadow_full_size_pages() -> u64 {
    kvtier_radix::ShadowConfig::default().full_size_pages
}

/// Per-tenant caps on pages per tier (a tenant is a request's `cache_salt`; unsalted requests
/// share the uncapped common space). A cap bounds the tenant's cached pages plus the pages
/// held for its requests (running requests, prefetches, copies); at its cap a tenant's
/// allocations evict its own leaves, and nobody's allocation evicts a tenant within its cap.
/// See `docs/scheduler.md` (Isolation) for the full rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TenantQuota {
    pub device_pages: Option<u32>,
    pub host_pages: Option<u32>,
}

fn one_rank() -> u32 {
    1
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            page_size: 64,
            device_pages: 4096,
            host_pages: 8192,
            max_batch_size: 256,
            token_budget: 8192,
            chunked_prefill_size: 8192,
            mixed_prefill_decode: true,
            host_enabled: true,
            l3_enabled: false,
            prefetch_threshold: 4,
            prefetch_stop: PrefetchStopPolicy::Timeout {
                base_ms: 50,
                per_1k_tokens_ms: 10,
            },
            write_policy: WritePolicy::WriteThrough,
            keep_device_after_write_back: true,
            retraction: RetractionPolicy::LatestArrival,
            max_context_tokens: 128 * 1024,
            namespace: KeyNamespace::default(),
            rank: 0,
            tp_ranks: 1,
            l3_sharing: L3Sharing::PerRank,
            record_kv_events: false,
            kv_events_max_bytes: default_kv_events_max_bytes(),
            eviction: EvictionPolicy::Lru,
            tenant_quota: TenantQuota::default(),
            host_admission: HostAdmission::OnFinish,
            queue_protection: QueueProtection::Waiting,
            shadow_sample_salt: 0,
            shadow_full_size_pages: default_shadow_full_size_pages(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ConfigError {
    #[error("{field} must be positive")]
    Zero { field: &'static str },
    #[error("token_budget ({budget}) must be at least page_size ({page_size})")]
    BudgetBelowPage { budget: usize, page_size: usize },
    #[error("write policy WriteBack backs up on host eviction and needs the host tier")]
    WriteBackWithoutHost,
    #[error("host_pages must be 0 when the host tier is disabled")]
    HostPagesWithoutHost,
    #[error("host tier enabled with 0 host pages")]
    HostWithoutPages,
    #[error("prefetch timeout must allow some time (base_ms or per_1k_tokens_ms > 0)")]
    ZeroTimeout,
    #[error("write_through_selective needs hit_threshold ≥ 1")]
    ZeroHitThreshold,
    #[error("max_context_tokens ({0}) exceeds the device capacity in tokens")]
    ContextExceedsDevice(usize),
    #[error("host_admission {0} writes device pages to host and needs the host tier")]
    DemotionWithoutHost(HostAdmission),
    #[error("host_admission {0}: ahead_pages must be 1 ..= device_pages ({1})")]
    DemotionAhead(HostAdmission, u32),
    /// Write-back promises that every page leaves the instance through host (and host backs
    /// it up to L3 before dropping it); with demotion, device drops the leaves it could not
    /// demote in time, which would then never reach L3.
    #[error("host_admission {0} demotes and cannot be combined with write_policy WriteBack")]
    DemotionWithWriteBack(HostAdmission),
    /// The learnt admission follows the adaptive eviction policy's level or the shadow
    /// selector's choice.
    #[error("host_admission Adaptive needs eviction Adaptive or Shadow")]
    AdaptiveAdmissionWithoutAdaptiveEviction,
    #[error("page_size {0} too large (max 65536)")]
    PageTooLarge(usize),
    /// A rank outside its group: a scheduler of rank 1 or above is one rank of several, and
    /// must know how many (`tp_ranks`), so that it refuses unagreed loss reports.
    #[error(
        "rank {rank} is not below tp_ranks {tp_ranks} (set tp_ranks to the tensor-parallel group's size)"
    )]
    RankOutOfRange { rank: u32, tp_ranks: u32 },
    #[error("l3_sharing Replicated leader {leader} is not below tp_ranks {tp_ranks}")]
    LeaderOutOfRange { leader: u32, tp_ranks: u32 },
    /// The shadow selector refused its configuration (`eviction` Shadow).
    #[error("shadow selector: {0}")]
    Shadow(#[from] kvtier_radix::ShadowConfigError),
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, v) in [
            ("page_size", self.page_size),
            ("device_pages", self.device_pages as usize),
            ("max_batch_size", self.max_batch_size),
            ("token_budget", self.token_budget),
            ("chunked_prefill_size", self.chunked_prefill_size),
            ("max_context_tokens", self.max_context_tokens),
            ("tp_ranks", self.tp_ranks as usize),
            (
                "kv_events_max_bytes",
                usize::try_from(self.kv_events_max_bytes).unwrap_or(usize::MAX),
            ),
            (
                "shadow_full_size_pages",
                usize::try_from(self.shadow_full_size_pages).unwrap_or(usize::MAX),
            ),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if self.rank >= self.tp_ranks {
            return Err(ConfigError::RankOutOfRange {
                rank: self.rank,
                tp_ranks: self.tp_ranks,
            });
        }
        if let L3Sharing::Replicated { leader } = self.l3_sharing
            && leader >= self.tp_ranks
        {
            return Err(ConfigError::LeaderOutOfRange {
                leader,
                tp_ranks: self.tp_ranks,
            });
        }
        if self.page_size > 65536 {
            return Err(ConfigError::PageTooLarge(self.page_size));
        }
        if self.token_budget < self.page_size {
            return Err(ConfigError::BudgetBelowPage {
                budget: self.token_budget,
                page_size: self.page_size,
            });
        }
        if let Some(ahead_pages) = self.host_admission.ahead_pages() {
            if matches!(self.host_admission, HostAdmission::Adaptive { .. })
                && !matches!(
                    self.eviction,
                    EvictionPolicy::Adaptive | EvictionPolicy::Shadow
                )
            {
                return Err(ConfigError::AdaptiveAdmissionWithoutAdaptiveEviction);
            }
            if !self.host_enabled {
                return Err(ConfigError::DemotionWithoutHost(self.host_admission));
            }
            if ahead_pages == 0 || ahead_pages > self.device_pages {
                return Err(ConfigError::DemotionAhead(
                    self.host_admission,
                    self.device_pages,
                ));
            }
            if self.write_policy == WritePolicy::WriteBack {
                return Err(ConfigError::DemotionWithWriteBack(self.host_admission));
            }
        }
        if !self.host_enabled {
            if self.write_policy == WritePolicy::WriteBack {
                return Err(ConfigError::WriteBackWithoutHost);
            }
            if self.host_pages > 0 {
                return Err(ConfigError::HostPagesWithoutHost);
            }
        } else if self.host_pages == 0 {
            return Err(ConfigError::HostWithoutPages);
        }
        if let PrefetchStopPolicy::Timeout {
            base_ms: 0,
            per_1k_tokens_ms: 0,
        } = self.prefetch_stop
        {
            return Err(ConfigError::ZeroTimeout);
        }
        if let WritePolicy::WriteThroughSelective { hit_threshold: 0 } = self.write_policy {
            return Err(ConfigError::ZeroHitThreshold);
        }
        if self.max_context_tokens > self.device_pages as usize * self.page_size {
            return Err(ConfigError::ContextExceedsDevice(self.max_context_tokens));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new user's first line, `Scheduler::new(SchedulerConfig::default())`, must work.
    #[test]
    fn default_config_is_valid() {
        assert_eq!(SchedulerConfig::default().validate(), Ok(()));
        let l3 = SchedulerConfig {
            l3_enabled: true,
            ..SchedulerConfig::default()
        };
        assert_eq!(l3.validate(), Ok(()));
    }
}
