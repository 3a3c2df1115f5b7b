//! Split deployment with real processes on 127.0.0.1 (ephemeral ports) and real temp dirs:
//! `kvtier-l3 --role master` plus `--role node` processes. Bytes live on the nodes, metadata
//! on the master; a `kill -9`ed node loses its memory replicas (-704 once the master's TTL
//! passes) while its SSD replicas stay registered and are readable again after it restarts
//! with the same SSD directory; the master keeps serving throughout; bad requests on either
//! process get typed errors.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

mod common;

use common::procs::{eventually, master, master_in, node};
use common::{client, payload, persisted, t};
use kvtier_l3::rpc::xfer::{XferClient, XferReply, XferRequest, read_frame, write_frame};
use kvtier_l3::{
    ClientId, ClientOptions, ExistOptions, L3Error, L3Store, PutOptions, RemoteStore, Tenant,
};

fn holder(c: &RemoteStore, tn: &Tenant, key: &str) -> ClientId {
    c.get_replica_list(tn, key).unwrap().replicas[0]
        .node()
        .expect("descriptor names a node")
        .id
}

#[test]
fn killed_node_loses_memory_replicas_and_gets_its_ssd_ones_back() {
    let m = master(&["--client-ttl-ms", "1000"], None);
    let d = tempfile::tempdir().unwrap();
    let n1 = node(m.addr, 1, None, None); // DRAM only
    let n2 = node(m.addr, 2, Some(d.path()), None); // DRAM + SSD write-through
    let c = client(m.addr, None);
    assert!(c.is_cluster());
    let a = t("a");
    let keys: Vec<String> = (0..16).map(|i| format!("k{i}")).collect();
    let objs: Vec<Vec<u8>> = (0..16).map(|i| payload(i, 64 * 1024 + i)).collect();
    for (k, o) in keys.iter().zip(&objs) {
        c.put(&a, k, o, persisted()).unwrap();
    }
    // Batched put too (placed, written and ended per node).
    let more: Vec<String> = (0..8).map(|i| format!("b{i}")).collect();
    let refs: Vec<&[u8]> = objs[..8].iter().map(Vec::as_slice).collect();
    assert!(
        c.batch_put_from(&a, &more, &refs, persisted())
            .unwrap()
            .iter()
            .all(Result::is_ok)
    );
    // Reads through the master's descriptors, from the nodes.
    for (k, o) in keys.iter().zip(&objs) {
        assert_eq!(&c.get(&a, k).unwrap(), o, "{k}");
    }
    let mut data = vec![0u8; 16 * 70_000];
    let mut bufs: Vec<&mut [u8]> = data.chunks_mut(70_000).collect();
    let r = c.batch_get_into(&a, &keys, &mut bufs).unwrap();
    for (i, res) in r.iter().enumerate() {
        assert_eq!(*res, Ok(objs[i].len() as u64));
        assert_eq!(&bufs[i][..objs[i].len()], &objs[i][..]);
    }
    // The master spread the objects over both nodes; node 2's also have an SSD replica.
    let on1: Vec<&String> = keys
        .iter()
        .filter(|k| holder(&c, &a, k) == ClientId(1))
        .collect();
    let on2: Vec<&String> = keys
        .iter()
        .filter(|k| holder(&c, &a, k) == ClientId(2))
        .collect();
    assert!(!on1.is_empty() && !on2.is_empty(), "{on1:?} {on2:?}");
    for k in &on2 {
        assert_eq!(c.get_replica_list(&a, k).unwrap().replicas.len(), 2);
    }
    // Tenant isolation holds across the split.
    assert_eq!(c.get(&t("b"), "k0").unwrap_err().code_i32(), -704);
    assert!(!c.is_exist(&t("b"), "k0").unwrap());

    // kill -9 both nodes: no flush, no goodbye.
    let mut n1 = n1;
    let mut n2 = n2;
    n1.child.kill().unwrap();
    n2.child.kill().unwrap();
    n1.child.wait().unwrap();
    n2.child.wait().unwrap();
    let k1 = on1[0].clone();
    // Both nodes' TTLs must have run out (each expires on its own schedule: waiting for node
    // 1's keys alone let a read of node 2's key still try its listed memory replica, -900).
    assert!(
        eventually(Duration::from_secs(10), || c
            .get(&a, &k1)
            .is_err_and(|e| e.code_i32() == -704)
            && c.stats().is_ok_and(|s| s.mem_capacity_bytes == 0)),
        "memory replicas of the dead nodes must be dropped after the TTL"
    );
    // The master keeps serving during the outage.
    for k in &on1 {
        assert_eq!(c.get(&a, k).unwrap_err().code_i32(), -704, "{k}");
        assert!(!c.is_exist(&a, k).unwrap());
    }
    for k in &on2 {
        assert!(c.is_exist(&a, k).unwrap(), "SSD replica stays registered");
        assert_eq!(
            c.get(&a, k).unwrap_err().code_i32(),
            -1010,
            "its node is down"
        );
    }
    let st = c.stats().unwrap();
    assert_eq!(st.mem_objects, 0);
    assert_eq!(st.mem_capacity_bytes, 0);
    assert_eq!(
        c.put(&a, "nowhere", b"x", PutOptions::default())
            .unwrap_err()
            .code_i32(),
        -200,
        "no live node, no room"
    );

    // Removed while its node is down: the tombstone waits at the master for the restart.
    let removed = on2[0].clone();
    c.remove(&a, &removed, true).unwrap();
    let on2 = &on2[1..];

    // Node 2 restarts from the same SSD directory (new process, new port).
    let _n2 = node(m.addr, 2, Some(d.path()), None);
    assert_eq!(
        c.get(&a, &removed).unwrap_err().code_i32(),
        -704,
        "a key removed during the outage stays removed"
    );
    for k in on2 {
        let i: usize = k[1..].parse().unwrap();
        assert_eq!(c.get(&a, k).unwrap(), objs[i], "{k} after restart");
        let q = c.get_replica_list(&a, k).unwrap();
        assert!(matches!(
            q.replicas[..],
            [kvtier_l3::ReplicaDescriptor::Disk { .. }]
        ));
    }
    for k in &on1 {
        assert_eq!(c.get(&a, k).unwrap_err().code_i32(), -704);
    }
    // And it takes new puts.
    c.put(&a, "after", b"restart", PutOptions::default())
        .unwrap();
    assert_eq!(c.get(&a, "after").unwrap(), b"restart");
    c.flush().unwrap();
}

