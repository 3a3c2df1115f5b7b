//! Scenario `put`: the embedded put path, 64 × 8 MiB (512 MiB) through `batch_put_from`,
//! against a memcpy of the same bytes into warm (already faulted) memory in the same run.
//!
//! Why: an engine offloads whole KV pages to L3 on its critical path; Mooncake's put of the
//! same batch costs about one memcpy (its segment is pre-registered memory). Three cases:
//! - `fresh store`: a new store each repetition (every object lands in never-touched memory);
//! - `overwrite`: the same keys again after `remove_all` (memory freed by the removes);
//! - `evicting`: new keys into a full store (memory freed by eviction).

use std::time::Instant;

use kvtier_l3::{EmbeddedStore, L3Store, PutOptions, StoreConfig};

use super::{R, median, payload, row, serde_row, tenant};

const N: usize = 64;
const SIZE: usize = 8 << 20;

fn store(segment: u64) -> R<EmbeddedStore> {
    EmbeddedStore::new(StoreConfig {
        local_segment_bytes: segment,
        max_batch_keys: 65_536,
        ..Default::default()
    })
    .map_err(|e| e.to_string())
}

fn put_all(s: &EmbeddedStore, keys: &[String], srcs: &[&[u8]]) -> R<f64> {
    let t0 = Instant::now();
    let r = s
        .batch_put_from(&tenant(), keys, srcs, PutOptions::default())
        .map_err(|e| e.to_string())?;
    let dt = t0.elapsed().as_secs_f64() * 1e3;
    if let Some(e) = r.into_iter().find_map(Result::err) {
        return Err(format!("put failed: {e}"));
    }
    Ok(dt)
}

pub fn put(reps: usize, rows: &mut Vec<serde_row::Row>) -> R<()> {
    let objs: Vec<Vec<u8>> = (0..N).map(|i| payload(i, SIZE)).collect();
    let srcs: Vec<&[u8]> = objs.iter().map(Vec::as_slice).collect();
    // The reference: the same bytes copied into warm destination buffers.
    let mut dst: Vec<Vec<u8>> = (0..N).map(|_| vec![1u8; SIZE]).collect();
    let mut memcpy = Vec::new();
    let mut fresh = Vec::new();
    let mut over = Vec::new();
    let mut evict = Vec::new();
    let cap = (N * SIZE) as u64 * 2;
    let keys = |g: usize| -> Vec<String> { (0..N).map(|i| format!("put-{g}-{i}")).collect() };
    let reused = store(cap)?;
    put_all(&reused, &keys(0), &srcs)?;
    // Full: 2.5 batches' worth of capacity; each repetition puts a new batch (evicting).
    let full = store(cap + cap / 4)?;
    for g in 0..3 {
        put_all(&full, &keys(1000 + g), &srcs)?;
    }
    for rep in 0..reps {
        let t0 = Instant::now();
        for (d, s) in dst.iter_mut().zip(&srcs) {
            d.copy_from_slice(s);
        }
        memcpy.push(t0.elapsed().as_secs_f64() * 1e3);
        let s = store(cap)?;
        fresh.push(put_all(&s, &keys(0), &srcs)?);
        drop(s);
        reused
            .remove_all(&tenant(), true)
            .map_err(|e| e.to_string())?;
        over.push(put_all(&reused, &keys(0), &srcs)?);
        evict.push(put_all(&full, &keys(2000 + rep), &srcs)?);
    }
    std::hint::black_box(&dst);
    let m = median(&mut memcpy);
    rows.push(row(
        "memcpy 64x8MiB into warm buffers",
        m,
        "ms",
        "(reference)",
        "(info)",
        true,
    ));
    for (name, v) in [
        ("embedded batch_put_from 64x8MiB, fresh store", &mut fresh),
        ("embedded batch_put_from 64x8MiB, overwrite", &mut over),
        ("embedded batch_put_from 64x8MiB, evicting", &mut evict),
    ] {
        let x = median(v);
        rows.push(row(
            name,
            x,
            "ms",
            &format!("{:.2}x memcpy", x / m),
            "(info)",
            true,
        ));
    }
    Ok(())
}
