//! The scheduler's counters reach whatever `metrics` recorder the engine installs.

mod common;
use common::*;
use kvtier_scheduler::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

#[test]
fn counters_are_recorded_through_the_metrics_facade() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let stats = metrics::with_local_recorder(&recorder, || {
        let c = cfg();
        let mut s = Scheduler::new(c.clone()).unwrap();
        let mut e = Engine::new(&c);
        e.submit(&mut s, 1, prompt(1, 30), 3);
        e.run_to_idle(&mut s, 100);
        e.submit(&mut s, 2, prompt(1, 30), 3);
        e.run_to_idle(&mut s, 100);
        s.stats()
    });
    let snap = snapshotter.snapshot().into_vec();
    let counter = |name: &str, label: Option<(&str, &str)>| -> u64 {
        snap.iter()
            .filter(|(k, _, _, _)| {
                let key = k.key();
                key.name() == name
                    && label
                        .is_none_or(|(l, v)| key.labels().any(|x| x.key() == l && x.value() == v))
            })
            .map(|(_, _, _, v)| match v {
                DebugValue::Counter(c) => *c,
                _ => 0,
            })
            .sum()
    };
    assert_eq!(counter("kvtier_requests_submitted_total", None), 2);
    assert_eq!(
        counter("kvtier_requests_ended_total", Some(("outcome", "finished"))),
        stats.finished
    );
    assert_eq!(
        counter("kvtier_ops_issued_total", Some(("kind", "WriteBack"))),
        stats.op(OpKind::WriteBack).issued
    );
    assert_eq!(
        counter("kvtier_hit_pages_total", Some(("tier", "device"))),
        stats.device_hit_pages
    );
    assert!(stats.device_hit_pages > 0);
    assert!(
        snap.iter()
            .any(|(k, _, _, v)| k.key().name() == "kvtier_op_latency_ms"
                && matches!(v, DebugValue::Histogram(h) if !h.is_empty())),
        "op latencies are recorded as a histogram"
    );
}
