//! The node's side of the conversation with the master: mount (with the SSD records found),
//! ping, and apply the [`NodeSync`] every reply carries (frees, evictions to offload,
//! settles, promotions). A mount keeps the ended DRAM replicas and reports them
//! (`Retained`): the master adopts those it can prove are live versions (`master::adopt`).
//!
//! Why: the master never connects to nodes; what it has to say waits for the node's next
//! call. A ping answered `need_remount` (declared dead while partitioned, or a restarted
//! master) mounts again, reporting what the node holds.
//!
//! Invariants:
//! - Bytes of an allocation the master freed are dropped when the node hears of it, and
//!   only then acknowledged (`freed`, sent on the next ping, over consecutive sequence
//!   numbers): the master repeats a free until then, so a lost reply never leaves the bytes
//!   of a removed key to be adopted by the next master (`master::frees`). Bytes written but
//!   never ended are dropped after `put_timeout` (the data channel bounds the memory held
//!   meanwhile, see `data`).
//! - An evicted replica the master stages for its SSD write (`offload`) is never dropped
//!   by its free: ping replies and put-end replies are applied on different threads, in
//!   either order, so the master repeats the offload with every reply that carries the
//!   free, and each reply stages before it frees (staging twice is a no-op).
//! - A cancel (version `token` of a key is gone) drops the node's ended DRAM copies of that
//!   key at that version or older before it is acknowledged: once the master forgets the
//!   cancel, nothing adoptable of the version is left here.
//! - A settle (tombstone a record, cancel a version's write) is acknowledged — `applied`,
//!   sent on the next ping — only after it is durable: cancels drop queued writes (the
//!   writer tombstones their records before they become visible) and return the records
//!   already published, which are tombstoned with the tombstones in one synced call. A
//!   failed tombstone acknowledges nothing; the master repeats its settles until they are
//!   acknowledged, and applying one twice is harmless. `applied` only moves over
//!   consecutive sequence numbers, so a settle lost on the way is never skipped.
//! - A mount re-registers only records the master accepts and fails (to be retried) if the
//!   refused ones cannot be tombstoned, so nothing is acknowledged while a refused record
//!   is still live on disk.
//! - A mount first cancels every SSD write announced before it (queued ones are written
//!   dead, published but unregistered ones tombstoned), except the unconfirmed records its
//!   rescan registers: a copy is only ever registered with the master incarnation that
//!   knew its version.
//! - A record whose registration went unanswered (master unreachable) keeps its
//!   announcement, so a cancel still tombstones it before it is acknowledged; after each
//!   ping the master answered (its settles applied first) the node registers such records
//!   again: registered → settled, refused → tombstoned then settled, unanswered → kept. A
//!   mount re-registers every live record, so it settles them all.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::error::{L3Error, L3Result};
use crate::master::{DiskLoc, NodeSync, RetainedObject, Settle};
use crate::rpc::service::{ClusterReply, ClusterRequest};
use crate::ssd::OffloadJob;

use super::NodeInner;
use super::mem::{Held, Staging};

/// SSD records registered per `Rescanned` call.
const RESCAN_CHUNK: usize = 4096;

impl NodeInner {
    /// Joins the master with an empty segment, then registers every live SSD record.
    pub(super) fn mount(&self) -> L3Result<()> {
        let _gate = self.gate.lock();
        // Every live record is registered again below (the rescan path), those whose
        // registration was unconfirmed included: they are settled once that succeeded.
        let taken = self
            .ssd
            .as_ref()
            .map(|s| s.take_unconfirmed())
            .unwrap_or_default();
        // Writes announced under an earlier mount are cancelled: the master may not know
        // them (see `SsdTier::cancel_before_mount`).
        let r = match &self.ssd {
            Some(ssd) => ssd.cancel_before_mount(&taken),
            None => Ok(()),
        }
        .and_then(|()| self.join());
        if let Some(ssd) = &self.ssd {
            match &r {
                Ok(()) => ssd.remounted(&taken),
                Err(_) => ssd.restore_unconfirmed(taken),
            }
        }
        r
    }

