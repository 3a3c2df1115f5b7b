//! `GET /metrics`: the router's `/stats` in Prometheus' text format, for the scrape every
//! serving stack already runs (vLLM and SGLang expose theirs at `/metrics`; before, a scrape
//! of the router got its JSON 404). One source: the figures are read from
//! [`crate::cluster::Cluster::stats`], so the two endpoints never disagree; per-instance
//! figures carry an `instance` label (the instance's index, as in `/stats`).

use std::fmt::Write as _;

use serde_json::Value;

/// (name, type, help, `/stats` key) of each per-instance figure.
const PER_INSTANCE: [(&str, &str, &str, &str); 9] = [
    (
        "kvtier_router_routed_total",
        "counter",
        "Requests routed to the instance.",
        "routed",
    ),
    (
        "kvtier_router_refused_total",
        "counter",
        "Requests the instance refused (connection refused or unavailable).",
        "refused",
    ),
    (
        "kvtier_router_unreachable_total",
        "counter",
        "Times the instance could not be connected to.",
        "unreachable",
    ),
    (
        "kvtier_router_upstream_errors_total",
        "counter",
        "Server errors the instance answered.",
        "upstream_errors",
    ),
    (
        "kvtier_router_in_flight",
        "gauge",
        "Proxied requests in flight on the instance.",
        "in_flight",
    ),
    (
        "kvtier_router_queue_seconds",
        "gauge",
        "Work the router counts queued on the instance, seconds.",
        "queue_s",
    ),
    (
        "kvtier_router_late_seconds",
        "gauge",
        "How much later than priced the instance's first tokens come, seconds.",
        "late_s",
    ),
    (
        "kvtier_router_gpu_pages",
        "gauge",
        "Pages the index holds on the instance's GPU.",
        "gpu_pages",
    ),
    (
        "kvtier_router_cpu_pages",
        "gauge",
        "Pages the index holds in the instance's host memory.",
        "cpu_pages",
    ),
];

/// (name, type, help, `/stats` key) of each router-wide figure.
const ROUTER: [(&str, &str, &str, &str); 6] = [
    (
        "kvtier_router_routed_load_only_total",
        "counter",
        "Requests routed by load alone (no tokens).",
        "routed_load_only",
    ),
    (
        "kvtier_router_overloaded_total",
        "counter",
        "Requests not sent for want of file descriptors.",
        "router_overloaded",
    ),
    (
        "kvtier_router_booked",
        "gauge",
        "Requests booked and not ended.",
        "booked",
    ),
    (
        "kvtier_router_index_pages",
        "gauge",
        "Pages in the router's index.",
        "index_pages",
    ),
    (
        "kvtier_router_storage_pages",
        "gauge",
        "Pages of the shared store in the index.",
        "storage_pages",
    ),
    (
        "kvtier_router_memory_bytes",
        "gauge",
        "Bytes the index holds.",
        "memory_bytes",
    ),
];

/// The Prometheus text exposition (format 0.0.4) of a `/stats` answer; a figure `/stats`
/// does not hold as a number is left out.
pub fn render(stats: &Value) -> String {
    let mut out = String::new();
    let instances = stats["instances"].as_array().map_or(&[][..], Vec::as_slice);
    for (name, kind, help, key) in PER_INSTANCE {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (i, inst) in instances.iter().enumerate() {
            if let Some(v) = inst[key].as_f64() {
                let _ = writeln!(out, "{name}{{instance=\"{i}\"}} {v}");
            }
        }
    }
    for (name, kind, help, key) in ROUTER {
        if let Some(v) = stats[key].as_f64() {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn figures_that_are_not_numbers_are_left_out() {
        let text = render(&json!({"instances": [{"routed": 2, "queue_s": null}], "booked": "x"}));
        assert!(
            text.contains("kvtier_router_routed_total{instance=\"0\"} 2\n"),
            "{text}"
        );
        assert!(!text.contains("kvtier_router_queue_seconds{"), "{text}");
        assert!(!text.contains("kvtier_router_booked"), "{text}");
        assert!(render(&json!({})).lines().all(|l| l.starts_with('#')));
    }
}
