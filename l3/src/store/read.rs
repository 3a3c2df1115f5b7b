//! The read path: resolve keys (or query results) to sources under the master lock, then
//! copy from them after it is released: DRAM replicas by memcpy (two threads for large
//! batches) or as shared blobs, SSD records by verified reads (several in flight).
//!
//! Why: reads dominate; doing the metadata work for a whole batch under one lock and all
//! copying outside it keeps the lock short and the copy single.
//!
//! Invariants:
//! - Bytes handed to a reader come from a replica that was leased at resolution time, so
//!   eviction cannot free them under the reader (and `Arc` keeps them alive regardless).
//! - SSD bytes are returned only after their checksum verified; a corrupt copy is dropped from
//!   the master and reported as a miss (-704).

use std::sync::Arc;

use crate::error::{L3Error, L3Result};
use crate::master::{DiskLoc, ReadSource};
use crate::metrics::Metrics;
use crate::ssd::SsdTier;
use crate::types::{Blob, QueryResult, ReplicaDescriptor, Tenant, validate_key};

use super::Inner;

/// Copies above this many bytes in one batch are split across two threads.
const PARALLEL_COPY_BYTES: u64 = 8 << 20;

impl Inner {
    /// Resolves query results while their leases hold (-707 per expired key). Descriptors
    /// are reused only if they still name this tenant's object: a forged or stale one is a
    /// miss, never foreign bytes.
    pub(super) fn resolve_query(
        &self,
        tenant: &Tenant,
        queries: &[QueryResult],
    ) -> Vec<L3Result<(u64, ReadSource)>> {
        let now = self.clock.now_ms();
        let m = self.master.lock();
        queries
            .iter()
            .map(|q| {
                if now >= q.lease_deadline_ms {
                    Metrics::add(&self.metrics.lease_rejections, 1);
                    return Err(L3Error::LeaseExpired);
                }
                validate_key(&q.key)?;
                let qr = m.current_replicas(tenant, &q.key)?;
                for r in &q.replicas {
                    match r {
                        ReplicaDescriptor::Memory { alloc, .. } if qr.0.contains(alloc) => {
                            if let Some(d) = m.alloc_data(*alloc) {
                                return Ok((d.len() as u64, ReadSource::Memory(d)));
                            }
                        }
                        ReplicaDescriptor::Disk {
                            bucket,
                            offset,
                            size,
                            crc,
                            ..
                        } => {
                            let loc = DiskLoc {
                                bucket: *bucket,
                                offset: *offset,
                                size: *size,
                                crc: *crc,
                            };
                            if qr.1 == Some(loc) {
                                return Ok((loc.size, ReadSource::Disk(loc)));
                            }
                        }
                        _ => {}
                    }
                }
                Err(L3Error::ObjectNotFound)
            })
            .collect()
    }

    /// Promotion on hit: queries (Mooncake's `GetReplicaList`, what its reads start with)
    /// that found objects on SSD only count towards their admission.
    pub(super) fn note_query_hits(&self, t: &Tenant, out: &[L3Result<QueryResult>]) {
        let Some(p) = &self.promoter else { return };
        let ssd_only = |q: &QueryResult| {
            !q.replicas.is_empty()
                && q.replicas
                    .iter()
                    .all(|r| matches!(r, ReplicaDescriptor::Disk { .. }))
        };
        let hits = out
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .filter(|q| ssd_only(q))
            .map(|q| (t.clone(), q.key.clone()))
            .collect();
        p.note_hits(hits);
    }

