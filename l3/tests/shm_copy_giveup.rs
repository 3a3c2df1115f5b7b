//! A get into a caller's `SharedRegion` from a store node stopped in the middle of the copy:
//! the client times out and returns, the caller reuses the region, the node resumes. What
//! the node writes into the region after the call returned overwrites the caller's bytes:
//! wrong data for the caller. The node checks that the client has not given up before each
//! 1 MiB of the copy (`GIVE_UP_CHUNK`), so at most the rest of one chunk lands late — the
//! chunk it was stopped in (docs/l3.md, *Shared memory*: a leftover). Before, the rest of the
//! object: 190–240 MB of the 256 MB, in 3 of 3 runs.
//!
//! Real parts: a `--role master` and a `--role node` process on 127.0.0.1, the node stopped
//! with a real SIGSTOP while its copy of a 256 MiB object into the region is under way (the
//! test looks at the region to know: some bytes written, not all; else it tries again with
//! another delay), a `RemoteStore` reaching the node through shared memory.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::ha::signal;
use common::procs::{eventually, master, node_with};
use common::t;
use kvtier_l3::{ClientOptions, L3Store, PutOptions, RemoteStore, ShmMode};

const SIZE: usize = 256 << 20;

/// The node's copy checks the client is still there before each chunk of this size.
const CHUNK: usize = 1 << 20;

#[test]
fn a_get_stopped_mid_copy_writes_at_most_one_chunk_into_the_callers_reused_region() {
    let frame = (300u64 << 20).to_string();
    let m = master(
        &["--max-frame", &frame, "--max-object-bytes", "268435456"],
        None,
    );
    let n = node_with(
        m.addr,
        1,
        None,
        None,
        &[
            "--segment-bytes",
            "1073741824",
            "--max-frame",
            &frame,
            "--max-object-bytes",
            "268435456",
        ],
    );
    let c = Arc::new(
        RemoteStore::connect(
            m.addr,
            ClientOptions {
                rpc_timeout: Duration::from_secs(2),
                shm: ShmMode::Auto,
                max_frame_bytes: 300 << 20,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let tn = t("giveup");
    let big = vec![0x5au8; SIZE];
    let mut last = None;
    assert!(
        eventually(Duration::from_secs(20), || {
            let r = c.put(&tn, "big", &big, PutOptions::default());
            let ok = r.is_ok();
            last = Some(r);
            ok
        }),
        "no put succeeded: {last:?}"
    );
    drop(big);
    assert!(
        c.uses_shm(),
        "the node is not reached through shared memory"
    );
    let region = c.shared_region(SIZE).unwrap();
    let (addr, len) = (region.as_ptr() as usize, region.len());
    // SAFETY: the region lives until the test ends; this thread touches it only while no
    // get runs, or (reads) while the node is stopped.
    let mem = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
    let mut delay = Duration::from_millis(20);
    for attempt in 0..12 {
        mem.fill(0);
        let (c2, tn2) = (c.clone(), tn.clone());
        let get = std::thread::spawn(move || {
            // SAFETY: as above.
            let buf = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            c2.get_into(&tn2, "big", buf)
        });
        let t0 = Instant::now();
        std::thread::sleep(delay);
        signal(&n.child, libc::SIGSTOP);
        let written = mem.iter().filter(|&&b| b == 0x5a).count();
        eprintln!(
            "attempt {attempt}: stopped after {:?}, {written} bytes written",
            t0.elapsed()
        );
        if written == 0 || written == SIZE {
            signal(&n.child, libc::SIGCONT);
            let r = get.join().unwrap();
            eprintln!("  get: {r:?}");
            delay = if written == 0 { delay * 2 } else { delay / 2 };
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        // Stopped mid-copy: the client times out and returns the region to the caller.
        let r = get.join().unwrap();
        eprintln!("  get: {r:?}");
        assert!(r.is_err(), "a get from a stopped node succeeded");
        mem.fill(0xcc);
        signal(&n.child, libc::SIGCONT);
        std::thread::sleep(Duration::from_millis(500));
        let late = mem.iter().filter(|&&b| b != 0xcc).count();
        eprintln!("  written after the get returned: {late} bytes");
        assert!(
            late <= CHUNK,
            "the node wrote {late} bytes into the caller's region after the get returned"
        );
        drop(region);
        return;
    }
    panic!("never stopped the node in the middle of its copy");
}
