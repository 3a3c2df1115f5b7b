//! The settle log in etcd (`kvtier_l3::ha::settles`) against keys it did not write. A key
//! `settles/fffffffffffffffe` (garbage written into etcd) made the next sequence number wrap:
//! the leader wrote batch `ffff…ffff` and then overwrote `settles/0000…0000` onwards, the
//! earlier leaders' settles and node membership, silently. Bad keys are a typed error now,
//! like a corrupt batch (the master steps down with it), and a good log is appended after
//! its last batch, never over one. Real etcd on 127.0.0.1.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kvtier_l3::L3Error;
use kvtier_l3::ha::local_etcd::LocalEtcd;
use kvtier_l3::ha::settles::EtcdSettleLog;
use kvtier_l3::ha::{ClusterKeys, Etcd, campaign};

fn lease(etcd: &Arc<Etcd>, keys: &ClusterKeys) -> Arc<kvtier_l3::ha::LeaderLease> {
    campaign(
        etcd.clone(),
        keys.clone(),
        Duration::from_secs(5),
        &AtomicBool::new(false),
    )
    .unwrap()
    .expect("elected")
}

fn key(keys: &ClusterKeys, tail: &str) -> Vec<u8> {
    let mut k = keys.settles.clone();
    k.extend_from_slice(tail.as_bytes());
    k
}

#[test]
fn settle_keys_kvtier_did_not_write_are_refused_and_nothing_is_overwritten() {
    let local = LocalEtcd::start(1).unwrap();
    let etcd = Arc::new(Etcd::parse(&local.endpoints(), Duration::from_secs(2)).unwrap());
    // a log of three batches (empty batches decode to no entries)
    let keys = ClusterKeys::new("good").unwrap();
    for s in 0..3u64 {
        etcd.put(&key(&keys, &format!("{s:016x}")), b"").unwrap();
    }
    let (mut log, entries) = EtcdSettleLog::open(lease(&etcd, &keys)).unwrap();
    assert!(entries.is_empty());
    log.commit(&[], None).unwrap();
    let (kvs, _) = etcd.get_prefix(&keys.settles).unwrap();
    let names: Vec<String> = kvs
        .iter()
        .map(|kv| String::from_utf8_lossy(&kv.key[keys.settles.len()..]).into_owned())
        .collect();
    assert_eq!(
        names,
        (0..4u64).map(|s| format!("{s:016x}")).collect::<Vec<_>>()
    );
    // keys that are not a sequence number kvtier writes: each refuses the open
    for (i, bad) in [
        "fffffffffffffffe",
        "ffffffffffffffff",
        "zz",
        "1",
        "00000000000000000",
    ]
    .iter()
    .enumerate()
    {
        let keys = ClusterKeys::new(&format!("bad{i}")).unwrap();
        etcd.put(&key(&keys, "0000000000000000"), b"").unwrap();
        etcd.put(&key(&keys, bad), b"").unwrap();
        let got = EtcdSettleLog::open(lease(&etcd, &keys));
        assert!(
            matches!(&got, Err(L3Error::Internal(m)) if m.contains("settle")),
            "{bad}: {:?}",
            got.map(|_| ())
        );
        let (kvs, _) = etcd.get_prefix(&keys.settles).unwrap();
        assert_eq!(kvs.len(), 2, "{bad}: nothing written");
    }
}
