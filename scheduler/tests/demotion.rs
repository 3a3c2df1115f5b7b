//! `HostAdmission::OnDeviceEviction` (demotion), driven through the checking engine: finished
//! requests leave no host copy while device has room; device pressure writes the coldest
//! device-only leaves to host before it evicts them, so they come back as host hits; a failed
//! demotion frees its host pages; the config rejects demotion (fixed or learnt) without a
//! usable host tier.

mod common;
use common::*;
use kvtier_scheduler::*;

fn demoting(ahead_pages: u32) -> SchedulerConfig {
    SchedulerConfig {
        host_admission: HostAdmission::OnDeviceEviction { ahead_pages },
        ..cfg()
    }
}

#[test]
fn finished_requests_get_no_host_copy_while_device_has_room() {
    let c = demoting(8);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 30), 5);
    e.run_to_idle(&mut s, 100);
    let st = s.stats();
    assert_eq!(st.host.cached, 0, "no copy at finish: {st:?}");
    assert_eq!(st.op(OpKind::WriteBack).issued, 0);
    assert_eq!(st.demotions, 0);
    assert!(st.device.cached >= 8);
    assert_quiescent(&s);
}

#[test]
fn device_pressure_demotes_and_the_prefix_comes_back_from_host() {
    let c = demoting(16);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 40), 2);
    e.run_to_idle(&mut s, 100);
    assert_eq!(s.stats().host.cached, 0);
    // Other prompts fill device (64 pages): the first prefix is the coldest leaf.
    for i in 0..6 {
        e.submit(&mut s, 10 + i, prompt(100 + i as u32, 40), 2);
    }
    e.run_to_idle(&mut s, 300);
    let mid = s.stats();
    assert!(mid.demotions > 0, "{mid:?}");
    assert!(mid.host.cached > 0);
    // Exclusive: device + host hold more than device alone can.
    assert!(
        mid.device.cached + mid.host.cached > c.device_pages as usize,
        "{mid:?}"
    );
    e.submit(&mut s, 2, prompt(1, 40), 2);
    e.run_to_idle(&mut s, 100);
    let after = s.stats();
    assert!(after.host_hit_pages > mid.host_hit_pages, "{after:?}");
    assert!(after.op(OpKind::LoadBack).succeeded > mid.op(OpKind::LoadBack).succeeded);
    assert!(e.pages_checked > 0, "the engine checked the KV it read");
    assert_quiescent(&s);
}

#[test]
fn the_same_workload_without_demotion_keeps_less() {
    // Control for the test above: copies at finish make host a superset of device's cache.
    let c = cfg();
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    for i in 0..7 {
        e.submit(&mut s, 10 + i, prompt(100 + i as u32, 40), 2);
    }
    e.run_to_idle(&mut s, 300);
    let st = s.stats();
    assert_eq!(st.demotions, 0);
    assert!(st.host.cached >= st.device.cached, "{st:?}");
}

#[test]
fn failed_demotions_free_their_host_pages_and_lose_nothing_else() {
    let c = demoting(16);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.fail_every = Some((OpKind::WriteBack, 1));
    for i in 0..7 {
        e.submit(&mut s, 10 + i, prompt(100 + i as u32, 40), 2);
    }
    e.run_to_idle(&mut s, 300);
    let st = s.stats();
    assert!(st.demotions > 0, "{st:?}");
    assert_eq!(
        st.op(OpKind::WriteBack).failed,
        st.op(OpKind::WriteBack).issued
    );
    assert_eq!(st.host.cached, 0, "no failed copy joined the host tree");
    // Every request still finished with the right KV.
    assert_eq!(e.ended.len(), 7);
    assert!(e.ended.iter().all(|(_, o)| *o == Outcome::Finished));
    assert_quiescent(&s);
}

#[test]
fn demotion_config_errors() {
    for make in [demoting, learning] {
        let no_host = SchedulerConfig {
            host_enabled: false,
            host_pages: 0,
            ..make(4)
        };
        assert!(matches!(
            Scheduler::new(no_host),
            Err(ConfigError::DemotionWithoutHost(_))
        ));
        let write_back = SchedulerConfig {
            write_policy: WritePolicy::WriteBack,
            l3_enabled: true,
            ..make(4)
        };
        assert!(matches!(
            Scheduler::new(write_back),
            Err(ConfigError::DemotionWithWriteBack(_))
        ));
        for bad in [0, 65] {
            assert!(matches!(
                Scheduler::new(make(bad)),
                Err(ConfigError::DemotionAhead(a, 64)) if a.ahead_pages() == Some(bad)
            ));
        }
        // Each message names the admission the user chose (`adaptive:4` named
        // OnDeviceEviction before), so that the value to change can be found.
        let chosen = make(4).host_admission;
        let kind = chosen.to_string();
        let kind = kind.split(':').next().expect("a name");
        for bad in [
            SchedulerConfig {
                host_enabled: false,
                host_pages: 0,
                ..make(4)
            },
            SchedulerConfig {
                write_policy: WritePolicy::WriteBack,
                l3_enabled: true,
                ..make(4)
            },
            make(0),
        ] {
            let msg = Scheduler::new(bad).err().expect("refused").to_string();
            assert!(msg.contains(kind), "{msg:?} does not name {kind}");
        }
    }
    for (text, want) in [
        ("on-finish", Some(HostAdmission::OnFinish)),
        (
            "on-device-eviction:16",
            Some(HostAdmission::OnDeviceEviction { ahead_pages: 16 }),
        ),
        ("on-device-eviction", None),
        ("on-device-eviction:x", None),
        ("demote", None),
    ] {
        assert_eq!(text.parse::<HostAdmission>().ok(), want, "{text}");
        if let Some(h) = want {
            assert_eq!(h.to_string(), text);
        }
    }
}
