//! Pre-authentication denial of service on the transfer channel: idle TCP connections that
//! never say hello must not lock out real clients, even on a token-protected server.
//!
//! Why: each transfer connection got a blocking thread with no read timeout, up to 64; 64
//! idle sockets (no hello, no token needed) made every new client fail with -900. Then
//! (an adversarial tester): the hello timeout was a per-read timeout, so a peer dribbling a
//! byte a second held a hello slot for ever and eight of them locked every client out of
//! the transfer channel and the shared-memory socket; a frame before hello could announce
//! (and be given) 64 MiB; an `Exist` of 60 MiB of empty keys was unpacked whole (a 16-byte
//! `&str` per 2-byte key, 0.5 GiB) before its batch size was checked.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::procs::eventually;
use common::raw::{PATIENCE, Server, TOKEN};
use common::{client, payload, t};
use kvtier_l3::rpc::server::ServerOptions;
use kvtier_l3::rpc::shm::{ShmReply, ShmRequest};
use kvtier_l3::rpc::xfer::{MAX_PENDING_HELLOS, XferReply, XferRequest, read_frame, write_frame};
use kvtier_l3::{
    EmbeddedStore, ExistOptions, L3Error, L3Store, PutOptions, RemoteStore, ShmMode, StoreConfig,
    spawn_server,
};
use serde_bytes::ByteBuf;

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

/// A server with the token and a shared-memory socket in `dir`: its RPC address, transfer
/// channel address and shared-memory socket path.
fn guarded_server(dir: &std::path::Path) -> (kvtier_l3::ServerHandle, SocketAddr, PathBuf) {
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
            token: Some(TOKEN.into()),
            shm: ShmMode::Auto,
            shm_dir: Some(dir.to_path_buf()),
            ..Default::default()
        },
    )
    .unwrap();
    let port = client(h.addr, Some(TOKEN)).limits().xfer_port;
    assert_ne!(port, 0, "server has a transfer channel");
    let sock = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "sock"))
        .expect("the shared-memory socket");
    let xa = SocketAddr::new(h.addr.ip(), port);
    (h, xa, sock)
}

/// A peer that announces a 1,000-byte frame and then sends one byte every 500 ms (under the
/// per-read timeout), until the server closes the socket or [`PATIENCE`] passes. Returns
/// whether the server closed it.
fn dribble<S: Write + Send + 'static>(mut s: S) -> std::thread::JoinHandle<bool> {
    std::thread::spawn(move || {
        let until = Instant::now() + PATIENCE;
        if s.write_all(&1000u32.to_le_bytes()).is_err() {
            return true;
        }
        while Instant::now() < until {
            if s.write_all(&[0]).is_err() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        false
    })
}

/// A hello with the token on the transfer channel: accepted?
fn xfer_hello(xa: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect(xa) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    write_frame(
        &mut s,
        &XferRequest::Hello {
            token: Some(TOKEN.into()),
        },
    )
    .is_ok()
        && matches!(
            read_frame::<XferReply>(&mut s, 1 << 20),
            Ok(XferReply::Hello(Ok(())))
        )
}

/// A hello with the token on the shared-memory socket: accepted?
fn shm_hello(path: &std::path::Path) -> bool {
    let Ok(mut s) = UnixStream::connect(path) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    write_frame(
        &mut s,
        &ShmRequest::Hello {
            token: Some(TOKEN.into()),
        },
    )
    .is_ok()
        && matches!(
            read_frame::<ShmReply>(&mut s, 1 << 20),
            Ok(ShmReply::Hello(Ok(_)))
        )
}

#[test]
fn dribbled_hellos_are_dropped_within_the_hello_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (_h, xa, path) = guarded_server(dir.path());
    // As many dribbling peers as may wait for their hello, on each socket.
    let mut peers = Vec::new();
    for _ in 0..MAX_PENDING_HELLOS {
        peers.push(dribble(TcpStream::connect(xa).unwrap()));
        peers.push(dribble(UnixStream::connect(&path).unwrap()));
    }
    // Real clients get through while the peers still dribble (at the latest once the
    // server dropped them, HELLO_TIMEOUT after they connected).
    assert!(
        eventually(PATIENCE, || xfer_hello(xa)),
        "transfer channel locked out"
    );
    assert!(
        eventually(PATIENCE, || shm_hello(&path)),
        "shared-memory socket locked out"
    );
    for p in peers {
        assert!(p.join().unwrap(), "a dribbling peer was never dropped");
    }
}

#[test]
fn a_large_frame_before_hello_is_refused_at_its_header() {
    let dir = tempfile::tempdir().unwrap();
    let (_h, xa, path) = guarded_server(dir.path());
    // A frame of 1 MiB announced, its body never sent: refused with a typed error at once.
    let mut s = TcpStream::connect(xa).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
    match read_frame::<XferReply>(&mut s, 1 << 20) {
        Ok(XferReply::Get(Err(L3Error::InvalidParams(m)))) => assert!(m.contains("hello"), "{m}"),
        other => panic!("transfer channel: {other:?}"),
    }
    let mut u = UnixStream::connect(&path).unwrap();
    u.set_read_timeout(Some(PATIENCE)).unwrap();
    u.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
    match read_frame::<ShmReply>(&mut u, 1 << 20) {
        Ok(ShmReply::Done(Err(L3Error::InvalidParams(m)))) => assert!(m.contains("hello"), "{m}"),
        other => panic!("shared-memory socket: {other:?}"),
    }
}

