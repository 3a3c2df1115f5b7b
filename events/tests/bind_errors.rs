//! Addresses the publisher cannot bind as asked are typed errors, never a panic and never
//! another address than the one asked for.

use kvtier_events::*;

fn bind(endpoint: &str, replay: Option<&str>) -> Result<String, String> {
    let cfg = PublisherConfig {
        endpoint: endpoint.to_string(),
        replay_endpoint: replay.map(str::to_string),
        ..Default::default()
    };
    match std::panic::catch_unwind(|| Publisher::bind(cfg)) {
        Ok(Ok(p)) => Ok(p.endpoint().to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => panic!("binding {endpoint:?} / {replay:?} panicked"),
    }
}

/// An adversarial tester's panic: an ipc address under a regular file failed in bind(2) with
/// ENOTDIR, which the zmq crate does not know, so `zmq::Error::from_raw` panicked ("unknown
/// error [20]"): `KvEventPublisher(...)` raised a PanicException, and a `kvtier-l3 --kv-events`
/// leader retrying its bind lost its publishing thread. A typed error naming the address.
#[test]
fn an_address_the_system_refuses_in_a_way_zmq_does_not_know_is_a_typed_error() {
    let dir = std::env::temp_dir().join(format!("kvtier-bind-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let under_a_file = format!("ipc://{}/sock", file.display());
    for (ep, replay) in [
        (under_a_file.as_str(), None),
        ("tcp://127.0.0.1:*", Some(under_a_file.as_str())),
    ] {
        let e = bind(ep, replay).expect_err("refused");
        assert!(e.contains(&under_a_file), "{e}");
    }
    // and the publisher binds afterwards as before
    bind("tcp://127.0.0.1:*", Some("tcp://127.0.0.1:*")).expect("bound");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A port past 65,535 (or negative) was bound modulo 65,536 (`tcp://127.0.0.1:99999` bound
/// port 34463, `:-1` port 65535), with no error: subscribers configured with the port asked
/// for found nothing there. Refused, as is a port that is not a number.
#[test]
fn a_port_that_is_not_a_port_is_refused() {
    for ep in [
        "tcp://127.0.0.1:99999",
        "tcp://127.0.0.1:65536",
        "tcp://127.0.0.1:-1",
        "tcp://127.0.0.1:+5",
        "tcp://127.0.0.1:",
        "tcp://127.0.0.1:x",
    ] {
        let e = bind(ep, None).expect_err(ep);
        assert!(e.contains(ep), "{e}");
        let e = bind("tcp://127.0.0.1:*", Some(ep)).expect_err(ep);
        assert!(e.contains(ep), "{e}");
    }
}

/// A port another socket holds is EADDRINUSE, naming the address; the first publisher goes on.
#[test]
fn a_port_in_use_is_a_typed_error() {
    let first = Publisher::bind(PublisherConfig::default()).unwrap();
    let taken = first.endpoint().to_string();
    let e = bind(&taken, None).expect_err("in use");
    assert!(e.contains(&taken), "{e}");
    let replay = first.replay_endpoint().unwrap().to_string();
    let e = bind("tcp://127.0.0.1:*", Some(&replay)).expect_err("in use");
    assert!(e.contains(&replay), "{e}");
    assert_eq!(
        first.publish(0.0, &[WireEvent::AllBlocksCleared]).unwrap(),
        0
    );
}
