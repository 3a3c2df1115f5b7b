//! [`L3Store`] for [`RemoteStore`]: each call one tarpc request (or, for big batches, chunks
//! of them sent at once), bulk reads and probes on the transfer channel when the server has
//! one, and data calls sent to the store nodes when the server is a cluster master.
//!
//! Why apart from the connection: the trait is long and every method is the same few steps
//! (check limits, pick the path, call, map the reply); the connection's machinery lives once
//! in the parent module.

use futures::future::join_all;

use super::{PER_KEY_OVERHEAD, RemoteStore, empty_reply, within};
use crate::api::{BatchResult, L3Store, single};
use crate::error::{L3Error, L3Result, best_effort};
use crate::master::{LossCursor, Losses};
use crate::pattern::KeyPattern;
use crate::rpc::shm::ShmOutcome;
use crate::types::{
    Blob, ClientId, ClientStatus, ExistOptions, PutHandle, PutOptions, QueryResult,
    ReplicateConfig, SegmentId, StoreStats, Tenant,
};

impl L3Store for RemoteStore {
    fn put_start(&self, tenant: &Tenant, key: &str, size: u64) -> L3Result<PutHandle> {
        self.same_process()?;
        self.run(
            self.rpc()
                .put_start(self.ctx(), tenant.clone(), key.to_string(), size),
        )
    }

    fn put_write(&self, handle: &PutHandle, data: &[u8]) -> L3Result<()> {
        self.same_process()?;
        if data.len() as u64 > self.max_object_bytes() {
            return Err(L3Error::InvalidParams(format!(
                "object exceeds this client's {}-byte object limit",
                self.max_object_bytes()
            )));
        }
        self.check_request(data.len() + PER_KEY_OVERHEAD + handle.key.len())?;
        if self.limits.cluster {
            let v = self.cluster_put_on_nodes(std::slice::from_ref(handle), &[data], None);
            return single(v, empty_reply);
        }
        self.run(
            self.rpc()
                .put_write(self.ctx(), handle.clone(), Blob::Owned(data.to_vec())),
        )
    }

    fn put_end(&self, handle: &PutHandle, opts: PutOptions) -> L3Result<()> {
        self.same_process()?;
        if self.limits.cluster {
            let v = self.cluster_put_on_nodes(std::slice::from_ref(handle), &[], Some(opts));
            return single(v, empty_reply);
        }
        self.run(self.rpc().put_end(self.ctx(), handle.clone(), opts))
    }

    fn put_revoke(&self, handle: &PutHandle) -> L3Result<()> {
        self.same_process()?;
        self.run(self.rpc().put_revoke(self.ctx(), handle.clone()))
    }

    fn batch_put_start_with(
        &self,
        tenant: &Tenant,
        keys: &[String],
        sizes: &[u64],
        cfg: ReplicateConfig,
    ) -> BatchResult<PutHandle> {
        self.same_process()?;
        cfg.validate()?;
        self.check_keys(keys.len())?;
        if cfg.replica_num == 1 {
            // The call every server version knows.
            return self.run(self.rpc().batch_put_start(
                self.ctx(),
                tenant.clone(),
                keys.to_vec(),
                sizes.to_vec(),
            ));
        }
        let v = self.run(self.rpc().batch_put_start_replicated(
            self.ctx(),
            tenant.clone(),
            keys.to_vec(),
            sizes.to_vec(),
            cfg,
        ))?;
        Ok(v.into_iter()
            .map(|r| {
                r.map(|(mut h, extra)| {
                    h.extra_replicas = extra;
                    h
                })
            })
            .collect())
    }

    fn batch_put_end(&self, handles: &[PutHandle], opts: PutOptions) -> BatchResult<()> {
        self.same_process()?;
        self.check_keys(handles.len())?;
        if self.limits.cluster {
            return Ok(self.cluster_put_on_nodes(handles, &[], Some(opts)));
        }
        self.run(self.rpc().batch_put_end(self.ctx(), handles.to_vec(), opts))
    }

    fn batch_put_revoke(&self, handles: &[PutHandle]) -> BatchResult<()> {
        self.same_process()?;
        self.check_keys(handles.len())?;
        self.run(self.rpc().batch_put_revoke(self.ctx(), handles.to_vec()))
    }

    fn get_replica_list(&self, tenant: &Tenant, key: &str) -> L3Result<QueryResult> {
        self.same_process()?;
        let v = self.batch_query(tenant, &[key.to_string()])?;
        single(v, empty_reply)
    }

