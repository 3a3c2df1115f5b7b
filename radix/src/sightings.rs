//! The second-sighting admission filter of the adaptive policy: which prompts came back
//! after their pages had left the tree.
//!
//! Why: on the conversation trace 76 % of blocks are never read again, and every host copy of
//! one of them pushes out a page that would have been. A cache that admits a page to a lower
//! tier only when it has seen it twice (TinyLFU's doorkeeper, 2Q's A1out) keeps one-off pages
//! out. "Twice" is either a leaf matched since it was written, or a leaf written by a prompt
//! that stopped at a ghost (its pages had been evicted and were asked for again): those
//! hashes are kept here.
//!
//! How: a ghost hit records the hash at which the prompt stopped with the traffic clock; a
//! sighting lives for one capacity of traffic (sized in time, as the ghosts are) and at most
//! one capacity of sightings is kept (the oldest go first), so the state is bounded by the
//! cache's size and driven only by the cache's operations, in their order (deterministic
//! across tensor-parallel ranks).

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use crate::cache::PrefixHasher;
use crate::hash::PageHash;

/// Hashes at which a prompt hit a ghost, each with the traffic at that time.
#[derive(Debug, Clone)]
pub(crate) struct Sightings {
    order: VecDeque<(u64, PageHash)>,
    /// Hash → traffic of its latest sighting; a queue entry with another traffic is stale.
    live: HashMap<PageHash, u64, BuildHasherDefault<PrefixHasher>>,
    /// Traffic a sighting lives for, and most sightings kept.
    capacity: u64,
}

impl Sightings {
    pub(crate) fn new(capacity: u64) -> Self {
        Sightings {
            order: VecDeque::new(),
            live: HashMap::default(),
            capacity: capacity.max(1),
        }
    }

    /// A prompt stopped at the ghost `h`: pages written from `h` on are a second sighting.
    pub(crate) fn record(&mut self, h: PageHash, traffic: u64) {
        self.expire(traffic);
        while self.order.len() as u64 >= self.capacity {
            self.pop_oldest();
        }
        self.order.push_back((traffic, h));
        self.live.insert(h, traffic);
    }

    /// Whether `h` was sighted again within one capacity of traffic before `traffic`.
    pub(crate) fn contains(&self, h: &PageHash, traffic: u64) -> bool {
        self.live
            .get(h)
            .is_some_and(|&t| traffic.saturating_sub(t) <= self.capacity)
    }

    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    fn expire(&mut self, traffic: u64) {
        while let Some(&(t, _)) = self.order.front() {
            if traffic.saturating_sub(t) <= self.capacity {
                break;
            }
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if let Some((t, h)) = self.order.pop_front()
            && self.live.get(&h) == Some(&t)
        {
            self.live.remove(&h);
        }
    }

    /// At most one capacity queued, every live sighting queued.
    pub(crate) fn check_bounds(&self) -> Result<(), String> {
        if self.order.len() as u64 > self.capacity || self.live.len() > self.order.len() {
            return Err(format!(
                "{} sightings live, {} queued, bound {}",
                self.live.len(),
                self.order.len(),
                self.capacity
            ));
        }
        Ok(())
    }
}