#[test]
fn split_two_phase_put_leases_and_typed_errors() {
    let tok = Some("s3cret");
    let m = master(
        &[
            "--max-batch-keys",
            "16",
            "--max-object-bytes",
            "1048576",
            "--lease-ms",
            "2000",
        ],
        tok,
    );
    let n = node(m.addr, 7, None, tok);
    // Wrong or missing token: -601 (the node refuses it too).
    let e = RemoteStore::connect(
        m.addr,
        ClientOptions {
            token: Some("wrong".into()),
            ..Default::default()
        },
    )
    .err()
    .unwrap();
    assert_eq!(e.code_i32(), -601);
    assert_eq!(
        XferClient::connect(n.addr, None, 1 << 20, std::time::Duration::from_secs(30))
            .err()
            .unwrap()
            .code_i32(),
        -601
    );
    let c = client(m.addr, tok);
    let a = t("a");

    // Two-phase put over the split: first writer wins, end needs the bytes, revoke frees.
    let h = c.put_start(&a, "two", 3).unwrap();
    assert_eq!(h.replica.node().unwrap().addr, n.addr);
    assert_eq!(c.put_start(&a, "two", 3).unwrap_err().code_i32(), -705);
    assert_eq!(
        c.put_end(&h, PutOptions::default()).unwrap_err().code_i32(),
        -703
    );
    assert_eq!(c.put_write(&h, b"toolong").unwrap_err().code_i32(), -600);
    c.put_write(&h, b"abc").unwrap();
    c.put_end(&h, PutOptions::default()).unwrap();
    assert_eq!(c.get(&a, "two").unwrap(), b"abc");
    assert_eq!(
        c.put_end(&h, PutOptions::default()).unwrap_err().code_i32(),
        -705
    );
    let r = c.put_start(&a, "gone", 4).unwrap();
    c.put_revoke(&r).unwrap();
    assert_eq!(c.get(&a, "gone").unwrap_err().code_i32(), -704);
    c.put(&a, "gone", b"back", PutOptions::default()).unwrap();

    // Limits: client-side and master-side -600.
    let many: Vec<String> = (0..17).map(|i| format!("k{i}")).collect();
    assert_eq!(c.batch_is_exist(&a, &many).unwrap_err().code_i32(), -600);
    assert_eq!(
        c.put(&a, "big", &vec![0u8; (1 << 20) + 1], PutOptions::default())
            .unwrap_err()
            .code_i32(),
        -600
    );
    assert_eq!(
        c.put_start(&a, "big", 4 << 20).unwrap_err().code_i32(),
        -600
    );
    assert_eq!(c.get(&a, "").unwrap_err().code_i32(), -400);

    // Leases: -706 on remove, -707 for a query result reused after its lease.
    let ks = vec!["two".to_string(), "gone".to_string()];
    let qs: Vec<_> = c
        .batch_query(&a, &ks)
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(c.remove(&a, "two", false).unwrap_err().code_i32(), -706);
    let mut data = [0u8; 16];
    let mut bufs: Vec<&mut [u8]> = data.chunks_mut(8).collect();
    let r = c.batch_get_with_query(&a, &qs, &mut bufs).unwrap();
    assert_eq!(r, vec![Ok(3), Ok(4)]);
    assert_eq!(&bufs[1][..4], b"back");
    // the lease (2 s: three calls must fit in it on a loaded machine) runs out
    std::thread::sleep(Duration::from_millis(2100));
    let r = c.batch_get_with_query(&a, &qs, &mut bufs).unwrap();
    assert_eq!(
        r,
        vec![Err(L3Error::LeaseExpired), Err(L3Error::LeaseExpired)]
    );
    c.remove(&a, "two", false).unwrap();
    assert_eq!(c.get(&a, "two").unwrap_err().code_i32(), -704);
    assert!(c.is_exist(&a, "gone").unwrap());
    assert_eq!(
        c.batch_exist_key(&a, &ks, ExistOptions::default()).unwrap(),
        vec![Ok(false), Ok(true)]
    );

    // The node: garbage, oversized frames, requests before hello, metadata calls, and a
    // forged descriptor naming another tenant's object all get typed errors.
    let mut s = TcpStream::connect(n.addr).unwrap();
    s.write_all(&8u32.to_le_bytes()).unwrap();
    s.write_all(&[0xEE; 8]).unwrap();
    let reply: XferReply = read_frame(&mut s, 1 << 20).unwrap();
    assert!(
        matches!(reply, XferReply::Get(Err(L3Error::InvalidParams(_)))),
        "{reply:?}"
    );
    let mut s = TcpStream::connect(n.addr).unwrap();
    s.write_all(&u32::MAX.to_le_bytes()).unwrap();
    let reply: XferReply = read_frame(&mut s, 1 << 20).unwrap();
    assert!(matches!(
        reply,
        XferReply::Get(Err(L3Error::InvalidParams(_)))
    ));
    let mut s = TcpStream::connect(n.addr).unwrap();
    write_frame(&mut s, &XferRequest::NodeFlush).unwrap();
    let reply: XferReply = read_frame(&mut s, 1 << 20).unwrap();
    assert!(matches!(
        reply,
        XferReply::Get(Err(L3Error::IllegalClient(_)))
    ));
    let mut x = XferClient::connect(
        n.addr,
        tok.map(str::to_string),
        1 << 20,
        std::time::Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(
        x.exist(&a, &["gone".to_string()], ExistOptions::default())
            .unwrap_err()
            .code_i32(),
        -1010
    );
    let q = c.get_replica_list(&a, "gone").unwrap();
    let mut buf = [0u8; 8];
    let r = x
        .node_read(
            &t("b"),
            &["gone".to_string()],
            &q.replicas,
            &mut [&mut buf[..]],
        )
        .unwrap();
    assert_eq!(r[0].as_ref().unwrap_err().code_i32(), -704);
    assert_eq!(buf, [0u8; 8], "no foreign byte leaked");
    // A frame of garbage to the master: that connection closes, the master keeps serving.
    let mut s = TcpStream::connect(m.addr).unwrap();
    s.write_all(&[0, 0, 0, 16]).unwrap();
    s.write_all(&[0xFF; 16]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 64];
    assert!(matches!(s.read(&mut b), Ok(0) | Err(_)));
    // Both still serve.
    assert_eq!(c.get(&a, "gone").unwrap(), b"back");
    let c2 = client(m.addr, tok);
    assert_eq!(c2.get(&a, "gone").unwrap(), b"back");
    assert_eq!(c2.remove_all(&a, true).unwrap(), 1);
}

#[test]
fn sigterm_on_a_node_flushes_and_leaves() {
    let m = master(&["--client-ttl-ms", "60000"], None);
    let d = tempfile::tempdir().unwrap();
    let mut n = node(m.addr, 3, Some(d.path()), None);
    let c = client(m.addr, None);
    let a = t("a");
    let ks: Vec<String> = (0..32).map(|i| format!("k{i}")).collect();
    let objs: Vec<Vec<u8>> = (0..32).map(|i| payload(i, 32 * 1024)).collect();
    let refs: Vec<&[u8]> = objs.iter().map(Vec::as_slice).collect();
    // Not waited for: the SIGTERM flush makes them durable and registered.
    c.batch_put_from(&a, &ks, &refs, PutOptions::default())
        .unwrap();
    let pid = n.child.id() as libc::pid_t;
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    assert!(n.child.wait().unwrap().success());
    // Left gracefully: memory replicas gone at once (the TTL is a minute), SSD ones stay.
    let st = c.stats().unwrap();
    assert_eq!((st.mem_objects, st.disk_objects), (0, 32), "{st:?}");
    let _n = node(m.addr, 3, Some(d.path()), None);
    for (k, o) in ks.iter().zip(&objs) {
        assert_eq!(&c.get(&a, k).unwrap(), o);
    }
    // A corrupted SSD copy on a node is a miss (and dropped at the master), never bytes.
    let q = c.get_replica_list(&a, "k0").unwrap();
    let Some(kvtier_l3::ReplicaDescriptor::Disk { bucket, offset, .. }) = q.replicas.first() else {
        panic!("expected an SSD replica, got {q:?}");
    };
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(kvtier_l3::ssd::bucket::bucket_path(d.path(), *bucket))
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0xA5; 8], *offset).unwrap();
    drop(f);
    assert_eq!(c.get(&a, "k0").unwrap_err().code_i32(), -704);
    assert!(!c.is_exist(&a, "k0").unwrap());
    assert_eq!(&c.get(&a, "k1").unwrap(), &objs[1]);
}

