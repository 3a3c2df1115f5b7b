//! The node's data channel: clients write the bytes of their puts here (ending them at the
//! master through the node) and read replicas by descriptor.
//!
//! Why: bytes never pass through the master; it hands out descriptors naming a node's
//! allocation (or SSD record) and the client fetches them here, on the transfer-channel
//! framing of [`crate::rpc::xfer`], token-checked. A client on the node's host sends the
//! same requests through shared memory (`shm`), served by the same [`NodeInner::node_put`]
//! and [`NodeInner::node_read`]: one set of checks (token, tenant and key, epoch) for both.
//!
//! Invariants:
//! - A read returns bytes only for the tenant and key they were written for (memory: the
//!   allocation's recorded owner; SSD: the bucket record's tenant and key), and SSD bytes only
//!   after their checksum verified.
//! - A put ends (becomes visible at the master) only after its bytes are held here; its
//!   write-through SSD copy is announced before the end is sent (so a cancel of the version
//!   always finds it) and queued after the master accepted the end.
//! - Memory held never exceeds twice the segment (-200 beyond), which bounds the lag between
//!   a free and its notice (see `sync`). Recycled buffers count in that bound: they are kept
//!   only while live plus recycled bytes fit in the segment (`recycle`).

use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::config::{OffloadMode, check_batch_keys, check_object_bytes};
use crate::error::{L3Error, L3Result};
use crate::master::DiskLoc;
use crate::rpc::service::{ClusterReply, ClusterRequest};
use crate::rpc::xfer::{XferHandler, XferReply, XferRequest, refuse, send_blobs, write_frame};
use crate::ssd::OffloadJob;
use crate::types::{Blob, PutHandle, PutOptions, ReplicaDescriptor, Tenant, validate_key};

use super::NodeInner;
use super::mem::{Held, Staging};
use super::recycle;

impl NodeInner {
    fn alloc_of(&self, h: &PutHandle) -> L3Result<u64> {
        match h.replica {
            ReplicaDescriptor::Memory {
                segment,
                alloc,
                size,
                ..
            } if segment == self.segment && size == h.size => Ok(alloc),
            _ => Err(L3Error::InvalidParams(
                "the handle names no allocation of this node".into(),
            )),
        }
    }

    /// A put placed by an older leader epoch than the one this node now follows: the new
    /// leader never placed it (and this node dropped its pending bytes when it remounted),
    /// so the writer is told to put it again — not `ReplicaIsNotReady`, which reads as
    /// "retry the same handle".
    fn same_epoch(&self, h: &PutHandle) -> L3Result<()> {
        let now = self.link.fence.seen();
        if h.epoch < now {
            return Err(L3Error::EpochFenced(format!(
                "the put of {:?} started under master epoch {}, the leader is now epoch {now}: \
                 put it again",
                h.key, h.epoch
            )));
        }
        Ok(())
    }

    /// Holds `data` under the handle's allocation, unended. `gave_up` is asked once the
    /// bytes are copied: a client that gave up on the call by then may have put its next
    /// bytes where these were read from (memory it shares itself), so they are not held.
    fn write_one(&self, h: &PutHandle, data: &[u8], gave_up: &dyn Fn() -> bool) -> L3Result<()> {
        validate_key(&h.key)?;
        self.same_epoch(h)?;
        let alloc = self.alloc_of(h)?;
        if data.len() as u64 != h.size {
            return Err(L3Error::InvalidParams(
                "data length differs from put size".into(),
            ));
        }
        check_object_bytes(h.size, self.opts.max_object_bytes)?;
        let data = recycle::filled(&self.mem, data);
        if gave_up() {
            return Err(crate::rpc::shm::gave_up());
        }
        let held = Held {
            tenant: h.tenant.clone(),
            key: h.key.clone(),
            token: h.token,
            data,
            ended: false,
            staged: Staging::No,
            since: Instant::now(),
        };
        let cap = self.opts.segment_bytes.saturating_mul(2);
        let released = self.mem.lock().write(alloc, held, cap)?;
        drop(released); // outside the lock
        Ok(())
    }

