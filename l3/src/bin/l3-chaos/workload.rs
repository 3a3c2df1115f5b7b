//! The clients: worker threads that put, read and remove their own keys through
//! [`RemoteStore`] while processes die under them, and the loss-journal reader.
//!
//! Why a lazy connection: a worker may start while the master is down; once connected,
//! `RemoteStore` redials a restarted server by itself, as a production client's does, so the
//! store keeps being exercised across every restart.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvtier_l3::ha::Locator;
use kvtier_l3::{
    ClientOptions, L3Error, L3Store, LossCursor, PutOptions, RemoteStore, ReplicateConfig, Tenant,
};

use crate::oracle::{KeyState, Read, Rng, Shared, Violation, payload};

pub fn tenant() -> Tenant {
    Tenant::new("chaos").unwrap_or_else(|_| unreachable!("a valid tenant name"))
}

pub fn key_name(key_id: u32) -> String {
    format!("chaos-{key_id}")
}

/// A connection made on first use (the server may be down when a worker starts).
pub struct Conn {
    addr: Locator,
    store: Option<RemoteStore>,
    /// The last call found the server down or rebuilding (-900 / -1010).
    down: bool,
    counts: Arc<Counts>,
}

impl Conn {
    pub fn new(addr: Locator, counts: Arc<Counts>) -> Self {
        Conn {
            addr,
            store: None,
            down: false,
            counts,
        }
    }

    /// Runs `f` on the connection, connecting first if needed.
    pub fn call<T>(
        &mut self,
        f: impl FnOnce(&RemoteStore) -> Result<T, L3Error>,
    ) -> Result<T, L3Error> {
        if self.store.is_none() {
            let opts = ClientOptions {
                rpc_timeout: Duration::from_secs(5),
                ..Default::default()
            };
            match RemoteStore::connect_to(self.addr.clone(), opts) {
                Ok(s) => self.store = Some(s),
                Err(e) => {
                    self.down = true;
                    return Err(e);
                }
            }
        }
        let started = Instant::now();
        let r = match &self.store {
            Some(s) => f(s),
            None => Err(L3Error::RpcFail("not connected".into())),
        };
        self.counts.timed(started.elapsed());
        self.down = matches!(r, Err(L3Error::RpcFail(_) | L3Error::Unavailable(_)));
        r
    }
}

/// Counters of what the workers did.
#[derive(Default)]
pub struct Counts {
    pub puts_acked: AtomicU64,
    pub puts_persisted: AtomicU64,
    pub puts_failed: AtomicU64,
    pub removes_acked: AtomicU64,
    pub reads_checked: AtomicU64,
    pub reads_failed: AtomicU64,
    pub misses: AtomicU64,
    /// The longest call (not judged: a call waits up to the client's failover timeout,
    /// 30 s, for a new leader to serve, and a read from a paused node's shared memory
    /// waits for the node).
    pub longest_call_ms: AtomicU64,
}

impl Counts {
    fn timed(&self, took: Duration) {
        let ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
        self.longest_call_ms.fetch_max(ms, Ordering::Relaxed);
    }
}

/// One worker's settings.
pub struct Worker {
    pub addr: Locator,
    pub first_key: u32,
    pub keys: u32,
    pub max_bytes: usize,
    pub persisted_is_durable: bool,
    pub seed: u64,
    /// Set by the fault thread for a remove burst: only removes (they go to the master
    /// alone, so no worker waits on a node that is about to be paused).
    pub burst: Arc<AtomicBool>,
}

/// The keys a worker owns, with their models (read back by the final checks).
pub type Keys = Vec<(u32, KeyState)>;

/// Reads one key and checks the answer; transport errors are counted, not judged.
pub fn read_and_check(
    conn: &mut Conn,
    key_id: u32,
    st: &KeyState,
    shared: &Shared,
    counts: &Counts,
) -> Result<(), L3Error> {
    let t = tenant();
    let k = key_name(key_id);
    let r = conn.call(|s| s.get(&t, &k));
    let verdict = match &r {
        Ok(b) => st.check(key_id, Read::Bytes(b)),
        Err(L3Error::ObjectNotFound) => st.check(key_id, Read::NotFound),
        Err(_) => {
            counts.reads_failed.fetch_add(1, Ordering::Relaxed);
            return r.map(|_| ());
        }
    };
    counts.reads_checked.fetch_add(1, Ordering::Relaxed);
    let mut f = lock(&shared.findings);
    match verdict {
        Ok(Some(miss)) => {
            counts.misses.fetch_add(1, Ordering::Relaxed);
            f.misses.push(miss);
        }
        Ok(None) => {}
        Err(v) => {
            let got = match &r {
                Ok(b) => crate::oracle::decode(key_id, b).map_or_else(
                    || format!("{} undecodable bytes", b.len()),
                    |w| format!("version {w}"),
                ),
                Err(e) => e.to_string(),
            };
            tracing::warn!(key = %k, violation = ?v, read = %got, "violation");
            f.record(v, key_id, format!("{k}: read {got}, model {st:?}"));
        }
    }
    Ok(())
}

