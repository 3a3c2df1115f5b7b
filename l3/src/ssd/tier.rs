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
//! - A record the master refuses (object removed or replaced meanwhile) is tombstoned at
//!   once. One whose registration was not confirmed (a store node's master unreachable)
//!   stays live — after a master restart, records are how objects are found again — and
//!   keeps its announcement with its location, so a cancel of its version returns it to be
//!   tombstoned; the node registers it again ([`SsdTier::unconfirmed`], [`SsdTier::confirm`]).
//! - A remove is durable before it is acknowledged, whatever stage the object's SSD write is
//!   in. Every write is *announced* (under the master's lock, atomically with the put or
//!   eviction that makes it) before it is queued; [`SsdTier::cancel`] (after the master
//!   removed the object) drops a queued announcement, and the writer tombstones the records
//!   of cancelled jobs *before* it renames their bucket into view. A job already published
//!   but not yet registered is tombstoned (synced) by `cancel`'s caller.
//! - Tombstones are synced before [`SsdTier::tombstone`] returns; concurrent callers for
//!   the same record both return only after it is durable (`tomb_io`).
//! - Bucket ids are reserved durably in blocks before use and never reused.
//! - Lock order: master → `inflight` → `unconfirmed`, `inflight` → `state`; `tomb_io` →
//!   `state`. The tier never calls the [`TierHooks`] (which take the master's lock) while
//!   holding any of its locks.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

use parking_lot::Mutex;

use super::bucket;
use super::files::{self, OpenFiles};
use super::unconfirmed::{Registration, Unconfirmed};
use super::writer;
use crate::config::SsdConfig;
use crate::dirlock::DirLock;
use crate::error::{L3Error, L3Result};
use crate::master::DiskLoc;
use crate::types::{PutHandle, Tenant, check_key};

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

pub(super) enum Msg {
    Write(OffloadJob),
    Flush(SyncSender<()>),
}

/// What the tier needs from the master (implemented by the embedded store and store nodes).
pub trait TierHooks: Send + Sync {
    /// Register written copies; returns the master's answer per item. The embedded store
    /// never answers [`Registration::Unconfirmed`].
    fn register(&self, items: &[(&OffloadJob, DiskLoc)]) -> Vec<Registration>;
    /// A write failed: staged copies must be released.
    fn write_failed(&self, jobs: &[OffloadJob]);
    /// Atomically drop these disk replicas if none is leased; false = keep the bucket.
    fn evict_disk(&self, recs: &[(Tenant, String, DiskLoc)]) -> bool;
}

#[derive(Debug, Clone)]
pub(super) struct RecMeta {
    pub(super) tenant: Tenant,
    pub(super) key: String,
    pub(super) loc: DiskLoc,
    pub(super) index: u32,
    pub(super) alive: bool,
}

#[derive(Debug)]
pub(super) struct BucketMeta {
    pub(super) file_size: u64,
    pub(super) records: Vec<RecMeta>,
    pub(super) live: usize,
}

#[derive(Debug, Default)]
pub(super) struct TierState {
    pub(super) buckets: BTreeMap<u64, BucketMeta>,
    /// Open bucket files, at most [`super::files::default_cap`] at open.
    pub(super) files: OpenFiles,
    pub(super) next_id: u64,
    /// Ids below this are durably reserved (`next-bucket-id`).
    pub(super) reserved: u64,
    pub(super) used: u64,
    /// Bytes the tier may use: `capacity_bytes`, at most `used` plus the filesystem's free
    /// space when last looked at ([`effective_capacity`]).
    pub(super) capacity: u64,
    /// Counters for metrics.
    pub(super) written_objects: u64,
    pub(super) write_failures: u64,
    pub(super) evicted_buckets: u64,
    pub(super) corrupt_reads: u64,
}

/// Numbers of the SSD tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Live bucket files.
    pub buckets: u64,
    /// Bytes in bucket files.
    pub used_bytes: u64,
    /// Bytes the tier may use now: `capacity_bytes`, or less where the filesystem holds
    /// less (its own use plus the free space).
    pub capacity_bytes: u64,
    /// Objects written since start.
    pub written_objects: u64,
    /// Failed bucket writes since start.
    pub write_failures: u64,
    /// Buckets evicted since start.
    pub evicted_buckets: u64,
    /// Reads that failed their checksum.
    pub corrupt_reads: u64,
}

