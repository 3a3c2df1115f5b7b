//! The SSD tier of one store node: bucket index, asynchronous offload writer, SSD eviction,
//! verified reads and the restart rescan.
//!
//! Why this shape (seed 002): offload is write-through and asynchronous — a put returns as
//! soon as the DRAM copy is visible, and a single writer thread batches queued objects into
//! bucket files. Metadata of SSD copies is registered with the master *only after* the bucket
//! is durable (fsync + rename), so "acknowledged as persisted" always means "on disk", and a
//! restart rescan finds exactly what was acknowledged. A failed write removes its temporary
//! file and registers nothing.
//!
//! Invariants:
//! - `used` is the sum of the sizes of bucket files in `buckets`.
//! - A record is registered with the master at most once; one the master refuses (object
//!   removed or replaced meanwhile) is tombstoned at once.
//! - Lock order: the tier's lock is never held while calling the [`TierHooks`] (which take
//!   the master's lock), and the master's lock is never held while calling into the tier.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

use parking_lot::Mutex;

use super::bucket::{self, NewRecord};
use crate::config::SsdConfig;
use crate::error::{L3Error, L3Result};
use crate::master::DiskLoc;
use crate::types::{PutHandle, Tenant};

/// An object queued for SSD.
pub struct OffloadJob {
    /// Tenant.
    pub tenant: Tenant,
    /// Key.
    pub key: String,
    /// Put token (the object version the bytes belong to).
    pub token: u64,
    /// Bytes.
    pub data: Arc<[u8]>,
    /// Written from DRAM eviction (offload-on-evict): the master holds a staged copy.
    pub staged: bool,
    /// Completion for callers that wait for persistence.
    pub done: Option<SyncSender<L3Result<()>>>,
}

impl OffloadJob {
    /// The write-through job for the object `h` put; with `wait`, also the receiver its
    /// completion is sent to.
    pub fn for_put(
        h: &PutHandle,
        data: Arc<[u8]>,
        wait: bool,
    ) -> (Self, Option<Receiver<L3Result<()>>>) {
        let (done, wait) = if wait {
            let (tx, rx) = sync_channel(1);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let job = Self {
            tenant: h.tenant.clone(),
            key: h.key.clone(),
            token: h.token,
            data,
            staged: false,
            done,
        };
        (job, wait)
    }
}

enum Msg {
    Write(OffloadJob),
    Flush(SyncSender<()>),
}

/// What the tier needs from the master (implemented by the embedded store).
pub trait TierHooks: Send + Sync {
    /// Register written copies; returns, per item, whether the master accepted it.
    fn register(&self, items: &[(&OffloadJob, DiskLoc)]) -> Vec<bool>;
    /// A write failed: staged copies must be released.
    fn write_failed(&self, jobs: &[OffloadJob]);
    /// Atomically drop these disk replicas if none is leased; false = keep the bucket.
    fn evict_disk(&self, recs: &[(Tenant, String, DiskLoc)]) -> bool;
}

#[derive(Debug, Clone)]
struct RecMeta {
    tenant: Tenant,
    key: String,
    loc: DiskLoc,
    index: u32,
    alive: bool,
}

#[derive(Debug)]
struct BucketMeta {
    file_size: u64,
    records: Vec<RecMeta>,
    live: usize,
}

#[derive(Debug, Default)]
struct TierState {
    buckets: BTreeMap<u64, BucketMeta>,
    files: HashMap<u64, Arc<File>>,
    next_id: u64,
    used: u64,
    /// Counters for metrics.
    written_objects: u64,
    write_failures: u64,
    evicted_buckets: u64,
    corrupt_reads: u64,
}

/// Numbers of the SSD tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Live bucket files.
    pub buckets: u64,
    /// Bytes in bucket files.
    pub used_bytes: u64,
    /// Objects written since start.
    pub written_objects: u64,
    /// Failed bucket writes since start.
    pub write_failures: u64,
    /// Buckets evicted since start.
    pub evicted_buckets: u64,
    /// Reads that failed their checksum.
    pub corrupt_reads: u64,
}

struct Shared {
    cfg: SsdConfig,
    state: Mutex<TierState>,
}

