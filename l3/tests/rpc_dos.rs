//! Denial of service on the RPC port and the metrics endpoint, from peers that hold no
//! token: idle sockets, frames that never end, frames that decode into far more memory than
//! they take on the wire. Real sockets on 127.0.0.1 (ephemeral ports), the real server
//! (in this process, or the `kvtier-l3` binary where its memory or file descriptors are
//! measured).
//!
//! Why (found by an adversarial tester): a connection could stay unauthenticated for ever,
//! nothing capped the connections, so idle sockets exhausted the server's descriptors (a
//! real client's hello then timed out) while the accept loop spun on EMFILE; every
//! unauthenticated connection could buffer a 64 MiB frame, and a 60 MiB `batch_query` of
//! empty keys was decoded (1.5 GiB) before the call found it had no hello; the metrics
//! endpoint waited for a request for ever, on any number of connections.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::raw::{PATIENCE, Server, TOKEN, assert_closed, rpc_frame, token_server};
use common::{payload, t};
use kvtier_l3::rpc::server::ServerOptions;
use kvtier_l3::rpc::service::{L3RpcRequest, PROTOCOL_VERSION};
use kvtier_l3::{ClientOptions, L3Store, PutOptions, RemoteStore};

fn server(metrics: bool) -> kvtier_l3::ServerHandle {
    token_server(
        16 << 20,
        ServerOptions {
            metrics_addr: metrics.then(|| "127.0.0.1:0".parse().unwrap()),
            ..Default::default()
        },
    )
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// A client with the token, under a deadline short enough for a test.
fn client(addr: SocketAddr) -> kvtier_l3::L3Result<RemoteStore> {
    RemoteStore::connect(
        addr,
        ClientOptions {
            token: Some(TOKEN.into()),
            rpc_timeout: Duration::from_secs(30),
            ..Default::default()
        },
    )
}

/// The client moves data.
fn round_trip(c: &RemoteStore, key: &str) {
    let a = t("a");
    let data = payload(key.len(), 4096);
    c.put(&a, key, &data, PutOptions::default()).unwrap();
    let mut buf = vec![0u8; 4096];
    let mut bufs = [&mut buf[..]];
    let r = c.batch_get_into(&a, &[key.to_string()], &mut bufs).unwrap();
    assert_eq!(r, vec![Ok(4096)]);
    assert_eq!(buf, data);
}

#[test]
fn a_connection_that_never_says_hello_is_closed() {
    let h = server(false);
    let mut idle = connect(h.addr);
    let mut wrong = connect(h.addr);
    wrong
        .write_all(&rpc_frame(
            1,
            L3RpcRequest::Hello {
                token: Some("wrong".into()),
                version: PROTOCOL_VERSION,
            },
        ))
        .unwrap();
    let mut nothing = connect(h.addr);
    nothing
        .write_all(&rpc_frame(2, L3RpcRequest::Stats {}))
        .unwrap();
    assert_closed(&mut idle, "a connection that sent nothing");
    assert_closed(&mut wrong, "a connection whose hello had a wrong token");
    assert_closed(&mut nothing, "a connection that called without hello");
    // An authenticated client is not bound by the hello deadline.
    let c = client(h.addr).unwrap();
    round_trip(&c, "k");
}

#[test]
fn idle_connections_past_the_descriptor_limit_do_not_lock_out_clients() {
    // 256 descriptors for the whole server, 350 idle sockets from a peer without the token
    // (more than it can hold, fewer than it can hold and queue: the listen backlog is 128).
    let s = Server::spawn(&[], false, Some(256));
    let idle: Vec<TcpStream> = (0..350)
        .map_while(|_| TcpStream::connect_timeout(&s.addr, Duration::from_secs(10)).ok())
        .collect();
    assert!(idle.len() > 256, "{} idle sockets", idle.len());
    // A client with the token still connects and moves data...
    let c = client(s.addr).unwrap_or_else(|e| panic!("client locked out: {e}"));
    round_trip(&c, "k1");
    // ...and the idle sockets hold about half of the server's descriptors, not all.
    assert!(s.fds() < 200, "{} descriptors open", s.fds());
    drop(idle);
    round_trip(&c, "k2");
}

#[test]
fn a_large_frame_before_hello_is_refused_at_its_header() {
    let s = Server::spawn(&[], false, None);
    // A frame that announces 1 MiB and never ends: closed at once, nothing buffered.
    let mut partial = connect(s.addr);
    partial.write_all(&(1u32 << 20).to_be_bytes()).unwrap();
    partial.write_all(&[0u8; 100]).unwrap();
    assert_closed(&mut partial, "a partial 1 MiB frame before hello");
    // A 60 MiB `batch_query` of empty keys (one byte each on the wire, a 24-byte String
    // each decoded) from a peer that never said hello: refused before it is read.
    let n: usize = 60 << 20;
    let mut body = rpc_frame(
        3,
        L3RpcRequest::BatchQuery {
            tenant: t("a"),
            keys: Vec::new(),
        },
    );
    // The key count is the frame's last byte (varint 0): make it `n`, then `n` empty keys.
    body.pop();
    body.push(253);
    body.extend_from_slice(&(n as u64).to_le_bytes());
    body.resize(body.len() + n, 0);
    let len = (body.len() - 4) as u32;
    body[..4].copy_from_slice(&len.to_be_bytes());
    let mut big = connect(s.addr);
    big.set_write_timeout(Some(PATIENCE)).unwrap();
    // The server may close while this is sent: a failed write is what it should do.
    let _ = big.write_all(&body);
    assert_closed(&mut big, "a 60 MiB batch_query before hello");
    let peak_mib = s.status_kib("VmHWM") >> 10;
    assert!(
        peak_mib < 256,
        "server peaked at {peak_mib} MiB on frames from a peer without the token"
    );
    // The server still serves clients with the token, large frames included.
    let c = client(s.addr).unwrap();
    let a = t("a");
    let keys: Vec<String> = (0..4).map(|i| format!("big{i}")).collect();
    let objs: Vec<Vec<u8>> = (0..4).map(|i| payload(i, 1 << 20)).collect();
    let refs: Vec<&[u8]> = objs.iter().map(Vec::as_slice).collect();
    let r = c
        .batch_put_from(&a, &keys, &refs, PutOptions::default())
        .unwrap();
    assert!(r.iter().all(Result::is_ok), "{r:?}");
}

/// `GET /metrics` on a fresh connection: the status line.
fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.lines().next().unwrap_or_default().to_string()
}

