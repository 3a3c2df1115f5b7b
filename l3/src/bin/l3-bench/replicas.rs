//! Scenario `replicas`: a split deployment (a `--role master` and three `--role node`
//! processes on loopback), put and get of 128 × 1 MiB with `replica_num` 1, 2 and 3.
//!
//! Why: extra replicas cost one more node write each; the figures are ratios to
//! `replica_num` 1 of the same run, with the replica counts interleaved per repetition so
//! that load drifts on the shared machine hit all three alike.

use std::path::Path;
use std::time::{Duration, Instant};

use kvtier_l3::{ClientOptions, L3Store, PutOptions, RemoteStore, ReplicateConfig};

use super::{R, median, payload, row, serde_row, start_proc, tenant};

/// Objects and size of the replicated case.
const REPL_OBJECTS: usize = 128;
const REPL_SIZE: usize = 1 << 20;

pub fn replicas(bin: &Path, reps: usize, rows: &mut Vec<serde_row::Row>) -> R<()> {
    // The master's settle log (removed at the end; a bench run never restarts it).
    let state = std::env::temp_dir().join(format!("kvtier-l3-bench-master-{}", std::process::id()));
    let state_dir = state.display().to_string();
    let _cleanup = RemoveOnDrop(state.clone());
    let master = start_proc(
        bin,
        &[
            "--role",
            "master",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            &state_dir,
        ],
    )?;
    let maddr = master.addr.to_string();
    let seg = (1u64 << 30).to_string();
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let id = id.to_string();
        nodes.push(start_proc(
            bin,
            &[
                "--role",
                "node",
                "--master",
                &maddr,
                "--node-id",
                &id,
                "--listen",
                "127.0.0.1:0",
                "--segment-bytes",
                &seg,
                "--ping-ms",
                "100",
            ],
        )?);
    }
    let c =
        RemoteStore::connect(master.addr, ClientOptions::default()).map_err(|e| e.to_string())?;
    let t = tenant();
    let objs: Vec<Vec<u8>> = (0..REPL_OBJECTS).map(|i| payload(i, REPL_SIZE)).collect();
    let bytes = (REPL_OBJECTS * REPL_SIZE) as f64;
    let ns = [1u32, 2, 3];
    let mut put: Vec<Vec<f64>> = vec![Vec::new(); ns.len()];
    let mut get: Vec<Vec<f64>> = vec![Vec::new(); ns.len()];
    let mut data = vec![0u8; REPL_OBJECTS * REPL_SIZE];
    // Repetition 0 warms up; the replica counts are interleaved so that load drifts on the
    // shared machine hit all three alike.
    for rep in 0..=reps {
        for (j, &n) in ns.iter().enumerate() {
            let keys: Vec<String> = (0..REPL_OBJECTS).map(|i| format!("repl-{n}-{i}")).collect();
            let cfg = ReplicateConfig::replicas(n);
            let t0 = Instant::now();
            for (ks, os) in keys.chunks(32).zip(objs.chunks(32)) {
                let refs: Vec<&[u8]> = os.iter().map(|v| v.as_slice()).collect();
                for r in c
                    .batch_put_from_with(&t, ks, &refs, PutOptions::default(), cfg)
                    .map_err(|e| e.to_string())?
                {
                    r.map_err(|e| e.to_string())?;
                }
            }
            let dput = t0.elapsed().as_secs_f64();
            let q = c
                .get_replica_list(&t, &keys[0])
                .map_err(|e| e.to_string())?;
            if q.replicas.len() != n as usize {
                return Err(format!("{} replicas placed, {n} asked", q.replicas.len()));
            }
            let mut bufs: Vec<&mut [u8]> = data.chunks_mut(REPL_SIZE).collect();
            let t0 = Instant::now();
            for r in c
                .batch_get_into(&t, &keys, &mut bufs)
                .map_err(|e| e.to_string())?
            {
                r.map_err(|e| e.to_string())?;
            }
            let dget = t0.elapsed().as_secs_f64();
            if data[REPL_SIZE..2 * REPL_SIZE] != objs[1][..] {
                return Err("read data mismatch".into());
            }
            c.remove_all(&t, true).map_err(|e| e.to_string())?;
            if rep > 0 {
                put[j].push(bytes / dput / 1e9);
                get[j].push(bytes / dget / 1e9);
            }
        }
        // Let the nodes hear of the frees (ping period 100 ms) before the next round.
        std::thread::sleep(Duration::from_millis(250));
    }
    let p1 = median(&mut put[0].clone());
    let g1 = median(&mut get[0].clone());
    for (j, &n) in ns.iter().enumerate() {
        let p = median(&mut put[j]);
        let g = median(&mut get[j]);
        rows.push(row(
            &format!("split 3 nodes put 128x1MiB replica_num {n}"),
            p,
            "GB/s",
            &format!("x{:.2} of replica_num 1", p / p1),
            "(info)",
            true,
        ));
        rows.push(row(
            &format!("split 3 nodes get 128x1MiB replica_num {n}"),
            g,
            "GB/s",
            &format!("x{:.2} of replica_num 1", g / g1),
            "(info)",
            true,
        ));
    }
    drop(nodes);
    drop(master);
    Ok(())
}

/// Removes a scratch directory when the scenario ends (however it ends).
pub(super) struct RemoveOnDrop(pub(super) std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("l3-bench: could not remove {}: {e}", self.0.display());
        }
    }
}
