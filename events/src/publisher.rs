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
//! Threads: `publish` encodes the batch and assigns its number, then hands the bytes (over an
//! inproc socket) and the events (over a channel, in the same order) to the publisher thread
//! (`worker.rs`), which owns the PUB and ROUTER sockets (ZMQ sockets are not shared between
//! threads), the replay buffer and the mirror: it folds each batch into the mirror as it
//! sends it, so a snapshot it builds holds exactly the batches sent before it, and building
//! one (a second for a large index) holds up no `publish`.

use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use kvtier_radix::KvEvent;

use crate::bind::bind;
use crate::wire::{EncodeError, HashFormat, WireEvent, encode_batch};
use crate::worker::{Batch, Progress, Worker};

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

/// The numbering. The publisher thread never takes this lock (until 2026-12-07 it built
/// snapshots under it, and every `publish` meanwhile waited: 1.2 s for a 500K-block index).
struct State {
    next_seq: u64,
    closed: bool,
}

/// The hand-over to the publisher thread: a batch's bytes on the socket, its events on the
/// channel, in the same order.
struct Handover {
    socket: zmq::Socket,
    events: Sender<Batch>,
}

/// Publishes batches of KV events; dropping it stops its thread and closes its sockets.
pub struct Publisher {
    state: Mutex<State>,
    /// The hand-over to the publisher thread; its lock orders the batches (one publisher at
    /// a time, in number order). A hand-over may wait for the thread, which never takes it.
    /// `None` only once a forked child's shutdown leaked it (see `pid`).
    push: Option<Mutex<Handover>>,
    /// What the publisher thread has folded into its mirror.
    progress: Arc<Progress>,
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
                // no high-water mark: a ROUTER drops what passes it (1,000 by default: a
                // replay with a hole in it and an end marker looks complete), and one of
                // `buffer_steps` + 2 cut a second whole replay on one connection (ZMQ tells
                // the sender of reads only every low-water mark, so messages long read
                // counted as queued). What a requester may have queued is bounded by the
                // bytes it has not read (`worker.rs`); a send to a peer gone is refused
                // (mandatory), never silently dropped
                r.set_sndhwm(0).map_err(zerr("ROUTER high-water mark"))?;
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
        let (events, events_rx) = std::sync::mpsc::channel();
        let progress = Arc::new(Progress::default());
        let worker = Worker::new(
            &cfg,
            pub_sock,
            replay,
            pull,
            events_rx,
            Arc::clone(&progress),
            ctx,
        );
        let thread = std::thread::Builder::new()
            .name("kvtier-events".into())
            .spawn(move || worker.run())
            .map_err(|e| PublishError::Config(format!("cannot start the publisher thread: {e}")))?;
        Ok(Self {
            state: Mutex::new(State {
                next_seq: 0,
                closed: false,
            }),
            push: Some(Mutex::new(Handover {
                socket: push,
                events,
            })),
            progress,
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
        // may wait while the thread is behind (its queue full); the events follow the bytes
        // (the thread waits for them once it has the bytes), so a failed hand-over leaves
        // nothing behind on the channel
        send_whole(&push.socket, [&b"B"[..], &seq.to_be_bytes(), &payload])
            .map_err(zerr("hand the batch to the publisher thread"))?;
        // the thread gone (its receiver dropped): the batch is lost with it, as its bytes
        let _ = push.events.send(Batch {
            seq,
            ts,
            events: events.to_vec(),
        });
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .next_seq += 1;
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

    /// Resident blocks the publisher's mirror holds (what a snapshot would list) once every
    /// batch published before the call is folded in: waits for the publisher thread (at
    /// most a snapshot it is building), not for a thread that is gone.
    pub fn resident_blocks(&self) -> usize {
        let published = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .next_seq;
        let running =
            self.same_process().is_ok() && self.thread.as_ref().is_some_and(|t| !t.is_finished());
        self.progress.resident(published, running)
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
                    .socket
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
