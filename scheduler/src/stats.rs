//! Counters an operator watches: where prompt tokens came from, what ops ran and how long
//! they took, how long the queues are and how full the pools are.
//!
//! Why both a struct and the `metrics` facade: tests and the simulator read [`Stats`]
//! directly; a production engine already runs a Prometheus (or other) exporter, and every
//! counter here is also recorded through `metrics` under `kvtier_*` names, so it shows up
//! there without kvtier choosing an exporter.

use serde::Serialize;
use strum::IntoEnumIterator;

use kvtier_fsm::OpKind;
use kvtier_radix::TierUsage;

/// Per-kind op counters. Latencies are measured in the engine's clock (the `now` passed to
/// `next_execution_plan`), from the plan that issued the op to the first plan after its
/// completion was reported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OpStats {
    pub issued: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub latency_ms_sum: u64,
    pub latency_ms_max: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    pub submitted: u64,
    pub finished: u64,
    pub aborted: u64,
    pub failed: u64,
    pub retracted: u64,
    /// Prompt tokens found on device at a request's first admission (a resumed request's own
    /// pages are not prefix hits).
    pub device_hit_tokens: u64,
    pub device_hit_pages: u64,
    /// Prompt tokens loaded back from host.
    pub host_hit_tokens: u64,
    pub host_hit_pages: u64,
    /// Prompt tokens prefetched from L3 (and then loaded back).
    pub l3_hit_tokens: u64,
    pub l3_hit_pages: u64,
    /// Prompt tokens computed by prefill.
    pub computed_tokens: u64,
    /// Tree nodes whose "in L3" flag was cleared by reported L3 losses.
    pub l3_lost_nodes: u64,
    /// Device leaves written back to host before eviction (`HostAdmission::OnDeviceEviction`).
    pub demotions: u64,
    /// Failed backups waiting to be tried again once L3 answers (runs of pages, now).
    pub backups_retrying: usize,
    /// Failed backups given up (out of tries, or too many waiting).
    pub backups_given_up: u64,
    /// Failed backups tried again (backups planned from the retry queue).
    pub backups_retried: u64,
    /// Probes: waiting failed backups tried while L3 had not answered since a failure (one
    /// plan in `BackupRetry::probe_every`).
    pub backups_probed: u64,
    /// Locks or pages the scheduler failed to give back (a scheduler bug; `check` wants 0).
    pub internal_errors: u64,
    /// Time to first token (engine clock, ms), summed over requests that produced one.
    pub ttft_ms_sum: u64,
    pub ttft_count: u64,
    /// Per op kind, in `OpKind` order: LoadBack, WriteBack, Prefetch, BackUp, L3Query.
    pub ops: Vec<(OpKind, OpStats)>,
    pub waiting: usize,
    pub running: usize,
    pub prefetching: usize,
    pub device: TierUsage,
    pub host: TierUsage,
    pub plans: u64,
}

impl Stats {
    pub(crate) fn new() -> Self {
        Stats {
            ops: OpKind::iter().map(|k| (k, OpStats::default())).collect(),
            ..Stats::default()
        }
    }

    pub(crate) fn op_mut(&mut self, kind: OpKind) -> &mut OpStats {
        let i = OpKind::iter().position(|k| k == kind).unwrap_or(0);
        &mut self.ops[i].1
    }

