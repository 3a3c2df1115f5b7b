//! Promotion of SSD-only objects to DRAM, triggered by `exist` with `prefetch_to_memory`
//! (seed 000: "Prefetch SSD-Only Objects to DRAM on Exist"), and by reads that hit SSD-only
//! objects when `PromotionConfig::on_hit` is set (Mooncake's `--promotion_on_hit`, see
//! [`on_hit`]).
//!
//! Why: an engine probes L3 a little before it reads; promoting SSD-only keys during the
//! probe turns the later `get` into a DRAM hit. The review of seed 000 named three bugs this
//! module is built not to have:
//! 1. A failed registration left the throttle entry stuck "triggered" until its TTL: here any
//!    failure other than DRAM pressure *removes* the entry and wakes waiters at once.
//! 2. The dedup TTL erased entries that were still in flight: here only terminal entries
//!    (completed / failed) are ever purged; triggered and in-flight ones never expire.
//! 3. `get` polled the master every millisecond while waiting: here a waiter blocks on the
//!    entry's condition variable (no polling) for at most `ssd_get_wait`.
//!
//! How: a bounded queue feeds a fixed pool of worker threads. Each key has at most one
//! throttle entry; DRAM pressure (a promotion that would cross the high watermark) starts a
//! cool-down during which no new promotion is queued.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::clock::{Clock, ms};
use crate::config::PromotionConfig;
use crate::error::{L3Error, L3Result};
use crate::types::Tenant;

pub mod on_hit;

pub use on_hit::{HitCounter, Room};

type Key = (Tenant, String);

/// The work a promotion does (read SSD, verify, register a memory replica, making room as
/// the [`Room`] says).
pub type PromoteFn = Arc<dyn Fn(&Tenant, &str, Room) -> L3Result<()> + Send + Sync>;

/// State of one key in the throttle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromotionState {
    /// Queued, not started.
    Triggered,
    /// A worker is promoting it.
    InFlight,
    /// Promoted (terminal).
    Completed,
    /// Failed under DRAM pressure (terminal; retried after the dedup TTL).
    Failed,
}

impl PromotionState {
    fn terminal(self) -> bool {
        matches!(self, PromotionState::Completed | PromotionState::Failed)
    }
}

#[derive(Debug, Default)]
struct Signal {
    done: Mutex<bool>,
    cv: Condvar,
}

impl Signal {
    fn fire(&self) {
        *self.done.lock() = true;
        self.cv.notify_all();
    }
}

#[derive(Debug)]
struct Entry {
    state: PromotionState,
    since_ms: u64,
    signal: Arc<Signal>,
}

#[derive(Debug, Default)]
struct Throttle {
    entries: HashMap<Key, Entry>,
    cooldown_until_ms: u64,
}

/// What happened to one trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TriggerOutcome {
    /// Queued for a worker.
    Queued,
    /// An entry exists (in flight, or finished within the dedup TTL).
    Deduplicated,
    /// DRAM pressure cool-down is active.
    CoolingDown,
    /// The bounded queue is full.
    QueueFull,
}

/// Counters of the promoter.
#[derive(Debug, Default)]
pub struct PromotionCounters {
    /// Promotions queued.
    pub queued: AtomicU64,
    /// Promotions completed.
    pub completed: AtomicU64,
    /// Promotions failed (any reason).
    pub failed: AtomicU64,
    /// Triggers skipped (dedup, cool-down, queue full).
    pub skipped: AtomicU64,
    /// Times a get blocked on an in-flight promotion.
    pub get_waits: AtomicU64,
}

struct Inner {
    cfg: PromotionConfig,
    clock: Arc<Clock>,
    throttle: Mutex<Throttle>,
    counters: PromotionCounters,
}

