//! What a simulation measured, and the report users read (a table) or programs read (JSON).

use std::time::Duration;

use serde::Serialize;

use kvtier_scheduler::{OpKind, Outcome, SchedulerError, Stats};

use crate::belady::AccessLog;

/// Running tallies kept by the engine.
#[derive(Debug, Default)]
pub struct Collector {
    pub page_size: usize,
    pub page_bytes: u64,
    pub submitted: u64,
    pub rejected: u64,
    /// Rejected requests by reason.
    pub rejected_by: std::collections::BTreeMap<String, u64>,
    /// Prompt tokens of the rejected requests.
    pub rejected_prompt_tokens: u64,
    /// Longest request offered (prompt + output tokens), accepted or not.
    pub longest_request: u64,
    pub ended: u64,
    pub prompt_tokens: u64,
    /// Each request that produced a first token, in the order they ended (its TTFT among
    /// them: the percentiles are taken from these).
    pub timings: Vec<RequestTiming>,
    pub outcomes: [u64; 3],
    pub pages_checked: u64,
    pub oracle_failures: u64,
    pub first_failures: Vec<String>,
    pub pcie_bytes: u64,
    pub l3_read_bytes: u64,
    pub l3_write_bytes: u64,
    pub ssd_read_bytes: u64,
    pub prefetch_ssd_wait_us: u64,
    pub l3_pages_read: u64,
    pub l3_pages_written: u64,
    pub forwards: u64,
    pub forward_us: u64,
    pub prefill_tokens: u64,
    pub decode_rows: u64,
}

impl Collector {
    pub fn new(page_size: usize, page_bytes: u64) -> Self {
        Collector {
            page_size,
            page_bytes,
            ..Default::default()
        }
    }
    pub fn submitted(&mut self, prompt: u64) {
        self.submitted += 1;
        self.prompt_tokens += prompt;
    }
    /// A request the scheduler refused at submission.
    pub fn rejected(&mut self, e: &SchedulerError, prompt: u64) {
        self.rejected += 1;
        self.rejected_prompt_tokens += prompt;
        let reason = match e {
            SchedulerError::TooLong { max, .. } => {
                format!("prompt + output longer than max_context_tokens {max}")
            }
            other => other.to_string(),
        };
        *self.rejected_by.entry(reason).or_default() += 1;
    }
    pub fn longest(&mut self, tokens: u64) {
        self.longest_request = self.longest_request.max(tokens);
    }
    /// A request ended; `timing` when it produced a first token.
    pub fn ended(&mut self, o: Outcome, timing: Option<RequestTiming>) {
        self.ended += 1;
        self.outcomes[o as usize] += 1;
        if let Some(t) = timing {
            self.timings.push(t);
        }
    }
    pub fn oracle_failure(&mut self, msg: String) {
        self.oracle_failures += 1;
        if self.first_failures.len() < 5 {
            self.first_failures.push(msg);
        }
    }
    pub fn traffic(&mut self, kind: OpKind, bytes: u64) {
        match kind {
            OpKind::LoadBack | OpKind::WriteBack => self.pcie_bytes += bytes,
            OpKind::Prefetch => self.l3_read_bytes += bytes,
            OpKind::BackUp => self.l3_write_bytes += bytes,
            OpKind::L3Query => {}
        }
    }
    pub fn ssd_read(&mut self, bytes: u64) {
        self.ssd_read_bytes += bytes;
    }
    /// Time a prefetch spent waiting for SSD reads (inline, or a promotion not yet done).
    pub fn prefetch_ssd_wait(&mut self, us: u64) {
        self.prefetch_ssd_wait_us = self.prefetch_ssd_wait_us.saturating_add(us);
    }
    pub fn l3_read(&mut self, pages: u64) {
        self.l3_pages_read += pages;
    }
    pub fn l3_written(&mut self, pages: u64) {
        self.l3_pages_written += pages;
    }
    pub fn forward(&mut self, prefill: u64, decode: u64, us: u64) {
        self.forwards += 1;
        self.prefill_tokens += prefill;
        self.decode_rows += decode;
        self.forward_us = self.forward_us.saturating_add(us);
    }

