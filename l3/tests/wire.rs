//! The tarpc server on loopback (ephemeral ports), real client, real binary: data path,
//! leases over the wire, tenant isolation, token, limits, malformed / oversized frames,
//! metrics, SIGTERM flush and a killed node process restarting from its SSD buckets.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::{client, payload, persisted, t};
use kvtier_l3::rpc::client::ClientOptions;
use kvtier_l3::rpc::server::ServerOptions;
use kvtier_l3::rpc::service::{L3RpcClient, PROTOCOL_VERSION};
use kvtier_l3::{
    EmbeddedStore, ExistOptions, L3Error, L3Store, PutOptions, QueryResult, RemoteStore, SsdConfig,
    StoreConfig, Tenant, spawn_server,
};

/// Keys `k0` .. `k{n-1}`.
fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("k{i}")).collect()
}

/// The objects as the slices `batch_put_from` takes.
fn slices(objs: &[Vec<u8>]) -> Vec<&[u8]> {
    objs.iter().map(|v| v.as_slice()).collect()
}

/// `batch_query`, every key expected to be found.
fn query_all(c: &RemoteStore, tenant: &Tenant, keys: &[String]) -> Vec<QueryResult> {
    c.batch_query(tenant, keys)
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

/// A store with `bytes` of DRAM and the other settings at their defaults.
fn dram(bytes: u64) -> StoreConfig {
    StoreConfig {
        local_segment_bytes: bytes,
        ..Default::default()
    }
}

fn server(cfg: StoreConfig, token: Option<&str>) -> kvtier_l3::ServerHandle {
    let store = Arc::new(EmbeddedStore::new(cfg).unwrap());
    spawn_server(
        store,
        ServerOptions {
            token: token.map(str::to_string),
            metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn data_path_leases_and_isolation_over_the_wire() {
    let h = server(dram(256 << 20), None);
    let c = client(h.addr, None);
    let (a, b) = (t("a"), t("b"));
    // Big batch: 64 x 1 MiB = 64 MiB, far above tarpc's 8 MiB default frame.
    let ks = keys(64);
    let objs: Vec<Vec<u8>> = (0..64).map(|i| payload(i, 1 << 20)).collect();
    let refs = slices(&objs);
    assert!(
        c.batch_put_from(&a, &ks, &refs, PutOptions::default())
            .unwrap()
            .iter()
            .all(Result::is_ok)
    );
    let mut data = vec![0u8; 64 << 20];
    let mut bufs: Vec<&mut [u8]> = data.chunks_mut(1 << 20).collect();
    let r = c.batch_get_into(&a, &ks, &mut bufs).unwrap();
    assert!(r.iter().all(|x| *x == Ok(1 << 20)));
    for (i, buf) in bufs.iter().enumerate() {
        assert!(buf[..] == objs[i][..], "object {i} differs");
    }
    // Two-phase put over the wire, first writer wins.
    let hd = c.put_start(&a, "two", 3).unwrap();
    assert_eq!(c.put_start(&a, "two", 3).unwrap_err().code_i32(), -705);
    c.put_write(&hd, b"abc").unwrap();
    c.put_end(&hd, PutOptions::default()).unwrap();
    assert_eq!(c.get(&a, "two").unwrap(), b"abc");
    // Tenant isolation.
    assert!(!c.is_exist(&b, "two").unwrap());
    assert_eq!(c.get(&b, "two").unwrap_err().code_i32(), -704);
    assert_eq!(c.remove(&b, "two", true).unwrap_err().code_i32(), -704);
    // Leases: -706 on remove, then BatchQuery + get with one expired.
    assert_eq!(c.remove(&a, "two", false).unwrap_err().code_i32(), -706);
    let qs = query_all(&c, &a, &ks[..2]);
    let mut bufs2: Vec<&mut [u8]> = data.chunks_mut(1 << 20).take(2).collect();
    let r = c.batch_get_with_query(&a, &qs, &mut bufs2).unwrap();
    assert_eq!(r, vec![Ok(1 << 20), Ok(1 << 20)]);
    h.store().clock().advance(Duration::from_secs(11));
    let fresh = c
        .batch_query(&a, &ks[1..2])
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    let r = c
        .batch_get_with_query(&a, &[qs[0].clone(), fresh], &mut bufs2)
        .unwrap();
    assert_eq!(r[0], Err(L3Error::LeaseExpired));
    assert_eq!(r[1], Ok(1 << 20));
    // Exists, sizes, ping, remove_all.
    let ex = c.batch_exist_key(&a, &ks, ExistOptions::default()).unwrap();
    assert!(ex.iter().all(|x| *x == Ok(true)));
    assert_eq!(c.get_size(&a, "k3").unwrap(), 1 << 20);
    c.mount_segment(kvtier_l3::ClientId(9), kvtier_l3::SegmentId(9), 1 << 20)
        .unwrap();
    assert_eq!(
        c.ping(kvtier_l3::ClientId(9)).unwrap(),
        kvtier_l3::ClientStatus::Ok
    );
    assert_eq!(c.remove_all(&a, true).unwrap(), 65);
    assert_eq!(c.stats().unwrap().objects, 0);
}

#[test]
fn token_and_limits_are_typed_errors() {
    let h = server(
        StoreConfig {
            max_batch_keys: 16,
            max_object_bytes: 1 << 20,
            ..dram(8 << 20)
        },
        Some("s3cret"),
    );
    let e = RemoteStore::connect(
        h.addr,
        ClientOptions {
            token: Some("wrong".into()),
            ..Default::default()
        },
    )
    .err()
    .unwrap();
    assert_eq!(e.code_i32(), -601);
    assert!(RemoteStore::connect(h.addr, ClientOptions::default()).is_err());
    let c = client(h.addr, Some("s3cret"));
    let a = t("a");
    let many = keys(17);
    assert_eq!(c.batch_is_exist(&a, &many).unwrap_err().code_i32(), -600);
    assert_eq!(
        c.put(&a, "big", &vec![0u8; (1 << 20) + 1], PutOptions::default())
            .unwrap_err()
            .code_i32(),
        -600
    );
    // The server enforces its limits itself, for clients that skip the checks.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let transport = tarpc::serde_transport::tcp::connect(
            h.addr,
            tarpc::tokio_serde::formats::Bincode::default,
        )
        .await
        .unwrap();
        let raw = L3RpcClient::new(tarpc::client::Config::default(), transport).spawn();
        let ctx = tarpc::context::current;
        // No hello yet: refused.
        let r = raw
            .batch_exist(ctx(), a.clone(), vec!["x".into()], ExistOptions::default())
            .await
            .unwrap();
        assert_eq!(r.unwrap_err().code_i32(), -601);
        raw.hello(ctx(), Some("s3cret".into()), PROTOCOL_VERSION)
            .await
            .unwrap()
            .unwrap();
        let r = raw
            .batch_exist(ctx(), a.clone(), many.clone(), ExistOptions::default())
            .await
            .unwrap();
        assert_eq!(r.unwrap_err().code_i32(), -600);
        let hd = raw
            .put_start(ctx(), a.clone(), "k".into(), 4 << 20)
            .await
            .unwrap();
        assert_eq!(hd.unwrap_err().code_i32(), -600);
    });
    assert!(c.is_exist(&a, "k0").is_ok());
}

/// The server closed `s`: a read returns end of stream or fails (5 s timeout).
fn assert_closed(s: &mut TcpStream) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 64];
    assert!(
        matches!(s.read(&mut buf), Ok(0) | Err(_)),
        "connection must be closed"
    );
}

