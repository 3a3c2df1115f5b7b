//! One candidate's shadow: a metadata-only [`RadixCache`] of the candidate's sizes, driven by
//! the request stream the way a real engine drives the cache, under the candidate's eviction
//! policy and host admission.
//!
//! Why the real tree and not a lighter model: the point of a shadow is to report the hits the
//! candidate *would* have had, and any simplification (a flat LRU of pages, no prefix closure)
//! reports the hits of something else. The tree holds no KV, only page ids and hashes; the
//! shadow keeps one dummy token per page (page size 1), so its memory is the tree's metadata.
//!
//! How, per request (the replay used by the selector and by the property tests):
//! 1. match the prompt: the hit is every page found on device or host;
//! 2. bring the prompt (at most device's capacity of it) onto device: the host-only part is
//!    loaded, the rest computed — before allocating, demotion (`Demote`) writes the coldest
//!    device-only leaves back to host until the pages needed are free or backed;
//! 3. copies at finish (`CopyAtFinish`): the prompt's pages get their host copy.
//!
//! Every step holds a lock on the prefix it builds on, so no allocation evicts it.

use crate::adaptive::LearntAdmission;
use crate::cache::{RadixCache, RadixConfig};
use crate::error::RadixError;
use crate::hash::PageHash;
use crate::node::NodeId;
use crate::policy::EvictionPolicy;
use crate::tier::{Device, Host, Tier, TierKind};

/// A fixed option the selector compares: an eviction order and a host admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Candidate {
    pub eviction: EvictionPolicy,
    pub admission: LearntAdmission,
}

impl std::fmt::Display for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.eviction {
            EvictionPolicy::Lru => "lru".to_string(),
            e if e == EvictionPolicy::CONVERSATION => "freq-depth".to_string(),
            e => e.to_string(),
        };
        match self.admission {
            LearntAdmission::CopyAtFinish => f.write_str(&name),
            LearntAdmission::Demote => write!(f, "{name} + demote"),
        }
    }
}

/// A candidate's shadow cache and the hits it has reported.
pub struct ShadowCache {
    pub(crate) candidate: Candidate,
    cache: RadixCache,
    /// Requests replayed and pages looked up / hit (on either tier).
    pub(crate) requests: u64,
    pub(crate) looked_up: u64,
    pub(crate) hits: u64,
}

impl ShadowCache {
    /// A shadow of `candidate` with `device_pages` + `host_pages`.
    pub fn new(
        candidate: Candidate,
        device_pages: u32,
        host_pages: u32,
    ) -> Result<ShadowCache, RadixError> {
        let mut cache = RadixCache::new(RadixConfig {
            page_size: 1,
            device_pages,
            host_pages,
            record_events: false,
        })?;
        cache.set_eviction_policy(candidate.eviction);
        Ok(ShadowCache {
            candidate,
            cache,
            requests: 0,
            looked_up: 0,
            hits: 0,
        })
    }

    /// Replays one request's prompt (its page hashes); returns the pages it hit.
    pub fn replay(&mut self, hashes: &[PageHash]) -> usize {
        let m = self.cache.match_prefix(hashes);
        self.requests += 1;
        self.looked_up += hashes.len() as u64;
        self.hits += m.matched_pages as u64;
        let device = self.cache.usage(TierKind::Device).capacity;
        let n = hashes.len().min(device);
        if n > m.device_pages {
            // A failure (everything else locked) leaves the request uncached, as an engine
            // that cannot allocate would compute it without keeping it.
            let _ = self.fill::<Device>(&hashes[..n], m.device_node, m.device_pages);
        }
        if self.candidate.admission == LearntAdmission::CopyAtFinish {
            let host = self.cache.usage(TierKind::Host).capacity;
            let nh = n.min(host);
            if nh > m.host_pages {
                let _ = self.fill::<Host>(&hashes[..nh], m.host_node, m.host_pages);
            }
        }
        m.matched_pages
    }

    /// Pages `from..` of `hashes` onto tier `T` below `start` (on `T`, ending at `from`),
    /// `start` locked meanwhile; on device, demotion first under `Demote`.
    fn fill<T: Tier>(
        &mut self,
        hashes: &[PageHash],
        start: NodeId,
        from: usize,
    ) -> Result<(), RadixError> {
        let need = hashes.len() - from;
        let lock = self.cache.lock::<T>(start)?;
        if T::KIND == TierKind::Device && self.candidate.admission == LearntAdmission::Demote {
            self.demote(need);
        }
        let res = self.cache.alloc_evicting::<T>(need).and_then(|pages| {
            let tokens = vec![0u32; hashes.len()];
            match self.cache.insert(start, from, hashes, &tokens, &pages) {
                Ok(o) => {
                    let dup: Vec<_> = o.duplicates.iter().map(|d| d.1).collect();
                    self.cache.free(&dup)
                }
                Err(e) => {
                    self.cache.free(&pages)?;
                    Err(e)
                }
            }
        });
        self.cache.unlock(lock).map_err(|r| r.error)?;
        res
    }

    /// Demotion: writes the coldest device-only leaves to host until `need` device pages are
    /// free or backed by a host copy (the scheduler's `plan_demotions`, done at once).
    fn demote(&mut self, need: usize) {
        let mut covered = self.cache.usage(TierKind::Device).free;
        if covered >= need {
            return;
        }
        let mut victims = Vec::new();
        for node in self.cache.evictable_lru::<Device>() {
            if covered >= need {
                break;
            }
            covered += self.cache.node_hashes(node).map_or(0, <[PageHash]>::len);
            if self.cache.is_resident(node, TierKind::Host) != Ok(true) {
                victims.push(node);
            }
        }
        for v in victims {
            let _ = self.demote_leaf(v);
        }
    }

    fn demote_leaf(&mut self, leaf: NodeId) -> Result<(), RadixError> {
        let path = self.cache.path_nodes(leaf)?;
        let Some(i) = path
            .iter()
            .position(|&(n, ..)| self.cache.is_resident(n, TierKind::Host) != Ok(true))
        else {
            return Ok(());
        };
        let above = if i == 0 {
            self.cache.root()
        } else {
            path[i - 1].0
        };
        let from = path[i].1;
        let end = path[path.len() - 1].2;
        let lock = self.cache.lock::<Host>(above)?;
        let res = self
            .cache
            .alloc_for_copy::<Host>(leaf, TierKind::Device, end - from)
            .and_then(|pages| {
                let unused = self.cache.add_copies(leaf, from, &pages)?;
                self.cache.free(&unused)
            });
        self.cache.unlock(lock).map_err(|r| r.error)?;
        res
    }

    /// The shadow's hit rate so far (pages hit / pages looked up).
    pub fn hit_rate(&self) -> f64 {
        if self.looked_up == 0 {
            0.0
        } else {
            self.hits as f64 / self.looked_up as f64
        }
    }

    /// Pages hit so far (on either tier) and pages looked up.
    pub fn hits(&self) -> (u64, u64) {
        (self.hits, self.looked_up)
    }

    /// The candidate this shadow runs.
    pub fn candidate(&self) -> Candidate {
        self.candidate
    }

    /// Nodes in the shadow's tree (its memory is proportional).
    pub fn node_count(&self) -> usize {
        self.cache.node_count()
    }

    /// The tree's own audit (for property tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.cache.check_invariants()
    }
}
