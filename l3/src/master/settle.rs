//! Settlement (split deployment): what the master keeps telling a store node about object
//! versions it dropped, until the node acknowledges that it applied them durably.
//!
//! Why: the master drops a removed (or replaced, revoked, evicted) version at once, but the
//! node holding — or about to write — its SSD copy hears of it only on its next ping. If the
//! master forgot the order once it was *sent*, a node that crashed before the order reached
//! its disk would re-register the record at restart and bring the version back. So every
//! order ([`Settle`]) gets a per-node sequence number and stays here until the node's ping
//! carries an `applied` number at or past it; until then a rescanned record it names is
//! refused ([`Master::register_rescanned`]), and after a remount every unacknowledged order
//! is delivered again.
//!
//! Orders: [`Settle::Tombstone`] for a registered SSD copy; [`Settle::Cancel`] for a version
//! whose SSD copy may still be queued or unregistered on the node that writes it (the node
//! drops the queued write, or tombstones the record if already written), and to every node
//! holding a memory replica of it (a master adopting DRAM replicas after a failover refuses
//! a cancelled version, `adopt`). Both are idempotent on the node, so repeating them is
//! harmless.
//!
//! The embedded store (and `--role both`) tombstones and cancels under its own lock
//! ([`LOCAL_NODE`]); nothing is queued for it, nor for clients that are not store nodes.

use std::collections::HashMap;

pub(super) use super::sequenced::Deliver;
use super::sequenced::Sequenced;
use super::*;

/// An order a store node applies durably and then acknowledges (by sequence number).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Settle {
    /// Tombstone the SSD record at this location (its object version is gone).
    Tombstone(DiskLoc),
    /// Version `token` (and any older one) of the key is gone: do not write it, and
    /// tombstone the record if it is already written but not registered.
    Cancel {
        /// Tenant.
        tenant: Tenant,
        /// Key.
        key: String,
        /// The dropped version's put token.
        token: u64,
    },
}

/// One change to the settles, as the master's durable log records it (`--state-dir`):
/// replaying a log in order rebuilds every node's unacknowledged settles and counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SettleLogEntry {
    /// Settle `seq` was issued to `node`.
    Issued {
        /// Node.
        node: ClientId,
        /// Its sequence number.
        seq: u64,
        /// The order.
        settle: Settle,
    },
    /// `node` acknowledged every settle up to `applied` (also a floor for the counter).
    Acked {
        /// Node.
        node: ClientId,
        /// Acknowledged up to.
        applied: u64,
    },
    /// Put tokens below `floor` may have been handed out: a restart starts at it.
    TokensBelow {
        /// Reserved bound.
        floor: u64,
    },
    /// `node` mounted: a restart waits for it to report its records (`rebuild`).
    Member {
        /// Node.
        node: ClientId,
    },
    /// `node` did not come back in time after a restart: its old records are refused.
    Fenced {
        /// Node.
        node: ClientId,
    },
    /// The loss journal's identity and the sequence number of the next entry replayed
    /// (a snapshot's; the journal's entries follow).
    LossJournal {
        /// The journal's id (readers' cursors name it).
        id: u64,
        /// Sequence number of the entry after this one.
        first_seq: u64,
    },
    /// A loss-journal entry: this key of this tenant stopped existing.
    Lost {
        /// Tenant.
        tenant: Tenant,
        /// Key.
        key: String,
    },
    /// A loss-journal entry: some losses are not named (readers before it overflow).
    LossesUnknown,
    /// `node`'s SSD record `loc` was registered for version `token` of the key while a
    /// cancel of an older version was unacknowledged (a rescan accepts it).
    Written {
        /// Node.
        node: ClientId,
        /// Tenant.
        tenant: Tenant,
        /// Key.
        key: String,
        /// The version's put token.
        token: u64,
        /// The record.
        loc: DiskLoc,
    },
}

