//! A store node reuses the buffers of objects removed just before a put (issue 23's node
//! puts), without waiting for its next ping.
//!
//! A node copies each put into a buffer of its own and keeps freed buffers for the next put
//! of the same size, but the master frees allocations when a client removes objects, and a
//! node hears of that only at its next ping or put end. A client that removes a batch and
//! puts the next one at once (an engine cycling its KV pages; `l3-bench --only shm`) had
//! every put of the new batch fault in a fresh buffer. Now a large put that finds no freed
//! buffer of its size asks the master first (at most once per 10 ms). In process: a
//! `ClusterMaster` on 127.0.0.1 and one `StoreNode` whose periodic ping is a minute away.

use std::time::{Duration, Instant};

mod common;

use common::{payload, t};
use kvtier_l3::rpc::server::ServerOptions;
use kvtier_l3::{
    ClientId, ClientOptions, ClusterMaster, L3Store, NodeOptions, PutOptions, RemoteStore, ShmMode,
    StoreConfig, StoreNode, spawn_cluster_master,
};

const OBJ: usize = 2 << 20;

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

fn put(c: &RemoteStore, prefix: &str, n: usize, seed: usize) -> Vec<Vec<u8>> {
    let tn = t("recycle");
    let data: Vec<Vec<u8>> = (0..n).map(|i| payload(seed + i, OBJ)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let r = c
        .batch_put_from(&tn, &keys(prefix, n), &refs, PutOptions::default())
        .unwrap();
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    data
}

#[test]
fn puts_right_after_removes_reuse_the_removed_buffers() {
    let cm = ClusterMaster::new(StoreConfig {
        local_segment_bytes: 0,
        ..Default::default()
    })
    .unwrap();
    let master = spawn_cluster_master(cm, ServerOptions::default()).unwrap();
    let mut o = NodeOptions::new(ClientId(1), master.addr);
    o.segment_bytes = 256 << 20; // no eviction below: only removes free buffers
    o.ping_interval = Duration::from_secs(60);
    let node = StoreNode::start(o).unwrap();
    for (i, shm) in [ShmMode::Off, ShmMode::Auto].into_iter().enumerate() {
        let (a, b) = (format!("a{i}-"), format!("b{i}-"));
        let c = RemoteStore::connect(
            master.addr,
            ClientOptions {
                shm,
                ..Default::default()
            },
        )
        .unwrap();
        let tn = t("recycle");
        put(&c, &a, 6, 0);
        for k in keys(&a, 6) {
            c.remove(&tn, &k, false).unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
        let before = node.recycle_stats();
        let data = put(&c, &b, 6, 100);
        let after = node.recycle_stats();
        assert_eq!(
            (after.reused - before.reused, after.fresh - before.fresh),
            (6, 0),
            "{shm:?}: every put of the second batch reuses a removed object's buffer \
             ({before:?} -> {after:?})"
        );
        assert_eq!(
            after.early_syncs - before.early_syncs,
            1,
            "one sync for the batch"
        );
        // Reused buffers hold exactly the new bytes.
        for (k, d) in keys(&b, 6).iter().zip(&data) {
            assert_eq!(&c.get(&tn, k).unwrap(), d, "{k}");
        }
    }

    // Puts that find nothing freed (a node filling up) sync at most once per 10 ms.
    let c = RemoteStore::connect(master.addr, ClientOptions::default()).unwrap();
    let before = node.recycle_stats();
    let started = Instant::now();
    for round in 0..4 {
        put(&c, &format!("fill{round}-"), 5, 1000 * round);
    }
    let ms = started.elapsed().as_millis() as u64;
    let after = node.recycle_stats();
    assert_eq!(after.fresh - before.fresh, 20);
    assert!(
        after.early_syncs - before.early_syncs <= 1 + ms / 10,
        "{} early syncs in {ms} ms",
        after.early_syncs - before.early_syncs
    );
}