#[test]
fn keys_past_the_batch_limit_are_refused_before_they_are_unpacked() {
    let s = Server::spawn(&[], false, None);
    let xa = {
        let c = RemoteStore::connect(
            s.addr,
            kvtier_l3::ClientOptions {
                token: Some(TOKEN.into()),
                ..Default::default()
            },
        )
        .unwrap();
        SocketAddr::new(s.addr.ip(), c.limits().xfer_port)
    };
    // 60 MiB of empty keys (2 bytes each packed, a 16-byte &str each unpacked).
    let packed = vec![0u8; 60 << 20];
    let n = packed.len() / 2;
    let tenant = t("a");
    for req in [
        XferRequest::Exist {
            tenant: tenant.clone(),
            opts: ExistOptions::default(),
            keys: ByteBuf::from(packed.clone()),
        },
        XferRequest::Get {
            tenant: tenant.clone(),
            keys: ByteBuf::from(packed.clone()),
            caps: Vec::new(),
        },
    ] {
        let mut c = TcpStream::connect(xa).unwrap();
        c.set_read_timeout(Some(PATIENCE)).unwrap();
        write_frame(
            &mut c,
            &XferRequest::Hello {
                token: Some(TOKEN.into()),
            },
        )
        .unwrap();
        assert!(matches!(
            read_frame::<XferReply>(&mut c, 1 << 20),
            Ok(XferReply::Hello(Ok(())))
        ));
        write_frame(&mut c, &req).unwrap();
        let want = format!("{n} keys in one batch; limit is 65536");
        match read_frame::<XferReply>(&mut c, 1 << 20) {
            Ok(XferReply::Exist(Err(L3Error::InvalidParams(m))))
            | Ok(XferReply::Get(Err(L3Error::InvalidParams(m)))) => assert_eq!(m, want),
            other => panic!("{other:?}"),
        }
        // The frame itself (read, then decoded) is what the server held, not a vector of
        // its keys.
        let peak_mib = s.status_kib("VmHWM") >> 10;
        assert!(peak_mib < 320, "server peaked at {peak_mib} MiB");
    }
}

#[test]
fn a_peer_that_does_not_read_its_reply_is_dropped() {
    let store = Arc::new(
        EmbeddedStore::new(StoreConfig {
            local_segment_bytes: 128 << 20,
            ..Default::default()
        })
        .unwrap(),
    );
    let h = spawn_server(
        store,
        ServerOptions {
            xfer_write_timeout: Duration::from_secs(1),
            ..Default::default()
        },
    )
    .unwrap();
    let c = client(h.addr, None);
    let xa = SocketAddr::new(h.addr.ip(), c.limits().xfer_port);
    let a = t("a");
    let (n, size) = (16usize, 4usize << 20);
    let keys: Vec<String> = (0..n).map(|i| format!("pin{i}")).collect();
    let objs: Vec<Vec<u8>> = (0..n).map(|i| payload(i, size)).collect();
    let refs: Vec<&[u8]> = objs.iter().map(Vec::as_slice).collect();
    let r = c
        .batch_put_from(&a, &keys, &refs, PutOptions::default())
        .unwrap();
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    // A 64 MiB reply asked for, and not read.
    let mut s = TcpStream::connect(xa).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    write_frame(&mut s, &XferRequest::Hello { token: None }).unwrap();
    assert!(matches!(
        read_frame::<XferReply>(&mut s, 1 << 20),
        Ok(XferReply::Hello(Ok(())))
    ));
    let req = XferRequest::Get {
        tenant: a.clone(),
        keys: ByteBuf::from(kvtier_l3::rpc::xfer::pack_keys(&keys).unwrap()),
        caps: vec![size as u64; n],
    };
    write_frame(&mut s, &req).unwrap();
    // The server is writing (the first bytes are here); ten times its write timeout later
    // it has given up on this peer.
    let mut first = [0u8; 1];
    assert_eq!(s.peek(&mut first).unwrap(), 1);
    std::thread::sleep(Duration::from_secs(10));
    // So the reply ends short: what the socket buffers held, then the close.
    let mut got = 0usize;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("still open after {got} bytes")
            }
            Err(_) => break,
        }
    }
    assert!(got < n * size, "{got} bytes: the whole reply was sent");
    // Everyone else is still served.
    let mut out = vec![0u8; size];
    let mut bufs = [&mut out[..]];
    let r = c
        .batch_get_into(&a, std::slice::from_ref(&keys[0]), &mut bufs)
        .unwrap();
    assert_eq!(r, vec![Ok(size as u64)]);
    assert_eq!(out, objs[0]);
}
