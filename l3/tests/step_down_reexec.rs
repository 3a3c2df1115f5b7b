//! A leader that steps down re-executes itself as a candidate (docs/l3/ha.md, "Step-down"). It
//! found itself through `/proc/self/exe`, which no longer resolves once the binary on disk
//! was replaced (an upgrade, `cp` + `mv`, a rebuild: a new inode): the re-exec failed with
//! ENOENT and the process aborted, leaving the cluster for good. Real etcd, real processes,
//! a real SIGSTOP past the leader's lease.

mod common;

use std::time::{Duration, Instant};

use common::ha::{free_addr, leader, signal, spawn_master_exe};
use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::{ClientOptions, RemoteStore};

#[test]
fn a_deposed_leader_rejoins_after_its_binary_was_replaced_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("kvtier-l3");
    std::fs::copy(env!("CARGO_BIN_EXE_kvtier-l3"), &exe).unwrap();
    let etcd = LocalEtcd::start(1).unwrap();
    let mut masters = vec![spawn_master_exe(&exe, &etcd, free_addr(), 1, &[], None)];
    let (laddr, epoch) = leader(&etcd, Duration::from_secs(20)).expect("a leader");
    masters.push(spawn_master_exe(&exe, &etcd, free_addr(), 1, &[], None));
    // the upgrade: a new file renamed over the old path
    let new = dir.path().join("kvtier-l3.new");
    std::fs::copy(env!("CARGO_BIN_EXE_kvtier-l3"), &new).unwrap();
    std::fs::rename(&new, &exe).unwrap();
    // the leader loses its lease while paused, and steps down when it resumes
    signal(&masters[0].child, libc::SIGSTOP);
    let end = Instant::now() + Duration::from_secs(30);
    let new_epoch = loop {
        if let Some((a, e)) = leader(&etcd, Duration::from_secs(1))
            && e > epoch
        {
            assert_ne!(a, laddr);
            break e;
        }
        assert!(Instant::now() < end, "no new leader");
        std::thread::sleep(Duration::from_millis(50));
    };
    signal(&masters[0].child, libc::SIGCONT);
    // back as a standby on its address, redirecting to the new leader
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        assert_eq!(
            masters[0].child.try_wait().unwrap(),
            None,
            "the deposed leader died instead of re-executing itself"
        );
        let direct = RemoteStore::connect(
            laddr,
            ClientOptions {
                rpc_timeout: Duration::from_secs(2),
                ..Default::default()
            },
        );
        if let Ok(d) = direct
            && d.epoch() == new_epoch
        {
            assert_ne!(d.master_addr(), laddr);
            break;
        }
        assert!(Instant::now() < end, "the deposed leader does not redirect");
        std::thread::sleep(Duration::from_millis(200));
    }
}
