//! The integrity oracle's bookkeeping: the fingerprints a request's pages must hold, the
//! checks of every page a forward reads, the pages it writes, the check that a page dropped
//! from host under write-back is still in some tier, and the access log for the Belady
//! ceiling.
//!
//! Why apart from the event loop: the loop decides *when* things happen; this decides whether
//! what the scheduler handed out is right, and it must stay simple enough to trust.

use kvtier_l3::L3Store;
use kvtier_radix::{TierKind, extend_hashes};
use kvtier_scheduler::{KvEvent, RequestId, WritePolicy};

use super::{Simulation, fingerprint};

impl Simulation {
    /// Logs a request's prompt pages (once) for the Belady ceiling.
    pub(super) fn log_prompt(&mut self, inst: usize, id: RequestId) {
        let ps = self.cfg.scheduler.page_size;
        let Some(tr) = self.insts[inst].tracks.get(&id) else {
            return;
        };
        if tr.logged {
            return;
        }
        let n = tr.prompt_len / ps;
        self.ensure_fps(inst, id, n);
        if let Some(tr) = self.insts[inst].tracks.get_mut(&id) {
            tr.logged = true;
            for &f in &tr.fps[..n.min(tr.fps.len())] {
                self.accesses.push(f, true);
            }
        }
    }

    /// Makes sure the track has fingerprints for the first `pages` full pages.
    pub(super) fn ensure_fps(&mut self, inst: usize, id: RequestId, pages: usize) {
        let ps = self.cfg.scheduler.page_size;
        let i = &mut self.insts[inst];
        let Some(tr) = i.tracks.get_mut(&id) else {
            return;
        };
        if tr.fps.len() >= pages {
            return;
        }
        let Some(tokens) = i.sched.request_tokens(id) else {
            return;
        };
        let from = tr.hashes.len();
        extend_hashes(&mut tr.hashes, tokens, ps, from, pages);
        tr.fps.extend(tr.hashes[from..].iter().map(fingerprint));
    }

    /// Verifies pages `0..pages` of `id`'s table (from the first unverified one).
    pub(super) fn verify(&mut self, inst: usize, id: RequestId, pages: usize) {
        self.ensure_fps(inst, id, pages);
        let i = &mut self.insts[inst];
        let Some(tr) = i.tracks.get_mut(&id) else {
            return;
        };
        let upto = pages.min(i.model.table(id).len()).min(tr.fps.len());
        let from = tr.verified.min(upto);
        match i.model.check(id, from, &tr.fps[..upto]) {
            Ok(n) => {
                self.col.pages_checked += n as u64;
                tr.verified = tr.verified.max(upto);
            }
            Err(w) => {
                tr.verified = w.page;
                self.col
                    .oracle_failure(format!("{id:?} reads wrong KV at page {}", w.page));
            }
        }
    }

    pub(super) fn write(&mut self, inst: usize, id: RequestId, from_page: usize, to_page: usize) {
        self.ensure_fps(inst, id, to_page);
        let i = &mut self.insts[inst];
        let Some(tr) = i.tracks.get(&id) else {
            return;
        };
        let to = to_page.min(i.model.table(id).len()).min(tr.fps.len());
        i.model.write(id, from_page, &tr.fps[..to]);
        // Every computed page may enter the cache from now on (published per chunk, at
        // retraction or at finish): log it as written, as early as any policy could use it.
        for fp in tr.fps.iter().take(to).skip(from_page) {
            self.accesses.push(*fp, false);
        }
    }

    /// Under write-back, host is the last local tier a page leaves: every page the scheduler
    /// dropped from host must still be in L3 or on this instance's device, or it is lost from
    /// every tier (an oracle failure). Runs only where KV events are recorded (write-back
    /// with L3, or a KV-aware router: `Simulation::new` turns them on); the events drained
    /// here are also what the router reads.
    pub(super) fn check_host_drops(&mut self, inst: usize) {
        if !self.insts[inst].sched.config().record_kv_events {
            return;
        }
        let events = self.insts[inst].sched.drain_kv_events();
        // A KV-aware router reads every event the instance published.
        self.router.kv_events(inst, &events);
        // Only write-back makes L3 the only copy of what host drops.
        let cfg = self.insts[inst].sched.config();
        if !(cfg.l3_enabled && cfg.write_policy == WritePolicy::WriteBack) {
            return;
        }
        let Some(store) = self.store.clone() else {
            return;
        };
        let mut dropped = Vec::new();
        for ev in events {
            if let KvEvent::Removed {
                tier: TierKind::Host,
                hashes,
                ..
            } = ev
            {
                dropped.extend(hashes);
            }
        }
        if dropped.is_empty() {
            return;
        }
        let i = &self.insts[inst];
        let on_device: std::collections::HashSet<u64> = i.model.device.iter().copied().collect();
        let keys = i.sched.l3_keys(&dropped);
        let exist = store.batch_is_exist(&self.tenant, &keys);
        for (j, h) in dropped.iter().enumerate() {
            let in_l3 = matches!(exist.as_ref().map(|v| v.get(j)), Ok(Some(Ok(true))));
            if !in_l3 && !on_device.contains(&fingerprint(h)) {
                self.col.oracle_failure(format!(
                    "page {} dropped from host while in no other tier",
                    keys[j]
                ));
            }
        }
    }
}
