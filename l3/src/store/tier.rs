//! Glue between the master's metadata and the SSD tier.
//!
//! Why: the SSD tier knows buckets and records, the master knows objects and replicas; each
//! crossing (an evicted object staged for offload, a written bucket registered, a disk bucket
//! evicted, a promotion back to DRAM, a corrupt record, a removed object) must update both
//! sides in an order that survives a crash. This module holds those crossings; the tier's
//! callbacks reach the store through a weak handle so they never keep it alive.
//!
//! Invariants:
//! - A corrupt SSD copy is dropped from the master and tombstoned; readers see a miss (-704).
//! - An acknowledged remove tombstones the object's SSD copies durably (queued writes are
//!   cancelled first), so it survives a crash at any point of the write.

use std::sync::{Arc, Weak};

use crate::error::{L3Error, L3Result};
use crate::master::{DiskLoc, EvictionOutcome, LOCAL_NODE, Removed};
use crate::metrics::Metrics;
use crate::promotion::Room;
use crate::ssd::{OffloadJob, Registration, TierHooks};
use crate::types::Tenant;

use super::Inner;

pub(super) struct Hooks(pub(super) Weak<Inner>);

impl TierHooks for Hooks {
    fn register(&self, items: &[(&OffloadJob, DiskLoc)]) -> Vec<Registration> {
        let Some(inner) = self.0.upgrade() else {
            // Store is going away: the bucket is durable and a restart rescan registers it.
            return vec![Registration::Registered; items.len()];
        };
        let mut m = inner.master.lock();
        items
            .iter()
            .map(
                |(j, loc)| match m.register_disk(LOCAL_NODE, &j.tenant, &j.key, j.token, *loc) {
                    true => Registration::Registered,
                    false => Registration::Refused,
                },
            )
            .collect()
    }

    fn write_failed(&self, jobs: &[OffloadJob]) {
        if let Some(inner) = self.0.upgrade() {
            let mut m = inner.master.lock();
            // Staged on eviction (offload-on-evict) or while its write-through copy was
            // queued: either way no copy is coming.
            for j in jobs {
                m.unstage(&j.tenant, &j.key, j.token);
            }
        }
    }

    fn evict_disk(&self, recs: &[(Tenant, String, DiskLoc)]) -> bool {
        let Some(inner) = self.0.upgrade() else {
            return false;
        };
        let now = inner.clock.now_ms();
        let mut m = inner.master.lock();
        if !recs
            .iter()
            .all(|(t, k, l)| m.disk_evictable(LOCAL_NODE, t, k, l, now))
        {
            return false;
        }
        for (t, k, l) in recs {
            m.drop_disk(LOCAL_NODE, t, k, l);
        }
        true
    }
}

impl Inner {
    /// Promotion work: read the SSD copy (verified) and add a memory replica, making room
    /// as `room` allows (see [`Room`]).
    pub(super) fn promote_one(&self, t: &Tenant, key: &str, room: Room) -> L3Result<()> {
        let Some(ssd) = &self.ssd else {
            return Err(L3Error::UnableOffload);
        };
        let (token, loc) = {
            let m = self.master.lock();
            if room == Room::Refuse && m.under_pressure(0) {
                return Err(L3Error::NoAvailableHandle { needed: 0 });
            }
            m.ssd_only(t, key).ok_or(L3Error::ObjectNotFound)?
        };
        let mut buf = vec![0u8; loc.size as usize];
        if !ssd.read(&loc, &mut buf)? {
            self.on_corrupt(t, key, &loc);
            return Err(L3Error::ObjectNotFound);
        }
        let now = self.clock.now_ms();
        let mut out = EvictionOutcome::default();
        let r = {
            let mut m = self.master.lock();
            let r = m.promote(t, key, token, Arc::from(buf), now, room, &mut out);
            // Announced with the eviction that staged them, so a remove cancels them (as a
            // put's eviction does).
            for s in &out.to_offload {
                ssd.announce(&s.tenant, &s.key, s.token);
            }
            r
        };
        if !out.to_offload.is_empty() {
            self.offload_evicted(out);
        }
        r
    }

