//! The bytes a node holds, by allocation id.
//!
//! Why: the master owns placement and frees; the node only keeps each allocation's bytes with
//! the tenant, key and token they were written for, so reads can check ownership and frees
//! can be applied by id. An evicted replica in offload-on-evict mode stays here, *staged*,
//! until its SSD copy is registered (then *retired* for one grace period, so a reader holding
//! its descriptor a moment longer still finds it). Freed buffers go to the node's
//! [`NodeRecycler`] for its next puts of the same size.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::error::{L3Error, L3Result};
use crate::types::Tenant;

use super::recycle::NodeRecycler;

pub(super) struct Held {
    pub(super) tenant: Tenant,
    pub(super) key: String,
    pub(super) token: u64,
    pub(super) data: Arc<[u8]>,
    pub(super) ended: bool,
    /// Evicted at the master, kept for its SSD write (offload-on-evict).
    pub(super) staged: Staging,
    pub(super) since: Instant,
}

/// Where an evicted-but-staged allocation stands.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Staging {
    /// A live replica (not evicted).
    No,
    /// Waiting for its SSD write; a master free does not drop it.
    Writing,
    /// Written (or failed): dropped at the first tick after `since` plus a ping period,
    /// so a reader holding its descriptor a moment longer still finds it.
    Retired,
}

pub(super) struct Mem {
    pub(super) allocs: HashMap<u64, Held>,
    /// Bytes of live replicas (staged bytes are bounded by the SSD queue and the grace
    /// period instead: they must not make puts fail while they drain).
    pub(super) used: u64,
    /// (tenant, key, token) → allocation of staged bytes.
    pub(super) staged: HashMap<(Tenant, String, u64), u64>,
    /// Freed buffers kept for later puts.
    pub(super) recycled: NodeRecycler,
}

impl Mem {
    /// An empty memory whose freed buffers go to `recycled`.
    pub(super) fn new(recycled: NodeRecycler) -> Self {
        Mem {
            allocs: HashMap::new(),
            used: 0,
            staged: HashMap::new(),
            recycled,
        }
    }

    pub(super) fn drop_alloc(&mut self, alloc: u64) {
        if let Some(h) = self.allocs.remove(&alloc) {
            if h.staged == Staging::No {
                self.used = self.used.saturating_sub(h.data.len() as u64);
            } else {
                self.staged.remove(&(h.tenant, h.key, h.token));
            }
            self.recycled.keep(h.data, self.used);
        }
    }

    /// Whether `alloc` holds the bytes of the put (`t`, `key`, `token`), ended or not.
    pub(super) fn holds(&self, alloc: u64, t: &Tenant, key: &str, token: u64) -> bool {
        self.allocs
            .get(&alloc)
            .is_some_and(|e| e.token == token && e.tenant == *t && e.key == key)
    }

    /// Holds the bytes of an unended put under `alloc` (replacing an unended earlier write
    /// of it, or an unended write of an older put: see below), with `cap` the most live
    /// bytes a node holds. Returns the buffers released (beyond the recycler's bound) for
    /// the caller to drop outside its lock. Refused: the allocation is ended already (-705
    /// when by this very put: its replica is complete; -601 when by another put), holds the
    /// unended bytes of a put with a token at least this one's (-601), or `cap` would be
    /// passed; the bytes are then recycled.
    ///
    /// Two puts' writes to one allocation: one master never gives an id out twice, so one of
    /// them was placed by a master since replaced (restarted, with or without its state
    /// dir: same epoch, ids counted from 1 again), and put tokens grow across such restarts
    /// (`TokensBelow`; without a state dir, a clock floor: `cluster/durable.rs`), so the
    /// newer put is the one with the higher token. The older one's late write must
    /// not replace the newer one's bytes: this node may have checked them for the newer
    /// put's end, sent to the master, and marks the allocation ended on its answer
    /// (`tests/reused_alloc.rs`: before, the key was then read with the late put's bytes).
    pub(super) fn write(&mut self, alloc: u64, h: Held, cap: u64) -> L3Result<Vec<Arc<[u8]>>> {
        let size = h.data.len() as u64;
        let same_put = |e: &Held| e.token == h.token && e.tenant == h.tenant && e.key == h.key;
        let prev = match self.allocs.get(&alloc) {
            Some(e) if e.ended && same_put(e) => Err(L3Error::ObjectAlreadyExists),
            Some(e) if !e.ended && !same_put(e) && e.token >= h.token => {
                Err(L3Error::IllegalClient(
                    "the allocation holds a newer put's bytes: this put was placed by a master \
                     since replaced; put it again"
                        .into(),
                ))
            }
            // Another put's ended bytes: one master never gives an allocation id out twice,
            // so this handle was placed by a master since replaced (the id given out again).
            // Not -705, which a client takes for its own put's object being complete.
            Some(e) if e.ended => Err(L3Error::IllegalClient(
                "the allocation holds another put's bytes: the put was placed by a master \
                 since replaced; put it again"
                    .into(),
            )),
            Some(e) => Ok(e.data.len() as u64),
            None => Ok(0),
        };
        let used = prev.map(|p| self.used.saturating_sub(p));
        let used = used.and_then(|u| match u + size > cap {
            true => Err(L3Error::NoAvailableHandle { needed: size }),
            false => Ok(u),
        });
        let used = match used {
            Ok(u) => u,
            Err(e) => {
                self.recycled.keep(h.data, self.used);
                return Err(e);
            }
        };
        self.used = used + size;
        let mut out = self.recycled.fit(self.used);
        if let Some(old) = self.allocs.insert(alloc, h) {
            out.extend(self.recycled.keep(old.data, self.used));
        }
        Ok(out)
    }

