//! One thread per event stream: a ZMQ SUB socket on the publisher's endpoint and, for
//! recovery, requests to its replay socket (vLLM's protocol; a snapshot is `start = -2`).
//!
//! At start the thread asks for a snapshot so the index is complete however late the router
//! starts; then it folds live batches in order ([`crate::stream::Tracker`]), replays a gap, and
//! every `resync` of quiet asks for anything after its last batch (a lost tail is otherwise
//! invisible until the next batch). A monitor on the SUB socket reports a reconnect after a
//! disconnect, and the stream then syncs with a snapshot at once: the publisher on the other
//! end may be a new incarnation (a restarted engine, a new L3 leader) whose numbers say
//! nothing about ours ([`Tracker::reconnected`]). A publisher that is down or does not answer only leaves
//! its pages missing or stale: nothing here waits longer than the replay timeout, and routing
//! never waits on a stream.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cluster::Cluster;
use crate::stream::{Apply, History, Replayed, Tracker};

/// One stream to follow.
#[derive(Clone, Debug)]
pub struct StreamSpec {
    /// The publisher's PUB endpoint (`tcp://host:port`).
    pub endpoint: String,
    /// Its replay ROUTER endpoint (`None`: no gap recovery, no snapshot).
    pub replay: Option<String>,
    /// The topic every batch must name, live and replayed (`None`: any). A live batch of
    /// another topic is dropped before its number is looked at (`foreign_topic`); a replay
    /// answer holding one, or without topics (a publisher before vLLM 0.32's framing), is
    /// no answer. So a stream of another model's pages is never folded in, whatever the
    /// endpoint says.
    pub topic: Option<String>,
}

#[derive(Clone, Copy, Debug)]
pub struct SubscribeOptions {
    /// How long to wait for each message of a replay answer.
    pub replay_timeout: Duration,
    /// Quiet time after which the stream asks whether it missed the tail.
    pub resync: Duration,
    /// A batch longer than this is skipped undecoded (counted `oversized`), and a replay
    /// answer holding more than four times this is no answer (`unanswered`): what one
    /// publisher can make the router hold. It is also every socket's largest frame
    /// (`ZMQ_MAXMSGSIZE`): a publisher sending a longer one, live or in a replay answer, is
    /// disconnected before the frame is read (live: the SUB reconnects and resyncs, counted
    /// `reconnects`; a replay: no answer). A decoded batch takes up to ~50 times its bytes.
    pub max_batch_bytes: usize,
    /// After a replay or snapshot request goes unanswered, how long the replay socket is not
    /// asked again: requests meanwhile are unanswered at once (counted `unanswered`; a gap
    /// is then lost and the live batches go on). A dead or silent replay socket otherwise
    /// held the stream up a replay timeout (two at a gap) at every gap.
    pub replay_backoff: Duration,
}

/// Live batches the SUB socket queues ahead of the stream's thread (its receive high-water
/// mark). Small, because each may be a frame of up to `max_batch_bytes`: the SUB holds at
/// most this many batches, one more being received (ZMQ reads it whole) and the one the
/// thread has taken. Batches the publisher sends while the queue is full wait in its own send
/// queue (or are dropped there: a gap, recovered by replay).
pub const LIVE_HWM: i32 = 2;

/// Replay answer batches a replay DEALER socket reads ahead of [`Answer`] (its receive
/// high-water mark): a flood of large batches is refused at the answer's cap, not read ahead.
pub const REPLAY_HWM: i32 = 2;

/// Bounds what a socket receives: no frame larger than `max_frame` (a publisher that sends
/// one is disconnected before the frame is read: ZMQ's `ZMQ_MAXMSGSIZE`) and at most `hwm`
/// messages queued.
fn bound_receive(s: &zmq::Socket, max_frame: usize, hwm: i32) -> Result<(), zmq::Error> {
    s.set_maxmsgsize(i64::try_from(max_frame).unwrap_or(i64::MAX))?;
    s.set_rcvhwm(hwm)
}

