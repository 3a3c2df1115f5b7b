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

/// An adversarial tester's hijack: binding an ipc address another live publisher held
/// succeeded (ZMQ unlinks the socket file and binds anew), so two engines configured with
/// one path by mistake both started, and every subscriber that connected from then on heard
/// the second alone: the first's events went nowhere, and nothing said so. EADDRINUSE, as
/// TCP gives; a socket file nobody listens on (a crashed publisher's) is bound as before.
#[test]
fn an_ipc_address_another_publisher_holds_is_in_use() {
    let dir = std::env::temp_dir().join(format!("kvtier-ipc-in-use-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pub");
    let ep = format!("ipc://{}", path.display());
    let first = Publisher::bind(PublisherConfig {
        endpoint: ep.clone(),
        replay_endpoint: None,
        ..Default::default()
    })
    .unwrap();
    let e = bind(&ep, None).expect_err("in use");
    assert!(e.contains(&ep), "{e}");
    let replay = format!("ipc://{}", dir.join("replay").display());
    let _second = Publisher::bind(PublisherConfig {
        endpoint: "tcp://127.0.0.1:*".into(),
        replay_endpoint: Some(replay.clone()),
        ..Default::default()
    })
    .unwrap();
    let e = bind("tcp://127.0.0.1:*", Some(&replay)).expect_err("in use");
    assert!(e.contains(&replay), "{e}");
    // the first still publishes where it was bound
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_subscribe(b"").unwrap();
    sub.set_rcvtimeo(200).unwrap();
    sub.connect(&ep).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        first.publish(7.0, &[]).unwrap();
        if sub.recv_multipart(0).is_ok() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the first publisher is not heard"
        );
    }
    // a socket file left behind with nobody listening
    let stale = dir.join("stale");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    bind(&format!("ipc://{}", stale.display()), None).expect("a stale socket file is bound");
    drop(first);
    std::fs::remove_dir_all(&dir).unwrap();
}
