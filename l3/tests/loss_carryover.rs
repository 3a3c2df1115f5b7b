//! The loss journal across a master restart or an etcd failover, on the real `Master`: the
//! new master replays the journal from the durable settle log (what `--state-dir` and
//! `--etcd` both keep), so a reader's cursor stays valid and a loss recorded before the
//! restart is still named after it; a restart that cannot name its own losses (a member
//! came back without its memory, offloads on eviction, or was fenced) adds one `Unknown`
//! entry, an `overflowed` for readers before it. Also adoption rule 6: another node's SSD
//! record with the very bytes of a version adopted from DRAM becomes its SSD copy.
//!
//! Before the fix a new master started a journal of its own: every reader was told
//! `overflowed` and the named losses were gone (`l3-chaos --masters 2 --journal named
//! --loss-poll-ms 1000` counted them as unreported losses).

use std::net::SocketAddr;

use kvtier_l3::master::{DiskLoc, Master, MasterPolicy, RetainedObject, SettleLogEntry};
use kvtier_l3::{ClientId, LossCursor, SegmentId, StoreConfig, Tenant};

const SIZE: u64 = 100;

fn tn() -> Tenant {
    Tenant::new("a").unwrap()
}

fn policy() -> MasterPolicy {
    let cfg = StoreConfig {
        loss_journal_keys: 64,
        ..StoreConfig::default()
    };
    MasterPolicy::from_config(&cfg)
}

fn mount(m: &mut Master, n: u64) {
    let addr = SocketAddr::from(([127, 0, 0, 1], 9000 + n as u16));
    m.mount_node(ClientId(n), SegmentId(n), 1 << 20, addr, 0)
        .unwrap();
}

fn retained(key: &str, token: u64, crc: u32) -> RetainedObject {
    RetainedObject {
        tenant: tn(),
        key: key.into(),
        token,
        size: SIZE,
        crc,
        disk: None,
    }
}

/// A master with a durable log whose nodes 1 and 2 are members, holding "kept" (on node 1)
/// and "gone" (removed: a named loss); returns it, its log, and a reader's cursor taken
/// before the remove.
fn first_master() -> (Master, Vec<SettleLogEntry>, LossCursor) {
    let mut m = Master::new(policy());
    m.keep_settle_log();
    // The log as a master writes it: a snapshot when it opens, then every change.
    let mut log = m.settle_snapshot();
    mount(&mut m, 1);
    mount(&mut m, 2);
    assert!(
        m.adopt_all(
            ClientId(1),
            &[retained("kept", 5, 1), retained("gone", 6, 2)]
        )[0]
        .is_some()
    );
    let cursor = m.losses_since(&tn(), None).unwrap().next;
    m.remove(&tn(), "gone", true, 0).unwrap();
    log.extend(m.take_settle_log());
    (m, log, cursor)
}

/// The master a restart (or a new leader) opens on `log`, rebuilding until `deadline`.
fn restarted(log: &[SettleLogEntry], deadline: u64) -> Master {
    reopened(log, deadline).0
}

/// [`restarted`], with the snapshot it writes as its new log.
fn reopened(log: &[SettleLogEntry], deadline: u64) -> (Master, Vec<SettleLogEntry>) {
    let mut m = Master::new(policy());
    m.restore_settles(log.iter().cloned());
    m.keep_settle_log();
    let snap = m.settle_snapshot();
    m.begin_rebuild(deadline);
    (m, snap)
}

#[test]
fn members_that_kept_their_memory_lose_nothing_unnamed_and_the_journal_goes_on() {
    let (_, log, cursor) = first_master();
    let mut m = restarted(&log, 1_000);
    for n in [1, 2] {
        mount(&mut m, n);
        m.adopt_all(ClientId(n), &[retained("kept", 5, 1)]);
        m.node_ping(ClientId(n), 0, 0, 1);
    }
    m.serving().unwrap();
    let l = m.losses_since(&tn(), Some(cursor)).unwrap();
    assert!(!l.overflowed, "the journal was carried over: {l:?}");
    assert_eq!(l.keys, vec!["gone".to_string()]);
}

#[test]
fn a_member_back_without_its_memory_makes_the_restart_overflow_once() {
    let (_, log, cursor) = first_master();
    let (mut m, mut log2) = reopened(&log, 1_000);
    mount(&mut m, 1);
    m.adopt_all(ClientId(1), &[retained("kept", 5, 1)]);
    m.node_ping(ClientId(1), 0, 0, 1);
    let mid = m.losses_since(&tn(), Some(cursor)).unwrap();
    assert!(!mid.overflowed && mid.keys == vec!["gone".to_string()]);
    mount(&mut m, 2); // restarted: no DRAM replica reported
    m.node_ping(ClientId(2), 0, 0, 1);
    m.serving().unwrap();
    let l = m.losses_since(&tn(), Some(mid.next)).unwrap();
    assert!(l.overflowed, "node 2's lost memory cannot be named");
    assert!(!m.losses_since(&tn(), Some(l.next)).unwrap().overflowed);
    // What was logged replays to the same answers (the next failover).
    log2.extend(m.take_settle_log());
    let again = restarted(&log2, 1_000);
    assert_eq!(
        again.losses_since(&tn(), Some(cursor)).unwrap(),
        m.losses_since(&tn(), Some(cursor)).unwrap()
    );
}

