//! The shared-memory path to the store nodes of a split deployment (issue 23), with real
//! processes on 127.0.0.1 (a `--role master`, two `--role node`): a client on the nodes'
//! host reaches both through shared memory, agrees byte for byte and error for error with a
//! TCP-only client (1 and 2 replicas, a node SIGKILLed, then restarted with a new nonce on
//! the same address), and a client SIGKILLed mid-transfer leaves nothing behind at the
//! nodes or the master.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::procs::{eventually, kill9, master};
use common::shm::{mapped_memfds, status_kb};
use common::{payload, t};
use kvtier_l3::{
    DataPath, L3Error, L3Store, PutOptions, RemoteStore, ReplicateConfig, ShmMode, Tenant,
};

const CHILD_ENV: &str = "KVTIER_SHM_NODES_CHILD";

use common::shm::{shm_client as connect, shm_node as node};

fn paths(c: &RemoteStore) -> Vec<DataPath> {
    c.node_paths().into_iter().map(|(_, p)| p).collect()
}

/// Reads `keys` through `c` into buffers 3 bytes longer than each object (filled with
/// 0xEE); the per-key results, with each buffer checked against `data` (exact bytes,
/// nothing written past the object).
fn read_all(c: &RemoteStore, tn: &Tenant, keys: &[String], data: &[Vec<u8>]) -> String {
    let mut bufs: Vec<Vec<u8>> = data.iter().map(|d| vec![0xEE; d.len() + 3]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let got = c.batch_get_into(tn, keys, &mut slices).unwrap();
    for ((g, b), d) in got.iter().zip(&bufs).zip(data) {
        if g.is_ok() {
            assert_eq!(*g.as_ref().unwrap(), d.len() as u64);
            assert_eq!(&b[..d.len()], &d[..]);
            assert_eq!(&b[d.len()..], &[0xEE; 3], "nothing written past the object");
        }
    }
    format!("{got:?}")
}

fn put_all(c: &RemoteStore, tn: &Tenant, keys: &[String], data: &[Vec<u8>], replicas: u32) {
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let r = c
        .batch_put_from_with(
            tn,
            keys,
            &refs,
            PutOptions::default(),
            ReplicateConfig::replicas(replicas),
        )
        .unwrap();
    assert!(r.iter().all(Result::is_ok), "{r:?}");
}

#[test]
fn a_client_reaches_both_nodes_through_shm_and_agrees_with_tcp() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let m = master(&["--client-ttl-ms", "1000"], None);
    let mut n1 = node(&m, 1, &[]);
    let n2 = node(&m, 2, &[]);
    // A 1 MiB staging segment: the 4 MiB objects go over TCP, batches in several requests.
    let shm = connect(m.addr, ShmMode::Auto, 1 << 20);
    let tcp = connect(m.addr, ShmMode::Off, 1 << 20);
    assert!(shm.uses_shm() && !tcp.uses_shm());
    assert_eq!(paths(&shm), [DataPath::SharedMemory; 2]);
    // Each node maps the shm client's staging segment, and nothing of the TCP client's.
    for n in [&n1, &n2] {
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", n.child.id())).unwrap();
        assert_eq!(mapped_memfds(n.child.id()), 1, "node {}: {maps}", n.addr);
    }

    let tn = t("nodes");
    let sizes = [1usize, 4095, 200 << 10, 4 << 20, 333_333];
    let mut keys = Vec::new();
    let mut data = Vec::new();
    for r in 1..=2u32 {
        for (i, &n) in sizes.iter().enumerate() {
            keys.push(format!("r{r}-one-{i}"));
            data.push(payload(i + 10 * r as usize, n));
        }
        for i in 0..12 {
            keys.push(format!("r{r}-many-{i}"));
            data.push(payload(100 + i, 150 << 10));
        }
    }
    let per = keys.len() / 2;
    // 1 replica, then 2; the first half of each written over shm, the other over TCP.
    for (k, d, r) in [
        (&keys[..per], &data[..per], 1),
        (&keys[per..], &data[per..], 2),
    ] {
        let h = k.len() / 2;
        put_all(&shm, &tn, &k[..h], &d[..h], r);
        put_all(&tcp, &tn, &k[h..], &d[h..], r);
    }
    let a = read_all(&shm, &tn, &keys, &data);
    assert_eq!(a, read_all(&tcp, &tn, &keys, &data));
    assert_eq!(paths(&tcp), [DataPath::Tcp; 2]);
    assert!(!a.contains("Err"), "{a}");

    // Per-key errors are the same typed ones: a missing key, a buffer too small.
    let ks = ["r1-one-2".to_string(), "absent".to_string()];
    let mut outs = Vec::new();
    for c in [&shm, &tcp] {
        let (mut small, mut none) = ([0u8; 10], [0u8; 10]);
        let v = c
            .batch_get_into(&tn, &ks, &mut [&mut small[..], &mut none[..]])
            .unwrap();
        assert!(matches!(
            v[0],
            Err(L3Error::BufferOverflow { have: 10, .. })
        ));
        assert!(matches!(v[1], Err(L3Error::ObjectNotFound)));
        outs.push(format!("{v:?}"));
    }
    assert_eq!(outs[0], outs[1]);
    // Reads by query result, one-key calls and a two-phase put go through the nodes too.
    let q: Vec<_> = shm
        .batch_query(&tn, &keys[2..4])
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let (mut b1, mut b2) = (vec![0u8; 200 << 10], vec![0u8; 4 << 20]);
    let v = shm
        .batch_get_with_query(&tn, &q, &mut [&mut b1[..], &mut b2[..]])
        .unwrap();
    assert_eq!(*v[1].as_ref().unwrap(), 4 << 20);
    assert_eq!((b1, b2), (data[2].clone(), data[3].clone()));
    shm.put(&tn, "single", b"one key", PutOptions::default())
        .unwrap();
    assert_eq!(tcp.get(&tn, "single").unwrap(), b"one key");
    let h = shm.put_start(&tn, "phased", 5000).unwrap();
    shm.put_write(&h, &payload(9, 5000)).unwrap();
    shm.put_end(&h, PutOptions::default()).unwrap();
    assert_eq!(tcp.get(&tn, "phased").unwrap(), payload(9, 5000));
    assert_eq!(paths(&shm), [DataPath::SharedMemory; 2]);

    // Node 1 SIGKILLed: every key with a second replica reads from node 2, alike on both.
    let n1_addr = n1.addr;
    kill9(&mut n1.child);
    let a = read_all(&shm, &tn, &keys[per..], &data[per..]);
    assert_eq!(a, read_all(&tcp, &tn, &keys[per..], &data[per..]));
    assert!(!a.contains("Err"), "{a}");

    // Restarted on the same address (a new socket, a new nonce): the first call finds the
    // old connections dead (a put on them fails, as on TCP), then the shm client reaches
    // the node through shared memory again.
    let n1b = node(&m, 1, &["--listen", &n1_addr.to_string()]);
    assert_eq!(n1b.addr, n1_addr);
    let fresh: Vec<Vec<u8>> = (0..4).map(|i| payload(500 + i, 64 << 10)).collect();
    let mut round = 0;
    let back = eventually(Duration::from_secs(10), || {
        round += 1;
        let ks: Vec<String> = (0..4).map(|i| format!("fresh-{i}-{round}")).collect();
        let refs: Vec<&[u8]> = fresh.iter().map(Vec::as_slice).collect();
        let two = ReplicateConfig::replicas(2);
        let put = shm.batch_put_from_with(&tn, &ks, &refs, PutOptions::default(), two);
        put.is_ok_and(|v| v.iter().all(Result::is_ok))
            && read_all(&shm, &tn, &ks, &fresh) == read_all(&tcp, &tn, &ks, &fresh)
            && shm
                .node_paths()
                .contains(&(n1_addr, DataPath::SharedMemory))
    });
    assert!(back, "not back on shared memory: {:?}", shm.node_paths());
    assert_eq!(mapped_memfds(n1b.child.id()), 1);
}

