//! Reconnect delays: exponential with jitter, reset on success. Used wherever the relay waits
//! for a database or broker to come back (start-up, the claim loop, settling, LISTEN).
//!
//! Not to be confused with [`crate::retry`], the policy for a message the broker rejected.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Exponential reconnect delays (doubling up to a cap, 0–20% jitter off each), reset by making
/// a new one on success.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts at `first`, doubles up to `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        Self { next: first, max }
    }

    /// The claim loop's and settling's: 100 ms doubling to 30 s.
    pub fn reconnect() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(30))
    }

    /// Start-up's and the LISTEN session's: 200 ms doubling to 30 s.
    pub fn session() -> Self {
        Self::new(Duration::from_millis(200), Duration::from_secs(30))
    }

    /// The delay to wait now; the following one is twice as long (capped).
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d.mul_f64(0.8 + 0.2 * rand::random::<f64>())
    }
}

/// Sleeps for `d`, or less if `token` is cancelled meanwhile; `false` if it was cancelled.
pub async fn sleep_or_cancel(d: Duration, token: &CancellationToken) -> bool {
    tokio::select! {
        () = tokio::time::sleep(d) => true,
        () = token.cancelled() => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `d` is `nominal` minus at most 20% jitter.
    fn jittered(d: Duration, nominal_ms: u64) -> bool {
        let nominal = Duration::from_millis(nominal_ms);
        d <= nominal && d >= nominal.mul_f64(0.8)
    }

    #[test]
    fn doubles_and_caps() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let delays: Vec<Duration> = (0..5).map(|_| b.next_delay()).collect();
        for (d, nominal) in delays.iter().zip([100, 200, 350, 350, 350]) {
            assert!(jittered(*d, nominal), "{d:?} for {nominal} ms: {delays:?}");
        }
    }

    #[test]
    fn a_new_backoff_starts_over_after_success() {
        // The callers reset by replacing theirs with a fresh one once connected.
        let mut b = Backoff::reconnect();
        for _ in 0..10 {
            b.next_delay();
        }
        assert!(jittered(b.next_delay(), 30_000));
        b = Backoff::reconnect();
        assert!(jittered(b.next_delay(), 100));
        assert!(jittered(Backoff::session().next_delay(), 200));
    }
}