impl SettleLogEntry {
    /// Whether the entry must be durable before a reply leaves the master (an issued
    /// settle: a reply may acknowledge the drop it records; a member: the mount reply lets
    /// it register records a restart must wait for). A lost acknowledgement only repeats
    /// settles, which is harmless.
    pub fn needs_sync(&self) -> bool {
        !matches!(self, SettleLogEntry::Acked { .. })
    }
}

/// Put tokens reserved per durable `TokensBelow` entry.
const TOKEN_BLOCK: u64 = 1 << 20;

/// One node's settles, by sequence number (1, 2, …; never reused for the node).
#[derive(Debug, Default)]
pub(super) struct Settlement {
    log: Sequenced<Settle>,
    /// Unacknowledged tombstones and cancels, counted per location and per key, so a
    /// rescan of many records checks each in O(1).
    locs: HashMap<DiskLoc, u32>,
    keys: HashMap<(Tenant, String), u32>,
    /// SSD records this node wrote and the master registered for a version (its put
    /// token) while a cancel of an older version of the key was unacknowledged: a rescan
    /// accepts exactly these despite the key's cancel (see [`Settlement::refuses`]).
    written: HashMap<DiskLoc, ((Tenant, String), u64)>,
}

fn bump<K: std::hash::Hash + Eq>(m: &mut HashMap<K, u32>, k: K, up: bool) {
    if up {
        *m.entry(k).or_default() += 1;
    } else if let Some(n) = m.get_mut(&k) {
        *n -= 1;
        if *n == 0 {
            m.remove(&k);
        }
    }
}

impl Settlement {
    fn index(&mut self, s: &Settle, up: bool) {
        match s {
            Settle::Tombstone(l) => bump(&mut self.locs, *l, up),
            Settle::Cancel { tenant, key, .. } => {
                bump(&mut self.keys, (tenant.clone(), key.clone()), up)
            }
        }
    }

    fn push(&mut self, s: Settle) {
        self.index(&s, true);
        self.log.push(s);
    }

    /// The node applied every settle up to `applied`. A number past what was issued (a
    /// node still counting from before a master restart) is ignored.
    fn ack(&mut self, applied: u64) {
        let done = self.log.ack(applied);
        self.acked_done(done);
    }

    fn acked_done(&mut self, done: Option<Vec<Settle>>) {
        let Some(done) = done else {
            return;
        };
        for s in &done {
            self.index(s, false);
        }
        let keys = &self.keys;
        self.written.retain(|_, (k, _)| keys.contains_key(k));
    }

    /// Replays a logged issue (one already acknowledged is skipped).
    fn restore_issued(&mut self, seq: u64, s: Settle) {
        if self.log.restore(seq, s.clone()) {
            self.index(&s, true);
        }
    }

    /// Replays a logged acknowledgement.
    fn restore_acked(&mut self, applied: u64) {
        let done = self.log.restore_acked(applied);
        self.acked_done(done);
    }

    /// A rescanned record is refused when it is tombstoned, or when its key has an
    /// unacknowledged cancel — a record carries no version, so it may be the cancelled
    /// one — unless the master registered this very record for a version newer than every
    /// such cancel (`written`: a persisted newer version is not lost to an older one's
    /// cancel across a failover; l3-chaos with etcd masters found it).
    fn refuses(&self, t: &Tenant, key: &str, loc: &DiskLoc) -> bool {
        if self.locs.contains_key(loc) {
            return true;
        }
        if self.keys.is_empty() {
            return false;
        }
        let k = (t.clone(), key.to_string());
        if !self.keys.contains_key(&k) {
            return false;
        }
        let Some((wk, token)) = self.written.get(loc) else {
            return true;
        };
        *wk != k
            || self.log.values().any(|s| {
                matches!(s, Settle::Cancel { tenant, key: ck, token: c }
                    if tenant == t && ck == key && c >= token)
            })
    }
}

