//! What a `wait_persisted` put's acknowledgement means (issue 19, item 2): the object is on
//! SSD *and registered* — it exists right after the answer — or the put fails with the code
//! that says why (-712 dropped before its copy was registered, -1103 write failed, -1301
//! queue full, -900 registration unanswered). Before, the SSD writer answered every waiter
//! with success whatever happened to the registration: under a DRAM flood 73 of 1,102
//! acknowledged puts did not exist right after their acknowledgement and never came back.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

mod common;

use common::{payload, persisted, t};
use kvtier_l3::{EmbeddedStore, L3Store, PutOptions, SsdConfig, StoreConfig};

const MIB: usize = 1 << 20;

/// One thread floods an 8 MiB DRAM segment with 1 MiB write-through puts while this one
/// puts with `wait_persisted` and probes right after each acknowledgement.
#[test]
fn an_acknowledged_persisted_put_exists_under_a_dram_flood() {
    let d = tempfile::tempdir().unwrap();
    let store = Arc::new(
        EmbeddedStore::new(StoreConfig {
            local_segment_bytes: 8 * MIB as u64,
            // A bounded backlog (the flood's full-queue skips are fine), so the test ends
            // quickly after the flood stops.
            ssd: Some(SsdConfig {
                queue_len: 64,
                ..SsdConfig::new(d.path())
            }),
            ..Default::default()
        })
        .unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            let tn = t("flood");
            let bytes = vec![0xF1u8; MIB];
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // -200 (everything pending or leased) and a full queue are fine here.
                let _ = store.put(&tn, &format!("f{i}"), &bytes, PutOptions::default());
                i += 1;
            }
            i
        })
    };
    let tn = t("durable");
    let (mut acked, mut missing, mut refused) = (0usize, Vec::new(), Vec::new());
    let end = Instant::now() + Duration::from_secs(6);
    let mut i = 0usize;
    while acked < 400 && Instant::now() < end {
        let key = format!("w{i}");
        let bytes = payload(i, MIB);
        match store.put(&tn, &key, &bytes, persisted()) {
            Ok(()) => {
                acked += 1;
                if !store.is_exist(&tn, &key).unwrap() {
                    missing.push(key);
                } else if store.get(&tn, &key).unwrap() != bytes {
                    panic!("{key}: wrong bytes after an acknowledged persisted put");
                }
            }
            Err(e) => refused.push(e.code_i32()),
        }
        i += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let flooded = flood.join().unwrap();
    assert!(flooded > 20, "the flood must overflow DRAM: {flooded} puts");
    assert!(acked > 0, "no persisted put was acknowledged: {refused:?}");
    assert!(
        missing.is_empty(),
        "{} of {acked} acknowledged persisted puts did not exist right after: {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    for c in &refused {
        assert!(
            [-712, -1103, -1301, -200].contains(c),
            "a persisted put failed with an unexpected code {c}"
        );
    }
    eprintln!(
        "{acked} acknowledged and present, {} refused ({:?}), flood {flooded} puts",
        refused.len(),
        refused
            .iter()
            .fold(std::collections::BTreeMap::new(), |mut m, c| {
                *m.entry(*c).or_insert(0) += 1;
                m
            })
    );
}
