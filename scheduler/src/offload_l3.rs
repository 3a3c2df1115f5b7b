//! L3 below the offloading-manager mode: what [`OffloadManager`] backs up and knows is in L3.
//!
//! Why here and not in the engine's glue: the write policy (which host pages go to L3, and
//! when) and the residency it implies are scheduler decisions, as in [`crate::Scheduler`];
//! the glue only moves bytes. How: with [`L3Backups::WriteThrough`] every run of pages a store
//! inserts into the host tree is queued; [`OffloadManager::plan_backups`] turns the queue
//! into BackUp jobs (host slots → L3) for the pages L3 lacks, each locking its host path until
//! [`OffloadManager::complete_backup`]. Pages backed up, or reported found by the engine's
//! L3 probe ([`OffloadManager::l3_found`]; under tensor parallelism only the pages every
//! rank's probe found, agreed in `agreed_finds.rs`), are answered [`Lookup::InL3`] once off
//! host, and
//! the engine prefetches them with an ordinary store job whose bytes come from L3
//! ([`OffloadManager::prepare_store`]). What L3 loses the engine reports
//! ([`OffloadManager::l3_lost`]): a hint, as docs/scheduler.md says of L3 residency.
//!
//! A BackUp that fails (L3 down, or refusing) is not given up: its run waits in a retry
//! queue and is planned again, by a later [`OffloadManager::plan_backups`], once L3 has
//! answered since (a backup done, a prefetch that read pages, a probe that found some), or
//! as the probe one plan in [`BackupRetry::probe_every`] makes while it has not (an engine
//! serving only hits makes L3 no other answer), so a server that is down costs at most one
//! backup per that many plans for the pages already failed; at most
//! [`BackupRetry::pages_per_plan`] retried pages per plan (the step is not stalled by a
//! backlog), each run at most [`BackupRetry::tries`] times. Pages that left host meanwhile,
//! or that L3 holds or is being sent, are not planned again.
//!
//! A prefetch started with [`OffloadManager::prepare_prefetch`] is an op of its own
//! ([`OffloadManager::complete_prefetch`] takes how many pages were read, and what was not is
//! lost in L3), so that tensor-parallel ranks, each reading its shard of the pages, agree on
//! it with [`crate::RankAgreement`] like backups (`offload_agreement.rs`).
//!
//! [`Lookup::InL3`]: crate::Lookup::InL3

use std::collections::{BTreeMap, HashMap, HashSet};

use kvtier_radix::{Host, HostPageId, LockHandle, PageHash, TenantId};

use crate::backup_retry::{BackupRetry, RetryQueue, Run};
use crate::offload::{JobKind, JobOutcome, OffloadError, OffloadManager, StorePlan};

/// Whether the manager backs host pages up to L3.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum L3Backups {
    /// No L3 below the host tier.
    #[default]
    Off,
    /// Every page stored on host is backed up to L3 once.
    WriteThrough,
}

/// A BackUp in flight: the lock on its host path, its pages, and the run it was planned from
/// (queued again if it fails).
struct BackupJob {
    lock: LockHandle<Host>,
    pages: Vec<PageHash>,
    run: Run,
}

/// A BackUp: copy host `slots` (in order) to L3 as `pages`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupPlan {
    pub job: u64,
    pub pages: Vec<PageHash>,
    pub slots: Vec<HostPageId>,
}

/// The L3 side of an [`OffloadManager`].
#[derive(Default)]
pub(crate) struct L3Books {
    mode: L3Backups,
    /// Known to be in L3.
    in_l3: HashSet<PageHash>,
    /// Inserted runs waiting for a backup.
    queued: Vec<Run>,
    /// Runs whose backup failed, waiting for L3 to answer again (`backup_retry.rs`).
    retry: RetryQueue,
    /// Pages of backups in flight.
    backing_up: HashSet<PageHash>,
    jobs: HashMap<u64, BackupJob>,
    /// Prefetches in flight (store jobs whose bytes come from L3): job -> their pages.
    prefetches: BTreeMap<u64, Vec<PageHash>>,
    /// Pages L3 lost while a backup of them was in flight: its `Done` must not mark them.
    lost_in_backup: HashSet<PageHash>,
}

