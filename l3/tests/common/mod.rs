//! Helpers shared by the integration tests that talk to a server or to store processes.

#![allow(dead_code)]

pub mod ha;
pub mod kv_events;
pub mod oracle;
pub mod procs;
pub mod raw;
pub mod shm;

use std::net::SocketAddr;

use kvtier_l3::master::DiskLoc;
use kvtier_l3::{ClientOptions, L3Store, PutOptions, RemoteStore, Tenant};

pub fn t(n: &str) -> Tenant {
    Tenant::new(n).unwrap()
}

pub fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 131 + j * 7) as u8).collect()
}

/// An embedded store of 16 MiB DRAM over an SSD tier in `dir`.
pub fn ssd_store_config(dir: &std::path::Path) -> kvtier_l3::StoreConfig {
    kvtier_l3::StoreConfig {
        local_segment_bytes: 16 << 20,
        ssd: Some(kvtier_l3::SsdConfig::new(dir)),
        ..Default::default()
    }
}

/// Writes bucket `id` holding `keys` (tenant "a", payload i for the i-th key) the way the
/// writer does, so a test controls which records share a bucket.
pub fn craft_bucket(dir: &std::path::Path, id: u64, keys: &[(&str, usize)]) {
    let data: Vec<Vec<u8>> = keys.iter().map(|(_, i)| payload(*i, 100)).collect();
    let recs: Vec<kvtier_l3::ssd::bucket::NewRecord<'_>> = keys
        .iter()
        .zip(&data)
        .map(|((k, _), d)| kvtier_l3::ssd::bucket::NewRecord {
            tenant: "a",
            key: k,
            data: d,
        })
        .collect();
    kvtier_l3::ssd::bucket::write_bucket(dir, id, &recs).unwrap();
}

/// A put that waits for the SSD copy.
pub fn persisted() -> PutOptions {
    PutOptions {
        wait_persisted: true,
        ..Default::default()
    }
}

pub fn client(addr: SocketAddr, token: Option<&str>) -> RemoteStore {
    RemoteStore::connect(
        addr,
        ClientOptions {
            token: token.map(str::to_string),
            ..Default::default()
        },
    )
    .unwrap()
}

/// The segments holding memory replicas of the key, sorted.
pub fn memory_segments(s: &dyn L3Store, tn: &Tenant, key: &str) -> Vec<kvtier_l3::SegmentId> {
    let mut v: Vec<kvtier_l3::SegmentId> = s
        .get_replica_list(tn, key)
        .unwrap()
        .replicas
        .iter()
        .filter_map(|r| match r {
            kvtier_l3::ReplicaDescriptor::Memory { segment, .. } => Some(*segment),
            _ => None,
        })
        .collect();
    v.sort();
    v
}

/// The SSD copy the master lists for a key, if any.
pub fn disk_of(c: &RemoteStore, tn: &Tenant, key: &str) -> Option<DiskLoc> {
    c.get_replica_list(tn, key)
        .ok()?
        .replicas
        .iter()
        .find_map(DiskLoc::from_descriptor)
}
