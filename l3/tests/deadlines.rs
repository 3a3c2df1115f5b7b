//! Deadlines from the outside: a client timeout too large for tarpc's timer, and requests
//! whose deadline lies years ahead (or past any clock), sent as raw frames to the real server.
//!
//! Why: tarpc keeps in-flight requests in a timer wheel that panics ("invalid deadline") for
//! deadlines beyond ~2^36 ms, and it turns the wire's relative deadline into an `Instant`
//! with a plain addition that panics on overflow. Both are reachable from input: a client
//! option, and any peer's request bytes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

mod common;

use kvtier_l3::rpc::server::ServerOptions;
use kvtier_l3::rpc::service::L3RpcRequest;
use kvtier_l3::{
    ClientOptions, EmbeddedStore, L3Error, L3Store, RemoteStore, StoreConfig, spawn_server,
};

fn server() -> kvtier_l3::ServerHandle {
    let store = Arc::new(
        EmbeddedStore::new(StoreConfig {
            local_segment_bytes: 1 << 20,
            ..Default::default()
        })
        .unwrap(),
    );
    spawn_server(store, ServerOptions::default()).unwrap()
}

#[test]
fn client_timeouts_out_of_range_are_typed_errors() {
    let h = server();
    for bad in [
        Duration::ZERO,
        Duration::from_millis(1 << 36),
        Duration::from_secs(u64::MAX),
        Duration::MAX,
    ] {
        let r = RemoteStore::connect(
            h.addr,
            ClientOptions {
                rpc_timeout: bad,
                ..Default::default()
            },
        );
        assert!(
            matches!(r, Err(L3Error::InvalidParams(_))),
            "rpc_timeout {bad:?}: {:?}",
            r.err()
        );
    }
    // The largest accepted timeout works.
    let c = RemoteStore::connect(
        h.addr,
        ClientOptions {
            rpc_timeout: kvtier_l3::rpc::client::MAX_RPC_TIMEOUT,
            ..Default::default()
        },
    )
    .unwrap();
    c.stats().unwrap();
}

/// One `stats` request frame (length-delimited bincode, as tarpc sends it) with the given
/// relative deadline.
fn stats_frame(id: u64, deadline_secs: u64) -> Vec<u8> {
    common::raw::rpc_frame_with_deadline(
        id,
        L3RpcRequest::Stats {},
        Duration::from_secs(deadline_secs),
    )
}

#[test]
fn far_request_deadlines_are_clamped_not_panics() {
    let h = server();
    for (id, secs) in [
        (1u64, 10 * 365 * 86_400u64), // ten years: past tarpc's timer wheel
        (2, u64::MAX / 2),            // past any Instant
        (3, u64::MAX),
    ] {
        let mut s = TcpStream::connect(h.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        s.write_all(&stats_frame(id, secs)).unwrap();
        // A response frame comes back (the call is refused for want of a hello, which is
        // an answer); a panicked connection task would close the socket instead.
        let mut len = [0u8; 4];
        s.read_exact(&mut len)
            .unwrap_or_else(|e| panic!("deadline {secs}s: connection dropped ({e})"));
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut body).unwrap();
        assert!(!body.is_empty());
    }
    // And the server still serves everyone else.
    let c = common::client(h.addr, None);
    c.stats().unwrap();
}
