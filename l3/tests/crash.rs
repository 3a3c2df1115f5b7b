//! Crash safety of the SSD tier, end to end: the real `kvtier-l3` server process is killed
//! with SIGKILL at random moments while a client streams puts (persisted or not), forced
//! removes and flushes; it is restarted on the same directory and checked against what the
//! client was told:
//! - every object acknowledged as persisted reads back with its bytes;
//! - every acknowledged remove stays removed (an older version never comes back);
//! - no key ever returns another key's bytes (each payload names its key and version).
//!
//! Why a model of *allowed outcomes* per key: an operation cut short by the kill may or may
//! not have happened, so each key carries the set of states the store may show after a
//! restart (absent, or one of a few versions); an acknowledgement narrows it, a lost reply
//! widens it. After each restart the observed state is checked against the set and becomes
//! the new exact state (it is on disk now).
//!
//! Cycles: `KVTIER_CRASH_CYCLES` (default 300), seed `KVTIER_CRASH_SEED`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

mod common;

use common::t;
use kvtier_l3::{ClientOptions, L3Error, L3Store, PutOptions, RemoteStore, Tenant};

const KEYS: u64 = 48;

struct Server {
    child: Child,
    addr: SocketAddr,
}

fn start(dir: &Path) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"))
        .args(["--listen", "127.0.0.1:0", "--segment-bytes", "268435456"])
        .arg("--ssd-dir")
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
        .unwrap_or_else(|| panic!("server did not start: {line:?}"))
        .parse()
        .unwrap();
    Server { child, addr }
}

fn connect(addr: SocketAddr) -> RemoteStore {
    RemoteStore::connect(
        addr,
        ClientOptions {
            rpc_timeout: Duration::from_secs(60),
            ..Default::default()
        },
    )
    .unwrap()
}

/// Payload of version `v` of key `k`: a 16-byte header naming both, then bytes derived
/// from them, so a read of the wrong key or version is recognised.
fn payload(k: u64, v: u64) -> Vec<u8> {
    let len = 512 + ((k * 7919 + v * 104_729) % 8192) as usize;
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&k.to_le_bytes());
    out.extend_from_slice(&v.to_le_bytes());
    let mut x = k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ v.wrapping_add(1);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(x as u8);
    }
    out
}

fn decode(key: u64, bytes: &[u8]) -> u64 {
    assert!(bytes.len() >= 16, "k{key}: short object");
    let k = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let v = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
    assert_eq!(k, key, "k{key} returned the bytes of k{k}");
    assert_eq!(bytes, payload(k, v), "k{key} v{v}: bytes differ");
    v
}

/// Per key: the states a restart may show (None = absent, Some(v) = version v).
type Model = BTreeMap<u64, BTreeSet<Option<u64>>>;

/// A key never put is absent.
fn absent() -> BTreeSet<Option<u64>> {
    BTreeSet::from([None])
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn lost_reply(e: &L3Error) -> bool {
    matches!(e, L3Error::RpcFail(_) | L3Error::Unavailable(_))
}

/// The client's stream: runs until the server dies under it. Updates `model` as replies
/// arrive.
fn stream(c: RemoteStore, tenant: Tenant, model: Arc<Mutex<Model>>, mut rng: Rng, next_v: u64) {
    let mut v = next_v;
    loop {
        let r = rng.next();
        let k = r % KEYS;
        let key = format!("k{k}");
        let op = (r >> 16) % 10;
        if op < 5 {
            // Put (persisted 2 in 5): widen first, narrow on the reply.
            v += 1;
            let wait = op < 2;
            let before = {
                let mut m = model.lock().unwrap();
                let s = m.entry(k).or_insert_with(absent);
                let before = s.clone();
                s.insert(Some(v));
                before
            };
            let opts = PutOptions {
                wait_persisted: wait,
                ..Default::default()
            };
            let r = c.put(&tenant, &key, &payload(k, v), opts);
            eprintln!("put {key} v{v} wait={wait} -> {r:?}");
            match r {
                Ok(()) => {
                    let mut m = model.lock().unwrap();
                    let s = m.entry(k).or_insert_with(absent);
                    if wait {
                        *s = BTreeSet::from([Some(v)]);
                    }
                }
                Err(e) if lost_reply(&e) => return,
                Err(L3Error::ObjectAlreadyExists) => {
                    model.lock().unwrap().insert(k, before);
                }
                Err(e) => panic!("put {key}: {e:?}"),
            }
        } else if op < 9 {
            model
                .lock()
                .unwrap()
                .entry(k)
                .or_insert_with(absent)
                .insert(None);
            let r = c.remove(&tenant, &key, true);
            eprintln!("remove {key} -> {r:?}");
            match r {
                Ok(()) => {
                    model.lock().unwrap().insert(k, BTreeSet::from([None]));
                }
                Err(L3Error::ObjectNotFound) => {}
                Err(e) if lost_reply(&e) => return,
                Err(e) => panic!("remove {key}: {e:?}"),
            }
        } else {
            match c.flush() {
                Ok(()) => {}
                Err(e) if lost_reply(&e) => return,
                Err(e) => panic!("flush: {e:?}"),
            }
        }
    }
}

/// After a restart: every key shows one of its allowed states; that state becomes exact.
fn verify(c: &RemoteStore, tenant: &Tenant, model: &mut Model, cycle: u64) {
    for (k, allowed) in model.iter_mut() {
        let key = format!("k{k}");
        let seen = match c.get(tenant, &key) {
            Ok(b) => Some(decode(*k, &b)),
            Err(L3Error::ObjectNotFound) => None,
            Err(e) => panic!("cycle {cycle}: get {key}: {e:?}"),
        };
        assert!(
            allowed.contains(&seen),
            "cycle {cycle}: {key} shows {seen:?}, allowed {allowed:?} \
             (Some(v) after an acknowledged remove = resurrected; None after an \
             acknowledged persisted put = lost)"
        );
        *allowed = BTreeSet::from([seen]);
    }
}

#[test]
fn sigkill_during_puts_removes_and_flushes_loses_nothing_acknowledged() {
    let cycles: u64 = std::env::var("KVTIER_CRASH_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let seed: u64 = std::env::var("KVTIER_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_CAFE);
    let d = tempfile::tempdir().unwrap();
    // KVTIER_CRASH_KEEP leaves the directory for inspection after a failure.
    let (dir, _cleanup) = if std::env::var_os("KVTIER_CRASH_KEEP").is_some() {
        let p = d.keep();
        eprintln!("ssd dir kept: {}", p.display());
        (p, None)
    } else {
        (d.path().to_path_buf(), Some(d))
    };
    let tenant = t("crash");
    let model = Arc::new(Mutex::new(Model::new()));
    let mut rng = Rng(seed | 1);
    for cycle in 0..cycles {
        let mut server = start(&dir);
        let c = connect(server.addr);
        verify(&c, &tenant, &mut model.lock().unwrap(), cycle);
        let (m, r) = (model.clone(), Rng(rng.next() | 1));
        let tn = tenant.clone();
        let worker = thread::spawn(move || stream(c, tn, m, r, cycle << 32));
        // Kill somewhere in the first ~40 ms of the stream (it starts right away).
        thread::sleep(Duration::from_micros(rng.next() % 40_000));
        server.child.kill().unwrap();
        server.child.wait().unwrap();
        worker.join().expect("client stream panicked");
    }
    // A last restart checks the final cycle's acknowledgements too.
    let mut server = start(&dir);
    let c = connect(server.addr);
    verify(&c, &tenant, &mut model.lock().unwrap(), cycles);
    server.child.kill().unwrap();
    server.child.wait().unwrap();
}
