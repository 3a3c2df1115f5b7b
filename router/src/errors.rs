//! Instances that answer errors: counted per instance (`upstream_errors` in `/stats`), and
//! one whose latest answers were all errors is passed over for a while.
//!
//! Why: an engine that fails fast (a 503 when it is overloaded or broken, a 500 for every
//! request) ends its requests sooner than any healthy instance ends theirs, so by its queue
//! alone it looks the least busy and draws nearly every request while the healthy instances
//! have any prefill pending. Its error answers teach the closed-loop queue nothing (the proxy
//! drops their bookings), and after [`ERROR_STREAK`] errors in a row the instance is skipped
//! for [`ERROR_BACKOFF_S`] while another instance is left; the first request after that
//! tries it again, and one success clears the streak. Each error in a row past the streak
//! doubles the backoff, up to [`ERROR_BACKOFF_MAX_S`], so an instance that stays broken is
//! tried a few times a minute, not every second.
//!
//! A connection refused or timed out ([`UpstreamErrors::unreachable`]) is definitive: the
//! instance is passed over at once. An unreachable host costs each request that tries it a
//! connect timeout, so without this every request paid it (and each of its lookups).

/// Errors in a row (no success between them) after which an instance is passed over.
pub const ERROR_STREAK: u32 = 3;

/// Seconds an instance is passed over after the error that made (or kept) its streak
/// [`ERROR_STREAK`] long.
pub const ERROR_BACKOFF_S: f64 = 1.0;

/// The longest an instance is passed over after an error ([`ERROR_BACKOFF_S`] doubled per
/// error in a row past [`ERROR_STREAK`]).
pub const ERROR_BACKOFF_MAX_S: f64 = 30.0;

/// Each instance's error answers.
#[derive(Clone, Debug)]
pub struct UpstreamErrors {
    /// Per instance: error answers so far.
    errors: Vec<u64>,
    /// Per instance: error answers since its latest success, and when the latest came.
    streak: Vec<(u32, f64)>,
}

impl UpstreamErrors {
    pub fn new(instances: usize) -> Self {
        Self {
            errors: vec![0; instances],
            streak: vec![(0, 0.0); instances],
        }
    }

    /// Instance `i` answered at `now_s` (seconds): a success (`ok`) or an error. An unknown
    /// instance is ignored.
    pub fn answered(&mut self, i: usize, ok: bool, now_s: f64) {
        let (Some(n), Some(s)) = (self.errors.get_mut(i), self.streak.get_mut(i)) else {
            return;
        };
        if ok {
            *s = (0, now_s);
        } else {
            *n += 1;
            *s = (s.0.saturating_add(1), now_s);
        }
    }

    /// Instance `i` could not be connected to at `now_s` (refused, or timed out): it is
    /// passed over at once, as after a streak of errors (one more in a row if it was
    /// already), without counting an error answer. An unknown instance is ignored.
    pub fn unreachable(&mut self, i: usize, now_s: f64) {
        if let Some(s) = self.streak.get_mut(i) {
            *s = (s.0.saturating_add(1).max(ERROR_STREAK), now_s);
        }
    }

    /// Instance `i`'s error answers so far (0 for an unknown instance).
    pub fn errors(&self, i: usize) -> u64 {
        self.errors.get(i).copied().unwrap_or(0)
    }

    /// Whether instance `i` is passed over at `now_s`.
    pub fn backing_off(&self, i: usize, now_s: f64) -> bool {
        self.streak
            .get(i)
            .is_some_and(|&(n, at)| n >= ERROR_STREAK && now_s - at < backoff_s(n))
    }

    /// `exclude` and the instances passed over at `now_s`; `exclude` alone if that would
    /// leave no instance (an instance that errs is still better than none).
    pub fn avoid(&self, exclude: &[usize], now_s: f64) -> Vec<usize> {
        let mut out = exclude.to_vec();
        out.extend(
            (0..self.errors.len()).filter(|&i| !exclude.contains(&i) && self.backing_off(i, now_s)),
        );
        if (0..self.errors.len()).all(|i| out.contains(&i)) {
            out.truncate(exclude.len());
        }
        out
    }
}

/// Seconds an instance is passed over after its `n`th error in a row (`n` at least
/// [`ERROR_STREAK`]).
fn backoff_s(n: u32) -> f64 {
    let doublings = n.saturating_sub(ERROR_STREAK).min(16);
    (ERROR_BACKOFF_S * f64::from(1u32 << doublings)).min(ERROR_BACKOFF_MAX_S)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streak_of_errors_backs_off_until_a_success_or_the_time_is_up() {
        let mut e = UpstreamErrors::new(2);
        for t in 0..ERROR_STREAK - 1 {
            e.answered(1, false, f64::from(t));
            assert!(!e.backing_off(1, f64::from(t)));
        }
        e.answered(1, false, 10.0);
        assert!(e.backing_off(1, 10.0));
        assert_eq!(e.avoid(&[], 10.5), vec![1]);
        assert_eq!(e.avoid(&[0], 10.5), vec![0], "never every instance");
        assert!(!e.backing_off(1, 10.0 + ERROR_BACKOFF_S), "tried again");
        e.answered(1, false, 12.0);
        assert!(e.backing_off(1, 12.0), "still failing: passed over again");
        assert!(
            e.backing_off(1, 12.0 + 1.5 * ERROR_BACKOFF_S),
            "one more in a row: twice as long"
        );
        e.answered(1, true, 12.5);
        assert!(!e.backing_off(1, 12.5));
        assert_eq!(e.errors(1), u64::from(ERROR_STREAK) + 1);
        assert_eq!(e.errors(0), 0);
        e.answered(7, false, 0.0); // unknown: ignored
        assert_eq!(e.errors(7), 0);
    }

    #[test]
    fn an_unreachable_instance_is_passed_over_at_once_and_longer_while_it_stays_so() {
        let mut e = UpstreamErrors::new(2);
        e.unreachable(0, 5.0);
        assert!(e.backing_off(0, 5.0), "at once");
        assert_eq!(e.errors(0), 0, "no error answer");
        assert!(!e.backing_off(0, 5.0 + ERROR_BACKOFF_S));
        let mut at = 5.0;
        for k in 1..12 {
            at += 100.0;
            e.unreachable(0, at);
            let want = (ERROR_BACKOFF_S * 2f64.powi(k)).min(ERROR_BACKOFF_MAX_S);
            assert!(e.backing_off(0, at + want - 0.01), "{k}");
            assert!(!e.backing_off(0, at + want), "{k}");
        }
        e.answered(0, true, at + 100.0);
        e.unreachable(0, at + 101.0);
        assert!(
            !e.backing_off(0, at + 101.0 + ERROR_BACKOFF_S),
            "a success reset it"
        );
        e.unreachable(9, 0.0); // unknown: ignored
        assert!(!e.backing_off(9, 0.0));
    }
}
