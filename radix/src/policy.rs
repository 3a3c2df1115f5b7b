//! Eviction policies: how a tier ranks its evictable leaves.
//!
//! Why more than LRU: on the public conversation trace, 76 % of the prefix blocks a prompt
//! brings are never read again, while a block's chance of another read grows with the reads
//! it has had (24 % after the first, 42 % after the second, 58 % after the fourth, 75 % after
//! five or more), and the deep pages of long prompts are read again less often than the
//! shallow ones. LRU ranks a never-reused tail of a long one-off prompt like the prefix of a
//! live conversation; [`EvictionPolicy::FrequencyDepth`] credits each read and debits depth.
//!
//! How: a policy is only a *rank* for each evictable leaf (lowest evicted first, ties broken
//! by the node's creation sequence, then its id: the same on every tensor-parallel rank). The
//! leaf-first structure, locks and pools are untouched, so every invariant of the tree holds
//! for every policy (the model tests run them all). Ranks use a traffic clock: pages given to
//! the device tier so far (computed or loaded), which advances with the work the engine does
//! and not with how often a blocked request is matched again.

use serde::{Deserialize, Serialize};

use crate::node::Node;
use crate::tier::TierKind;

/// How each tier ranks its evictable leaves (lowest rank evicted first).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum EvictionPolicy {
    /// Least recently used first.
    #[default]
    Lru,
    /// Recency on the traffic clock, plus `use_credit_pages` for each distinct match through
    /// the node (at most `max_credited_uses`), minus `depth_debit_per_page` for each page of
    /// the node's end depth. Uses outlive eviction: a page computed again starts with the uses
    /// it had when it left the cache, plus one (`memory.rs`).
    FrequencyDepth {
        use_credit_pages: u64,
        max_credited_uses: u32,
        depth_debit_per_page: u64,
    },
    /// Learns online how much of [`EvictionPolicy::CONVERSATION`]'s credit and debit to use,
    /// from LRU (none) to all of it, by which kind of evicted leaf later misses hit (ghost
    /// lists, see `adaptive.rs`).
    Adaptive,
    /// Follows whichever fixed option (LRU or the conversation setting of freq-depth, each
    /// with copies at finish or demotion) hits most in metadata-only shadow caches fed the
    /// same requests, switching on a significant lead at fixed request counts (`shadow/`).
    Shadow,
}

/// `"lru"`, `"adaptive"`, `"shadow"`, `"freq-depth"` (the conversation setting) or
/// `"freq-depth:CREDIT_PAGES:MAX_USES:DEBIT_PER_PAGE"` — the spelling of the CLI, TOML-free
/// configs and Python.
impl std::str::FromStr for EvictionPolicy {
    type Err = String;

    fn from_str(e: &str) -> Result<EvictionPolicy, String> {
        let parts: Vec<&str> = e.split(':').collect();
        let num = |s: &str| {
            s.parse::<u64>()
                .map_err(|_| format!("bad number `{s}` in eviction policy `{e}`"))
        };
        Ok(match parts.as_slice() {
            ["lru"] => EvictionPolicy::Lru,
            ["adaptive"] => EvictionPolicy::Adaptive,
            ["shadow"] => EvictionPolicy::Shadow,
            ["freq-depth"] => EvictionPolicy::CONVERSATION,
            ["freq-depth", c, m, d] => EvictionPolicy::FrequencyDepth {
                use_credit_pages: num(c)?,
                max_credited_uses: u32::try_from(num(m)?)
                    .map_err(|_| format!("max uses `{m}` too large"))?,
                depth_debit_per_page: num(d)?,
            },
            _ => return Err(format!("unknown eviction policy `{e}`")),
        })
    }
}