/// The promoter: throttle plus bounded worker pool.
pub struct Promoter {
    inner: Arc<Inner>,
    /// Read counts for promotion on hit (None: `PromotionConfig::on_hit` is off).
    hits: Option<HitCounter>,
    tx: Mutex<Option<SyncSender<(Key, Room)>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Promoter {
    /// Starts `cfg.workers` threads running `work`.
    pub fn start(cfg: PromotionConfig, clock: Arc<Clock>, work: PromoteFn) -> L3Result<Self> {
        let hits = cfg.on_hit.then(|| HitCounter::new(cfg.admission_threshold));
        let (tx, rx) = sync_channel::<(Key, Room)>(cfg.queue_len);
        let rx = Arc::new(Mutex::new(rx));
        let inner = Arc::new(Inner {
            cfg,
            clock,
            throttle: Mutex::new(Throttle::default()),
            counters: PromotionCounters::default(),
        });
        let mut workers = Vec::new();
        for i in 0..inner.cfg.workers {
            let inner = inner.clone();
            let rx = rx.clone();
            let work = work.clone();
            let h = std::thread::Builder::new()
                .name(format!("kvtier-l3-promote-{i}"))
                .spawn(move || worker_loop(inner, rx, work))
                .map_err(|e| L3Error::Internal(format!("spawn promoter: {e}")))?;
            workers.push(h);
        }
        Ok(Promoter {
            inner,
            hits,
            tx: Mutex::new(Some(tx)),
            workers: Mutex::new(workers),
        })
    }

    /// Counters.
    pub fn counters(&self) -> &PromotionCounters {
        &self.inner.counters
    }

    /// Starts a DRAM-pressure cool-down.
    pub fn note_pressure(&self) {
        let until = self.inner.clock.now_ms() + ms(self.inner.cfg.pressure_cooldown);
        let mut th = self.inner.throttle.lock();
        th.cooldown_until_ms = th.cooldown_until_ms.max(until);
    }

    /// Triggers promotions of the given SSD-only keys (one throttle pass for the batch); a
    /// probe's promotions never evict ([`Room::Refuse`]), a read's on hit may
    /// ([`Room::EvictSaved`]).
    pub fn trigger_many(&self, keys: Vec<Key>, room: Room) -> Vec<TriggerOutcome> {
        let now = self.inner.clock.now_ms();
        let ttl = ms(self.inner.cfg.dedup_ttl);
        let tx = self.tx.lock().clone();
        let mut out = Vec::with_capacity(keys.len());
        let mut th = self.inner.throttle.lock();
        // Purge only *terminal* entries past the TTL: in-flight ones never expire.
        th.entries
            .retain(|_, e| !(e.state.terminal() && now.saturating_sub(e.since_ms) > ttl));
        let cooling = th.cooldown_until_ms > now;
        for k in keys {
            // A read's promotion on hit replaces a finished entry: the key was admitted again,
            // so it is SSD-only again (evicted since), and its count gates repeats.
            if room == Room::EvictSaved && th.entries.get(&k).is_some_and(|e| e.state.terminal()) {
                th.entries.remove(&k);
            }
            if th.entries.contains_key(&k) {
                out.push(TriggerOutcome::Deduplicated);
                continue;
            }
            if cooling {
                out.push(TriggerOutcome::CoolingDown);
                continue;
            }
            let Some(tx) = &tx else {
                out.push(TriggerOutcome::QueueFull);
                continue;
            };
            th.entries.insert(
                k.clone(),
                Entry {
                    state: PromotionState::Triggered,
                    since_ms: now,
                    signal: Arc::new(Signal::default()),
                },
            );
            match tx.try_send((k, room)) {
                Ok(()) => out.push(TriggerOutcome::Queued),
                Err(TrySendError::Full((k, _))) | Err(TrySendError::Disconnected((k, _))) => {
                    // Nothing will run it: release the entry so a later probe may retry.
                    if let Some(e) = th.entries.remove(&k) {
                        e.signal.fire();
                    }
                    out.push(TriggerOutcome::QueueFull);
                }
            }
        }
        let c = &self.inner.counters;
        for o in &out {
            match o {
                TriggerOutcome::Queued => c.queued.fetch_add(1, Ordering::Relaxed),
                _ => c.skipped.fetch_add(1, Ordering::Relaxed),
            };
        }
        out
    }

    /// Reads found these keys on SSD only: with promotion on hit, counts them and queues
    /// those that reach the admission threshold, allowed to make room
    /// ([`Room::EvictSaved`]). Nothing without it.
    pub fn note_hits(&self, keys: Vec<Key>) {
        let Some(h) = &self.hits else { return };
        if keys.is_empty() {
            return;
        }
        let admitted = h.admit(keys);
        if !admitted.is_empty() {
            // Outcomes are counted by `trigger_many`; a read never waits for them.
            let _ = self.trigger_many(admitted, Room::EvictSaved);
        }
    }

    /// Throttle state of a key (tests, metrics).
    pub fn state(&self, t: &Tenant, key: &str) -> Option<PromotionState> {
        let k = (t.clone(), key.to_string());
        self.inner.throttle.lock().entries.get(&k).map(|e| e.state)
    }

    /// Number of throttle entries (tests).
    pub fn entries(&self) -> usize {
        self.inner.throttle.lock().entries.len()
    }

    /// If a promotion of the key is queued or in flight, blocks on its notification for at
    /// most `ssd_get_wait`. Returns true if it waited and the promotion finished.
    pub fn wait_in_flight(&self, t: &Tenant, key: &str) -> bool {
        self.wait_until(t, key, Instant::now() + self.inner.cfg.ssd_get_wait)
    }

    /// For a batched get: waits for the in-flight promotions of `keys` (index, key) under
    /// *one* deadline, `ssd_get_wait` from now, so a batch waits at most that long in total
    /// rather than that long per key. Returns the indices whose promotion finished.
    pub fn wait_many<'a>(
        &self,
        t: &Tenant,
        keys: impl IntoIterator<Item = (usize, &'a str)>,
    ) -> Vec<usize> {
        let deadline = Instant::now() + self.inner.cfg.ssd_get_wait;
        keys.into_iter()
            .filter(|(_, k)| self.wait_until(t, k, deadline))
            .map(|(i, _)| i)
            .collect()
    }

    fn wait_until(&self, t: &Tenant, key: &str, deadline: Instant) -> bool {
        let k = (t.clone(), key.to_string());
        let signal = {
            let th = self.inner.throttle.lock();
            match th.entries.get(&k) {
                Some(e) if !e.state.terminal() => e.signal.clone(),
                _ => return false,
            }
        };
        let mut done = signal.done.lock();
        if !*done && Instant::now() < deadline {
            self.inner
                .counters
                .get_waits
                .fetch_add(1, Ordering::Relaxed);
            // Timing out is an answer (the get reads the SSD copy), not an error.
            let _ = signal.cv.wait_until(&mut done, deadline);
        }
        *done
    }

    /// Configured wait.
    pub fn ssd_get_wait(&self) -> Duration {
        self.inner.cfg.ssd_get_wait
    }

    /// Stops the workers after the queue drains.
    pub fn shutdown(&self) {
        drop(self.tx.lock().take());
        let ws: Vec<JoinHandle<()>> = std::mem::take(&mut *self.workers.lock());
        for w in ws {
            crate::error::join_logged("promotion worker", w);
        }
    }
}

impl Drop for Promoter {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn worker_loop(inner: Arc<Inner>, rx: Arc<Mutex<Receiver<(Key, Room)>>>, work: PromoteFn) {
    loop {
        let (k, room) = {
            let rx = rx.lock();
            match rx.recv() {
                Ok(k) => k,
                Err(_) => return,
            }
        };
        {
            let mut th = inner.throttle.lock();
            match th.entries.get_mut(&k) {
                Some(e) => {
                    e.state = PromotionState::InFlight;
                    e.since_ms = inner.clock.now_ms();
                }
                None => continue,
            }
        }
        let res = work(&k.0, &k.1, room);
        let now = inner.clock.now_ms();
        let mut th = inner.throttle.lock();
        let signal = match &res {
            Ok(()) => {
                inner.counters.completed.fetch_add(1, Ordering::Relaxed);
                th.entries.get_mut(&k).map(|e| {
                    e.state = PromotionState::Completed;
                    e.since_ms = now;
                    e.signal.clone()
                })
            }
            Err(L3Error::NoAvailableHandle { .. }) => {
                inner.counters.failed.fetch_add(1, Ordering::Relaxed);
                th.cooldown_until_ms = th
                    .cooldown_until_ms
                    .max(now + ms(inner.cfg.pressure_cooldown));
                th.entries.get_mut(&k).map(|e| {
                    e.state = PromotionState::Failed;
                    e.since_ms = now;
                    e.signal.clone()
                })
            }
            Err(_) => {
                // Failed registration (object gone, corrupt copy, ...): release the key's
                // throttle state at once so neither retries nor waiters are held up.
                inner.counters.failed.fetch_add(1, Ordering::Relaxed);
                th.entries.remove(&k).map(|e| e.signal)
            }
        };
        drop(th);
        if let Some(s) = signal {
            s.fire();
        }
    }
}

#[cfg(test)]
mod tests {
    //! Seed 000's review cases, on the real promoter with a controllable work function.
    use super::*;
    use std::sync::mpsc::{Receiver, channel};
    use std::time::Instant;