#[test]
fn malformed_and_oversized_frames_do_not_take_the_server_down() {
    let h = server(dram(8 << 20), None);
    let c = client(h.addr, None);
    let a = t("a");
    c.put(&a, "k", b"still here", PutOptions::default())
        .unwrap();
    // A frame of garbage.
    let mut s = TcpStream::connect(h.addr).unwrap();
    s.write_all(&[0, 0, 0, 16]).unwrap();
    s.write_all(&[0xFF; 16]).unwrap();
    assert_closed(&mut s);
    // A frame header announcing 1 GiB (above the frame limit).
    let mut s = TcpStream::connect(h.addr).unwrap();
    s.write_all(&(1u32 << 30).to_be_bytes()).unwrap();
    assert_closed(&mut s);
    // A truncated connection.
    let mut s = TcpStream::connect(h.addr).unwrap();
    s.write_all(&[0, 0, 1]).unwrap();
    drop(s);
    // Existing and new clients still served.
    assert_eq!(c.get(&a, "k").unwrap(), b"still here");
    let c2 = client(h.addr, None);
    assert_eq!(c2.get(&a, "k").unwrap(), b"still here");
}

#[test]
fn metrics_endpoint_on_loopback() {
    let h = server(dram(8 << 20), None);
    let c = client(h.addr, None);
    let a = t("a");
    c.put(&a, "k", b"v", PutOptions::default()).unwrap();
    c.get(&a, "k").unwrap();
    let _ = c.get(&a, "missing");
    let maddr = h.metrics_addr.unwrap();
    assert!(maddr.ip().is_loopback());
    let mut s = TcpStream::connect(maddr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200"));
    assert!(
        body.contains("kvtier_l3_hits_total{tier=\"memory\"} 1"),
        "{body}"
    );
    assert!(body.contains("kvtier_l3_misses_total 1"));
    assert!(body.contains("kvtier_l3_op_latency_seconds_count{op=\"get\"}"));
}

// ---- the real binary -------------------------------------------------------------------

struct Node {
    child: Child,
    addr: SocketAddr,
}

fn start_node(dir: &std::path::Path) -> Node {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--segment-bytes",
            "67108864",
            "--ssd-dir",
        ])
        .arg(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("LISTENING ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    Node { child, addr }
}

impl Node {
    /// SIGKILL: no flush, no goodbye.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

#[test]
fn killed_node_restarts_with_ssd_replicas_and_no_memory_ones() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    let node = start_node(d.path());
    {
        let c = client(node.addr, None);
        for i in 0..16 {
            c.put(&a, &format!("k{i}"), &payload(i, 256 * 1024), persisted())
                .unwrap();
        }
        let st = c.stats().unwrap();
        assert_eq!((st.mem_objects, st.disk_objects), (16, 16));
    }
    node.kill(); // SIGKILL: no flush, no goodbye.
    let node = start_node(d.path());
    let c = client(node.addr, None);
    let st = c.stats().unwrap();
    assert_eq!(st.mem_objects, 0, "memory replicas died with the process");
    assert_eq!(
        st.disk_objects, 16,
        "every acknowledged SSD replica re-registered"
    );
    for i in 0..16 {
        assert_eq!(c.get(&a, &format!("k{i}")).unwrap(), payload(i, 256 * 1024));
    }
    node.kill();
}

#[test]
fn sigterm_flushes_queued_writes() {
    let d = tempfile::tempdir().unwrap();
    let a = t("a");
    let mut node = start_node(d.path());
    {
        let c = client(node.addr, None);
        let ks = keys(64);
        let objs: Vec<Vec<u8>> = (0..64).map(|i| payload(i, 64 * 1024)).collect();
        let refs = slices(&objs);
        c.batch_put_from(&a, &ks, &refs, PutOptions::default())
            .unwrap();
    }
    let pid = node.child.id() as libc::pid_t;
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    let status = node.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let node = start_node(d.path());
    let c = client(node.addr, None);
    for i in 0..64 {
        assert_eq!(
            c.get(&a, &format!("k{i}")).unwrap(),
            payload(i, 64 * 1024),
            "k{i}"
        );
    }
    node.kill();
}

#[test]
fn ssd_backed_server_serves_disk_hits_remotely() {
    let d = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        ssd: Some(SsdConfig::new(d.path())),
        ..dram(1 << 20)
    };
    let h = server(cfg, None);
    let c = client(h.addr, None);
    let a = t("a");
    for i in 0..8 {
        c.put(&a, &format!("k{i}"), &payload(i, 256 * 1024), persisted())
            .unwrap();
    }
    // Only ~3 fit in 1 MiB of DRAM: the rest come from SSD.
    for i in 0..8 {
        assert_eq!(c.get(&a, &format!("k{i}")).unwrap(), payload(i, 256 * 1024));
    }
    let st = c.stats().unwrap();
    assert!(st.mem_objects < 8 && st.disk_objects == 8, "{st:?}");
}

