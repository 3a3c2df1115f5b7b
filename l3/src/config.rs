//! Configuration of the store, with Mooncake's defaults where Mooncake has one.
//!
//! Why: the scheduler, the simulator, the tests and the binary all build stores; one
//! `StoreConfig` with documented defaults keeps them consistent, and `validate` turns bad
//! values into a typed error before any state exists.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{L3Error, L3Result};
use crate::types::validate_key;

/// SSD offload policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OffloadMode {
    /// Every ended put is written to SSD asynchronously (Mooncake's default, seed 002).
    WriteThrough,
    /// Objects are written to SSD only when DRAM eviction drops their memory replica.
    OnEvict,
}

/// SSD tier settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SsdConfig {
    /// Directory holding bucket files (created if missing).
    pub dir: PathBuf,
    /// Offload policy.
    pub mode: OffloadMode,
    /// Most keys per bucket file (Mooncake `MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT`).
    pub bucket_keys_limit: usize,
    /// Most payload bytes per bucket file.
    pub bucket_bytes_limit: u64,
    /// SSD capacity the tier may use.
    pub capacity_bytes: u64,
    /// Start evicting buckets above this fraction of `capacity_bytes`.
    pub high_watermark: f64,
    /// Evict down to this fraction.
    pub low_watermark: f64,
    /// Bounded offload queue length (objects); a full queue skips the offload (-1301).
    pub queue_len: usize,
    /// How the tier learns the free space of its directory's filesystem (`statvfs` unless
    /// a test gives a function): the tier never counts on more than its own use plus that.
    #[serde(skip)]
    pub free_space: FreeSpace,
}

/// Free bytes of the filesystem holding a directory: `statvfs`'s `f_bavail × f_frsize`,
/// or a given function (tests simulate a small filesystem with it).
#[derive(Clone, Default)]
pub struct FreeSpace(Option<Arc<FreeSpaceFn>>);

/// A function giving the free bytes of the filesystem holding a directory.
pub type FreeSpaceFn = dyn Fn(&Path) -> std::io::Result<u64> + Send + Sync;

impl std::fmt::Debug for FreeSpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "FreeSpace(given)"
        } else {
            "FreeSpace(statvfs)"
        })
    }
}

impl FreeSpace {
    /// Free space as `f` says.
    pub fn given(f: impl Fn(&Path) -> std::io::Result<u64> + Send + Sync + 'static) -> Self {
        FreeSpace(Some(Arc::new(f)))
    }

    /// Free bytes for an unprivileged writer of the filesystem holding `dir`.
    pub fn of(&self, dir: &Path) -> std::io::Result<u64> {
        if let Some(f) = &self.0 {
            return f(dir);
        }
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        // SAFETY: statvfs reads the NUL-terminated path and writes only the struct given.
        let mut v: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(c.as_ptr(), &mut v) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((v.f_bavail as u64).saturating_mul(v.f_frsize as u64))
    }
}

impl SsdConfig {
    /// Defaults for a directory: write-through, 256 keys / 64 MiB per bucket, 64 GiB, 0.90/0.80.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        SsdConfig {
            dir: dir.into(),
            mode: OffloadMode::WriteThrough,
            bucket_keys_limit: 256,
            bucket_bytes_limit: 64 << 20,
            capacity_bytes: 64 << 30,
            high_watermark: 0.90,
            low_watermark: 0.80,
            queue_len: 4096,
            free_space: FreeSpace::default(),
        }
    }
}

/// Promotion (prefetch-on-exist, seed 000) settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PromotionConfig {
    /// Worker threads promoting SSD objects into DRAM (bounded pool).
    pub workers: usize,
    /// Bounded queue of pending promotions; beyond it a trigger is dropped.
    pub queue_len: usize,
    /// De-duplication TTL of *finished* promotions (an in-flight one never expires).
    pub dedup_ttl: Duration,
    /// After DRAM pressure is seen, no promotion starts for this long.
    pub pressure_cooldown: Duration,
    /// A `get` that finds a promotion in flight waits this long for it (`ssd_get_wait_ms`).
    pub ssd_get_wait: Duration,
    /// Promote an SSD-only object when reads hit it (Mooncake's master flag
    /// `--promotion_on_hit`, off by default as there); see [`crate::promotion::on_hit`].
    #[serde(default)]
    pub on_hit: bool,
    /// Reads of an SSD-only object before a promotion on hit fires (Mooncake's
    /// `--promotion_admission_threshold`, default 2; clamped to 1 ..= 255 as there).
    #[serde(default = "default_admission_threshold")]
    pub admission_threshold: u32,
}