/// The worker loop: until `stop`, pick a key and put, read or remove it.
pub fn run(w: Worker, stop: Arc<AtomicBool>, shared: Arc<Shared>, counts: Arc<Counts>) -> Keys {
    let mut rng = Rng::new(w.seed);
    let mut keys: Keys = (w.first_key..w.first_key + w.keys)
        .map(|k| (k, KeyState::default()))
        .collect();
    let mut conn = Conn::new(w.addr, counts.clone());
    let t = tenant();
    while !stop.load(Ordering::Relaxed) {
        if w.burst.load(Ordering::Relaxed) {
            let from = rng.below(keys.len() as u64) as usize;
            let n = keys.len();
            match (0..n)
                .map(|j| (from + j) % n)
                .find(|&j| keys[j].1.present.is_some() || !keys[j].1.maybe.is_empty())
            {
                Some(j) => {
                    let (key_id, st) = &mut keys[j];
                    remove(&mut conn, *key_id, st, &shared, &counts);
                }
                None => std::thread::sleep(Duration::from_millis(1)),
            }
            continue;
        }
        let i = rng.below(keys.len() as u64) as usize;
        let (key_id, st) = &mut keys[i];
        let key_id = *key_id;
        let k = key_name(key_id);
        let dice = rng.below(100);
        let remove_it = match st.present {
            Some(_) => dice < 15,
            // Versions that may exist (unknown outcomes): remove them now and then, so the
            // key gets back to a known state.
            None => !st.maybe.is_empty() && dice < 20,
        };
        if remove_it {
            remove(&mut conn, key_id, st, &shared, &counts);
        } else if st.present.is_none() && dice < 60 {
            // Where the loss journal ends now: a loss of this version is an entry past it.
            let from = match conn.call(|s| s.losses_since(&t, None)) {
                Ok(l) => l.next,
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let v = st.new_version();
            let len = 64 + rng.below(w.max_bytes as u64) as usize;
            let data = payload(key_id, v, len);
            let replicas = 1 + rng.below(3) as u32;
            let wait_persisted = rng.below(3) == 0;
            let opts = PutOptions {
                soft_pin: false,
                wait_persisted,
            };
            match conn
                .call(|s| s.put_with(&t, &k, &data, opts, ReplicateConfig::replicas(replicas)))
            {
                Ok(()) => {
                    let durable = wait_persisted && w.persisted_is_durable;
                    st.put_acked(v, durable, Some(from));
                    counts.puts_acked.fetch_add(1, Ordering::Relaxed);
                    if durable {
                        counts.puts_persisted.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(L3Error::ObjectAlreadyExists) => {
                    // Something is stored that the model may not know of (a pending put of
                    // an earlier failed call, or a version that came back): read it.
                    counts.puts_failed.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = read_and_check(&mut conn, key_id, st, &shared, &counts) {
                        tracing::debug!(error = %e, "read after -705 failed");
                    }
                }
                Err(_) => {
                    st.put_unknown(v);
                    counts.puts_failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        } else if let Err(e) = read_and_check(&mut conn, key_id, st, &shared, &counts) {
            tracing::debug!(error = %e, "read failed");
        }
        if conn.down || rng.below(64) == 0 {
            // Down or rebuilding: do not spin on a server that cannot answer yet.
            std::thread::sleep(Duration::from_millis(if conn.down { 10 } else { 1 }));
        }
    }
    keys
}

/// Removes a key (forced: a read lease must not block it) and updates its model.
fn remove(conn: &mut Conn, key_id: u32, st: &mut KeyState, shared: &Shared, counts: &Counts) {
    let t = tenant();
    let k = key_name(key_id);
    match conn.call(|s| s.remove(&t, &k, true)) {
        Ok(()) => {
            st.removed();
            counts.removes_acked.fetch_add(1, Ordering::Relaxed);
        }
        Err(L3Error::ObjectNotFound) => {
            if let Some(m) = st.remove_not_found(key_id) {
                counts.misses.fetch_add(1, Ordering::Relaxed);
                lock(&shared.findings).misses.push(m);
            }
        }
        Err(_) => st.remove_unknown(),
    }
}

/// Reads the loss journal every `poll` until `stop`, noting when each report arrived.
pub fn read_losses(
    addr: Locator,
    poll: Duration,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
    counts: Arc<Counts>,
) {
    let t = tenant();
    let mut conn = Conn::new(addr, counts);
    let mut cursor: Option<LossCursor> = None;
    loop {
        let done = stop.load(Ordering::Relaxed);
        match conn.call(|s| s.losses_since(&t, cursor)) {
            Ok(l) => {
                let now = Instant::now();
                let mut r = lock(&shared.reports);
                if l.overflowed {
                    r.overflows.push(now);
                }
                let from = cursor.filter(|_| !l.overflowed);
                r.heard(from, l.keys, l.next, now);
                cursor = Some(l.next);
                if done {
                    return;
                }
            }
            // Connected or not, a reader that cannot read when asked to stop has reported
            // what it could; the final check counts anything it missed as unreported.
            Err(_) if done => return,
            Err(_) => {}
        }
        std::thread::sleep(poll);
    }
}

/// Counts a violation (for the final checks).
pub fn record(shared: &Shared, v: Violation, key_id: u32, what: String) {
    lock(&shared.findings).record(v, key_id, what);
}

/// Locks, whether or not a thread panicked while holding it (the counts stay usable).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
