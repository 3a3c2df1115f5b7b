//! Store nodes of a split deployment move objects between their DRAM and their SSD as the
//! single process does: DRAM evictions reach the node's SSD (write-through: the copy is
//! already there; offload-on-evict: the evicted bytes are written then), the evicted
//! objects read back with their bytes from the SSD, and `exist` with `prefetch_to_memory`
//! promotes SSD-only objects back into the node's DRAM, from where they are then served.
//!
//! Real `kvtier-l3 --role master` and `--role node` processes on 127.0.0.1 (ephemeral ports),
//! real bucket files in temp dirs.

use std::path::Path;
use std::time::Duration;

mod common;

use common::procs::{Proc, args, eventually, master, spawn};
use common::{client, payload, persisted, t};
use kvtier_l3::{ExistOptions, L3Store, PutOptions, RemoteStore, ReplicaDescriptor, Tenant};

const MIB: usize = 1 << 20;
/// The node's DRAM segment: 16 MiB; 40 objects of 1 MiB overflow it.
const OBJECTS: usize = 40;

fn node_with(m: &Proc, ssd: &Path, mode: &str) -> Proc {
    let mut a = args(&[
        "--role",
        "node",
        "--listen",
        "127.0.0.1:0",
        "--segment-bytes",
        "16777216",
        "--ping-ms",
        "50",
        "--node-id",
        "1",
        "--offload",
        mode,
    ]);
    a.extend(["--master".to_string(), m.addr.to_string()]);
    a.extend(["--ssd-dir".to_string(), ssd.display().to_string()]);
    spawn(&a, None)
}

/// (in DRAM, on SSD) as the master's replica list says.
fn where_is(c: &RemoteStore, tn: &Tenant, key: &str) -> (bool, bool) {
    let q = c.get_replica_list(tn, key).unwrap();
    let mem = q
        .replicas
        .iter()
        .any(|r| matches!(r, ReplicaDescriptor::Memory { .. }));
    let disk = q
        .replicas
        .iter()
        .any(|r| matches!(r, ReplicaDescriptor::Disk { .. }));
    (mem, disk)
}

fn keys() -> Vec<String> {
    (0..OBJECTS).map(|i| format!("obj-{i}")).collect()
}

fn fill(c: &RemoteStore, tn: &Tenant, opts: PutOptions) -> Vec<Vec<u8>> {
    let objs: Vec<Vec<u8>> = (0..OBJECTS).map(|i| payload(i, MIB)).collect();
    for (k, o) in keys().iter().zip(&objs) {
        c.put(tn, k, o, opts).unwrap();
    }
    objs
}

fn bucket_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "bkt"))
        })
        .count()
}

/// Every key reads back its own bytes.
fn all_read_back(c: &RemoteStore, tn: &Tenant, objs: &[Vec<u8>]) {
    let ks = keys();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; MIB]; OBJECTS];
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let got = c.batch_get_into(tn, &ks, &mut refs).unwrap();
    for (i, r) in got.iter().enumerate() {
        assert_eq!(r.as_ref().ok(), Some(&(MIB as u64)), "{}: {r:?}", ks[i]);
        assert!(bufs[i] == objs[i], "{}: other bytes came back", ks[i]);
    }
}

