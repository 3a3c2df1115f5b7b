//! Adoption of the DRAM replicas a store node kept across a remount (a new etcd leader, a
//! restarted master, issue 22).
//!
//! Why: a failover used to cost every DRAM-only object — the node cleared its memory when it
//! mounted again and reported only its SSD records. A node now keeps its ended replicas and
//! reports them after `MountNode` ([`RetainedObject`]: tenant, key, put token, size); the
//! master adopts each into its object table and gives it an allocation in the node's
//! segment (the node keeps the bytes under that id from then on). Unlike an SSD record, a
//! DRAM replica carries its version (the put token; tokens only grow across restarts and
//! failovers: `TokensBelow`), so duplicates resolve to the newest.
//!
//! Rules (checked in this order; refused → the node frees the bytes):
//! 1. The node must be mounted and not fenced (`rebuild`), and this master must never have
//!    dropped its memory (its first mount here): a node this master declared dead, or saw
//!    leave or remount, had its replicas dropped here without being told, so what it kept
//!    may be versions removed since.
//! 2. Settles first: a version some node has an unacknowledged cancel for (that token or a
//!    newer one: "this version and any older one is gone") is not adopted — a removed key
//!    or a replaced version never comes back. Cancels are issued to every node holding a
//!    replica of a dropped version (`settle_gone`) and are durable before the reply.
//! 3. A key the master knows at a newer version: refused (an older version is never served).
//!    At the same version: one more replica (on a node with none yet). At an older,
//!    complete version: that version is dropped (settled gone) and this one adopted. A
//!    pending put of the key (started on this master, so newer): refused.
//! 4. Only ended replicas are reported (the node frees puts it never ended).
//! 5. An SSD record of the same node holding the very same bytes (the node compares size
//!    and CRC32C) is attached as the adopted version's SSD copy; its rescan is then accepted.
//! 6. An SSD record of *another* node, rescanned while the master rebuilds, is attached to
//!    a version adopted from DRAM when that version has no SSD copy yet and the record has
//!    the very same size and CRC32C as the adopted bytes (`register_rescanned`). Why: with
//!    2 or 3 replicas only the first replica's node writes the SSD copy; if another node's
//!    DRAM replica was adopted first, the record used to be refused (tombstoned) and a put
//!    acknowledged as persisted was lost once that DRAM replica was evicted (l3-chaos with
//!    etcd masters found it). Two different versions of one key with equal size and CRC32C
//!    would be taken for one (a 2^-32 chance per such pair); every other record of the key
//!    is still refused.

use serde::{Deserialize, Serialize};

use super::*;

/// One DRAM replica a node kept across a remount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetainedObject {
    /// Tenant.
    pub tenant: Tenant,
    /// Key.
    pub key: String,
    /// The version's put token.
    pub token: u64,
    /// Size in bytes (the bytes the node holds).
    pub size: u64,
    /// CRC32C of those bytes: another node's SSD record of the key with the same size and
    /// CRC32C is taken as this version's SSD copy (rule 6).
    pub crc: u32,
    /// The node's live SSD record of the key holding the very same bytes (same size and
    /// CRC32C as the DRAM copy), if any: attached as the adopted version's SSD copy (an SSD
    /// record alone carries no version, so it could not be attached otherwise).
    pub disk: Option<DiskLoc>,
}

/// Why a retained replica was not adopted (the node frees it either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The node has no segment here, or is fenced.
    NotMounted,
    /// A settle says this version is gone.
    Settled,
    /// The master has a newer version (or a put of the key in progress).
    Older,
    /// The node holds this version twice, or its segment is full.
    NoRoom,
}