    fn key(k: &str) -> Key {
        (Tenant::new("t").unwrap(), k.to_string())
    }

    fn cfg() -> PromotionConfig {
        PromotionConfig {
            workers: 1,
            queue_len: 4,
            dedup_ttl: Duration::from_millis(100),
            pressure_cooldown: Duration::from_secs(60),
            ssd_get_wait: Duration::from_millis(300),
            ..PromotionConfig::default()
        }
    }

    /// A work function that blocks until told what to return.
    fn gated() -> (PromoteFn, std::sync::mpsc::Sender<L3Result<()>>) {
        let (tx, rx) = channel::<L3Result<()>>();
        let rx: Arc<Mutex<Receiver<L3Result<()>>>> = Arc::new(Mutex::new(rx));
        let f: PromoteFn = Arc::new(move |_t: &Tenant, _k: &str, _r: Room| {
            rx.lock()
                .recv()
                .unwrap_or(Err(L3Error::Internal("closed".into())))
        });
        (f, tx)
    }

    fn wait_state(p: &Promoter, k: &str, s: Option<PromotionState>) {
        let t = Tenant::new("t").unwrap();
        let t0 = Instant::now();
        while p.state(&t, k) != s {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "state never became {s:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn failed_registration_releases_throttle_state_and_waiters() {
        let clock = Arc::new(Clock::new());
        let (f, gate) = gated();
        let p = Promoter::start(cfg(), clock, f).unwrap();
        assert_eq!(
            p.trigger_many(vec![key("a")], Room::Refuse),
            vec![TriggerOutcome::Queued]
        );
        wait_state(&p, "a", Some(PromotionState::InFlight));
        let t = Tenant::new("t").unwrap();
        let waiter = std::thread::scope(|s| {
            let h = s.spawn(|| {
                let t0 = Instant::now();
                let woke = p.wait_in_flight(&t, "a");
                (woke, t0.elapsed())
            });
            std::thread::sleep(Duration::from_millis(20));
            gate.send(Err(L3Error::ObjectNotFound)).unwrap();
            h.join().unwrap()
        });
        assert!(waiter.0, "waiter must be woken by the failure");
        assert!(
            waiter.1 < Duration::from_millis(250),
            "woken by notification, not timeout"
        );
        wait_state(&p, "a", None);
        // Released: a new trigger is accepted at once (no TTL wait).
        assert_eq!(
            p.trigger_many(vec![key("a")], Room::Refuse),
            vec![TriggerOutcome::Queued]
        );
        gate.send(Ok(())).unwrap();
        wait_state(&p, "a", Some(PromotionState::Completed));
    }

    #[test]
    fn dedup_ttl_never_expires_an_in_flight_promotion() {
        let clock = Arc::new(Clock::new());
        let (f, gate) = gated();
        let p = Promoter::start(cfg(), clock.clone(), f).unwrap();
        p.trigger_many(vec![key("a")], Room::Refuse);
        wait_state(&p, "a", Some(PromotionState::InFlight));
        clock.advance(Duration::from_secs(10));
        assert_eq!(
            p.trigger_many(vec![key("a")], Room::Refuse),
            vec![TriggerOutcome::Deduplicated]
        );
        assert_eq!(
            p.state(&Tenant::new("t").unwrap(), "a"),
            Some(PromotionState::InFlight)
        );
        gate.send(Ok(())).unwrap();
        wait_state(&p, "a", Some(PromotionState::Completed));
        // Terminal entries do expire after the TTL.
        assert_eq!(
            p.trigger_many(vec![key("a")], Room::Refuse),
            vec![TriggerOutcome::Deduplicated]
        );
        clock.advance(Duration::from_millis(200));
        assert_eq!(
            p.trigger_many(vec![key("a")], Room::Refuse),
            vec![TriggerOutcome::Queued]
        );
        gate.send(Ok(())).unwrap();
    }

    #[test]
    fn dram_pressure_starts_a_cooldown() {
        let clock = Arc::new(Clock::new());
        let (f, gate) = gated();
        let p = Promoter::start(cfg(), clock.clone(), f).unwrap();
        p.trigger_many(vec![key("a")], Room::Refuse);
        gate.send(Err(L3Error::NoAvailableHandle { needed: 1 }))
            .unwrap();
        wait_state(&p, "a", Some(PromotionState::Failed));
        assert_eq!(
            p.trigger_many(vec![key("b")], Room::Refuse),
            vec![TriggerOutcome::CoolingDown]
        );
        clock.advance(Duration::from_secs(61));
        assert_eq!(
            p.trigger_many(vec![key("b")], Room::Refuse),
            vec![TriggerOutcome::Queued]
        );
        gate.send(Ok(())).unwrap();
    }

    #[test]
    fn get_wait_is_bounded_and_queue_is_bounded() {
        let clock = Arc::new(Clock::new());
        let (f, gate) = gated();
        let mut c = cfg();
        c.ssd_get_wait = Duration::from_millis(50);
        let p = Promoter::start(c, clock, f).unwrap();
        let t = Tenant::new("t").unwrap();
        // Not in flight: no wait at all.
        assert!(!p.wait_in_flight(&t, "zzz"));
        let out = p.trigger_many(
            (0..10).map(|i| key(&format!("k{i}"))).collect(),
            Room::Refuse,
        );
        // One worker busy + 4 queued; the rest dropped and released.
        let queued = out.iter().filter(|o| **o == TriggerOutcome::Queued).count();
        assert!((4..=5).contains(&queued), "{out:?}");
        assert!(out.contains(&TriggerOutcome::QueueFull));
        let t0 = Instant::now();
        assert!(!p.wait_in_flight(&t, "k0"));
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(45) && waited < Duration::from_millis(500));
        for _ in 0..10 {
            let _ = gate.send(Ok(()));
        }
    }