    fn exist_key(&self, tenant: &Tenant, key: &str, opts: ExistOptions) -> L3Result<bool> {
        self.same_process()?;
        let v = self.batch_exist_key(tenant, &[key.to_string()], opts)?;
        single(v, empty_reply)
    }

    fn batch_exist_key(
        &self,
        tenant: &Tenant,
        keys: &[String],
        opts: ExistOptions,
    ) -> BatchResult<bool> {
        self.same_process()?;
        self.check_keys(keys.len())?;
        self.idempotent(|| {
            if self.xfer.is_some() {
                return self.with_xfer(|x| x.exist(tenant, keys, opts));
            }
            self.run(
                self.rpc()
                    .batch_exist(self.ctx(), tenant.clone(), keys.to_vec(), opts),
            )
        })
    }

    fn batch_query(&self, tenant: &Tenant, keys: &[String]) -> BatchResult<QueryResult> {
        self.same_process()?;
        self.check_keys(keys.len())?;
        self.idempotent(|| {
            self.run(
                self.rpc()
                    .batch_query(self.ctx(), tenant.clone(), keys.to_vec()),
            )
        })
    }

    fn batch_get_with_query(
        &self,
        tenant: &Tenant,
        queries: &[QueryResult],
        bufs: &mut [&mut [u8]],
    ) -> BatchResult<u64> {
        self.same_process()?;
        let keys: Vec<String> = queries.iter().map(|q| q.key.clone()).collect();
        if self.limits.cluster {
            // A read, tried again across a failover as a plain get is: the descriptors'
            // check goes to the master (its first call after a failover failed whole, -900).
            return self.idempotent(|| self.cluster_get(tenant, &keys, bufs, Some(queries)));
        }
        self.get_chunks(tenant, &keys, bufs, Some(queries))
    }

    /// Retried across a failover: a retry of a remove that was applied answers -704.
    fn remove(&self, tenant: &Tenant, key: &str, force: bool) -> L3Result<()> {
        self.same_process()?;
        self.idempotent(|| {
            self.run(
                self.rpc()
                    .remove(self.ctx(), tenant.clone(), key.to_string(), force),
            )
        })
    }

    fn remove_all(&self, tenant: &Tenant, force: bool) -> L3Result<u64> {
        self.same_process()?;
        self.run(self.rpc().remove_all(self.ctx(), tenant.clone(), force))
    }

    fn remove_by_regex(&self, tenant: &Tenant, pattern: &str, force: bool) -> L3Result<u64> {
        self.same_process()?;
        // Checked here too: a bad pattern costs no round trip (the server checks again).
        KeyPattern::new(pattern)?;
        self.run(
            self.rpc()
                .remove_by_regex(self.ctx(), tenant.clone(), pattern.to_string(), force),
        )
    }

    fn batch_replica_clear(
        &self,
        tenant: &Tenant,
        keys: &[String],
        segment: SegmentId,
    ) -> BatchResult<bool> {
        self.same_process()?;
        self.check_keys(keys.len())?;
        for k in keys {
            crate::types::validate_key(k)?;
        }
        self.run(
            self.rpc()
                .batch_replica_clear(self.ctx(), tenant.clone(), keys.to_vec(), segment),
        )
    }

    fn copy_replica(&self, tenant: &Tenant, key: &str, target: SegmentId) -> L3Result<bool> {
        self.same_process()?;
        crate::types::validate_key(key)?;
        self.run(
            self.rpc()
                .copy_replica(self.ctx(), tenant.clone(), key.to_string(), target),
        )
    }

    fn move_replica(
        &self,
        tenant: &Tenant,
        key: &str,
        source: SegmentId,
        target: SegmentId,
    ) -> L3Result<()> {
        self.same_process()?;
        crate::types::validate_key(key)?;
        self.run(self.rpc().move_replica(
            self.ctx(),
            tenant.clone(),
            key.to_string(),
            source,
            target,
        ))
    }

    fn mount_segment(&self, client: ClientId, segment: SegmentId, capacity: u64) -> L3Result<()> {
        self.same_process()?;
        self.run(
            self.rpc()
                .mount_segment(self.ctx(), client, segment, capacity),
        )
    }

    fn unmount_segment(&self, client: ClientId, segment: SegmentId) -> L3Result<()> {
        self.same_process()?;
        self.run(self.rpc().unmount_segment(self.ctx(), client, segment))
    }

