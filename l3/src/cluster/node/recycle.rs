//! The store node's freed object buffers, kept for its next puts of the same size.
//!
//! Why: a node copies every put into a buffer of its own. A fresh 8 MiB buffer page-faults
//! its memory in on that copy (see [`crate::buffers`]), and a node reuses memory at the pace
//! of its clients' put / remove cycles; measured (docs/l3-bench.md, *Store nodes over shared
//! memory*) node puts ran at 0.29–0.50× of embedded ones while the embedded store and the
//! `--role both` server recycle. This is the same [`Recycler`], with the node's bound.
//!
//! Bound: a node has no free capacity of its own to measure against (the master allocates;
//! the node hears of frees late, and holds up to twice its segment meanwhile), so what is
//! kept is at most [`SHARE_DIV`]⁻¹ of the segment *and* at most the segment minus the live
//! bytes: live plus recycled never exceed the segment while live bytes fit in it. A buffer
//! freed beyond that is released; a put that grows the live bytes trims what is kept. Once
//! the node has been idle for `idle_after` the recycler is cut to `keep_idle` and free
//! heap pages are returned to the system, once per idle period ([`IdleTrim`]).
//!
//! Safety: only buffers nobody else holds are kept (a reader's or an SSD job's clone keeps
//! it out), and a kept buffer is handed only to a put of exactly its size, which overwrites
//! it whole ([`crate::buffers::fill`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::buffers::{self, IdleTrim, Recycler};

use super::mem::Mem;

/// Kept buffers never exceed the segment divided by this.
pub(super) const SHARE_DIV: u64 = 2;

/// Freed buffers of a node, bounded by its segment (see the module docs).
#[derive(Debug)]
pub(super) struct NodeRecycler {
    kept: Recycler,
    segment: u64,
    keep_idle: u64,
    idle: IdleTrim,
    /// Moves with every put and free (the idle test).
    activity: u64,
}

impl NodeRecycler {
    /// A recycler for a node of `segment` bytes; `keep_idle` bytes stay kept once the node
    /// has been idle for `idle_after`.
    pub(super) fn new(segment: u64, keep_idle: u64, idle_after: Duration) -> Self {
        NodeRecycler {
            kept: Recycler::default(),
            segment,
            keep_idle,
            idle: IdleTrim::new(idle_after),
            activity: 0,
        }
    }

    /// Bytes kept.
    #[cfg(test)]
    pub(super) fn bytes(&self) -> u64 {
        self.kept.bytes()
    }

    /// The most bytes kept while `live` bytes are held.
    pub(super) fn limit(&self, live: u64) -> u64 {
        (self.segment / SHARE_DIV).min(self.segment.saturating_sub(live))
    }

    /// A kept buffer of exactly `len` bytes, for a put to overwrite whole.
    pub(super) fn take(&mut self, len: usize) -> Option<Arc<[u8]>> {
        self.activity = self.activity.wrapping_add(1);
        self.kept.take(len)
    }

    /// Keeps a freed buffer if nobody else holds it and the bound leaves room; returns it
    /// otherwise, for the caller to drop (outside its lock where it can).
    pub(super) fn keep(&mut self, buf: Arc<[u8]>, live: u64) -> Option<Arc<[u8]>> {
        self.activity = self.activity.wrapping_add(1);
        let limit = self.limit(live);
        self.kept.keep(buf, limit)
    }

    /// The buffers beyond the bound once `live` bytes are held (a put grew them).
    pub(super) fn fit(&mut self, live: u64) -> Vec<Arc<[u8]>> {
        let limit = self.limit(live);
        self.kept.trim(limit)
    }

    /// Once per idle period: the buffers beyond `keep_idle`, to drop before asking the
    /// allocator to return free pages ([`crate::buffers::release_free_memory`]). None when
    /// the node is not idle (or was trimmed already in this idle period).
    pub(super) fn idle_trim(&mut self, now: Instant) -> Option<Vec<Arc<[u8]>>> {
        if !self.idle.due(self.activity, now) {
            return None;
        }
        Some(self.kept.trim(self.keep_idle))
    }
}