    /// Turns sources into blobs: DRAM shared, SSD read and verified.
    pub(super) fn blobs<K: AsRef<str>>(
        &self,
        t: &Tenant,
        keys: &[K],
        srcs: Vec<L3Result<(u64, ReadSource)>>,
    ) -> Vec<L3Result<Blob>> {
        let mut out = Vec::with_capacity(srcs.len());
        for (i, s) in srcs.into_iter().enumerate() {
            out.push(match s {
                Err(e) => Err(e),
                Ok((_, ReadSource::Memory(d))) => {
                    Metrics::add(&self.metrics.hits_memory, 1);
                    Ok(Blob::Shared(d))
                }
                Ok((size, ReadSource::Disk(loc))) => match &self.ssd {
                    None => Err(L3Error::UnableOffload),
                    Some(ssd) => {
                        let mut v = vec![0u8; size as usize];
                        match ssd.read(&loc, &mut v) {
                            Ok(true) => {
                                Metrics::add(&self.metrics.hits_disk, 1);
                                Ok(Blob::Owned(v))
                            }
                            Ok(false) => {
                                self.on_corrupt(t, keys[i].as_ref(), &loc);
                                Err(L3Error::ObjectNotFound)
                            }
                            Err(e) => Err(e),
                        }
                    }
                },
            });
        }
        Metrics::add(
            &self.metrics.misses,
            out.iter().filter(|r| r.is_err()).count() as u64,
        );
        out
    }

    /// Resolves keys to sources under one lock; waits for in-flight promotions of SSD-only
    /// keys (notification, bounded by `ssd_get_wait`) and re-resolves those.
    pub(super) fn resolve<K: AsRef<str>>(
        &self,
        t: &Tenant,
        keys: &[K],
    ) -> Vec<L3Result<(u64, ReadSource)>> {
        let now = self.clock.now_ms();
        let mut res: Vec<L3Result<(u64, ReadSource)>> = {
            let mut m = self.master.lock();
            // Last to first: the batch's first key ranks most recent (`batch_order`).
            crate::batch_order::last_to_first(keys.len(), |i| {
                validate_key(keys[i].as_ref())?;
                m.read_source(t, keys[i].as_ref(), now)
            })
        };
        if let Some(p) = &self.promoter {
            // One deadline for the whole batch (not `ssd_get_wait` per key).
            let on_disk = res
                .iter()
                .enumerate()
                .filter(|(_, r)| matches!(r, Ok((_, ReadSource::Disk(_)))))
                .map(|(i, _)| (i, keys[i].as_ref()));
            let mut promoted = p.wait_many(t, on_disk);
            if !promoted.is_empty() {
                let now = self.clock.now_ms();
                let mut m = self.master.lock();
                promoted.sort_unstable_by(|a, b| b.cmp(a)); // last to first, as above
                for i in promoted {
                    res[i] = m.read_source(t, keys[i].as_ref(), now);
                }
            }
            // Promotion on hit: the reads still served from SSD count towards admission.
            let hits = res
                .iter()
                .enumerate()
                .filter(|(_, r)| matches!(r, Ok((_, ReadSource::Disk(_)))))
                .map(|(i, _)| (t.clone(), keys[i].as_ref().to_string()))
                .collect();
            p.note_hits(hits);
        }
        res
    }

    /// Copies resolved sources into buffers: memory copies (parallel when large), then
    /// verified SSD reads.
    pub(super) fn fill(
        &self,
        t: &Tenant,
        keys: &[String],
        srcs: Vec<L3Result<(u64, ReadSource)>>,
        bufs: &mut [&mut [u8]],
    ) -> Vec<L3Result<u64>> {
        let mut out: Vec<L3Result<u64>> = Vec::with_capacity(srcs.len());
        let mut mem_jobs: Vec<(Arc<[u8]>, usize)> = Vec::new();
        let mut disk_jobs: Vec<(DiskLoc, usize)> = Vec::new();
        for (i, s) in srcs.into_iter().enumerate() {
            match s {
                Err(e) => out.push(Err(e)),
                Ok((size, src)) => {
                    let have = bufs[i].len() as u64;
                    if have < size {
                        out.push(Err(L3Error::BufferOverflow { needed: size, have }));
                        continue;
                    }
                    out.push(Ok(size));
                    match src {
                        ReadSource::Memory(d) => mem_jobs.push((d, i)),
                        ReadSource::Disk(l) => disk_jobs.push((l, i)),
                    }
                }
            }
        }
        let mem_bytes: u64 = mem_jobs.iter().map(|(d, _)| d.len() as u64).sum();
        Metrics::add(&self.metrics.hits_memory, mem_jobs.len() as u64);
        copy_all(&mem_jobs, bufs, mem_bytes >= PARALLEL_COPY_BYTES);
        if let Some(ssd) = &self.ssd {
            let results = read_disk_all(ssd, &disk_jobs, bufs);
            for ((loc, i), r) in disk_jobs.iter().zip(results) {
                match r {
                    Ok(true) => Metrics::add(&self.metrics.hits_disk, 1),
                    Ok(false) => {
                        self.on_corrupt(t, &keys[*i], loc);
                        out[*i] = Err(L3Error::ObjectNotFound);
                    }
                    Err(e) => out[*i] = Err(e),
                }
            }
        } else {
            for (_, i) in &disk_jobs {
                out[*i] = Err(L3Error::UnableOffload);
            }
        }
        let misses = out.iter().filter(|r| r.is_err()).count() as u64;
        Metrics::add(&self.metrics.misses, misses);
        out
    }
}

