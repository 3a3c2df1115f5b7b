//! The node's SSD tier and its crossings with the master.
//!
//! Why: tiers work as in the single process, but the master's metadata is a call away. In
//! write-through mode every ended put is queued for the SSD, so a DRAM eviction only drops
//! bytes; in offload-on-evict mode the master leaves the bytes of an evicted replica staged
//! here ([`NodeSync::offload`](crate::master::NodeSync::offload)): they stay readable under
//! their allocation until their SSD copy is registered ([`NodeHooks`]), then go. A
//! prefetching probe at the master queues SSD-only keys for their node
//! ([`NodeSync::promote`](crate::master::NodeSync::promote)); the node's promoter thread reads
//! them (verified) and asks for a replica in its own segment (`Promote`).
//!
//! Invariant: SSD bytes are kept or served only after their checksum verified; a corrupt
//! record is dropped at the master and tombstoned here.

use std::sync::{Arc, Weak};
use std::time::Instant;

use crate::master::DiskLoc;
use crate::rpc::service::{ClusterReply, ClusterRequest};
use crate::ssd::{OffloadJob, Registration, TierHooks, Unconfirmed};
use crate::types::Tenant;

use super::mem::{Held, Staging};
use super::{NodeInner, PromoteBatch};

pub(super) struct NodeHooks(pub(super) Weak<NodeInner>);

impl TierHooks for NodeHooks {
    fn register(&self, items: &[(&OffloadJob, DiskLoc)]) -> Vec<Registration> {
        let Some(n) = self.0.upgrade() else {
            // Node going away: the record stays live and its next start re-registers it.
            return vec![Registration::Unconfirmed; items.len()];
        };
        let recs: Vec<Unconfirmed> = items
            .iter()
            .map(|(j, loc)| Unconfirmed {
                tenant: j.tenant.clone(),
                key: j.key.clone(),
                token: j.token,
                loc: *loc,
                staged: j.staged,
            })
            .collect();
        n.register_disk(&recs)
    }

    fn write_failed(&self, jobs: &[OffloadJob]) {
        let Some(n) = self.0.upgrade() else { return };
        n.unstage(jobs.iter().filter(|j| j.staged));
    }

    fn evict_disk(&self, recs: &[(Tenant, String, DiskLoc)]) -> bool {
        let Some(n) = self.0.upgrade() else {
            return false;
        };
        matches!(
            n.link.call(ClusterRequest::EvictDisk {
                node: n.opts.id,
                recs: recs.to_vec(),
            }),
            Ok(ClusterReply::Evictable(true))
        )
    }
}

impl NodeInner {
    /// Registers written SSD copies with the master. Unreachable (or an unexpected reply):
    /// every item is [`Registration::Unconfirmed`] — the records stay live (after a master
    /// restart they are how objects are found again) and are registered again on a later
    /// tick ([`NodeInner::retry_unconfirmed`]) or by the next mount.
    fn register_disk(&self, recs: &[Unconfirmed]) -> Vec<Registration> {
        let req = ClusterRequest::RegisterDisk {
            node: self.opts.id,
            items: recs
                .iter()
                .map(|r| (r.tenant.clone(), r.key.clone(), r.token, r.loc))
                .collect(),
        };
        match self.link.call(req) {
            Ok(ClusterReply::Accepted(v)) if v.len() == recs.len() => {
                // Registered (or refused: removed meanwhile): staged bytes are done with.
                let mut m = self.mem.lock();
                for r in recs.iter().filter(|r| r.staged) {
                    m.retire(&r.tenant, &r.key, r.token);
                }
                v.into_iter()
                    .map(|ok| match ok {
                        true => Registration::Registered,
                        false => Registration::Refused,
                    })
                    .collect()
            }
            other => {
                tracing::warn!(
                    ?other,
                    "ssd registration not confirmed; kept, to be registered again"
                );
                vec![Registration::Unconfirmed; recs.len()]
            }
        }
    }

