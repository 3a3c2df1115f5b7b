//! Submitting a request: [`Scheduler::submit`] and [`Scheduler::submit_at`].
//!
//! Why apart: submission is the one place where untrusted request specs enter the scheduler,
//! so it validates everything first (duplicate id, empty prompt, zero `max_new_tokens`, length,
//! extra keys) and only then records the request. It also does the per-request work done
//! exactly once: the hash scope (cache salt, adapter, extra keys), the tenant a cache salt
//! names, and the prompt's page hashes.

use std::sync::Arc;

use kvtier_fsm::RequestState;
use kvtier_radix::{HashScope, ScopeLabel, TenantId, TierKind, page_hashes};

use crate::error::SchedulerError;
use crate::request::{DeviceTable, L3Progress, Request};
use crate::scheduler::Scheduler;
use crate::types::RequestSpec;

impl Scheduler {
    /// Adds a request to the waiting queue. Its prompt's page hashes are computed once, here.
    pub fn submit(&mut self, spec: RequestSpec) -> Result<(), SchedulerError> {
        self.submit_at(spec, self.now_ms)
    }

    /// Like [`Self::submit`], with the arrival time (ms) for latency statistics.
    pub fn submit_at(&mut self, spec: RequestSpec, now_ms: u64) -> Result<(), SchedulerError> {
        if self.reqs.contains_key(&spec.id) {
            return Err(SchedulerError::DuplicateRequest(spec.id));
        }
        if spec.prompt.is_empty() {
            return Err(SchedulerError::EmptyPrompt);
        }
        if spec.max_new_tokens == 0 {
            return Err(SchedulerError::ZeroMaxNewTokens);
        }
        let total = spec.prompt.len() + spec.max_new_tokens as usize;
        if total > self.cfg.max_context_tokens {
            return Err(SchedulerError::TooLong {
                tokens: total,
                max: self.cfg.max_context_tokens,
            });
        }
        // A request that alone needs more device pages than its tenant may hold could never
        // finish (it would retract itself forever): refused up front.
        if let (Some(_), Some(quota)) = (&spec.cache_salt, self.cfg.tenant_quota.device_pages) {
            let pages = total.div_ceil(self.cfg.page_size);
            if pages > quota as usize {
                return Err(SchedulerError::ExceedsTenantQuota { pages, quota });
            }
        }
        for (index, k) in spec.extra_keys.iter().enumerate() {
            if k.start >= k.end || k.end as usize > spec.prompt.len() {
                return Err(SchedulerError::BadExtraKey {
                    index,
                    start: k.start,
                    end: k.end,
                    prompt_len: spec.prompt.len(),
                });
            }
        }
        let scope =
            (spec.cache_salt.is_some() || spec.adapter.is_some() || !spec.extra_keys.is_empty())
                .then(|| {
                    Box::new((
                        HashScope::new(
                            spec.cache_salt.as_deref(),
                            spec.adapter.as_deref(),
                            spec.extra_keys,
                        ),
                        Arc::new(ScopeLabel {
                            cache_salt: spec.cache_salt,
                            adapter: spec.adapter,
                        }),
                    ))
                });
        let tenant = match &scope {
            Some(sc) => match &sc.1.cache_salt {
                Some(salt) => self.tenant_for_salt(salt),
                None => TenantId::SHARED,
            },
            None => TenantId::SHARED,
        };
        let hashes = match &scope {
            None => page_hashes(&spec.prompt, self.cfg.page_size, None),
            Some(s) => s.0.page_hashes(&spec.prompt, self.cfg.page_size),
        };
        // The shadow selector sees every submission, in order, on every rank.
        self.cache.observe_request(&hashes);
        let seq = self.next_seq;
        self.next_seq += 1;
        let prompt_len = spec.prompt.len();
        self.reqs.insert(
            spec.id,
            Request {
                id: spec.id,
                seq,
                tokens: spec.prompt,
                prompt_len,
                max_new: spec.max_new_tokens,
                hashes,
                scope,
                tenant,
                state: RequestState::Submitted,
                table: DeviceTable::new(),
                l3: if self.cfg.l3_enabled {
                    L3Progress::Unprobed { reprobes: 0 }
                } else {
                    L3Progress::Done
                },
                prefetched: None,
                prefetch_pin: None,
                resumed: false,
                ops: Default::default(),
                recompute: false,
                arrival_ms: now_ms,
                first_token_ms: None,
            },
        );
        self.enqueue(seq, spec.id);
        self.stats.submitted += 1;
        metrics::counter!("kvtier_requests_submitted_total").increment(1);
        Ok(())
    }

    /// The tenant a cache salt names (never `SHARED`); registers its caps on first sight when
    /// `tenant_quota` sets any.
    fn tenant_for_salt(&mut self, salt: &str) -> TenantId {
        let t = tenant_id(salt);
        let q = self.cfg.tenant_quota;
        let capped = q.device_pages.is_some() || q.host_pages.is_some();
        if capped && self.cache.tenant_cached(t, TierKind::Device).is_none() {
            self.cache
                .set_tenant_cap(t, TierKind::Device, q.device_pages.map(|x| x as usize));
            self.cache
                .set_tenant_cap(t, TierKind::Host, q.host_pages.map(|x| x as usize));
        }
        t
    }
}

/// The tenant a cache salt names (never `SHARED`).
fn tenant_id(salt: &str) -> TenantId {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in b"kvtier-tenant-v1".iter().chain(salt.as_bytes()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    TenantId(h.max(1))
}

impl Scheduler {
    /// The pages of tier `t` that count against the quota of the tenant `cache_salt` names:
    /// cached in its tree nodes plus held for its requests, prefetches and copies. `None`
    /// when no quota is configured or the salt was never seen.
    pub fn tenant_pages(&self, cache_salt: &str, t: TierKind) -> Option<usize> {
        self.cache.tenant_charge(tenant_id(cache_salt), t)
    }
}
