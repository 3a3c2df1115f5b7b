//! Batches shared between the replay buffer and the answers ZMQ still holds, and the count
//! of the bytes that only answers hold.
//!
//! Why: a replay or snapshot answer copied into a ROUTER's queue stays there until its
//! requester reads it. A requester that asks and never reads (or many asking at once) had a
//! copy of every answer queued at the publisher: a snapshot asked for 2,000 times took
//! 2,000 copies of the index, in the engine's memory. Here an answer is sent as a reference
//! to the bytes the publisher already holds (ZMQ's `zmq_msg_init_data`, released by ZMQ
//! when the last queue lets go of it), and [`Pool::alive`] counts every payload's bytes
//! until both the publisher and ZMQ have let go, so the publisher can tell how much only
//! answers still hold and stop answering past a bound. [`Requesters`] counts the same per
//! requester, so one that does not read is refused before the others are.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A batch's (or a snapshot's) encoded bytes; its size leaves [`Pool::alive`] when the last
/// reference (the buffer's, the snapshot cache's, one per queued answer) goes.
pub(crate) struct Payload {
    bytes: Vec<u8>,
    alive: Arc<AtomicUsize>,
}

impl Payload {
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        self.alive.fetch_sub(self.bytes.len(), Ordering::Relaxed);
    }
}

/// Makes payloads and counts their bytes while any is referenced.
#[derive(Default)]
pub(crate) struct Pool {
    alive: Arc<AtomicUsize>,
}

impl Pool {
    pub(crate) fn payload(&self, bytes: Vec<u8>) -> Arc<Payload> {
        self.alive.fetch_add(bytes.len(), Ordering::Relaxed);
        Arc::new(Payload {
            bytes,
            alive: Arc::clone(&self.alive),
        })
    }

    /// Bytes of every payload someone still references.
    pub(crate) fn alive(&self) -> usize {
        self.alive.load(Ordering::Relaxed)
    }
}

/// The bytes of the answers queued for each requester (by its ROUTER identity) that it has
/// not read yet.
#[derive(Default)]
pub(crate) struct Requesters {
    unread: HashMap<Vec<u8>, Arc<AtomicUsize>>,
    /// Entries kept after the last sweep; the next sweep at twice as many.
    kept: usize,
}

impl Requesters {
    /// The count of requester `id` (a new one: 0).
    pub(crate) fn of(&mut self, id: &[u8]) -> Arc<AtomicUsize> {
        if !self.unread.contains_key(id) && self.unread.len() >= 2 * self.kept.max(64) {
            // requesters come and go (a new identity per connection): forget those with
            // nothing queued
            self.unread.retain(|_, n| n.load(Ordering::Relaxed) > 0);
            self.kept = self.unread.len();
        }
        Arc::clone(self.unread.entry(id.to_vec()).or_default())
    }
}

/// What a queued message costs beyond its payload (ZMQ's message, its other frames, the
/// pipe's slot), as counted against its requester: an end marker is not free.
pub(crate) const MESSAGE_COST: usize = 256;

/// What a queued message holds: its bytes, and the count of its requester's unread bytes.
struct Held {
    payload: Arc<Payload>,
    unread: Arc<AtomicUsize>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.unread
            .fetch_sub(self.payload.bytes.len() + MESSAGE_COST, Ordering::Relaxed);
    }
}

/// ZMQ's free function: drops what the message held (on ZMQ's I/O thread, or here when a
/// send fails).
unsafe extern "C" fn release(_data: *mut c_void, hint: *mut c_void) {
    // SAFETY: `hint` is the `Box<Held>` leaked by `send_shared`, released once.
    drop(unsafe { Box::from_raw(hint.cast::<Held>()) });
}

/// Sends `p`'s bytes as one frame of `socket` without copying them: the message holds a
/// reference to `p`, and counts its bytes in `unread`, until ZMQ is done with it.
pub(crate) fn send_shared(
    socket: &mut zmq::Socket,
    p: &Arc<Payload>,
    unread: &Arc<AtomicUsize>,
    flags: i32,
) -> Result<(), zmq::Error> {
    unread.fetch_add(p.bytes.len() + MESSAGE_COST, Ordering::Relaxed);
    let held = Box::into_raw(Box::new(Held {
        payload: Arc::clone(p),
        unread: Arc::clone(unread),
    }));
    let mut msg = MaybeUninit::<zmq_sys::zmq_msg_t>::uninit();
    // SAFETY: the data pointer and length are the payload's, which `held` keeps alive (and
    // unmoved: a Vec's buffer) until ZMQ calls `release` with `held` as its hint.
    let rc = unsafe {
        zmq_sys::zmq_msg_init_data(
            msg.as_mut_ptr(),
            p.bytes.as_ptr().cast_mut().cast(),
            p.bytes.len(),
            Some(release),
            held.cast(),
        )
    };
    if rc == -1 {
        // SAFETY: not handed to ZMQ: the reference is ours to drop
        drop(unsafe { Box::from_raw(held) });
        return Err(zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }));
    }
    // SAFETY: `msg` was initialised above; `socket` is a live socket of this thread.
    let rc = unsafe { zmq_sys::zmq_msg_send(msg.as_mut_ptr(), socket.as_mut_ptr(), flags) };
    if rc == -1 {
        let e = zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() });
        // SAFETY: a failed send leaves the message ours: closing it calls `release`
        unsafe { zmq_sys::zmq_msg_close(msg.as_mut_ptr()) };
        return Err(e);
    }
    Ok(())
}
