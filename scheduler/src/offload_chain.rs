//! The chains an [`OffloadManager`] accepts: a page hash names one prefix.
//!
//! Why: the tree matches page-hash lists on the premise that they are chains, each hash
//! covering its whole prefix: it indexes a node by its first hash only, and compares a run of
//! pages by its last one (`common_prefix`: if the last pages agree, every page before does).
//! The [`crate::Scheduler`] hashes its chains itself; the manager takes them from the engine.
//! A list that is not a chain — a hash repeated, or a hash that followed another page before
//! — broke the index (`check` failed right after) and matched pages the tree does not hold:
//! a load of `c, d, b, e` over a stored `c, d, a, e` handed out `a`'s slot for `b` (wrong KV).
//! So the manager refuses such lists ([`OffloadError::NotAChain`]).
//!
//! How: the parent of every page the manager handed a slot to, from the moment of
//! [`OffloadManager::prepare_store`] (so in-flight stores count too). A list is a chain when
//! each of its pages has one parent: the one recorded, and the same wherever the list
//! repeats it. Entries may outlive their pages (a page evicted keeps its entry until the
//! books are rebuilt from the tree, once they hold twice the host slots and 64 more): a
//! stale entry still names the page's one parent, so it never refuses a real chain, and the
//! books stay within `2 × host slots + 64` entries.
//!
//! [`OffloadManager`]: crate::OffloadManager
//! [`OffloadError::NotAChain`]: crate::OffloadError::NotAChain

use std::collections::HashMap;

use kvtier_radix::{KvEvent, PageHash, TierKind};

/// How much of a list [`ChainBooks::first_conflict`] compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Only its pages the books know: enough for a lookup or a load (a page the books do not
    /// know is in no tree, so the match stops before it).
    Known,
    /// Also its own repeats: what a store must pass before its pages are recorded.
    Whole,
}

/// The recorded parent of every page the manager knows (`None`: a first page).
#[derive(Debug, Default)]
pub(crate) struct ChainBooks {
    parents: HashMap<PageHash, Option<PageHash>>,
    /// Rebuild from the tree past this many entries.
    bound: usize,
}

impl ChainBooks {
    pub(crate) fn new(host_slots: u32) -> Self {
        ChainBooks {
            parents: HashMap::new(),
            bound: 2 * host_slots as usize + 64,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.parents.len()
    }

    /// The first page of `chain` with another parent than the books record for it (or, under
    /// [`Scope::Whole`], than it has where the list named it before).
    pub(crate) fn first_conflict(&self, chain: &[PageHash], scope: Scope) -> Option<usize> {
        let mut seen: HashMap<PageHash, Option<PageHash>> = HashMap::new();
        for (i, h) in chain.iter().enumerate() {
            let parent = i.checked_sub(1).map(|j| chain[j]);
            let before = match self.parents.get(h) {
                Some(p) => Some(*p),
                None if scope == Scope::Whole => seen.insert(*h, parent),
                None => None,
            };
            if before.is_some_and(|p| p != parent) {
                return Some(i);
            }
        }
        None
    }

    /// Records the parents of `chain[from..]` (checked with [`Scope::Whole`] before).
    pub(crate) fn record(&mut self, chain: &[PageHash], from: usize) {
        for i in from..chain.len() {
            let parent = i.checked_sub(1).map(|j| chain[j]);
            self.parents.insert(chain[i], parent);
        }
    }

    /// Past the bound: the books become what the tree holds on host (`resident`, the tree's
    /// own listing) and the pages of the stores in flight.
    pub(crate) fn prune<'a>(
        &mut self,
        resident: impl FnOnce() -> Vec<KvEvent>,
        in_flight: impl Iterator<Item = (&'a [PageHash], usize)>,
    ) {
        if self.parents.len() <= self.bound {
            return;
        }
        self.parents = host_pages(resident()).collect();
        for (chain, from) in in_flight {
            self.record(chain, from);
        }
    }

    /// Every page the tree holds on host is in the books with its parent.
    pub(crate) fn check(&self, resident: Vec<KvEvent>) -> Result<(), String> {
        for (h, p) in host_pages(resident) {
            if self.parents.get(&h) != Some(&p) {
                return Err(format!(
                    "chain books: host page {h:?} follows {p:?}, the books say {:?}",
                    self.parents.get(&h)
                ));
            }
        }
        Ok(())
    }
}

/// Every host page of the tree's listing (`RadixCache::resident_events`) with its parent.
fn host_pages(resident: Vec<KvEvent>) -> impl Iterator<Item = (PageHash, Option<PageHash>)> {
    resident.into_iter().flat_map(|ev| match ev {
        KvEvent::Stored {
            tier: TierKind::Host,
            parent,
            hashes,
            ..
        } => {
            let parents: Vec<_> = std::iter::once(parent)
                .chain(hashes.iter().map(|&h| Some(h)))
                .collect();
            hashes.into_iter().zip(parents).collect()
        }
        _ => Vec::new(),
    })
}
