//! [`L3Store`] for [`EmbeddedStore`]: Mooncake's client API over the read and write paths.
//!
//! Why: the trait is what the scheduler, the server and the bindings program against; this
//! file only validates batch shapes, times the operations and delegates, so the logic lives
//! once in the path modules.

use std::time::Instant;

use crate::api::{BatchResult, L3Store};
use crate::batch_order::last_to_first;
use crate::error::{L3Error, L3Result};
use crate::master::{Cleared, LossCursor, Losses};
use crate::metrics::Op;
use crate::pattern::KeyPattern;
use crate::types::{
    ClientId, ClientStatus, ExistOptions, PutHandle, PutOptions, QueryResult, ReplicateConfig,
    SegmentId, StoreStats, Tenant, validate_key,
};

use super::EmbeddedStore;

impl L3Store for EmbeddedStore {
    fn put_start(&self, tenant: &Tenant, key: &str, size: u64) -> L3Result<PutHandle> {
        self.inner.put_start(tenant, key, size, 1)
    }

    fn put_write(&self, handle: &PutHandle, data: &[u8]) -> L3Result<()> {
        if data.len() as u64 != handle.size {
            return Err(L3Error::InvalidParams(
                "data length differs from put size".into(),
            ));
        }
        let bytes = self.inner.object_bytes(data);
        self.inner.master.lock().put_write(handle, bytes)
    }

    fn put_end(&self, handle: &PutHandle, opts: PutOptions) -> L3Result<()> {
        self.inner.put_end(handle, opts)
    }

    fn put_revoke(&self, handle: &PutHandle) -> L3Result<()> {
        self.inner.master.lock().put_revoke(handle)
    }

    /// `replica_num` memory replicas on segments of distinct owners, best effort: with the
    /// store's own segment alone that is one (one process is one failure domain), with
    /// segments mounted by clients (Mooncake's model, `mount_segment`) one in each of up to
    /// `replica_num` of them, so a client's segment going away leaves the other replicas.
    fn batch_put_start_with(
        &self,
        tenant: &Tenant,
        keys: &[String],
        sizes: &[u64],
        cfg: ReplicateConfig,
    ) -> BatchResult<PutHandle> {
        cfg.validate()?;
        self.inner.cfg.check_batch(keys.len())?;
        if keys.len() != sizes.len() {
            return Err(L3Error::InvalidParams(
                "keys and sizes differ in length".into(),
            ));
        }
        Ok(keys
            .iter()
            .zip(sizes)
            .map(|(k, &s)| self.inner.put_start(tenant, k, s, cfg.replica_num))
            .collect())
    }

    fn batch_put_end(&self, handles: &[PutHandle], opts: PutOptions) -> BatchResult<()> {
        self.inner.cfg.check_batch(handles.len())?;
        // Last to first: the batch's first key ranks most recent (`batch_order`).
        Ok(last_to_first(handles.len(), |i| {
            self.inner.put_end(&handles[i], opts)
        }))
    }

    fn batch_put_revoke(&self, handles: &[PutHandle]) -> BatchResult<()> {
        self.inner.cfg.check_batch(handles.len())?;
        let mut m = self.inner.master.lock();
        Ok(handles.iter().map(|h| m.put_revoke(h)).collect())
    }

    fn get_replica_list(&self, tenant: &Tenant, key: &str) -> L3Result<QueryResult> {
        validate_key(key)?;
        let now = self.inner.clock.now_ms();
        let q = self.inner.master.lock().query(tenant, key, now);
        self.inner.note_query_hits(tenant, std::slice::from_ref(&q));
        q
    }

    fn batch_exist_key(
        &self,
        tenant: &Tenant,
        keys: &[String],
        opts: ExistOptions,
    ) -> BatchResult<bool> {
        self.exist_many(tenant, keys, opts)
    }

    fn batch_query(&self, tenant: &Tenant, keys: &[String]) -> BatchResult<QueryResult> {
        self.inner.cfg.check_batch(keys.len())?;
        let t0 = Instant::now();
        let now = self.inner.clock.now_ms();
        let out = self.inner.master.lock().query_many(tenant, keys, now);
        self.inner.note_query_hits(tenant, &out);
        self.inner.metrics.observe(Op::Query, t0.elapsed());
        Ok(out)
    }