    /// [`NodeInner::mount`], under the gate.
    fn join(&self) -> L3Result<()> {
        self.mounted.store(false, Ordering::Release);
        // The master hands out every unacknowledged settle again after a mount, with the
        // number it has seen acknowledged: count from there (frees too).
        self.applied.store(0, Ordering::Release);
        self.freed.store(0, Ordering::Release);
        let kept = self.mem.lock().take_retained();
        self.link.call(ClusterRequest::MountNode {
            node: self.opts.id,
            segment: self.segment,
            capacity: self.opts.segment_bytes,
            data_addr: self.data_addr()?,
            offload_on_evict: self.offload_on_evict(),
        })?;
        // DRAM first: its replicas carry their version, SSD records do not (a record of a
        // key adopted here is refused below, never attached to a version it may not be).
        self.report_retained(kept)?;
        if let Some(ssd) = &self.ssd {
            let recs = ssd.live_records();
            let mut refused = 0usize;
            for chunk in recs.chunks(RESCAN_CHUNK) {
                let reply = self.link.call(ClusterRequest::Rescanned {
                    node: self.opts.id,
                    disks: chunk.to_vec(),
                })?;
                let ClusterReply::Accepted(ok) = reply else {
                    return Err(L3Error::RpcFail("unexpected reply to Rescanned".into()));
                };
                let dead: Vec<DiskLoc> = chunk
                    .iter()
                    .zip(ok)
                    .filter(|(_, accepted)| !accepted)
                    .map(|((_, _, loc), _)| *loc)
                    .collect();
                refused += dead.len();
                // Not mounted until they are dead: a refused record left live would come
                // back at a later restart, once the master forgot why it refused it.
                ssd.tombstone_many(&dead)?;
            }
            tracing::info!(
                registered = recs.len() - refused,
                refused,
                "ssd replicas registered with the master"
            );
        }
        self.mounted.store(true, Ordering::Release);
        Ok(())
    }

    /// Reports the DRAM replicas kept across the remount; keeps the bytes of those the
    /// master adopts under their new allocation, drops the others.
    fn report_retained(&self, kept: Vec<Held>) -> L3Result<()> {
        let (mut adopted, total) = (0usize, kept.len());
        // A live SSD record holding the same bytes as a DRAM copy goes with it (module docs
        // of `master::adopt`).
        let records: std::collections::HashMap<(crate::types::Tenant, String), DiskLoc> =
            match (&self.ssd, total) {
                (Some(ssd), 1..) => {
                    let mut m = std::collections::HashMap::new();
                    // Newest first: the newest record of a key is the one compared.
                    for (t, k, l) in ssd.live_records() {
                        m.entry((t, k)).or_insert(l);
                    }
                    m
                }
                _ => Default::default(),
            };
        let mut rest = kept;
        while !rest.is_empty() {
            let chunk: Vec<Held> = rest.drain(..rest.len().min(RESCAN_CHUNK)).collect();
            let objects: Vec<RetainedObject> = chunk
                .iter()
                .map(|h| {
                    let crc = crc32c::crc32c(&h.data);
                    RetainedObject {
                        tenant: h.tenant.clone(),
                        key: h.key.clone(),
                        token: h.token,
                        size: h.data.len() as u64,
                        crc,
                        disk: records
                            .get(&(h.tenant.clone(), h.key.clone()))
                            .filter(|d| d.size == h.data.len() as u64 && d.crc == crc)
                            .copied(),
                    }
                })
                .collect();
            let reply = self.link.call(ClusterRequest::Retained {
                node: self.opts.id,
                objects,
            })?;
            let ClusterReply::Adopted(allocs) = reply else {
                return Err(L3Error::RpcFail("unexpected reply to Retained".into()));
            };
            if allocs.len() != chunk.len() {
                return Err(L3Error::RpcFail("short reply to Retained".into()));
            }
            let mut m = self.mem.lock();
            for (h, a) in chunk.into_iter().zip(allocs) {
                if let Some(a) = a {
                    m.adopt(a, h);
                    adopted += 1;
                }
            }
        }
        if total > 0 {
            tracing::info!(adopted, refused = total - adopted, "dram replicas reported");
        }
        Ok(())
    }

    pub(super) fn apply(&self, s: NodeSync) {
        let _gate = self.gate.lock();
        let mut jobs = Vec::new();
        let mut lost = Vec::new();
        if !s.freed.is_empty() || !s.offload.is_empty() {
            let mut m = self.mem.lock();
            // Evicted replicas to write first: their allocations are in `freed` too.
            for a in &s.offload {
                if self.ssd.is_none() {
                    continue;
                }
                let Some((t, k, tok, data)) = m.stage(*a) else {
                    continue;
                };
                jobs.push(OffloadJob {
                    tenant: t,
                    key: k,
                    token: tok,
                    data,
                    staged: true,
                    done: None,
                });
            }
            // A staged allocation's free is applied by its SSD write (it retires then).
            for (_, a) in &s.freed {
                if m.allocs.get(a).is_some_and(|h| h.staged == Staging::No) {
                    m.drop_alloc(*a);
                }
            }
        }
        self.ack_frees(&s.freed, s.frees_acked);
        if let Some(ssd) = &self.ssd {
            for j in jobs {
                ssd.announce(&j.tenant, &j.key, j.token);
                let (t, k, tok) = (j.tenant.clone(), j.key.clone(), j.token);
                if ssd.enqueue(j, false).is_err() {
                    lost.push(OffloadJob {
                        tenant: t,
                        key: k,
                        token: tok,
                        data: Arc::from(Vec::new()),
                        staged: true,
                        done: None,
                    });
                }
            }
        }
        // After the offloads above were announced, so a cancel in the same reply finds them.
        self.settle(&s.settles, s.settled);
        // A full SSD queue skips the write, as in the single process: the copy is dropped.
        self.unstage(lost.iter());
        if !s.promote.is_empty()
            && let Some(tx) = &*self.promote_tx.lock()
        {
            // A full promoter queue skips the batch (a later probe asks again).
            let _ = tx.try_send(s.promote);
        }
    }