    pub fn finish(mut self, stats: &[Stats], end_us: u64, wall: Duration) -> Report {
        let sum = |f: fn(&Stats) -> u64| stats.iter().map(f).sum::<u64>();
        let ps = self.page_size as u64;
        let device = sum(|s| s.device_hit_tokens);
        let host = sum(|s| s.host_hit_tokens);
        let l3 = sum(|s| s.l3_hit_tokens);
        let computed = sum(|s| s.computed_tokens);
        // Rates are fractions of the prompt tokens submitted; tokens computed again after a
        // retraction are reported separately.
        let prompt = self.prompt_tokens;
        let rate = |x: u64| {
            if prompt == 0 {
                0.0
            } else {
                x as f64 / prompt as f64
            }
        };
        let miss = prompt.saturating_sub(device + host + l3);
        let recomputed = computed.saturating_sub(miss);
        let mut ttft_us: Vec<u64> = self.timings.iter().map(|t| t.ttft_us).collect();
        ttft_us.sort_unstable();
        let secs = end_us as f64 / 1e6;
        let ops = [
            OpKind::L3Query,
            OpKind::Prefetch,
            OpKind::LoadBack,
            OpKind::WriteBack,
            OpKind::BackUp,
        ]
        .iter()
        .map(|k| {
            let issued = stats.iter().map(|s| s.op(*k).issued).sum();
            let failed = stats.iter().map(|s| s.op(*k).failed).sum();
            OpCount {
                kind: format!("{k}"),
                issued,
                failed,
            }
        })
        .collect();
        let output_tokens = self.decode_rows + sum(|s| s.ttft_count);
        Report {
            requests: self.submitted,
            rejected: self.rejected,
            rejections: std::mem::take(&mut self.rejected_by)
                .into_iter()
                .map(|(reason, count)| Rejection { reason, count })
                .collect(),
            rejected_prompt_tokens: self.rejected_prompt_tokens,
            longest_request_tokens: self.longest_request,
            finished: self.outcomes[Outcome::Finished as usize],
            aborted: self.outcomes[Outcome::Aborted as usize],
            failed: self.outcomes[Outcome::Failed as usize],
            retracted: sum(|s| s.retracted),
            prompt_tokens: self.prompt_tokens,
            hits: HitRates {
                device_tokens: device,
                host_tokens: host,
                l3_tokens: l3,
                miss_tokens: miss,
                recomputed_tokens: recomputed,
                device_pages: device / ps,
                host_pages: host / ps,
                l3_pages: l3 / ps,
                device: rate(device),
                host: rate(host),
                l3: rate(l3),
                miss: rate(miss),
                total: rate(device + host + l3),
            },
            prefill_tokens_saved: device + host + l3,
            ttft_ms: Percentiles::of_sorted_us(&ttft_us),
            simulated_seconds: secs,
            throughput_requests_per_s: if secs > 0.0 {
                self.ended as f64 / secs
            } else {
                0.0
            },
            throughput_output_tokens_per_s: if secs > 0.0 {
                output_tokens as f64 / secs
            } else {
                0.0
            },
            pcie_bytes: self.pcie_bytes,
            l3_read_bytes: self.l3_read_bytes,
            l3_write_bytes: self.l3_write_bytes,
            ssd_read_bytes: self.ssd_read_bytes,
            prefetch_ssd_wait_ms: self.prefetch_ssd_wait_us as f64 / 1000.0,
            ops,
            belady: None,
            belady_local: None,
            oracle: Oracle {
                pages_checked: self.pages_checked,
                failures: self.oracle_failures,
                first_failures: self.first_failures,
            },
            l3_objects: 0,
            wall_seconds: wall.as_secs_f64(),
            policy: String::new(),
            compared: Vec::new(),
            accesses: AccessLog::default(),
            adaptive: Vec::new(),
            shadow: Vec::new(),
            routing: RoutingReport::default(),
            timings: std::mem::take(&mut self.timings),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct HitRates {
    pub device_tokens: u64,
    pub host_tokens: u64,
    pub l3_tokens: u64,
    pub miss_tokens: u64,
    /// Tokens computed again because their request was retracted.
    pub recomputed_tokens: u64,
    pub device_pages: u64,
    pub host_pages: u64,
    pub l3_pages: u64,
    /// Fractions of the prompt tokens submitted.
    pub device: f64,
    pub host: f64,
    pub l3: f64,
    pub miss: f64,
    pub total: f64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Percentiles {
    /// Percentiles (ms) of sorted durations in µs: the nearest rank, all zero when empty.
    pub fn of_sorted_us(us: &[u64]) -> Self {
        let pct = |p: f64| -> f64 {
            if us.is_empty() {
                return 0.0;
            }
            let i = ((us.len() as f64 - 1.0) * p).round() as usize;
            us[i] as f64 / 1000.0
        };
        Percentiles {
            p50: pct(0.5),
            p90: pct(0.9),
            p99: pct(0.99),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct OpCount {
    pub kind: String,
    pub issued: u64,
    pub failed: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Oracle {
    pub pages_checked: u64,
    pub failures: u64,
    pub first_failures: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BeladyBound {
    pub capacity_pages: u64,
    /// Page-level offline-optimal (MIN) hit rate over prompt tokens: no policy can do better.
    pub hit_rate: f64,
    pub hit_pages: u64,
}

/// The headline figures of a run, for side-by-side comparisons.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The eviction policy that ran.
    pub policy: String,
    pub hit_rate: f64,
    pub device: f64,
    pub ttft_ms: Percentiles,
}

/// Requests the scheduler refused, with why.
#[derive(Debug, Clone, Serialize)]
pub struct Rejection {
    pub reason: String,
    pub count: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Requests accepted.
    pub requests: u64,
    pub rejected: u64,
    pub rejections: Vec<Rejection>,
    /// Prompt tokens of the rejected requests (left out of `prompt_tokens`, the hit rates and
    /// the TTFT percentiles).
    pub rejected_prompt_tokens: u64,
    /// Longest request offered (prompt + output tokens).
    pub longest_request_tokens: u64,
    pub finished: u64,
    pub aborted: u64,
    pub failed: u64,
    pub retracted: u64,
    pub prompt_tokens: u64,
    pub hits: HitRates,
    pub prefill_tokens_saved: u64,
    pub ttft_ms: Percentiles,
    pub simulated_seconds: f64,
    pub throughput_requests_per_s: f64,
    pub throughput_output_tokens_per_s: f64,
    pub pcie_bytes: u64,
    pub l3_read_bytes: u64,
    pub l3_write_bytes: u64,
    /// Bytes prefetches read from L3's SSD tier.
    pub ssd_read_bytes: u64,
    /// Total time prefetches waited for the L3's SSD (promotion on probe shortens it).
    pub prefetch_ssd_wait_ms: f64,
    pub ops: Vec<OpCount>,
    pub belady: Option<BeladyBound>,
    /// With L3 enabled: the ceiling for the local tiers alone (device + host), the capacity a
    /// sweep's x axis shows.
    pub belady_local: Option<BeladyBound>,
    pub oracle: Oracle,
    pub l3_objects: u64,
    pub wall_seconds: f64,
    /// The eviction policy that ran (set by the caller; empty if unknown).
    pub policy: String,
    /// The same workload and capacity under the simulator's other online policies (LRU and
    /// the frequency/depth-aware one), for comparison (set by the caller).
    pub compared: Vec<Summary>,
    /// What the adaptive eviction policy learnt, per instance (empty under a fixed policy).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub adaptive: Vec<kvtier_radix::AdaptiveSnapshot>,
    /// What the shadow selector chose and its shadows' hit rates, per instance (empty under
    /// other policies).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shadow: Vec<kvtier_radix::ShadowSnapshot>,
    /// Where the router sent requests, how busy each instance was, its index.
    pub routing: RoutingReport,
    /// The access sequence the Belady ceiling is computed over (not serialized).
    #[serde(skip)]
    pub accesses: AccessLog,
    /// Each request's time to first token, where it ran (not serialized: one per request;
    /// `examples/p99_anatomy.rs` reads them).
    #[serde(skip)]
    pub timings: Vec<RequestTiming>,
}

/// One request's time to first token and where it ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestTiming {
    /// The request's id (its line in a trace).
    pub id: u64,
    pub instance: usize,
    pub arrival_us: u64,
    pub ttft_us: u64,
    pub prompt_tokens: usize,
}

/// The router's part of a run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RoutingReport {
    pub router: String,
    /// Requests routed to each instance.
    pub routed: Vec<u64>,
    /// Seconds each instance spent in forward passes.
    pub busy_s: Vec<f64>,
    pub index: crate::routing::IndexStats,
}

impl RoutingReport {
    /// The most and the least busy instance's forward time (seconds).
    pub fn busy_max_min(&self) -> (f64, f64) {
        let max = self.busy_s.iter().copied().fold(0.0, f64::max);
        let min = self.busy_s.iter().copied().fold(f64::INFINITY, f64::min);
        (max, if min.is_finite() { min } else { 0.0 })
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

impl Report {
    pub fn summary(&self) -> Summary {
        Summary {
            policy: self.policy.clone(),
            hit_rate: self.hits.total,
            device: self.hits.device,
            ttft_ms: self.ttft_ms.clone(),
        }
    }

    /// A readable table for the terminal.
    pub fn table(&self) -> String {
        let h = &self.hits;
        let mut s = String::new();
        let mut line = |k: &str, v: String| {
            s.push_str(&format!("  {k:<28} {v}\n"));
        };
        line(
            "requests",
            format!(
                "{} ({} finished, {} aborted, {} failed, {} rejected, {} retractions)",
                self.requests,
                self.finished,
                self.aborted,
                self.failed,
                self.rejected,
                self.retracted
            ),
        );
        for r in &self.rejections {
            line("rejected", format!("{}: {}", r.count, r.reason));
        }
        if self.rejected > 0 {
            line(
                "rejected prompt tokens",
                format!("{} (not in the hit rates)", self.rejected_prompt_tokens),
            );
        }
        line(
            "longest request",
            format!("{} tokens (prompt + output)", self.longest_request_tokens),
        );
        line("prompt tokens", format!("{}", self.prompt_tokens));
        // A run that served no prompt (every request rejected) has no rates to show: zeros
        // would read as measured (a sweep point says "not measured" likewise).
        // as a sweep point's `measured()`: no request accepted, nothing to rate
        let served = self.requests > 0;
        let unmeasured = |what: &str| format!("not measured: {what}");
        let no_prompt = || {
            unmeasured(&format!(
                "no prompt was served ({} rejected)",
                self.rejected
            ))
        };
        if !served {
            for k in [
                "hit rate: device",
                "hit rate: host",
                "hit rate: L3",
                "miss (computed)",
            ] {
                line(k, no_prompt());
            }
        } else {
            line(
                "hit rate: device",
                format!("{:>6.2} %  ({} tokens)", h.device * 100.0, h.device_tokens),
            );
            line(
                "hit rate: host",
                format!("{:>6.2} %  ({} tokens)", h.host * 100.0, h.host_tokens),
            );
            line(
                "hit rate: L3",
                format!("{:>6.2} %  ({} tokens)", h.l3 * 100.0, h.l3_tokens),
            );
            line(
                "miss (computed)",
                format!(
                    "{:>6.2} %  ({} tokens; {} recomputed after retraction)",
                    h.miss * 100.0,
                    h.miss_tokens,
                    h.recomputed_tokens
                ),
            );
        }
        let policy = if self.policy.is_empty() {
            String::new()
        } else {
            format!("  (eviction {})", self.policy)
        };
        line(
            "total hit rate",
            if !served {
                format!("{}{policy}", no_prompt())
            } else {
                format!("{:>6.2} %{policy}", h.total * 100.0)
            },
        );
        for (i, sh) in self.shadow.iter().enumerate() {
            let rates: Vec<String> = sh
                .shadows
                .iter()
                .map(|x| format!("{} {:.2} %", x.candidate, x.hit_rate * 100.0))
                .collect();
            line(
                &format!("shadow selector {i}"),
                format!(
                    "{} ({} switches, sample 1/{}); shadows: {}",
                    sh.choice,
                    sh.switches,
                    sh.sample,
                    rates.join(", ")
                ),
            );
        }
        for l in &self.compared {
            line(
                &format!("{}, same capacity", l.policy),
                if !served {
                    no_prompt() // the same requests, rejected there too
                } else {
                    format!(
                        "{:>6.2} %  (TTFT p50 / p99 {:.1} / {:.1} ms)",
                        l.hit_rate * 100.0,
                        l.ttft_ms.p50,
                        l.ttft_ms.p99
                    )
                },
            );
        }
        if let Some(b) = &self.belady {
            line(
                "Belady ceiling",
                format!(
                    "{:>6.2} %  (capacity {} pages)",
                    b.hit_rate * 100.0,
                    b.capacity_pages
                ),
            );
        }
        if let Some(b) = &self.belady_local {
            line(
                "Belady, device + host only",
                format!(
                    "{:>6.2} %  (capacity {} pages)",
                    b.hit_rate * 100.0,
                    b.capacity_pages
                ),
            );
        }
        line(
            "prefill tokens saved",
            format!("{}", self.prefill_tokens_saved),
        );
        line(
            "TTFT p50 / p90 / p99",
            if self.timings.is_empty() {
                unmeasured("no request reached its first token")
            } else {
                format!(
                    "{:.1} / {:.1} / {:.1} ms",
                    self.ttft_ms.p50, self.ttft_ms.p90, self.ttft_ms.p99
                )
            },
        );
        line(
            "throughput",
            format!(
                "{:.2} req/s, {:.0} output tok/s over {:.1} s simulated",
                self.throughput_requests_per_s,
                self.throughput_output_tokens_per_s,
                self.simulated_seconds
            ),
        );
        line(
            "PCIe / L3 read (SSD) / write",
            format!(
                "{} / {} ({}) / {}",
                gib(self.pcie_bytes),
                gib(self.l3_read_bytes),
                gib(self.ssd_read_bytes),
                gib(self.l3_write_bytes)
            ),
        );
        let ops: Vec<String> = self
            .ops
            .iter()
            .map(|o| {
                format!(
                    "{} {}{}",
                    o.kind,
                    o.issued,
                    if o.failed > 0 {
                        format!(" ({} failed)", o.failed)
                    } else {
                        String::new()
                    }
                )
            })
            .collect();
        line("ops", ops.join(", "));
        line(
            "oracle",
            format!(
                "{} page reads checked, {} failures",
                self.oracle.pages_checked, self.oracle.failures
            ),
        );
        let rt = &self.routing;
        if rt.routed.len() > 1 {
            let (max, min) = rt.busy_max_min();
            line(
                "router",
                format!(
                    "{}: requests per instance {:?}, busy {:.1} s max / {:.1} s min",
                    rt.router, rt.routed, max, min
                ),
            );
            if rt.index.pages > 0 {
                line(
                    "router index",
                    format!(
                        "{} entries, {}",
                        rt.index.pages,
                        rt.index
                            .bytes
                            .map_or_else(|| "size not reported".into(), |b| format!("{b} bytes"))
                    ),
                );
            }
        }
        line("wall time", format!("{:.2} s", self.wall_seconds));
        s
    }
}