#[test]
fn a_fenced_member_or_one_offloading_on_eviction_overflows_too() {
    let (_, log, cursor) = first_master();
    let mut m = restarted(&log, 1_000);
    mount(&mut m, 1);
    m.adopt_all(ClientId(1), &[retained("kept", 5, 1)]);
    m.node_ping(ClientId(1), 0, 0, 1);
    assert_eq!(m.rebuild_deadline(1_000), 1, "node 2 fenced");
    assert!(m.losses_since(&tn(), Some(cursor)).unwrap().overflowed);

    let mut m = restarted(&log, 1_000);
    for n in [1, 2] {
        mount(&mut m, n);
        m.set_node_offload(ClientId(n), n == 2);
        m.adopt_all(ClientId(n), &[retained("kept", 5, 1)]);
        m.node_ping(ClientId(n), 0, 0, 1);
    }
    assert!(
        m.losses_since(&tn(), Some(cursor)).unwrap().overflowed,
        "staged bytes dropped at the remount are not named"
    );
}

#[test]
fn another_nodes_ssd_record_with_the_adopted_bytes_becomes_the_ssd_copy() {
    let (_, log, _) = first_master();
    let mut m = restarted(&log, 1_000);
    mount(&mut m, 1);
    mount(&mut m, 2);
    m.adopt_all(ClientId(1), &[retained("kept", 5, 0xabcd)]);
    let rec = |crc| DiskLoc {
        bucket: 1,
        offset: 0,
        size: SIZE,
        crc,
    };
    assert!(
        !m.register_rescanned(ClientId(2), &tn(), "kept", rec(0x1234)),
        "other bytes: refused"
    );
    assert!(!m.on_disk(&tn(), "kept"));
    assert!(m.register_rescanned(ClientId(2), &tn(), "kept", rec(0xabcd)));
    assert!(m.on_disk(&tn(), "kept"));
    assert!(
        !m.register_rescanned(
            ClientId(2),
            &tn(),
            "kept",
            DiskLoc {
                bucket: 2,
                ..rec(0xabcd)
            }
        ),
        "one SSD copy per version"
    );
}

/// A newer version's SSD record, registered while a cancel of an older version of the key
/// was unacknowledged on that node, is accepted by the rescan after a restart (it used to be
/// refused — tombstoned — and a put acknowledged as persisted was lost: l3-chaos with etcd
/// masters); any other record of the key, or this one once its own version is cancelled, is
/// still refused.
#[test]
fn a_newer_versions_record_survives_an_older_versions_unacknowledged_cancel() {
    let log_of = |m: &mut Master, mut head: Vec<SettleLogEntry>| {
        head.extend(m.take_settle_log());
        head
    };
    let mut m = Master::new(policy());
    m.keep_settle_log();
    let head = m.settle_snapshot();
    mount(&mut m, 1);
    mount(&mut m, 2);
    assert!(m.adopt_all(ClientId(1), &[retained("k", 5, 1)])[0].is_some());
    // Version 7 replaces 5: node 1 is told to cancel version 5 (not acknowledged yet).
    assert!(m.adopt_all(ClientId(2), &[retained("k", 7, 2)])[0].is_some());
    assert_eq!(m.unsettled(ClientId(1)), 1);
    let rec = |bucket| DiskLoc {
        bucket,
        offset: 0,
        size: SIZE,
        crc: 2,
    };
    assert!(m.register_disk(ClientId(1), &tn(), "k", 7, rec(1)));
    let log = log_of(&mut m, head);

    let mut r = restarted(&log, 1_000);
    mount(&mut r, 1);
    assert!(
        !r.register_rescanned(ClientId(1), &tn(), "k", rec(2)),
        "another record of the key may be version 5's"
    );
    assert!(
        r.register_rescanned(ClientId(1), &tn(), "k", rec(1)),
        "version 7's record"
    );
    assert!(r.on_disk(&tn(), "k"));

    // Once version 7 itself is dropped (removed), its record is refused like any other.
    m.remove(&tn(), "k", true, 0).unwrap();
    let log = log_of(&mut m, log);
    let mut r = restarted(&log, 1_000);
    mount(&mut r, 1);
    assert!(!r.register_rescanned(ClientId(1), &tn(), "k", rec(1)));
}
