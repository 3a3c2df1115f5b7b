//! # kvtier-e2e — the scheduler end to end, with the real L3 store
//!
//! Why a crate of its own: the scheduler's unit and property tests model L3 as a map, so that
//! they can hold, reorder and fail ops at will; the store's tests exercise the store alone.
//! What neither shows is the two together: page bytes put by one engine instance and read by
//! another through the real `EmbeddedStore`, its namespaced keys, its existence probes, its
//! removals. [`StoreEngine`] executes plans on the shared engine model
//! (`kvtier_scheduler::model::PageModel`, the same oracle as the scheduler's tests and the
//! simulator; a page's 32 bytes are its chained, scoped page hash) with any [`L3Store`] as L3;
//! keys are parsed with the one `parse_l3_key`.

use std::collections::HashMap;
use std::sync::Arc;

use kvtier_l3::{ExistOptions, L3Store, PutOptions, Tenant};
use kvtier_radix::{HashScope, PageHash, parse_l3_key};
use kvtier_scheduler::model::PageModel;
use kvtier_scheduler::*;

/// One engine instance: device and host pools of 32-byte pages, an L3 store.
pub struct StoreEngine {
    pub s: Scheduler,
    pub l3: Arc<dyn L3Store>,
    pub tenant: Tenant,
    page_size: usize,
    /// The shared engine model, with a page's 32 bytes as its content.
    model: PageModel<[u8; 32]>,
    tokens: HashMap<RequestId, Vec<u32>>,
    scopes: HashMap<RequestId, HashScope>,
    /// Pages every forward read and found right.
    pub pages_checked: u64,
    /// The store is unreachable (a killed server): every call to it fails, so probes find
    /// nothing, prefetches read nothing and backups fail, until this is cleared.
    pub l3_down: bool,
}

impl StoreEngine {
    pub fn new(cfg: SchedulerConfig, l3: Arc<dyn L3Store>, tenant: &str) -> StoreEngine {
        StoreEngine {
            page_size: cfg.page_size,
            model: PageModel::new(cfg.device_pages, cfg.host_pages),
            s: Scheduler::new(cfg).expect("valid config"),
            l3,
            tenant: Tenant::new(tenant).expect("valid tenant"),
            tokens: HashMap::new(),
            scopes: HashMap::new(),
            pages_checked: 0,
            l3_down: false,
        }
    }

    pub fn submit(&mut self, spec: RequestSpec) -> Result<(), SchedulerError> {
        let scope = HashScope::new(
            spec.cache_salt.as_deref(),
            spec.adapter.as_deref(),
            spec.extra_keys.clone(),
        );
        let (id, prompt) = (spec.id, spec.prompt.clone());
        self.s.submit(spec)?;
        self.tokens.insert(id, prompt);
        self.scopes.insert(id, scope);
        Ok(())
    }

    fn hashes(&self, req: RequestId, upto: usize) -> Vec<PageHash> {
        let t = &self.tokens[&req];
        self.scopes[&req].page_hashes(&t[..upto.min(t.len())], self.page_size)
    }

    /// Runs one op against the pools and the store; returns its completion.
    pub fn execute(&mut self, op: &PlannedOp) -> Result<Event, String> {
        let id = op.id;
        if self.l3_down {
            return Ok(match &op.spec {
                OpSpec::L3Query { .. } => Event::L3QueryDone {
                    op: id,
                    hit_pages: 0,
                },
                OpSpec::Prefetch { .. } => Event::PrefetchDone {
                    op: id,
                    completed: 0,
                },
                OpSpec::BackUp { .. } => Event::BackUpDone {
                    op: id,
                    success: false,
                },
                OpSpec::LoadBack { .. } | OpSpec::WriteBack { .. } => self.execute_local(op),
            });
        }
        Ok(match &op.spec {
            OpSpec::L3Query { keys } => {
                let found = self
                    .l3
                    .batch_exist_key(
                        &self.tenant,
                        keys,
                        ExistOptions {
                            prefetch_to_memory: true,
                        },
                    )
                    .map_err(|e| e.to_string())?;
                let hit = found.iter().take_while(|r| matches!(r, Ok(true))).count();
                Event::L3QueryDone {
                    op: id,
                    hit_pages: hit as u32,
                }
            }
            OpSpec::Prefetch { keys, dst } => {
                let mut done = 0;
                for (i, k) in keys.iter().enumerate() {
                    let Ok(bytes) = self.l3.get(&self.tenant, k) else {
                        break;
                    };
                    let want = parse_l3_key(k).ok_or("bad key")?.page;
                    if bytes[..] != want.0[..] {
                        return Err(format!("L3 returned other bytes for {k}"));
                    }
                    self.model.set(dst, i, want.0);
                    done += 1;
                }
                Event::PrefetchDone {
                    op: id,
                    completed: done,
                }
            }
            OpSpec::LoadBack { .. } | OpSpec::WriteBack { .. } => self.execute_local(op),
            OpSpec::BackUp { keys, src } => {
                let mut ok = true;
                for (i, k) in keys.iter().enumerate() {
                    let want = parse_l3_key(k).ok_or("bad key")?.page;
                    let have = self.model.get(src, i);
                    if have != want.0 {
                        return Err(format!("backup would store other bytes under {k}"));
                    }
                    match self.l3.put(&self.tenant, k, &have, PutOptions::default()) {
                        Ok(()) => {}
                        Err(e) if e.code() == kvtier_l3::ErrorCode::ObjectAlreadyExists => {}
                        Err(_) => ok = false,
                    }
                }
                Event::BackUpDone {
                    op: id,
                    success: ok,
                }
            }
        })
    }