#[test]
fn restarted_master_gets_ssd_replicas_back_from_its_nodes() {
    let state = tempfile::tempdir().unwrap();
    let m = master_in("127.0.0.1:0", state.path(), &[], None);
    let addr = m.addr;
    let d = tempfile::tempdir().unwrap();
    let _n = node(addr, 4, Some(d.path()), None);
    let a = t("a");
    let objs: Vec<Vec<u8>> = (0..8).map(|i| payload(i, 16 * 1024)).collect();
    {
        let c = client(addr, None);
        for (i, o) in objs.iter().enumerate() {
            c.put(&a, &format!("k{i}"), o, persisted()).unwrap();
        }
    }
    // The master dies with all its metadata and comes back on the same address.
    drop(m);
    let _m = master_in(&addr.to_string(), state.path(), &[], None);
    let c = client(addr, None);
    // The node's next ping is answered "remount": it mounts again, reports the DRAM replicas
    // it kept (adopted, each with its SSD record of the same bytes) and re-registers its SSD
    // records, so every object is found again, in memory and on SSD (issue 22).
    assert!(
        eventually(Duration::from_secs(10), || c
            .is_exist(&a, "k7")
            .unwrap_or(false)),
        "node did not re-register with the restarted master"
    );
    for (i, o) in objs.iter().enumerate() {
        assert_eq!(&c.get(&a, &format!("k{i}")).unwrap(), o);
    }
    let st = c.stats().unwrap();
    assert_eq!((st.objects, st.mem_objects, st.disk_objects), (8, 8, 8));
}