/// Memory copies into the caller's buffers; split over two threads for large batches.
fn copy_all(jobs: &[(Arc<[u8]>, usize)], bufs: &mut [&mut [u8]], parallel: bool) {
    if !parallel || jobs.len() < 2 {
        for (d, i) in jobs {
            bufs[*i][..d.len()].copy_from_slice(d);
        }
        return;
    }
    // Pair each job with its destination slice, then split the list in two halves by bytes.
    let mut slots: Vec<Option<&mut [u8]>> = bufs.iter_mut().map(|b| Some(&mut **b)).collect();
    let mut work: Vec<(&[u8], &mut [u8])> = Vec::with_capacity(jobs.len());
    for (d, i) in jobs {
        if let Some(dst) = slots[*i].take() {
            work.push((&d[..], dst));
        }
    }
    let total: usize = work.iter().map(|(s, _)| s.len()).sum();
    let mut acc = 0;
    let mut split = work.len();
    for (n, (s, _)) in work.iter().enumerate() {
        if acc >= total / 2 {
            split = n;
            break;
        }
        acc += s.len();
    }
    let (a, b) = work.split_at_mut(split);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            for (s, d) in b.iter_mut() {
                d[..s.len()].copy_from_slice(s);
            }
        });
        for (s, d) in a.iter_mut() {
            d[..s.len()].copy_from_slice(s);
        }
    });
}

/// Verified SSD reads straight into the caller's buffers; several in flight for big batches.
fn read_disk_all(
    ssd: &SsdTier,
    jobs: &[(DiskLoc, usize)],
    bufs: &mut [&mut [u8]],
) -> Vec<L3Result<bool>> {
    if jobs.is_empty() {
        return Vec::new();
    }
    let mut slots: Vec<Option<&mut [u8]>> = bufs.iter_mut().map(|b| Some(&mut **b)).collect();
    let mut work: Vec<(DiskLoc, &mut [u8])> = Vec::with_capacity(jobs.len());
    let mut results: Vec<L3Result<bool>> = Vec::with_capacity(jobs.len());
    for (loc, i) in jobs {
        if let Some(dst) = slots[*i].take() {
            work.push((*loc, dst));
        }
    }
    const READERS: usize = 4;
    if work.len() < 4 {
        for (loc, dst) in work.iter_mut() {
            results.push(ssd.read(loc, &mut dst[..loc.size as usize]));
        }
        return results;
    }
    let chunk = work.len().div_ceil(READERS);
    let mut parts: Vec<Vec<L3Result<bool>>> = Vec::new();
    std::thread::scope(|sc| {
        let handles: Vec<_> = work
            .chunks_mut(chunk)
            .map(|part| {
                sc.spawn(move || {
                    part.iter_mut()
                        .map(|(loc, dst)| ssd.read(loc, &mut dst[..loc.size as usize]))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            parts.push(
                h.join()
                    .unwrap_or_else(|_| vec![Err(L3Error::Internal("reader panicked".into()))]),
            );
        }
    });
    for p in parts {
        results.extend(p);
    }
    results.resize_with(jobs.len(), || {
        Err(L3Error::Internal("reader lost results".into()))
    });
    results
}