impl Master {
    /// Adopts one DRAM replica `node` kept: returns the allocation the node keeps its bytes
    /// under, or why it must free them (module docs).
    pub fn adopt_retained(&mut self, node: ClientId, r: &RetainedObject) -> Result<u64, Refusal> {
        let seg = self
            .nodes
            .get(&node)
            .filter(|n| n.adopts)
            .and_then(|n| n.segment)
            .filter(|_| !self.member_fenced(node))
            .ok_or(Refusal::NotMounted)?;
        if r.size == 0 || self.version_settled(&r.tenant, &r.key, r.token) {
            return Err(Refusal::Settled);
        }
        let existing = self
            .obj(&r.tenant, &r.key)
            .map(|o| (o.token, o.is_complete(), o.mem.iter().any(|m| m.seg == seg)));
        match existing {
            Some((tok, _, _)) if tok > r.token => return Err(Refusal::Older),
            Some((_, false, _)) => return Err(Refusal::Older),
            Some((tok, true, true)) if tok == r.token => return Err(Refusal::NoRoom),
            Some((tok, true, false)) if tok == r.token => {
                self.members.adopted(r);
                if self
                    .obj(&r.tenant, &r.key)
                    .is_some_and(|o| o.fp.bytes() != r.size)
                {
                    return Err(Refusal::Settled);
                }
                let alloc = self
                    .segments
                    .allocate_on(seg, Footprint::of(r.size, &r.key))
                    .ok_or(Refusal::NoRoom)?;
                let disk = self.attachable(node, r);
                if let Some(mut o) = self.obj_mut(&r.tenant, &r.key) {
                    o.mem.push(MemReplica {
                        seg,
                        alloc,
                        ended: true,
                    });
                    if o.disk.is_none()
                        && let Some(d) = disk
                    {
                        o.disk = Some(d);
                        o.disk_node = node;
                    }
                }
                return Ok(alloc);
            }
            Some(_) => {
                // An older complete version: dropped (and settled) for this newer one.
                if let Some(o) = self.take_obj(&r.tenant, &r.key) {
                    for a in o.allocs() {
                        self.segments.free(a);
                    }
                    self.settle_gone(&r.tenant, &r.key, o.gone());
                }
            }
            None => {}
        }
        let alloc = self
            .segments
            .allocate_on(seg, Footprint::of(r.size, &r.key))
            .ok_or(Refusal::NoRoom)?;
        self.next_token = self.next_token.max(r.token);
        let tick = self.touch();
        let mut o = Object::found(Footprint::of(r.size, &r.key), r.token, node, tick);
        o.disk = self.attachable(node, r);
        self.members.adopted(r);
        o.mem.push(MemReplica {
            seg,
            alloc,
            ended: true,
        });
        self.objects.insert(&r.tenant, r.key.clone(), o);
        self.readable(&r.tenant, &r.key);
        Ok(alloc)
    }

    /// The SSD record a node paired with a retained replica, unless a settle refuses it.
    fn attachable(&self, node: ClientId, r: &RetainedObject) -> Option<DiskLoc> {
        r.disk
            .filter(|d| d.size == r.size && !self.settle_refuses(node, &r.tenant, &r.key, d))
    }

    /// [`Master::adopt_retained`] for each object: the allocations, None where refused.
    /// A replica refused for lack of room (or a segment) whose key is then unknown here
    /// was a live version: it is named in the loss journal.
    pub fn adopt_all(&mut self, node: ClientId, objects: &[RetainedObject]) -> Vec<Option<u64>> {
        self.member_retained(node);
        let v: Vec<Option<u64>> = objects
            .iter()
            .map(|r| match self.adopt_retained(node, r) {
                Ok(a) => Some(a),
                Err(Refusal::NoRoom | Refusal::NotMounted) => {
                    if self.obj(&r.tenant, &r.key).is_none() {
                        self.lose(&r.tenant, &r.key);
                    }
                    None
                }
                Err(Refusal::Settled | Refusal::Older) => None,
            })
            .collect();
        let adopted = v.iter().filter(|a| a.is_some()).count();
        tracing::info!(
            node = node.0,
            adopted,
            refused = v.len() - adopted,
            "dram replicas reported"
        );
        v
    }
}