    fn batch_get_with_query(
        &self,
        tenant: &Tenant,
        queries: &[QueryResult],
        bufs: &mut [&mut [u8]],
    ) -> BatchResult<u64> {
        self.inner.cfg.check_batch(queries.len())?;
        if queries.len() != bufs.len() {
            return Err(L3Error::InvalidParams(
                "queries and buffers differ in length".into(),
            ));
        }
        let t0 = Instant::now();
        let keys: Vec<String> = queries.iter().map(|q| q.key.clone()).collect();
        let srcs = self.inner.resolve_query(tenant, queries);
        let out = self.inner.fill(tenant, &keys, srcs, bufs);
        self.inner.metrics.observe(Op::Get, t0.elapsed());
        Ok(out)
    }

    /// Refused (nothing changed, the key readable) when the key's SSD tombstone cannot be
    /// written: the tombstone is durable before the key leaves memory (`Inner::remove_durably`).
    fn remove(&self, tenant: &Tenant, key: &str, force: bool) -> L3Result<()> {
        validate_key(key)?;
        let t0 = Instant::now();
        let now = self.inner.clock.now_ms();
        self.inner.remove_durably(tenant, key, force, now)?;
        self.inner.metrics.observe(Op::Remove, t0.elapsed());
        Ok(())
    }

    /// Keys whose SSD tombstone cannot be written stay; the others are removed and the
    /// error names the kept ones and the count (`Inner::remove_many_durably`).
    fn remove_all(&self, tenant: &Tenant, force: bool) -> L3Result<u64> {
        let now = self.inner.clock.now_ms();
        self.inner.remove_many_durably(tenant, |_| true, force, now)
    }

    /// As `remove_all`, for the keys `pattern` is found in.
    fn remove_by_regex(&self, tenant: &Tenant, pattern: &str, force: bool) -> L3Result<u64> {
        let pattern = KeyPattern::new(pattern)?;
        let t0 = Instant::now();
        let now = self.inner.clock.now_ms();
        let n = (self.inner).remove_many_durably(tenant, |k| pattern.is_found_in(k), force, now)?;
        self.inner.metrics.observe(Op::Remove, t0.elapsed());
        Ok(n)
    }

    fn copy_replica(&self, tenant: &Tenant, key: &str, target: SegmentId) -> L3Result<bool> {
        validate_key(key)?;
        self.inner.master.lock().copy_replica(tenant, key, target)
    }

    fn move_replica(
        &self,
        tenant: &Tenant,
        key: &str,
        source: SegmentId,
        target: SegmentId,
    ) -> L3Result<()> {
        validate_key(key)?;
        (self.inner.master.lock()).move_replica(tenant, key, source, target)
    }

    fn batch_replica_clear(
        &self,
        tenant: &Tenant,
        keys: &[String],
        segment: SegmentId,
    ) -> BatchResult<bool> {
        self.inner.cfg.check_batch(keys.len())?;
        let now = self.inner.clock.now_ms();
        let mut removed = Vec::new();
        let out = {
            let mut m = self.inner.master.lock();
            keys.iter()
                .map(|k| {
                    validate_key(k)?;
                    Ok(match m.clear_replica(tenant, k, segment, now)? {
                        Cleared::Skipped => false,
                        Cleared::Replica => true,
                        Cleared::Object(r) => {
                            removed.push(r);
                            true
                        }
                    })
                })
                .collect()
        };
        // An object that went with its last replica: its queued SSD write is cancelled.
        self.inner.forget_on_disk(tenant, &removed)?;
        Ok(out)
    }

    fn mount_segment(&self, client: ClientId, segment: SegmentId, capacity: u64) -> L3Result<()> {
        let now = self.inner.clock.now_ms();
        self.inner
            .master
            .lock()
            .mount_segment(client, segment, capacity, now)
    }

