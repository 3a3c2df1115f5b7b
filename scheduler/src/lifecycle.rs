//! The back half of a request's life: publishing computed pages into the tree, finishing
//! (write-back device → host, backup host → L3), retraction under device pressure, and
//! releasing everything a request held exactly once.
//!
//! Ownership rule (written on `DeviceTable`): a request's `pages[..tree_pages]` belong to the
//! tree (pinned by its device lock), `pages[tree_pages..]` are the request's own. Publishing
//! moves pages from the second group to the first; releasing unlocks the first and frees the second. Every op that reads
//! pages after the request let go of them holds its own lock (see `ops.rs`).

use kvtier_fsm::{OpKind, RequestEvent, RequestState};
use kvtier_radix::{Device, Host, HostPageId, LockHandle, NodeId, PageHash};

use crate::backup_retry::Run;
use crate::config::{RetractionPolicy, WritePolicy};
use crate::ops::{AnyLock, BackupSource, BackupUrgency, OpCtx, RetractedKv, WriteBackCause};
use crate::release;
use crate::scheduler::Scheduler;
use crate::types::*;

/// Which pages of a path a backup takes (`Scheduler::issue_backup`).
#[derive(Clone, Copy, Debug)]
struct BackupPick {
    /// Only nodes at least this many requests reused (the selective write policy).
    threshold: u32,
    /// Only pages at this depth or deeper (a retried run's start).
    from: usize,
    /// Times these pages' backup failed before.
    tries: u32,
}

impl Scheduler {
    /// Publishes the request's pages `tree_pages .. upto` (full pages whose KV is computed)
    /// into the device tree, so concurrent requests with the same prefix reuse them at once.
    /// Pages the tree already had are swapped into the request's page table and its own copies
    /// freed; the engine receives the change as a page-table delta.
    pub(crate) fn publish_device(&mut self, id: RequestId, upto: usize) {
        let ps = self.cfg.page_size;
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        let upto = upto.min(r.table.pages.len());
        if upto <= r.table.tree_pages {
            return;
        }
        r.ensure_hashes(upto, ps);
        if r.hashes.len() < upto {
            return;
        }
        let Some(dl) = r.table.lock.take() else {
            return;
        };
        let from = r.table.tree_pages;
        match self.cache.insert_labelled::<Device>(
            dl.node(),
            from,
            &r.hashes,
            &r.tokens,
            &r.table.pages[from..upto],
            r.owner(),
        ) {
            Ok(out) => {
                for &(idx, mine, theirs) in &out.duplicates {
                    r.table.pages[idx] = theirs;
                    r.table.dirty_from = r.table.dirty_from.min(idx);
                    release::free(&mut self.cache, &mut self.stats, &[mine]);
                }
                match release::relock(&mut self.cache, &mut self.stats, dl, out.end_node) {
                    Ok(nl) => {
                        r.table.lock = Some(nl);
                        r.table.tree_pages = upto;
                    }
                    Err(old) => r.table.lock = Some(old),
                }
            }
            Err(e) => {
                tracing::error!(req = ?id, error = %e, "publish failed");
                r.table.lock = Some(dl);
            }
        }
    }

    /// Generation is over: publish the pages, write back what host lacks, back up per policy.
    pub(crate) fn finish(&mut self, id: RequestId) {
        let ps = self.cfg.page_size;
        let Some(r) = self.reqs.get(&id) else {
            return;
        };
        let full = r.kv_len() / ps;
        let seq = r.seq;
        self.publish_device(id, full);
        self.drop_own_pages(id);
        self.running.remove(&seq);
        self.demotions_paused = false;
        let copy_at_finish = self.copies_at_finish();
        let n = if self.cfg.host_enabled && copy_at_finish {
            self.plan_write_back(id, WriteBackCause::Finish)
        } else {
            0
        };
        self.apply(
            id,
            RequestEvent::Finish {
                pages_to_write_back: n as u32,
            },
        );
        self.apply(id, RequestEvent::CommitDraining);
        if n == 0 {
            // Everything already on host (or no host tier): back up from where it is, with the
            // backup holding its own lock, then end the request.
            if let Some(end) = self
                .reqs
                .get(&id)
                .and_then(|r| r.table.lock.as_ref())
                .map(|l| l.node())
            {
                let on_host = self.cache.is_resident(end, kvtier_radix::TierKind::Host) == Ok(true);
                if self.cfg.host_enabled && on_host {
                    self.plan_backup(end, BackupSource::Host, None, BackupUrgency::PerPolicy);
                } else if !self.cfg.host_enabled || !copy_at_finish {
                    // No host tier, or host gets its copy only on demotion: L3 gets its copy
                    // from device now (write-through does not wait for device pressure).
                    self.plan_backup(end, BackupSource::Device, None, BackupUrgency::PerPolicy);
                }
            }
            self.release(id);
        }
    }

