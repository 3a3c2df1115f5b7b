//! The settle log kept in etcd (`--etcd`): what must survive a failover, fenced by epoch.
//!
//! Why here and only this: object metadata is rebuilt from the nodes' reports when they
//! mount on the new leader (no per-put log); what cannot be rebuilt is the master's own
//! promises — the tombstones and write cancels its nodes have not acknowledged (so a
//! removed key or an old version never comes back), node membership (so the new leader
//! waits for every node before it serves), and the put-token floor (so no token is reused).
//! Those are the entries of the file settle log ([`crate::cluster::state`]); here each
//! batch of them is one etcd key `settles/<seq>`.
//!
//! Fencing: every write is a txn whose only comparison is "the leader key's create revision
//! is my epoch". A deposed master — paused, partitioned, its lease expired — can never
//! commit, so two masters cannot both write in one epoch, and a reply that needed the write
//! never leaves (the caller steps down instead).
//!
//! Bound: when the keys written since the last compaction exceed four times the live
//! entries (and 4096), one txn replaces them all by a snapshot of the live state, and the
//! etcd history before it is compacted, so etcd holds O(unsettled settles + members), not
//! O(operations). The snapshot must fit one etcd request (1.5 MiB by default: about 10,000
//! unsettled settles; nodes acknowledge them within a ping, so it stays far below).

use std::sync::Arc;

use super::election::LeaderLease;
use super::etcd::{Compare, Op};
use crate::cluster::state::{decode, encode};
use crate::error::{L3Error, L3Result};
use crate::master::SettleLogEntry;

/// Below this many appended batches the log is never compacted.
const COMPACT_FLOOR: u64 = 4096;

/// Batch sequence numbers stay below this: far beyond any real log (one batch per settle
/// write), and far from `u64::MAX`, so the next number never wraps onto `settles/0…0`.
pub const MAX_SETTLE_SEQ: u64 = 1 << 62;

/// The sequence number a batch key names: exactly 16 lowercase hex digits (as
/// [`EtcdSettleLog`] writes them) below [`MAX_SETTLE_SEQ`]; anything else is not kvtier's.
fn batch_seq(tail: &[u8]) -> Option<u64> {
    if tail.len() != 16 || !tail.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let seq = u64::from_str_radix(std::str::from_utf8(tail).ok()?, 16).ok()?;
    (seq < MAX_SETTLE_SEQ).then_some(seq)
}

/// The settle log of one leader's epoch.
#[derive(Debug)]
pub struct EtcdSettleLog {
    lease: Arc<LeaderLease>,
    /// Sequence number of the next batch key.
    next: u64,
    /// Batches written since the last compaction.
    appended: u64,
}

impl EtcdSettleLog {
    /// Reads every entry the previous leaders left, in order. A key under the log's prefix
    /// that is not a batch key kvtier writes (16 lowercase hex digits below
    /// [`MAX_SETTLE_SEQ`]) is refused like a corrupt batch: garbage there made the next
    /// sequence number wrap and the log's first batches be overwritten.
    pub fn open(lease: Arc<LeaderLease>) -> L3Result<(Self, Vec<SettleLogEntry>)> {
        let (kvs, _) = lease.etcd().get_prefix(&lease.keys().settles)?;
        let mut entries = Vec::new();
        let mut next = 0;
        for kv in &kvs {
            let seq = kv
                .key
                .strip_prefix(lease.keys().settles.as_slice())
                .and_then(batch_seq)
                .ok_or_else(|| {
                    L3Error::Internal(format!(
                        "etcd settle key {} is not one kvtier writes (16 lowercase hex digits below 2^62)",
                        String::from_utf8_lossy(&kv.key)
                    ))
                })?;
            let (mut e, used) = decode(&kv.value);
            if used != kv.value.len() {
                return Err(L3Error::Internal(format!(
                    "etcd settle batch {} is corrupt",
                    String::from_utf8_lossy(&kv.key)
                )));
            }
            entries.append(&mut e);
            next = next.max(seq + 1);
        }
        Ok((
            EtcdSettleLog {
                lease,
                next,
                appended: kvs.len() as u64,
            },
            entries,
        ))
    }

    fn key(&self, seq: u64) -> Vec<u8> {
        let mut k = self.lease.keys().settles.clone();
        k.extend_from_slice(format!("{seq:016x}").as_bytes());
        k
    }

    /// Whether the next commit should replace the log by a snapshot of `live` entries.
    pub fn wants_compaction(&self, live: usize) -> bool {
        self.appended > COMPACT_FLOOR.max(4 * live as u64)
    }

    /// Writes `entries` (or, with `snapshot`, replaces the whole log by it) in one txn
    /// fenced on the epoch. An error means nothing was written: the caller must not reply.
    pub fn commit(
        &mut self,
        entries: &[SettleLogEntry],
        snapshot: Option<&[SettleLogEntry]>,
    ) -> L3Result<()> {
        if self.next >= MAX_SETTLE_SEQ {
            return Err(L3Error::Internal(format!(
                "the etcd settle log's sequence numbers are exhausted ({})",
                self.next
            )));
        }
        let mut value = Vec::new();
        encode(snapshot.unwrap_or(entries), &mut value)?;
        let mut ops = Vec::with_capacity(2);
        if snapshot.is_some() {
            // Every batch before the snapshot's own key (etcd refuses a txn that deletes
            // and puts one key).
            ops.push(Op::DeleteRange {
                from: self.lease.keys().settles.clone(),
                to: self.key(self.next),
            });
        }
        ops.push(Op::Put {
            key: self.key(self.next),
            value,
            lease: 0,
        });
        let (ok, rev, _) = self.lease.etcd().txn(
            &[Compare::CreateRevision(
                self.lease.keys().leader.clone(),
                self.lease.epoch() as i64,
            )],
            &ops,
            None,
        )?;
        if !ok {
            self.lease.lose();
            return Err(L3Error::NotLeader(format!(
                "epoch {} is over: the settle write was refused",
                self.lease.epoch()
            )));
        }
        self.next += 1;
        self.appended += 1;
        if snapshot.is_some() {
            self.appended = 1;
            // The history before the snapshot is garbage; a failed compaction is retried by
            // the next one.
            if let Err(e) = self.lease.etcd().compact(rev) {
                tracing::warn!(error = %e, "etcd compaction failed");
            }
        }
        Ok(())
    }
}
