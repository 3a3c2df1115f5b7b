//! Clients cannot grow a `kvtier-l3` server's memory without bound by mounting segments.
//!
//! A Mooncake client in front of a `kvtier-l3` server mounts its `global_segment_size` there,
//! but the bytes put into that segment live in the *server* (kvtier clients own no store
//! memory). Before the cap, any authenticated client could mount a segment of any size, any
//! number of times, and puts then filled the server's memory until the kernel killed it. Now
//! the capacity mounted by clients, in all, is capped (`--client-segments-max-bytes`, default
//! the host's memory): a mount past it is -200 and changes nothing, an unmount or a client's
//! death gives the room back, the server's own segment is not counted. Against the real
//! binary on 127.0.0.1.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

mod common;

use common::procs::{args, eventually, spawn};
use common::{client, t};
use kvtier_l3::{ClientId, L3Error, L3Store, PutOptions, ReplicateConfig, SegmentId};

const MIB: u64 = 1 << 20;

fn mounted(c: &dyn L3Store) -> u64 {
    c.stats().unwrap().mem_capacity_bytes
}

#[test]
fn mounts_past_the_cap_are_refused_and_room_comes_back() {
    let cap = (10 * MIB).to_string();
    let srv = spawn(
        &args(&[
            "--listen",
            "127.0.0.1:0",
            "--segment-bytes",
            &(4 * MIB).to_string(),
            "--client-segments-max-bytes",
            &cap,
            "--client-ttl-ms",
            "1000",
        ]),
        None,
    );
    let c = client(srv.addr, None);
    let own = mounted(&c);
    assert_eq!(own, 4 * MIB, "the server's own segment");
    let (a, b) = (ClientId(101), ClientId(102));
    // The mounting clients stay alive (pinged) until the end, whatever the machine's load.
    let stop = Arc::new(AtomicBool::new(false));
    let pinger = {
        let (stop, p) = (stop.clone(), client(srv.addr, None));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for id in [101, 102, 105] {
                    p.ping(ClientId(id)).unwrap();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    c.mount_segment(a, SegmentId(101), 6 * MIB).unwrap();
    // 6 + 6 > 10: refused with -200, nothing mounted.
    let e = c.mount_segment(b, SegmentId(102), 6 * MIB).unwrap_err();
    assert!(
        matches!(e, L3Error::NoAvailableHandle { needed } if needed == 6 * MIB),
        "{e:?}"
    );
    assert_eq!(e.code_i32(), -200);
    assert_eq!(mounted(&c), own + 6 * MIB);
    assert!(matches!(
        c.unmount_segment(b, SegmentId(102)),
        Err(L3Error::SegmentNotFound)
    ));
    // A size that overflows any sum is refused the same way, not wrapped around.
    assert!(matches!(
        c.mount_segment(b, SegmentId(103), u64::MAX),
        Err(L3Error::NoAvailableHandle { .. })
    ));
    // Exactly the rest fits.
    c.mount_segment(b, SegmentId(102), 4 * MIB).unwrap();
    assert_eq!(mounted(&c), own + 10 * MIB);
    assert!(c.mount_segment(b, SegmentId(104), 1).is_err());
    // Objects go into the mounted segments and read back.
    let tn = t("cap");
    let data = vec![7u8; MIB as usize];
    for i in 0..8 {
        c.put_with(
            &tn,
            &format!("k{i}"),
            &data,
            PutOptions::default(),
            ReplicateConfig::replicas(1),
        )
        .unwrap();
    }
    assert_eq!(c.get(&tn, "k7").unwrap(), data);
    // An unmount gives its room back.
    c.unmount_segment(a, SegmentId(101)).unwrap();
    c.mount_segment(ClientId(105), SegmentId(105), 6 * MIB)
        .unwrap();
    // So does a client's death: once nobody pings for 105 and 102, the sweeper unmounts them.
    stop.store(true, Ordering::Relaxed);
    pinger.join().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || mounted(&c) == own),
        "dead clients' segments still mounted: {} bytes",
        mounted(&c)
    );
    c.mount_segment(ClientId(106), SegmentId(106), 10 * MIB)
        .unwrap();
}

#[test]
fn by_default_the_cap_is_the_hosts_memory() {
    let host = kvtier_l3::config::host_memory_bytes().expect("/proc/meminfo");
    let srv = spawn(
        &args(&["--listen", "127.0.0.1:0", "--segment-bytes", "0"]),
        None,
    );
    let c = client(srv.addr, None);
    assert!(matches!(
        c.mount_segment(ClientId(1), SegmentId(1), host + 1),
        Err(L3Error::NoAvailableHandle { .. })
    ));
    c.mount_segment(ClientId(1), SegmentId(1), host / 2)
        .unwrap();
    assert!(matches!(
        c.mount_segment(ClientId(2), SegmentId(2), host / 2 + MIB),
        Err(L3Error::NoAvailableHandle { .. })
    ));
    assert_eq!(mounted(&c), host / 2);
}
