//! `HostAdmission::Adaptive` (issue 25): the host admission learnt by the adaptive eviction
//! policy. It copies at finish until ghost hits say demotion would have kept more (here:
//! from the start); the config only takes it with the adaptive eviction policy (the host-tier and
//! read-ahead errors it shares with demotion are in `demotion.rs`); its spelling round-trips.
//! The switch to demotion is checked on the conversation trace, where it happens
//! (`sim/tests/cli_adaptive.rs`); the rule itself in `radix/src/adaptive.rs`'s unit test; the
//! random workloads of `props.rs` run the admission with their KV checks.

mod common;
use common::*;
use kvtier_radix::{EvictionPolicy, LearntAdmission};
use kvtier_scheduler::*;
use proptest::prelude::*;

#[test]
fn copies_at_finish_until_ghosts_say_demotion_pays() {
    let c = learning(8);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 30), 5);
    e.run_to_idle(&mut s, 100);
    let st = s.stats();
    let snap = s.cache().adaptive_snapshot().unwrap();
    assert_eq!(
        (snap.level, snap.admission),
        (0, LearntAdmission::CopyAtFinish)
    );
    assert!(st.host.cached > 0, "a copy at finish, as on-finish: {st:?}");
    assert_eq!(st.demotions, 0);
    assert_quiescent(&s);
}

#[test]
fn config_errors() {
    let fixed = SchedulerConfig {
        eviction: EvictionPolicy::Lru,
        ..learning(4)
    };
    assert!(matches!(
        Scheduler::new(fixed),
        Err(ConfigError::AdaptiveAdmissionWithoutAdaptiveEviction)
    ));
    for text in [
        "adaptive",
        "adaptive:",
        "adaptive:-1",
        "adaptive-x:4",
        "on-finish:4",
    ] {
        assert!(text.parse::<HostAdmission>().is_err(), "{text}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Every admission's spelling parses back to it.
    #[test]
    fn spelling_round_trips(ahead_pages in any::<u32>(), kind in 0u8..3) {
        let h = match kind {
            0 => HostAdmission::OnFinish,
            1 => HostAdmission::OnDeviceEviction { ahead_pages },
            _ => HostAdmission::Adaptive { ahead_pages },
        };
        prop_assert_eq!(h.to_string().parse::<HostAdmission>(), Ok(h));
    }
}