/// The SSD tier.
pub struct SsdTier {
    shared: Arc<Shared>,
    tx: Mutex<Option<SyncSender<Msg>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

/// A record recovered by the restart rescan.
pub type Rescanned = (Tenant, String, DiskLoc);

impl SsdTier {
    /// Opens (creating) the directory and rescans existing buckets. The writer thread is not
    /// started yet: call [`SsdTier::start`] once the master has registered the rescan.
    pub fn open(cfg: SsdConfig) -> L3Result<(Self, Vec<Rescanned>)> {
        std::fs::create_dir_all(&cfg.dir)
            .map_err(|e| L3Error::FileOpenFail(format!("{}: {e}", cfg.dir.display())))?;
        let ids = bucket::list_buckets(&cfg.dir)
            .map_err(|e| L3Error::FileOpenFail(format!("{}: {e}", cfg.dir.display())))?;
        let mut st = TierState::default();
        let mut found = Vec::new();
        for id in ids {
            st.next_id = st.next_id.max(id + 1);
            let (recs, size) = match bucket::scan_bucket(&bucket::bucket_path(&cfg.dir, id)) {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(bucket = id, error = %e, "unreadable bucket skipped");
                    continue;
                }
            };
            let dead = bucket::read_tombstones(&cfg.dir, id);
            let mut metas = Vec::with_capacity(recs.len());
            let mut live = 0;
            for r in recs {
                let Ok(tenant) = Tenant::new(r.tenant) else {
                    continue;
                };
                let alive = !dead.contains(&r.index);
                let loc = DiskLoc {
                    bucket: id,
                    offset: r.offset,
                    size: r.size,
                    crc: r.crc,
                };
                if alive {
                    live += 1;
                    found.push((tenant.clone(), r.key.clone(), loc));
                }
                metas.push(RecMeta {
                    tenant,
                    key: r.key,
                    loc,
                    index: r.index,
                    alive,
                });
            }
            if live == 0 {
                let _ = bucket::delete_bucket(&cfg.dir, id);
                continue;
            }
            st.used += size;
            st.buckets.insert(
                id,
                BucketMeta {
                    file_size: size,
                    records: metas,
                    live,
                },
            );
        }
        // Newest first, so that a key written twice resolves to its latest copy.
        found.sort_by(|a, b| {
            b.2.bucket
                .cmp(&a.2.bucket)
                .then(b.2.offset.cmp(&a.2.offset))
        });
        let tier = SsdTier {
            shared: Arc::new(Shared {
                cfg,
                state: Mutex::new(st),
            }),
            tx: Mutex::new(None),
            worker: Mutex::new(None),
        };
        Ok((tier, found))
    }

    /// Starts the writer thread.
    pub fn start(&self, hooks: Arc<dyn TierHooks>) -> L3Result<()> {
        let (tx, rx) = sync_channel(self.shared.cfg.queue_len);
        let shared = self.shared.clone();
        let h = std::thread::Builder::new()
            .name("kvtier-l3-ssd-writer".into())
            .spawn(move || writer_loop(shared, rx, hooks))
            .map_err(|e| L3Error::Internal(format!("spawn ssd writer: {e}")))?;
        *self.tx.lock() = Some(tx);
        *self.worker.lock() = Some(h);
        Ok(())
    }

    /// Offload mode configured.
    pub fn config(&self) -> &SsdConfig {
        &self.shared.cfg
    }

    /// Queues an object. `block` waits for queue space; otherwise a full queue is -1301.
    /// On error the job is dropped; the caller still knows its tenant/key/token.
    pub fn enqueue(&self, job: OffloadJob, block: bool) -> L3Result<()> {
        let tx = self.tx.lock().clone();
        let Some(tx) = tx else {
            return Err(L3Error::Unavailable("ssd tier stopped".into()));
        };
        if block {
            tx.send(Msg::Write(job))
                .map_err(|_| L3Error::Unavailable("ssd tier stopped".into()))
        } else {
            tx.try_send(Msg::Write(job)).map_err(|e| match e {
                TrySendError::Full(_) => L3Error::UnableOffloading,
                TrySendError::Disconnected(_) => L3Error::Unavailable("ssd tier stopped".into()),
            })
        }
    }

    /// Waits until everything queued before this call is written and registered.
    pub fn flush(&self) {
        let tx = self.tx.lock().clone();
        if let Some(tx) = tx {
            let (dtx, drx) = sync_channel(1);
            if tx.send(Msg::Flush(dtx)).is_ok() {
                let _ = drx.recv();
            }
        }
    }

    /// Stops accepting work, writes everything queued, joins the writer (graceful shutdown).
    pub fn shutdown(&self) {
        let tx = self.tx.lock().take();
        drop(tx);
        let h = self.worker.lock().take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }

