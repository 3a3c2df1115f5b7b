//! Removes reach a store node's disk even when the node crashes before applying them: real
//! `kvtier-l3 --role master` and `--role node` processes on 127.0.0.1, a real SSD directory,
//! real SIGSTOP / SIGKILL of the node.
//!
//! The state is built, not raced for: the node's tombstone of one removed key is made to
//! fail (its bucket's tombstone sidecar is a directory, so the append fails like a dying
//! disk), the way a crash between hearing of the remove and making it durable would leave
//! it; another key is removed while the node is stopped and cannot ping at all. The node is
//! then SIGKILLed, the obstacle removed, and the node restarted on the same directory with
//! the same id: neither key may come back. (Before acknowledged settlement the master
//! forgot a tombstone once it had handed it to the node, and the first key came back.)

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

mod common;

use common::procs::{Proc, eventually, master, node};
use common::{client, disk_of, payload, persisted, t};
use kvtier_l3::{L3Error, L3Store};

const LEN: usize = 64 << 10;

fn signal(p: &Proc, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &p.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} failed");
}

fn tomb_path(dir: &Path, bucket: u64) -> std::path::PathBuf {
    dir.join(format!("{bucket:020}.tomb"))
}

#[test]
fn keys_removed_while_the_node_cannot_apply_stay_removed_after_its_restart() {
    let dir = tempfile::tempdir().unwrap();
    let m = master(&[], None);
    let mut n = node(m.addr, 1, Some(dir.path()), None);
    let c = client(m.addr, None);
    let a = t("a");
    // Persisted batches until one bucket holds two records (the writer batches what is
    // queued together; usually the first batch does): removing one of them then appends to
    // the bucket's tombstone sidecar instead of deleting the bucket.
    let mut objs: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut shared: Option<(u64, Vec<String>)> = None;
    for round in 0..20 {
        let keys: Vec<String> = (0..8).map(|i| format!("r{round}-{i}")).collect();
        let data: Vec<Vec<u8>> = (0..8).map(|i| payload(round * 8 + i, LEN)).collect();
        let bufs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
        let r = c.batch_put_from(&a, &keys, &bufs, persisted()).unwrap();
        assert!(r.iter().all(|x| x.is_ok()), "{r:?}");
        let mut by_bucket: BTreeMap<u64, Vec<String>> = BTreeMap::new();
        for (k, d) in keys.iter().zip(data) {
            let loc = disk_of(&c, &a, k).expect("persisted put has an SSD copy");
            by_bucket.entry(loc.bucket).or_default().push(k.clone());
            objs.insert(k.clone(), d);
        }
        shared = by_bucket.into_iter().find(|(_, ks)| ks.len() >= 2);
        if shared.is_some() {
            break;
        }
    }
    let (bucket, in_bucket) = shared.expect("no bucket ever held two records");
    let victim = in_bucket[0].clone();
    let survivor = in_bucket[1].clone();
    let during_stop = objs.keys().find(|k| !in_bucket.contains(k)).cloned();

    // 1. The node hears of the remove on its pings but cannot make the tombstone durable.
    std::fs::create_dir(tomb_path(dir.path(), bucket)).unwrap();
    c.remove(&a, &victim, true).unwrap();
    // A few ping periods (100 ms): it has been handed over by now (and failed each time).
    std::thread::sleep(Duration::from_millis(600));

    // 2. Another key is removed while the node is stopped: it cannot even ping.
    signal(&n, "-STOP");
    if let Some(k) = &during_stop {
        c.remove(&a, k, true).unwrap();
    }

    // 3. Crash, the obstacle goes (as after a crash before the tombstone was written),
    //    restart on the same directory with the same id.
    signal(&n, "-KILL");
    n.child.wait().unwrap();
    std::fs::remove_dir(tomb_path(dir.path(), bucket)).unwrap();
    drop(n);
    n = node(m.addr, 1, Some(dir.path()), None);

    for k in std::iter::once(&victim).chain(during_stop.as_ref()) {
        assert!(
            matches!(c.get(&a, k), Err(L3Error::ObjectNotFound)),
            "{k} was removed at the master but came back after the node restarted"
        );
        assert!(!c.is_exist(&a, k).unwrap(), "{k} exists again");
    }
    // The rest of the node's SSD copies are back, with their bytes.
    assert_eq!(c.get(&a, &survivor).unwrap(), objs[&survivor]);
    for (k, d) in &objs {
        if *k != victim && Some(k) != during_stop.as_ref() {
            assert_eq!(&c.get(&a, k).unwrap(), d, "{k}");
        }
    }
    // The refused record is tombstoned durably on the node now.
    let tomb = tomb_path(dir.path(), bucket);
    assert!(
        eventually(Duration::from_secs(5), || std::fs::metadata(&tomb)
            .is_ok_and(|m| m.is_file() && m.len() >= 8)),
        "no tombstone written for {victim}"
    );
    // And a second restart (settles acknowledged meanwhile) keeps it removed; the key can
    // be put again and reads its new bytes.
    std::thread::sleep(Duration::from_millis(300));
    signal(&n, "-KILL");
    n.child.wait().unwrap();
    drop(n);
    let _n = node(m.addr, 1, Some(dir.path()), None);
    assert!(matches!(c.get(&a, &victim), Err(L3Error::ObjectNotFound)));
    let fresh = payload(999, LEN);
    c.put(&a, &victim, &fresh, persisted()).unwrap();
    assert_eq!(c.get(&a, &victim).unwrap(), fresh);
}
