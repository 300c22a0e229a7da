//! When to try a failed call again: exponential backoff with full jitter, and the wait a server's
//! `Retry-After` asks for (seconds or an HTTP date), both capped by the time the caller has left.
//!
//! Full jitter (a uniform draw from zero to the exponential bound, as AWS's "Exponential Backoff
//! and Jitter" recommends) spreads clients that failed together, e.g. every gateway of a verifier
//! that just restarted, instead of bringing them back in lockstep.

use std::time::{Duration, SystemTime};

use rand::Rng;

/// Exponential backoff with full jitter: attempt `n` (0-based) waits a uniform time in
/// `[0, min(cap, base · 2^n)]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
}

impl Backoff {
    /// The bound attempt `n`'s wait is drawn under.
    pub fn bound(&self, attempt: u32) -> Duration {
        self.base.saturating_mul(1u32 << attempt.min(20)).min(self.cap)
    }

    /// Attempt `n`'s wait.
    pub fn wait(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        self.bound(attempt).mul_f64(rng.random_range(0.0..=1.0))
    }
}

/// The wait a `Retry-After` value asks for: delay-seconds or an HTTP date (RFC 9110 §10.2.3),
/// relative to `now`. A date in the past asks for no wait; anything else unreadable is None.
pub fn retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// `wait`, unless it would end past `deadline` (the caller's own time limit): then None, as
/// waiting would only fail later.
pub fn within(
    wait: Duration,
    now: std::time::Instant,
    deadline: std::time::Instant,
) -> Option<Duration> {
    (now + wait <= deadline).then_some(wait)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use std::time::Instant;

    #[test]
    fn backoff_bound_doubles_up_to_the_cap() {
        let b = Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(2) };
        let bounds: Vec<u128> = (0..7).map(|n| b.bound(n).as_millis()).collect();
        assert_eq!(bounds, [100, 200, 400, 800, 1600, 2000, 2000]);
        assert_eq!(b.bound(u32::MAX), Duration::from_secs(2));
    }

    #[test]
    fn full_jitter_spreads_over_the_whole_range() {
        let b = Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(10) };
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let waits: Vec<f64> = (0..2000).map(|_| b.wait(3, &mut rng).as_secs_f64()).collect();
        assert!(waits.iter().all(|&w| (0.0..=0.8).contains(&w)));
        // Uniform on [0, 0.8]: each fifth of the range holds about a fifth of the draws.
        for k in 0..5 {
            let (lo, hi) = (k as f64 * 0.16, (k + 1) as f64 * 0.16);
            let share = waits.iter().filter(|&&w| w >= lo && w < hi).count() as f64 / 2000.0;
            assert!((share - 0.2).abs() < 0.04, "fifth {k}: {share}");
        }
    }

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(retry_after("120", now), Some(Duration::from_secs(120)));
        assert_eq!(retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            retry_after("Sun, 06 Nov 1994 08:49:47 GMT", now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(retry_after("Sun, 06 Nov 1994 08:49:00 GMT", now), Some(Duration::ZERO));
        assert_eq!(retry_after("-1", now), None);
        assert_eq!(retry_after("soon", now), None);
    }

    #[test]
    fn waits_past_the_deadline_are_refused() {
        let now = Instant::now();
        let deadline = now + Duration::from_secs(5);
        assert_eq!(within(Duration::from_secs(5), now, deadline), Some(Duration::from_secs(5)));
        assert_eq!(within(Duration::from_secs(6), now, deadline), None);
    }
}