    fn end_many(&self, handles: &[PutHandle], out: &mut [L3Result<()>], opts: PutOptions) {
        let mut ready = Vec::new();
        {
            let m = self.mem.lock();
            for (i, h) in handles.iter().enumerate() {
                if out[i].is_err() {
                    continue;
                }
                let r = self.same_epoch(h).and_then(|()| self.alloc_of(h));
                let r = r.and_then(|a| match m.allocs.get(&a) {
                    Some(e) if e.token == h.token && e.tenant == h.tenant && e.key == h.key => {
                        if e.ended {
                            Err(L3Error::ObjectAlreadyExists)
                        } else {
                            Ok(())
                        }
                    }
                    _ => Err(L3Error::ReplicaIsNotReady),
                });
                match r {
                    Ok(()) => ready.push(i),
                    Err(e) => out[i] = Err(e),
                }
            }
        }
        if ready.is_empty() {
            return;
        }
        // Offload-on-evict writes evictions only (as the single process does).
        let ssd = self
            .ssd
            .as_ref()
            .filter(|s| s.config().mode == OffloadMode::WriteThrough);
        // Announced before the master can see the end: a remove that follows the end
        // queues a cancel for this version, which then always finds the announcement (or
        // the record it became), never an announcement made after it.
        if let Some(ssd) = ssd {
            for &i in &ready {
                ssd.announce(&handles[i].tenant, &handles[i].key, handles[i].token);
            }
        }
        let withdraw = |idx: &mut dyn Iterator<Item = usize>| {
            if let Some(ssd) = ssd {
                for i in idx {
                    ssd.withdraw(&handles[i].tenant, &handles[i].key, handles[i].token);
                }
            }
        };
        let req = ClusterRequest::PutEndReplicas {
            node: self.opts.id,
            handles: ready.iter().map(|&i| handles[i].clone()).collect(),
            soft_pin: opts.soft_pin,
        };
        let (res, sync) = match self.link.call(req) {
            Ok(ClusterReply::EndedReplicas(res, sync)) if res.len() == ready.len() => (res, sync),
            Ok(_) => {
                for &i in &ready {
                    out[i] = Err(L3Error::RpcFail("unexpected reply from the master".into()));
                }
                withdraw(&mut ready.iter().copied());
                return;
            }
            Err(e) => {
                for &i in &ready {
                    out[i] = Err(e.clone());
                }
                withdraw(&mut ready.iter().copied());
                return;
            }
        };
        let mut jobs = Vec::new();
        {
            let mut m = self.mem.lock();
            for (&i, r) in ready.iter().zip(res) {
                let Ok(alloc) = self.alloc_of(&handles[i]) else {
                    continue;
                };
                let h = &handles[i];
                // The allocation may hold another put's bytes by now: a newer put's, placed
                // on the same id by a master since restarted (`Mem::write`), or nothing
                // (a remount emptied the memory). Neither is this put's to end or drop.
                let ours = m.holds(alloc, &h.tenant, &h.key, h.token);
                match r {
                    Ok(ended) if ours => {
                        if let Some(e) = m.allocs.get_mut(&alloc) {
                            e.ended = true;
                            // One SSD copy per object: the first replica's node writes it.
                            if ended.primary {
                                jobs.push((i, e.data.clone()));
                            }
                        }
                    }
                    Ok(_) => {
                        out[i] = Err(L3Error::IllegalClient(
                            "the put's bytes are no longer held by this node (its allocation \
                             was given out again, or the node remounted): put it again"
                                .into(),
                        ));
                    }
                    Err(e) => {
                        // Revoked or gone at the master: the allocation is free there.
                        if ours && matches!(e, L3Error::IllegalClient(_) | L3Error::ObjectNotFound)
                        {
                            m.drop_alloc(alloc);
                        }
                        out[i] = Err(e);
                    }
                }
            }
        }
        // Only this node's primary replicas are written (one SSD copy per object).
        withdraw(
            &mut ready
                .iter()
                .copied()
                .filter(|i| !jobs.iter().any(|(j, _)| j == i)),
        );
        self.apply(sync);
        let Some(ssd) = ssd else {
            return;
        };
        let mut waits = Vec::new();
        for (i, data) in jobs {
            let h = &handles[i];
            let (job, wait) = OffloadJob::for_put(h, data, opts.wait_persisted);
            match ssd.enqueue(job, opts.wait_persisted) {
                Ok(()) => {
                    if let Some(rx) = wait {
                        waits.push((i, rx));
                    }
                }
                // The object is in DRAM; only its SSD copy is missing.
                Err(e) if opts.wait_persisted => out[i] = Err(e),
                Err(_) => {}
            }
        }
        for (i, rx) in waits {
            match rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => out[i] = Err(e),
                Err(_) => out[i] = Err(L3Error::Unavailable("ssd writer stopped".into())),
            }
        }
    }

    /// Writes `data` (one per handle, or none: end only) and, with `end`, ends the puts:
    /// the data channel's `NodePut`.
    pub(super) fn node_put(
        &self,
        handles: &[PutHandle],
        data: &[&[u8]],
        end: Option<PutOptions>,
    ) -> L3Result<Vec<L3Result<()>>> {
        self.node_put_from(handles, data, end, &|| false)
    }

    /// [`NodeInner::node_put`] of bytes in memory the client shares (the shared-memory
    /// path's `NodePut`): each key's bytes are checked after their copy with `gave_up`
    /// (whether the client gave up on the call: it may have reused that memory since), and
    /// a key whose client gave up is neither held nor ended (`tests/node_late_put.rs`).
    pub(super) fn node_put_from(
        &self,
        handles: &[PutHandle],
        data: &[&[u8]],
        end: Option<PutOptions>,
        gave_up: &dyn Fn() -> bool,
    ) -> L3Result<Vec<L3Result<()>>> {
        check_batch_keys(handles.len(), self.opts.max_batch_keys)?;
        if !data.is_empty() && data.len() != handles.len() {
            return Err(L3Error::InvalidParams(
                "handles and data differ in length".into(),
            ));
        }
        let mut out: Vec<L3Result<()>> = vec![Ok(()); handles.len()];
        for (i, (h, d)) in handles.iter().zip(data).enumerate() {
            out[i] = self.write_one(h, d, gave_up);
        }
        if let Some(opts) = end {
            self.end_many(handles, &mut out, opts);
        }
        Ok(out)
    }

    fn read_one(&self, t: &Tenant, key: &str, r: &ReplicaDescriptor) -> L3Result<Blob> {
        validate_key(key)?;
        match r {
            ReplicaDescriptor::Memory { segment, alloc, .. } => {
                if *segment != self.segment {
                    return Err(L3Error::ObjectNotFound);
                }
                let m = self.mem.lock();
                match m.allocs.get(alloc) {
                    Some(e) if e.ended && e.tenant == *t && e.key == key => {
                        Ok(Blob::Shared(e.data.clone()))
                    }
                    // Not mounted (a new process, or remounting): the descriptor may name
                    // bytes of the previous incarnation that the master has not dropped yet,
                    // so "not here" is not yet a definitive miss (issue 19).
                    None if !self.mounted.load(Ordering::Acquire) => Err(L3Error::RpcFail(
                        "the store node is (re)mounting: retry once the master has processed it"
                            .into(),
                    )),
                    _ => Err(L3Error::ObjectNotFound),
                }
            }
            d => {
                let loc = DiskLoc::from_descriptor(d).ok_or(L3Error::ObjectNotFound)?;
                let ssd = self.ssd.as_ref().ok_or(L3Error::UnableOffload)?;
                match ssd.owner_of(&loc) {
                    Some((tt, kk)) if tt == *t && kk == key => {}
                    _ => return Err(L3Error::ObjectNotFound),
                }
                let mut v = vec![0u8; loc.size as usize];
                if ssd.read(&loc, &mut v)? {
                    Ok(Blob::Owned(v))
                } else {
                    // Corrupt: a miss, dropped at the master and tombstoned here.
                    self.on_corrupt(t, key, loc);
                    Err(L3Error::ObjectNotFound)
                }
            }
        }
    }

    /// Reads replicas by descriptor, each only for the tenant and key it holds: the data
    /// channel's and the shared-memory path's `NodeRead`.
    pub(super) fn node_read(
        &self,
        tenant: &Tenant,
        keys: &[String],
        replicas: &[ReplicaDescriptor],
        n_caps: usize,
    ) -> L3Result<Vec<L3Result<Blob>>> {
        check_batch_keys(keys.len(), self.opts.max_batch_keys)?;
        if replicas.len() != keys.len() || n_caps != keys.len() {
            return Err(L3Error::InvalidParams(
                "keys, replicas and capacities differ in length".into(),
            ));
        }
        Ok(keys
            .iter()
            .zip(replicas)
            .map(|(k, r)| self.read_one(tenant, k, r))
            .collect())
    }
}

impl XferHandler for NodeInner {
    fn handle(&self, sock: &mut TcpStream, req: XferRequest) -> bool {
        match req {
            XferRequest::NodePut { handles, data, end } => {
                let data: Vec<&[u8]> = data.iter().map(|d| d.as_ref()).collect();
                let r = self.node_put(&handles, &data, end);
                write_frame(sock, &XferReply::Batch(r)).is_ok()
            }
            XferRequest::NodeRead {
                tenant,
                keys,
                replicas,
                caps,
            } => {
                let r = self.node_read(&tenant, &keys, &replicas, caps.len());
                send_blobs(sock, r, &caps).is_ok()
            }
            XferRequest::NodeFlush => {
                if let Some(s) = &self.ssd {
                    s.flush();
                }
                write_frame(sock, &XferReply::Batch(Ok(Vec::new()))).is_ok()
            }
            XferRequest::ShmOffer => {
                write_frame(sock, &XferReply::ShmOffer(self.shm_offer.get().cloned())).is_ok()
            }
            other => refuse(
                sock,
                &other,
                "this is a store node: metadata calls and probes go to the master",
            ),
        }
    }
}