    pub fn op(&self, kind: OpKind) -> OpStats {
        self.ops
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, s)| *s)
            .unwrap_or_default()
    }

    pub(crate) fn record_issue(&mut self, kind: OpKind) {
        self.op_mut(kind).issued += 1;
        // One literal label per kind makes the metric key a static: no label allocation and no
        // key hashing per issued op. The labels are `kind_name(kind)` (checked in the tests).
        match kind {
            OpKind::LoadBack => metrics::counter!("kvtier_ops_issued_total", "kind" => "LoadBack"),
            OpKind::WriteBack => {
                metrics::counter!("kvtier_ops_issued_total", "kind" => "WriteBack")
            }
            OpKind::Prefetch => metrics::counter!("kvtier_ops_issued_total", "kind" => "Prefetch"),
            OpKind::BackUp => metrics::counter!("kvtier_ops_issued_total", "kind" => "BackUp"),
            OpKind::L3Query => metrics::counter!("kvtier_ops_issued_total", "kind" => "L3Query"),
        }
        .increment(1);
    }

    pub(crate) fn record_completion(&mut self, kind: OpKind, success: bool, latency_ms: u64) {
        let s = self.op_mut(kind);
        if success {
            s.succeeded += 1;
        } else {
            s.failed += 1;
        }
        s.latency_ms_sum += latency_ms;
        s.latency_ms_max = s.latency_ms_max.max(latency_ms);
        let k = kind_name(kind);
        metrics::counter!("kvtier_ops_completed_total", "kind" => k, "success" => if success { "true" } else { "false" })
            .increment(1);
        metrics::histogram!("kvtier_op_latency_ms", "kind" => k).record(latency_ms as f64);
    }

    pub(crate) fn record_hits(&mut self, tier: &'static str, pages: u64, page_size: u64) {
        let (p, t) = match tier {
            "device" => (&mut self.device_hit_pages, &mut self.device_hit_tokens),
            "host" => (&mut self.host_hit_pages, &mut self.host_hit_tokens),
            _ => (&mut self.l3_hit_pages, &mut self.l3_hit_tokens),
        };
        *p += pages;
        *t += pages * page_size;
        // Literal labels make the metric keys statics: no label allocation and no key hashing
        // per call (this runs three times per admitted request; the dynamic form was a fifth of
        // a 256-admission plan).
        let (hit_pages, hit_tokens) = match tier {
            "device" => (
                metrics::counter!("kvtier_hit_pages_total", "tier" => "device"),
                metrics::counter!("kvtier_hit_tokens_total", "tier" => "device"),
            ),
            "host" => (
                metrics::counter!("kvtier_hit_pages_total", "tier" => "host"),
                metrics::counter!("kvtier_hit_tokens_total", "tier" => "host"),
            ),
            "l3" => (
                metrics::counter!("kvtier_hit_pages_total", "tier" => "l3"),
                metrics::counter!("kvtier_hit_tokens_total", "tier" => "l3"),
            ),
            _ => (
                metrics::counter!("kvtier_hit_pages_total", "tier" => tier),
                metrics::counter!("kvtier_hit_tokens_total", "tier" => tier),
            ),
        };
        hit_pages.increment(pages);
        hit_tokens.increment(pages * page_size);
    }

    /// Publishes the gauges (once per plan).
    pub(crate) fn publish_gauges(&self) {
        metrics::gauge!("kvtier_waiting_requests").set(self.waiting as f64);
        metrics::gauge!("kvtier_running_requests").set(self.running as f64);
        metrics::gauge!("kvtier_prefetching_requests").set(self.prefetching as f64);
        metrics::gauge!("kvtier_backups_retrying").set(self.backups_retrying as f64);
        for (tier, u) in [("device", self.device), ("host", self.host)] {
            metrics::gauge!("kvtier_pool_pages", "tier" => tier, "state" => "free")
                .set(u.free as f64);
            metrics::gauge!("kvtier_pool_pages", "tier" => tier, "state" => "held")
                .set(u.held as f64);
            metrics::gauge!("kvtier_pool_pages", "tier" => tier, "state" => "cached")
                .set(u.cached as f64);
            metrics::gauge!("kvtier_pool_pages", "tier" => tier, "state" => "locked")
                .set(u.locked as f64);
        }
    }
}

fn kind_name(k: OpKind) -> &'static str {
    k.into()
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use metrics::{
        Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };

    use super::*;

    /// Records `name{label=value,..}` of every counter registered.
    #[derive(Default)]
    struct Keys(Mutex<Vec<String>>);

    impl Recorder for Keys {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            let mut keys = self.0.lock().unwrap();
            keys.push(format!("{}{{{}}}", key.name(), labels.join(",")));
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    #[test]
    fn literal_metric_labels_are_the_kind_and_tier_names() {
        let rec = Keys::default();
        let mut s = Stats::new();
        metrics::with_local_recorder(&rec, || {
            for kind in OpKind::iter() {
                s.record_issue(kind);
            }
            for tier in ["device", "host", "l3"] {
                s.record_hits(tier, 1, 64);
            }
        });
        let mut want: Vec<String> = OpKind::iter()
            .map(|k| format!("kvtier_ops_issued_total{{kind={}}}", kind_name(k)))
            .collect();
        for tier in ["device", "host", "l3"] {
            want.push(format!("kvtier_hit_pages_total{{tier={tier}}}"));
            want.push(format!("kvtier_hit_tokens_total{{tier={tier}}}"));
        }
        assert_eq!(*rec.0.lock().unwrap(), want);
        assert_eq!(s.op(OpKind::BackUp).issued, 1);
        assert_eq!((s.l3_hit_pages, s.l3_hit_tokens), (1, 64));
    }
}
