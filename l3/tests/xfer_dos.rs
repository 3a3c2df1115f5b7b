//! Pre-authentication denial of service on the transfer channel: idle TCP connections that
//! never say hello must not lock out real clients, even on a token-protected server.
//!
//! Why: each transfer connection got a blocking thread with no read timeout, up to 64; 64
//! idle sockets (no hello, no token needed) made every new client fail with -900.

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

mod common;

use common::{client, payload, t};
use kvtier_l3::rpc::server::ServerOptions;
use kvtier_l3::{EmbeddedStore, L3Store, PutOptions, StoreConfig, spawn_server};

#[test]
fn idle_unauthenticated_connections_do_not_lock_out_clients() {
    let store = Arc::new(
        EmbeddedStore::new(StoreConfig {
            local_segment_bytes: 16 << 20,
            ..Default::default()
        })
        .unwrap(),
    );
    let h = spawn_server(
        store,
        ServerOptions {
            token: Some("s3cret".into()),
            ..Default::default()
        },
    )
    .unwrap();
    let first = client(h.addr, Some("s3cret"));
    let port = first.limits().xfer_port;
    assert_ne!(port, 0, "server has a transfer channel");
    let xa = SocketAddr::new(h.addr.ip(), port);
    // Far more idle sockets than the server's connection limit: no hello, no token.
    let idle: Vec<TcpStream> = (0..200)
        .filter_map(|_| TcpStream::connect(xa).ok())
        .collect();
    assert!(!idle.is_empty());
    // New clients still connect and move data (over the channel, or the RPC path when the
    // channel is saturated).
    let a = t("a");
    for i in 0..4 {
        let c = client(h.addr, Some("s3cret"));
        let k = format!("k{i}");
        c.put(&a, &k, &payload(i, 4096), PutOptions::default())
            .unwrap();
        let mut buf = vec![0u8; 4096];
        let mut bufs = [&mut buf[..]];
        let r = c
            .batch_get_into(&a, std::slice::from_ref(&k), &mut bufs)
            .unwrap();
        assert_eq!(r, vec![Ok(4096)]);
        assert_eq!(buf, payload(i, 4096));
        assert_eq!(c.batch_is_exist(&a, &[k]).unwrap(), vec![Ok(true)]);
    }
    drop(idle);
}
