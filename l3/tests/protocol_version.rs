//! Peers of two wire protocol versions refuse each other at `hello` (-300, naming both
//! versions) and never misread each other's bytes: real `kvtier-l3` processes and clients on
//! 127.0.0.1 (ephemeral ports). A process plays another version through the test hook
//! `KVTIER_L3_TEST_PROTOCOL_VERSION_OVERRIDE`; a client through
//! `ClientOptions::protocol_version`.
//!
//! Why: rolling upgrades meet old clients with new servers and new nodes with old masters;
//! before versions, a changed request or reply type failed with an opaque decode error or,
//! worse, decoded into the wrong fields.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use bincode::Options;
use common::procs::{Proc, args, eventually, master, master_in, node, node_with, spawn};
use common::{client, payload, t};
use kvtier_l3::rpc::service::{
    ClusterReply, ClusterRequest, Hello, L3RpcRequest, L3RpcResponse, PROTOCOL_VERSION,
    PROTOCOL_VERSION_OVERRIDE_ENV,
};
use kvtier_l3::{ClientOptions, L3Error, L3Store, PutOptions, RemoteStore};

const OTHER: u32 = PROTOCOL_VERSION + 1;

/// A `kvtier-l3` process (`--role both`, or the role in `extra`) announcing `version`.
fn spawn_version(extra: &[&str], version: u32) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"));
    cmd.args(extra)
        .env_remove("KVTIER_L3_TOKEN")
        .env(PROTOCOL_VERSION_OVERRIDE_ENV, version.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let out = child.stdout.take().unwrap();
    let addr = kvtier_l3::cli::read_listening(out).unwrap();
    Proc {
        child,
        addr,
        state: None,
    }
}

fn server() -> Proc {
    spawn(
        &args(&["--listen", "127.0.0.1:0", "--segment-bytes", "16777216"]),
        None,
    )
}

fn connect_as(addr: SocketAddr, version: u32) -> Result<RemoteStore, L3Error> {
    RemoteStore::connect(
        addr,
        ClientOptions {
            protocol_version: version,
            rpc_timeout: Duration::from_secs(10),
            ..Default::default()
        },
    )
}

fn assert_mismatch(r: Result<RemoteStore, L3Error>, client: u32, server: u32) {
    let e = match r {
        Ok(_) => panic!("a client of protocol {client} was served by a server of {server}"),
        Err(e) => e,
    };
    assert_eq!(e, L3Error::ProtocolMismatch { client, server });
    assert_eq!(e.code_i32(), -300);
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("client speaks kvtier-l3 wire protocol {client}"))
            && msg.contains(&format!("the server {server}")),
        "{msg}"
    );
}

fn round_trip(c: &RemoteStore, key: &str) {
    let a = t("a");
    let data = payload(key.len(), 4096);
    c.put(&a, key, &data, PutOptions::default()).unwrap();
    assert_eq!(c.get(&a, key).unwrap(), data);
}

#[test]
fn a_client_of_another_version_is_refused_and_the_server_keeps_serving() {
    let s = server();
    let before = client(s.addr, None);
    round_trip(&before, "before");
    for _ in 0..3 {
        assert_mismatch(connect_as(s.addr, OTHER), OTHER, PROTOCOL_VERSION);
        assert_mismatch(connect_as(s.addr, 0), 0, PROTOCOL_VERSION);
    }
    // Clients already connected and new ones are served.
    round_trip(&before, "after-1");
    round_trip(&client(s.addr, None), "after-2");
}

#[test]
fn a_server_of_another_version_is_refused() {
    // A real server process announcing another version: it refuses this client.
    let s = spawn_version(
        &["--listen", "127.0.0.1:0", "--segment-bytes", "16777216"],
        OTHER,
    );
    assert_mismatch(
        connect_as(s.addr, PROTOCOL_VERSION),
        PROTOCOL_VERSION,
        OTHER,
    );
    // ... and serves a client of its version.
    round_trip(&connect_as(s.addr, OTHER).unwrap(), "k");
}

