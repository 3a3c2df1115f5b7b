//! The master's lock, made durable: [`DurableMaster::lock`] hands out a guard that, when
//! dropped, writes the settle changes made under it to the state dir's log and syncs them
//! before the caller can reply.
//!
//! Why a guard: every reply of the master is computed under its one lock, and a reply must
//! not leave before the settles it implies are durable (a remove answered, then a crash
//! that forgot its tombstone, brought the key back: issue 19). Doing it on drop means no
//! call site can forget it. Order: the changes are appended under the master lock (the log
//! is in the order the master made them), the master lock is released, then the file is
//! synced — concurrent callers share syncs (group commit) and the master is not held
//! during an fsync. An append or sync that fails is fatal: the process aborts rather than
//! answer what it cannot keep (as databases do on a failed fsync); a restart replays the
//! log up to its last whole entry.
//!
//! With `--etcd` the log lives in etcd ([`crate::ha::settles`]): the changes are committed
//! in one txn fenced on the leader's epoch, under the log's lock (taken under the master
//! lock, so the order is the master's), after the master lock is released. A commit that
//! fails means this process may no longer be the leader: it steps down (the CLI restarts
//! it as a candidate) instead of replying.

use std::ops::{Deref, DerefMut};

use parking_lot::{Mutex, MutexGuard};

use std::path::Path;
use std::sync::Arc;

use super::state::SettleLog;
use crate::error::L3Result;
use crate::ha::LeaderLease;
use crate::ha::settles::EtcdSettleLog;
use crate::master::Master;

/// Where the settle log is kept.
#[derive(Debug)]
pub enum SettleBackend {
    /// `--state-dir`: a file, synced.
    File(SettleLog),
    /// `--etcd`: batches in etcd, fenced on the epoch.
    Etcd(EtcdSettleLog),
}

/// The master behind its lock, with its settle log when it has a state dir.
pub(super) struct DurableMaster {
    master: Mutex<Master>,
    log: Option<Mutex<SettleBackend>>,
}

/// A locked master; see the module doc for what dropping it does.
pub(super) struct MasterGuard<'a> {
    g: Option<MutexGuard<'a, Master>>,
    log: Option<&'a Mutex<SettleBackend>>,
}

impl DurableMaster {
    pub(super) fn new(master: Master, log: Option<SettleBackend>) -> Self {
        DurableMaster {
            master: Mutex::new(master),
            log: log.map(Mutex::new),
        }
    }

    /// Closes a file settle log (the master is shut down): its state dir's lock is released
    /// so the dir can be opened again (a restart in the same process), and settles made
    /// after this are not written (logged as errors): the dir may have a new owner.
    pub(super) fn close_log(&self) {
        if let Some(l) = &self.log
            && let SettleBackend::File(f) = &mut *l.lock()
        {
            f.close();
        }
    }

    pub(super) fn lock(&self) -> MasterGuard<'_> {
        MasterGuard {
            g: Some(self.master.lock()),
            log: self.log.as_ref(),
        }
    }
}

/// Where a master keeps its settles.
pub(super) enum Durability<'a> {
    /// In memory only (a restart forgets them).
    Memory,
    /// `--state-dir`: the file settle log.
    Dir(&'a Path),
    /// `--etcd`: in etcd, fenced on this leader's epoch.
    Etcd(Arc<LeaderLease>),
}

