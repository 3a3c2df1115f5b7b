//! Leader election on etcd: one leader key under a lease, its create revision the epoch.
//!
//! Why a lease and a create-if-absent txn (not a home-made protocol): etcd already decides
//! who holds the key, and its create revision only grows, so it is a fencing token for free.
//! The winner's key value is empty until it listens; it then writes its address there
//! (`publish`, fenced on its own epoch) so clients and nodes find it.
//!
//! How the leader knows it still is: [`LeaderLease`] keeps `valid_until`, moved forward only
//! by keep-alives that succeeded, to *the time the keep-alive was sent* plus TTL minus a
//! margin. etcd expires the lease no earlier than TTL after it received that keep-alive, so
//! every moment this process believes it leads, the key is still its own: no other master
//! can have won (two masters serving one epoch — or overlapping epochs — is impossible by
//! construction). The clock is monotonic and keeps running while the process is stopped
//! (SIGSTOP), so a paused leader that resumes knows at once it is no longer valid.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::etcd::{Compare, Etcd, Op};
use crate::error::{L3Error, L3Result};

/// The etcd keys of one kvtier cluster.
#[derive(Debug, Clone)]
pub struct ClusterKeys {
    /// `/kvtier/<cluster>/leader`: the leader's address, under its lease.
    pub leader: Vec<u8>,
    /// `/kvtier/<cluster>/settles/`: the durable settle state, fenced by the epoch.
    pub settles: Vec<u8>,
    /// `/kvtier/<cluster>/tenants`: the tenant quotas every leader enforces.
    pub tenants: Vec<u8>,
    /// `/kvtier/<cluster>/token`: the hex digest of the shared-secret token (never the
    /// token itself) every leader checks hellos against.
    pub token: Vec<u8>,
}

impl ClusterKeys {
    /// The keys of cluster `name` (letters, digits, `-`, `_`, `.`; 1..=64 bytes).
    pub fn new(name: &str) -> L3Result<Self> {
        let ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !ok {
            return Err(L3Error::InvalidParams(format!(
                "cluster name {name:?}: use 1 to 64 letters, digits, '-', '_' or '.'"
            )));
        }
        Ok(ClusterKeys {
            leader: format!("/kvtier/{name}/leader").into_bytes(),
            settles: format!("/kvtier/{name}/settles/").into_bytes(),
            tenants: format!("/kvtier/{name}/tenants").into_bytes(),
            token: format!("/kvtier/{name}/token").into_bytes(),
        })
    }
}

/// What one leader key holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderView {
    /// The leader's RPC address (None: elected, not listening yet).
    pub addr: Option<std::net::SocketAddr>,
    /// Its epoch (the key's create revision).
    pub epoch: u64,
}

/// Reads the current leader (None: no leader elected).
pub fn read_leader(etcd: &Etcd, keys: &ClusterKeys) -> L3Result<Option<LeaderView>> {
    Ok(etcd.get(&keys.leader)?.map(|kv| LeaderView {
        addr: std::str::from_utf8(&kv.value)
            .ok()
            .and_then(|s| s.parse().ok()),
        epoch: kv.create_revision.max(0) as u64,
    }))
}

/// The leader lease TTLs a master accepts, in seconds (`--leader-ttl-s`).
///
/// Why 3,600 at most: the TTL is how long a dead (SIGKILLed, partitioned) leader keeps the
/// cluster without a master, so an hour is already far past any useful value; etcd itself
/// would grant up to 9,000,000,000 s and refuse more, which left a master campaigning
/// forever. Why 1 at least: etcd leases are whole seconds (etcd raises a TTL below its own
/// minimum, which only makes this leader's view of its lease more cautious).
pub const LEADER_TTL_S: std::ops::RangeInclusive<u64> = 1..=3600;

/// The leader lease TTL for `secs` (a typed -600 outside [`LEADER_TTL_S`]).
pub fn leader_ttl(secs: u64) -> L3Result<Duration> {
    if !LEADER_TTL_S.contains(&secs) {
        return Err(L3Error::InvalidParams(format!(
            "the leader lease TTL must be {} to {} seconds, got {secs}",
            LEADER_TTL_S.start(),
            LEADER_TTL_S.end()
        )));
    }
    Ok(Duration::from_secs(secs))
}

/// Longest a standby waits between two looks at the leader key, whatever the TTL: how soon a
/// resigned leader is replaced, and how soon an elected master serves, never grow with the
/// TTL (at TTL/10 they took 30 s at TTL 300, 6 minutes at TTL 3,600).
pub const MAX_POLL: Duration = Duration::from_millis(500);

/// How often candidates and standbys look at the leader key: TTL/10, between 50 ms and
/// [`MAX_POLL`].
pub fn poll_interval(ttl: Duration) -> Duration {
    (ttl / 10).clamp(Duration::from_millis(50), MAX_POLL)
}

/// The safety margin kept between this process's view of its lease and etcd's: a leader
/// acts until `keep-alive sent + TTL - margin` (public for the fencing model test).
pub fn margin(ttl: Duration) -> Duration {
    (ttl / 5).max(Duration::from_millis(100))
}

/// This process's leadership: its epoch and how long it may still act on it.
#[derive(Debug)]
pub struct LeaderLease {
    etcd: Arc<Etcd>,
    keys: ClusterKeys,
    lease: i64,
    epoch: u64,
    ttl: Duration,
    valid_until: Mutex<Instant>,
    lost: AtomicBool,
}

impl LeaderLease {
    /// The epoch: the leader key's create revision.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The keys of its cluster.
    pub fn keys(&self) -> &ClusterKeys {
        &self.keys
    }