/// Frees DRAM (removing ten DRAM-resident keys), then promotes one SSD-only key with a
/// prefetching probe and checks it is then served from the node's DRAM.
fn promote_one(c: &RemoteStore, tn: &Tenant, objs: &[Vec<u8>]) {
    let ks = keys();
    let ssd_only: Vec<usize> = (0..OBJECTS)
        .filter(|&i| where_is(c, tn, &ks[i]) == (false, true))
        .collect();
    let in_mem: Vec<usize> = (0..OBJECTS)
        .filter(|&i| where_is(c, tn, &ks[i]).0)
        .collect();
    assert!(!ssd_only.is_empty() && in_mem.len() >= 10);
    for &i in &in_mem[..10] {
        c.remove(tn, &ks[i], true).unwrap();
    }
    let before = c.stats().unwrap();
    let target = ssd_only[0];
    let key = ks[target].clone();
    let hit = c
        .batch_exist_key(
            tn,
            std::slice::from_ref(&key),
            ExistOptions {
                prefetch_to_memory: true,
            },
        )
        .unwrap();
    assert!(matches!(hit[0], Ok(true)));
    assert!(
        eventually(Duration::from_secs(5), || where_is(c, tn, &key).0),
        "{key} was not promoted to the node's DRAM"
    );
    // The promoted copy comes first in the replica list (reads go there) and the SSD copy
    // stays registered.
    let q = c.get_replica_list(tn, &key).unwrap();
    assert!(
        matches!(q.replicas[0], ReplicaDescriptor::Memory { .. }),
        "{q:?}"
    );
    assert!(where_is(c, tn, &key).1);
    let after = c.stats().unwrap();
    assert_eq!(
        after.mem_objects,
        before.mem_objects + 1,
        "{before:?} {after:?}"
    );
    assert_eq!(c.get(tn, &key).unwrap(), objs[target]);
}

#[test]
fn write_through_node_reads_evicted_objects_from_ssd_and_promotes_them() {
    let dir = tempfile::tempdir().unwrap();
    let m = master(&[], None);
    let _n = node_with(&m, dir.path(), "write-through");
    let c = client(m.addr, None);
    let a = t("a");
    // Each put waits for its SSD copy: an object evicted while its write-through copy is
    // still queued is dropped, here as in the single process.
    let objs = fill(&c, &a, persisted());
    let s = c.stats().unwrap();
    assert_eq!(s.objects, OBJECTS as u64);
    assert!(s.mem_objects < OBJECTS as u64, "nothing was evicted: {s:?}");
    assert_eq!(s.disk_objects, OBJECTS as u64, "{s:?}");
    // The master counts the bytes its nodes hold on SSD (it reported 0 with 40 objects there).
    assert_eq!(s.disk_used_bytes, (OBJECTS * MIB) as u64, "{s:?}");
    assert!(bucket_files(dir.path()) > 0);
    all_read_back(&c, &a, &objs);
    promote_one(&c, &a, &objs);
}

#[test]
fn on_evict_node_writes_evicted_objects_to_ssd_and_promotes_them() {
    let dir = tempfile::tempdir().unwrap();
    let m = master(&[], None);
    let _n = node_with(&m, dir.path(), "on-evict");
    let c = client(m.addr, None);
    let a = t("a");
    // Below capacity nothing is written: this mode writes evictions only.
    c.put(&a, "small", &payload(99, 4096), PutOptions::default())
        .unwrap();
    c.flush().unwrap();
    assert_eq!(c.stats().unwrap().disk_objects, 0);
    assert_eq!(bucket_files(dir.path()), 0);
    c.remove(&a, "small", true).unwrap();

    let objs = fill(&c, &a, PutOptions::default());
    let ks = keys();
    // Every object is readable at every moment: in DRAM, staged on the node, or on SSD.
    all_read_back(&c, &a, &objs);
    // The node hears of its evictions on its next ping and writes them to its SSD.
    assert!(
        eventually(Duration::from_secs(10), || {
            let _ = c.flush();
            (0..OBJECTS).all(|i| {
                let (mem, disk) = where_is(&c, &a, &ks[i]);
                mem != disk
            })
        }),
        "evicted objects did not all reach the SSD"
    );
    let s = c.stats().unwrap();
    assert_eq!(s.objects, OBJECTS as u64);
    assert!(
        s.disk_objects > 0 && s.mem_objects < OBJECTS as u64,
        "{s:?}"
    );
    assert_eq!(s.disk_objects + s.mem_objects, OBJECTS as u64, "{s:?}");
    assert_eq!(s.disk_used_bytes, s.disk_objects * MIB as u64, "{s:?}");
    assert!(bucket_files(dir.path()) > 0);
    all_read_back(&c, &a, &objs);
    promote_one(&c, &a, &objs);
}
