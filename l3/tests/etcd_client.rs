//! The blocking etcd client (`kvtier_l3::ha::Etcd`, on the `etcd-client` crate) against a
//! real 3-member etcd on 127.0.0.1: every call the HA layer makes round-trips; a SIGSTOPped
//! or SIGKILLed member costs at most one deadline before another member answers, and a
//! client of the paused member alone gets a typed error at its deadline instead of hanging
//! (Mooncake's master hung on a paused etcd leader); calls work from inside a tokio runtime
//! (the tarpc server's worker threads, where `block_on` would panic).

use std::time::{Duration, Instant};

use kvtier_l3::L3Error;
use kvtier_l3::ha::Etcd;
use kvtier_l3::ha::etcd::{Compare, Op, prefix_end};
use kvtier_l3::ha::local_etcd::LocalEtcd;

const DEADLINE: Duration = Duration::from_millis(400);
/// Scheduling slack on a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(1500);

fn members(etcd: &LocalEtcd) -> Vec<String> {
    etcd.endpoints().split(',').map(str::to_string).collect()
}

/// A client whose endpoint list starts with member `first` (tried first).
fn client_first(etcd: &LocalEtcd, first: usize) -> Etcd {
    let mut m = members(etcd);
    m.rotate_left(first);
    Etcd::parse(&m.join(","), DEADLINE).unwrap()
}

/// A member that is not etcd's raft leader (pausing it leaves a quorum with a leader).
fn follower(etcd: &LocalEtcd) -> usize {
    (etcd.wait_leader(Duration::from_secs(10)).unwrap() + 1) % 3
}

#[test]
fn every_call_round_trips() {
    let etcd = LocalEtcd::start(3).unwrap();
    let c = etcd.client().unwrap();
    assert_eq!(c.get(b"/t/none").unwrap(), None);
    c.put(b"/t/a", b"1").unwrap();
    c.put(b"/t/b", b"2").unwrap();
    c.put(b"/u", b"3").unwrap();
    let a = c.get(b"/t/a").unwrap().unwrap();
    assert_eq!(
        (a.key.as_slice(), a.value.as_slice()),
        (&b"/t/a"[..], &b"1"[..])
    );
    assert!(a.create_revision > 0 && a.mod_revision >= a.create_revision);
    let (kvs, rev) = c.get_prefix(b"/t/").unwrap();
    let keys: Vec<&[u8]> = kvs.iter().map(|k| k.key.as_slice()).collect();
    assert_eq!(keys, [&b"/t/a"[..], b"/t/b"]);
    assert!(rev >= kvs[1].mod_revision);

    // Create-if-absent under a lease; on failure the current value comes back.
    let lease = c.grant(5).unwrap();
    let put = |v: &[u8]| Op::Put {
        key: b"/t/leader".to_vec(),
        value: v.to_vec(),
        lease,
    };
    let absent = [Compare::CreateRevision(b"/t/leader".to_vec(), 0)];
    let (won, rev1, _) = c.txn(&absent, &[put(b"me")], Some(b"/t/leader")).unwrap();
    assert!(won);
    let (won, _, cur) = c.txn(&absent, &[put(b"you")], Some(b"/t/leader")).unwrap();
    assert!(!won);
    let cur = cur.unwrap();
    assert_eq!(
        (cur.value.as_slice(), cur.create_revision),
        (&b"me"[..], rev1)
    );
    assert!(c.keep_alive(lease).unwrap() > 0);

    // A fenced delete of a range.
    let fence = [Compare::CreateRevision(b"/t/leader".to_vec(), rev1)];
    let del = Op::DeleteRange {
        from: b"/t/a".to_vec(),
        to: prefix_end(b"/t/b"),
    };
    let (ok, _, _) = c.txn(&fence, &[del], None).unwrap();
    assert!(ok);
    let (kvs, _) = c.get_prefix(b"/t/").unwrap();
    assert_eq!(kvs.len(), 1, "only the leader key is left");

    // Revoking takes the leased key with it; a keep-alive then says the lease is gone.
    c.revoke(lease).unwrap();
    assert_eq!(c.get(b"/t/leader").unwrap(), None);
    assert_eq!(c.keep_alive(lease).unwrap(), 0);
    assert!(
        c.revoke(lease).is_err(),
        "revoking an unknown lease is an error"
    );

    let (_, rev) = c.get_prefix(b"/").unwrap();
    c.compact(rev).unwrap();
    let (id, leader) = c.status().unwrap();
    assert!(id != 0 && leader != 0);
}

