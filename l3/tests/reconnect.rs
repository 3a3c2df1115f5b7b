//! A `RemoteStore` outlives a restart of its server: the call that finds the connection
//! broken fails with -900 (it may or may not have been applied, so it is not repeated), and
//! the next one dials again, authenticates and goes on — including the transfer channel,
//! whose port changes with the restart. Real `kvtier-l3` processes, real SIGKILL.
//!
//! Why: before, a client's connection to the server was made once; after the server (or a
//! split deployment's master) was restarted, every call of every existing client — an
//! engine's L3 store, the SGLang backend — failed with -900 for good.

use std::time::Duration;

mod common;

use common::procs::{args, eventually, kill9, master_in, node_with, spawn};
use common::{client, payload, persisted, t};
use kvtier_l3::{L3Error, L3Store};

#[test]
fn a_client_goes_on_after_its_server_was_sigkilled_and_restarted() {
    let flags = |listen: &str| args(&["--listen", listen, "--segment-bytes", "67108864"]);
    let mut server = spawn(&flags("127.0.0.1:0"), None);
    let addr = server.addr.to_string();
    let c = client(server.addr, None);
    c.put(&t("a"), "before", &payload(1, 4096), Default::default())
        .unwrap();
    let keys = vec!["before".to_string()];
    let mut buf = vec![0u8; 4096];
    c.batch_get_into(&t("a"), &keys, &mut [&mut buf[..]])
        .unwrap()
        .remove(0)
        .unwrap();

    kill9(&mut server.child);
    let _server = spawn(&flags(&addr), None);
    assert!(
        eventually(Duration::from_secs(10), || c
            .put(&t("a"), "after", &payload(2, 4096), Default::default())
            .is_ok()),
        "the client never reconnected"
    );
    assert_eq!(c.get(&t("a"), "after").unwrap(), payload(2, 4096));
    // The restarted server keeps nothing in memory.
    assert!(matches!(
        c.get(&t("a"), "before"),
        Err(L3Error::ObjectNotFound)
    ));
    // Bulk reads go through the transfer channel, which listens on a new port now.
    let keys = vec!["after".to_string()];
    let got = c
        .batch_get_into(&t("a"), &keys, &mut [&mut buf[..]])
        .unwrap()
        .remove(0);
    assert_eq!(got.unwrap(), 4096);
    assert_eq!(buf, payload(2, 4096));
}

#[test]
fn a_client_of_a_split_deployment_goes_on_after_a_master_restart() {
    let state = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let mut master = master_in("127.0.0.1:0", state.path(), &[], None);
    let addr = master.addr.to_string();
    let _node = node_with(master.addr, 1, Some(ssd.path()), None, &[]);
    let c = client(master.addr, None);
    c.put(&t("a"), "k", &payload(3, 8192), persisted()).unwrap();

    kill9(&mut master.child);
    let _master = master_in(&addr, state.path(), &[], None);
    // The node remounts and reports its SSD record; the same client reads it.
    assert!(
        eventually(Duration::from_secs(15), || c
            .get(&t("a"), "k")
            .is_ok_and(|b| b == payload(3, 8192))),
        "the client never read the persisted key through the restarted master"
    );
    c.put(&t("a"), "k2", &payload(4, 8192), Default::default())
        .unwrap();
    assert_eq!(c.get(&t("a"), "k2").unwrap(), payload(4, 8192));
}