/// What a dropped object version leaves to settle on nodes.
#[derive(Debug, Clone)]
pub(super) struct Gone {
    token: u64,
    /// Segments holding its memory replicas (their nodes may keep the bytes across a
    /// remount: they are told the version is gone, see `adopt`).
    mem_segs: Vec<SegmentId>,
    /// Replicas dropped earlier while the version lived on, whose nodes may still hold the
    /// bytes (`Object::freed_on`).
    freed_on: Vec<(ClientId, u64)>,
    writer: ClientId,
    staged_on: Option<ClientId>,
    disk: Option<(ClientId, DiskLoc)>,
}

impl Gone {
    /// Segments that held replicas taken from the object before it was dropped.
    pub(super) fn add_mem_segs(&mut self, segs: impl IntoIterator<Item = SegmentId>) {
        self.mem_segs.extend(segs);
    }
}

impl Object {
    pub(super) fn gone(&self) -> Gone {
        Gone {
            token: self.token,
            mem_segs: self.mem.iter().map(|r| r.seg).collect(),
            freed_on: self.freed_on.clone(),
            writer: self.writer,
            staged_on: match self.staged {
                Some(Staged::OnNode { node, .. }) => Some(node),
                _ => None,
            },
            disk: self.disk.map(|d| (self.disk_node, d)),
        }
    }
}

impl Master {
    /// Queues an order for a store node (nothing for [`LOCAL_NODE`] or for a client that
    /// never mounted as a node).
    pub(super) fn queue_settle(&mut self, node: ClientId, s: Settle) {
        if node == LOCAL_NODE {
            return;
        }
        if let Some(st) = self.nodes.get_mut(&node) {
            if let Some(log) = &mut self.settle_log {
                log.push(SettleLogEntry::Issued {
                    node,
                    seq: st.settle.log.next_seq(),
                    settle: s.clone(),
                });
            }
            st.settle.push(s);
        }
    }

    /// Queues the tombstone of a removed object's SSD record for the node holding it (a
    /// no-op for [`LOCAL_NODE`], whose caller tombstones directly).
    pub fn queue_tombstone(&mut self, node: ClientId, loc: DiskLoc) {
        self.queue_settle(node, Settle::Tombstone(loc));
    }

    /// A version of `key` left the master (removed, replaced, revoked, evicted without an
    /// SSD copy, lost with its node's memory): its registered SSD copy is tombstoned, or,
    /// when none is registered yet, the nodes that may be writing one (the write-through
    /// writer, the node it is staged on) cancel the write; every node still holding a
    /// memory replica of it gets the cancel too (it keeps its memory across a remount, and
    /// a cancelled version is never adopted: `adopt`).
    pub(super) fn settle_gone(&mut self, t: &Tenant, key: &str, g: Gone) {
        let mut to = Vec::new();
        if let Some((node, loc)) = g.disk {
            self.queue_settle(node, Settle::Tombstone(loc));
        } else {
            to.push(g.writer);
            to.extend(g.staged_on);
        }
        // Nodes holding a memory replica keep it across a remount: a new master must not
        // adopt it (`adopt`).
        to.extend(
            g.mem_segs
                .iter()
                .filter_map(|s| self.segments.get(*s).map(|i| i.owner)),
        );
        // So do nodes whose replica of it was dropped earlier, until they acknowledge that
        // free (`frees`): a lost reply must not leave adoptable bytes of a dead version.
        to.extend(
            g.freed_on
                .iter()
                .filter(|(n, a)| self.may_hold_freed(*n, *a))
                .map(|(n, _)| *n),
        );
        to.sort_unstable();
        to.dedup();
        for node in to {
            self.queue_settle(
                node,
                Settle::Cancel {
                    tenant: t.clone(),
                    key: key.to_string(),
                    token: g.token,
                },
            );
        }
    }

