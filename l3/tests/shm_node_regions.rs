//! Shared regions (`RemoteStore::shared_region`, Mooncake's dummy-client pool) against a
//! split deployment, with real processes on 127.0.0.1 (a `--role master`, two `--role
//! node`). Before, a region could be registered with a `--role both` server only: against a
//! master it was -1010, so a dummy client's pool was heap memory and every byte went through
//! each node's staging segment (one copy more in the client, and objects bigger than half
//! the staging segment over TCP). Now a region is registered with every store node reached
//! through shared memory, also with a node reached (or restarted) after the region was
//! made, and buffers inside it move with no copy in the client.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::procs::{eventually, kill9, master};
use common::shm::status_kb;
use common::{payload, t};
use kvtier_l3::{
    DataPath, L3Error, L3Store, PutOptions, RemoteStore, ReplicateConfig, SharedRegion, ShmMode,
};

const MIB: usize = 1 << 20;

use common::shm::shm_node as node;

/// A client with a 1 MiB staging segment: a 4 MiB plain buffer cannot be staged (it goes
/// over TCP), one in a region goes through shared memory.
fn connect(addr: SocketAddr, shm: ShmMode) -> RemoteStore {
    common::shm::shm_client(addr, shm, MIB)
}

/// Lines of the process's maps naming a client region.
fn mapped_regions(pid: u32) -> usize {
    common::shm::mapped(pid, "kvtier-shm-region")
}

/// The region's bytes `[at, at + len)`.
#[allow(clippy::mut_from_ref)]
fn slice(r: &SharedRegion, at: usize, len: usize) -> &mut [u8] {
    assert!(at + len <= r.len());
    // SAFETY: in range (checked above); the test touches each part from one thread only.
    unsafe { std::slice::from_raw_parts_mut(r.as_ptr().add(at), len) }
}

