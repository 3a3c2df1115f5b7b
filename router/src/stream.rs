//! One event stream's sequence numbers: which batches to apply, and how to recover a gap.
//!
//! Sans I/O: the tracker decides, a [`History`] (the publisher's replay socket in
//! [`crate::subscriber`], a list in the tests) answers replay and snapshot requests, and a sink
//! folds the batches it is handed into the index. vLLM's protocol numbers batches from 0; a
//! subscriber that sees a number past the one it expects asks the replay socket for every
//! batch from the expected one on. kvtier's publishers also answer `start = -2` with a snapshot
//! (`AllBlocksCleared`, then every resident block, numbered as the last batch it includes);
//! vLLM's own publisher answers -2 with its whole replay buffer, which is the full history as
//! long as the buffer still starts at 0. Either way the tracker applies what comes back in
//! order and continues after the last number.
//!
//! What never happens: a stream that does not answer, answers garbage, restarts or repeats
//! itself never blocks or fails anything. The tracker counts it and goes on with what it has
//! (the index is then incomplete or stale, so routing is worse, never wrong in kind).

/// A replay request's answer: `(seq, payload)` batches in the order received, without the end
/// marker. `None`: no answer (no replay socket, timeout, publisher down).
pub type Replayed = Option<Vec<(i64, Vec<u8>)>>;

/// Where missed batches come from.
pub trait History {
    /// Every kept batch numbered `from` or later (`from = -2`: a snapshot).
    fn replay(&mut self, from: i64) -> Replayed;
}

/// The start value that asks for a snapshot.
pub const SNAPSHOT: i64 = -2;

/// The most live batches that can queue between a publisher and the subscriber (the
/// publisher's send queue: vLLM's high-water mark is 100,000): a live batch can be behind
/// the next expected number by at most this many and still be one that queued while a replay
/// ran (a duplicate). Further behind, the replay's numbers are not the live stream's.
pub const LIVE_QUEUE: u64 = 100_000;

/// Counters of one stream, as `/stats` reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StreamCounters {
    /// Batches folded into the index (live and replayed).
    pub applied: u64,
    /// Live batches numbered before the next expected one (already applied), dropped.
    pub duplicates: u64,
    /// Times a live batch was numbered past the next expected one.
    pub gaps: u64,
    /// Replay requests answered.
    pub replays: u64,
    /// Snapshot requests answered.
    pub snapshots: u64,
    /// Replay or snapshot requests not answered.
    pub unanswered: u64,
    /// Batches that could not be recovered (accepted a later number without them).
    pub lost: u64,
    /// Batches whose payload did not decode (skipped).
    pub garbage: u64,
    /// Times the publisher started again from 0.
    pub restarts: u64,
    /// Times the SUB socket connected again after losing its publisher (then resynced).
    pub reconnects: u64,
    /// Live batches of a topic other than the stream's (`topic=`), dropped unread.
    pub foreign_topic: u64,
    /// Live batches numbered further behind the replayed ones than any queue holds: the
    /// replay socket numbers another stream (misconfigured, or another incarnation). The
    /// stream is taken from the live batch on.
    pub renumbered: u64,
    /// Batches larger than the stream's `max_batch_bytes`, skipped undecoded (decoding
    /// takes many times a payload's size).
    pub oversized: u64,
}

/// Sequence-number state of one stream.
#[derive(Clone, Debug, Default)]
pub struct Tracker {
    /// The next number to apply; `None` until synced (nothing applied yet).
    next: Option<u64>,
    /// The last live number received (the highest, but for a restart).
    last_live: Option<u64>,
    /// The SUB reconnected since the last live batch and no snapshot settled it: a number
    /// at or below the last is then a new incarnation's, not a duplicate.
    reconnected_since_live: bool,
    /// Batches longer than this are skipped undecoded (`None`: no limit).
    max_batch_bytes: Option<usize>,
    /// A live batch far behind is being resynced ([`Self::behind`]): it syncs once, so a
    /// history whose answers disagree cannot make it recurse.
    resyncing: bool,
    pub counters: StreamCounters,
}

/// What a snapshot request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Synced {
    Unanswered,
    /// Answered with nothing (nothing published, or no snapshots).
    Empty,
    /// Answered with batches, applied.
    Applied,
}