    /// The staged bytes of this object version are done with (written or failed).
    pub(super) fn retire(&mut self, t: &Tenant, key: &str, token: u64) {
        if let Some(a) = self.staged.get(&(t.clone(), key.to_string(), token))
            && let Some(h) = self.allocs.get_mut(a)
        {
            h.staged = Staging::Retired;
            h.since = Instant::now();
        }
    }

    /// Empties the memory for a remount and returns the replicas to report to the master
    /// (`Retained`): the ended, live ones. Puts never ended and staged bytes are dropped
    /// (the mount cancels staged writes; an unended put is no version anybody saw).
    pub(super) fn take_retained(&mut self) -> Vec<Held> {
        let recycled = std::mem::replace(
            &mut self.recycled,
            NodeRecycler::new(0, 0, std::time::Duration::ZERO),
        );
        let all = std::mem::replace(self, Mem::new(recycled));
        all.allocs
            .into_values()
            .filter(|h| h.ended && h.staged == Staging::No)
            .collect()
    }

    /// Stages the ended, live replica under `alloc` for its SSD write (offload-on-evict):
    /// its bytes stop counting as live. Returns its version and bytes; `None` when there is
    /// no such replica.
    pub(super) fn stage(&mut self, alloc: u64) -> Option<(Tenant, String, u64, Arc<[u8]>)> {
        let h = self.allocs.get_mut(&alloc)?;
        if !h.ended || h.staged != Staging::No {
            return None;
        }
        h.staged = Staging::Writing;
        let (t, k, tok, data) = (h.tenant.clone(), h.key.clone(), h.token, h.data.clone());
        self.used = self.used.saturating_sub(data.len() as u64);
        self.staged.insert((t.clone(), k.clone(), tok), alloc);
        Some((t, k, tok, data))
    }

    /// Keeps the promoted bytes `h` (ended, live) under the allocation the master gave the
    /// promotion. Returns the buffers released, for the caller to drop outside its lock.
    ///
    /// The master gave that id to this promotion, so whatever the node still holds under it
    /// is dropped first, as by a free: a stale unended write of a put placed by a master
    /// since replaced (ids counted from 1 again) stops counting as live, and staged bytes
    /// leave the staged index, so their retirement never names the promoted replica. Until
    /// 2026-12-07 the bytes were inserted over them: the stale write's bytes stayed in
    /// `used` for good (the node's capacity slowly lost), and a retirement dropped the
    /// promoted replica.
    pub(super) fn promoted(&mut self, alloc: u64, h: Held) -> Vec<Arc<[u8]>> {
        self.drop_alloc(alloc);
        self.used += h.data.len() as u64;
        self.allocs.insert(alloc, h);
        self.recycled.fit(self.used)
    }