    fn ping(&self, client: ClientId) -> L3Result<ClientStatus> {
        self.same_process()?;
        self.run(self.rpc().ping(self.ctx(), client))
    }

    fn put(&self, tenant: &Tenant, key: &str, data: &[u8], opts: PutOptions) -> L3Result<()> {
        self.same_process()?;
        let v = self.batch_put_from(tenant, &[key.to_string()], &[data], opts)?;
        single(v, empty_reply)
    }

    fn get(&self, tenant: &Tenant, key: &str) -> L3Result<Vec<u8>> {
        self.same_process()?;
        if self.limits.cluster {
            return self.idempotent(|| {
                let q = self.get_replica_list(tenant, key)?;
                let mut buf = vec![0u8; q.size as usize];
                let mut bufs = [&mut buf[..]];
                let v = self.cluster_read(tenant, &[key.to_string()], &mut bufs, vec![Ok(q)])?;
                let n = single(v, empty_reply)?;
                buf.truncate(n as usize);
                Ok(buf)
            });
        }
        let v = self.run(self.rpc().batch_get(
            self.ctx(),
            tenant.clone(),
            vec![key.to_string()],
        ))?;
        match single(v, empty_reply)? {
            Blob::Owned(b) => Ok(b),
            b => Ok(b.as_slice().to_vec()),
        }
    }

    fn get_into(&self, tenant: &Tenant, key: &str, buf: &mut [u8]) -> L3Result<u64> {
        self.same_process()?;
        let v = self.batch_get_into(tenant, &[key.to_string()], &mut [buf])?;
        single(v, empty_reply)
    }

    fn batch_put_from_with(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &[&[u8]],
        opts: PutOptions,
        cfg: ReplicateConfig,
    ) -> BatchResult<()> {
        self.same_process()?;
        cfg.validate()?;
        self.check_bufs(keys.len(), bufs.len())?;
        for (k, b) in keys.iter().zip(bufs) {
            if b.len() as u64 > self.max_object_bytes() {
                return Err(L3Error::InvalidParams(format!(
                    "object of {} bytes exceeds this client's {}-byte object limit (the \
                     server's limit and what one frame carries)",
                    b.len(),
                    self.max_object_bytes()
                )));
            }
            self.check_request(b.len() + k.len() + PER_KEY_OVERHEAD)?;
        }
        if self.limits.cluster {
            return self.cluster_put(tenant, keys, bufs, opts, cfg);
        }
        if let Some(shm) = &self.shm
            && let ShmOutcome::Done(r) = shm.lock().put(tenant, keys, bufs, opts, cfg)
        {
            return r;
        }
        if cfg.replica_num > 1 {
            return self.put_replicated(tenant, keys, bufs, opts, cfg);
        }
        let ranges = self.chunks(keys.len(), |i| bufs[i].len());
        let limit = self.call_limit();
        let calls = ranges.iter().map(|r| {
            let ctx = self.ctx();
            let c = self.rpc().clone();
            let t = tenant.clone();
            let ks = keys[r.clone()].to_vec();
            let data: Vec<Blob> = bufs[r.clone()]
                .iter()
                .map(|b| Blob::Owned(b.to_vec()))
                .collect();
            async move { within(limit, c.batch_put(ctx, t, ks, data, opts)).await }
        });
        let replies = self.rt.block_on(join_all(calls));
        let mut out = Vec::with_capacity(keys.len());
        for (r, reply) in ranges.iter().zip(replies) {
            let v = reply.map_err(|e| self.transport_err(e))??;
            if v.len() != r.len() {
                return Err(L3Error::RpcFail("reply length mismatch".into()));
            }
            out.extend(v);
        }
        Ok(out)
    }

    fn batch_get_into(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &mut [&mut [u8]],
    ) -> BatchResult<u64> {
        self.same_process()?;
        if self.limits.cluster {
            return self.idempotent(|| self.cluster_get(tenant, keys, bufs, None));
        }
        self.get_chunks(tenant, keys, bufs, None)
    }

    fn get_size(&self, tenant: &Tenant, key: &str) -> L3Result<u64> {
        self.same_process()?;
        self.idempotent(|| {
            self.run(
                self.rpc()
                    .get_size(self.ctx(), tenant.clone(), key.to_string()),
            )
        })
    }

    fn flush(&self) -> L3Result<()> {
        self.same_process()?;
        if self.limits.cluster {
            return self.cluster_flush();
        }
        self.run(self.rpc().flush(self.ctx()))
    }

