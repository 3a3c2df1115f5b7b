//! The SSD tier's writer thread: batches queued objects into buckets, publishes them
//! (tombstoning records whose objects were removed while queued *before* the rename), hands
//! them to the master, and evicts old buckets above the SSD high watermark.
//!
//! Why a separate file: this is the one place where the ordering of crash-safety steps
//! lives (reserve id → write + fsync temporary → under the inflight lock: tombstone
//! cancelled records, rename, record the bucket → register → tombstone refused records →
//! settle the announcements, except those of unconfirmed registrations → acknowledge
//! waiters); [`super::tier`] holds the state and the callers' API.

use std::sync::Arc;
use std::sync::mpsc::Receiver;

use super::bucket::{self, NewRecord};
use super::tier::{
    BucketMeta, ID_BLOCK, Msg, OffloadJob, RecMeta, Shared, TierHooks, TierRef, effective_capacity,
};
use super::unconfirmed::{Registration, Unconfirmed};
use crate::error::{L3Error, L3Result};
use crate::master::DiskLoc;
use crate::types::Tenant;

pub(super) fn writer_loop(shared: Arc<Shared>, rx: Receiver<Msg>, hooks: Arc<dyn TierHooks>) {
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

/// Withdraws the announcement of one write (written and registered, failed, or skipped).
pub(super) fn settle(shared: &Shared, tenant: &Tenant, key: &str, token: u64) {
    let mut inf = shared.inflight.lock();
    let k = (tenant.clone(), key.to_string());
    if let Some(v) = inf.get_mut(&k) {
        v.retain(|(t, _)| *t != token);
        if v.is_empty() {
            inf.remove(&k);
        }
    }
}

/// The error of a write whose object version was dropped before its bucket was published.
fn gone_while_queued() -> L3Error {
    L3Error::ReplicaIsGone("the object was dropped while its SSD write was queued".into())
}

/// Tells a `wait_persisted` caller how its write ended. A waiter that gave up (its caller
/// is gone) needs no answer, so a closed channel is not an error.
fn answer_waiter(j: &OffloadJob, result: L3Result<()>) {
    if let Some(d) = &j.done {
        let _ = d.send(result);
    }
}

/// The next bucket id, reserving a new block durably when the reserved one is used up.
fn next_bucket_id(shared: &Shared) -> std::io::Result<u64> {
    let mut st = shared.state.lock();
    if st.next_id >= bucket::MAX_BUCKET_ID {
        // Never wraps: an id handed out again would rename a bucket over a live one.
        return Err(std::io::Error::other(format!(
            "bucket ids exhausted in {} (next id {})",
            shared.cfg.dir.display(),
            st.next_id
        )));
    }
    if st.next_id >= st.reserved {
        let bound = (st.next_id + ID_BLOCK).min(bucket::MAX_BUCKET_ID);
        bucket::write_next_id(&shared.cfg.dir, bound)?;
        st.reserved = bound;
    }
    let id = st.next_id;
    st.next_id += 1;
    Ok(id)
}

/// A batch could not be written: nothing registered, waiters told, staged copies released.
fn fail_batch(
    shared: &Shared,
    id: Option<u64>,
    batch: &[OffloadJob],
    e: &std::io::Error,
    hooks: &dyn TierHooks,
) {
    tracing::warn!(bucket = ?id, error = %e, "ssd bucket write failed; nothing registered");
    shared.state.lock().write_failures += 1;
    let msg = e.to_string();
    for j in batch {
        settle(shared, &j.tenant, &j.key, j.token);
        if let Some(d) = &j.done {
            // A waiter that gave up is fine: the failure is counted either way.
            let _ = d.send(Err(L3Error::FileWriteFail(msg.clone())));
        }
    }
    hooks.write_failed(batch);
}

fn write_batch(shared: &Shared, batch: Vec<OffloadJob>, hooks: &dyn TierHooks) {
    // A record the format cannot hold fails alone (typed), never the rest of its batch.
    let (batch, unfit): (Vec<OffloadJob>, Vec<OffloadJob>) = batch
        .into_iter()
        .partition(|j| bucket::check_record(j.tenant.as_str(), &j.key).is_ok());
    if let Some(j) = unfit.first()
        && let Err(e) = bucket::check_record(j.tenant.as_str(), &j.key)
    {
        fail_batch(shared, None, &unfit, &e.into(), hooks);
    }
    if batch.is_empty() {
        return;
    }
    // The bucket file's size (headers and names too): what the capacity is counted in.
    let file_size = bucket::FILE_HDR
        + batch
            .iter()
            .map(|j| {
                (bucket::REC_HDR + j.tenant.as_str().len() + j.key.len()) as u64
                    + j.data.len() as u64
            })
            .sum::<u64>();
    let bytes = file_size;
    refresh_capacity(shared);
    evict_for(shared, bytes, hooks);
    let mut staged = stage(shared, &batch, bytes);
    if let Err((id, e)) = &staged
        && out_of_space(e)
    {
        // The filesystem is full before the tier thought: it is full at its current use.
        // Evict to make room, as at the watermark, and try once more.
        tracing::warn!(bucket = ?id, error = %e, "SSD filesystem full: evicting to make room");
        {
            let mut st = shared.state.lock();
            st.capacity = st.used;
        }
        evict_for(shared, bytes, hooks);
        staged = stage(shared, &batch, bytes);
    }
    let (id, staged, written) = match staged {
        Ok(x) => x,
        Err((id, e)) => return fail_batch(shared, id, &batch, &e, hooks),
    };
    let locs: Vec<DiskLoc> = batch
        .iter()
        .zip(&written)
        .map(|(j, w)| DiskLoc {
            bucket: id,
            offset: w.offset,
            size: j.data.len() as u64,
            crc: w.crc,
        })
        .collect();
    // Publish under the inflight lock: a job cancelled before this point is tombstoned in
    // the bucket's sidecar before the rename; one cancelled after it sees its location.
    let live: Vec<bool> = {
        let mut inf = shared.inflight.lock();
        let live: Vec<bool> = batch
            .iter()
            .map(|j| {
                inf.get(&(j.tenant.clone(), j.key.clone()))
                    .is_some_and(|v| v.iter().any(|(t, _)| *t == j.token))
            })
            .collect();
        if !live.iter().any(|l| *l) {
            // Everything was removed while queued: the bucket is never published.
            drop(inf);
            drop(staged);
            for j in &batch {
                answer_waiter(j, Err(gone_while_queued()));
            }
            return;
        }
        let dead: Vec<u32> = (0..batch.len() as u32)
            .filter(|i| !live[*i as usize])
            .collect();
        if let Err(e) = staged.publish(&dead) {
            drop(inf);
            return fail_batch(shared, Some(id), &batch, &e, hooks);
        }
        let metas: Vec<RecMeta> = batch
            .iter()
            .zip(&locs)
            .enumerate()
            .map(|(i, (j, loc))| RecMeta {
                tenant: j.tenant.clone(),
                key: j.key.clone(),
                loc: *loc,
                index: i as u32,
                alive: live[i],
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
                    live: live.iter().filter(|l| **l).count(),
                    records: metas,
                },
            );
        }
        for (j, loc) in batch.iter().zip(&locs) {
            if let Some(v) = inf.get_mut(&(j.tenant.clone(), j.key.clone()))
                && let Some(e) = v.iter_mut().find(|(t, _)| *t == j.token)
            {
                e.1 = Some(*loc);
            }
        }
        live
    };
    let items: Vec<(&OffloadJob, DiskLoc)> = batch
        .iter()
        .zip(&locs)
        .zip(&live)
        .filter(|(_, l)| **l)
        .map(|((j, loc), _)| (j, *loc))
        .collect();
    let answers = hooks.register(&items);
    let answer = |i: usize| answers.get(i).copied().unwrap_or(Registration::Unconfirmed);
    // What each job's waiter is told, by batch index: only a registered copy is "durable
    // and findable"; every other outcome fails with the code that says why.
    let mut outcome: Vec<L3Result<()>> = live
        .iter()
        .map(|l| if *l { Ok(()) } else { Err(gone_while_queued()) })
        .collect();
    let live_idx: Vec<usize> = (0..batch.len()).filter(|i| live[*i]).collect();
    for (n, &bi) in live_idx.iter().enumerate() {
        outcome[bi] = match answer(n) {
            Registration::Registered => Ok(()),
            Registration::Refused => Err(L3Error::ReplicaIsGone(
                "the object was dropped (evicted, removed or replaced) before its SSD copy \
                 was registered"
                    .into(),
            )),
            Registration::Unconfirmed => Err(L3Error::RpcFail(
                "the SSD copy is written but the master did not answer its registration \
                 (it is retried)"
                    .into(),
            )),
        };
    }
    // Records the master refused (object removed or replaced meanwhile) are dead at once.
    let refused: Vec<DiskLoc> = (0..items.len())
        .filter(|i| answer(*i) == Registration::Refused)
        .map(|i| items[i].1)
        .collect();
    if let Err(e) = TierRef(shared).tombstone_many(&refused) {
        tracing::warn!(bucket = id, error = %e, "could not tombstone refused records");
    }
    // Unconfirmed records keep their announcement (with their location), so a cancel of
    // their version still finds them; the node registers them again later.
    let unconfirmed: Vec<Unconfirmed> = (0..items.len())
        .filter(|i| answer(*i) == Registration::Unconfirmed)
        .map(|i| Unconfirmed {
            tenant: items[i].0.tenant.clone(),
            key: items[i].0.key.clone(),
            token: items[i].0.token,
            loc: items[i].1,
            staged: items[i].0.staged,
        })
        .collect();
    for (j, result) in batch.iter().zip(outcome) {
        let kept = unconfirmed
            .iter()
            .any(|u| u.token == j.token && u.key == j.key && u.tenant == j.tenant);
        if !kept {
            settle(shared, &j.tenant, &j.key, j.token);
        }
        answer_waiter(j, result);
    }
    if !unconfirmed.is_empty() {
        shared.unconfirmed.lock().extend(unconfirmed);
    }
}