/// A server that answers `hello` with another version without refusing the client itself
/// (and limits this version cannot read): the client refuses, without decoding them.
#[test]
fn a_client_refuses_a_server_answering_another_version() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let req = read_frame(&mut s).expect("the client's hello");
        let o = bincode::DefaultOptions::new();
        let msg: tarpc::ClientMessage<L3RpcRequest> = o.deserialize(&req).unwrap();
        let tarpc::ClientMessage::Request(r) = msg else {
            panic!("not a request")
        };
        let L3RpcRequest::Hello { version, .. } = r.message else {
            panic!("the first call is not hello: {:?}", r.message)
        };
        assert_eq!(version, PROTOCOL_VERSION);
        let reply = tarpc::Response {
            request_id: r.id,
            message: Ok(L3RpcResponse::Hello(Ok(Hello {
                version: OTHER,
                limits: vec![0xff; 3],
            }))),
        };
        let body = o.serialize(&reply).unwrap();
        s.write_all(&(body.len() as u32).to_be_bytes()).unwrap();
        s.write_all(&body).unwrap();
        // Nothing else may come: the client hangs up.
        read_frame(&mut s)
    });
    assert_mismatch(connect_as(addr, PROTOCOL_VERSION), PROTOCOL_VERSION, OTHER);
    assert!(
        fake.join().unwrap().is_none(),
        "the client sent a call after a hello of another version"
    );
}

/// One length-delimited frame (big-endian u32 length), or None at EOF / after an error.
fn read_frame(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).ok()?;
    Some(body)
}