    fn stats(&self) -> L3Result<StoreStats> {
        self.same_process()?;
        self.idempotent(|| self.run(self.rpc().stats(self.ctx())))
    }

    fn losses_since(&self, tenant: &Tenant, cursor: Option<LossCursor>) -> L3Result<Losses> {
        self.same_process()?;
        self.run(self.rpc().losses_since(self.ctx(), tenant.clone(), cursor))
    }

    /// The server's limit, or less: what one frame carries under the longest key and
    /// tenant (a put's request and a get's reply hold the object's bytes in one frame).
    fn max_object_bytes(&self) -> u64 {
        self.limits.max_object_bytes.min(self.frame_object_bytes())
    }

    fn batch_keys_limit(&self) -> usize {
        usize::try_from(self.limits.max_batch_keys).unwrap_or(usize::MAX)
    }
}

impl RemoteStore {
    /// Puts with `replica_num > 1` over TCP to a `--role both` server: start (the server
    /// places the replicas, one per segment owner), write (every replica), end.
    fn put_replicated(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &[&[u8]],
        opts: PutOptions,
        cfg: ReplicateConfig,
    ) -> BatchResult<()> {
        self.same_process()?;
        self.put_placed(tenant, keys, bufs, cfg, |hs, ds| {
            let mut res: Vec<L3Result<()>> = hs
                .iter()
                .zip(ds)
                .map(|(h, d)| self.put_write(h, d))
                .collect();
            let written: Vec<PutHandle> = hs
                .iter()
                .zip(&res)
                .filter(|(_, r)| r.is_ok())
                .map(|(h, _)| h.clone())
                .collect();
            let mut ends = self.batch_put_end(&written, opts)?.into_iter();
            if ends.len() != written.len() {
                return Err(L3Error::RpcFail("reply length mismatch".into()));
            }
            for r in res.iter_mut().filter(|r| r.is_ok()) {
                *r = ends.next().unwrap_or(Ok(()));
            }
            Ok(res)
        })
    }

    /// A whole put in two phases: a placement for every key (`batch_put_start_with`), then
    /// `finish` writes and ends the placed ones (one result per handle, in order). A
    /// placement whose finish failed is revoked at once (best effort) rather than at the put
    /// timeout; a finish that failed as a whole (transport) revokes them all and is the
    /// batch's error. A finish's -705 is success (this put's own object is complete). Per-key
    /// results, in the batch's order.
    pub(super) fn put_placed(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &[&[u8]],
        cfg: ReplicateConfig,
        finish: impl FnOnce(&[PutHandle], &[&[u8]]) -> L3Result<Vec<L3Result<()>>>,
    ) -> BatchResult<()> {
        let sizes: Vec<u64> = bufs.iter().map(|b| b.len() as u64).collect();
        let started = self.batch_put_start_with(tenant, keys, &sizes, cfg)?;
        if started.len() != keys.len() {
            return Err(L3Error::RpcFail("reply length mismatch".into()));
        }
        let mut out: Vec<L3Result<()>> = Vec::with_capacity(keys.len());
        let (mut handles, mut data, mut at) = (Vec::new(), Vec::new(), Vec::new());
        for (i, r) in started.into_iter().enumerate() {
            match r {
                Ok(h) => {
                    out.push(Ok(()));
                    handles.push(h);
                    data.push(bufs[i]);
                    at.push(i);
                }
                Err(e) => out.push(Err(e)),
            }
        }
        let res = match finish(&handles, &data) {
            Ok(v) if v.len() == handles.len() => v,
            Ok(_) => vec![Err(L3Error::RpcFail("reply length mismatch".into())); handles.len()],
            Err(e) => {
                best_effort("revoke unfinished puts", self.batch_put_revoke(&handles));
                return Err(e);
            }
        };
        let mut failed = Vec::new();
        for ((i, h), r) in at.into_iter().zip(handles).zip(res) {
            match r {
                // -705 for this placement's handle: the token matched, so the object found
                // complete is this put's own (another writer's is refused at placement,
                // above), e.g. adopted by a restarted master from a replica this put ended
                // (`tests/adopted_put.rs`). Nothing to revoke; the put took effect.
                Err(L3Error::ObjectAlreadyExists) => {}
                Err(e) => {
                    failed.push(h);
                    out[i] = Err(e);
                }
                Ok(()) => {}
            }
        }
        if !failed.is_empty() {
            best_effort("revoke failed puts", self.batch_put_revoke(&failed));
        }
        Ok(out)
    }
}