    /// `Remove` of one key, durably: under the master's lock, the refusals the master would
    /// answer are checked first (nothing changes), then the key's registered SSD copy is
    /// tombstoned (synced), and only then is the key removed. A tombstone that fails
    /// refuses the remove with the key in place and readable; before, the key was dropped
    /// from memory first and its record stayed live, so a restart brought it back (after a
    /// newer version was put and removed, the older one). Lock order: master → the tier's
    /// locks, as for `announce`; the tier never calls back into the master under its locks.
    pub(super) fn remove_durably(
        &self,
        t: &Tenant,
        key: &str,
        force: bool,
        now: u64,
    ) -> L3Result<()> {
        let mut m = self.master.lock();
        let disk = match m.current_replicas(t, key) {
            Ok((_, d)) => d,
            // A put not ended yet has no SSD copy of its own; `force` removes it.
            Err(L3Error::ReplicaIsNotReady) if force => None,
            Err(e) => return Err(e),
        };
        if !force && m.is_leased(t, key, now) {
            return Err(L3Error::ObjectHasLease);
        }
        if let (Some(ssd), Some(loc)) = (&self.ssd, disk) {
            ssd.tombstone(&loc)?;
        }
        let removed = match m.remove(t, key, force, now) {
            Ok(r) => r,
            Err(e) => {
                // Not reached (same checks, same lock); should the master's rules change,
                // it must not point at the record just tombstoned.
                if let Some(loc) = disk {
                    m.drop_disk(LOCAL_NODE, t, key, &loc);
                }
                return Err(e);
            }
        };
        // Queued writes of the version are cancelled; a record published but not yet
        // registered (its writer is waiting for this lock) is tombstoned now. If that fails
        // the key is already gone: the error is answered (see docs/l3.md, "remove").
        self.forget_on_disk(t, std::slice::from_ref(&removed))
    }

    /// `RemoveAll` / `RemoveByRegex`, durably, with the same order as
    /// [`Inner::remove_durably`]: the SSD copies of the keys selected are tombstoned one by
    /// one under the master's lock, then every selected key is removed except those whose
    /// tombstone failed, which stay (readable). Returns how many were removed; when a
    /// tombstone failed, an error naming the kept keys and that count (the others are
    /// removed all the same).
    pub(super) fn remove_many_durably(
        &self,
        t: &Tenant,
        select: impl Fn(&str) -> bool,
        force: bool,
        now: u64,
    ) -> L3Result<u64> {
        let mut m = self.master.lock();
        let selected = m.removable(t, select, force, now);
        let mut kept: Vec<(String, L3Error)> = Vec::new();
        if let Some(ssd) = &self.ssd {
            for (k, loc) in &selected {
                if let Some(loc) = loc
                    && let Err(e) = ssd.tombstone(loc)
                {
                    kept.push((k.clone(), e));
                }
            }
        }
        let mut removed = Vec::with_capacity(selected.len());
        for (k, _) in &selected {
            if kept.iter().any(|(x, _)| x == k) {
                continue;
            }
            // Selected under this lock: the checks already passed.
            if let Ok(r) = m.remove(t, k, true, now) {
                removed.push(r);
            }
        }
        let n = removed.len() as u64;
        let after = self.forget_on_disk(t, &removed);
        drop(m);
        if let Some((k, e)) = kept.first() {
            let names: Vec<&str> = kept.iter().take(8).map(|(k, _)| k.as_str()).collect();
            return Err(L3Error::FileWriteFail(format!(
                "{n} keys removed; {} kept, their SSD tombstone could not be written                  (e.g. {k}: {e}); kept: {}{}",
                kept.len(),
                names.join(", "),
                if kept.len() > names.len() {
                    ", ..."
                } else {
                    ""
                },
            )));
        }
        after.map(|()| n)
    }

    /// After the master removed objects: cancels their queued SSD writes and tombstones
    /// their SSD copies (published or registered), durably, so an acknowledged remove
    /// survives a crash at any point of the write.
    pub(super) fn forget_on_disk(&self, t: &Tenant, removed: &[Removed]) -> L3Result<()> {
        let Some(ssd) = &self.ssd else { return Ok(()) };
        let mut locs = Vec::new();
        for r in removed {
            locs.extend(ssd.cancel(t, &r.key, r.token));
            locs.extend(r.disk.map(|(_, l)| l));
        }
        ssd.tombstone_many(&locs)
    }

    pub(super) fn on_corrupt(&self, t: &Tenant, key: &str, loc: &DiskLoc) {
        Metrics::add(&self.metrics.corrupt_reads, 1);
        self.master.lock().drop_disk(LOCAL_NODE, t, key, loc);
        if let Some(s) = &self.ssd
            && let Err(e) = s.tombstone(loc)
        {
            tracing::warn!(error = %e, "could not tombstone a corrupt record");
        }
    }

    pub(super) fn offload_evicted(&self, out: EvictionOutcome) {
        let Some(ssd) = &self.ssd else { return };
        for s in out.to_offload {
            let (t, k, tok) = (s.tenant.clone(), s.key.clone(), s.token);
            let job = OffloadJob {
                tenant: s.tenant,
                key: s.key,
                token: s.token,
                data: s.data,
                staged: true,
                done: None,
            };
            if ssd.enqueue(job, false).is_err() {
                Metrics::add(&self.metrics.offload_skipped, 1);
                self.master.lock().unstage(&t, &k, tok);
            }
        }
    }
}