/// What the sink is asked to do.
pub enum Apply<'a> {
    /// Fold a batch in; the sink returns `false` if it did not decode (counted as garbage).
    Batch(&'a [u8]),
    /// [`Apply::Batch`] decoded already, outside the cluster's lock (the subscriber's sink).
    Decoded(crate::index::DecodedBatch),
    /// Forget what this stream told before (its publisher restarted): clear its pages.
    Reset,
    /// A snapshot's first batch: if it decodes, it replaces what this stream told before, in
    /// one step; if not, nothing changes and the sink returns `false`.
    Replace(&'a [u8]),
    /// [`Apply::Replace`] decoded already (the subscriber's sink).
    ReplaceDecoded(crate::index::DecodedBatch),
}

impl Tracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// A tracker that skips batches longer than `max_batch_bytes` (counted `oversized`, as
    /// lost): a decoded batch takes up to ~50 times its payload (a one-byte hash becomes a
    /// decoded value), so the limit bounds the memory one hostile batch can take.
    pub fn with_max_batch_bytes(max_batch_bytes: usize) -> Self {
        Tracker {
            max_batch_bytes: Some(max_batch_bytes),
            ..Self::default()
        }
    }

    /// The next sequence number expected (`None`: not synced yet).
    pub fn next(&self) -> Option<u64> {
        self.next
    }

    /// Syncs with a snapshot request (at start, or after history was lost). `true` if answered.
    pub fn sync(
        &mut self,
        history: &mut dyn History,
        sink: &mut dyn FnMut(Apply<'_>) -> bool,
    ) -> bool {
        self.synced(history, sink) != Synced::Unanswered
    }

    /// The SUB socket connected again after it lost its publisher. The publisher may be a
    /// new incarnation (an engine restarted on the same port, a new L3 leader binding the
    /// store's endpoint) whose first batches went out before this subscriber joined: its
    /// numbers may then run past ours and look like a gap, not a restart. A snapshot settles
    /// it either way; after one, the last live number is forgotten (the snapshot's number
    /// is the reference). A publisher that answers no snapshot (vLLM's) keeps the
    /// restart detection by numbers.
    pub fn reconnected(
        &mut self,
        history: &mut dyn History,
        sink: &mut dyn FnMut(Apply<'_>) -> bool,
    ) {
        self.counters.reconnects += 1;
        if self.synced(history, sink) == Synced::Applied {
            self.last_live = None;
        } else {
            self.reconnected_since_live = true;
        }
    }

    fn synced(
        &mut self,
        history: &mut dyn History,
        sink: &mut dyn FnMut(Apply<'_>) -> bool,
    ) -> Synced {
        let Some(batches) = history.replay(SNAPSHOT) else {
            self.counters.unanswered += 1;
            return Synced::Unanswered;
        };
        self.counters.snapshots += 1;
        if batches.is_empty() {
            // nothing published yet (or a publisher without snapshots, as vLLM's): start from
            // 0, so the first gap or resync replays the whole history; a synced stream keeps
            // what it has (a restarted publisher shows itself by numbering from 0 again)
            if self.next.is_none() {
                self.next = Some(0);
            }
            return Synced::Empty;
        }
        // vLLM's publisher answers -2 with its whole buffer: complete if it starts at 0
        let first = batches.first().map_or(0, |b| b.0);
        let incomplete = first > 0 && !starts_with_clear(&batches[0].1);
        let mut first_batch = true;
        for (seq, payload) in batches {
            let Ok(seq) = u64::try_from(seq) else {
                continue;
            };
            if first_batch {
                // a snapshot (or a replay from the buffer's start) replaces what we had, if
                // it decodes: a garbage answer is no answer (forgetting the pages first left
                // the instance with none)
                if !self.replace(seq, &payload, sink) {
                    return Synced::Unanswered;
                }
                if incomplete {
                    self.counters.lost += 1;
                }
                first_batch = false;
            } else if self.next.is_none_or(|n| seq >= n) {
                self.fold(seq, &payload, sink);
            }
        }
        Synced::Applied
    }

    /// A live batch arrived.
    pub fn on_live(
        &mut self,
        seq: u64,
        payload: &[u8],
        history: &mut dyn History,
        sink: &mut dyn FnMut(Apply<'_>) -> bool,
    ) {
        // a number not past the last live one is a duplicate (a relay's retransmit, a
        // reordering) unless the publisher shows it restarted: it numbers from 0 again, or
        // the SUB reconnected since the last live batch (a new incarnation whose first
        // batches went out before we joined)
        let restarted = self
            .last_live
            .is_some_and(|l| seq <= l && ((seq == 0 && l > 0) || self.reconnected_since_live));
        self.reconnected_since_live = false;
        self.last_live = match self.last_live {
            Some(l) if !restarted => Some(l.max(seq)),
            _ => Some(seq),
        };
        self.live(seq, payload, restarted, history, sink);
    }

    fn live(
        &mut self,
        seq: u64,
        payload: &[u8],
        restarted: bool,
        history: &mut dyn History,
        sink: &mut dyn FnMut(Apply<'_>) -> bool,
    ) {
        let Some(next) = self.next else {
            // not synced: try a snapshot now; if none comes, start from this batch
            if self.sync(history, sink) {
                if self.next.is_some_and(|n| seq >= n) {
                    self.live(seq, payload, false, history, sink);
                }
            } else {
                if seq > 0 {
                    self.counters.lost += 1;
                }
                self.fold(seq, payload, sink);
            }
            return;
        };
        if seq == next {
            self.fold(seq, payload, sink);
            return;
        }
        if seq < next {
            if restarted {
                // forget the old incarnation and sync with the new one from scratch
                self.counters.restarts += 1;
                sink(Apply::Reset);
                self.next = None;
                self.live(seq, payload, false, history, sink);
            } else {
                self.behind(seq, next, payload, history, sink);
            }
            return;
        }
        self.counters.gaps += 1;
        self.replay_from(next, history, sink);
        if self.next.is_some_and(|n| seq > n) {
            // the replay did not reach this batch: its history is gone
            self.sync(history, sink);
        }
        match self.next {
            Some(n) if seq == n => self.fold(seq, payload, sink),
            Some(n) if seq < n => self.behind(seq, n, payload, history, sink),
            _ => {
                // still missing: take the live batch and go on without what is lost
                self.counters.lost += 1;
                self.fold(seq, payload, sink);
            }
        }
    }

    /// A live batch numbered before `next`, not from a restarted publisher: replayed already
    /// (the replay overtook the batches queued behind a gap) if it is within what can have
    /// queued. Further behind, the numbers that put `next` there were not this stream's: a
    /// replay socket's of another stream, or one live batch numbered far ahead (a corrupt or
    /// hostile frame). The stream syncs afresh: a snapshot within reach of this batch is
    /// this stream's (applied, and the batch with it); one numbered far past it too is not
    /// (dropped), and the stream is taken from this batch on. (It used to be taken from this
    /// batch on at once: one frame numbered 2^63 cost the instance every page published
    /// before it.)
    fn behind(
        &mut self,
        seq: u64,
        next: u64,
        payload: &[u8],
        history: &mut dyn History,
        sink: &mut dyn FnMut(Apply<'_>) -> bool,
    ) {
        if next - seq <= LIVE_QUEUE {
            self.counters.duplicates += 1;
            return;
        }
        self.counters.renumbered += 1;
        self.last_live = Some(seq);
        let nested = std::mem::replace(&mut self.resyncing, true);
        let done = !nested
            && self.sync(history, sink)
            && match self.next {
                Some(n) if seq >= n => {
                    self.live(seq, payload, false, history, sink);
                    true
                }
                // the snapshot holds this batch already
                Some(n) => n - seq <= LIVE_QUEUE,
                None => false,
            };
        self.resyncing = nested;
        if done {
            return;
        }
        // no snapshot, or another stream's: this batch on, without what came before
        self.counters.lost += 1;
        sink(Apply::Reset);
        self.fold(seq, payload, sink);
    }

    /// Resyncs after a quiet period: asks for anything after the last applied batch (what a
    /// subscriber does when it suspects it missed the tail of a stream).
    pub fn catch_up(&mut self, history: &mut dyn History, sink: &mut dyn FnMut(Apply<'_>) -> bool) {
        match self.next {
            None => {
                self.sync(history, sink);
            }
            Some(n) => self.replay_from(n, history, sink),
        }
    }

    /// Asks for every batch from `from` on and applies them in order; if that history is gone
    /// (the answer starts later), asks for a snapshot.
    fn replay_from(
        &mut self,
        from: u64,
        history: &mut dyn History,
        sink: &mut dyn FnMut(Apply<'_>) -> bool,
    ) {
        let start = i64::try_from(from).unwrap_or(i64::MAX);
        let Some(batches) = history.replay(start) else {
            self.counters.unanswered += 1;
            return;
        };
        self.counters.replays += 1;
        if batches.first().is_some_and(|b| b.0 > start) {
            self.sync(history, sink);
            return;
        }
        for (seq, payload) in batches {
            match (u64::try_from(seq), self.next) {
                (Ok(s), Some(n)) if s == n => self.fold(s, &payload, sink),
                _ => {}
            }
        }
    }

    /// A snapshot's first batch, numbered `seq`: replaces the stream's pages if it decodes
    /// (`true`); one too large or that does not decode changes nothing (counted, `false`).
    fn replace(
        &mut self,
        seq: u64,
        payload: &[u8],
        sink: &mut dyn FnMut(Apply<'_>) -> bool,
    ) -> bool {
        if self.max_batch_bytes.is_some_and(|m| payload.len() > m) {
            self.counters.oversized += 1;
            return false;
        }
        if !sink(Apply::Replace(payload)) {
            self.counters.garbage += 1;
            return false;
        }
        self.counters.applied += 1;
        self.next = Some(seq.saturating_add(1));
        true
    }

    fn fold(&mut self, seq: u64, payload: &[u8], sink: &mut dyn FnMut(Apply<'_>) -> bool) {
        if self.max_batch_bytes.is_some_and(|m| payload.len() > m) {
            self.counters.oversized += 1;
            self.counters.lost += 1;
        } else if sink(Apply::Batch(payload)) {
            self.counters.applied += 1;
        } else {
            self.counters.garbage += 1;
        }
        self.next = Some(seq.saturating_add(1));
    }
}

/// Whether a batch's first event is `AllBlocksCleared` (a snapshot), read without decoding
/// the rest.
fn starts_with_clear(payload: &[u8]) -> bool {
    matches!(
        crate::index::decode_batch(payload).as_deref(),
        Ok([crate::index::IndexEvent::Cleared, ..])
    )
}