#[test]
fn an_idle_metrics_connection_is_closed() {
    let h = server(true);
    let m = h.metrics_addr.unwrap();
    let mut idle = connect(m);
    assert_closed(&mut idle, "an idle metrics connection");
    assert_eq!(scrape(m), "HTTP/1.1 200 OK");
}

#[test]
fn idle_metrics_connections_are_capped() {
    let s = Server::spawn(&[], true, None);
    let m = s.metrics.unwrap();
    let base = s.fds();
    let idle: Vec<TcpStream> = (0..300).map(|_| TcpStream::connect(m).unwrap()).collect();
    // A scraper is served while they are open...
    assert_eq!(scrape(m), "HTTP/1.1 200 OK");
    // ...and the server keeps few of them (the scrape was accepted after all of them).
    let held = common::procs::eventually(Duration::from_secs(5), || s.fds() < base + 100);
    assert!(
        held,
        "{} descriptors open with 300 idle metrics connections",
        s.fds()
    );
    drop(idle);
}

/// The accept loop of the transfer channel and the shared-memory socket (the RPC port's:
/// `rpc::server::limits`' unit test).
#[test]
fn a_failing_accept_pauses_instead_of_spinning() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    // Out of descriptors: every accept fails at once, as it does under EMFILE.
    let calls = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let c = calls.clone();
    let serve: kvtier_l3::rpc::accept::ServeConn<TcpStream> = Arc::new(|_, _| {});
    let h = kvtier_l3::rpc::accept::spawn_acceptor(
        "emfile",
        move || -> std::io::Result<TcpStream> {
            c.fetch_add(1, Ordering::Relaxed);
            Err(std::io::Error::from_raw_os_error(libc::EMFILE))
        },
        stop.clone(),
        serve,
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Release);
    h.join().unwrap();
    let n = calls.load(Ordering::Relaxed);
    assert!(n < 1000, "{n} failed accepts in a second");
}
