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
//!   know which keys changed meanwhile), which the restart's `overflowed` loss report covers.
//! - Nodes' own requests are never gated (they are how the gate opens).

use std::collections::BTreeSet;

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

    /// A node pinged (not asked to remount): its mount, rescan included, is complete.
    pub(super) fn member_pinged(&mut self, node: ClientId) {
        let m = &mut self.members;
        if !m.mounted.remove(&node) {
            return;
        }
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
                m.awaited = None;
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
        m.awaited = None;
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
