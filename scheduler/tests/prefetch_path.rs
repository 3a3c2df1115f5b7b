//! The prefetch path: prefetched pages stay pinned until their request is admitted; a prefetch
//! asks only for keys its probe answered; write-through-selective counts requests, not match
//! attempts.

mod common;
use common::*;
use kvtier_scheduler::*;

fn l3_cfg() -> SchedulerConfig {
    SchedulerConfig {
        l3_enabled: true,
        prefetch_threshold: 1,
        prefetch_stop: PrefetchStopPolicy::WaitComplete,
        ..cfg()
    }
}

/// Runs `p` to completion on a fresh scheduler and returns its engine, whose L3 then holds
/// every page of `p`.
fn seeded(c: &SchedulerConfig, p: Vec<u32>) -> Engine {
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(c);
    e.submit(&mut s, 900, p, 1);
    e.run_to_idle(&mut s, 300);
    e
}

/// A's pages arrive from L3 while A cannot be admitted (R holds the device); R then finishes
/// and writes its pages back to host. A's prefetched pages must survive that host pressure.
#[test]
fn prefetched_pages_stay_pinned_until_admission() {
    let c = SchedulerConfig {
        device_pages: 16,
        host_pages: 16,
        max_context_tokens: 64,
        ..l3_cfg()
    };
    let pa = prompt(1, 41);
    let mut e = Engine::new(&c);
    e.l3 = seeded(&c, pa.clone()).l3;
    let mut s = Scheduler::new(c.clone()).unwrap();
    e.submit(&mut s, 1, prompt(2, 45), 8); // R: 12 prompt pages, grows to 13
    e.submit(&mut s, 2, pa, 2); // A: 10 usable pages, all in L3
    e.run_to_idle(&mut s, 400);
    assert_quiescent(&s);
    let st = s.stats();
    assert_eq!(st.op(OpKind::Prefetch).succeeded, 1);
    assert_eq!(
        st.l3_hit_pages, 10,
        "A used every page it prefetched: {st:?}"
    );
}
