//! Records whose registration the master did not confirm (a store node whose master was
//! unreachable when the writer registered them).
//!
//! Why they are kept, and kept announced: after a master *restart* the records on disk are
//! how objects are found again, so an unanswered registration must not lose the record; but
//! if the master, only unreachable for a moment, dropped that version meanwhile, its cancel
//! arrives later and must still find the record to tombstone it before it is acknowledged —
//! otherwise the next restart rescan brings a removed object back. So the writer leaves the
//! announcement (with the record's location) in place and lists the record here; the node
//! registers the list again after each ping the master answers ([`SsdTier::unconfirmed`],
//! [`SsdTier::confirm`]), and a mount, which re-registers every live record, settles it
//! whole ([`SsdTier::take_unconfirmed`], [`SsdTier::remounted`]).

use super::tier::SsdTier;
use super::writer;
use crate::error::L3Result;
use crate::master::DiskLoc;
use crate::types::Tenant;

/// The master's answer to the registration of a written copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registration {
    /// The master holds the copy.
    Registered,
    /// The object was removed or replaced meanwhile: the record must die.
    Refused,
    /// No answer (a store node whose master is unreachable): the record is kept, its
    /// announcement too, so that a later cancel still finds it; see [`SsdTier::unconfirmed`].
    Unconfirmed,
}

/// A published record whose registration the master did not confirm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unconfirmed {
    /// Tenant.
    pub tenant: Tenant,
    /// Key.
    pub key: String,
    /// Put token of the version written.
    pub token: u64,
    /// The record.
    pub loc: DiskLoc,
    /// Written from DRAM eviction (offload-on-evict).
    pub staged: bool,
}

impl SsdTier {
    /// Records whose registration the master did not confirm and that were not cancelled
    /// since (a cancelled one was tombstoned by the cancel's caller): the node registers
    /// them again, then calls [`SsdTier::confirm`].
    pub fn unconfirmed(&self) -> Vec<Unconfirmed> {
        let inf = self.shared.inflight.lock();
        let mut u = self.shared.unconfirmed.lock();
        u.retain(|r| {
            inf.get(&(r.tenant.clone(), r.key.clone()))
                .is_some_and(|v| v.iter().any(|(t, l)| *t == r.token && *l == Some(r.loc)))
        });
        u.clone()
    }

    /// Applies the master's answers to a registration of [`SsdTier::unconfirmed`] records:
    /// registered ones are settled, refused ones tombstoned (synced) and then settled,
    /// unconfirmed ones stay. A failed tombstone leaves the refused records to retry.
    pub fn confirm(&self, items: &[Unconfirmed], answers: &[Registration]) -> L3Result<()> {
        let answer = |i: usize| answers.get(i).copied().unwrap_or(Registration::Unconfirmed);
        let refused: Vec<DiskLoc> = (0..items.len())
            .filter(|i| answer(*i) == Registration::Refused)
            .map(|i| items[i].loc)
            .collect();
        let tombstoned = self.tombstone_many(&refused);
        let done: Vec<&Unconfirmed> = items
            .iter()
            .enumerate()
            .filter(|(i, _)| match answer(*i) {
                Registration::Registered => true,
                Registration::Refused => tombstoned.is_ok(),
                Registration::Unconfirmed => false,
            })
            .map(|(_, r)| r)
            .collect();
        self.settle_unconfirmed(&done);
        tombstoned
    }

    /// Takes every unconfirmed record out of the list, for a mount, which registers every
    /// live record again (the rescan path); [`SsdTier::remounted`] settles them once it
    /// succeeded, [`SsdTier::restore_unconfirmed`] puts them back if it failed.
    pub fn take_unconfirmed(&self) -> Vec<Unconfirmed> {
        std::mem::take(&mut *self.shared.unconfirmed.lock())
    }

    /// The mount registered (or refused and tombstoned) every live record: the records
    /// taken by [`SsdTier::take_unconfirmed`] are settled.
    pub fn remounted(&self, taken: &[Unconfirmed]) {
        self.settle_unconfirmed(&taken.iter().collect::<Vec<_>>());
    }

    /// The mount failed: the records taken go back to the list.
    pub fn restore_unconfirmed(&self, taken: Vec<Unconfirmed>) {
        let mut u = self.shared.unconfirmed.lock();
        for r in taken {
            if !u.contains(&r) {
                u.push(r);
            }
        }
    }

    fn settle_unconfirmed(&self, done: &[&Unconfirmed]) {
        if done.is_empty() {
            return;
        }
        self.shared
            .unconfirmed
            .lock()
            .retain(|r| !done.contains(&r));
        for r in done {
            writer::settle(&self.shared, &r.tenant, &r.key, r.token);
        }
    }
}

/// A key, and one announced write of it (its token, its record once published).
type KeyOf = (Tenant, String);
type Announced = (u64, Option<DiskLoc>);

impl SsdTier {
    /// A store node (re)mounts: every write announced before the mount is cancelled except
    /// the unconfirmed records in `kept`, which the mount's rescan registers. A queued
    /// write is then written dead; a record already published but not registered is
    /// tombstoned here (synced). On a failed tombstone the announcements are put back and
    /// the error returned, so the mount fails and its retry cancels them again.
    ///
    /// Why: the master the node mounts with may be a restarted one that never heard of
    /// these versions. Registered later, such a record would be adopted for a key whose
    /// newer version (put after the mount, then lost) or whose remove the master cannot
    /// remember once it restarts again: a stale version or a removed key would come back
    /// (issue 19's chaos run). Copies written from here on belong to this mount.
    pub fn cancel_before_mount(&self, kept: &[Unconfirmed]) -> L3Result<()> {
        let keep: std::collections::HashSet<(&Tenant, &str, u64)> = kept
            .iter()
            .map(|u| (&u.tenant, u.key.as_str(), u.token))
            .collect();
        let mut taken: Vec<(KeyOf, Announced)> = Vec::new();
        {
            let mut inf = self.shared.inflight.lock();
            inf.retain(|k, v| {
                v.retain(|e| {
                    if keep.contains(&(&k.0, k.1.as_str(), e.0)) {
                        return true;
                    }
                    taken.push((k.clone(), *e));
                    false
                });
                !v.is_empty()
            });
        }
        let published: Vec<DiskLoc> = taken.iter().filter_map(|(_, (_, l))| *l).collect();
        if let Err(e) = self.tombstone_many(&published) {
            let mut inf = self.shared.inflight.lock();
            for (k, e) in taken {
                inf.entry(k).or_default().push(e);
            }
            return Err(e);
        }
        if !taken.is_empty() {
            tracing::info!(
                cancelled = taken.len(),
                tombstoned = published.len(),
                "ssd writes announced before this mount cancelled"
            );
        }
        Ok(())
    }
}
