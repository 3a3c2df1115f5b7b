//! Membership and the rebuild gate (split deployment with a state dir): a restarted master
//! answers no client until every store node it knew has mounted again and re-registered its
//! SSD records, or has been fenced.
//!
//! Why: a restarted master knows only its settles; the objects are rebuilt from what the
//! nodes report when they mount. Serving before a node is back gave wrong answers that
//! later turned into wrong data (issue 19's chaos run): a key whose only copy is on that
//! node's SSD read "not found", so a remove of it answered -704 and left it in place, and a
//! put of a new version succeeded; once the node mounted, its record was adopted (the key
//! was unknown again after the new version was lost or removed), and a removed or older
//! version was served. Gating closes this: until the gate opens, nothing a client sees can
//! disagree with a record that is still to be reported.
//!
//! Invariants:
//! - The members are durable (`SettleLogEntry::Member`, synced before the mount reply): a
//!   node whose records the master may have adopted is waited for after any restart.
//! - A member counts as back once it pings after its mount (its rescan is complete then).
//! - A member still away when the rebuild timeout passes is *fenced* (durably): every record
//!   its next mount rescans is refused, so the node tombstones them; only its first ping
//!   after that mount makes it a member again. Its SSD copies are lost (the master cannot
//!   know which keys changed meanwhile): some losses are not named, so the loss journal gets
//!   an `Unknown` entry (readers before it are told `overflowed`).
//! - Nodes' own requests are never gated (they are how the gate opens).
//!
//! Losses across the restart (the loss journal is replayed with the settles: `losses`): a
//! key the previous master acknowledged and this one never hears of again is a loss nobody
//! can name — there is no per-put log. It can only happen to a member that lost memory
//! meanwhile: one that mounts without reporting retained DRAM replicas (a restarted node
//! process, or one that holds none: taken as restarted), one that offloads on eviction (its
//! bytes staged for an SSD write are dropped at the remount, unreported), or one fenced at
//! the deadline. Any of these adds one `Unknown` entry to the journal, before the gate
//! opens; a member that kept its memory and reported it loses nothing unnamed (what it does
//! not get adopted for lack of room is named: `adopt`).

use std::collections::{BTreeSet, HashMap};

use super::adopt::RetainedObject;

use super::*;

/// Members and, after a restart, who is still awaited.
#[derive(Debug, Default)]
pub(super) struct Membership {
    members: BTreeSet<ClientId>,
    fenced: BTreeSet<ClientId>,
    /// Set while rebuilding: members not back yet, and the deadline (ms).
    awaited: Option<(BTreeSet<ClientId>, u64)>,
    /// Members that mounted since the restart (back once they ping).
    mounted: BTreeSet<ClientId>,
    /// Awaited members that reported retained DRAM replicas since their mount.
    retained: BTreeSet<ClientId>,
    /// This restart already logged that some losses are not named.
    unnamed: bool,
    /// While rebuilding: the versions adopted from DRAM (token, size, CRC32C of the bytes),
    /// which another node's rescanned SSD record with the same bytes is attached to
    /// (`adopt`, rule 6).
    adopted: HashMap<(Tenant, String), (u64, u64, u32)>,
}

impl Membership {
    /// A DRAM replica was adopted (kept while rebuilding only).
    pub(super) fn adopted(&mut self, r: &RetainedObject) {
        if self.awaited.is_some() {
            self.adopted
                .insert((r.tenant.clone(), r.key.clone()), (r.token, r.size, r.crc));
        }
    }

    /// Whether `loc` holds the very bytes of the version `token` adopted from DRAM.
    pub(super) fn same_bytes(&self, t: &Tenant, key: &str, token: u64, loc: &DiskLoc) -> bool {
        self.adopted.get(&(t.clone(), key.to_string())) == Some(&(token, loc.size, loc.crc))
    }

    fn rebuilt(&mut self) {
        self.awaited = None;
        self.adopted = HashMap::new();
    }
}

impl Master {
    /// A node mounted: a new one becomes a member (durably); an awaited one is about to
    /// report its records.
    pub(super) fn member_mounted(&mut self, node: ClientId) {
        let m = &mut self.members;
        if m.awaited.as_ref().is_some_and(|(a, _)| a.contains(&node)) || m.fenced.contains(&node) {
            m.mounted.insert(node);
        } else if m.members.insert(node)
            && let Some(log) = &mut self.settle_log
        {
            log.push(SettleLogEntry::Member { node });
        }
    }