    fn unmount_segment(&self, client: ClientId, segment: SegmentId) -> L3Result<()> {
        self.inner
            .master
            .lock()
            .unmount_segment(client, segment)
            .map(|_| ())
    }

    fn ping(&self, client: ClientId) -> L3Result<ClientStatus> {
        let now = self.inner.clock.now_ms();
        Ok(self.inner.master.lock().ping(client, now))
    }

    fn put(&self, tenant: &Tenant, key: &str, data: &[u8], opts: PutOptions) -> L3Result<()> {
        let t0 = Instant::now();
        let h = self.inner.put_start(tenant, key, data.len() as u64, 1)?;
        let r = self.inner.put_finish(&h, data, opts);
        self.inner.metrics.observe(Op::Put, t0.elapsed());
        r
    }

    fn get(&self, tenant: &Tenant, key: &str) -> L3Result<Vec<u8>> {
        let size = self.get_size(tenant, key)?;
        let mut buf = vec![0u8; size as usize];
        let n = self.get_into(tenant, key, &mut buf)?;
        buf.truncate(n as usize);
        Ok(buf)
    }

    /// `replica_num` replicas as `batch_put_start_with` places them.
    fn batch_put_from_with(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &[&[u8]],
        opts: PutOptions,
        cfg: ReplicateConfig,
    ) -> BatchResult<()> {
        cfg.validate()?;
        self.inner.cfg.check_batch(keys.len())?;
        if keys.len() != bufs.len() {
            return Err(L3Error::InvalidParams(
                "keys and buffers differ in length".into(),
            ));
        }
        // The whole batch is allocated before any of it is written, as Mooncake's
        // BatchPutStart does: pending objects are never eviction victims, so a batch cannot
        // evict its own keys (before, a batch larger than the free space evicted its first
        // keys to store its last and still answered Ok for them). Keys that do not fit fail
        // with -200.
        let t0 = Instant::now();
        let handles: Vec<L3Result<PutHandle>> = keys
            .iter()
            .zip(bufs)
            .map(|(k, b)| {
                self.inner
                    .put_start(tenant, k, b.len() as u64, cfg.replica_num)
            })
            .collect();
        // Allocated first to last (a batch that does not fit keeps its head), ended last to
        // first (its first key ranks most recent: `batch_order`).
        let out = last_to_first(handles.len(), |i| {
            let h = handles[i].as_ref().map_err(Clone::clone)?;
            self.inner.put_finish(h, bufs[i], opts)
        });
        self.inner.metrics.observe(Op::Put, t0.elapsed());
        Ok(out)
    }

    fn batch_get_into(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &mut [&mut [u8]],
    ) -> BatchResult<u64> {
        self.inner.cfg.check_batch(keys.len())?;
        if keys.len() != bufs.len() {
            return Err(L3Error::InvalidParams(
                "keys and buffers differ in length".into(),
            ));
        }
        let t0 = Instant::now();
        let srcs = self.inner.resolve(tenant, keys);
        let out = self.inner.fill(tenant, keys, srcs, bufs);
        self.inner.metrics.observe(Op::Get, t0.elapsed());
        Ok(out)
    }

    fn get_size(&self, tenant: &Tenant, key: &str) -> L3Result<u64> {
        validate_key(key)?;
        self.inner.master.lock().size_of(tenant, key)
    }

    fn flush(&self) -> L3Result<()> {
        if let Some(s) = &self.inner.ssd {
            s.flush();
        }
        Ok(())
    }

    fn losses_since(&self, tenant: &Tenant, cursor: Option<LossCursor>) -> L3Result<Losses> {
        self.inner.master.lock().losses_since(tenant, cursor)
    }

    fn max_object_bytes(&self) -> u64 {
        self.config().max_object_bytes
    }

    fn batch_keys_limit(&self) -> usize {
        self.config().max_batch_keys
    }

    fn stats(&self) -> L3Result<StoreStats> {
        let mut s = self.inner.master.lock().stats();
        if let Some(t) = &self.inner.ssd {
            s.disk_used_bytes = t.stats().used_bytes;
        }
        Ok(s)
    }
}