    /// A batched get of keys whose promotions are all stalled blocks once, until one shared
    /// deadline, not once per key (which multiplied `ssd_get_wait` by the batch size).
    #[test]
    fn a_batch_waits_under_one_deadline() {
        let clock = Arc::new(Clock::new());
        let (f, gate) = gated();
        let p = Promoter::start(cfg(), clock, f).unwrap();
        let t = Tenant::new("t").unwrap();
        let keys: Vec<String> = (0..5).map(|i| format!("k{i}")).collect();
        // k0 in flight on the one worker (gated), then k1..k4 fill the queue.
        assert_eq!(
            p.trigger_many(vec![key("k0")], Room::Refuse),
            vec![TriggerOutcome::Queued]
        );
        wait_state(&p, "k0", Some(PromotionState::InFlight));
        let out = p.trigger_many(keys[1..].iter().map(|k| key(k)).collect(), Room::Refuse);
        assert!(out.iter().all(|o| *o == TriggerOutcome::Queued), "{out:?}");
        let done = p.wait_many(&t, keys.iter().enumerate().map(|(i, k)| (i, k.as_str())));
        let waits = p.counters().get_waits.load(Ordering::Relaxed);
        // Release the worker before asserting, so a failure does not hang the drop.
        for _ in 0..5 {
            let _ = gate.send(Ok(()));
        }
        assert!(done.is_empty(), "nothing finished: {done:?}");
        assert_eq!(
            waits, 1,
            "the first stalled key used up the batch's wait; the others did not wait again"
        );
    }
}