/// Opens the settle log `durability` names, replays it into `master`, rewrites it as one
/// snapshot, and starts the rebuild gate (until `rebuild_deadline`). Returns the log and,
/// for etcd, the leader lease calls are gated on.
pub(super) fn open_log(
    master: &mut Master,
    durability: Durability<'_>,
    rebuild_deadline: u64,
) -> L3Result<(Option<SettleBackend>, Option<Arc<LeaderLease>>)> {
    let mut lease = None;
    let log = match durability {
        Durability::Memory => {
            // No durable token floor: a restarted master would count put tokens from 0
            // again, and a put the previous incarnation placed (its writer paused) could
            // then share its token, key and allocation id with a new one: the node took
            // the late bytes for the new put's own (`tests/reused_alloc.rs`). Start above
            // the clock instead, so each incarnation's tokens exceed every earlier one's
            // (unless the clock goes back, or one gave out more than a token per µs).
            master.start_tokens_above(clock_token_floor());
            None
        }
        Durability::Etcd(l) => {
            let (mut log, entries) = EtcdSettleLog::open(l.clone())?;
            let n = entries.len();
            master.set_epoch(l.epoch());
            master.restore_settles(entries);
            master.keep_settle_log();
            log.commit(&[], Some(&master.settle_snapshot()))?;
            master.begin_rebuild(rebuild_deadline);
            tracing::info!(
                epoch = l.epoch(),
                replayed = n,
                unsettled = master.unsettled_total(),
                "settle state replayed from etcd"
            );
            lease = Some(l);
            Some(SettleBackend::Etcd(log))
        }
        Durability::Dir(dir) => {
            let (mut log, entries) = SettleLog::open(dir)?;
            let n = entries.len();
            master.restore_settles(entries);
            master.keep_settle_log();
            log.compact(&master.settle_snapshot())?;
            master.begin_rebuild(rebuild_deadline);
            tracing::info!(
                dir = %dir.display(),
                replayed = n,
                unsettled = master.unsettled_total(),
                "settle log replayed"
            );
            Some(SettleBackend::File(log))
        }
    };
    Ok((log, lease))
}

/// The put token floor of a master without durable state: unix time in microseconds.
fn clock_token_floor() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2))
}

fn fatal(what: &str, e: &dyn std::fmt::Display) -> ! {
    tracing::error!(error = %e, "settle log: {what} failed; aborting");
    eprintln!("kvtier-l3 master: settle log: {what} failed: {e}; aborting");
    std::process::abort()
}

impl Deref for MasterGuard<'_> {
    type Target = Master;
    fn deref(&self) -> &Master {
        // Only `drop` takes it.
        self.g.as_deref().unwrap_or_else(|| unreachable!())
    }
}

impl DerefMut for MasterGuard<'_> {
    fn deref_mut(&mut self) -> &mut Master {
        self.g.as_deref_mut().unwrap_or_else(|| unreachable!())
    }
}

impl Drop for MasterGuard<'_> {
    fn drop(&mut self) {
        let (Some(mut g), Some(log)) = (self.g.take(), self.log) else {
            return;
        };
        if !g.settle_log_pending() {
            return;
        }
        let entries = g.take_settle_log();
        let mut l = log.lock();
        let file = match &mut *l {
            SettleBackend::Etcd(etcd) => {
                let snap = etcd
                    .wants_compaction(g.unsettled_total())
                    .then(|| g.settle_snapshot());
                drop(g);
                if let Err(e) = etcd.commit(&entries, snap.as_deref()) {
                    crate::ha::step_down(&e);
                }
                return;
            }
            SettleBackend::File(f) => f,
        };
        if file.is_closed() {
            // A master already shut down (its server stopped): the state dir may belong to
            // a new master by now, so nothing more is written to it.
            tracing::error!(
                entries = entries.len(),
                "settle log closed (master shut down): settles not written"
            );
            return;
        }
        let must_sync = entries.iter().any(|e| e.needs_sync());
        let synced = match file.append(&entries) {
            Ok(f) => f,
            Err(e) => fatal("append", &e),
        };
        if file.wants_compaction(g.unsettled_total()) {
            // Synced by `compact` itself (the snapshot includes what was just appended).
            if let Err(e) = file.compact(&g.settle_snapshot()) {
                fatal("compaction", &e);
            }
            return;
        }
        drop(l);
        drop(g);
        if must_sync && let Err(e) = synced.sync_data() {
            fatal("sync", &e);
        }
    }
}