/// `src` in a buffer of the node's own: a kept one of its size when there is one (taken
/// under the lock, filled after it), else a fresh one.
pub(super) fn filled(mem: &Mutex<Mem>, src: &[u8]) -> Arc<[u8]> {
    let recycled = mem.lock().recycled.take(src.len());
    buffers::fill(recycled, src)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::error::L3Error;
    use crate::types::Tenant;

    use super::super::mem::{Held, Staging};

    /// Buffers under `buffers::KEEP_MIN` (4 KiB) are never kept: the sizes below are above it.
    const SEG: u64 = 65536;

    fn mem(keep_idle: u64) -> Mutex<Mem> {
        Mutex::new(Mem::new(NodeRecycler::new(
            SEG,
            keep_idle,
            Duration::from_millis(50),
        )))
    }

    fn held(data: Arc<[u8]>) -> Held {
        Held {
            tenant: Tenant::new("t").unwrap(),
            key: "k".into(),
            token: 1,
            data,
            ended: false,
            staged: Staging::No,
            since: Instant::now(),
        }
    }

    /// The write path of `NodeInner::write_one` below the checks of the handle.
    fn put(m: &Mutex<Mem>, alloc: u64, src: &[u8]) -> Result<(), L3Error> {
        let data = filled(m, src);
        let released = m.lock().write(alloc, held(data), 2 * SEG)?;
        drop(released);
        Ok(())
    }

    #[test]
    fn a_shorter_put_after_a_longer_free_reads_back_only_its_own_bytes() {
        let m = mem(0);
        put(&m, 1, &[0xAA; 4096]).unwrap();
        let ptr = m.lock().allocs[&1].data.as_ptr();
        m.lock().drop_alloc(1);
        assert_eq!(m.lock().recycled.bytes(), 4096, "the freed buffer is kept");
        put(&m, 2, &[0xBB; 100]).unwrap();
        assert_eq!(&m.lock().allocs[&2].data[..], &[0xBB; 100][..]);
        assert_eq!(
            m.lock().recycled.bytes(),
            4096,
            "no buffer of another size is used"
        );
        put(&m, 3, &[0xCC; 4096]).unwrap();
        let g = m.lock();
        assert_eq!(
            g.allocs[&3].data.as_ptr(),
            ptr,
            "same size: the buffer is reused"
        );
        assert_eq!(&g.allocs[&3].data[..], &[0xCC; 4096][..]);
        assert_eq!(g.recycled.bytes(), 0);
    }

    #[test]
    fn frees_beyond_the_bound_are_released_and_a_growing_put_trims() {
        let m = mem(0);
        for a in 0..6 {
            put(&m, a, &[a as u8; 16000]).unwrap();
        }
        for a in 0..6 {
            m.lock().drop_alloc(a);
            let g = m.lock();
            assert!(
                g.recycled.bytes() <= SEG / SHARE_DIV,
                "{}",
                g.recycled.bytes()
            );
            assert!(g.recycled.bytes() <= SEG.saturating_sub(g.used));
        }
        assert_eq!(
            m.lock().recycled.bytes(),
            32000,
            "two of six kept: half the segment"
        );
        // A put of another size grows the live bytes: what is kept shrinks to fit.
        put(&m, 9, &[1; 48000]).unwrap();
        let g = m.lock();
        assert_eq!(g.used, 48000);
        assert!(g.recycled.bytes() <= SEG - 48000, "{}", g.recycled.bytes());
    }

    #[test]
    fn a_buffer_a_reader_holds_is_never_kept() {
        let m = mem(0);
        put(&m, 1, &[5; 4096]).unwrap();
        let reader = m.lock().allocs[&1].data.clone();
        m.lock().drop_alloc(1);
        assert_eq!(m.lock().recycled.bytes(), 0);
        put(&m, 2, &[6; 4096]).unwrap();
        assert_eq!(&reader[..], &[5; 4096][..]);
    }

    #[test]
    fn an_idle_node_keeps_only_keep_idle_bytes_once_per_idle_period() {
        let m = mem(5000);
        for a in 0..4 {
            put(&m, a, &[1; 5000]).unwrap();
        }
        for a in 0..4 {
            m.lock().drop_alloc(a);
        }
        assert_eq!(m.lock().recycled.bytes(), 20000);
        let t0 = Instant::now();
        let mut g = m.lock();
        assert!(
            g.recycled.idle_trim(t0).is_none(),
            "activity restarts the period"
        );
        assert!(
            g.recycled
                .idle_trim(t0 + Duration::from_millis(10))
                .is_none()
        );
        let freed = g
            .recycled
            .idle_trim(t0 + Duration::from_millis(60))
            .unwrap();
        assert_eq!(freed.len(), 3);
        assert_eq!(g.recycled.bytes(), 5000);
        assert!(
            g.recycled
                .idle_trim(t0 + Duration::from_millis(500))
                .is_none()
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put { alloc: u64, size: usize, byte: u8 },
        End(u64),
        Free(u64),
        Hold(u64),
        Unhold,
    }

    fn op() -> impl Strategy<Value = Op> {
        let size = prop::sample::select(vec![1usize, 7, 100, 1000, 3000, 4096]);
        prop_oneof![
            4 => (0..8u64, size, any::<u8>()).prop_map(|(alloc, size, byte)| Op::Put {
                alloc,
                size,
                byte
            }),
            1 => (0..8u64).prop_map(Op::End),
            3 => (0..8u64).prop_map(Op::Free),
            1 => (0..8u64).prop_map(Op::Hold),
            1 => Just(Op::Unhold),
        ]
    }

    proptest! {
        /// Whatever the sequence of puts, frees and readers: kept bytes stay within the
        /// bound, every allocation reads back exactly the bytes last written to it (never
        /// a recycled buffer's earlier object), and a reader's clone never changes.
        #[test]
        fn recycling_is_bounded_and_never_mixes_objects(ops in prop::collection::vec(op(), 1..80)) {
            let m = mem(0);
            let mut model: HashMap<u64, (Vec<u8>, bool)> = HashMap::new();
            let mut readers: Vec<(Arc<[u8]>, Vec<u8>)> = Vec::new();
            for o in ops {
                match o {
                    Op::Put { alloc, size, byte } => {
                        let src = vec![byte; size];
                        let live: u64 = model.values().map(|(v, _)| v.len() as u64).sum();
                        let prev = model.get(&alloc).map_or(0, |(v, _)| v.len() as u64);
                        let r = put(&m, alloc, &src);
                        match model.get(&alloc) {
                            Some((_, true)) => {
                                let exists = matches!(r, Err(L3Error::ObjectAlreadyExists));
                                prop_assert!(exists, "{:?}", r);
                            }
                            _ if live - prev + size as u64 > 2 * SEG => {
                                let full = matches!(r, Err(L3Error::NoAvailableHandle { .. }));
                                prop_assert!(full, "{:?}", r);
                            }
                            _ => {
                                prop_assert!(r.is_ok());
                                model.insert(alloc, (src, false));
                            }
                        }
                    }
                    Op::End(a) => {
                        if let Some(h) = m.lock().allocs.get_mut(&a) {
                            h.ended = true;
                        }
                        if let Some(e) = model.get_mut(&a) {
                            e.1 = true;
                        }
                    }
                    Op::Free(a) => {
                        m.lock().drop_alloc(a);
                        model.remove(&a);
                    }
                    Op::Hold(a) => {
                        if let Some(h) = m.lock().allocs.get(&a) {
                            readers.push((h.data.clone(), h.data.to_vec()));
                        }
                    }
                    Op::Unhold => readers.clear(),
                }
                let g = m.lock();
                let kept = g.recycled.bytes();
                prop_assert!(kept <= SEG / SHARE_DIV && kept <= SEG.saturating_sub(g.used));
                prop_assert_eq!(g.used, model.values().map(|(v, _)| v.len() as u64).sum::<u64>());
                prop_assert_eq!(g.allocs.len(), model.len());
                for (a, (v, _)) in &model {
                    prop_assert_eq!(&g.allocs[a].data[..], &v[..]);
                }
                for (b, v) in &readers {
                    prop_assert_eq!(&b[..], &v[..]);
                }
            }
        }
    }
}