#[test]
fn a_paused_member_costs_one_deadline_and_never_hangs_a_call() {
    let etcd = LocalEtcd::start(3).unwrap();
    let paused = follower(&etcd);
    let alone = Etcd::parse(&members(&etcd)[paused], DEADLINE).unwrap();
    // The precondition: a client whose preferred member is the one paused next. On a loaded
    // machine a fresh member's first answer can outlast DEADLINE, and the client then prefers
    // the member that answered (as it should): such a client is made again.
    let id = alone.status().unwrap().0;
    let c = (0..10)
        .find_map(|_| {
            let c = client_first(&etcd, paused);
            c.put(b"/p/k", b"v").ok()?;
            (c.status().ok()?.0 == id).then_some(c)
        })
        .expect("a client that prefers the member to pause");
    alone.get(b"/p/k").unwrap().unwrap();
    etcd.pause(paused);

    // The paused member is tried first: one deadline, then another member answers.
    let t0 = Instant::now();
    assert_eq!(c.get(b"/p/k").unwrap().unwrap().value, b"v");
    let took = t0.elapsed();
    assert!(
        took >= DEADLINE,
        "the paused member was not tried first: {took:?}"
    );
    assert!(took < DEADLINE + SLACK, "get took {took:?}");
    // The member that answered is now preferred: no deadline spent.
    let t0 = Instant::now();
    c.put(b"/p/k", b"w").unwrap();
    assert!(t0.elapsed() < SLACK, "second call took {:?}", t0.elapsed());

    // The paused member alone: a typed error at the deadline, for every kind of call.
    for (what, r) in [
        ("get", alone.get(b"/p/k").map(|_| ())),
        ("txn", alone.txn(&[], &[], None).map(|_| ())),
        ("keep_alive", alone.keep_alive(1).map(|_| ())),
        ("grant", alone.grant(5).map(|_| ())),
    ] {
        assert!(matches!(r, Err(L3Error::Unavailable(_))), "{what}: {r:?}");
    }
    let t0 = Instant::now();
    assert!(alone.status().is_err());
    assert!(t0.elapsed() < DEADLINE + SLACK, "took {:?}", t0.elapsed());

    // Resumed, it answers again (a linearizable read: the write made while it slept).
    etcd.resume(paused);
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        match alone.get(b"/p/k") {
            Ok(Some(kv)) => {
                assert_eq!(kv.value, b"w");
                break;
            }
            r => assert!(Instant::now() < end, "resumed member: {r:?}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_killed_member_costs_at_most_one_deadline() {
    let mut etcd = LocalEtcd::start(3).unwrap();
    let dead = follower(&etcd);
    let c = client_first(&etcd, dead);
    c.put(b"/k/k", b"v").unwrap();
    etcd.kill(dead);
    let t0 = Instant::now();
    assert_eq!(c.get(b"/k/k").unwrap().unwrap().value, b"v");
    assert!(t0.elapsed() < DEADLINE + SLACK, "took {:?}", t0.elapsed());
    let gone = Etcd::parse(&members(&etcd)[dead], DEADLINE).unwrap();
    assert!(matches!(gone.get(b"/k/k"), Err(L3Error::Unavailable(_))));
}

#[test]
fn calls_work_from_inside_a_tokio_runtime() {
    let etcd = LocalEtcd::start(1).unwrap();
    let c = std::sync::Arc::new(etcd.client().unwrap());
    // A worker thread of a multi-thread runtime (the tarpc server's case).
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let c2 = c.clone();
    multi
        .block_on(async move { tokio::spawn(async move { c2.put(b"/r/k", b"m") }).await })
        .unwrap()
        .unwrap();
    // Inside a current-thread runtime's block_on.
    let single = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let got = single.block_on(async { c.get(b"/r/k") }).unwrap().unwrap();
    assert_eq!(got.value, b"m");
    // The last handle dropped on a runtime worker thread.
    multi
        .block_on(async move { tokio::spawn(async move { drop(c) }).await })
        .unwrap();
}