impl L3Books {
    pub(crate) fn holds(&self, page: &PageHash) -> bool {
        self.in_l3.contains(page)
    }

    pub(crate) fn on_inserted(&mut self, chain: &[PageHash], from: usize) {
        if self.mode == L3Backups::WriteThrough && from < chain.len() {
            self.queued.push(Run {
                chain: chain.to_vec(),
                from,
                tries: 0,
            });
        }
    }

    pub(crate) fn backups(&self) -> usize {
        self.jobs.len()
    }

    pub(crate) fn prefetch_ended(&mut self, job: u64) {
        self.prefetches.remove(&job);
    }

    pub(crate) fn prefetch_jobs(&self) -> impl Iterator<Item = u64> + '_ {
        self.prefetches.keys().copied()
    }

    pub(crate) fn is_prefetch(&self, job: u64) -> bool {
        self.prefetches.contains_key(&job)
    }

    /// The pages prefetch `job` reads (`None`: no such prefetch in flight).
    pub(crate) fn prefetch_pages(&self, job: u64) -> Option<usize> {
        self.prefetches.get(&job).map(Vec::len)
    }

    pub(crate) fn backup_jobs(&self) -> impl Iterator<Item = u64> + '_ {
        self.jobs.keys().copied()
    }

    pub(crate) fn known(&self) -> usize {
        self.in_l3.len()
    }

    /// Whether a plan has anything to do now: inserted runs, failed runs once L3 answered or
    /// as the probe, or a plan to count towards the probe (`backup_retry.rs`).
    fn due(&self) -> bool {
        !self.queued.is_empty() || self.retry.due() || self.retry.counting()
    }
}

impl OffloadManager {
    /// Sets the write policy towards L3.
    pub fn set_l3_backups(&mut self, mode: L3Backups) {
        self.l3.mode = mode;
    }

    /// How failed backups are tried again (module doc); [`BackupRetry::default`] until set.
    pub fn set_backup_retry(&mut self, conf: BackupRetry) {
        self.l3.retry.set_conf(conf);
    }

    /// BackUp jobs for the queued host pages L3 lacks (pages evicted from host meanwhile are
    /// skipped), then, once L3 answered since the last failed backup, for up to
    /// [`BackupRetry::pages_per_plan`] pages of failed ones; each pins its host path until
    /// [`Self::complete_backup`].
    pub fn plan_backups(&mut self) -> Vec<BackupPlan> {
        let mut out = Vec::new();
        for run in std::mem::take(&mut self.l3.queued) {
            self.plan_run(run, usize::MAX, &mut out);
        }
        let mut retry = std::mem::take(&mut self.l3.retry);
        retry.plan(|run, budget| self.plan_run(run, budget, &mut out));
        self.l3.retry = retry;
        out
    }

    /// Plans a backup of at most `budget` pages of `run` that are on host and that L3 lacks:
    /// the pages planned, and what is left of the run beyond them (`None`: nothing).
    fn plan_run(
        &mut self,
        run: Run,
        budget: usize,
        out: &mut Vec<BackupPlan>,
    ) -> (usize, Option<Run>) {
        let host_end = self.host_prefix(&run.chain);
        if host_end <= run.from {
            return (0, None);
        }
        let wanted = |i: &usize| {
            !self.l3.in_l3.contains(&run.chain[*i]) && !self.l3.backing_up.contains(&run.chain[*i])
        };
        let todo: Vec<usize> = (run.from..host_end).filter(wanted).take(budget).collect();
        let Some(&last) = todo.last() else {
            return (0, None);
        };
        let end = last + 1;
        let rest = (end < host_end && (end..host_end).any(|i| wanted(&i))).then(|| Run {
            chain: run.chain[..host_end].to_vec(),
            from: end,
            tries: run.tries,
        });
        let node = self.cache.match_prefix(&run.chain[..end]).host_node;
        let Ok(lock) = self.cache.lock::<Host>(node) else {
            return (0, None);
        };
        let path = match self.cache.path_pages::<Host>(node) {
            Ok(p) => p,
            Err(_) => {
                self.release(lock);
                return (0, None);
            }
        };
        let (Some(slots), Some(pages)) = (
            todo.iter()
                .map(|&i| path.get(i).copied())
                .collect::<Option<Vec<_>>>(),
            todo.iter()
                .map(|&i| run.chain.get(i).copied())
                .collect::<Option<Vec<_>>>(),
        ) else {
            self.release(lock);
            return (0, None);
        };
        let job = self.next_job;
        self.next_job += 1;
        self.l3.backing_up.extend(pages.iter().copied());
        let n = pages.len();
        let run = Run {
            chain: run.chain[..end].to_vec(),
            from: run.from,
            tries: run.tries,
        };
        self.l3.jobs.insert(
            job,
            BackupJob {
                lock,
                pages: pages.clone(),
                run,
            },
        );
        out.push(BackupPlan { job, pages, slots });
        (n, rest)
    }