/// The client process of [`a_client_killed_mid_transfer_leaks_nothing`]: puts (2 replicas)
/// and reads 4 MiB objects through both nodes' shared memory until it is killed.
#[test]
fn child_cluster_client() {
    let Ok(addr) = std::env::var(CHILD_ENV) else {
        return;
    };
    let c = connect(addr.parse().unwrap(), ShmMode::Auto, 16 << 20);
    assert_eq!(paths(&c), [DataPath::SharedMemory; 2]);
    let tn = t("killed");
    let obj = payload(1, 4 << 20);
    let mut buf = vec![0u8; obj.len()];
    let mut i = 0u64;
    loop {
        let k = format!("k{}", i % 8);
        let _ = c.remove(&tn, &k, true);
        let _ = c.put_with(
            &tn,
            &k,
            &obj,
            PutOptions::default(),
            ReplicateConfig::replicas(2),
        );
        let _ = c.get_into(&tn, &k, &mut buf);
        if i == 2 {
            println!("KVTIER-CHILD READY");
        }
        i += 1;
    }
}

#[test]
fn a_client_killed_mid_transfer_leaks_nothing() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let fast = ["--lease-ms", "200", "--put-timeout-ms", "500"];
    let m = master(&fast, None);
    // a node takes the put timeout; the lease is the master's (a node refuses --lease-ms)
    let nodes = [node(&m, 1, &fast[2..]), node(&m, 2, &fast[2..])];
    let pids: Vec<u32> = nodes.iter().map(|n| n.child.id()).collect();
    let watcher = connect(m.addr, ShmMode::Off, 1 << 20);
    std::thread::sleep(Duration::from_millis(200));
    let base: Vec<u64> = pids.iter().map(|&p| status_kb(p, "RssShmem:")).collect();
    for round in 0..3u64 {
        let mut kid: Child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_cluster_client",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD_ENV, m.addr.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let ready = BufReader::new(kid.stdout.take().unwrap())
            .lines()
            .map_while(Result::ok)
            .any(|l| l.contains("KVTIER-CHILD READY"));
        assert!(ready, "round {round}: the client did not start");
        for &p in &pids {
            assert_eq!(
                mapped_memfds(p),
                1,
                "round {round}: node {p} maps the staging"
            );
        }
        std::thread::sleep(Duration::from_millis(30 + 40 * round));
        kill9(&mut kid); // mid-transfer
        for &p in &pids {
            assert!(
                eventually(Duration::from_secs(5), || mapped_memfds(p) == 0),
                "round {round}: node {p} still maps the dead client's segment"
            );
        }
    }
    // The segments' pages leave the nodes' resident sets. Waited for, not read once: the
    // kernel drops a VMA from `/proc/<pid>/maps` before it has zapped the VMA's pages and
    // updated the RSS counters (CI read 4096 kB right after the maps line was gone).
    for (&p, &b) in pids.iter().zip(&base) {
        let freed = eventually(Duration::from_secs(5), || {
            status_kb(p, "RssShmem:") <= b + 1024
        });
        let now = status_kb(p, "RssShmem:");
        assert!(freed, "node {p}: RssShmem {now} kB vs {b} kB");
    }
    // No lease left held and no put left pending at the master once the lease and the put
    // timeout (500 ms) passed: every key is removed without force, and each can be put
    // again (a put the client started and never ended is revoked, not kept forever).
    let tn = t("killed");
    let clean = eventually(Duration::from_secs(10), || {
        watcher.remove_all(&tn, false).is_ok() && watcher.stats().is_ok_and(|s| s.objects == 0)
    });
    assert!(clean, "{:?}", watcher.stats());
    for i in 0..8 {
        let k = format!("k{i}");
        let put = eventually(Duration::from_secs(5), || {
            watcher
                .put(&tn, &k, b"again", PutOptions::default())
                .is_ok()
        });
        assert!(
            put,
            "{k}: {:?}",
            watcher.put(&tn, &k, b"again", PutOptions::default())
        );
        assert_eq!(watcher.get(&tn, &k).unwrap(), b"again");
    }
}

#[test]
fn off_switches_keep_clients_of_a_node_on_tcp() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let m = master(&[], None);
    let n = node(&m, 1, &["--no-shm"]);
    let mut x = kvtier_l3::rpc::xfer::XferClient::connect(
        n.addr,
        None,
        1 << 20,
        std::time::Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(x.shm_offer().unwrap(), None, "--no-shm: no offer");
    let c = connect(m.addr, ShmMode::Auto, 1 << 20);
    assert!(!c.uses_shm());
    assert_eq!(paths(&c), [DataPath::Tcp]);
    let tn = t("off");
    c.put(&tn, "k", b"over tcp", PutOptions::default()).unwrap();
    assert_eq!(c.get(&tn, "k").unwrap(), b"over tcp");
    assert_eq!(mapped_memfds(n.child.id()), 0);
}