    /// The frees `freed` are applied: moves `freed` over the consecutive ones.
    fn ack_frees(&self, freed: &[(u64, u64)], acked: u64) {
        let mut a = self.freed.load(Ordering::Acquire).max(acked);
        for (n, _) in freed {
            if *n == a + 1 {
                a = *n;
            }
        }
        self.freed.fetch_max(a, Ordering::AcqRel);
    }

    /// Drops the ended DRAM copies of every version a cancel says is gone (`Held::token` at
    /// or below the cancelled one), before the cancel is acknowledged.
    fn drop_cancelled(&self, settles: &[(u64, Settle)]) {
        let mut gone: std::collections::HashMap<(&crate::types::Tenant, &str), u64> =
            std::collections::HashMap::new();
        for (_, s) in settles {
            if let Settle::Cancel { tenant, key, token } = s {
                let e = gone.entry((tenant, key.as_str())).or_default();
                *e = (*e).max(*token);
            }
        }
        if gone.is_empty() {
            return;
        }
        let mut m = self.mem.lock();
        let doomed: Vec<u64> = m
            .allocs
            .iter()
            .filter(|(_, h)| {
                h.ended
                    && h.staged == Staging::No
                    && gone
                        .get(&(&h.tenant, h.key.as_str()))
                        .is_some_and(|t| h.token <= *t)
            })
            .map(|(a, _)| *a)
            .collect();
        for a in doomed {
            m.drop_alloc(a);
        }
    }

    /// Applies settles durably, then moves `applied` over the consecutive ones.
    fn settle(&self, settles: &[(u64, Settle)], settled: u64) {
        self.drop_cancelled(settles);
        let mut locs = Vec::new();
        for (_, s) in settles {
            match s {
                Settle::Tombstone(l) => locs.push(*l),
                Settle::Cancel { tenant, key, token } => {
                    if let Some(ssd) = &self.ssd {
                        locs.extend(ssd.cancel(tenant, key, *token));
                    }
                }
            }
        }
        let durable = match &self.ssd {
            Some(ssd) => ssd
                .tombstone_many(&locs)
                .inspect_err(
                    |e| tracing::warn!(error = %e, "could not apply settles; not acknowledged"),
                )
                .is_ok(),
            None => true,
        };
        let mut a = self.applied.load(Ordering::Acquire).max(settled);
        if durable {
            let mut seqs: Vec<u64> = settles.iter().map(|(n, _)| *n).collect();
            seqs.sort_unstable();
            for n in seqs {
                if n == a + 1 {
                    a = n;
                }
            }
        }
        self.applied.fetch_max(a, Ordering::AcqRel);
    }

    /// One ping period: drop stale unended writes, ping (or mount), apply the reply, register
    /// again what was not confirmed.
    pub(super) fn tick(&self) {
        let stale = self.opts.put_timeout;
        let grace = self.opts.ping_interval;
        {
            let mut m = self.mem.lock();
            let old: Vec<u64> = m
                .allocs
                .iter()
                .filter(|(_, h)| {
                    (!h.ended && h.since.elapsed() > stale)
                        || (h.staged == Staging::Retired && h.since.elapsed() >= grace)
                })
                .map(|(&a, _)| a)
                .collect();
            for a in old {
                m.drop_alloc(a);
            }
            let idle = m.recycled.idle_trim(std::time::Instant::now());
            drop(m);
            if let Some(freed) = idle {
                drop(freed); // outside the lock
                crate::buffers::release_free_memory();
            }
        }
        if !self.mounted.load(Ordering::Acquire) {
            if let Err(e) = self.mount() {
                tracing::warn!(error = %e, "mount with the master failed; retrying");
            }
            return;
        }
        let applied = self.applied.load(Ordering::Acquire);
        let freed = self.freed.load(Ordering::Acquire);
        match self.link.call(ClusterRequest::Ping {
            node: self.opts.id,
            applied,
            freed,
        }) {
            Ok(ClusterReply::Sync(s)) if s.need_remount => {
                tracing::warn!(
                    "master does not know this node (declared dead or restarted): remounting"
                );
                if let Err(e) = self.mount() {
                    tracing::warn!(error = %e, "remount failed; retrying");
                }
            }
            Ok(ClusterReply::Sync(s)) => {
                self.apply(s);
                // The master is reachable again, and the cancels it sent are applied.
                self.retry_unconfirmed();
            }
            Ok(other) => tracing::warn!(?other, "unexpected ping reply"),
            Err(e) => tracing::warn!(error = %e, "ping failed"),
        }
    }
}