/// A bucket id and the batch written to its temporary file, or why not (and the id, if one
/// was taken).
type StageResult =
    Result<(u64, bucket::Staged, Vec<bucket::Written>), (Option<u64>, std::io::Error)>;

/// Writes `batch` (a bucket file of `bytes`) to a new bucket's temporary file, if it fits
/// the tier's capacity.
fn stage(shared: &Shared, batch: &[OffloadJob], bytes: u64) -> StageResult {
    let id = next_bucket_id(shared).map_err(|e| (None, e))?;
    let over_capacity = {
        let st = shared.state.lock();
        st.used + bytes > st.capacity
    };
    if over_capacity {
        return Err((
            Some(id),
            std::io::Error::other("ssd tier capacity exhausted"),
        ));
    }
    let recs: Vec<NewRecord<'_>> = batch
        .iter()
        .map(|j| NewRecord {
            tenant: j.tenant.as_str(),
            key: &j.key,
            data: &j.data,
        })
        .collect();
    bucket::write_staged(&shared.cfg.dir, id, &recs)
        .map(|(s, w)| (id, s, w))
        .map_err(|e| (Some(id), e))
}

/// Whether a write failed for want of space (the filesystem or the user's quota), which
/// evicting buckets can cure; EFBIG (a file past `RLIMIT_FSIZE`) is not: smaller files fit.
fn out_of_space(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// The capacity the tier may use now: the configured one, at most its use plus the
/// filesystem's free space (unchanged when the free space cannot be read).
fn refresh_capacity(shared: &Shared) {
    match shared.cfg.free_space.of(&shared.cfg.dir) {
        Ok(free) => {
            let mut st = shared.state.lock();
            st.capacity = effective_capacity(shared.cfg.capacity_bytes, st.used, free);
        }
        Err(e) => tracing::debug!(error = %e, "free space of the SSD directory unknown"),
    }
}

/// SSD eviction: above the high watermark (counting `incoming`, the new bucket's size),
/// drop the oldest buckets whose objects are not leased until usage is below the low
/// watermark; nothing for an `incoming` larger than the capacity (its write fails anyway).
///
/// Past a bucket holding a leased object (refused by `evict_disk`), only as far as the
/// write needs to fit within the capacity: the buckets after it are newer (hotter), and the
/// lease is a reader's for seconds, so the write goes above the high watermark rather than
/// evict them, and the oldest go first again once the lease ends (its next write past the
/// high watermark). Mooncake's bucket backend evicts strictly oldest first (FIFO, or least
/// recently read) and only until the write fits its quota; it has no leased bucket to
/// skip. Until 2026-12-07 the walk went on to the low watermark past leased buckets: a
/// write that fitted evicted newer buckets, and with more leased than the low watermark
/// every unleased bucket went, the newest included (`tests/ssd_leased_buckets.rs`).
fn evict_for(shared: &Shared, incoming: u64, hooks: &dyn TierHooks) {
    let cfg = &shared.cfg;
    let (low, candidates): (u64, Vec<u64>) = {
        let st = shared.state.lock();
        let high = (st.capacity as f64 * cfg.high_watermark) as u64;
        let low = (st.capacity as f64 * cfg.low_watermark) as u64;
        // A bucket larger than the whole capacity fails however much is evicted for it.
        if st.used + incoming <= high || incoming > st.capacity {
            return;
        }
        (low, st.buckets.keys().copied().collect())
    };
    // The usage to evict down to: the low watermark, the capacity once a leased bucket
    // was passed over.
    let mut target = low;
    for id in candidates {
        let recs: Vec<(Tenant, String, DiskLoc)> = {
            let st = shared.state.lock();
            if st.used + incoming <= target.min(st.capacity) {
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
            target = u64::MAX;
            continue;
        }
        let mut st = shared.state.lock();
        if let Some(b) = st.buckets.remove(&id) {
            st.used = st.used.saturating_sub(b.file_size);
            st.evicted_buckets += 1;
        }
        st.files.remove(id);
        drop(st);
        if let Err(e) = bucket::delete_bucket(&cfg.dir, id) {
            tracing::warn!(bucket = id, error = %e, "could not delete an evicted bucket");
        }
    }
}