    fn file(&self, id: u64) -> L3Result<Option<Arc<File>>> {
        let mut st = self.shared.state.lock();
        if !st.buckets.contains_key(&id) {
            return Ok(None);
        }
        if let Some(f) = st.files.get(&id) {
            return Ok(Some(f.clone()));
        }
        let f = match File::open(bucket::bucket_path(&self.shared.cfg.dir, id)) {
            Ok(f) => Arc::new(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(L3Error::FileReadFail(e.to_string())),
        };
        st.files.insert(id, f.clone());
        Ok(Some(f))
    }

    /// Reads a copy into `buf` (`buf.len() == loc.size`), verifying its checksum.
    /// `Ok(false)` = miss (missing bucket, short file or checksum mismatch).
    pub fn read(&self, loc: &DiskLoc, buf: &mut [u8]) -> L3Result<bool> {
        if buf.len() as u64 != loc.size {
            return Err(L3Error::InvalidParams(
                "buffer size differs from object".into(),
            ));
        }
        let Some(f) = self.file(loc.bucket)? else {
            return Ok(false);
        };
        let ok = bucket::read_verified(&f, loc.offset, loc.crc, buf)
            .map_err(|e| L3Error::FileReadFail(e.to_string()))?;
        if !ok {
            self.shared.state.lock().corrupt_reads += 1;
            // Never leave unverified bytes in the caller's buffer.
            buf.fill(0);
        }
        Ok(ok)
    }

    /// Marks a record dead (object removed / replaced / corrupt); deletes the bucket when
    /// nothing in it is alive.
    pub fn tombstone(&self, loc: &DiskLoc) {
        TierRef(&self.shared).tombstone(loc);
    }

    /// Current numbers.
    pub fn stats(&self) -> TierStats {
        let st = self.shared.state.lock();
        TierStats {
            buckets: st.buckets.len() as u64,
            used_bytes: st.used,
            written_objects: st.written_objects,
            write_failures: st.write_failures,
            evicted_buckets: st.evicted_buckets,
            corrupt_reads: st.corrupt_reads,
        }
    }

    /// The tenant and key a live record at `loc` belongs to (a store node checks that a read
    /// names this tenant's object before it returns a byte).
    pub fn owner_of(&self, loc: &DiskLoc) -> Option<(Tenant, String)> {
        let st = self.shared.state.lock();
        st.buckets
            .get(&loc.bucket)?
            .records
            .iter()
            .find(|r| r.alive && r.loc == *loc)
            .map(|r| (r.tenant.clone(), r.key.clone()))
    }

    /// Every live record, newest first (a store node re-registers them with a master that
    /// lost track of it).
    pub fn live_records(&self) -> Vec<Rescanned> {
        let st = self.shared.state.lock();
        let mut v: Vec<Rescanned> = st
            .buckets
            .values()
            .flat_map(|b| b.records.iter().filter(|r| r.alive))
            .map(|r| (r.tenant.clone(), r.key.clone(), r.loc))
            .collect();
        v.sort_by(|a, b| {
            b.2.bucket
                .cmp(&a.2.bucket)
                .then(b.2.offset.cmp(&a.2.offset))
        });
        v
    }

    /// Directory of the tier.
    pub fn dir(&self) -> &Path {
        &self.shared.cfg.dir
    }
}

impl Drop for SsdTier {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn writer_loop(shared: Arc<Shared>, rx: Receiver<Msg>, hooks: Arc<dyn TierHooks>) {
    let keys_limit = shared.cfg.bucket_keys_limit;
    let bytes_limit = shared.cfg.bucket_bytes_limit;
    let mut carry: Option<Msg> = None;
    loop {
        let first = match carry.take() {
            Some(m) => m,
            None => match rx.recv() {
                Ok(m) => m,
                Err(_) => return,
            },
        };
        let mut batch = Vec::new();
        let mut bytes = 0u64;
        let mut flush = None;
        match first {
            Msg::Flush(d) => {
                let _ = d.send(());
                continue;
            }
            Msg::Write(j) => {
                bytes += j.data.len() as u64;
                batch.push(j);
            }
        }
        while batch.len() < keys_limit && bytes < bytes_limit {
            match rx.try_recv() {
                Ok(Msg::Write(j)) => {
                    if bytes + j.data.len() as u64 > bytes_limit {
                        carry = Some(Msg::Write(j));
                        break;
                    }
                    bytes += j.data.len() as u64;
                    batch.push(j);
                }
                Ok(Msg::Flush(d)) => {
                    flush = Some(d);
                    break;
                }
                Err(_) => break,
            }
        }
        write_batch(&shared, batch, hooks.as_ref());
        if let Some(d) = flush {
            let _ = d.send(());
        }
    }
}

fn write_batch(shared: &Shared, batch: Vec<OffloadJob>, hooks: &dyn TierHooks) {
    let cfg = &shared.cfg;
    let bytes: u64 = batch.iter().map(|j| j.data.len() as u64).sum();
    evict_for(shared, bytes, hooks);
    let id = {
        let mut st = shared.state.lock();
        let id = st.next_id;
        st.next_id += 1;
        id
    };
    let over_capacity = {
        let st = shared.state.lock();
        st.used + bytes > cfg.capacity_bytes
    };
    let res = if over_capacity {
        Err(std::io::Error::other("ssd tier capacity exhausted"))
    } else {
        let recs: Vec<NewRecord<'_>> = batch
            .iter()
            .map(|j| NewRecord {
                tenant: j.tenant.as_str(),
                key: &j.key,
                data: &j.data,
            })
            .collect();
        bucket::write_bucket(&cfg.dir, id, &recs)
    };
    let written = match res {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(bucket = id, error = %e, "ssd bucket write failed; nothing registered");
            shared.state.lock().write_failures += 1;
            let msg = e.to_string();
            for j in &batch {
                if let Some(d) = &j.done {
                    let _ = d.send(Err(L3Error::FileWriteFail(msg.clone())));
                }
            }
            hooks.write_failed(&batch);
            return;
        }
    };
    let file_size = bucket::FILE_HDR
        + batch
            .iter()
            .map(|j| {
                (bucket::REC_HDR + j.tenant.as_str().len() + j.key.len()) as u64
                    + j.data.len() as u64
            })
            .sum::<u64>();
    let metas: Vec<RecMeta> = batch
        .iter()
        .zip(&written)
        .enumerate()
        .map(|(i, (j, w))| RecMeta {
            tenant: j.tenant.clone(),
            key: j.key.clone(),
            loc: DiskLoc {
                bucket: id,
                offset: w.offset,
                size: j.data.len() as u64,
                crc: w.crc,
            },
            index: i as u32,
            alive: true,
        })
        .collect();
    {
        let mut st = shared.state.lock();
        st.used += file_size;
        st.written_objects += batch.len() as u64;
        st.buckets.insert(
            id,
            BucketMeta {
                file_size,
                live: metas.len(),
                records: metas.clone(),
            },
        );
    }
    let items: Vec<(&OffloadJob, DiskLoc)> =
        batch.iter().zip(&metas).map(|(j, m)| (j, m.loc)).collect();
    let accepted = hooks.register(&items);
    // Records the master refused (object removed or replaced meanwhile) are dead at once.
    let refused: Vec<DiskLoc> = metas
        .iter()
        .zip(accepted.iter().chain(std::iter::repeat(&false)))
        .filter(|(_, ok)| !**ok)
        .map(|(m, _)| m.loc)
        .collect();
    for j in &batch {
        if let Some(d) = &j.done {
            let _ = d.send(Ok(()));
        }
    }
    let tier = TierRef(shared);
    for loc in refused {
        tier.tombstone(&loc);
    }
}

struct TierRef<'a>(&'a Shared);

