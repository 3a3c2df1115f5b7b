//! The streams' counters as Prometheus lines, for the server's `/metrics`.

use super::{KvEventsHandle, KvEventsStats};

/// Prometheus lines of the streams' counters (`kvtier_l3_kv_events_*`): unlabelled for a
/// single stream, labelled `stream` (its position) and `topic` when there are several.
pub fn render_metrics(streams: &[KvEventsHandle]) -> String {
    type Read = fn(&KvEventsStats) -> u64;
    const SERIES: [(&str, &str, &str, Read); 7] = [
        ("batches_total", "Event batches published", "counter", |s| {
            s.batches
        }),
        (
            "stored_total",
            "Pages published as stored (STORAGE)",
            "counter",
            |s| s.stored,
        ),
        (
            "removed_total",
            "Pages published as removed (STORAGE)",
            "counter",
            |s| s.removed,
        ),
        (
            "unparsed_keys_total",
            "Readable keys not published: not {namespace}:{64 hex}:{rank}",
            "counter",
            |s| s.unparsed_keys,
        ),
        (
            "other_namespace_keys_total",
            "Readable keys not published: namespace not carried",
            "counter",
            |s| s.other_namespace_keys,
        ),
        (
            "failed_batches_total",
            "Batches the publisher refused",
            "counter",
            |s| s.failed_batches,
        ),
        (
            "resident_pages",
            "Pages published as resident now",
            "gauge",
            |s| s.resident_pages,
        ),
    ];
    let stats: Vec<(String, KvEventsStats)> = streams
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let label = if streams.len() > 1 {
                let topic = h.topic().replace('\\', "\\\\").replace('"', "\\\"");
                format!("{{stream=\"{i}\",topic=\"{topic}\"}}")
            } else {
                String::new()
            };
            (label, h.stats())
        })
        .collect();
    let mut o = String::new();
    if stats.is_empty() {
        return o;
    }
    for (name, help, kind, read) in SERIES {
        o.push_str(&format!(
            "# HELP kvtier_l3_kv_events_{name} {help}\n# TYPE kvtier_l3_kv_events_{name} {kind}\n"
        ));
        for (label, s) in &stats {
            let v = read(s);
            o.push_str(&format!("kvtier_l3_kv_events_{name}{label} {v}\n"));
        }
    }
    o
}
