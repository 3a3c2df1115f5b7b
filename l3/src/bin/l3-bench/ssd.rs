//! Scenario `ssd`: cold SSD `batch_get_into` of 256 × 1 MiB from a restarted store (every
//! object SSD-only) after dropping the page cache, against the disk's O_DIRECT read bandwidth
//! measured with dd on the same bucket files.
//!
//! Why: a read that misses DRAM is bounded by the disk; the target is a share of what the
//! disk itself delivers (Mooncake reached 0.305 of 0.63 GB/s on this machine kind), so the
//! ratio does not depend on which disk the run lands on. Without root the page cache is
//! dropped per file (`posix_fadvise(DONTNEED)`); the row names which was used.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use kvtier_l3::{EmbeddedStore, L3Store, PutOptions, SsdConfig, StoreConfig};

use super::{R, fill, median, row, serde_row, tenant};

const MOONCAKE_SSD_COLD_GBPS: f64 = 0.305;

fn drop_caches(dir: &Path) -> &'static str {
    if std::fs::write("/proc/sys/vm/drop_caches", b"3").is_ok() {
        return "drop_caches";
    }
    // Unprivileged fallback: evict each bucket file's clean pages.
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if let Ok(f) = std::fs::File::open(e.path()) {
                use std::os::fd::AsRawFd;
                // SAFETY: valid fd for the duration of the call.
                unsafe {
                    libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
                }
            }
        }
    }
    "posix_fadvise(DONTNEED)"
}

/// O_DIRECT sequential read bandwidth of `file` measured with dd (GB/s).
fn dd_direct(file: &Path) -> R<f64> {
    let out = Command::new("dd")
        .arg(format!("if={}", file.display()))
        .args(["of=/dev/null", "bs=1M", "iflag=direct"])
        .output()
        .map_err(|e| format!("dd: {e}"))?;
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    // "... bytes (...) copied, 0.4 s, 630 MB/s"
    let last = text.lines().last().unwrap_or("").to_string();
    let parts: Vec<&str> = last.split(',').collect();
    let bytes: f64 = last
        .split_whitespace()
        .next()
        .and_then(|b| b.parse().ok())
        .ok_or_else(|| format!("cannot parse dd output {text:?}"))?;
    let secs: f64 = parts
        .get(parts.len().saturating_sub(2))
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("cannot parse dd output {text:?}"))?;
    Ok(bytes / secs / 1e9)
}

pub fn ssd(dir: &Path, reps: usize, rows: &mut Vec<serde_row::Row>) -> R<()> {
    kvtier_l3::error::best_effort("remove the bench dir", std::fs::remove_dir_all(dir));
    let mk = |seg: u64| {
        let mut ssd = SsdConfig::new(dir);
        ssd.bucket_bytes_limit = 64 << 20;
        EmbeddedStore::new(StoreConfig {
            local_segment_bytes: seg,
            ssd: Some(ssd),
            ..Default::default()
        })
        .map_err(|e| e.to_string())
    };
    let keys = {
        let s = mk(1 << 30)?;
        let k = fill(&s, 256, 1 << 20, PutOptions::default())?;
        s.flush().map_err(|e| e.to_string())?;
        k
    };
    // Restarted store: DRAM empty, every object SSD-only.
    let s = mk(1 << 30)?;
    let mut cold = Vec::new();
    let mut how = "";
    let mut data = vec![0u8; 256 << 20];
    for _ in 0..reps.clamp(3, 5) {
        how = drop_caches(dir);
        let mut bufs: Vec<&mut [u8]> = data.chunks_mut(1 << 20).collect();
        let t0 = Instant::now();
        let r = s
            .batch_get_into(&tenant(), &keys, &mut bufs)
            .map_err(|e| e.to_string())?;
        let dt = t0.elapsed().as_secs_f64();
        if r.iter().any(|x| x.is_err()) {
            return Err("ssd read failed".into());
        }
        cold.push((256 << 20) as f64 / dt / 1e9);
    }
    let m = median(&mut cold);
    // The disk's direct-read bandwidth on the same files.
    let mut dd = Vec::new();
    let mut biggest: Option<(u64, PathBuf)> = None;
    for e in std::fs::read_dir(dir).map_err(|e| e.to_string())?.flatten() {
        let len = e.metadata().map(|m| m.len()).unwrap_or(0);
        if biggest.as_ref().is_none_or(|(l, _)| len > *l) {
            biggest = Some((len, e.path()));
        }
    }
    if let Some((_, p)) = &biggest {
        for _ in 0..3 {
            drop_caches(dir);
            dd.push(dd_direct(p)?);
        }
    }
    let disk = median(&mut dd);
    rows.push(row(
        &format!("cold SSD batch_get_into 256x1MiB ({how})"),
        m,
        "GB/s",
        &format!("Mooncake {MOONCAKE_SSD_COLD_GBPS} of 0.63"),
        &format!(">= {:.3} (0.8 x dd {:.3})", 0.8 * disk, disk),
        m >= 0.8 * disk,
    ));
    rows.push(row(
        "  disk O_DIRECT read (dd bs=1M iflag=direct)",
        disk,
        "GB/s",
        "0.63 (Mooncake run)",
        "(info)",
        true,
    ));
    drop(s);
    kvtier_l3::error::best_effort("remove the bench dir", std::fs::remove_dir_all(dir));
    Ok(())
}
