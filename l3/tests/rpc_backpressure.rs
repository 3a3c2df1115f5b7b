//! Authenticated peers that send and never read, on the RPC port: the server answers a
//! bounded number of a connection's requests at a time, stops reading from a connection
//! whose replies are not being read, and drops a connection whose replies have made no
//! progress, or that left a frame half-sent, for `ServerOptions::rpc_stall_timeout`. Real
//! sockets on 127.0.0.1 (ephemeral ports), the real server in this process.
//!
//! Why (found by an adversarial tester): the server read requests as fast as they came,
//! whether or not the replies could be written. A client pipelining `batch_exist`s of
//! 65,536 keys and reading nothing took the server from 169 MiB to 5.8 GiB in 20 s; raw
//! `batch_get`s never read pinned their 8 MiB objects for ever, even after a remove; 40
//! connections each sending 59 MiB of a 60 MiB frame held 2.37 GiB for ever.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::raw::{PATIENCE, TOKEN, assert_closed, rpc_frame, token_server};
use common::{payload, t};
use kvtier_l3::rpc::server::{DEFAULT_MAX_REQUESTS_PER_CONNECTION, ServerOptions};
use kvtier_l3::rpc::service::{L3RpcRequest, PROTOCOL_VERSION};
use kvtier_l3::{ClientOptions, ExistOptions, L3Store, PutOptions, RemoteStore, ShmMode};

/// The stall limit of these servers (60 s by default).
const STALL: Duration = Duration::from_secs(2);

fn server() -> kvtier_l3::ServerHandle {
    token_server(
        64 << 20,
        ServerOptions {
            metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
            shm: ShmMode::Off,
            rpc_stall_timeout: STALL,
            ..Default::default()
        },
    )
}

/// A client with the token on the tarpc path only (no transfer channel, no shared memory).
fn client(addr: SocketAddr) -> RemoteStore {
    RemoteStore::connect(
        addr,
        ClientOptions {
            token: Some(TOKEN.into()),
            rpc_timeout: Duration::from_secs(60),
            use_transfer_channel: false,
            shm: ShmMode::Off,
            ..Default::default()
        },
    )
    .unwrap()
}

/// A raw connection that said its hello and read the answer.
fn authenticated(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s.write_all(&rpc_frame(
        1,
        L3RpcRequest::Hello {
            token: Some(TOKEN.into()),
            version: PROTOCOL_VERSION,
        },
    ))
    .unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    s
}

/// A server-side gauge from the metrics endpoint.
fn gauge(metrics: SocketAddr, name: &str) -> u64 {
    let mut s = TcpStream::connect(metrics).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the metrics"))
}

#[test]
fn a_client_that_never_reads_is_throttled_then_dropped() {
    let h = server();
    let m = h.metrics_addr.unwrap();
    let mut s = authenticated(h.addr);
    s.set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    // 4,096 keys a request (about 8 KiB on the wire, 4,096 answers back): far more of them
    // than the socket buffers hold, if the server stops reading.
    let keys: Vec<String> = vec!["k".into(); 4096];
    let frame = |id| {
        rpc_frame(
            id,
            L3RpcRequest::BatchExist {
                tenant: t("a"),
                keys: keys.clone(),
                opts: ExistOptions::default(),
            },
        )
    };
    let total = 20_000u64;
    let mut sent = 0u64;
    let mut in_flight_seen = 0;
    let mut dropped = None;
    let mut pending: Vec<u8> = Vec::new();
    let started = Instant::now();
    while started.elapsed() < PATIENCE * 2 {
        if pending.is_empty() {
            if sent == total {
                break;
            }
            sent += 1;
            pending = frame(sent + 1);
        }
        match s.write(&pending) {
            Ok(n) => {
                pending.drain(..n);
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                // The server stopped reading: the requests it holds are bounded.
                in_flight_seen = in_flight_seen.max(gauge(m, "kvtier_l3_rpc_requests_in_flight"));
            }
            Err(e) => {
                dropped = Some(e);
                break;
            }
        }
    }
    assert!(
        sent < total,
        "the server read all {total} requests of a client that reads no reply"
    );
    let err = dropped.unwrap_or_else(|| {
        panic!("a connection whose replies were not read for {PATIENCE:?} is still open")
    });
    assert!(
        matches!(
            err.kind(),
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe
        ),
        "{err}"
    );
    // The server's replies cannot have stalled before its first request came.
    assert!(
        started.elapsed() >= STALL,
        "dropped {:?} after the first request: before the {STALL:?} limit",
        started.elapsed()
    );
    assert!(
        in_flight_seen > 0 && in_flight_seen <= DEFAULT_MAX_REQUESTS_PER_CONNECTION as u64,
        "{in_flight_seen} requests in flight on one connection (cap \
         {DEFAULT_MAX_REQUESTS_PER_CONNECTION})"
    );
    // The connection is gone, with its requests.
    let gone = common::procs::eventually(PATIENCE, || {
        gauge(m, "kvtier_l3_rpc_requests_in_flight") == 0
            && gauge(m, "kvtier_l3_rpc_connections") == 0
    });
    assert!(gone, "the dropped connection still holds requests");
    // Everyone else is served.
    let c = client(h.addr);
    c.put(&t("a"), "x", b"y", PutOptions::default()).unwrap();
    assert_eq!(c.get(&t("a"), "x").unwrap(), b"y");
}

#[test]
fn a_frame_left_half_sent_drops_the_connection() {
    let h = server();
    let mut s = authenticated(h.addr);
    // Announces 1 MiB (allowed after hello), sends 1,000 bytes of it and stops.
    s.write_all(&(1u32 << 20).to_be_bytes()).unwrap();
    s.write_all(&[0u8; 1000]).unwrap();
    let t0 = Instant::now();
    assert_closed(&mut s, "a frame left half-sent");
    assert!(
        t0.elapsed() + Duration::from_millis(600) >= STALL,
        "closed after {:?}, before the {STALL:?} limit",
        t0.elapsed()
    );
}

#[test]
fn idle_and_busy_clients_are_not_dropped() {
    let h = server();
    let c = Arc::new(client(h.addr));
    let a = t("a");
    c.put(&a, "k", &payload(1, 4096), PutOptions::default())
        .unwrap();
    // Idle past the stall limit: an idle connection has nothing stalled.
    std::thread::sleep(STALL * 2);
    assert_eq!(c.get(&a, "k").unwrap(), payload(1, 4096));
    // Far more calls at once than a connection's cap: they wait their turn, none refused.
    let threads: Vec<_> = (0..DEFAULT_MAX_REQUESTS_PER_CONNECTION * 4)
        .map(|w| {
            let (c, a) = (c.clone(), a.clone());
            std::thread::spawn(move || {
                for i in 0..10 {
                    let key = format!("w{w}-{i}");
                    let data = payload(w * 10 + i, 64 << 10);
                    c.put(&a, &key, &data, PutOptions::default()).unwrap();
                    assert_eq!(c.get(&a, &key).unwrap(), data);
                    assert!(c.exist_key(&a, &key, ExistOptions::default()).unwrap());
                }
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
}