#[test]
fn tarpc_only_path_and_transfer_channel_agree() {
    let h = server(dram(64 << 20), Some("tok"));
    let fast = client(h.addr, Some("tok"));
    let slow = RemoteStore::connect(
        h.addr,
        ClientOptions {
            token: Some("tok".into()),
            use_transfer_channel: false,
            ..Default::default()
        },
    )
    .unwrap();
    assert_ne!(fast.limits().xfer_port, 0);
    let a = t("a");
    let ks = keys(32);
    let objs: Vec<Vec<u8>> = (0..32).map(|i| payload(i, 100_000 + i)).collect();
    let refs = slices(&objs);
    slow.batch_put_from(&a, &ks, &refs, PutOptions::default())
        .unwrap();
    let mut probe = ks.clone();
    probe.push("absent".into());
    let e1 = fast.batch_is_exist(&a, &probe).unwrap();
    let e2 = slow.batch_is_exist(&a, &probe).unwrap();
    assert_eq!(e1, e2);
    assert_eq!(e1.last(), Some(&Ok(false)));
    for c in [&fast, &slow] {
        let mut data = vec![0u8; 33 * 100_100];
        let mut bufs: Vec<&mut [u8]> = data.chunks_mut(100_100).collect();
        // One buffer too small: -10 for that key only.
        bufs[5] = &mut [];
        let r = c.batch_get_into(&a, &probe, &mut bufs).unwrap();
        assert_eq!(r[5].as_ref().unwrap_err().code_i32(), -10);
        assert_eq!(r[32].as_ref().unwrap_err().code_i32(), -704);
        for i in (0..32).filter(|&i| i != 5) {
            assert_eq!(r[i], Ok((100_000 + i) as u64));
            assert_eq!(&bufs[i][..100_000 + i], &objs[i][..]);
        }
        let qs = query_all(c, &a, &ks[..4]);
        let mut bufs4: Vec<&mut [u8]> = data.chunks_mut(100_100).take(4).collect();
        let r = c.batch_get_with_query(&a, &qs, &mut bufs4).unwrap();
        assert!(r.iter().all(Result::is_ok));
    }
}

