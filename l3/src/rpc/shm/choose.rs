//! Which copy a plain caller buffer takes in `ShmMode::Auto`: in place (the server's
//! `process_vm_readv`/`writev`, one copy) or staged (two memcpys, pipelined), chosen by the
//! throughput each has given this client.
//!
//! Why measured and not fixed: the kernel pins every page of the caller's buffer for an
//! in-place copy, and that costs per page. On caller memory backed by huge pages in-place is
//! the faster path by far (one copy instead of two); on 4 KiB pages it was measured slower
//! than staging on the 2-vCPU VM of docs/l3-bench.md (about 2.5× a memcpy per byte, against
//! two memcpys that overlap across two processes). Which kind of memory a caller passes
//! cannot be asked of the kernel cheaply, so the client keeps a moving estimate of each
//! path's bytes per second, per direction, takes the better one, and tries the other every
//! [`EXPLORE`]th call so that an estimate never goes stale. Calls under [`MIN_BYTES`] are not
//! measured (their time is the round trip, not the copy).

use std::time::Duration;

/// Every this many calls of a direction, the path that is not the best is tried.
pub const EXPLORE: u64 = 8;
/// Calls moving fewer bytes do not update the estimates.
pub const MIN_BYTES: usize = 1 << 20;

/// A copy path for plain buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyPath {
    /// The server copies in place.
    InPlace,
    /// Through the staging segment.
    Staged,
}

/// A direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// Put (client → server).
    Put,
    /// Get (server → client).
    Get,
}

/// Moving throughput estimates (bytes/s) per direction and path.
#[derive(Debug, Default)]
pub struct Chooser {
    est: [[Option<f64>; 2]; 2],
    calls: [u64; 2],
}

fn ix(p: CopyPath) -> usize {
    match p {
        CopyPath::InPlace => 0,
        CopyPath::Staged => 1,
    }
}

fn other(p: CopyPath) -> CopyPath {
    match p {
        CopyPath::InPlace => CopyPath::Staged,
        CopyPath::Staged => CopyPath::InPlace,
    }
}

impl Chooser {
    /// The path for the next call of `way`: an unmeasured path first (in place before
    /// staged), else the faster, except every [`EXPLORE`]th call.
    pub fn pick(&mut self, way: Way) -> CopyPath {
        let w = way as usize;
        self.calls[w] += 1;
        let [a, b] = self.est[w];
        match (a, b) {
            (None, _) => CopyPath::InPlace,
            (_, None) => CopyPath::Staged,
            (Some(a), Some(b)) => {
                let best = if a >= b {
                    CopyPath::InPlace
                } else {
                    CopyPath::Staged
                };
                if self.calls[w].is_multiple_of(EXPLORE) {
                    other(best)
                } else {
                    best
                }
            }
        }
    }

    /// A call of `way` on `path` moved `bytes` in `took`.
    pub fn record(&mut self, way: Way, path: CopyPath, bytes: usize, took: Duration) {
        let secs = took.as_secs_f64();
        if bytes < MIN_BYTES || secs <= 0.0 {
            return;
        }
        let rate = bytes as f64 / secs;
        let e = &mut self.est[way as usize][ix(path)];
        *e = Some(match *e {
            Some(old) => 0.7 * old + 0.3 * rate,
            None => rate,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn each_path_is_measured_then_the_faster_wins_with_exploration() {
        let mut c = Chooser::default();
        assert_eq!(c.pick(Way::Put), CopyPath::InPlace);
        c.record(Way::Put, CopyPath::InPlace, 4 << 20, 4 * MS);
        assert_eq!(c.pick(Way::Put), CopyPath::Staged);
        c.record(Way::Put, CopyPath::Staged, 4 << 20, MS);
        // Staged is 4× faster: it wins, except each EXPLORE-th call.
        let picks: Vec<CopyPath> = (0..2 * EXPLORE).map(|_| c.pick(Way::Put)).collect();
        let explored = picks.iter().filter(|&&p| p == CopyPath::InPlace).count();
        assert_eq!(explored, 2);
        // Gets are measured on their own.
        assert_eq!(c.pick(Way::Get), CopyPath::InPlace);
        // Small calls do not move the estimates.
        c.record(Way::Put, CopyPath::InPlace, 100, Duration::from_nanos(1));
        assert_eq!(c.pick(Way::Put), CopyPath::Staged);
    }

    proptest! {
        /// Whatever the measurements, the better-estimated path is taken at least
        /// (EXPLORE-1)/EXPLORE of the time once both are measured.
        #[test]
        fn the_faster_path_dominates(fast in 1u64..1000, slow in 1u64..1000, n in 16usize..200) {
            prop_assume!(fast != slow);
            let mut c = Chooser::default();
            let (tf, ts) = (Duration::from_micros(fast), Duration::from_micros(slow));
            let best = if fast < slow { CopyPath::InPlace } else { CopyPath::Staged };
            let mut hits = 0usize;
            for i in 0..n {
                let p = c.pick(Way::Get);
                if i >= 2 && p == best {
                    hits += 1;
                }
                let t = if p == CopyPath::InPlace { tf } else { ts };
                c.record(Way::Get, p, 8 << 20, t);
            }
            let measured = n - 2;
            prop_assert!(hits * EXPLORE as usize >= measured * (EXPLORE as usize - 1) - EXPLORE as usize);
        }
    }
}
