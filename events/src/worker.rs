//! The publisher thread: owns the PUB and ROUTER sockets, the replay buffer and the mirror.
//!
//! Why the mirror lives here: a snapshot is built from it (a second for a 500K-block index),
//! and built on the thread that sends the batches it holds, it needs no lock `publish` takes
//! and is exactly the batches sent before it (numbered as the last of them).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use crate::answers::{Payload, Pool, Requesters, send_shared};
use crate::mirror::Mirror;
use crate::publisher::{END_SEQ, PublisherConfig, SNAPSHOT_REQUEST};
use crate::wire::{HashFormat, WireEvent, encode_batch};

/// A batch's events, handed to the thread beside its bytes.
pub(crate) struct Batch {
    pub seq: u64,
    pub ts: f64,
    pub events: Vec<WireEvent>,
}

/// How far the thread has folded batches into its mirror, for `resident_blocks`.
#[derive(Default)]
pub(crate) struct Progress {
    seen: Mutex<Seen>,
    changed: Condvar,
}

#[derive(Default)]
struct Seen {
    /// Batches folded in (the next number).
    batches: u64,
    resident: usize,
    gone: bool,
}

impl Progress {
    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn folded(&self, batches: u64, resident: usize) {
        let mut s = self.lock();
        s.batches = s.batches.max(batches);
        s.resident = resident;
        self.changed.notify_all();
    }

    fn gone(&self) {
        self.lock().gone = true;
        self.changed.notify_all();
    }

    /// The resident blocks once `batches` are folded in; at once when the thread is not
    /// `running` (ended, or not of this process).
    pub(crate) fn resident(&self, batches: u64, running: bool) -> usize {
        let s = self.lock();
        if !running {
            return s.resident;
        }
        self.changed
            .wait_while(s, |s| s.batches < batches && !s.gone)
            .unwrap_or_else(PoisonError::into_inner)
            .resident
    }
}

pub(crate) struct Worker {
    pub_sock: zmq::Socket,
    replay: Option<zmq::Socket>,
    pull: zmq::Socket,
    topic: Vec<u8>,
    /// Replies share these bytes ([`send_shared`]): a replay copies no batch.
    buffer: VecDeque<(u64, Arc<Payload>)>,
    buffer_steps: usize,
    buffer_bytes: usize,
    /// The payload bytes `buffer` holds.
    buffered_bytes: usize,
    /// Counts the bytes of the buffer's batches, the latest snapshot and whatever answers
    /// queued in ZMQ still hold.
    pool: Pool,
    /// What each requester has queued and not read: past `one_requester` it is not answered.
    requesters: Requesters,
    /// The end marker's empty last frame.
    empty: Arc<Payload>,
    /// The latest snapshot and the number it is of: every request until the next batch is
    /// answered with these bytes (built once, queued once however many ask).
    snapshot: Option<(u64, Arc<Payload>)>,
    /// What the batches sent so far left resident: what a snapshot lists.
    mirror: Mirror,
    /// The last batch sent: its number and time (a snapshot's).
    last: Option<(u64, f64)>,
    /// Each batch's events, in the order of the bytes on `pull`.
    events: Receiver<Batch>,
    progress: Arc<Progress>,
    dp: i64,
    hash_format: HashFormat,
    // the context outlives the sockets: fields drop in order, the context last
    _ctx: zmq::Context,
}

impl Worker {
    pub(crate) fn new(
        cfg: &PublisherConfig,
        pub_sock: zmq::Socket,
        replay: Option<zmq::Socket>,
        pull: zmq::Socket,
        events: Receiver<Batch>,
        progress: Arc<Progress>,
        ctx: zmq::Context,
    ) -> Self {
        Self {
            pub_sock,
            replay,
            pull,
            topic: cfg.topic.clone().into_bytes(),
            buffer: VecDeque::with_capacity(cfg.buffer_steps.min(1 << 16)),
            buffer_steps: cfg.buffer_steps,
            buffer_bytes: cfg.buffer_bytes,
            buffered_bytes: 0,
            pool: Pool::default(),
            requesters: Requesters::default(),
            empty: Pool::default().payload(Vec::new()),
            snapshot: None,
            mirror: Mirror::new(),
            last: None,
            events,
            progress,
            dp: cfg.data_parallel_rank,
            hash_format: cfg.hash_format,
            _ctx: ctx,
        }
    }

