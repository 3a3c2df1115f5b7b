//! A split deployment's clients learn the batch, object and frame limits from the master's
//! `hello` and move bytes on the nodes by them, so a node whose own limits are lower refused
//! what every client sent it: `--max-batch-keys 100` on a node under a master of the default
//! 65,536 started, and then every batch put of more than 100 keys failed (-600 per key),
//! silently for the operator. Such a node is refused when it meets its master (exit 1,
//! naming the flag); a node whose limits are the master's or higher serves those batches.
//! Real processes on 127.0.0.1 (ephemeral ports).

use std::time::Duration;

mod common;

use common::procs::{master, node_args, node_with, spawn_unready};
use common::{client, t};
use kvtier_l3::{L3Store, PutOptions};

fn exit_of(mut child: std::process::Child) -> Option<i32> {
    for _ in 0..200 {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    None
}

#[test]
fn a_node_below_its_masters_limits_is_refused_and_one_at_them_serves_them() {
    let m = master(&["--max-batch-keys", "256"], None);
    for (flag, low) in [
        ("--max-batch-keys", "100"),
        ("--max-object-bytes", "1024"),
        ("--max-frame", "1048576"),
    ] {
        let node = node_args(m.addr, 3, None, &[flag, low]);
        assert_eq!(
            exit_of(spawn_unready(&node)),
            Some(1),
            "a node of {flag} {low} under a master of higher limits must not start"
        );
    }
    let _n = node_with(m.addr, 4, None, None, &["--max-batch-keys", "256"]);
    let c = client(m.addr, None);
    let a = t("a");
    let keys: Vec<String> = (0..200).map(|i| format!("k{i}")).collect();
    let vals: Vec<Vec<u8>> = (0..200).map(|i| vec![i as u8; 64]).collect();
    let views: Vec<&[u8]> = vals.iter().map(Vec::as_slice).collect();
    let r = c
        .batch_put_from(&a, &keys, &views, PutOptions::default())
        .unwrap();
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(c.get(&a, "k199").unwrap(), vals[199]);
}
