//! The write path: put start (allocation, with eviction staging objects for the SSD) and put
//! end (publication, with the write-through hand-off to the SSD writer).
//!
//! Why: a put is two metadata steps around a copy done outside the lock; what evicting or
//! publishing hands to the SSD tier must be announced in the same critical section that
//! makes it so, or a concurrent remove could miss a queued write.

use std::sync::Arc;

use crate::config::OffloadMode;
use crate::error::{L3Error, L3Result, best_effort};
use crate::master::EvictionOutcome;
use crate::metrics::Metrics;
use crate::ssd::OffloadJob;
use crate::types::{PutHandle, PutOptions, Tenant};

use super::Inner;

impl Inner {
    /// A put's bytes in a buffer of their own: a recycled one when the segment has one of
    /// this size (taken under the lock, filled after it), else a fresh one. One copy.
    pub(super) fn object_bytes(&self, data: &[u8]) -> Arc<[u8]> {
        let recycled = self.master.lock().take_buffer(data.len() as u64);
        crate::buffers::fill(recycled, data)
    }

    /// `PutStart` of `replicas` memory replicas, on segments of distinct owners where
    /// several are mounted (each client of the store that contributed a segment is one, as
    /// in Mooncake; best effort, at least one).
    pub(super) fn put_start(
        &self,
        t: &Tenant,
        key: &str,
        size: u64,
        replicas: u32,
    ) -> L3Result<PutHandle> {
        self.cfg.check_put(key, size)?;
        let now = self.clock.now_ms();
        let mut out = EvictionOutcome::default();
        let r = {
            let mut m = self.master.lock();
            let r = m.put_start(t, key, size, replicas as usize, now, &mut out);
            // Announced with the eviction that staged them, so a remove cancels them.
            if let Some(ssd) = &self.ssd {
                for s in &out.to_offload {
                    ssd.announce(&s.tenant, &s.key, s.token);
                }
            }
            r
        };
        if !out.to_offload.is_empty() {
            self.offload_evicted(out);
        }
        r
    }

    /// Writes and ends a started put; a failed write revokes it.
    pub(super) fn put_finish(&self, h: &PutHandle, data: &[u8], opts: PutOptions) -> L3Result<()> {
        self.put_finish_bytes(h, Ok(self.object_bytes(data)), opts)
    }

    /// Ends a started put with its bytes already in a buffer of their own; `Err` (the bytes
    /// could not be had) revokes it, so nothing of the object becomes visible.
    pub(super) fn put_finish_bytes(
        &self,
        h: &PutHandle,
        bytes: L3Result<Arc<[u8]>>,
        opts: PutOptions,
    ) -> L3Result<()> {
        let bytes = match bytes {
            Ok(b) => b,
            Err(e) => {
                best_effort("revoke an unfilled put", self.master.lock().put_revoke(h));
                return Err(e);
            }
        };
        // Bind the result first: the guard of the first lock must be gone before the revoke
        // locks again (parking_lot's mutex is not reentrant; holding it here deadlocked the
        // store when a forced remove raced this put).
        let written = self.master.lock().put_write(h, bytes);
        if let Err(e) = written {
            // The revoke fails only if the pending object is already gone (a forced remove
            // took it): nothing is left to release then.
            let revoked = self.master.lock().put_revoke(h);
            best_effort("revoke a put whose write failed", revoked);
            return Err(e);
        }
        self.put_end(h, opts)
    }

    pub(super) fn put_end(&self, h: &PutHandle, opts: PutOptions) -> L3Result<()> {
        let now = self.clock.now_ms();
        let write_through = self
            .ssd
            .as_ref()
            .filter(|s| s.config().mode == OffloadMode::WriteThrough);
        let data = {
            let mut m = self.master.lock();
            let data = m.put_end(h, opts.soft_pin, now)?;
            // Announced in the critical section that makes the object visible: a remove
            // either precedes both or finds the announcement and cancels the write.
            if let (Some(ssd), Some(_)) = (write_through, &data) {
                ssd.announce(&h.tenant, &h.key, h.token);
                m.mark_copy_queued(&h.tenant, &h.key, h.token);
            }
            data
        };
        let Some(ssd) = write_through else {
            return Ok(());
        };
        let Some(data) = data else { return Ok(()) };
        let (job, wait) = OffloadJob::for_put(h, data, opts.wait_persisted);
        match ssd.enqueue(job, opts.wait_persisted) {
            Ok(()) => {}
            Err(e) => {
                Metrics::add(&self.metrics.offload_skipped, 1);
                // No copy is coming: an eviction may not stage it any more (and one that
                // already did leaves no bytes behind).
                self.master.lock().unstage(&h.tenant, &h.key, h.token);
                // The object is in DRAM; only its SSD copy is missing.
                return if opts.wait_persisted { Err(e) } else { Ok(()) };
            }
        }
        match wait {
            Some(rx) => rx
                .recv()
                .map_err(|_| L3Error::Unavailable("ssd writer stopped".into()))?,
            None => Ok(()),
        }
    }
}