    /// Whether some node has an unacknowledged cancel of this version of the key (or of a
    /// newer one: a cancel covers every older version).
    pub(super) fn version_settled(&self, t: &Tenant, key: &str, token: u64) -> bool {
        let k = (t.clone(), key.to_string());
        self.nodes.values().any(|n| {
            n.settle.keys.contains_key(&k)
                && n.settle.log.values().any(|s| {
                    matches!(s, Settle::Cancel { tenant, key: kk, token: c }
                        if tenant == t && kk == key && *c >= token)
                })
        })
    }

    /// Settles for a node, and every settle up to which it acknowledged (the node counts
    /// on from there).
    pub(super) fn take_settles(&mut self, node: ClientId, d: Deliver) -> (Vec<(u64, Settle)>, u64) {
        match self.nodes.get_mut(&node) {
            Some(st) => (st.settle.log.take(d), st.settle.log.acked()),
            None => (Vec::new(), 0),
        }
    }

    /// The node applied (durably) every settle up to `applied`: they are dropped.
    pub fn node_ack(&mut self, node: ClientId, applied: u64) {
        if let Some(st) = self.nodes.get_mut(&node) {
            let before = st.settle.log.acked();
            st.settle.ack(applied);
            if st.settle.log.acked() != before
                && let Some(log) = &mut self.settle_log
            {
                log.push(SettleLogEntry::Acked {
                    node,
                    applied: st.settle.log.acked(),
                });
            }
        }
    }

    /// Starts recording settle changes for a durable log ([`Master::take_settle_log`]),
    /// and reserving put tokens in it.
    pub fn keep_settle_log(&mut self) {
        self.settle_log.get_or_insert_with(Vec::new);
        let floor = self.token_floor.unwrap_or(0).max(self.next_token);
        self.token_floor = Some(floor);
    }

    /// Puts tokens from now on above `floor` (never lowers them). A master with no durable
    /// token floor (`--no-state-dir`) starts above the clock ([`ClusterMaster::open`]).
    ///
    /// [`ClusterMaster::open`]: crate::cluster::ClusterMaster::open
    pub fn start_tokens_above(&mut self, floor: u64) {
        self.next_token = self.next_token.max(floor);
    }

    /// The next put token. With a settle log, tokens are reserved in blocks (a durable
    /// `TokensBelow` entry, synced before the reply that hands out the first of them).
    pub(super) fn new_token(&mut self) -> u64 {
        self.next_token += 1;
        if let (Some(floor), Some(log)) = (self.token_floor, &mut self.settle_log)
            && self.next_token >= floor
        {
            let bound = self.next_token.saturating_add(TOKEN_BLOCK);
            log.push(SettleLogEntry::TokensBelow { floor: bound });
            self.token_floor = Some(bound);
        }
        self.next_token
    }

