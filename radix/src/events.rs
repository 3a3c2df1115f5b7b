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
    /// Forget every copy this cache was said to hold: the events since the last drain passed
    /// their cap and were discarded ([`EventLog`]), so the `Stored` events that follow in the
    /// same drain (every copy held now) are the cache's whole state. vLLM's `AllBlocksCleared`.
    Cleared,
}

/// The events recorded since the last drain, bounded.
///
/// Why: the cache records an event for every copy gained or lost, and only a drain frees
/// them. An engine that turned events on but drains them late, or never (a router not
/// started yet, a publisher thread that died), would otherwise grow the log without bound:
/// about 36 bytes a page at 1-token pages, 290 at 64-token pages (hash and tokens), every
/// time a page is cached. Past `cap_bytes` the log drops what it holds and records nothing
/// more; the next drain answers [`KvEvent::Cleared`] and the cache's resident copies
/// instead, which leave a subscriber exactly where the full history would have (a resync,
/// as after a missed batch). So a slow consumer costs a snapshot, never memory or
/// correctness.
#[derive(Debug, Default)]
pub(crate) struct EventLog {
    events: Vec<KvEvent>,
    /// Estimated bytes `events` holds (`KvEvent::approx_bytes`).
    bytes: usize,
    /// `None`: unbounded (the caller drains every step: an `OffloadManager`).
    cap_bytes: Option<usize>,
    overflowed: bool,
}

impl KvEvent {
    /// What the event holds, roughly: its hashes and tokens and a fixed part.
    fn approx_bytes(&self) -> usize {
        const FIXED: usize = 64;
        let hash = std::mem::size_of::<PageHash>();
        FIXED
            + match self {
                KvEvent::Stored { hashes, tokens, .. } => {
                    hashes.len() * hash + tokens.len() * std::mem::size_of::<u32>()
                }
                KvEvent::Removed { hashes, .. } => hashes.len() * hash,
                KvEvent::Cleared => 0,
            }
    }
}

impl EventLog {
    pub(crate) fn set_cap_bytes(&mut self, cap: Option<usize>) {
        self.cap_bytes = cap;
        self.check_cap();
    }

    pub(crate) fn push(&mut self, ev: KvEvent) {
        if self.overflowed {
            return; // the next drain answers the resident state instead
        }
        self.bytes += ev.approx_bytes();
        self.events.push(ev);
        self.check_cap();
    }

    fn check_cap(&mut self) {
        if self.cap_bytes.is_some_and(|cap| self.bytes > cap) {
            self.events = Vec::new();
            self.bytes = 0;
            self.overflowed = true;
        }
    }

    /// Bytes held now (estimated), at most the cap.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The recorded events, or `None` if they overflowed (the caller answers the resident
    /// state); the log is empty and recording again afterwards.
    fn take(&mut self) -> Option<Vec<KvEvent>> {
        self.bytes = 0;
        let events = std::mem::take(&mut self.events);
        (!std::mem::replace(&mut self.overflowed, false)).then_some(events)
    }
}

impl crate::RadixCache {
    /// Takes the recorded router events: what changed since the last call, or, if that
    /// passed the log's cap ([`crate::RadixCache::set_events_cap_bytes`]), [`KvEvent::Cleared`]
    /// and every copy held now ([`crate::RadixCache::resident_events`]).
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        match self.events.take() {
            Some(events) => events,
            None => {
                let mut out = vec![KvEvent::Cleared];
                out.extend(self.resident_events());
                out
            }
        }
    }

    /// Caps the events held between drains at about `cap` bytes (`None`: no cap). Past it,
    /// the next drain answers a resync instead of the history ([`EventLog`]).
    pub fn set_events_cap_bytes(&mut self, cap: Option<usize>) {
        self.events.set_cap_bytes(cap);
    }

    /// Bytes the events recorded since the last drain hold (estimated; at most the cap).
    pub fn pending_event_bytes(&self) -> usize {
        self.events.bytes()
    }

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
