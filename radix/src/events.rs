//! Store/remove events of cached pages, for an external KV-aware router.
//!
//! Why: a router that sends each request to the engine instance holding most of its prefix
//! needs to know which pages each instance caches. The cache records an event whenever a node
//! gains or loses a copy on a tier; the scheduler drains them and the engine publishes them
//! (the shape follows the BlockStored/BlockRemoved events of vLLM and Dynamo).

use std::sync::Arc;

use serde::Serialize;

use crate::hash::PageHash;
use crate::tier::TierKind;

/// Whose prefix a cached page belongs to: the cache salt (tenant) and adapter of the requests
/// that computed it (`None` for both: the shared, unscoped prefix space). Page hashes of
/// different labels never collide (see [`crate::HashScope`]); the label tells a router or a
/// quota *which* space a page is in without recomputing hashes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct ScopeLabel {
    pub cache_salt: Option<String>,
    pub adapter: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum KvEvent {
    /// `hashes` (consecutive pages, following `parent`) now have a copy on `tier`.
    Stored {
        tier: TierKind,
        parent: Option<PageHash>,
        hashes: Vec<PageHash>,
        /// The pages' token ids, `hashes.len() * page_size` of them (vLLM's `BlockStored`
        /// carries them: routers that hash tokens themselves, like Dynamo's, index by them).
        tokens: Vec<u32>,
        /// The scope the pages belong to (`None`: unscoped).
        label: Option<Arc<ScopeLabel>>,
    },
    /// `hashes` no longer have a copy on `tier`.
    Removed {
        tier: TierKind,
        hashes: Vec<PageHash>,
        label: Option<Arc<ScopeLabel>>,
    },
}

impl crate::RadixCache {
    /// Every copy the cache holds now, as `Stored` events a subscriber can replay from an empty
    /// index: per tier, parents before children (by depth, then creation), one event per node.
    /// What a router that starts late (or restarts) asks for instead of the history it missed.
    pub fn resident_events(&self) -> Vec<KvEvent> {
        let mut out = Vec::new();
        for tier in [TierKind::Device, TierKind::Host] {
            let mut ids: Vec<_> = self
                .nodes
                .iter()
                .filter(|(_, n)| n.parent.is_some() && n.slot(tier).pages.is_some())
                .map(|(id, n)| (n.start, n.seq, id))
                .collect();
            ids.sort_unstable();
            for (_, _, id) in ids {
                let n = &self.nodes[id];
                out.push(KvEvent::Stored {
                    tier,
                    parent: n.parent.and_then(|p| self.nodes[p].hashes.last().copied()),
                    hashes: n.hashes.to_vec(),
                    tokens: n.tokens.clone(),
                    label: n.label.clone(),
                });
            }
        }
        out
    }
}
