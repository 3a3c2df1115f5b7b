//! The table of cache operations in flight.
//!
//! Why a table: every op the scheduler hands out must come back exactly once, with a
//! completion of its own kind. The table holds each op's FSM (`Pending → Issued → Done |
//! Failed`), the request it serves, and the context needed to finish it — most importantly
//! the **locks** that keep its source and destination pages alive until its completion
//! arrives (a backup's host pages stay locked until `BackUpDone`: the review bug where backup
//! sources were reused before the backup read them cannot happen).

use kvtier_fsm::{CacheOp, OpKind};
use kvtier_radix::{Device, DevicePageId, Host, HostPageId, LockHandle, PageHash};

use crate::types::RequestId;

/// Why pages are written back device → host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WriteBackCause {
    /// The request finished: its pages are kept for later requests (then backed up per policy).
    Finish,
    /// The request is retracted: its pages wait on host for it to resume.
    Retract,
}

/// Where a backup reads its pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BackupSource {
    Host,
    /// Without a host tier.
    Device,
}

/// Whether a backup follows the write policy or must happen regardless.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BackupUrgency {
    /// Per the write policy (write-through, selective; nothing under write-back).
    PerPolicy,
    /// Host is about to drop pages L3 lacks (write-back policy): back up now.
    BeforeHostDrop,
}

/// What a retracted request's computed KV is worth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RetractedKv {
    /// Correct: publish it and write it back to host.
    Keep,
    /// Computed from pages that never arrived: drop it and recompute.
    Garbage,
}

/// A lock on either tier.
pub(crate) enum AnyLock {
    Device(LockHandle<Device>),
    Host(LockHandle<Host>),
}

impl AnyLock {
    /// Gives the lock back to the cache.
    pub(crate) fn release(self, cache: &mut kvtier_radix::RadixCache, stats: &mut crate::Stats) {
        match self {
            AnyLock::Device(l) => crate::release::unlock(cache, stats, l),
            AnyLock::Host(l) => crate::release::unlock(cache, stats, l),
        }
    }

    pub(crate) fn node(&self) -> kvtier_radix::NodeId {
        match self {
            AnyLock::Device(l) => l.node(),
            AnyLock::Host(l) => l.node(),
        }
    }
}

/// Destination pages of a prefetch.
pub(crate) enum PrefetchDst {
    /// Into host pages, inserted below the locked host node.
    Host(Vec<HostPageId>, LockHandle<Host>),
    /// Into device pages (host tier disabled), inserted below the locked device node.
    Device(Vec<DevicePageId>, LockHandle<Device>),
}

pub(crate) enum OpCtx {
    Query {
        /// First prompt page probed (the local match at probe time).
        start: usize,
        n: usize,
    },
    Prefetch {
        /// Prompt page the first key is for: the local match *when the prefetch was issued*.
        start: usize,
        dst: PrefetchDst,
        /// The first prompt page of this prefetch that L3 reported lost while it was in flight
        /// (the read may still have found it): from there on the pages are not marked in L3.
        lost_from: Option<usize>,
    },
    LoadBack {
        /// Pins the host source pages until the copy is done.
        host_lock: LockHandle<Host>,
        /// Prompt pages up to `to` are on device once the copy is done.
        to: usize,
    },
    WriteBack {
        /// Pins the host node the written pages will hang below.
        host_lock: LockHandle<Host>,
        /// The written pages are the request's pages `from .. from + dst.len()`.
        from: usize,
        dst: Vec<HostPageId>,
        /// Written back because the request finished, or because it is being retracted.
        cause: WriteBackCause,
    },
    /// A device leaf written back to host before device evicts it (see `demotion.rs`).
    Demotion {
        /// Pins the source path on device.
        dev_lock: LockHandle<Device>,
        /// Pins the host node the written pages will hang below.
        host_lock: LockHandle<Host>,
        /// Depth of the first written page.
        from: usize,
        dst: Vec<HostPageId>,
    },
    BackUp {
        /// Pins the source pages (host, or device without a host tier) until `BackUpDone`.
        lock: AnyLock,
        /// Depth ranges of the nodes entirely covered by this backup (marked in L3 on success).
        nodes: Vec<(usize, usize)>,
        /// Hashes of the pages being backed up (de-duplicates concurrent backups).
        hashes: Vec<PageHash>,
        /// Depths of the first planned page and past the last: a failed backup's run
        /// (`backup_retry.rs`) is the path's pages in between.
        span: (usize, usize),
        /// Times these pages' backup failed before (0 for a first backup).
        tries: u32,
    },
}

pub(crate) struct OpRecord {
    pub op: CacheOp,
    pub req: Option<RequestId>,
    /// `now` (ms) of the plan that issued it.
    pub issued_ms: u64,
    pub ctx: OpCtx,
}

impl OpRecord {
    pub(crate) fn kind(&self) -> OpKind {
        self.op.kind
    }
}
