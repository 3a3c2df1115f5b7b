//! The reference engine model: what an engine's KV pools hold after executing plans.
//!
//! Why it lives here, public: every executor kvtier tests itself with — the scheduler's test
//! engine, the simulator, the end-to-end tests — needs the same thing: device and host pools
//! whose pages hold a *content* (a page's identity: its chained hash, or a fingerprint of it),
//! each request's page table as the engine sees it (built from the plans' deltas), copies
//! applied the way the engine applies them, and a check that every page a forward reads holds
//! the content its position requires. Written once, the integrity oracle means the same thing
//! in every test; executors add only what is theirs (timing, failures, an L3 backend).
//!
//! `C` is the content type: `Option<PageHash>` (exact), `u64` fingerprints (compact, for
//! simulations of millions of pages); `C::default()` is "nothing complete".

use std::collections::HashMap;

use kvtier_radix::DevicePageId;

use crate::types::{OpSpec, PageTableDelta, RequestId, TierPages};

/// A page a forward read held other content than its position requires.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WrongPage {
    pub req: RequestId,
    /// Index in the request's page table.
    pub page: usize,
    /// The device page.
    pub device_page: u32,
}

/// Device and host pools of page contents, and each request's device page table.
#[derive(Clone, Debug)]
pub struct PageModel<C> {
    pub device: Vec<C>,
    pub host: Vec<C>,
    tables: HashMap<RequestId, Vec<DevicePageId>>,
}

impl<C: Copy + PartialEq + Default> PageModel<C> {
    pub fn new(device_pages: u32, host_pages: u32) -> PageModel<C> {
        PageModel {
            device: vec![C::default(); device_pages as usize],
            host: vec![C::default(); host_pages as usize],
            tables: HashMap::new(),
        }
    }

    /// The request's page table is void (it ended, or was retracted).
    pub fn forget(&mut self, req: RequestId) {
        self.tables.remove(&req);
    }

    /// Applies a row's page-table delta (`None`: unchanged).
    pub fn apply_delta(&mut self, req: RequestId, d: &Option<PageTableDelta>) {
        let t = self.tables.entry(req).or_default();
        if let Some(d) = d {
            t.truncate(d.from as usize);
            t.extend_from_slice(&d.pages);
        }
    }

    /// The request's page table as the engine holds it.
    pub fn table(&self, req: RequestId) -> &[DevicePageId] {
        self.tables.get(&req).map_or(&[], |t| &t[..])
    }

    /// Applies a `LoadBack` or `WriteBack` copy (other ops: nothing).
    pub fn copy(&mut self, spec: &OpSpec) {
        match spec {
            OpSpec::LoadBack { src, dst } => {
                for (a, b) in src.iter().zip(dst) {
                    self.device[b.index() as usize] = self.host[a.index() as usize];
                }
            }
            OpSpec::WriteBack { src, dst } => {
                for (a, b) in src.iter().zip(dst) {
                    self.host[b.index() as usize] = self.device[a.index() as usize];
                }
            }
            _ => {}
        }
    }

    /// Content of page `i` of `pages` (a prefetch's destination, a backup's source).
    pub fn get(&self, pages: &TierPages, i: usize) -> C {
        match pages {
            TierPages::Device(p) => self.device[p[i].index() as usize],
            TierPages::Host(p) => self.host[p[i].index() as usize],
        }
    }

    /// Sets page `i` of `pages`.
    pub fn set(&mut self, pages: &TierPages, i: usize, c: C) {
        match pages {
            TierPages::Device(p) => self.device[p[i].index() as usize] = c,
            TierPages::Host(p) => self.host[p[i].index() as usize] = c,
        }
    }

    /// Checks that table entries `from .. expected.len()` hold `expected[..]` (the oracle).
    pub fn check(&self, req: RequestId, from: usize, expected: &[C]) -> Result<usize, WrongPage> {
        let table = self.table(req);
        let mut n = 0;
        for (i, want) in expected.iter().enumerate().skip(from) {
            let Some(p) = table.get(i) else { break };
            if self.device[p.index() as usize] != *want {
                return Err(WrongPage {
                    req,
                    page: i,
                    device_page: p.index(),
                });
            }
            n += 1;
        }
        Ok(n)
    }

    /// A forward wrote table entries `from .. content.len()`.
    pub fn write(&mut self, req: RequestId, from: usize, content: &[C]) {
        let Some(table) = self.tables.get(&req) else {
            return;
        };
        for (p, c) in table.iter().zip(content).skip(from) {
            self.device[p.index() as usize] = *c;
        }
    }
}
