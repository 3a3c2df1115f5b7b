//! Threads racing on one store: put / remove(force) / get / batch get on a few shared keys,
//! embedded and over the real tarpc server on loopback, each run under a watchdog.
//!
//! Why: a put whose write fails because a forced remove took its pending object used to
//! re-lock the (non-reentrant) master mutex while still holding it, and the whole store hung.
//! A hang cannot be asserted directly, so the workload runs on its own thread and the test
//! fails if it does not finish within a generous limit. Correctness checks ride along: every
//! error is one of the typed outcomes a race may produce, and a read never returns bytes
//! that are not the key's own.

use std::sync::Arc;
use std::sync::mpsc::channel;
use std::thread;
use std::time::{Duration, Instant};

mod common;

use common::{client, t};
use kvtier_l3::rpc::server::ServerOptions;
use kvtier_l3::{
    EmbeddedStore, L3Error, L3Store, PutOptions, SsdConfig, StoreConfig, spawn_server,
};

const KEYS: usize = 4;
const THREADS: usize = 4;
/// How long the threads race (they stop early after `MAX_OPS` each).
const RACE: Duration = Duration::from_secs(2);
const MAX_OPS: usize = 20_000;
/// Far above the race itself, even on a loaded 2-core machine.
const WATCHDOG: Duration = Duration::from_secs(120);

/// The bytes of key `k` (every version of a key has the same bytes, so any read can be
/// checked).
fn bytes_of(k: usize) -> Vec<u8> {
    (0..4096).map(|j| (k * 37 + j) as u8).collect()
}

fn expected_race_error(e: &L3Error) -> bool {
    matches!(
        e,
        L3Error::ObjectNotFound
            | L3Error::ObjectAlreadyExists
            | L3Error::IllegalClient(_)
            | L3Error::ReplicaIsNotReady
    )
}

/// Races `THREADS` threads on `KEYS` keys, then checks the store still answers.
fn race<S: L3Store + Send + Sync + 'static>(store: Arc<S>) {
    let tenant = t("race");
    let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(|k| format!("k{k}")).collect());
    let start = Instant::now();
    let workers: Vec<_> = (0..THREADS)
        .map(|w| {
            let (store, keys, tenant) = (store.clone(), keys.clone(), tenant.clone());
            thread::spawn(move || {
                let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (w as u64 + 1);
                let mut ops = 0;
                while start.elapsed() < RACE && ops < MAX_OPS {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let k = (x % KEYS as u64) as usize;
                    let key = &keys[k];
                    match (x >> 8) % 4 {
                        0 => {
                            if let Err(e) =
                                store.put(&tenant, key, &bytes_of(k), PutOptions::default())
                            {
                                assert!(expected_race_error(&e), "put {key}: {e:?}");
                            }
                        }
                        1 => {
                            if let Err(e) = store.remove(&tenant, key, true) {
                                assert!(expected_race_error(&e), "remove {key}: {e:?}");
                            }
                        }
                        2 => match store.get(&tenant, key) {
                            Ok(v) => assert_eq!(v, bytes_of(k), "{key} returned foreign bytes"),
                            Err(e) => assert!(expected_race_error(&e), "get {key}: {e:?}"),
                        },
                        _ => {
                            let mut data = vec![0u8; KEYS * 4096];
                            let mut bufs: Vec<&mut [u8]> = data.chunks_mut(4096).collect();
                            let r = store.batch_get_into(&tenant, &keys, &mut bufs).unwrap();
                            for (i, r) in r.iter().enumerate() {
                                match r {
                                    Ok(n) => {
                                        assert_eq!(*n, 4096);
                                        assert_eq!(bufs[i], &bytes_of(i)[..], "k{i} foreign bytes");
                                    }
                                    Err(e) => assert!(expected_race_error(e), "batch k{i}: {e:?}"),
                                }
                            }
                        }
                    }
                    ops += 1;
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a racing thread panicked");
    }
    // The store still serves after the race.
    let _ = store.remove(&tenant, "after", true);
    store
        .put(&tenant, "after", b"still alive", PutOptions::default())
        .unwrap();
    assert_eq!(store.get(&tenant, "after").unwrap(), b"still alive");
}

/// Runs `f` on its own thread; fails the test if it does not finish within [`WATCHDOG`].
fn watchdog(name: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = channel();
    let h = thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(WATCHDOG) {
        Ok(()) => h.join().unwrap(),
        Err(_) if h.is_finished() => {
            // The workload panicked: surface its message.
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
        Err(_) => panic!("{name}: store deadlocked (no progress within {WATCHDOG:?})"),
    }
}

fn dram() -> StoreConfig {
    StoreConfig {
        local_segment_bytes: 64 << 20,
        ..Default::default()
    }
}

#[test]
fn put_remove_get_race_embedded() {
    watchdog("embedded", || {
        race(Arc::new(EmbeddedStore::new(dram()).unwrap()))
    });
}

#[test]
fn put_remove_get_race_embedded_with_ssd() {
    watchdog("embedded+ssd", || {
        let d = tempfile::tempdir().unwrap();
        let cfg = StoreConfig {
            ssd: Some(SsdConfig::new(d.path())),
            ..dram()
        };
        race(Arc::new(EmbeddedStore::new(cfg).unwrap()));
    });
}

#[test]
fn put_remove_get_race_over_the_server() {
    watchdog("server", || {
        let store = Arc::new(EmbeddedStore::new(dram()).unwrap());
        let h = spawn_server(store, ServerOptions::default()).unwrap();
        race(Arc::new(client(h.addr, None)));
        drop(h);
    });
}