    pub(crate) fn run(mut self) {
        // however the thread ends, `resident_blocks` stops waiting for it
        struct Gone(Arc<Progress>);
        impl Drop for Gone {
            fn drop(&mut self) {
                self.0.gone();
            }
        }
        let _gone = Gone(Arc::clone(&self.progress));
        loop {
            let (batch, request) = {
                let mut items = vec![self.pull.as_poll_item(zmq::POLLIN)];
                if let Some(r) = &self.replay {
                    items.push(r.as_poll_item(zmq::POLLIN));
                }
                match zmq::poll(&mut items, -1) {
                    Ok(_) => {}
                    // a signal delivered to this thread (a process's SIGTERM lands on any
                    // thread): not an error, poll again
                    Err(zmq::Error::EINTR) => continue,
                    Err(_) => return,
                }
                (
                    items[0].is_readable(),
                    items.get(1).is_some_and(|i| i.is_readable()),
                )
            };
            // every batch waiting first: a request (a snapshot can take a second to build)
            // lets the engine's batches queue up to the hand-over's limit, where `publish`
            // would wait
            let mut flags = if batch { 0 } else { zmq::DONTWAIT };
            loop {
                match self.pull.recv_multipart(flags) {
                    Ok(frames) if frames.first().map(Vec::as_slice) == Some(b"S") => return,
                    Ok(mut frames) if frames.len() == 3 => {
                        let payload = frames.pop().unwrap_or_default();
                        let seq = frames.pop().unwrap_or_default();
                        self.take_batch(&seq, payload);
                    }
                    Ok(_) => {}
                    Err(zmq::Error::EINTR) => {}
                    Err(zmq::Error::EAGAIN) => break,
                    Err(_) => return,
                }
                flags = zmq::DONTWAIT;
            }
            if request {
                self.serve_replay();
            }
        }
    }

    /// Folds a batch's events into the mirror, then sends and keeps its bytes.
    fn take_batch(&mut self, seq: &[u8], payload: Vec<u8>) {
        let n = seq.try_into().map(u64::from_be_bytes).unwrap_or(0);
        // the events follow the bytes on the channel (`publish` sends them right after);
        // none older are left there, a hand-over that failed sends none
        while let Ok(b) = self.events.recv() {
            if b.seq < n {
                continue;
            }
            if b.seq == n {
                for e in &b.events {
                    self.mirror.apply(e);
                }
                self.last = Some((n, b.ts));
            }
            break;
        }
        self.progress.folded(n + 1, self.mirror.blocks());
        self.send_batch(seq, payload);
    }

    fn send_batch(&mut self, seq: &[u8], payload: Vec<u8>) {
        // a PUB send never blocks: past the high-water mark ZMQ drops the message for that
        // subscriber, which finds the gap from the sequence numbers and replays
        if let Err(e) = self
            .pub_sock
            .send_multipart([&self.topic[..], seq, &payload], zmq::DONTWAIT)
        {
            eprintln!("kvtier-events: PUB send failed: {e}");
        }
        let n = seq.try_into().map(u64::from_be_bytes).unwrap_or(0);
        self.buffered_bytes += payload.len();
        self.buffer.push_back((n, self.pool.payload(payload)));
        while self.buffer.len() > 1
            && (self.buffer.len() > self.buffer_steps || self.buffered_bytes > self.buffer_bytes)
        {
            if let Some((_, old)) = self.buffer.pop_front() {
                self.buffered_bytes -= old.bytes().len();
            }
        }
    }

    /// Bytes only queued answers hold: replayed batches the buffer dropped since, snapshots
    /// older than the latest.
    fn held_by_answers(&self) -> usize {
        let cached = self.snapshot.as_ref().map_or(0, |(_, p)| p.bytes().len());
        self.pool
            .alive()
            .saturating_sub(self.buffered_bytes)
            .saturating_sub(cached)
    }

    /// What one requester may hold unread and still be answered: `buffer_bytes` beyond a
    /// whole replay and a snapshot (ZMQ lets go of an answer's bytes a little after its
    /// requester has them: one that reads and asks again at once must not find itself over).
    fn one_requester(&self) -> usize {
        let snapshot = self.snapshot.as_ref().map_or(0, |(_, p)| p.bytes().len());
        self.buffer_bytes
            .saturating_add(self.buffered_bytes)
            .saturating_add(snapshot)
    }

