//! Store/remove events of cached pages, for an external KV-aware router.
//!
//! Why: a router that sends each request to the engine instance holding most of its prefix
//! needs to know which pages each instance caches. The cache records an event whenever a node
//! gains or loses a copy on a tier; the scheduler drains them and the engine publishes them
//! (the shape follows the BlockStored/BlockRemoved events of vLLM and Dynamo).

use serde::Serialize;

use crate::hash::PageHash;
use crate::tier::TierKind;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum KvEvent {
    /// `hashes` (consecutive pages, following `parent`) now have a copy on `tier`.
    Stored {
        tier: TierKind,
        parent: Option<PageHash>,
        hashes: Vec<PageHash>,
    },
    /// `hashes` no longer have a copy on `tier`.
    Removed {
        tier: TierKind,
        hashes: Vec<PageHash>,
    },
}