/// [`SubscribeOptions::max_batch_bytes`]'s default: 64 MiB, past kvtier's snapshot of a
/// 500K-block host tier (~25 MB) and far past an engine step's batch (well under 1 MiB).
pub const MAX_BATCH_BYTES: usize = 64 << 20;

impl Default for SubscribeOptions {
    fn default() -> Self {
        Self {
            replay_timeout: Duration::from_millis(500),
            resync: Duration::from_secs(5),
            max_batch_bytes: MAX_BATCH_BYTES,
            replay_backoff: Duration::from_secs(5),
        }
    }
}

/// A replay answer being received, bounded: past `cap` bytes it is no answer.
struct Answer {
    batches: Vec<(i64, Vec<u8>)>,
    bytes: usize,
    cap: usize,
}

impl Answer {
    fn new(cap: usize) -> Self {
        Answer {
            batches: Vec::new(),
            bytes: 0,
            cap,
        }
    }

    /// Adds a batch; `None` once the answer holds more than its cap.
    fn push(&mut self, seq: i64, payload: &[u8]) -> Option<()> {
        self.bytes = self.bytes.saturating_add(payload.len());
        (self.bytes <= self.cap).then(|| self.batches.push((seq, payload.to_vec())))
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct SubscribeError {
    what: String,
    #[source]
    source: zmq::Error,
}

fn zerr(what: impl Into<String>) -> impl FnOnce(zmq::Error) -> SubscribeError {
    let what = what.into();
    move |source| SubscribeError { what, source }
}

/// The replay socket of one publisher, asked through a fresh DEALER per request (so an answer
/// that arrives after a timeout never mixes into the next request's). vLLM 0.32 reads the
/// start number unsigned, so it answers a snapshot request (-2) with the end marker alone;
/// the tracker then replays from 0 on the first gap or resync, which is vLLM's full history
/// while its buffer still starts at 0.
struct ZmqHistory {
    ctx: zmq::Context,
    endpoint: Option<String>,
    timeout: Duration,
    topic: Option<Vec<u8>>,
    /// The most bytes one answer may hold.
    max_answer_bytes: usize,
    /// The longest frame its socket receives.
    max_frame_bytes: usize,
    /// How long not to ask after a request went unanswered.
    backoff: Duration,
    /// Not asked again before this (a request went unanswered).
    quiet_until: Option<Instant>,
}

impl History for ZmqHistory {
    fn replay(&mut self, from: i64) -> Replayed {
        if self.quiet_until.is_some_and(|t| Instant::now() < t) {
            return None;
        }
        let answer = self.ask(from);
        self.quiet_until = match answer {
            Some(_) => None,
            None => Instant::now().checked_add(self.backoff),
        };
        answer
    }
}

impl ZmqHistory {
    fn ask(&mut self, from: i64) -> Replayed {
        let ep = self.endpoint.as_ref()?;
        let s = self.ctx.socket(zmq::DEALER).ok()?;
        s.set_linger(0).ok()?;
        bound_receive(&s, self.max_frame_bytes, REPLAY_HWM).ok()?;
        s.connect(ep).ok()?;
        s.send_multipart([&b""[..], &from.to_be_bytes()[..]], zmq::DONTWAIT)
            .ok()?;
        let ms = i64::try_from(self.timeout.as_millis()).unwrap_or(i64::MAX);
        // a publisher that answers forever is cut off (the answer is then no answer)
        let deadline = Instant::now()
            .checked_add(self.timeout.saturating_mul(20).max(Duration::from_secs(10)));
        let mut out = Answer::new(self.max_answer_bytes);
        loop {
            if deadline.is_some_and(|d| Instant::now() > d) {
                return None;
            }
            let mut items = [s.as_poll_item(zmq::POLLIN)];
            match zmq::poll(&mut items, ms) {
                Ok(n) if n > 0 => {}
                // A signal handled on this thread is not the publisher's silence: wait again
                // (within the deadline above).
                Err(zmq::Error::EINTR) => continue,
                _ => return None,
            }
            let frames = loop {
                match s.recv_multipart(0) {
                    Ok(frames) => break frames,
                    Err(zmq::Error::EINTR) => {}
                    Err(_) => return None,
                }
            };
            // ["", seq, payload] (vLLM before 0.32, kvtier before 2026-12-05) or
            // ["", topic, seq, payload] (vLLM 0.32 adds the topic, as on the PUB socket)
            let (topic, seq, payload) = match frames.as_slice() {
                [_, seq, payload] => (None, seq, payload),
                [_, topic, seq, payload] => (Some(topic), seq, payload),
                _ => return None,
            };
            let seq = i64::from_be_bytes(<[u8; 8]>::try_from(seq.as_slice()).ok()?);
            if seq == -1 {
                return Some(out.batches);
            }
            if let Some(want) = &self.topic
                && topic != Some(want)
            {
                return None; // another stream's history (or one that cannot say): none
            }
            out.push(seq, payload)?; // a flood is no answer
        }
    }
}

/// Follows one stream until `stop` is set; the stream's state is `cluster.streams[stream]`.
pub fn spawn(
    spec: StreamSpec,
    stream: usize,
    cluster: Arc<Mutex<Cluster>>,
    stop: Arc<AtomicBool>,
    opts: SubscribeOptions,
) -> Result<JoinHandle<()>, SubscribeError> {
    // zmq's connect panics on a NUL byte (`CString::new(..).unwrap()`); the replay socket is
    // connected later, in the subscriber thread: refuse both here
    if let Some(ep) = std::iter::once(&spec.endpoint)
        .chain(spec.replay.as_ref())
        .find(|ep| ep.contains('\0'))
    {
        return Err(SubscribeError {
            what: format!("endpoint {ep:?} contains a NUL byte"),
            source: zmq::Error::EINVAL,
        });
    }
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).map_err(zerr("SUB socket"))?;
    sub.set_subscribe(b"").map_err(zerr("subscribe"))?;
    sub.set_linger(0).map_err(zerr("SUB linger"))?;
    bound_receive(&sub, opts.max_batch_bytes, LIVE_HWM).map_err(zerr("SUB receive bounds"))?;
    // The SUB's connection events: a reconnect after a disconnect may be a new publisher
    // incarnation on the same address ([`Tracker::reconnected`]).
    let mon_ep = "inproc://kvtier-router-sub-monitor";
    sub.monitor(
        mon_ep,
        (zmq::SocketEvent::DISCONNECTED as i32) | (zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32),
    )
    .map_err(zerr("monitor the SUB"))?;
    let mon = ctx.socket(zmq::PAIR).map_err(zerr("SUB monitor socket"))?;
    mon.set_linger(0).map_err(zerr("SUB monitor linger"))?;
    mon.connect(mon_ep)
        .map_err(zerr("connect the SUB monitor"))?;
    sub.connect(&spec.endpoint)
        .map_err(zerr(format!("connect SUB {}", spec.endpoint)))?;
    let history = ZmqHistory {
        ctx,
        endpoint: spec.replay,
        timeout: opts.replay_timeout,
        topic: spec.topic.map(String::into_bytes),
        max_answer_bytes: opts.max_batch_bytes.saturating_mul(4),
        max_frame_bytes: opts.max_batch_bytes,
        backoff: opts.replay_backoff,
        quiet_until: None,
    };
    std::thread::Builder::new()
        .name(format!("kvtier-router-sub-{stream}"))
        .spawn(move || {
            let live = Live {
                sub,
                mon,
                endpoint: spec.endpoint,
            };
            follow(live, history, stream, &cluster, &stop, opts)
        })
        .map_err(|e| SubscribeError {
            what: format!("start the subscriber thread: {e}"),
            source: zmq::Error::EFAULT,
        })
}

/// What a SUB monitor message says: `Some(true)` disconnected, `Some(false)` connected
/// (handshake done), `None` anything else. The first frame is the event (u16, native
/// endianness) and its value (u32).
fn connection_event(frames: &[Vec<u8>]) -> Option<bool> {
    let f = frames.first()?;
    let ev = u16::from_ne_bytes([*f.first()?, *f.get(1)?]);
    if ev == zmq::SocketEvent::DISCONNECTED.to_raw() {
        Some(true)
    } else if ev == zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw() {
        Some(false)
    } else {
        None
    }
}

/// The live side of a stream: its SUB socket, the SUB's monitor, the publisher's endpoint.
struct Live {
    sub: zmq::Socket,
    mon: zmq::Socket,
    endpoint: String,
}

fn follow(
    live: Live,
    mut history: ZmqHistory,
    stream: usize,
    cluster: &Mutex<Cluster>,
    stop: &AtomicBool,
    opts: SubscribeOptions,
) {
    let Live { sub, mon, endpoint } = live;
    let mut tracker = Tracker::with_max_batch_bytes(opts.max_batch_bytes);
    let topic = history.topic.clone();
    let lock = || cluster.lock().unwrap_or_else(PoisonError::into_inner);
    // a batch is decoded before the lock is taken: decoding is most of its cost
    let mut sink = |a: Apply<'_>| {
        let a = match a {
            Apply::Batch(p) => Apply::Decoded(crate::index::DecodedBatch::of(p)),
            Apply::Replace(p) => Apply::ReplaceDecoded(crate::index::DecodedBatch::of(p)),
            a => a,
        };
        lock().apply(stream, a)
    };
    let publish = |t: &Tracker| {
        let mut c = lock();
        if let Some(s) = c.streams.get_mut(stream) {
            s.next_seq = t.next();
            s.counters = t.counters.clone();
        }
    };
    tracker.sync(&mut history, &mut sink);
    publish(&tracker);
    let mut last = Instant::now();
    let mut lost_publisher = false;
    while !stop.load(Ordering::Relaxed) {
        let mut items = [sub.as_poll_item(zmq::POLLIN), mon.as_poll_item(zmq::POLLIN)];
        let (ready, watched) = match zmq::poll(&mut items, 100) {
            Ok(n) => (n > 0 && items[0].is_readable(), items[1].is_readable()),
            Err(_) => {
                // an interrupted poll: no busy loop
                std::thread::sleep(Duration::from_millis(50));
                (false, false)
            }
        };
        if watched && let Ok(frames) = mon.recv_multipart(0) {
            match connection_event(&frames) {
                Some(true) => {
                    lost_publisher = true;
                    // ZMQ reconnects after a lost connection, but not after a protocol
                    // error (a frame past `ZMQ_MAXMSGSIZE` ends the session for good): a new
                    // connection either way
                    let _ = sub.disconnect(&endpoint);
                    let _ = sub.connect(&endpoint);
                }
                Some(false) if lost_publisher => {
                    lost_publisher = false;
                    tracker.reconnected(&mut history, &mut sink);
                    publish(&tracker);
                    last = Instant::now();
                }
                _ => {}
            }
        }
        if !ready {
            if watched {
                continue;
            }
            if last.elapsed() >= opts.resync {
                tracker.catch_up(&mut history, &mut sink);
                publish(&tracker);
                last = Instant::now();
            }
            continue;
        }
        let Ok(frames) = sub.recv_multipart(0) else {
            continue;
        };
        last = Instant::now();
        match frames.as_slice() {
            [t, _, _] if topic.as_ref().is_some_and(|want| want != t) => {
                tracker.counters.foreign_topic += 1;
            }
            [_, seq, payload] if seq.len() == 8 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(seq);
                tracker.on_live(u64::from_be_bytes(b), payload, &mut history, &mut sink);
            }
            _ => tracker.counters.garbage += 1,
        }
        publish(&tracker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both sockets refuse a frame past the batch cap and queue only a few batches (they
    /// set no bound before: a 3 GiB frame was read whole, and 100,000 frames could queue).
    #[test]
    fn receiving_sockets_are_bounded_by_the_batch_cap() {
        let ctx = zmq::Context::new();
        for kind in [zmq::SUB, zmq::DEALER] {
            let s = ctx.socket(kind).expect("socket");
            bound_receive(&s, 1 << 20, LIVE_HWM).expect("bounds");
            assert_eq!(s.get_maxmsgsize().expect("maxmsgsize"), 1 << 20);
            assert_eq!(s.get_rcvhwm().expect("rcvhwm"), LIVE_HWM);
        }
    }

    /// A replay answer is kept up to its cap; one byte past it, it is no answer.
    #[test]
    fn a_replay_answer_past_its_cap_is_no_answer() {
        let mut a = Answer::new(10);
        assert_eq!(a.push(0, &[0; 4]), Some(()));
        assert_eq!(a.push(1, &[0; 6]), Some(()));
        assert_eq!(a.batches.len(), 2);
        assert_eq!(a.push(2, &[0; 1]), None);
        assert_eq!(a.batches.len(), 2, "nothing past the cap is kept");
    }

    extern "C" fn ignore(_: libc::c_int) {}

    /// A signal delivered to the thread asking a replay (any handler installed without
    /// `SA_RESTART`: a runtime's, a profiler's) interrupts `zmq::poll`; the request was given
    /// up as unanswered and the replay backed off, leaving the gap open. An interrupted wait
    /// is waited again.
    #[test]
    fn an_interrupted_wait_for_a_replay_answer_waits_again() {
        // SAFETY: a no-op handler for SIGUSR1, which no other test uses.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = ignore as extern "C" fn(libc::c_int) as usize;
            sa.sa_flags = 0; // no SA_RESTART
            libc::sigemptyset(&mut sa.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
        }
        let ctx = zmq::Context::new();
        let server = ctx.socket(zmq::ROUTER).expect("ROUTER");
        server.bind("tcp://127.0.0.1:*").expect("bind");
        let endpoint = server
            .get_last_endpoint()
            .expect("endpoint")
            .expect("utf-8");
        let answering = std::thread::spawn(move || {
            let ask = server.recv_multipart(0).expect("request");
            std::thread::sleep(Duration::from_millis(400));
            let id = ask[0].clone();
            let reply = |seq: i64, payload: &[u8]| {
                server
                    .send_multipart([&id[..], b"", &seq.to_be_bytes()[..], payload], 0)
                    .expect("reply");
            };
            reply(0, b"batch");
            reply(-1, b"");
            std::thread::sleep(Duration::from_millis(200));
        });
        let mut history = ZmqHistory {
            ctx: ctx.clone(),
            endpoint: Some(endpoint),
            timeout: Duration::from_secs(2),
            topic: None,
            max_answer_bytes: 1 << 20,
            max_frame_bytes: 1 << 20,
            backoff: Duration::from_secs(1),
            quiet_until: None,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let asking = std::thread::spawn(move || {
            // SAFETY: this thread's own id, used while it lives (it is joined below).
            tx.send(unsafe { libc::pthread_self() }).expect("send");
            history.ask(0)
        });
        let tid = rx.recv().expect("tid");
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(100));
            // SAFETY: the asking thread has not been joined yet.
            assert_eq!(unsafe { libc::pthread_kill(tid, libc::SIGUSR1) }, 0);
        }
        let answer = asking.join().expect("asking thread");
        answering.join().expect("answering thread");
        let batches = answer.expect("interrupted: the answer was given up");
        assert_eq!(batches.len(), 1);
    }
}
