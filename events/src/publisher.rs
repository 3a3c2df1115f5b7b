//! A ZMQ publisher speaking vLLM's KV event protocol, plus snapshots.
//!
//! What a vLLM subscriber expects (`ZmqEventPublisher` in `vllm/distributed/kv_events.py`):
//! - a PUB socket sending three frames per batch: topic, the batch's sequence number (8 bytes,
//!   big-endian, from 0) and the msgpack `KVEventBatch` ([`crate::wire`]);
//! - optionally a ROUTER replay socket: a request `[identity, "", start_seq]` is answered with
//!   `[identity, "", topic, seq, payload]` for every kept batch from `start_seq` on, then
//!   `[identity, "", "", -1, ""]` (vLLM 0.32 on; before, the replies had no topic frame). The
//!   topic on every frame lets a subscriber check that a replayed batch is of the stream it
//!   expects (a store's stream of one namespace: the topic is the namespace).
//!
//! kvtier adds one request to the replay socket: `start_seq = -2` ([`SNAPSHOT_REQUEST`]) asks
//! for the whole resident state instead of history, answered as one batch (`AllBlocksCleared`
//! then every resident block, [`crate::Mirror::snapshot`]) whose sequence number is the last
//! batch it includes (no batch before the end marker: nothing published yet); the subscriber
//! drops live batches up to that number. A router that
//! starts late, restarts, or finds that the history it missed is gone (the first replayed
//! number is past what it asked for) recovers with one request and no engine involved.
//!
//! Threads: `publish` encodes the batch, assigns its number and folds it into the mirror under
//! one lock (so numbers, mirror and snapshots agree), then hands the bytes over an inproc
//! socket to the publisher thread, which owns the PUB and ROUTER sockets (ZMQ sockets are not
//! shared between threads) and keeps the replay buffer.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use kvtier_radix::KvEvent;

use crate::answers::{Payload, Pool, send_shared};
use crate::bind::bind;
use crate::mirror::Mirror;
use crate::wire::{EncodeError, HashFormat, WireEvent, encode_batch};

/// The replay request that asks for a snapshot (kvtier's extension): -2 as 8 big-endian bytes.
pub const SNAPSHOT_REQUEST: [u8; 8] = (-2i64).to_be_bytes();
/// vLLM's end-of-replay sequence number: -1 as 8 big-endian bytes.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// The replay buffer's default byte bound: 10,000 batches (vLLM's `buffer_steps`) of a
/// long prompt's blocks each would be gigabytes.
pub const DEFAULT_BUFFER_BYTES: usize = 64 << 20;

/// Where and how to publish.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// The PUB socket's address; `tcp://127.0.0.1:*` binds a free port ([`Publisher::endpoint`]
    /// says which).
    pub endpoint: String,
    /// The ROUTER replay socket's address (`None`: no replay, no snapshots).
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Bytes of batches kept for replay, at most (the latest batch is always kept): the
    /// oldest go first. A subscriber further behind recovers from a snapshot. Also the bound
    /// on what answers alone hold (replayed batches the buffer has dropped since, snapshots
    /// older than the latest) while their requesters have not read them: past it a request
    /// is not answered (its requester times out and asks again).
    pub buffer_bytes: usize,
    /// The PUB socket's send high-water mark (messages queued per slow subscriber).
    pub hwm: i32,
    pub data_parallel_rank: i64,
    /// The cache's page size in tokens (vLLM's `block_size`).
    pub block_size: u32,
    /// Block hashes as vLLM's default 64-bit integers, or the whole 32 bytes.
    pub hash_format: HashFormat,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:*".into(),
            replay_endpoint: Some("tcp://127.0.0.1:*".into()),
            topic: String::new(),
            buffer_steps: 10_000,
            buffer_bytes: DEFAULT_BUFFER_BYTES,
            hwm: 100_000,
            data_parallel_rank: 0,
            block_size: 16,
            hash_format: HashFormat::Int64,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("{what}: {source}")]
    Zmq {
        what: String,
        #[source]
        source: zmq::Error,
    },
    #[error(transparent)]
    Encode(#[from] EncodeError),
    #[error("invalid publisher config: {0}")]
    Config(String),
    #[error("the publisher is shut down")]
    Closed,
    #[error(
        "this publisher was bound by process {owner} and this is process {here} (forked \
         after): its thread and sockets are the parent's; bind a publisher in this process"
    )]
    Forked { owner: u32, here: u32 },
}