    /// A BackUp ended: on `Done` its pages are known in L3 (and L3 answers: failed backups
    /// may be tried again), on `Failed` its run waits to be tried again (module doc); either
    /// way its path is unpinned.
    pub fn complete_backup(&mut self, job: u64, outcome: JobOutcome) -> Result<(), OffloadError> {
        let Some(BackupJob { lock, pages, run }) = self.l3.jobs.remove(&job) else {
            return Err(OffloadError::UnknownJob {
                kind: JobKind::Backup,
                job,
            });
        };
        for p in &pages {
            self.l3.backing_up.remove(p);
        }
        if outcome == JobOutcome::Done {
            self.l3.retry.answered();
            for p in pages {
                if !self.l3.lost_in_backup.remove(&p) {
                    self.l3.in_l3.insert(p);
                }
            }
        } else {
            for p in &pages {
                self.l3.lost_in_backup.remove(p);
            }
            self.l3.retry.failed(run);
        }
        self.release(lock);
        Ok(())
    }

    /// The engine's probe found these pages in L3. Refused on a manager of several ranks
    /// ([`OffloadError::FoundNeedsAgreement`], nothing changed): one rank's probe found its
    /// shard, and that rank alone answering [`crate::Lookup::InL3`] would plan other
    /// prefetches than the others; `RankAgreement::found_pages` and `agree_found` apply the
    /// pages every rank found (`agreed_finds.rs`).
    pub fn l3_found(&mut self, pages: &[PageHash]) -> Result<(), OffloadError> {
        match self.tp_ranks {
            1 => {
                self.mark_l3_found(pages.iter().copied());
                Ok(())
            }
            tp_ranks => Err(OffloadError::FoundNeedsAgreement { tp_ranks }),
        }
    }

    /// Marks `pages` in L3 (a find of the one rank, or one every rank agreed): L3 answered,
    /// if any. The number of marks added.
    pub(crate) fn mark_l3_found(&mut self, pages: impl IntoIterator<Item = PageHash>) -> usize {
        let before = self.l3.known();
        let mut any = false;
        for p in pages {
            any = true;
            self.l3.in_l3.insert(p);
        }
        if any {
            self.l3.retry.answered();
        }
        self.l3.known() - before
    }

    /// L3 lost these pages (evicted, removed, a failed read): no longer answered `InL3`.
    /// Refused on a manager of several ranks ([`OffloadError::LossNeedsAgreement`]: one
    /// rank's store heard of it; `RankAgreement::lost_pages` and `agree_losses` apply it).
    pub fn l3_lost(&mut self, pages: &[PageHash]) -> Result<(), OffloadError> {
        self.single_rank_loss()?;
        self.forget_l3(pages);
        Ok(())
    }

    fn single_rank_loss(&self) -> Result<(), OffloadError> {
        match self.tp_ranks {
            1 => Ok(()),
            tp_ranks => Err(OffloadError::LossNeedsAgreement { tp_ranks }),
        }
    }

    /// Forgets `pages` in L3 (an agreed loss, or a prefetch every rank agreed fell short).
    pub(crate) fn forget_l3(&mut self, pages: &[PageHash]) {
        for p in pages {
            self.l3.in_l3.remove(p);
            // A loss can overtake the completion of the backup writing the page.
            if self.l3.backing_up.contains(p) {
                self.l3.lost_in_backup.insert(*p);
            }
        }
    }