    /// A copy between the engine's own pools (device ↔ host): it does not touch the store.
    fn execute_local(&mut self, op: &PlannedOp) -> Event {
        self.model.copy(&op.spec);
        match op.spec {
            OpSpec::LoadBack { .. } => Event::LoadBackDone {
                op: op.id,
                success: true,
            },
            _ => Event::WriteBackDone {
                op: op.id,
                success: true,
            },
        }
    }

    /// Runs a forward: checks every page each row reads, writes the pages it completes.
    pub fn forward(&mut self, f: &ForwardBatch) -> Result<Event, String> {
        let mut outputs = Vec::new();
        for c in &f.prefill {
            self.delta(c.req, &c.table);
            let start = c.start as usize;
            self.check(c.req, start)?;
            self.write(c.req, start, start + c.len as usize);
            outputs.push(TokenOutput {
                req: c.req,
                token: 7,
                stop: false,
            });
        }
        for d in &f.decode {
            self.delta(d.req, &d.table);
            let pos = d.position as usize;
            self.check(d.req, pos)?;
            self.tokens
                .get_mut(&d.req)
                .ok_or("unknown request")?
                .push(7);
            self.write(d.req, pos, pos + 1);
            outputs.push(TokenOutput {
                req: d.req,
                token: 7,
                stop: false,
            });
        }
        for c in &f.prefill {
            if c.last {
                self.tokens
                    .get_mut(&c.req)
                    .ok_or("unknown request")?
                    .push(7);
            }
        }
        Ok(Event::ForwardDone {
            step: f.step.ok_or("no step")?,
            outputs,
        })
    }

    fn delta(&mut self, req: RequestId, d: &Option<PageTableDelta>) {
        self.model.apply_delta(req, d);
    }

    fn check(&mut self, req: RequestId, upto_tokens: usize) -> Result<(), String> {
        let want: Vec<[u8; 32]> = self.hashes(req, upto_tokens).iter().map(|h| h.0).collect();
        match self.model.check(req, 0, &want) {
            Ok(n) if n == want.len() => {
                self.pages_checked += n as u64;
                Ok(())
            }
            Ok(_) => Err(format!("{req:?}: page table shorter than its KV")),
            Err(w) => Err(format!("{req:?} reads wrong KV at page {}", w.page)),
        }
    }

    fn write(&mut self, req: RequestId, from: usize, to: usize) {
        let content: Vec<[u8; 32]> = self.hashes(req, to).iter().map(|h| h.0).collect();
        self.model.write(req, from / self.page_size, &content);
    }

    /// One step: plan, every op executed and reported, the forward.
    pub fn step(&mut self, now: u64) -> Result<(), String> {
        let plan = self.s.next_execution_plan(now);
        for (id, _) in &plan.ended {
            self.model.forget(*id);
        }
        for id in &plan.retracted {
            self.model.forget(*id);
        }
        for op in &plan.ops {
            let ev = self.execute(op)?;
            self.s.on_event(ev).map_err(|e| e.to_string())?;
        }
        if plan.forward.step.is_some() {
            let ev = self.forward(&plan.forward)?;
            self.s.on_event(ev).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Steps until the scheduler is idle; checks it is quiescent.
    pub fn run_to_idle(&mut self) -> Result<(), String> {
        for t in 0..10_000 {
            if self.s.is_idle() {
                self.s.next_execution_plan(t);
                return self.s.check();
            }
            self.step(t)?;
        }
        Err("not idle after 10,000 steps".into())
    }
}