    /// The etcd client.
    pub fn etcd(&self) -> &Arc<Etcd> {
        &self.etcd
    }

    /// Ok while this process may act as the leader; a typed `NotLeader` once its lease may
    /// have expired (checked on every call the master serves).
    pub fn check(&self) -> L3Result<()> {
        if !self.lost.load(Ordering::Acquire) && Instant::now() < *self.valid_until.lock() {
            return Ok(());
        }
        self.lost.store(true, Ordering::Release);
        Err(L3Error::NotLeader(format!(
            "epoch {} ended: this master could not renew its etcd lease",
            self.epoch
        )))
    }

    /// Marks the leadership lost (a fenced write failed).
    pub fn lose(&self) {
        self.lost.store(true, Ordering::Release);
    }

    /// Writes this leader's address into the leader key (fenced on its epoch).
    pub fn publish(&self, addr: std::net::SocketAddr) -> L3Result<()> {
        let (ok, _, _) = self.etcd.txn(
            &[Compare::CreateRevision(
                self.keys.leader.clone(),
                self.epoch as i64,
            )],
            &[Op::Put {
                key: self.keys.leader.clone(),
                value: addr.to_string().into_bytes(),
                lease: self.lease,
            }],
            None,
        )?;
        if !ok {
            self.lose();
            return Err(L3Error::NotLeader(format!(
                "epoch {} is over before it could publish",
                self.epoch
            )));
        }
        Ok(())
    }

    /// One keep-alive: on success moves `valid_until`; returns false once the lease is gone
    /// or has run out here.
    pub fn renew(&self) -> bool {
        let sent = Instant::now();
        match self.etcd.keep_alive(self.lease) {
            Ok(ttl) if ttl > 0 => {
                let mut v = self.valid_until.lock();
                *v = (*v).max(sent + self.ttl - margin(self.ttl));
            }
            Ok(_) => {
                tracing::warn!(epoch = self.epoch, "etcd lease is gone");
                self.lose();
            }
            Err(e) => tracing::warn!(epoch = self.epoch, error = %e, "lease keep-alive failed"),
        }
        self.check().is_ok()
    }

    /// Keeps the lease alive every TTL/3 on a thread of its own, and calls `on_lost` once
    /// the leadership is lost (the caller stops serving: the CLI restarts as a candidate).
    pub fn spawn_keeper(
        self: &Arc<Self>,
        on_lost: impl FnOnce() + Send + 'static,
    ) -> L3Result<std::thread::JoinHandle<()>> {
        let me = self.clone();
        std::thread::Builder::new()
            .name("kvtier-l3-lease".into())
            .spawn(move || {
                let period = me.ttl / 3;
                loop {
                    let t0 = Instant::now();
                    if !me.renew() {
                        on_lost();
                        return;
                    }
                    // Wake early enough to notice the deadline even when etcd is silent.
                    let until_invalid = me
                        .valid_until
                        .lock()
                        .saturating_duration_since(Instant::now());
                    std::thread::sleep(
                        period
                            .saturating_sub(t0.elapsed())
                            .min(until_invalid + Duration::from_millis(1)),
                    );
                }
            })
            .map_err(|e| L3Error::Internal(format!("spawn lease keeper: {e}")))
    }

    /// Gives the leadership up now (graceful shutdown): the next master need not wait for
    /// the TTL.
    pub fn resign(&self) {
        self.lose();
        // Unrevoked, the lease (and the leader key) expires after its TTL.
        crate::error::best_effort("revoke the leader lease", self.etcd.revoke(self.lease));
    }
}

/// Campaigns until this process holds the leader key (polling every [`poll_interval`] while
/// another master holds it, or `stop` turns true: then `Ok(None)`). The TTL must be whole
/// seconds within [`LEADER_TTL_S`] (a typed -600 otherwise).
pub fn campaign(
    etcd: Arc<Etcd>,
    keys: ClusterKeys,
    ttl: Duration,
    stop: &AtomicBool,
) -> L3Result<Option<Arc<LeaderLease>>> {
    if ttl.subsec_nanos() != 0 {
        return Err(L3Error::InvalidParams(format!(
            "the leader lease TTL must be a whole number of seconds, got {ttl:?}"
        )));
    }
    leader_ttl(ttl.as_secs())?;
    let poll = poll_interval(ttl);
    let mut last_err = None;
    while !stop.load(Ordering::Acquire) {
        let sent = Instant::now();
        let lease = match etcd.grant(ttl.as_secs()) {
            Ok(l) => l,
            Err(e) => {
                if last_err.as_ref() != Some(&e.to_string()) {
                    tracing::warn!(error = %e, "campaign: etcd unavailable");
                    last_err = Some(e.to_string());
                }
                std::thread::sleep(poll);
                continue;
            }
        };
        let won = etcd.txn(
            &[Compare::CreateRevision(keys.leader.clone(), 0)],
            &[Op::Put {
                key: keys.leader.clone(),
                value: Vec::new(),
                lease,
            }],
            None,
        );
        match won {
            Ok((true, rev, _)) => {
                let me = LeaderLease {
                    etcd,
                    keys,
                    lease,
                    epoch: rev.max(0) as u64,
                    ttl,
                    valid_until: Mutex::new(sent + ttl - margin(ttl)),
                    lost: AtomicBool::new(false),
                };
                tracing::info!(epoch = me.epoch, "elected leader");
                return Ok(Some(Arc::new(me)));
            }
            Ok((false, ..)) => {}
            Err(e) => tracing::warn!(error = %e, "campaign txn failed"),
        }
        crate::error::best_effort("revoke the campaign lease", etcd.revoke(lease));
        std::thread::sleep(poll);
    }
    Ok(None)
}