    /// Registers again the records whose registration was not confirmed (called after a
    /// ping the master answered, once its settles are applied, so a cancel of such a record
    /// has tombstoned it already): registered ones are settled, refused ones tombstoned.
    pub(super) fn retry_unconfirmed(&self) {
        let Some(ssd) = &self.ssd else { return };
        let recs = ssd.unconfirmed();
        if recs.is_empty() {
            return;
        }
        let answers = self.register_disk(&recs);
        if let Err(e) = ssd.confirm(&recs, &answers) {
            tracing::warn!(error = %e, "could not tombstone refused records; retrying");
        }
    }

    /// Staged copies whose SSD write failed or was skipped: dropped here and at the master.
    pub(super) fn unstage<'a>(&self, jobs: impl Iterator<Item = &'a OffloadJob>) {
        let items: Vec<(Tenant, String, u64)> = {
            let mut m = self.mem.lock();
            jobs.map(|j| {
                m.retire(&j.tenant, &j.key, j.token);
                (j.tenant.clone(), j.key.clone(), j.token)
            })
            .collect()
        };
        if items.is_empty() {
            return;
        }
        if let Err(e) = self.link.call(ClusterRequest::Unstage {
            node: self.opts.id,
            items,
        }) {
            tracing::warn!(error = %e, "could not tell the master of failed offloads");
        }
    }

    /// Promoter thread work: read each SSD copy (verified), get a replica for it in this
    /// node's segment from the master, keep the bytes under it.
    pub(super) fn promote(&self, batch: PromoteBatch) {
        let Some(ssd) = &self.ssd else { return };
        let mut read: Vec<((Tenant, String, DiskLoc), Vec<u8>)> = Vec::new();
        for (t, k, loc) in batch {
            match ssd.owner_of(&loc) {
                Some((tt, kk)) if tt == t && kk == k => {}
                _ => continue,
            }
            let mut v = vec![0u8; loc.size as usize];
            match ssd.read(&loc, &mut v) {
                Ok(true) => read.push(((t, k, loc), v)),
                Ok(false) => self.on_corrupt(&t, &k, loc),
                Err(e) => tracing::warn!(error = %e, "promotion read failed"),
            }
        }
        if read.is_empty() {
            return;
        }
        let _gate = self.gate.lock();
        let room = {
            let m = self.mem.lock();
            let want: u64 = read.iter().map(|(_, v)| v.len() as u64).sum();
            m.used + want <= self.opts.segment_bytes.saturating_mul(2)
        };
        if !room {
            return;
        }
        let items: Vec<(Tenant, String, DiskLoc)> = read.iter().map(|(i, _)| i.clone()).collect();
        let n = items.len();
        let res = match self.link.call(ClusterRequest::Promote {
            node: self.opts.id,
            items,
        }) {
            Ok(ClusterReply::Promoted(v)) if v.len() == n => v,
            other => {
                tracing::warn!(?other, "promotion not confirmed by the master");
                return;
            }
        };
        let mut released = Vec::new();
        let mut m = self.mem.lock();
        for (((t, k, _), v), r) in read.into_iter().zip(res) {
            let Ok((alloc, token)) = r else { continue };
            released.extend(m.promoted(
                alloc,
                Held {
                    tenant: t,
                    key: k,
                    token,
                    data: Arc::from(v),
                    ended: true,
                    staged: Staging::No,
                    since: Instant::now(),
                },
            ));
        }
        drop(m);
        drop(released); // outside the lock
    }

    pub(super) fn on_corrupt(&self, t: &Tenant, key: &str, loc: DiskLoc) {
        // Best effort: a master that does not hear of it finds the record corrupt itself
        // when a read of it fails again.
        let told = self.link.call(ClusterRequest::DropDisk {
            node: self.opts.id,
            tenant: t.clone(),
            key: key.to_string(),
            loc,
        });
        crate::error::best_effort("tell the master of a corrupt record", told);
        if let Some(ssd) = &self.ssd
            && let Err(e) = ssd.tombstone(&loc)
        {
            tracing::warn!(error = %e, "could not tombstone a corrupt record");
        }
    }
}