#[test]
fn transfer_channel_rejects_bad_token_malformed_and_oversized_frames() {
    use kvtier_l3::rpc::xfer::{XferClient, XferReply, read_frame};
    let h = server(dram(8 << 20), Some("tok"));
    let c = client(h.addr, Some("tok"));
    let a = t("a");
    c.put(&a, "k", b"v", PutOptions::default()).unwrap();
    let xa = SocketAddr::new(h.addr.ip(), c.limits().xfer_port);
    assert_eq!(
        XferClient::connect(
            xa,
            Some("bad".into()),
            1 << 20,
            std::time::Duration::from_secs(30)
        )
        .err()
        .unwrap()
        .code_i32(),
        -601
    );
    assert_eq!(
        XferClient::connect(xa, None, 1 << 20, std::time::Duration::from_secs(30))
            .err()
            .unwrap()
            .code_i32(),
        -601
    );
    // Garbage body: typed error reply, then the connection closes.
    let mut s = TcpStream::connect(xa).unwrap();
    s.write_all(&8u32.to_le_bytes()).unwrap();
    s.write_all(&[0xEE; 8]).unwrap();
    let reply: XferReply = read_frame(&mut s, 1 << 20).unwrap();
    assert!(
        matches!(reply, XferReply::Get(Err(L3Error::InvalidParams(_)))),
        "{reply:?}"
    );
    // Oversized frame announcement: typed error reply, connection closed.
    let mut s = TcpStream::connect(xa).unwrap();
    s.write_all(&u32::MAX.to_le_bytes()).unwrap();
    let reply: XferReply = read_frame(&mut s, 1 << 20).unwrap();
    assert!(matches!(
        reply,
        XferReply::Get(Err(L3Error::InvalidParams(_)))
    ));
    // Requests before hello are refused.
    let mut s = TcpStream::connect(xa).unwrap();
    kvtier_l3::rpc::xfer::write_frame(
        &mut s,
        &kvtier_l3::rpc::xfer::XferRequest::Exist {
            tenant: a.clone(),
            opts: ExistOptions::default(),
            keys: serde_bytes::ByteBuf::from(kvtier_l3::rpc::xfer::pack_keys(&["k"]).unwrap()),
        },
    )
    .unwrap();
    let reply: XferReply = read_frame(&mut s, 1 << 20).unwrap();
    assert!(matches!(
        reply,
        XferReply::Get(Err(L3Error::IllegalClient(_)))
    ));
    // The server still serves.
    assert!(c.is_exist(&a, "k").unwrap());
    assert_eq!(c.get(&a, "k").unwrap(), b"v");
}

/// A client's object limit is what one frame carries, not only the server's setting: with
/// the defaults (1 GiB objects, 64 MiB frames) a client reported 1 GiB, the engines checked
/// their page or chunk against that at startup (`kvtier.l3_limits.object_refusal`), and
/// then every put of a 64 MiB chunk failed with -600. An object of the reported size puts
/// and reads back under the longest key; one byte more is refused before it is sent.
#[test]
fn a_clients_object_limit_is_what_one_frame_carries() {
    let h = server(dram(160 << 20), None);
    let c = client(h.addr, None);
    let most = c.max_object_bytes();
    assert!(most < 64 << 20 && most > 63 << 20, "{most}");
    let tn = t("a");
    let key = "k".repeat(kvtier_l3::types::MAX_KEY_LEN);
    let obj = payload(1, most as usize);
    c.put(&tn, &key, &obj, PutOptions::default()).unwrap();
    assert_eq!(c.get(&tn, &key).unwrap(), obj);
    let mut back = vec![0u8; most as usize];
    assert_eq!(c.get_into(&tn, &key, &mut back).unwrap(), most);
    assert!(back == obj);
    let over = payload(2, most as usize + 1);
    assert!(
        matches!(
            c.put(&tn, "over", &over, PutOptions::default()),
            Err(L3Error::InvalidParams(_))
        ),
        "an object past the limit"
    );
}
