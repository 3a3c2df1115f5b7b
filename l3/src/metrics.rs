//! Prometheus metrics: objects, bytes and hits per tier, evictions, promotions, lease
//! rejections and op latencies.
//!
//! Why hand-rolled: the text exposition format is a few lines, and the counters are plain
//! atomics bumped on the hot path (no allocation, no lock). The HTTP endpoint lives in
//! [`crate::rpc::server`] and binds loopback only.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::types::StoreStats;

/// Operations whose latency is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// put / batch_put_from
    Put,
    /// get / batch_get_into
    Get,
    /// exist / batch_exist
    Exist,
    /// query / batch_query
    Query,
    /// remove / remove_all
    Remove,
}

const OPS: [(&str, Op); 5] = [
    ("put", Op::Put),
    ("get", Op::Get),
    ("exist", Op::Exist),
    ("query", Op::Query),
    ("remove", Op::Remove),
];

/// Latency histogram bucket bounds in microseconds.
const BOUNDS_US: [u64; 10] = [10, 50, 100, 250, 500, 1_000, 5_000, 10_000, 50_000, 250_000];

#[derive(Debug, Default)]
struct Hist {
    buckets: [AtomicU64; 10],
    count: AtomicU64,
    sum_us: AtomicU64,
}

/// All counters of one store.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Reads served from DRAM.
    pub hits_memory: AtomicU64,
    /// Reads served from SSD.
    pub hits_disk: AtomicU64,
    /// Reads that found nothing.
    pub misses: AtomicU64,
    /// DRAM replicas evicted.
    pub evictions: AtomicU64,
    /// Batched gets rejected per key because the query lease expired (-707).
    pub lease_rejections: AtomicU64,
    /// SSD reads that failed their checksum (reported as misses).
    pub corrupt_reads: AtomicU64,
    /// Offloads skipped because the queue was full.
    pub offload_skipped: AtomicU64,
    hist: [Hist; 5],
}

impl Metrics {
    /// Records one operation's latency.
    pub fn observe(&self, op: Op, d: Duration) {
        let idx = OPS.iter().position(|(_, o)| *o == op).unwrap_or(0);
        let h = &self.hist[idx];
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        if let Some(b) = BOUNDS_US.iter().position(|&b| us <= b) {
            h.buckets[b].fetch_add(1, Ordering::Relaxed);
        }
        h.count.fetch_add(1, Ordering::Relaxed);
        h.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Operations recorded so far (all kinds).
    pub fn ops_total(&self) -> u64 {
        self.hist
            .iter()
            .map(|h| h.count.load(Ordering::Relaxed))
            .fold(0u64, u64::wrapping_add)
    }

    /// Adds to a counter.
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Prometheus text exposition.
    pub fn render(&self, s: &StoreStats, extra: &[(&str, &str, u64)]) -> String {
        let mut o = String::new();
        let g = |o: &mut String, name: &str, help: &str, kind: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        let ld = |c: &AtomicU64| c.load(Ordering::Relaxed);
        g(
            &mut o,
            "kvtier_l3_objects",
            "Complete objects known to the master",
            "gauge",
            s.objects,
        );
        let _ = writeln!(
            o,
            "# HELP kvtier_l3_tier_objects Objects with a replica in the tier\n# TYPE kvtier_l3_tier_objects gauge\nkvtier_l3_tier_objects{{tier=\"memory\"}} {}\nkvtier_l3_tier_objects{{tier=\"disk\"}} {}",
            s.mem_objects, s.disk_objects
        );
        let _ = writeln!(
            o,
            "# HELP kvtier_l3_tier_bytes Bytes used in the tier (memory: as charged, values with their keys and metadata)\n# TYPE kvtier_l3_tier_bytes gauge\nkvtier_l3_tier_bytes{{tier=\"memory\"}} {}\nkvtier_l3_tier_bytes{{tier=\"disk\"}} {}",
            s.mem_used_bytes, s.disk_used_bytes
        );
        g(
            &mut o,
            "kvtier_l3_memory_capacity_bytes",
            "Capacity of mounted segments",
            "gauge",
            s.mem_capacity_bytes,
        );
        let _ = writeln!(
            o,
            "# HELP kvtier_l3_hits_total Reads served per tier\n# TYPE kvtier_l3_hits_total counter\nkvtier_l3_hits_total{{tier=\"memory\"}} {}\nkvtier_l3_hits_total{{tier=\"disk\"}} {}",
            ld(&self.hits_memory),
            ld(&self.hits_disk)
        );
        g(
            &mut o,
            "kvtier_l3_misses_total",
            "Reads that found nothing",
            "counter",
            ld(&self.misses),
        );
        g(
            &mut o,
            "kvtier_l3_evictions_total",
            "DRAM replicas evicted",
            "counter",
            ld(&self.evictions),
        );
        g(
            &mut o,
            "kvtier_l3_lease_rejections_total",
            "Batched gets rejected for an expired lease",
            "counter",
            ld(&self.lease_rejections),
        );
        g(
            &mut o,
            "kvtier_l3_corrupt_reads_total",
            "SSD reads failing their checksum",
            "counter",
            ld(&self.corrupt_reads),
        );
        g(
            &mut o,
            "kvtier_l3_offload_skipped_total",
            "Offloads skipped (queue full)",
            "counter",
            ld(&self.offload_skipped),
        );
        for (name, help, v) in extra {
            g(&mut o, name, help, "counter", *v);
        }
        let _ = writeln!(
            o,
            "# HELP kvtier_l3_op_latency_seconds Operation latency\n# TYPE kvtier_l3_op_latency_seconds histogram"
        );
        for (i, (name, _)) in OPS.iter().enumerate() {
            let h = &self.hist[i];
            let mut cum = 0;
            for (b, bound) in BOUNDS_US.iter().enumerate() {
                cum += ld(&h.buckets[b]);
                let _ = writeln!(
                    o,
                    "kvtier_l3_op_latency_seconds_bucket{{op=\"{name}\",le=\"{}\"}} {cum}",
                    *bound as f64 / 1e6
                );
            }
            let count = ld(&h.count);
            let _ = writeln!(
                o,
                "kvtier_l3_op_latency_seconds_bucket{{op=\"{name}\",le=\"+Inf\"}} {count}"
            );
            let _ = writeln!(
                o,
                "kvtier_l3_op_latency_seconds_sum{{op=\"{name}\"}} {}",
                ld(&h.sum_us) as f64 / 1e6
            );
            let _ = writeln!(
                o,
                "kvtier_l3_op_latency_seconds_count{{op=\"{name}\"}} {count}"
            );
        }
        o
    }
}
