//! The shared-memory tests' fixtures: clients with a chosen mode and staging size, store
//! nodes, a raw client of a shared-memory socket (a server's or a store node's) for the
//! hostile tests (hello, requests, registration of memfd segments the test fills and
//! inspects), and what `/proc` says of a process's shared memory.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use super::procs::{Proc, node_with};
use kvtier_l3::rpc::shm::segment::{Mapping, send_fd};
use kvtier_l3::rpc::shm::{ShmOffer, ShmRange, ShmReply, ShmRequest};
use kvtier_l3::rpc::xfer::{read_frame, write_frame};
use kvtier_l3::{ClientOptions, L3Error, RemoteStore, ShmMode};

/// A client of `addr` with shared memory `shm` and a staging segment of `staging` bytes.
pub fn shm_client(addr: SocketAddr, shm: ShmMode, staging: usize) -> RemoteStore {
    RemoteStore::connect(
        addr,
        ClientOptions {
            shm,
            shm_staging_bytes: staging,
            ..Default::default()
        },
    )
    .unwrap()
}

/// A `--role node` of master `m` with a 64 MiB segment (and `extra` flags).
pub fn shm_node(m: &Proc, id: u64, extra: &[&str]) -> Proc {
    let mut a = vec!["--segment-bytes", "67108864"];
    a.extend(extra);
    node_with(m.addr, id, None, None, &a)
}

/// Size of the test segments.
pub const SEG: usize = 1 << 16;

pub struct Raw(pub UnixStream);

impl Raw {
    /// Connects and says hello (the nonce must be the offer's).
    pub fn open(offer: &ShmOffer, token: Option<&str>) -> Raw {
        let mut r = Raw(UnixStream::connect(&offer.path).unwrap());
        match r.call(&ShmRequest::Hello {
            token: token.map(str::to_string),
        }) {
            ShmReply::Hello(Ok(n)) => assert_eq!(n, offer.nonce),
            other => panic!("hello: {other:?}"),
        }
        r
    }

    pub fn call(&mut self, req: &ShmRequest) -> ShmReply {
        write_frame(&mut self.0, req).unwrap();
        read_frame(&mut self.0, 1 << 20).unwrap()
    }

    /// The per-key results of a put-shaped request (`Put`, `PutAt`, `NodePut`).
    pub fn put_reply(&mut self, req: &ShmRequest) -> Result<Vec<Result<(), L3Error>>, L3Error> {
        match self.call(req) {
            ShmReply::Put(r) => r,
            other => panic!("put: {other:?}"),
        }
    }

    /// The per-key results of a get-shaped request (`Get`, `GetAt`, `NodeRead`).
    pub fn get_reply(&mut self, req: &ShmRequest) -> Result<Vec<Result<u64, L3Error>>, L3Error> {
        match self.call(req) {
            ShmReply::Get(r) => r,
            other => panic!("get: {other:?}"),
        }
    }

    pub fn register(&mut self, len: u64, fd: &OwnedFd) -> Result<u32, L3Error> {
        write_frame(&mut self.0, &ShmRequest::Register { len }).unwrap();
        send_fd(&self.0, fd).unwrap();
        match read_frame(&mut self.0, 1 << 20).unwrap() {
            ShmReply::Registered(r) => r,
            other => panic!("register: {other:?}"),
        }
    }
}

pub fn rng(seg: u32, off: u64, len: u64) -> ShmRange {
    ShmRange { seg, off, len }
}

/// A fresh segment of [`SEG`] bytes, every one `byte`.
pub fn filled(byte: u8) -> Mapping {
    let m = Mapping::create("kvtier-shm-test", SEG).unwrap();
    // SAFETY: our own fresh mapping.
    unsafe { m.bytes_mut(0, SEG) }.fill(byte);
    m
}

/// Whether every byte of `m` is still `byte`.
pub fn all(m: &Mapping, byte: u8) -> bool {
    // SAFETY: our own mapping, no other reference alive.
    unsafe { m.bytes(0, SEG) }.iter().all(|&b| b == byte)
}

/// Lines of `/proc/<pid>/maps` naming one of the client memfds (`kvtier-shm-*`).
pub fn mapped_memfds(pid: u32) -> usize {
    mapped(pid, "kvtier-shm")
}

/// Lines of `/proc/<pid>/maps` naming a memfd whose name starts with `name`.
pub fn mapped(pid: u32, name: &str) -> usize {
    let pat = format!("memfd:{name}");
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(&pat))
        .count()
}

/// A `kB` field of `/proc/<pid>/status` (0 when absent).
pub fn status_kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}