fn zerr(what: impl Into<String>) -> impl FnOnce(zmq::Error) -> PublishError {
    let what = what.into();
    move |source| PublishError::Zmq { what, source }
}

/// Sends `frames` as one message, waiting as long as the thread is behind. A signal that
/// interrupts the wait (EINTR: Python installs its handlers without `SA_RESTART`) retries
/// the frame it interrupted: failing would lose a batch whose events the caller had already
/// drained, and giving up after the first frames would leave them queued, to be glued to the
/// next batch (which the thread then drops as malformed).
fn send_whole(push: &zmq::Socket, frames: [&[u8]; 3]) -> Result<(), zmq::Error> {
    let last = frames.len() - 1;
    for (i, frame) in frames.iter().enumerate() {
        let flags = if i < last { zmq::SNDMORE } else { 0 };
        loop {
            match push.send(*frame, flags) {
                Ok(()) => break,
                Err(zmq::Error::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// What the publisher thread reads to answer a snapshot request. Never held while waiting
/// for that thread (it would wait for this lock: a hang under snapshot requests).
struct State {
    next_seq: u64,
    /// The latest batch's timestamp: a snapshot's (it holds every batch up to that one).
    last_ts: f64,
    mirror: Mirror,
    closed: bool,
}

/// Publishes batches of KV events; dropping it stops its thread and closes its sockets.
pub struct Publisher {
    state: Arc<Mutex<State>>,
    /// The hand-over to the publisher thread; its lock orders the batches (one publisher at
    /// a time, in number order). A hand-over may wait for the thread, which never takes it.
    /// `None` only once a forked child's shutdown leaked it (see `pid`).
    push: Option<Mutex<zmq::Socket>>,
    thread: Option<JoinHandle<()>>,
    /// The process that bound the sockets. A child forked after has copies of the sockets
    /// whose signalling file descriptors the parent's ZMQ threads share, and no publisher
    /// thread: in it every publish is refused ([`PublishError::Forked`]) and shutdown leaks
    /// the sockets and the thread's handle (closing them made the parent's ZMQ threads
    /// abort; joining the thread panicked).
    pid: u32,
    endpoint: String,
    replay_endpoint: Option<String>,
    data_parallel_rank: i64,
    block_size: u32,
    hash_format: HashFormat,
}

impl Publisher {
    /// Binds the sockets and starts the publisher thread.
    pub fn bind(cfg: PublisherConfig) -> Result<Self, PublishError> {
        if cfg.buffer_steps == 0 || cfg.buffer_bytes == 0 || cfg.hwm < 0 || cfg.block_size == 0 {
            return Err(PublishError::Config(format!(
                "buffer_steps {}, buffer_bytes {} and block_size {} must be positive, hwm {} not negative",
                cfg.buffer_steps, cfg.buffer_bytes, cfg.block_size, cfg.hwm
            )));
        }
        // zmq's bind panics on a NUL byte (`CString::new(..).unwrap()`): refuse it first
        if let Some(ep) = std::iter::once(&cfg.endpoint)
            .chain(cfg.replay_endpoint.as_ref())
            .find(|ep| ep.contains('\0'))
        {
            return Err(PublishError::Config(format!(
                "endpoint {ep:?} contains a NUL byte"
            )));
        }
        let ctx = zmq::Context::new();
        let mut pub_sock = ctx.socket(zmq::PUB).map_err(zerr("PUB socket"))?;
        pub_sock
            .set_sndhwm(cfg.hwm)
            .map_err(zerr("PUB high-water mark"))?;
        pub_sock.set_linger(0).map_err(zerr("PUB linger"))?;
        bind(&mut pub_sock, &cfg.endpoint, "PUB")?;
        let endpoint = last_endpoint(&pub_sock)?;
        let replay = match &cfg.replay_endpoint {
            Some(ep) => {
                let mut r = ctx.socket(zmq::ROUTER).map_err(zerr("ROUTER socket"))?;
                r.set_linger(0).map_err(zerr("ROUTER linger"))?;
                // a whole replay (every kept batch and the end marker) fits a requester's
                // queue; past it a send is refused (mandatory), never silently dropped: a
                // ROUTER drops what exceeds its high-water mark (1,000 by default), and a
                // replay with a hole in it and an end marker looks complete
                let hwm = i32::try_from(cfg.buffer_steps.saturating_add(2)).unwrap_or(i32::MAX);
                r.set_sndhwm(hwm).map_err(zerr("ROUTER high-water mark"))?;
                r.set_router_mandatory(true)
                    .map_err(zerr("ROUTER mandatory"))?;
                bind(&mut r, ep, "replay ROUTER")?;
                Some(r)
            }
            None => None,
        };
        let replay_endpoint = replay.as_ref().map(last_endpoint).transpose()?;
        // one inproc pair per publisher: the address is unique in this context
        let inproc = "inproc://kvtier-events";
        let pull = ctx.socket(zmq::PULL).map_err(zerr("inproc PULL"))?;
        pull.bind(inproc).map_err(zerr("bind inproc PULL"))?;
        let push = ctx.socket(zmq::PUSH).map_err(zerr("inproc PUSH"))?;
        push.connect(inproc).map_err(zerr("connect inproc PUSH"))?;
        let state = Arc::new(Mutex::new(State {
            next_seq: 0,
            last_ts: 0.0,
            mirror: Mirror::new(),
            closed: false,
        }));
        let worker = Worker {
            pub_sock,
            replay,
            pull,
            topic: cfg.topic.into_bytes(),
            buffer: VecDeque::with_capacity(cfg.buffer_steps.min(1 << 16)),
            buffer_steps: cfg.buffer_steps,
            buffer_bytes: cfg.buffer_bytes,
            buffered_bytes: 0,
            pool: Pool::default(),
            snapshot: None,
            state: Arc::clone(&state),
            dp: cfg.data_parallel_rank,
            hash_format: cfg.hash_format,
            _ctx: ctx,
        };
        let thread = std::thread::Builder::new()
            .name("kvtier-events".into())
            .spawn(move || worker.run())
            .map_err(|e| PublishError::Config(format!("cannot start the publisher thread: {e}")))?;
        Ok(Self {
            state,
            push: Some(Mutex::new(push)),
            thread: Some(thread),
            pid: std::process::id(),
            endpoint,
            replay_endpoint,
            data_parallel_rank: cfg.data_parallel_rank,
            block_size: cfg.block_size,
            hash_format: cfg.hash_format,
        })
    }

    /// The PUB socket's bound address (the port filled in).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The tokens a block holds in the events published (vLLM's `block_size`): the page size
    /// of the cache whose events these are.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Ok in the process that bound the publisher; [`PublishError::Forked`] in a child forked
    /// after (see `pid`).
    pub fn same_process(&self) -> Result<(), PublishError> {
        let here = std::process::id();
        if here == self.pid {
            return Ok(());
        }
        Err(PublishError::Forked {
            owner: self.pid,
            here,
        })
    }

    /// Publishes one batch; returns its sequence number.
    pub fn publish(&self, ts: f64, events: &[WireEvent]) -> Result<u64, PublishError> {
        self.same_process()?;
        let payload = encode_batch(ts, events, self.data_parallel_rank, self.hash_format)?;
        let push = self
            .push
            .as_ref()
            .ok_or(PublishError::Closed)?
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // the number is ours while `push` is held (only a hand-over advances it)
        let seq = {
            let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if st.closed {
                return Err(PublishError::Closed);
            }
            st.next_seq
        };
        // may wait while the thread is behind (its queue full): without the state lock, which
        // the thread takes to build a snapshot. A snapshot taken meanwhile is numbered before
        // this batch and does not hold it: consistent.
        send_whole(&push, [&b"B"[..], &seq.to_be_bytes(), &payload])
            .map_err(zerr("hand the batch to the publisher thread"))?;
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.next_seq += 1;
        st.last_ts = ts;
        for e in events {
            st.mirror.apply(e);
        }
        Ok(seq)
    }

    /// Publishes kvtier cache events (as drained from the scheduler or cache).
    pub fn publish_kv(&self, ts: f64, events: &[KvEvent]) -> Result<u64, PublishError> {
        let wire: Vec<WireEvent> = events
            .iter()
            .map(|e| WireEvent::from_kv(e, self.block_size))
            .collect();
        self.publish(ts, &wire)
    }

    /// Resident blocks the publisher's mirror holds (what a snapshot would list).
    pub fn resident_blocks(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .mirror
            .blocks()
    }

    /// Stops the thread and closes the sockets (also done on drop). Never blocks on a thread
    /// that is gone: the stop message is offered without waiting, again while the thread
    /// still runs (its queue full), and not at all once it ended.
    pub fn shutdown(&mut self) {
        if self.same_process().is_err() {
            // a forked child: nothing here is its own to stop or close (see `pid`)
            std::mem::forget(self.thread.take());
            std::mem::forget(self.push.take());
            return;
        }
        let Some(push) = &self.push else {
            return;
        };
        let first = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            !std::mem::replace(&mut st.closed, true)
        };
        if first {
            loop {
                let sent = push
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .send(&b"S"[..], zmq::DONTWAIT);
                let running = self.thread.as_ref().is_some_and(|t| !t.is_finished());
                match sent {
                    Ok(()) => break,
                    Err(zmq::Error::EAGAIN | zmq::Error::EINTR) if running => {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    // the thread is gone (its socket closed): nothing to stop; a send
                    // failing otherwise leaves a running thread no stop will reach, which
                    // is not joined (never block)
                    Err(_) => {
                        if running {
                            self.thread.take();
                        }
                        break;
                    }
                }
            }
        }
        if let Some(t) = self.thread.take() {
            // a panic in the thread has nothing left to release: its sockets drop with it
            if t.join().is_err() {
                eprintln!("kvtier-events: the publisher thread panicked");
            }
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn last_endpoint(s: &zmq::Socket) -> Result<String, PublishError> {
    match s
        .get_last_endpoint()
        .map_err(zerr("read the bound address"))?
    {
        Ok(ep) => Ok(ep),
        Err(raw) => Err(PublishError::Config(format!(
            "bound address is not UTF-8: {raw:?}"
        ))),
    }
}

struct Worker {
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
    /// The latest snapshot and the number it is of: every request until the next batch is
    /// answered with these bytes (built once, queued once however many ask).
    snapshot: Option<(u64, Arc<Payload>)>,
    state: Arc<Mutex<State>>,
    dp: i64,
    hash_format: HashFormat,
    // the context outlives the sockets: fields drop in order, the context last
    _ctx: zmq::Context,
}

impl Worker {
    fn run(mut self) {
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
            if batch {
                match self.pull.recv_multipart(0) {
                    Ok(frames) if frames.first().map(Vec::as_slice) == Some(b"S") => return,
                    Ok(mut frames) if frames.len() == 3 => {
                        let payload = frames.pop().unwrap_or_default();
                        let seq = frames.pop().unwrap_or_default();
                        self.send_batch(&seq, payload);
                    }
                    Ok(_) => {}
                    Err(zmq::Error::EINTR) => {}
                    Err(_) => return,
                }
            }
            if request {
                self.serve_replay();
            }
        }
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

    /// The snapshot of the state now (`None`: nothing published yet), the cached one while
    /// no batch came since; a new one is not built while answers alone hold more than
    /// `buffer_bytes` (`Err`: not answered).
    fn snapshot(&mut self) -> Result<Option<(u64, Arc<Payload>)>, ()> {
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        // before the first batch there is nothing to snapshot
        let Some(seq) = st.next_seq.checked_sub(1) else {
            return Ok(None);
        };
        if let Some((s, p)) = &self.snapshot
            && *s == seq
        {
            return Ok(Some((seq, Arc::clone(p))));
        }
        if self.held_by_answers() >= self.buffer_bytes {
            return Err(());
        }
        let (ts, events) = (st.last_ts, st.mirror.snapshot());
        drop(st);
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
        let replies: Vec<(u64, Arc<Payload>)> = match start {
            None => Vec::new(),
            Some(start) if start == SNAPSHOT_REQUEST => match self.snapshot() {
                Ok(s) => s.into_iter().collect(),
                // answers alone hold too much: no answer (the requester asks again)
                Err(()) => return,
            },
            Some(start) => {
                // a replay shares the buffer's bytes, but they stay held once the buffer
                // drops them: none while answers alone hold more than `buffer_bytes`
                if self.held_by_answers() >= self.buffer_bytes {
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
            if head.is_err() || send_shared(r, &p, zmq::DONTWAIT).is_err() {
                return;
            }
        }
        // a failed end marker: the requester times out and asks again
        if let Err(e) = r.send_multipart([&id[..], b"", b"", &END_SEQ[..], b""], zmq::DONTWAIT) {
            eprintln!("kvtier-events: replay end not sent: {e}");
        }
    }
}