/// `hello` as released before protocol versions (the token alone), then a call on the same
/// connection: the server cannot read that hello (bincode: the frame ends before the
/// version) and closes the connection; the call is never served.
#[test]
fn a_hello_of_the_format_before_versions_is_never_served() {
    #[derive(serde::Serialize)]
    enum OldRequest {
        Hello { token: Option<String> },
    }
    #[derive(serde::Serialize)]
    struct Context {
        deadline: Duration,
        trace_context: tarpc::trace::Context,
    }
    #[derive(serde::Serialize)]
    struct Request<M> {
        context: Context,
        id: u64,
        message: M,
    }
    #[derive(serde::Serialize)]
    enum ClientMessage<M> {
        Request(Request<M>),
    }
    fn frame<M: serde::Serialize>(id: u64, message: M) -> Vec<u8> {
        let body = bincode::DefaultOptions::new()
            .serialize(&ClientMessage::Request(Request {
                context: Context {
                    deadline: Duration::from_secs(30),
                    trace_context: Default::default(),
                },
                id,
                message,
            }))
            .unwrap();
        let mut f = (body.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(&body);
        f
    }
    let s = server();
    for token in [None, Some(String::new()), Some("t".to_string())] {
        let mut c = TcpStream::connect(s.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(&frame(1, OldRequest::Hello { token })).unwrap();
        // Written on a connection the server may have closed already: either way unserved.
        let _ = c.write_all(&frame(2, L3RpcRequest::Stats {}));
        let start = Instant::now();
        while let Some(body) = read_frame(&mut c) {
            let r: Result<tarpc::Response<L3RpcResponse>, _> =
                bincode::DefaultOptions::new().deserialize(&body);
            if let Ok(r) = r {
                assert!(
                    !matches!(
                        r.message,
                        Ok(L3RpcResponse::Stats(Ok(_)) | L3RpcResponse::Hello(Ok(_)))
                    ),
                    "an old-format peer was served: {:?}",
                    r.message
                );
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(9),
            "the server kept the connection of an unreadable hello open"
        );
    }
    round_trip(&client(s.addr, None), "still-serving");
}

/// Runs a node process (announcing `version`, or this one) against `master` and returns its
/// stderr once it exits, failing (and killing it) if it is still running after 20 s or
/// exited successfully: it must have been refused.
fn refused_node(master: SocketAddr, id: u64, version: Option<u32>) -> String {
    let (child, stderr) = node_process(master, id, version, Stdio::null());
    refused(child, stderr)
}

/// A node process against `master` (announcing `version`, or this one), its stdout as
/// given, and a thread collecting its stderr.
fn node_process(
    master: SocketAddr,
    id: u64,
    version: Option<u32>,
    stdout: Stdio,
) -> (std::process::Child, std::thread::JoinHandle<String>) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"));
    cmd.args(common::procs::node_args(master, id, None, &[]))
        .env_remove("KVTIER_L3_TOKEN")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped());
    if let Some(v) = version {
        cmd.env(PROTOCOL_VERSION_OVERRIDE_ENV, v.to_string());
    }
    let mut child = cmd.spawn().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    (child, reader)
}

/// Waits for `child` to exit and returns its stderr, failing (and killing it) if it is still
/// running after 20 s or exited successfully: it must have been refused.
fn refused(mut child: std::process::Child, stderr: std::thread::JoinHandle<String>) -> String {
    let end = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the node of another version joined its master and kept running");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = stderr.join().unwrap();
    assert!(!status.success(), "the node ran: {stderr}");
    stderr
}

/// A store node of another version cannot join its master: it exits with the refusal, the
/// master lists no node and keeps serving; a node of its version joins.
#[test]
fn a_node_of_another_version_cannot_join_its_master() {
    let m = master(&[], None);
    let stderr = refused_node(m.addr, 1, Some(OTHER));
    assert!(
        stderr.contains(&format!(
            "client speaks kvtier-l3 wire protocol {OTHER}, the server {PROTOCOL_VERSION}"
        )),
        "{stderr}"
    );
    let c = client(m.addr, None);
    let nodes = |c: &RemoteStore| match c.cluster(ClusterRequest::Nodes).unwrap() {
        ClusterReply::Nodes(n) => n.len(),
        other => panic!("{other:?}"),
    };
    assert_eq!(nodes(&c), 0);
    // A master of another version refuses a node of this version the same way.
    let other = spawn_version(
        &[
            "--role",
            "master",
            "--listen",
            "127.0.0.1:0",
            "--no-state-dir",
        ],
        OTHER,
    );
    let stderr = refused_node(other.addr, 2, None);
    assert!(
        stderr.contains(&format!(
            "client speaks kvtier-l3 wire protocol {PROTOCOL_VERSION}, the server {OTHER}"
        )),
        "{stderr}"
    );
    // The master still takes a node of its version, and serves.
    let _n = node(m.addr, 3, None, None);
    assert!(eventually(Duration::from_secs(10), || nodes(&c) == 1));
    round_trip(&c, "joined");
}

/// A server replaced at its address by one of another version (an upgrade under a client
/// still connected): the client's calls fail with the refusal (-300) once it dials again,
/// not with a bare transport error, and nothing is served across versions (`get_size`:
/// a call on the RPC connection itself, not the shared-memory or transfer channel).
#[test]
fn a_connected_client_gets_the_refusal_when_its_server_is_upgraded_under_it() {
    let s = server();
    let addr = s.addr.to_string();
    let c = client(s.addr, None);
    round_trip(&c, "before");
    drop(s);
    let _upgraded = spawn_version(&["--listen", &addr, "--segment-bytes", "16777216"], OTHER);
    let a = t("a");
    let mut last = None;
    for _ in 0..5 {
        match c.get_size(&a, "before") {
            Err(e @ L3Error::ProtocolMismatch { .. }) => {
                last = Some(e);
                break;
            }
            Err(L3Error::RpcFail(_)) => {} // the old connection's end
            other => panic!("served across versions: {other:?}"),
        }
    }
    assert_eq!(
        last,
        Some(L3Error::ProtocolMismatch {
            client: PROTOCOL_VERSION,
            server: OTHER
        })
    );
    // Still refused, call after call.
    assert!(matches!(
        c.get_size(&a, "before"),
        Err(L3Error::ProtocolMismatch { .. })
    ));
}

/// A rolling upgrade that restarts the master (same address and state directory) in the new
/// version while a store node of the old one keeps running: the node cannot re-mount (its
/// pings are refused), and no client of the new version may read through its data channel
/// (whose own hello carries no version): the restarted master serves only what re-mounted
/// nodes hold, so the old node's bytes are unavailable, never read across versions. A guard:
/// it passed when written.
#[test]
fn a_node_left_on_the_old_version_is_never_read_through_by_new_clients() {
    let dir = tempfile::tempdir().unwrap();
    let m = master_in("127.0.0.1:0", dir.path(), &[], None);
    let addr = m.addr.to_string();
    let _n = node_with(m.addr, 1, None, None, &[]);
    let c = client(m.addr, None);
    let a = t("a");
    let data = payload(7, 4096);
    assert!(
        eventually(Duration::from_secs(20), || c
            .put(&a, "k", &data, PutOptions::default())
            .is_ok()),
        "no put succeeded"
    );
    drop(c);
    drop(m);
    let state = dir.path().display().to_string();
    let _m2 = spawn_version(
        &["--role", "master", "--listen", &addr, "--state-dir", &state],
        OTHER,
    );
    let new = connect_as(addr.parse().unwrap(), OTHER).unwrap();
    for _ in 0..20 {
        let r = new.get(&a, "k");
        assert!(
            r.is_err(),
            "a client of {OTHER} read through a node of {PROTOCOL_VERSION}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A running store node whose master is restarted (same address and state directory) in
/// another version exits with the refusal, naming both versions, instead of pinging a master
/// that refuses every call for as long as it runs (before: it kept running, each ping and
/// remount refused, silently without `RUST_LOG`).
#[test]
fn a_running_node_refused_by_its_upgraded_master_exits_with_the_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let m = master_in("127.0.0.1:0", dir.path(), &[], None);
    let addr = m.addr.to_string();
    let (mut child, stderr) = node_process(m.addr, 1, None, Stdio::piped());
    let out = child.stdout.take().unwrap();
    if let Err(e) = kvtier_l3::cli::read_listening(out) {
        let _ = child.kill();
        panic!("the node did not start: {e}");
    }
    drop(m);
    let state = dir.path().display().to_string();
    let _m2 = spawn_version(
        &["--role", "master", "--listen", &addr, "--state-dir", &state],
        OTHER,
    );
    let stderr = refused(child, stderr);
    assert!(
        stderr.contains(&format!(
            "refused by its master: protocol version mismatch: the client speaks kvtier-l3 \
             wire protocol {PROTOCOL_VERSION}, the server {OTHER}"
        )),
        "{stderr}"
    );
}

/// A peer of another version dialling again and again (a client or node left on the old
/// release, reconnecting) is refused every time, but the server's warning is rate-limited:
/// one line, not one per connection (before: 40 lines for 40 refused connections, a log
/// flooded for as long as the old peer retries).
#[test]
fn a_peer_of_another_version_dialling_again_and_again_is_warned_of_once() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"));
    cmd.args(["--listen", "127.0.0.1:0", "--segment-bytes", "16777216"])
        .env_remove("KVTIER_L3_TOKEN")
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let out = child.stdout.take().unwrap();
    let addr = kvtier_l3::cli::read_listening(out).unwrap();
    const DIALS: usize = 40;
    for _ in 0..DIALS {
        assert_mismatch(connect_as(addr, OTHER), OTHER, PROTOCOL_VERSION);
    }
    // Still serving its own version.
    round_trip(&client(addr, None), "served");
    let _ = child.kill();
    let _ = child.wait();
    let stderr = reader.join().unwrap();
    let warned = stderr
        .lines()
        .filter(|l| l.contains("refused a client of another protocol version"))
        .count();
    assert!(
        (1..=2).contains(&warned),
        "{warned} warnings for {DIALS} refused connections:\n{stderr}"
    );
}
