//! A store node's mount cancels every SSD write announced before it (issue 19), on the real
//! SSD tier over real files: a write still queued is written dead, a record published but
//! not registered is tombstoned (a rescan never finds it), and the unconfirmed records the
//! mount re-registers are kept.
//!
//! Why: the master a node mounts with may be a restarted one that never heard of those
//! versions; registered later, such a record was adopted for a key whose newer version or
//! whose remove the master could not remember after a further restart.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::Duration;

use kvtier_l3::master::DiskLoc;
use kvtier_l3::ssd::tier::{OffloadJob, SsdTier, TierHooks};
use kvtier_l3::ssd::{Registration, Unconfirmed};
use kvtier_l3::{SsdConfig, Tenant};
use parking_lot::Mutex;

/// Hooks whose `register` tells the test what was published, then waits for its answer.
struct Hooks {
    published: Mutex<SyncSender<Vec<(String, DiskLoc)>>>,
    answer: Mutex<Receiver<Registration>>,
}

impl TierHooks for Hooks {
    fn register(&self, items: &[(&OffloadJob, DiskLoc)]) -> Vec<Registration> {
        let v = items.iter().map(|(j, l)| (j.key.clone(), *l)).collect();
        self.published.lock().send(v).unwrap();
        let a = self.answer.lock().recv().unwrap();
        vec![a; items.len()]
    }
    fn write_failed(&self, _jobs: &[OffloadJob]) {}
    fn evict_disk(&self, _recs: &[(Tenant, String, DiskLoc)]) -> bool {
        false
    }
}

fn tn() -> Tenant {
    Tenant::new("a").unwrap()
}

fn job(key: &str, token: u64) -> OffloadJob {
    OffloadJob {
        tenant: tn(),
        key: key.into(),
        token,
        data: Arc::from(vec![token as u8; 4096]),
        staged: false,
        done: None,
    }
}

/// What was published, per `register` call.
type Published = Receiver<Vec<(String, DiskLoc)>>;

fn tier(dir: &std::path::Path) -> (SsdTier, Published, SyncSender<Registration>) {
    let mut cfg = SsdConfig::new(dir);
    cfg.bucket_keys_limit = 1;
    let (tier, _) = SsdTier::open(cfg).unwrap();
    let (ptx, prx) = sync_channel(16);
    let (atx, arx) = sync_channel(16);
    tier.start(Arc::new(Hooks {
        published: Mutex::new(ptx),
        answer: Mutex::new(arx),
    }))
    .unwrap();
    (tier, prx, atx)
}

fn live_keys(dir: &std::path::Path) -> Vec<String> {
    let (t, recs) = SsdTier::open(SsdConfig::new(dir)).unwrap();
    drop(t);
    let mut v: Vec<String> = recs.into_iter().map(|(_, k, _)| k).collect();
    v.sort();
    v
}

#[test]
fn a_mount_kills_the_writes_announced_before_it_but_keeps_the_unconfirmed_it_rescans() {
    let dir = tempfile::tempdir().unwrap();
    let (tier, published, answer) = tier(dir.path());

    // `kept`: written, its registration unanswered (unconfirmed), taken by the mount.
    tier.announce(&tn(), "kept", 1);
    tier.enqueue(job("kept", 1), true).unwrap();
    let kept_loc = published.recv_timeout(Duration::from_secs(10)).unwrap()[0].1;
    answer.send(Registration::Unconfirmed).unwrap();
    tier.flush();
    let taken = tier.take_unconfirmed();
    assert_eq!(
        taken,
        vec![Unconfirmed {
            tenant: tn(),
            key: "kept".into(),
            token: 1,
            loc: kept_loc,
            staged: false
        }]
    );

    // `published`: its bucket is on disk, its registration still in flight.
    tier.announce(&tn(), "published", 2);
    tier.enqueue(job("published", 2), true).unwrap();
    published.recv_timeout(Duration::from_secs(10)).unwrap();
    // `queued`: behind it in the writer's queue.
    tier.announce(&tn(), "queued", 3);
    tier.enqueue(job("queued", 3), true).unwrap();

    tier.cancel_before_mount(&taken).unwrap();
    // The master never heard of `published`'s version: it refuses it.
    answer.send(Registration::Refused).unwrap();
    // `queued` is written dead: nothing is published for it, nothing registered.
    assert!(
        published.recv_timeout(Duration::from_millis(500)).is_err(),
        "a cancelled write was published live"
    );
    tier.flush();
    tier.shutdown();
    drop(tier);
    assert_eq!(live_keys(dir.path()), vec!["kept".to_string()]);
}

#[test]
fn a_cancelled_record_stays_dead_even_if_its_registration_goes_unanswered() {
    let dir = tempfile::tempdir().unwrap();
    let (tier, published, answer) = tier(dir.path());
    tier.announce(&tn(), "k", 7);
    tier.enqueue(job("k", 7), true).unwrap();
    published.recv_timeout(Duration::from_secs(10)).unwrap();
    tier.cancel_before_mount(&[]).unwrap();
    // Unanswered: the record would be kept live for a later rescan, were it not dead.
    answer.send(Registration::Unconfirmed).unwrap();
    tier.flush();
    assert!(
        tier.unconfirmed().is_empty(),
        "a cancelled record is re-registered"
    );
    tier.shutdown();
    drop(tier);
    assert!(live_keys(dir.path()).is_empty());
}