    /// The settle changes since the last call, in order (empty without a log).
    pub fn take_settle_log(&mut self) -> Vec<SettleLogEntry> {
        self.settle_log
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Whether settle changes wait for the durable log.
    pub fn settle_log_pending(&self) -> bool {
        self.settle_log.as_ref().is_some_and(|l| !l.is_empty())
    }

    /// Rebuilds the settles of a log replayed in order (a master restarting on its state
    /// dir): the nodes they concern are known (not mounted) until they mount again, their
    /// rescanned records are refused as before the restart, and new put tokens start above
    /// every cancelled one (a redelivered cancel must not cancel a newer version).
    pub fn restore_settles(&mut self, entries: impl IntoIterator<Item = SettleLogEntry>) {
        for e in entries {
            match e {
                SettleLogEntry::Issued { node, seq, settle } => {
                    if let Settle::Cancel { token, .. } = &settle {
                        self.next_token = self.next_token.max(*token);
                    }
                    self.nodes
                        .entry(node)
                        .or_default()
                        .settle
                        .restore_issued(seq, settle);
                }
                SettleLogEntry::Acked { node, applied } => {
                    self.nodes
                        .entry(node)
                        .or_default()
                        .settle
                        .restore_acked(applied);
                }
                SettleLogEntry::TokensBelow { floor } => {
                    self.next_token = self.next_token.max(floor);
                    self.token_floor = Some(self.token_floor.unwrap_or(0).max(floor));
                }
                SettleLogEntry::Member { .. } | SettleLogEntry::Fenced { .. } => {
                    self.restore_member(&e)
                }
                SettleLogEntry::LossJournal { .. }
                | SettleLogEntry::Lost { .. }
                | SettleLogEntry::LossesUnknown => self.losses.restore(&e),
                SettleLogEntry::Written {
                    node,
                    tenant,
                    key,
                    token,
                    loc,
                } => {
                    let st = &mut self.nodes.entry(node).or_default().settle;
                    st.written.insert(loc, ((tenant, key), token));
                }
            }
        }
    }

    /// Every node's settle state as log entries (a compacted log replays to the same
    /// state): the token floor, the membership, then per node its acknowledgement and each
    /// unacknowledged settle.
    pub fn settle_snapshot(&self) -> Vec<SettleLogEntry> {
        let mut ids: Vec<&ClientId> = self.nodes.keys().collect();
        ids.sort_by_key(|c| c.0);
        let mut out = Vec::new();
        if let Some(floor) = self.token_floor {
            out.push(SettleLogEntry::TokensBelow { floor });
        }
        out.extend(self.members_snapshot());
        out.extend(self.losses.snapshot());
        for node in ids {
            let st = &self.nodes[node].settle;
            if st.log.issued() == 0 {
                continue;
            }
            out.push(SettleLogEntry::Acked {
                node: *node,
                applied: st.log.acked(),
            });
            out.extend(st.log.iter().map(|(seq, s)| SettleLogEntry::Issued {
                node: *node,
                seq: *seq,
                settle: s.clone(),
            }));
            out.extend(
                (st.written.iter())
                    .filter(|(_, (k, _))| st.keys.contains_key(k))
                    .map(|(loc, ((t, k), token))| SettleLogEntry::Written {
                        node: *node,
                        tenant: t.clone(),
                        key: k.clone(),
                        token: *token,
                        loc: *loc,
                    }),
            );
        }
        out
    }

    /// After a (re)mount every unacknowledged settle is handed out again.
    pub(super) fn redeliver_settles(&mut self, node: ClientId) {
        if let Some(st) = self.nodes.get_mut(&node) {
            st.settle.log.redeliver();
        }
    }

    /// `node` wrote `loc` for version `token` of the key and it was registered: if a cancel
    /// of the key is unacknowledged there, the record is exempt from it (durably), so a
    /// rescan after a restart or failover keeps it (`Settlement::refuses`).
    pub(super) fn note_written(
        &mut self,
        node: ClientId,
        t: &Tenant,
        key: &str,
        token: u64,
        loc: DiskLoc,
    ) {
        let Some(st) = self.nodes.get_mut(&node) else {
            return;
        };
        let k = (t.clone(), key.to_string());
        if !st.settle.keys.contains_key(&k) {
            return;
        }
        st.settle.written.insert(loc, (k, token));
        if let Some(log) = &mut self.settle_log {
            log.push(SettleLogEntry::Written {
                node,
                tenant: t.clone(),
                key: key.to_string(),
                token,
                loc,
            });
        }
    }

    /// Whether an unacknowledged settle of `node` forbids registering this rescanned record
    /// (a tombstone of its location, or a cancel of its key).
    pub(super) fn settle_refuses(
        &self,
        node: ClientId,
        t: &Tenant,
        key: &str,
        loc: &DiskLoc,
    ) -> bool {
        self.nodes
            .get(&node)
            .is_some_and(|st| st.settle.refuses(t, key, loc))
    }

    /// Unacknowledged settles of a node (tests, metrics).
    pub fn unsettled(&self, node: ClientId) -> usize {
        self.nodes.get(&node).map_or(0, |st| st.settle.log.len())
    }

    /// Unacknowledged settles of all nodes (metrics).
    pub fn unsettled_total(&self) -> usize {
        self.nodes.values().map(|st| st.settle.log.len()).sum()
    }
}