    /// L3 may have lost anything (a loss report overflowed): nothing is answered `InL3`
    /// until backed up or found again. Refused on a manager of several ranks, as
    /// [`Self::l3_lost`].
    pub fn l3_lost_all(&mut self) -> Result<(), OffloadError> {
        self.single_rank_loss()?;
        self.forget_l3_all_marks();
        Ok(())
    }

    pub(crate) fn forget_l3_all_marks(&mut self) {
        self.l3.in_l3.clear();
        let l3 = &mut self.l3;
        l3.lost_in_backup.extend(l3.backing_up.iter().copied());
    }

    /// Pages known to be in L3.
    pub fn l3_known(&self) -> usize {
        self.l3.known()
    }

    /// A **Prefetch**: host slots for pages `..to` of `chain` not on host, and for the run of
    /// pages after them known to be in L3 (a prefix is read in one job, not a job per page as
    /// the engine asks about them), handed out as [`Self::prepare_store`] does (after the
    /// host-resident prefix, evicting as needed); the engine reads their bytes from L3 and
    /// reports [`Self::complete_prefetch`]. Pages being prefetched are answered
    /// [`crate::Lookup::Pending`].
    pub fn prepare_prefetch(
        &mut self,
        chain: &[PageHash],
        to: usize,
    ) -> Result<Option<StorePlan>, OffloadError> {
        self.prepare_prefetch_for(TenantId::SHARED, chain, to)
    }

    /// [`Self::prepare_prefetch`] on behalf of `tenant` (its cap bounds the slots, and it
    /// owns the pages: `offload_tenant.rs`).
    pub fn prepare_prefetch_for(
        &mut self,
        tenant: TenantId,
        chain: &[PageHash],
        to: usize,
    ) -> Result<Option<StorePlan>, OffloadError> {
        let to = to
            + chain
                .get(to..)
                .unwrap_or_default()
                .iter()
                .take_while(|h| self.l3.in_l3.contains(h) && !self.storing_page(h))
                .count();
        let plan = self.plan_store(tenant, chain, to, false)?;
        if let Some(p) = &plan {
            let pages = chain[p.from..p.from + p.slots.len()].to_vec();
            self.l3.prefetches.insert(p.job, pages);
        }
        Ok(plan)
    }

    /// A Prefetch ended with its first `completed` pages read from L3: those become host
    /// pages (once their parent is), the rest lose their slots and are no longer taken to be
    /// in L3 (the read found them gone), so the engine computes them. More pages than the
    /// prefetch reads is [`OffloadError::TooManyPages`], nothing changed.
    pub fn complete_prefetch(&mut self, job: u64, completed: usize) -> Result<(), OffloadError> {
        let Some(pages) = self.l3.prefetches.get(&job) else {
            return Err(OffloadError::UnknownJob {
                kind: JobKind::Prefetch,
                job,
            });
        };
        if completed > pages.len() {
            return Err(OffloadError::TooManyPages {
                job,
                completed,
                pages: pages.len(),
            });
        }
        let lost = pages[completed..].to_vec();
        self.complete_store_prefix(job, completed)?;
        if completed > 0 {
            self.l3.retry.answered();
        }
        self.forget_l3(&lost);
        Ok(())
    }

    /// Backups waiting to be planned, and in flight.
    pub fn backups_pending(&self) -> (usize, usize) {
        (self.l3.queued.len(), self.l3.jobs.len())
    }

    /// Whether [`Self::plan_backups`] has anything to do now (inserted runs queued, failed
    /// ones L3 may take again, or, while L3 has not answered since a failure and runs wait,
    /// the plans counted towards the probe that tries one of them: `backup_retry.rs`): an
    /// engine may skip the call otherwise.
    pub fn backups_due(&self) -> bool {
        self.l3.due()
    }

    /// Failed backups waiting to be tried again (runs), and those given up so far.
    pub fn backups_retrying(&self) -> (usize, u64) {
        let (waiting, given_up, _) = self.l3.retry.counts();
        (waiting, given_up)
    }

    /// Probes planned so far: a waiting failed run tried while L3 had not answered
    /// ([`BackupRetry::probe_every`]).
    pub fn backups_probed(&self) -> u64 {
        self.l3.retry.probes()
    }
}