impl std::fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EvictionPolicy::Lru => f.write_str("lru"),
            EvictionPolicy::Adaptive => f.write_str("adaptive"),
            EvictionPolicy::Shadow => f.write_str("shadow"),
            EvictionPolicy::FrequencyDepth {
                use_credit_pages,
                max_credited_uses,
                depth_debit_per_page,
            } => write!(
                f,
                "freq-depth:{use_credit_pages}:{max_credited_uses}:{depth_debit_per_page}"
            ),
        }
    }
}

impl EvictionPolicy {
    /// The setting measured best on the conversation trace (see docs/sim.md): a read is worth
    /// about 300 requests' worth of traffic (56K pages of 64 tokens), at most four are
    /// credited, and each page of depth costs 60 pages of traffic.
    pub const CONVERSATION: EvictionPolicy = EvictionPolicy::FrequencyDepth {
        use_credit_pages: 56_000,
        max_credited_uses: 4,
        depth_debit_per_page: 60,
    };

    /// Whether ranks under this policy (or, for the learnt ones, under some option they may
    /// choose) count uses, so that the cache remembers the uses of evicted pages
    /// (`memory.rs`).
    pub fn reads_uses(&self) -> bool {
        !matches!(self, EvictionPolicy::Lru)
    }

    /// The node's rank on tier `t` under this policy (a copy made for `t` after the node's
    /// last use counts as a use on `t` only: see `TierSlot::copied_at`).
    pub(crate) fn rank(&self, n: &Node, t: TierKind) -> u64 {
        let (copied_tick, copied_traffic) = n.slot(t).copied_at;
        self.rank_of(
            n.last_access.max(copied_tick),
            n.last_use.max(copied_traffic),
            n.uses,
            n.end() as u64,
        )
    }

    /// The rank of an entry from its counters, for caches that are not a `RadixCache` (an
    /// engine's own host cache ranked by kvtier's policy): `last_access` on the access
    /// clock (LRU), `last_use` on the traffic clock, `uses` distinct uses, `end_pages` the
    /// entry's end depth in pages. Lowest is evicted first.
    pub fn rank_of(&self, last_access: u64, last_use: u64, uses: u32, end_pages: u64) -> u64 {
        match *self {
            // The learnt policies rank by their current choice (`RadixCache::ranking`); this
            // arm is that of their start (LRU).
            EvictionPolicy::Lru | EvictionPolicy::Adaptive | EvictionPolicy::Shadow => last_access,
            EvictionPolicy::FrequencyDepth {
                use_credit_pages,
                max_credited_uses,
                depth_debit_per_page,
            } => {
                let credit =
                    u64::from(uses.min(max_credited_uses)).saturating_mul(use_credit_pages);
                let debit = u128::from(end_pages) * u128::from(depth_debit_per_page);
                // Offset by (more than) the largest possible debit so that deep nodes keep
                // their order instead of all saturating at zero.
                let offset = (u128::from(u32::MAX) * 2).saturating_mul(depth_debit_per_page.into());
                let ranked =
                    (u128::from(last_use) + u128::from(credit) + offset).saturating_sub(debit);
                u64::try_from(ranked).unwrap_or(u64::MAX)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// `rank_of` is the radix tree's rank: LRU is the access clock; freq-depth rises
        /// with recency and with credited uses (up to the cap) and falls with depth.
        #[test]
        fn rank_of_orders_as_documented(a in 0u64..1 << 40, l in 0u64..1 << 40, u in 0u32..8, e in 0u64..1 << 20) {
            prop_assert_eq!(EvictionPolicy::Lru.rank_of(a, l, u, e), a);
            let p = EvictionPolicy::CONVERSATION;
            prop_assert!(p.rank_of(a, l + 1, u, e) > p.rank_of(a, l, u, e));
            prop_assert!(p.rank_of(a, l, u, e + 1) < p.rank_of(a, l, u, e));
            let more = p.rank_of(a, l, u + 1, e);
            if u < 4 { prop_assert!(more > p.rank_of(a, l, u, e)); } else { prop_assert_eq!(more, p.rank_of(a, l, u, e)); }
        }
    }
}