fn default_admission_threshold() -> u32 {
    2
}

impl Default for PromotionConfig {
    fn default() -> Self {
        PromotionConfig {
            workers: 4,
            queue_len: 1024,
            dedup_ttl: Duration::from_secs(5),
            pressure_cooldown: Duration::from_millis(500),
            ssd_get_wait: Duration::from_millis(10),
            on_hit: false,
            admission_threshold: default_admission_threshold(),
        }
    }
}

/// Store-wide settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoreConfig {
    /// Capacity of the store's own memory segment (0 = mount none; segments come via MountSegment).
    pub local_segment_bytes: u64,
    /// Read lease length (Mooncake `default_kv_lease_ttl`; issue default 10 s).
    pub lease_ttl: Duration,
    /// Soft pin TTL (Mooncake default 30 min).
    pub soft_pin_ttl: Duration,
    /// Evict when DRAM use passes this fraction.
    pub high_watermark: f64,
    /// Fraction of DRAM capacity freed per eviction pass.
    pub eviction_ratio: f64,
    /// A put not ended within this time is revoked (Mooncake `put_start_discard_timeout`).
    pub put_timeout: Duration,
    /// A client not pinging for this long is declared dead (Mooncake `client_live_ttl`).
    pub client_ttl: Duration,
    /// Largest object accepted.
    pub max_object_bytes: u64,
    /// Most keys in one batch call.
    pub max_batch_keys: usize,
    /// SSD tier (None = DRAM only).
    pub ssd: Option<SsdConfig>,
    /// Promotion settings (used only with an SSD tier).
    pub promotion: PromotionConfig,
    /// Keep a journal of up to this many keys that stopped existing (evicted, removed, lost
    /// with a node) for [`crate::L3Store::losses_since`]; 0 = no journal. An engine that
    /// marks pages as "in L3" reads it and reports the losses to its scheduler.
    pub loss_journal_keys: usize,
    /// Recycled object buffers ([`crate::buffers`]) kept once the store is idle; the rest
    /// are freed, and the allocator is asked to return free pages to the system.
    #[serde(default = "default_recycle_idle_bytes")]
    pub recycle_idle_bytes: u64,
    /// The store is idle after this long without an operation (checked by the sweeper,
    /// at most once a second).
    #[serde(default = "default_idle_trim_after")]
    pub idle_trim_after: Duration,
    /// Split deployment with a state dir: after a restart the master serves clients only
    /// once every store node it knew has mounted again, or this long has passed (the late
    /// ones are then fenced: their old SSD records are dropped when they mount).
    #[serde(default = "default_rebuild_timeout")]
    pub rebuild_timeout: Duration,
    /// Most DRAM bytes (memory replicas, pending puts included) each named tenant may hold;
    /// tenants not named have no cap. A put past its tenant's cap evicts that tenant's own
    /// objects first (least recently used, never leased ones), and fails with -200 when
    /// they cannot make room: one tenant cannot take another's cache.
    #[serde(default)]
    pub tenant_quota_bytes: std::collections::BTreeMap<String, u64>,
    /// Most capacity, in all, that clients may mount as segments whose bytes this store
    /// holds (a Mooncake client's `global_segment_size` on a `kvtier-l3` server: the server,
    /// not the client, holds the bytes put there). A mount past it is refused with -200,
    /// so clients cannot grow the server's memory without bound. `None`: no cap (the
    /// library default; the `kvtier-l3` server caps it at the host's memory).
    #[serde(default)]
    pub client_segments_max_bytes: Option<u64>,
    /// Publish the store's residency as KV cache events (medium `STORAGE`, vLLM's wire
    /// format) for KV-aware routers ([`crate::kv_events`]), one stream per entry (a store
    /// shared by several models: a stream per model's namespace,
    /// [`crate::KvEventsConfig::for_namespace`], each with its own sequence numbers,
    /// replay socket and topic); empty: no events. Only a process that holds the master
    /// publishes (embedded, `--role both`, `--role master`; with etcd HA the leader).
    #[serde(default)]
    pub kv_events: Vec<crate::kv_events::KvEventsConfig>,
}