    /// An awaited member reported the DRAM replicas it kept (it did not restart).
    pub(super) fn member_retained(&mut self, node: ClientId) {
        let m = &mut self.members;
        if m.mounted.contains(&node) {
            m.retained.insert(node);
        }
    }

    /// Some losses of this restart cannot be named: one `Unknown` journal entry.
    fn restart_losses_unnamed(&mut self) {
        if !self.members.unnamed {
            self.members.unnamed = true;
            self.losses_unknown();
        }
    }

    /// A node pinged (not asked to remount): its mount, rescan included, is complete.
    pub(super) fn member_pinged(&mut self, node: ClientId) {
        if !self.members.mounted.contains(&node) {
            return;
        }
        let kept = self.members.retained.remove(&node);
        let awaited = (self.members.awaited.as_ref()).is_some_and(|(a, _)| a.contains(&node));
        let on_evict = self.nodes.get(&node).is_some_and(|n| n.offload_on_evict);
        if awaited && (!kept || on_evict) {
            self.restart_losses_unnamed();
        }
        let m = &mut self.members;
        m.mounted.remove(&node);
        if m.fenced.remove(&node) {
            m.members.insert(node);
            if let Some(log) = &mut self.settle_log {
                log.push(SettleLogEntry::Member { node });
            }
            tracing::info!(
                node = node.0,
                "fenced store node mounted again (its old records dropped)"
            );
        }
        if let Some((awaited, _)) = &mut m.awaited {
            awaited.remove(&node);
            if awaited.is_empty() {
                m.rebuilt();
                tracing::info!("every store node is back: serving");
            }
        }
    }

    /// Whether this node's rescanned records are all refused (fenced, not back yet).
    pub(super) fn member_fenced(&self, node: ClientId) -> bool {
        self.members.fenced.contains(&node)
    }

    /// After a restart: wait for every member (fencing those still away at `deadline_ms`).
    pub fn begin_rebuild(&mut self, deadline_ms: u64) {
        let m = &mut self.members;
        let awaited: BTreeSet<ClientId> = m.members.difference(&m.fenced).copied().collect();
        if !awaited.is_empty() {
            tracing::info!(
                nodes = awaited.len(),
                "restarted: waiting for the store nodes to report their records"
            );
            m.awaited = Some((awaited, deadline_ms));
        }
    }

    /// -1010 while rebuilding (clients retry).
    pub fn serving(&self) -> L3Result<()> {
        match &self.members.awaited {
            None => Ok(()),
            Some((a, _)) => Err(L3Error::Unavailable(format!(
                "the master restarted and is rebuilding its state: {} of {} store nodes \
                 not back yet",
                a.len(),
                self.members.members.len()
            ))),
        }
    }

    /// Fences the members still away once the rebuild deadline passed; returns how many.
    pub fn rebuild_deadline(&mut self, now: u64) -> usize {
        let m = &mut self.members;
        let Some((awaited, deadline)) = &m.awaited else {
            return 0;
        };
        if now < *deadline {
            return 0;
        }
        let late: Vec<ClientId> = awaited.iter().copied().collect();
        m.rebuilt();
        if !late.is_empty() {
            self.restart_losses_unnamed();
        }
        let m = &mut self.members;
        for node in &late {
            // One mounted but not pinged yet stays `mounted`: its ping un-fences it.
            m.members.remove(node);
            m.fenced.insert(*node);
            if let Some(log) = &mut self.settle_log {
                log.push(SettleLogEntry::Fenced { node: *node });
            }
        }
        tracing::warn!(
            fenced = late.len(),
            "store nodes did not come back before the rebuild timeout: fenced (their SSD \
             records will be dropped when they mount); serving"
        );
        late.len()
    }

    /// Replays a membership entry.
    pub(super) fn restore_member(&mut self, e: &SettleLogEntry) {
        let m = &mut self.members;
        match e {
            SettleLogEntry::Member { node } => {
                m.fenced.remove(node);
                m.members.insert(*node);
            }
            SettleLogEntry::Fenced { node } => {
                m.members.remove(node);
                m.fenced.insert(*node);
            }
            _ => {}
        }
    }

    /// Membership as log entries (for a compacted log).
    pub(super) fn members_snapshot(&self) -> impl Iterator<Item = SettleLogEntry> + '_ {
        let m = &self.members;
        m.members
            .iter()
            .map(|&node| SettleLogEntry::Member { node })
            .chain(m.fenced.iter().map(|&node| SettleLogEntry::Fenced { node }))
    }
}