/// What the tier may use: the configured capacity, but never more than what the filesystem
/// can hold of it — its own `used` bytes plus the `free` ones. (A capacity larger than the
/// disk left writes failing with ENOSPC for good, no bucket evicted: an adversarial tester.)
pub fn effective_capacity(configured: u64, used: u64, free: u64) -> u64 {
    configured.min(used.saturating_add(free))
}

/// Ids reserved per write of `next-bucket-id`.
pub(super) const ID_BLOCK: u64 = 1024;

/// Writes announced and not yet settled, per object: token → `None` while queued or being
/// written, `Some(loc)` once its bucket is published (until the master registered it).
type Inflight = HashMap<(Tenant, String), Vec<(u64, Option<DiskLoc>)>>;

pub(super) struct Shared {
    pub(super) cfg: SsdConfig,
    pub(super) state: Mutex<TierState>,
    pub(super) inflight: Mutex<Inflight>,
    pub(super) tomb_io: Mutex<()>,
    /// Published records whose registration was not confirmed (their announcements stay).
    pub(super) unconfirmed: Mutex<Vec<Unconfirmed>>,
    /// The directory's lock ([`DirLock`]), held as long as anything (the tier, its writer
    /// thread) can still touch the directory.
    _lock: DirLock,
}

/// The SSD tier.
pub struct SsdTier {
    pub(super) shared: Arc<Shared>,
    tx: Mutex<Option<SyncSender<Msg>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

/// A record recovered by the restart rescan.
pub type Rescanned = (Tenant, String, DiskLoc);

impl SsdTier {
    /// Opens (creating) the directory and rescans existing buckets. The writer thread is not
    /// started yet: call [`SsdTier::start`] once the master has registered the rescan.
    pub fn open(cfg: SsdConfig) -> L3Result<(Self, Vec<Rescanned>)> {
        if cfg.capacity_bytes == 0 {
            // Before the directory is made: a tier of no bytes failed every write (-1103).
            return Err(L3Error::InvalidParams(
                "ssd capacity_bytes must be positive (a tier of no bytes fails every write)".into(),
            ));
        }
        let open_err =
            |e: std::io::Error| L3Error::FileOpenFail(format!("{}: {e}", cfg.dir.display()));
        std::fs::create_dir_all(&cfg.dir).map_err(open_err)?;
        // Before anything in the directory is read or changed: a second process on it would
        // delete the first one's in-flight `.bkt.tmp` files at its rescan, and two writers
        // would hand out the same bucket ids and rename buckets over each other's.
        // A holder that is going away (a store just dropped whose background threads are
        // still ending, a process just killed) lets go within moments: wait up to 2 s.
        let lock = DirLock::acquire_within(
            &cfg.dir,
            bucket::LOCK_FILE,
            "--ssd-dir",
            std::time::Duration::from_secs(2),
        )?;
        let scan = bucket::scan_dir(&cfg.dir).map_err(open_err)?;
        for id in &scan.orphan_tombs {
            // A crash between the unlinks of a deleted bucket: its sidecar must not outlive it.
            // Not fatal: the id is never handed out again (ids start above every file's).
            if let Err(e) = std::fs::remove_file(bucket::tomb_path(&cfg.dir, *id)) {
                tracing::warn!(bucket = id, error = %e, "could not remove an orphan tombstone");
            }
        }
        let mut next_id = scan
            .max_id
            .map_or(0, |m| m + 1)
            .max(bucket::read_next_id(&cfg.dir).unwrap_or(0));
        if next_id > bucket::MAX_BUCKET_ID {
            // Not a bound kvtier wrote (it never reserves past MAX_BUCKET_ID). Ids below it
            // may be in use, so none is handed out: every write fails, typed, never wraps.
            tracing::warn!(
                next_id,
                "{} is out of range: bucket ids exhausted, SSD writes will fail",
                bucket::NEXT_ID_FILE
            );
            next_id = bucket::MAX_BUCKET_ID;
        }
        let mut st = TierState {
            next_id,
            files: OpenFiles::new(files::default_cap()),
            ..Default::default()
        };
        // Nothing reserved yet in this run: the first bucket reserves a block.
        st.reserved = st.next_id;
        let mut found = Vec::new();
        for id in scan.buckets {
            let (recs, size) = match bucket::scan_bucket(&bucket::bucket_path(&cfg.dir, id)) {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(bucket = id, error = %e, "unreadable bucket skipped");
                    continue;
                }
            };
            // A bucket whose tombstones cannot be trusted is dropped whole: which record a
            // corrupt tombstone removed is unknown, and a removed key must not come back.
            let (dead, untrusted) = match bucket::read_tombstones(&cfg.dir, id) {
                Ok(t) if !t.corrupt => (t.dead, false),
                Ok(_) => {
                    tracing::warn!(bucket = id, "corrupt tombstone: bucket dropped");
                    (Vec::new(), true)
                }
                Err(e) => {
                    tracing::warn!(bucket = id, error = %e, "unreadable tombstones: bucket dropped");
                    (Vec::new(), true)
                }
            };
            let mut metas = Vec::with_capacity(recs.len());
            let mut live = 0;
            for r in recs {
                // Names no call could have made (written by an earlier build with looser
                // rules) are skipped alone: nobody can address them.
                let (Ok(tenant), Ok(())) = (Tenant::parse(r.tenant), check_key(&r.key)) else {
                    continue;
                };
                let alive = !untrusted && !dead.contains(&r.index);
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
                // Not fatal: the bucket is not indexed, and its id is never handed out again.
                if let Err(e) = bucket::delete_bucket(&cfg.dir, id) {
                    tracing::warn!(bucket = id, error = %e, "could not remove a dead bucket");
                }
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
        st.capacity = match cfg.free_space.of(&cfg.dir) {
            Ok(free) => effective_capacity(cfg.capacity_bytes, st.used, free),
            Err(e) => {
                tracing::warn!(error = %e, "free space of the SSD directory unknown");
                cfg.capacity_bytes
            }
        };
        if st.capacity < cfg.capacity_bytes {
            tracing::info!(
                configured = cfg.capacity_bytes,
                effective = st.capacity,
                used = st.used,
                dir = %cfg.dir.display(),
                "SSD capacity clamped to what the filesystem holds (the tier's use + free space)"
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
                inflight: Mutex::new(Inflight::new()),
                tomb_io: Mutex::new(()),
                unconfirmed: Mutex::new(Vec::new()),
                _lock: lock,
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
            .spawn(move || writer::writer_loop(shared, rx, hooks))
            .map_err(|e| L3Error::Internal(format!("spawn ssd writer: {e}")))?;
        *self.tx.lock() = Some(tx);
        *self.worker.lock() = Some(h);
        Ok(())
    }

    /// Offload mode configured.
    pub fn config(&self) -> &SsdConfig {
        &self.shared.cfg
    }

    /// Announces the write of version `token` of an object. Call it under the master's lock,
    /// in the same critical section that makes the object (put end, eviction to stage), so
    /// that a remove either sees the announcement or happens before it; then [`enqueue`].
    ///
    /// [`enqueue`]: SsdTier::enqueue
    pub fn announce(&self, tenant: &Tenant, key: &str, token: u64) {
        let mut inf = self.shared.inflight.lock();
        let v = inf.entry((tenant.clone(), key.to_string())).or_default();
        if !v.iter().any(|(t, _)| *t == token) {
            v.push((token, None));
        }
    }

    /// The object was removed (its version `token` and any older one): queued writes of it
    /// are dropped (the writer tombstones their records before they become visible).
    /// Returns the records already published but not yet registered; the caller tombstones
    /// them before acknowledging the remove.
    pub fn cancel(&self, tenant: &Tenant, key: &str, token: u64) -> Vec<DiskLoc> {
        let mut inf = self.shared.inflight.lock();
        let k = (tenant.clone(), key.to_string());
        let Some(v) = inf.get_mut(&k) else {
            return Vec::new();
        };
        let mut published = Vec::new();
        v.retain(|(t, loc)| {
            if *t > token {
                return true;
            }
            published.extend(*loc);
            false
        });
        if v.is_empty() {
            inf.remove(&k);
        }
        published
    }

    /// Withdraws the announcement of exactly version `token` (a write announced ahead of a
    /// put end that then failed, or that another node writes).
    pub fn withdraw(&self, tenant: &Tenant, key: &str, token: u64) {
        writer::settle(&self.shared, tenant, key, token);
    }

    /// Queues an object [announced](SsdTier::announce) before (a job whose announcement
    /// was cancelled meanwhile is written as dead). `block` waits for queue space;
    /// otherwise a full queue is -1301. On error the job is dropped and its announcement
    /// withdrawn; the caller still knows its tenant/key/token.
    pub fn enqueue(&self, job: OffloadJob, block: bool) -> L3Result<()> {
        let (tenant, key, token) = (job.tenant.clone(), job.key.clone(), job.token);
        let tx = self.tx.lock().clone();
        let stopped = || L3Error::Unavailable("ssd tier stopped".into());
        let sent = match tx {
            None => Err(stopped()),
            Some(tx) if block => tx.send(Msg::Write(job)).map_err(|_| stopped()),
            Some(tx) => tx.try_send(Msg::Write(job)).map_err(|e| match e {
                TrySendError::Full(_) => L3Error::UnableOffloading,
                TrySendError::Disconnected(_) => stopped(),
            }),
        };
        if sent.is_err() {
            writer::settle(&self.shared, &tenant, &key, token);
        }
        sent
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
            crate::error::join_logged("SSD writer", h);
        }
    }

    fn file(&self, id: u64) -> L3Result<Option<Arc<File>>> {
        let mut st = self.shared.state.lock();
        if !st.buckets.contains_key(&id) {
            return Ok(None);
        }
        if let Some(f) = st.files.get(id) {
            return Ok(Some(f));
        }
        let f = match bucket::open_regular(&bucket::bucket_path(&self.shared.cfg.dir, id), false) {
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

    /// Marks a record dead (object removed / replaced / corrupt) and makes that durable
    /// before returning; deletes the bucket when nothing in it is alive.
    pub fn tombstone(&self, loc: &DiskLoc) -> L3Result<()> {
        TierRef(&self.shared).tombstone_many(std::slice::from_ref(loc))
    }

    /// [`SsdTier::tombstone`] for many records: one synced append per bucket.
    pub fn tombstone_many(&self, locs: &[DiskLoc]) -> L3Result<()> {
        TierRef(&self.shared).tombstone_many(locs)
    }

    /// Current numbers.
    pub fn stats(&self) -> TierStats {
        let st = self.shared.state.lock();
        TierStats {
            buckets: st.buckets.len() as u64,
            used_bytes: st.used,
            capacity_bytes: st.capacity,
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

pub(super) struct TierRef<'a>(pub(super) &'a Shared);

impl TierRef<'_> {
    /// Plan under the state lock, write the tombstones (or delete the buckets), and only
    /// then mark the records dead: a failed write leaves them alive here, so a retry writes
    /// them again instead of finding them "already dead" (a store node acknowledges a
    /// tombstone to its master only once this returned `Ok`). Serialised by `tomb_io`, so
    /// no other tombstone changes the plan meanwhile; a bucket evicted meanwhile is skipped.
    pub(super) fn tombstone_many(&self, locs: &[DiskLoc]) -> L3Result<()> {
        if locs.is_empty() {
            return Ok(());
        }
        let dir = &self.0.cfg.dir;
        // Held through the file writes: a second caller for the same record returns only
        // once the first one's tombstone is durable.
        let _io = self.0.tomb_io.lock();
        let mut appends: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        let mut deletes = Vec::new();
        {
            let st = self.0.state.lock();
            for loc in locs {
                let Some(b) = st.buckets.get(&loc.bucket) else {
                    continue;
                };
                let Some(r) = b
                    .records
                    .iter()
                    .find(|r| r.loc.offset == loc.offset && r.alive)
                else {
                    continue;
                };
                let v = appends.entry(loc.bucket).or_default();
                if !v.contains(&r.index) {
                    v.push(r.index);
                }
            }
            appends.retain(|id, idx| {
                let whole = st.buckets.get(id).is_some_and(|b| b.live <= idx.len());
                if whole {
                    deletes.push(*id);
                }
                !whole
            });
        }
        let io = |e: std::io::Error| L3Error::FileWriteFail(format!("tombstone: {e}"));
        let mut done: Vec<(u64, &[u32])> = Vec::new();
        let mut failed = None;
        for (id, idx) in &appends {
            match bucket::append_tombstones(dir, *id, idx) {
                Ok(()) => done.push((*id, idx)),
                Err(e) => {
                    failed = Some(io(e));
                    break;
                }
            }
        }
        let mut deleted = Vec::new();
        if failed.is_none() {
            for id in &deletes {
                match bucket::delete_bucket(dir, *id) {
                    Ok(()) => deleted.push(*id),
                    Err(e) => {
                        failed = Some(io(e));
                        break;
                    }
                }
            }
        }
        {
            let mut st = self.0.state.lock();
            for (id, idx) in &done {
                if let Some(b) = st.buckets.get_mut(id) {
                    for r in b.records.iter_mut().filter(|r| idx.contains(&r.index)) {
                        if r.alive {
                            r.alive = false;
                            b.live -= 1;
                        }
                    }
                }
            }
            for id in &deleted {
                if let Some(b) = st.buckets.remove(id) {
                    st.used = st.used.saturating_sub(b.file_size);
                }
                st.files.remove(*id);
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if !deleted.is_empty() {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io)?;
        }
        Ok(())
    }
}