    /// Keeps the bytes of an adopted replica under the allocation the master gave it.
    pub(super) fn adopt(&mut self, alloc: u64, h: Held) {
        self.used += h.data.len() as u64;
        if let Some(old) = self.allocs.insert(alloc, h) {
            self.used = self.used.saturating_sub(old.data.len() as u64);
            self.recycled.keep(old.data, self.used);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(key: &str, ended: bool, staged: Staging) -> Held {
        Held {
            tenant: Tenant::new("a").unwrap(),
            key: key.into(),
            token: 1,
            data: Arc::from(vec![7u8; 10]),
            ended,
            staged,
            since: Instant::now(),
        }
    }

    /// An ended allocation refuses a write: -705 for the same put (its replica is complete),
    /// -601 for another put's handle naming it (an id a replaced master gave out again),
    /// never -705, which a client takes for its own put's object being complete. Nothing
    /// held changes either way.
    #[test]
    fn a_write_to_an_ended_allocation_says_whose_bytes_it_holds() {
        let mut m = Mem::new(NodeRecycler::new(100, 0, std::time::Duration::ZERO));
        m.write(1, held("k", false, Staging::No), 1000).unwrap();
        m.allocs.get_mut(&1).unwrap().ended = true;
        let again = m.write(1, held("k", false, Staging::No), 1000);
        assert_eq!(again.err(), Some(L3Error::ObjectAlreadyExists));
        let mut other_token = held("k", false, Staging::No);
        other_token.token = 2;
        let mut other_key = held("j", false, Staging::No);
        other_key.data = Arc::from(vec![9u8; 10]);
        for h in [other_token, other_key] {
            let r = m.write(1, h, 1000);
            assert!(matches!(r, Err(L3Error::IllegalClient(_))), "{r:?}");
        }
        assert_eq!(m.used, 10);
        assert_eq!(&m.allocs[&1].data[..], &[7u8; 10][..]);
        assert!(m.allocs[&1].ended && m.allocs[&1].token == 1);
    }

    /// One put's write, its token and key, the bytes a token byte.
    fn put(token: u64, key: &str) -> Held {
        let mut h = held(key, false, Staging::No);
        h.token = token;
        h.data = Arc::from(vec![token as u8; 10]);
        h
    }

    /// A late write of an older put (lower token: placed by a master since restarted, the
    /// id given out again) never replaces a newer put's unended bytes; a newer put's write
    /// replaces an older one's; the same put writes again.
    #[test]
    fn a_late_write_of_an_older_put_never_replaces_a_newer_ones_bytes() {
        let mut m = Mem::new(NodeRecycler::new(100, 0, std::time::Duration::ZERO));
        m.write(1, put(5, "k"), 1000).unwrap();
        for late in [put(3, "k"), put(3, "j"), put(5, "j")] {
            let r = m.write(1, late, 1000);
            assert!(matches!(r, Err(L3Error::IllegalClient(_))), "{r:?}");
        }
        assert!(m.holds(1, &Tenant::new("a").unwrap(), "k", 5));
        assert_eq!(&m.allocs[&1].data[..], &[5u8; 10][..]);
        m.write(1, put(5, "k"), 1000).unwrap();
        m.write(1, put(8, "j"), 1000).unwrap();
        assert!(m.holds(1, &Tenant::new("a").unwrap(), "j", 8));
        assert_eq!(m.used, 10);
    }

    proptest::proptest! {
        /// Whatever order puts' writes (and ends) reach one allocation in: what it holds is
        /// always the bytes of the put it says (token, key), its token never goes down, and
        /// ended bytes never change.
        #[test]
        fn an_allocation_holds_its_newest_puts_own_bytes(
            ops in proptest::collection::vec((1u64..6, 0usize..2, proptest::bool::ANY), 1..40),
        ) {
            let keys = ["k", "j"];
            let mut m = Mem::new(NodeRecycler::new(100, 0, std::time::Duration::ZERO));
            let mut top = 0;
            for (token, key, end) in ops {
                let before = m.allocs.get(&1).map(|e| (e.token, e.ended));
                let _ = m.write(1, put(token, keys[key]), 1000);
                if end && let Some(e) = m.allocs.get_mut(&1) {
                    e.ended = true;
                }
                let e = &m.allocs[&1];
                proptest::prop_assert!(e.data.iter().all(|&b| u64::from(b) == e.token));
                proptest::prop_assert!(e.token >= top);
                if let Some((t, true)) = before {
                    proptest::prop_assert_eq!(e.token, t);
                }
                top = e.token;
                proptest::prop_assert_eq!(m.used, 10);
            }
        }
    }

    /// The bytes counted as live: those of every allocation not staged.
    fn live_bytes(m: &Mem) -> u64 {
        m.allocs
            .values()
            .filter(|h| h.staged == Staging::No)
            .map(|h| h.data.len() as u64)
            .sum()
    }

    /// A promotion given an allocation id that holds a stale unended write (a put placed by
    /// a master since restarted, its id given out again) replaces those bytes: they stop
    /// counting as live, so its free leaves nothing counted (before, the stale write's bytes
    /// stayed in `used` for good: capacity lost, puts refused -200 early).
    #[test]
    fn a_promotion_over_a_stale_unended_write_counts_only_its_own_bytes() {
        let mut m = Mem::new(NodeRecycler::new(100, 0, std::time::Duration::ZERO));
        m.write(1, put(3, "stale"), 1000).unwrap();
        let mut p = put(9, "hot");
        p.ended = true;
        p.data = Arc::from(vec![9u8; 25]);
        drop(m.promoted(1, p));
        assert!(m.holds(1, &Tenant::new("a").unwrap(), "hot", 9));
        assert_eq!(m.used, 25);
        m.drop_alloc(1);
        assert_eq!(m.used, 0);
    }

    /// A promotion given the id of staged bytes (evicted, waiting for their SSD write) keeps
    /// its replica live: the staged version's retirement no longer names that allocation,
    /// and the promoted bytes count as live until freed.
    #[test]
    fn a_promotion_over_staged_bytes_is_never_retired_with_them() {
        let mut m = Mem::new(NodeRecycler::new(100, 0, std::time::Duration::ZERO));
        m.write(1, put(3, "old"), 1000).unwrap();
        m.allocs.get_mut(&1).unwrap().ended = true;
        assert!(m.stage(1).is_some());
        assert_eq!(m.used, 0);
        let mut p = put(9, "hot");
        p.ended = true;
        drop(m.promoted(1, p));
        m.retire(&Tenant::new("a").unwrap(), "old", 3);
        assert!(
            m.allocs[&1].staged == Staging::No,
            "the promoted replica was retired"
        );
        assert_eq!(m.used, 10);
        assert!(m.staged.is_empty());
        m.drop_alloc(1);
        assert_eq!(m.used, 0);
    }

    proptest::proptest! {
        /// Whatever puts' writes, ends, promotions, evictions (staging for the SSD, its
        /// retirement), frees and stale-write drops do, in any order over a few reused
        /// allocation ids: the live count equals the bytes of the live allocations held, and
        /// the staged index names exactly the staged allocations (their own versions).
        #[test]
        fn the_live_count_is_the_bytes_held(
            ops in proptest::collection::vec(
                (0u8..7, 1u64..4, 1u64..16, 0usize..3, 1usize..40),
                1..60,
            ),
        ) {
            let keys = ["k", "j", "i"];
            let a = Tenant::new("a").unwrap();
            let mut m = Mem::new(NodeRecycler::new(100, 0, std::time::Duration::ZERO));
            for (op, alloc, token, key, len) in ops {
                // One version is held under one allocation of a node (a put writes its own;
                // a promotion is of an SSD-only key): the token names its allocation too.
                let token = token * 4 + alloc;
                let mut h = put(token, keys[key]);
                h.data = Arc::from(vec![token as u8; len]);
                match op {
                    // A put's write (cap large: never the reason for a refusal here).
                    0 => drop(m.write(alloc, h, 1 << 20)),
                    // Its end (the master's answer).
                    1 => if let Some(e) = m.allocs.get_mut(&alloc) {
                        e.ended = true;
                    },
                    // A promotion given this id.
                    2 => {
                        h.ended = true;
                        drop(m.promoted(alloc, h));
                    }
                    // Evicted at the master, offload-on-evict: staged.
                    3 => drop(m.stage(alloc)),
                    // An SSD write of this version done (registered or failed).
                    4 => m.retire(&a, keys[key], token),
                    // The master's free (a staged allocation's is applied by its write).
                    5 => if m.allocs.get(&alloc).is_some_and(|h| h.staged == Staging::No) {
                        m.drop_alloc(alloc);
                    },
                    // A tick: stale unended writes and retired bytes dropped.
                    _ => if m.allocs.get(&alloc).is_some_and(|h| !h.ended || h.staged == Staging::Retired) {
                        m.drop_alloc(alloc);
                    },
                }
                proptest::prop_assert_eq!(m.used, live_bytes(&m));
                for ((t, k, tok), al) in &m.staged {
                    let h = m.allocs.get(al);
                    proptest::prop_assert!(h.is_some_and(|h| h.staged != Staging::No
                        && h.token == *tok && h.tenant == *t && h.key == *k));
                }
                let staged = m.allocs.values().filter(|h| h.staged != Staging::No).count();
                proptest::prop_assert_eq!(staged, m.staged.len());
            }
        }
    }

    /// A remount reports only ended, live replicas: a put never ended and staged bytes are
    /// freed, not offered for adoption; the memory is empty until the master answers.
    #[test]
    fn a_remount_reports_only_ended_live_replicas() {
        let mut m = Mem::new(NodeRecycler::new(100, 0, std::time::Duration::ZERO));
        for (a, h) in [
            (1, held("done", true, Staging::No)),
            (2, held("unended", false, Staging::No)),
            (3, held("staged", true, Staging::Writing)),
            (4, held("retired", true, Staging::Retired)),
        ] {
            if h.staged == Staging::No {
                m.used += h.data.len() as u64;
            }
            m.allocs.insert(a, h);
        }
        let kept = m.take_retained();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].key, "done");
        assert!(m.allocs.is_empty() && m.used == 0);
        let h = kept.into_iter().next().unwrap();
        m.adopt(9, h);
        assert_eq!(m.used, 10);
        assert!(m.allocs.contains_key(&9));
    }
}