impl TierRef<'_> {
    fn tombstone(&self, loc: &DiskLoc) {
        let dir = self.0.cfg.dir.clone();
        let mut st = self.0.state.lock();
        let mut delete = None;
        if let Some(b) = st.buckets.get_mut(&loc.bucket)
            && let Some(r) = b
                .records
                .iter_mut()
                .find(|r| r.loc.offset == loc.offset && r.alive)
        {
            r.alive = false;
            b.live -= 1;
            if b.live == 0 {
                delete = Some(b.file_size);
            } else {
                let _ = bucket::append_tombstone(&dir, loc.bucket, r.index);
            }
        }
        if let Some(size) = delete {
            st.buckets.remove(&loc.bucket);
            st.files.remove(&loc.bucket);
            st.used = st.used.saturating_sub(size);
            drop(st);
            let _ = bucket::delete_bucket(&dir, loc.bucket);
        }
    }
}

/// SSD eviction: above the high watermark (counting `incoming`), drop oldest buckets whose
/// objects are not leased until usage is below the low watermark.
fn evict_for(shared: &Shared, incoming: u64, hooks: &dyn TierHooks) {
    let cfg = &shared.cfg;
    let high = (cfg.capacity_bytes as f64 * cfg.high_watermark) as u64;
    let low = (cfg.capacity_bytes as f64 * cfg.low_watermark) as u64;
    let candidates: Vec<u64> = {
        let st = shared.state.lock();
        if st.used + incoming <= high {
            return;
        }
        st.buckets.keys().copied().collect()
    };
    for id in candidates {
        let recs: Vec<(Tenant, String, DiskLoc)> = {
            let st = shared.state.lock();
            if st.used + incoming <= low {
                return;
            }
            match st.buckets.get(&id) {
                Some(b) => b
                    .records
                    .iter()
                    .filter(|r| r.alive)
                    .map(|r| (r.tenant.clone(), r.key.clone(), r.loc))
                    .collect(),
                None => continue,
            }
        };
        if !hooks.evict_disk(&recs) {
            continue;
        }
        let mut st = shared.state.lock();
        if let Some(b) = st.buckets.remove(&id) {
            st.used = st.used.saturating_sub(b.file_size);
            st.evicted_buckets += 1;
        }
        st.files.remove(&id);
        drop(st);
        let _ = bucket::delete_bucket(&cfg.dir, id);
    }
}
