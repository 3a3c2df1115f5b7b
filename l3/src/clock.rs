//! The store's monotonic millisecond clock.
//!
//! Why: leases, put timeouts, client liveness and promotion TTLs are all deadlines; keeping
//! them on one monotonic clock (never wall time, which jumps) makes them comparable, and a
//! lease deadline handed out in a [`crate::QueryResult`] is checked against the same clock
//! when the result comes back. Tests and the simulator can move the clock forward with
//! [`Clock::advance`] instead of sleeping.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Milliseconds since the store started, plus any manual advance.
#[derive(Debug)]
pub struct Clock {
    start: Instant,
    skew_ms: AtomicU64,
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock {
    /// A clock starting at 0 now.
    pub fn new() -> Self {
        Clock {
            start: Instant::now(),
            skew_ms: AtomicU64::new(0),
        }
    }

    /// Current time in ms.
    pub fn now_ms(&self) -> u64 {
        let real = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        real.saturating_add(self.skew_ms.load(Ordering::Relaxed))
    }

    /// Moves the clock forward (tests, simulation). Time never goes back.
    pub fn advance(&self, d: Duration) {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        // saturating: a wrapped skew would move the clock back (leases alive again); the
        // closure never refuses, so the update always happens
        self.skew_ms
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_add(ms))
            })
            .ok();
    }
}

/// Duration → whole milliseconds, saturating.
pub fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A background thread that runs `tick` every `period` until stopped (or until `tick`
/// returns false). Stopping wakes it at once; dropping stops it.
pub struct Periodic {
    stop: Option<std::sync::mpsc::SyncSender<()>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Periodic {
    /// Spawns the thread.
    pub fn spawn(
        name: &str,
        period: Duration,
        mut tick: impl FnMut() -> bool + Send + 'static,
    ) -> crate::error::L3Result<Self> {
        use std::sync::mpsc::RecvTimeoutError;
        let (tx, rx) = std::sync::mpsc::sync_channel::<()>(1);
        let h = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                loop {
                    match rx.recv_timeout(period) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    if !tick() {
                        return;
                    }
                }
            })
            .map_err(|e| crate::error::L3Error::Internal(format!("spawn {name}: {e}")))?;
        Ok(Periodic {
            stop: Some(tx),
            handle: Some(h),
        })
    }

    /// Stops the thread and waits for it (unless called from the thread itself).
    pub fn stop(&mut self) {
        drop(self.stop.take());
        if let Some(h) = self.handle.take()
            && h.thread().id() != std::thread::current().id()
        {
            crate::error::join_logged("clock ticker", h);
        }
    }
}

impl Drop for Periodic {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Advancing saturates: a clock pushed to its top stays there instead of wrapping to
    /// 0 (which made expired leases live again and fresh ones never expire).
    #[test]
    fn advancing_past_the_top_saturates_and_never_goes_back() {
        let c = Clock::new();
        c.advance(Duration::from_millis(1 << 63));
        let before = c.now_ms();
        c.advance(Duration::from_millis(1 << 63));
        assert!(c.now_ms() >= before, "time went back");
        assert_eq!(c.now_ms(), u64::MAX);
        c.advance(Duration::from_millis(2));
        assert_eq!(c.now_ms(), u64::MAX);
        c.advance(Duration::MAX);
        assert_eq!(c.now_ms(), u64::MAX);
    }
}
