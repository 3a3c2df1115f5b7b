//! Demotion: device pages get their host copy when device is about to evict them, not when
//! their request finishes (`HostAdmission::OnDeviceEviction`).
//!
//! Why: with copies made at finish, every page cached on device is also on host, so device +
//! host hold what host alone holds (measured on the conversation trace: 2–3 points of hit rate
//! at the same total capacity, docs/sim.md). Copying only what device is about to drop makes
//! the tiers mostly exclusive.
//!
//! How, as an operating system's page reclaim does: every plan looks at device's evictable
//! leaves in eviction order and writes the coldest device-only ones back to host until at
//! least `ahead_pages` of the free and evictable pages are free or have a host copy. A
//! demotion is a `WriteBack` op without a request; it pins its source on device and the host
//! node it hangs below until `WriteBackDone`, then the pages join the host tree and the device
//! leaf becomes an ordinary evictable leaf with a host copy (evicting it drops a copy, not the
//! page). Allocation never waits for a demotion: under pressure faster than the write-backs,
//! device evicts uncopied leaves as it always did.
//!
//! Invariants: a node is demoted by at most one op at a time (it is locked, so it is not
//! evictable and not seen again); the locks an op holds are counted by `Scheduler::check`.

use kvtier_fsm::OpKind;
use kvtier_radix::{Device, Host, HostPageId, LearntAdmission, LockHandle, NodeId, TierKind};

use crate::config::HostAdmission;
use crate::ops::{BackupSource, BackupUrgency, OpCtx};
use crate::release;
use crate::scheduler::Scheduler;
use crate::types::OpSpec;

impl Scheduler {
    /// Whether finished requests' pages get their host copy at finish (else on demotion).
    pub(crate) fn copies_at_finish(&self) -> bool {
        match self.cfg.host_admission {
            HostAdmission::OnFinish => true,
            HostAdmission::OnDeviceEviction { .. } => false,
            HostAdmission::Adaptive { .. } => {
                self.cache.learnt_admission() != Some(LearntAdmission::Demote)
            }
        }
    }

    /// Plans the demotions that keep `ahead_pages` of device free or backed by host.
    pub(crate) fn plan_demotions(&mut self) {
        if self.copies_at_finish() {
            return;
        }
        let Some(ahead_pages) = self.cfg.host_admission.ahead_pages() else {
            return;
        };
        // Device pressure only comes from requests; an idle scheduler plans nothing.
        if self.reqs.is_empty() || self.demotions_paused {
            return;
        }
        let want = ahead_pages as usize;
        let mut covered = self.cache.usage(TierKind::Device).free + self.demoting_pages;
        if covered >= want {
            return;
        }
        let mut victims: Vec<NodeId> = Vec::new();
        for node in self.cache.evictable_lru::<Device>() {
            if covered >= want {
                break;
            }
            let len = self.cache.node_hashes(node).map_or(0, |h| h.len());
            covered += len;
            if self.cache.is_resident(node, TierKind::Host) != Ok(true) {
                victims.push(node);
            }
        }
        for node in victims {
            // A leaf host has no room for (everything there is warmer) is left for device to
            // drop; a warmer one behind it may still fit.
            self.plan_demotion(node);
        }
    }

    /// Writes `end`'s path back to host from its first node host lacks; plans nothing (and
    /// holds nothing) when host cannot give the pages.
    fn plan_demotion(&mut self, end: NodeId) {
        let Ok(path) = self.cache.path_nodes(end) else {
            return;
        };
        let Some(&(_, from, _)) = path
            .iter()
            .find(|(n, _, _)| self.cache.is_resident(*n, TierKind::Host) != Ok(true))
        else {
            return;
        };
        let Ok(to) = self.cache.node_end(end) else {
            return;
        };
        let Ok(above) = self.cache.node_at_depth(end, from) else {
            return;
        };
        let Ok(dev_lock) = self.cache.lock::<Device>(end) else {
            return;
        };
        let host_lock = match self.cache.lock::<Host>(above) {
            Ok(l) => l,
            Err(_) => {
                release::unlock(&mut self.cache, &mut self.stats, dev_lock);
                return;
            }
        };
        let Some(dst) = self.alloc_demotion(end, to - from) else {
            release::unlock(&mut self.cache, &mut self.stats, host_lock);
            release::unlock(&mut self.cache, &mut self.stats, dev_lock);
            return;
        };
        let src = match self.cache.path_pages_from::<Device>(end, from) {
            Ok(src) if src.len() == dst.len() => src,
            _ => {
                // Cannot happen while `end` is pinned on device; give everything back.
                self.stats.internal_errors += 1;
                release::free(&mut self.cache, &mut self.stats, &dst);
                release::unlock(&mut self.cache, &mut self.stats, host_lock);
                release::unlock(&mut self.cache, &mut self.stats, dev_lock);
                return;
            }
        };
        self.demoting_pages += dst.len();
        self.stats.demotions += 1;
        self.new_op(
            OpKind::WriteBack,
            None,
            false,
            OpSpec::WriteBack {
                src,
                dst: dst.clone(),
            },
            OpCtx::Demotion {
                dev_lock,
                host_lock,
                from,
                dst,
            },
        );
    }

    /// Host pages for demoting `n` pages of `end`: only host leaves colder than `end` make
    /// room (see `RadixCache::alloc_for_copy`), within the owner's host quota. (Write-back,
    /// whose host evictions wait for backups, is refused with demotion by the config.)
    fn alloc_demotion(&mut self, end: NodeId, n: usize) -> Option<Vec<HostPageId>> {
        let owner = self.cache.owner(end).ok()?;
        if let (Some(cached), Some(cap)) = (
            self.cache.tenant_charge(owner, TierKind::Host),
            self.cfg.tenant_quota.host_pages,
        ) && cached + n > cap as usize
        {
            return None;
        }
        self.cache
            .alloc_for_copy::<Host>(end, TierKind::Device, n)
            .ok()
    }

    /// `WriteBackDone` of a demotion: the copies join the host tree (or are freed if the copy
    /// failed), both pins end, and the new host pages are backed up per the write policy.
    pub(crate) fn demotion_done(
        &mut self,
        dev_lock: LockHandle<Device>,
        host_lock: LockHandle<Host>,
        from: usize,
        dst: Vec<HostPageId>,
        success: bool,
    ) {
        self.demoting_pages = self.demoting_pages.saturating_sub(dst.len());
        let end = dev_lock.node();
        let mut backed = false;
        if success {
            match self.cache.add_copies::<Host>(end, from, &dst) {
                Ok(unused) => {
                    release::free(&mut self.cache, &mut self.stats, &unused);
                    backed = true;
                }
                Err(e) => {
                    tracing::error!(error = %e, "demoted pages refused by the host tree");
                    self.stats.internal_errors += 1;
                    release::free(&mut self.cache, &mut self.stats, &dst);
                }
            }
        } else {
            release::free(&mut self.cache, &mut self.stats, &dst);
            self.demotions_paused = true;
        }
        release::unlock(&mut self.cache, &mut self.stats, host_lock);
        release::unlock(&mut self.cache, &mut self.stats, dev_lock);
        if backed {
            self.plan_backup(end, BackupSource::Host, None, BackupUrgency::PerPolicy);
        }
    }
}