/// The host's physical memory (`MemTotal` of `/proc/meminfo`), the default cap on what
/// clients may mount into a server (`StoreConfig::client_segments_max_bytes`); `None` where
/// it cannot be read.
pub fn host_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    kb.checked_mul(1024)
}

fn default_rebuild_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_recycle_idle_bytes() -> u64 {
    64 << 20
}

fn default_idle_trim_after() -> Duration {
    Duration::from_secs(5)
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            local_segment_bytes: 1 << 30,
            lease_ttl: Duration::from_secs(10),
            soft_pin_ttl: Duration::from_secs(30 * 60),
            high_watermark: 0.90,
            eviction_ratio: 0.05,
            put_timeout: Duration::from_secs(30),
            client_ttl: Duration::from_secs(10),
            max_object_bytes: 1 << 30,
            max_batch_keys: 65_536,
            ssd: None,
            promotion: PromotionConfig::default(),
            loss_journal_keys: 0,
            recycle_idle_bytes: default_recycle_idle_bytes(),
            rebuild_timeout: default_rebuild_timeout(),
            tenant_quota_bytes: Default::default(),
            idle_trim_after: default_idle_trim_after(),
            client_segments_max_bytes: None,
            kv_events: Vec::new(),
        }
    }
}

impl StoreConfig {
    /// Rejects nonsensical values with `InvalidParams`.
    pub fn validate(&self) -> L3Result<()> {
        let bad = |m: &str| Err(L3Error::InvalidParams(m.to_string()));
        if !(self.high_watermark > 0.0 && self.high_watermark <= 1.0) {
            return bad("high_watermark must be in (0, 1]");
        }
        if !(self.eviction_ratio > 0.0 && self.eviction_ratio <= 1.0) {
            return bad("eviction_ratio must be in (0, 1]");
        }
        if self.max_batch_keys == 0 || self.max_object_bytes == 0 {
            return bad("limits must be positive");
        }
        if self.lease_ttl.is_zero() {
            // A lease expiring as it is granted refuses every query-then-get (-707).
            return bad(
                "lease_ttl must be positive (a zero read lease refuses every query-then-get)",
            );
        }
        if let Some(s) = &self.ssd {
            if !(s.low_watermark > 0.0
                && s.low_watermark < s.high_watermark
                && s.high_watermark <= 1.0)
            {
                return bad("ssd watermarks must satisfy 0 < low < high <= 1");
            }
            if s.bucket_keys_limit == 0 || s.bucket_bytes_limit == 0 || s.queue_len == 0 {
                return bad("ssd bucket limits and queue length must be positive");
            }
        }
        if self.promotion.workers == 0 || self.promotion.queue_len == 0 {
            return bad("promotion workers and queue length must be positive");
        }
        for name in self.tenant_quota_bytes.keys() {
            crate::types::Tenant::new(name.as_str())?;
        }
        crate::kv_events::validate_streams(&self.kv_events)?;
        Ok(())
    }

    /// `InvalidParams` for a batch of more than `max_batch_keys` keys.
    pub(crate) fn check_batch(&self, n: usize) -> L3Result<()> {
        check_batch_keys(n, self.max_batch_keys)
    }

    /// `InvalidParams` for a bad key or an object larger than `max_object_bytes`.
    pub(crate) fn check_put(&self, key: &str, size: u64) -> L3Result<()> {
        validate_key(key)?;
        check_object_bytes(size, self.max_object_bytes)
    }
}

/// `InvalidParams` for a batch of more than `limit` keys.
pub(crate) fn check_batch_keys(n: usize, limit: usize) -> L3Result<()> {
    if n > limit {
        return Err(L3Error::InvalidParams(format!(
            "{n} keys in one batch; limit is {limit}"
        )));
    }
    Ok(())
}

/// `InvalidParams` for an object of more than `limit` bytes.
pub(crate) fn check_object_bytes(size: u64, limit: u64) -> L3Result<()> {
    if size > limit {
        return Err(L3Error::InvalidParams(format!(
            "object of {size} bytes exceeds the {limit}-byte limit"
        )));
    }
    Ok(())
}