#[test]
fn a_region_is_shared_with_every_node_and_its_buffers_move_in_place() {
    let m = master(&["--client-ttl-ms", "1000"], None);
    let mut n1 = node(&m, 1, &[]);
    let n2 = node(&m, 2, &[]);
    let c = connect(m.addr, ShmMode::Auto);
    let tcp = connect(m.addr, ShmMode::Off);
    let region = c.shared_region(32 * MIB).unwrap();
    assert_eq!(
        c.node_paths().iter().map(|p| p.1).collect::<Vec<_>>(),
        [DataPath::SharedMemory; 2]
    );
    for n in [&n1, &n2] {
        assert_eq!(mapped_regions(n.child.id()), 1, "node {}", n.addr);
    }
    // The TCP client has no region to give: the same typed error as before.
    assert!(matches!(
        tcp.shared_region(MIB),
        Err(L3Error::Unavailable(_))
    ));

    let tn = t("regions");
    let sizes = [4 * MIB, 1, 4095, 333_333, 2 * MIB];
    let keys: Vec<String> = (0..sizes.len()).map(|i| format!("k{i}")).collect();
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| payload(i + 1, n))
        .collect();
    let mut at = 0;
    let mut spans = Vec::new();
    for d in &data {
        slice(&region, at, d.len()).copy_from_slice(d);
        spans.push((at, d.len()));
        at += d.len().div_ceil(64) * 64;
    }
    let total: usize = sizes.iter().sum();
    let before: Vec<u64> = [&n1, &n2]
        .iter()
        .map(|n| status_kb(n.child.id(), "RssShmem:"))
        .collect();
    let bufs: Vec<&[u8]> = spans.iter().map(|&(a, n)| &*slice(&region, a, n)).collect();
    let r = c
        .batch_put_from_with(
            &tn,
            &keys,
            &bufs,
            PutOptions::default(),
            ReplicateConfig::replicas(2),
        )
        .unwrap();
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    // Each node read the objects out of the region itself: the region's pages are now in
    // its resident set (over TCP, or staged, they would not be).
    // (Waited for: the kernel's RSS counters may lag a little.)
    for (n, &b) in [&n1, &n2].iter().zip(&before) {
        let pid = n.child.id();
        let grew = || status_kb(pid, "RssShmem:").saturating_sub(b) as usize * 1024;
        assert!(
            eventually(Duration::from_secs(5), || grew() >= total - MIB),
            "node {}: {} bytes",
            n.addr,
            grew()
        );
    }
    // What a TCP client reads is what the region held.
    for (k, d) in keys.iter().zip(&data) {
        assert_eq!(&tcp.get(&tn, k).unwrap(), d, "{k}");
    }
    // Gets into the region (a second part of it): same bytes, same per-key errors as TCP.
    let base = 16 * MIB;
    let mut ks = keys.clone();
    ks.push("absent".into());
    let mut outs: Vec<&mut [u8]> = Vec::new();
    let mut off = base;
    for &n in sizes.iter().chain([10usize].iter()) {
        let s = slice(&region, off, n);
        s.fill(0xEE);
        outs.push(s);
        off += n.div_ceil(64) * 64;
    }
    let got = c.batch_get_into(&tn, &ks, &mut outs).unwrap();
    let mut plain: Vec<Vec<u8>> = sizes
        .iter()
        .chain([10usize].iter())
        .map(|&n| vec![0; n])
        .collect();
    let mut plain_refs: Vec<&mut [u8]> = plain.iter_mut().map(Vec::as_mut_slice).collect();
    let want = tcp.batch_get_into(&tn, &ks, &mut plain_refs).unwrap();
    assert_eq!(format!("{got:?}"), format!("{want:?}"));
    assert!(matches!(got[sizes.len()], Err(L3Error::ObjectNotFound)));
    for (o, d) in outs.iter().zip(&data) {
        assert_eq!(&o[..], &d[..]);
    }

    // Node 1 restarted on its address (new socket, new nonce): once the client is back on
    // shared memory, the region is registered with the new process too and puts from it
    // reach both nodes again.
    let n1_addr = n1.addr;
    kill9(&mut n1.child);
    let n1b = node(&m, 1, &["--listen", &n1_addr.to_string()]);
    let mut round = 0;
    let back = eventually(Duration::from_secs(10), || {
        round += 1;
        let ks = vec![format!("again-{round}")];
        let src: [&[u8]; 1] = [&*slice(&region, spans[0].0, spans[0].1)];
        let two = ReplicateConfig::replicas(2);
        c.batch_put_from_with(&tn, &ks, &src, PutOptions::default(), two)
            .is_ok_and(|v| v.iter().all(Result::is_ok))
            && c.node_paths().contains(&(n1_addr, DataPath::SharedMemory))
            && mapped_regions(n1b.child.id()) == 1
    });
    assert!(back, "region not shared with the restarted node");
    assert_eq!(&tcp.get(&tn, &format!("again-{round}")).unwrap(), &data[0]);

    // Dropped by its owner: each node unmaps it at the client's next call to that node
    // (two replicas: a call to each).
    drop(outs);
    drop(region);
    let two = ReplicateConfig::replicas(2);
    c.put_with(&tn, "after", b"x", PutOptions::default(), two)
        .unwrap();
    for n in [&n1b, &n2] {
        let pid = n.child.id();
        assert!(
            eventually(Duration::from_secs(5), || mapped_regions(pid) == 0),
            "node {} still maps a dropped region",
            n.addr
        );
    }
}

#[test]
fn a_region_made_before_a_node_is_reached_is_shared_with_it() {
    let m = master(&["--client-ttl-ms", "1000"], None);
    let c = connect(m.addr, ShmMode::Auto);
    // No node yet: the region is plain memory for now.
    let region = c.shared_region(8 * MIB).unwrap();
    let n = node(&m, 1, &[]);
    let d = payload(3, 3 * MIB);
    slice(&region, 0, d.len()).copy_from_slice(&d);
    let tn = t("late");
    let ok = eventually(Duration::from_secs(10), || {
        c.put(&tn, "k", slice(&region, 0, d.len()), PutOptions::default())
            .is_ok()
    });
    assert!(ok, "no put once the node mounted");
    assert_eq!(mapped_regions(n.child.id()), 1);
    assert_eq!(
        c.node_paths(),
        vec![(n.addr, DataPath::SharedMemory)],
        "reached through shared memory"
    );
    let out = slice(&region, 4 * MIB, d.len());
    assert_eq!(c.get_into(&tn, "k", out).unwrap(), d.len() as u64);
    assert_eq!(&out[..], &d[..]);
}