    /// Frees the request's own (unpublished) pages and truncates its table to the tree part.
    fn drop_own_pages(&mut self, id: RequestId) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        let own: Vec<_> = r
            .table
            .pages
            .drain(r.table.tree_pages.min(r.table.pages.len())..)
            .collect();
        release::free(&mut self.cache, &mut self.stats, &own);
        r.table.sent = r.table.sent.min(r.table.pages.len());
    }

    /// Plans the device → host write-back of the request's published pages that host lacks.
    /// Returns the number of pages (0: nothing to write, or no host memory).
    pub(crate) fn plan_write_back(&mut self, id: RequestId, cause: WriteBackCause) -> usize {
        let Some(r) = self.reqs.get(&id) else {
            return 0;
        };
        let Some(end) = r.table.lock.as_ref().map(|l| l.node()) else {
            return 0;
        };
        let full = r.table.tree_pages;
        if full == 0 {
            return 0;
        }
        let Ok(path) = self.cache.path_nodes(end) else {
            return 0;
        };
        let Some(&(_, host_from, _)) = path
            .iter()
            .find(|(n, _, _)| self.cache.is_resident(*n, kvtier_radix::TierKind::Host) != Ok(true))
        else {
            return 0;
        };
        let Ok(host_start) = self.cache.node_at_depth(end, host_from) else {
            return 0;
        };
        let Ok(hl) = self.cache.lock::<Host>(host_start) else {
            return 0;
        };
        let n = full - host_from;
        let tenant = self.tenant_of(id);
        let Some(dst) = self.alloc_host(tenant, n) else {
            release::unlock(&mut self.cache, &mut self.stats, hl);
            return 0;
        };
        let src = self
            .cache
            .path_pages_from::<Device>(end, host_from)
            .unwrap_or_default();
        self.new_op(
            OpKind::WriteBack,
            Some(id),
            false,
            OpSpec::WriteBack {
                src,
                dst: dst.clone(),
            },
            OpCtx::WriteBack {
                host_lock: hl,
                from: host_from,
                dst,
                cause,
            },
        );
        n
    }

    pub(crate) fn finish_write_back(
        &mut self,
        req: Option<RequestId>,
        host_lock: LockHandle<Host>,
        from: usize,
        dst: Vec<HostPageId>,
        cause: WriteBackCause,
        success: bool,
    ) {
        let host_end = match req {
            Some(id) if success => self.adopt_pages::<Host>(id, host_lock.node(), from, &dst),
            _ => {
                release::free(&mut self.cache, &mut self.stats, &dst);
                None
            }
        };
        release::unlock(&mut self.cache, &mut self.stats, host_lock);
        let Some(id) = req else { return };
        // The device copy was the source; the request's hold on it ends here.
        let dev_end = self.take_dev_lock(id);
        if cause == WriteBackCause::Retract {
            self.apply(
                id,
                RequestEvent::WriteBackDone {
                    success,
                    backups: 0,
                },
            );
            self.requeue_or_release(id);
            return;
        }
        let mut backups = 0;
        if success && let Some(end) = host_end {
            if self.plan_backup(end, BackupSource::Host, Some(id), BackupUrgency::PerPolicy) {
                backups = 1;
            }
            if !self.cfg.keep_device_after_write_back
                && let Some(dev_end) = dev_end
            {
                self.drop_device_copies(dev_end);
            }
        }
        self.apply(id, RequestEvent::WriteBackDone { success, backups });
        if self.reqs.get(&id).is_some_and(|r| r.state.is_terminal()) {
            self.release(id);
        }
    }

    /// Unlocks the request's device pin and forgets its (now void) page table.
    fn take_dev_lock(&mut self, id: RequestId) -> Option<NodeId> {
        let r = self.reqs.get_mut(&id)?;
        let lock = r.table.lock.take();
        let own: Vec<_> = r
            .table
            .pages
            .drain(r.table.tree_pages.min(r.table.pages.len())..)
            .collect();
        r.table.pages.clear();
        r.table.tree_pages = 0;
        r.table.sent = 0;
        r.table.dirty_from = usize::MAX;
        release::free(&mut self.cache, &mut self.stats, &own);
        let lock = lock?;
        let node = lock.node();
        release::unlock(&mut self.cache, &mut self.stats, lock);
        Some(node)
    }

    /// Evicts the device copies of `end` and its ancestors, deepest first, while they are
    /// unlocked leaves (write-back done and the policy is to drop device copies).
    fn drop_device_copies(&mut self, end: NodeId) {
        let Ok(path) = self.cache.path_nodes(end) else {
            return;
        };
        for (node, _, _) in path.into_iter().rev() {
            if self.cache.evict_node::<Device>(node).is_err() {
                break;
            }
        }
    }

    /// Plans a backup to L3 of the nodes on the path to `end` that L3 lacks (per the write
    /// policy, or regardless `BeforeHostDrop`). The backup locks `end` on its source tier until `BackUpDone`.
    pub(crate) fn plan_backup(
        &mut self,
        end: NodeId,
        source: BackupSource,
        req: Option<RequestId>,
        urgency: BackupUrgency,
    ) -> bool {
        if !self.cfg.l3_enabled {
            return false;
        }
        let threshold = match self.cfg.write_policy {
            WritePolicy::WriteThrough => 0,
            WritePolicy::WriteThroughSelective { hit_threshold } => hit_threshold,
            WritePolicy::WriteBack if urgency == BackupUrgency::BeforeHostDrop => 0,
            WritePolicy::WriteBack => return false,
        };
        let pick = BackupPick {
            threshold,
            from: 0,
            tries: 0,
        };
        self.issue_backup(end, source, req, pick) > 0
    }

    /// Issues a backup of the pages on the path to `end` that `pick` picks: at depth
    /// `pick.from` or deeper, in nodes L3 lacks that at least `pick.threshold` requests reused,
    /// not being sent by another backup. Returns the pages planned (0: no backup).
    fn issue_backup(
        &mut self,
        end: NodeId,
        source: BackupSource,
        req: Option<RequestId>,
        pick: BackupPick,
    ) -> usize {
        let Ok(path) = self.cache.path_nodes(end) else {
            return 0;
        };
        let mut depths: Vec<usize> = Vec::new();
        let mut hashes: Vec<PageHash> = Vec::new();
        let mut nodes = Vec::new();
        for (node, s, e) in path {
            if s < pick.from
                || self.cache.in_l3(node) != Ok(false)
                || self.cache.hit_count(node).unwrap_or(0) < pick.threshold
            {
                continue;
            }
            let Ok(hs) = self.cache.node_hashes(node) else {
                continue;
            };
            let mut all = true;
            for (i, h) in hs.iter().enumerate() {
                if self.backing_up.contains(h) {
                    all = false;
                } else {
                    depths.push(s + i);
                    hashes.push(*h);
                }
            }
            if all {
                nodes.push((s, e));
            }
        }
        let (Some(&first), Some(&last)) = (depths.first(), depths.last()) else {
            return 0;
        };
        let keys = self.l3_keys(&hashes);
        let (src, lock) = if source == BackupSource::Host {
            let Ok(all) = self.cache.path_pages::<Host>(end) else {
                return 0;
            };
            let Ok(l) = self.cache.lock::<Host>(end) else {
                return 0;
            };
            (
                TierPages::Host(depths.iter().map(|&d| all[d]).collect()),
                AnyLock::Host(l),
            )
        } else {
            let Ok(all) = self.cache.path_pages::<Device>(end) else {
                return 0;
            };
            let Ok(l) = self.cache.lock::<Device>(end) else {
                return 0;
            };
            (
                TierPages::Device(depths.iter().map(|&d| all[d]).collect()),
                AnyLock::Device(l),
            )
        };
        let n = hashes.len();
        self.backing_up.extend(hashes.iter().copied());
        self.new_op(
            OpKind::BackUp,
            req,
            false,
            OpSpec::BackUp { keys, src },
            OpCtx::BackUp {
                lock,
                nodes,
                hashes,
                span: (first, last + 1),
                tries: pick.tries,
            },
        );
        n
    }

    /// A backup failed: its run (the path to `end`, pages `span`) waits to be tried again
    /// once L3 answers (`backup_retry.rs`). `end` is still locked by the backup.
    pub(crate) fn backup_failed(&mut self, end: NodeId, (from, to): (usize, usize), tries: u32) {
        let Ok(path) = self.cache.path_nodes(end) else {
            return;
        };
        let mut chain = Vec::with_capacity(to);
        for (node, _, _) in path {
            if chain.len() >= to {
                break;
            }
            if let Ok(hs) = self.cache.node_hashes(node) {
                chain.extend_from_slice(hs);
            }
        }
        if chain.len() < to {
            return;
        }
        chain.truncate(to);
        self.backup_retry.failed(Run { chain, from, tries });
    }

    /// Plans the failed backups due again (L3 answered since the last failure), at most
    /// `BackupRetry::pages_per_plan` pages, or while it has not, counts the plan towards the
    /// probe and plans it when due (`backup_retry.rs`).
    pub(crate) fn plan_backup_retries(&mut self) {
        if !self.cfg.l3_enabled || !(self.backup_retry.due() || self.backup_retry.counting()) {
            return;
        }
        let mut retry = std::mem::take(&mut self.backup_retry);
        retry.plan(|run, budget| self.retry_backup(run, budget));
        self.backup_retry = retry;
    }

    /// Plans a backup of at most `budget` pages of a failed backup's run that are still on
    /// host (on device without a host tier) and that L3 lacks and no backup is sending: the
    /// pages planned, and what is left of the run beyond them. (A device page that reaches
    /// host later is backed up when it does, as every page written to host is.)
    fn retry_backup(&mut self, run: Run, budget: usize) -> (usize, Option<Run>) {
        let (dev, host) = self.cache.peek_prefix(&run.chain);
        let (source, resident) = if self.cfg.host_enabled {
            (BackupSource::Host, host)
        } else {
            (BackupSource::Device, dev)
        };
        let (end, depth) = self.cache.peek_node(&run.chain[..resident]);
        if depth <= run.from {
            return (0, None);
        }
        // Where the run is cut: the depth of the first wanted page beyond `budget` of them.
        let Ok(path) = self.cache.path_nodes(end) else {
            return (0, None);
        };
        let mut wanted = 0usize;
        let mut cut = None;
        'nodes: for (node, s, _) in path {
            if s < run.from || self.cache.in_l3(node) != Ok(false) {
                continue;
            }
            let Ok(hs) = self.cache.node_hashes(node) else {
                continue;
            };
            for (i, h) in hs.iter().enumerate() {
                if self.backing_up.contains(h) {
                    continue;
                }
                if wanted == budget {
                    cut = Some(s + i);
                    break 'nodes;
                }
                wanted += 1;
            }
        }
        let end = match cut {
            Some(c) => match self.cache.node_at_depth(end, c) {
                Ok(n) => n,
                Err(_) => return (0, None),
            },
            None => end,
        };
        let pick = BackupPick {
            threshold: 0,
            from: run.from,
            tries: run.tries,
        };
        let planned = self.issue_backup(end, source, None, pick);
        let rest = cut.filter(|_| planned > 0).map(|c| Run {
            chain: run.chain[..depth].to_vec(),
            from: c,
            tries: run.tries,
        });
        (planned, rest)
    }

    /// Write-back policy: before host evicts a page L3 lacks, back it up. Evicts LRU host leaves
    /// already in L3; for the others issues backups (which pin them until done) and stops once
    /// free pages plus pages being backed up cover `n`.
    /// Leaves of other tenants within their host quota are spared (docs/scheduler.md).
    pub(crate) fn make_room_on_host(&mut self, tenant: kvtier_radix::TenantId, n: usize) {
        let mut pending = 0usize;
        for _ in 0..100_000 {
            if self.cache.usage(kvtier_radix::TierKind::Host).free + pending >= n {
                return;
            }
            let cache = &self.cache;
            let Some(node) = cache.evictable_lru::<Host>().find(|&id| {
                cache
                    .owner(id)
                    .is_ok_and(|o| !cache.tenant_protected(o, tenant, kvtier_radix::TierKind::Host))
            }) else {
                return;
            };
            if self.cache.in_l3(node) == Ok(true) {
                let evicted = self.cache.evict_node::<Host>(node);
                crate::release::checked(&mut self.stats.internal_errors, "evict host", evicted);
                continue;
            }
            let len = self.cache.node_hashes(node).map(|h| h.len()).unwrap_or(0);
            if self.plan_backup(
                node,
                BackupSource::Host,
                None,
                BackupUrgency::BeforeHostDrop,
            ) {
                pending += len;
            } else {
                let evicted = self.cache.evict_node::<Host>(node);
                crate::release::checked(&mut self.stats.internal_errors, "evict host", evicted);
            }
        }
    }

    /// Device is out of pages for `needy`'s next decode token: retract a victim. Returns true if
    /// device pages were freed at once (a victim written back to host frees them later). When
    /// `same_tenant`, the allocation was refused by `needy`'s tenant quota: only that tenant's
    /// requests are candidates (retracting another's would not help, and would make one
    /// tenant's load cost another its progress).
    pub(crate) fn retract_for(&mut self, needy: RequestId, same_tenant: bool) -> bool {
        let tenant = self.tenant_of(needy);
        let mut best: Option<(RequestId, (u64, u64))> = None;
        for &id in self.running.values() {
            if id == needy {
                continue;
            }
            if !self.retractable(id) {
                continue;
            }
            let Some(r) = self.reqs.get(&id) else {
                continue;
            };
            if same_tenant && r.tenant != tenant {
                continue;
            }
            let key = match self.cfg.retraction {
                RetractionPolicy::LatestArrival => (r.seq, 0),
                RetractionPolicy::FewestGenerated => (u64::MAX - r.generated() as u64, r.seq),
                RetractionPolicy::MostPages => (r.table.pages.len() as u64, r.seq),
            };
            if best.as_ref().is_none_or(|(_, k)| key > *k) {
                best = Some((id, key));
            }
        }
        let victim = best.map(|b| b.0).unwrap_or(needy);
        if victim == needy && !self.retractable(needy) {
            return false;
        }
        self.retract(victim, RetractedKv::Keep)
    }

    /// Running with nothing in flight and no abort pending: can give its pages back now.
    fn retractable(&self, id: RequestId) -> bool {
        self.reqs.get(&id).is_some_and(|r| match r.state {
            RequestState::Decoding {
                in_flight: false,
                abort_pending: false,
                ..
            } => true,
            RequestState::Prefilling {
                done,
                scheduled,
                abort_pending: false,
                ..
            } => done == scheduled,
            _ => false,
        })
    }

    /// Preempts a running request: its computed pages are published and written back to host
    /// (or dropped, to be recomputed, when host is full or absent, or when `Garbage`), and it
    /// waits to resume. Returns true if its device pages were unpinned at once.
    pub(crate) fn retract(&mut self, id: RequestId, kv: RetractedKv) -> bool {
        let ps = self.cfg.page_size;
        let Some(r) = self.reqs.get(&id) else {
            return false;
        };
        let seq = r.seq;
        let garbage = kv == RetractedKv::Garbage || r.recompute;
        let kv = match r.state {
            RequestState::Prefilling { done, .. } => done as usize,
            _ => r.kv_len(),
        };
        if !garbage {
            self.publish_device(id, kv / ps);
        }
        self.drop_own_pages(id);
        self.running.remove(&seq);
        let n = if self.cfg.host_enabled && !garbage {
            self.plan_write_back(id, WriteBackCause::Retract)
        } else {
            0
        };
        self.apply(
            id,
            RequestEvent::Retract {
                write_back_pages: n as u32,
            },
        );
        self.stats.retracted += 1;
        self.retracted_out.push(id);
        if let Some(r) = self.reqs.get_mut(&id) {
            r.resumed = true;
        }
        if n == 0 {
            self.take_dev_lock(id);
            self.enqueue(seq, id);
            return true;
        }
        false
    }

    /// Ends a request in a terminal state: unpins and frees everything it held, once.
    pub(crate) fn release(&mut self, id: RequestId) {
        self.unpin_prefetch(id);
        self.take_dev_lock(id);
        let Some(seq) = self.reqs.get(&id).map(|r| r.seq) else {
            return;
        };
        self.dequeue(seq);
        let Some(r) = self.reqs.remove(&id) else {
            return;
        };
        self.running.remove(&r.seq);
        let outcome = match r.state {
            RequestState::Finished => {
                self.stats.finished += 1;
                Outcome::Finished
            }
            RequestState::Aborted => {
                self.stats.aborted += 1;
                Outcome::Aborted
            }
            _ => {
                self.stats.failed += 1;
                Outcome::Failed
            }
        };
        metrics::counter!("kvtier_requests_ended_total", "outcome" => match outcome {
            Outcome::Finished => "finished",
            Outcome::Aborted => "aborted",
            Outcome::Failed => "failed",
        })
        .increment(1);
        self.ended.push((id, outcome));
    }
}