    /// Whether answers nobody has read hold so much that no more is queued: what four
    /// requesters may hold ([`Worker::one_requester`]), all together.
    fn answers_full(&self) -> bool {
        self.held_by_answers() >= self.one_requester().saturating_mul(4)
    }

    /// The snapshot of the batches sent so far (`None`: none yet), the cached one while no
    /// batch came since; a new one is not built while [`Worker::answers_full`] (`Err`: not
    /// answered).
    fn snapshot(&mut self) -> Result<Option<(u64, Arc<Payload>)>, ()> {
        // before the first batch there is nothing to snapshot
        let Some((seq, ts)) = self.last else {
            return Ok(None);
        };
        if let Some((s, p)) = &self.snapshot
            && *s == seq
        {
            return Ok(Some((seq, Arc::clone(p))));
        }
        if self.answers_full() {
            return Err(());
        }
        let events = self.mirror.snapshot();
        match encode_batch(ts, &events, self.dp, self.hash_format) {
            Ok(bytes) => {
                let p = self.pool.payload(bytes);
                self.snapshot = Some((seq, Arc::clone(&p)));
                Ok(Some((seq, p)))
            }
            Err(e) => {
                eprintln!("kvtier-events: snapshot not encoded: {e}");
                Ok(None)
            }
        }
    }

    fn serve_replay(&mut self) {
        let Some(r) = &self.replay else { return };
        let Ok(frames) = r.recv_multipart(zmq::DONTWAIT) else {
            return;
        };
        // the ROUTER puts the requester's identity first: anything else it sent that is not
        // `["", start]` with an 8-byte start gets the end marker alone (it waited out its
        // timeout before)
        let Some(id) = frames.first() else { return };
        let start = match frames.as_slice() {
            [_, empty, start] if empty.is_empty() => <[u8; 8]>::try_from(start.as_slice()).ok(),
            _ => None,
        };
        // a requester that has not read what it was sent before (past `one_requester`) is
        // not answered: it asks again once it reads, and costs no other requester its answers
        let unread = self.requesters.of(id);
        if unread.load(Ordering::Relaxed) >= self.one_requester() {
            return;
        }
        let replies: Vec<(u64, Arc<Payload>)> = match start {
            None => Vec::new(),
            Some(start) if start == SNAPSHOT_REQUEST => match self.snapshot() {
                Ok(s) => s.into_iter().collect(),
                // answers alone hold too much: no answer (the requester asks again)
                Err(()) => return,
            },
            Some(start) => {
                // a replay shares the buffer's bytes, but they stay held once the buffer
                // drops them: none while answers are full
                if self.answers_full() {
                    return;
                }
                let from = u64::from_be_bytes(start);
                self.buffer
                    .iter()
                    .filter(|(s, _)| *s >= from)
                    .map(|(s, p)| (*s, Arc::clone(p)))
                    .collect()
            }
        };
        let Some(r) = &mut self.replay else { return };
        // a send refused (the requester's queue full, or it is gone) ends the answer without
        // its end marker: the requester times out and asks again, never takes a replay with
        // a hole for a whole one. The identity frame is the one a full queue refuses; the
        // rest of a message is never refused once it is.
        for (seq, p) in replies {
            let head = r.send_multipart(
                [&id[..], b"", &self.topic[..], &seq.to_be_bytes()[..]],
                zmq::DONTWAIT | zmq::SNDMORE,
            );
            if head.is_err() || send_shared(r, &p, &unread, zmq::DONTWAIT).is_err() {
                return;
            }
        }
        // a failed end marker: the requester times out and asks again. Counted against the
        // requester as every answer is (the ROUTER's queue has no bound of its own)
        let head = r.send_multipart(
            [&id[..], b"", b"", &END_SEQ[..]],
            zmq::DONTWAIT | zmq::SNDMORE,
        );
        if let Err(e) = head.and_then(|()| send_shared(r, &self.empty, &unread, zmq::DONTWAIT)) {
            eprintln!("kvtier-events: replay end not sent: {e}");
        }
    }
}
