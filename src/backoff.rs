//! Reconnect delays: exponential with jitter, reset on success. Used wherever the relay waits
//! for a database or broker to come back (start-up, the claim loop, settling, LISTEN).
//!
//! Not to be confused with [`crate::retry`], the policy for a message the broker rejected.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// The longest pause between two connects to a broker that is down ([`Backoff::broker`]).
pub const BROKER_MAX: Duration = Duration::from_secs(5);

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

    /// The claim loop's (for the database) and settling's: 100 ms doubling to 30 s.
    pub fn reconnect() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(30))
    }

    /// The claim loop's between failed broker connects: 100 ms doubling to 5 s, so that the
    /// relay resumes within about 5 s of the broker's return however long it was gone. A
    /// connect attempt costs a broker little; a sink that asks for longer says so itself (an
    /// HTTP `Retry-After`, the webhook sink's own pause).
    pub fn broker() -> Self {
        Self::new(Duration::from_millis(100), BROKER_MAX)
    }

    /// Start-up's and the LISTEN session's: 200 ms doubling to 30 s.
    pub fn session() -> Self {
        Self::new(Duration::from_millis(200), Duration::from_secs(30))
    }

    /// The delay to wait now; the following one is twice as long (capped).
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = doubled(self.next, 1, self.max);
        d.mul_f64(0.8 + 0.2 * rand::random::<f64>())
    }
}

/// The one capped-doubling policy: `first` doubled `n` times, at most `cap` (never
/// overflowing). Reconnect delays ([`Backoff`]), message retries ([`crate::retry`]), the NATS
/// client's reconnects and the wake-up's rechecks all grow this way.
pub fn doubled(first: Duration, n: u32, cap: Duration) -> Duration {
    let factor = 1u128 << n.min(63);
    let nanos = first.as_nanos().saturating_mul(factor).min(cap.as_nanos());
    let secs = u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX);
    let subsec = u32::try_from(nanos % 1_000_000_000).unwrap_or(0);
    Duration::new(secs, subsec)
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

    #[test]
    fn doubling_is_capped_and_never_overflows() {
        let ms = Duration::from_millis;
        let cap = Duration::from_secs(5);
        let got: Vec<Duration> = (0..8).map(|n| doubled(ms(100), n, cap)).collect();
        let want = [100, 200, 400, 800, 1600, 3200, 5000, 5000].map(ms);
        assert_eq!(got, want);
        assert_eq!(doubled(ms(100), u32::MAX, cap), cap);
        assert_eq!(doubled(Duration::MAX, 3, Duration::MAX), Duration::MAX);
    }

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

    #[test]
    fn a_broker_that_stays_down_is_tried_again_every_five_seconds() {
        let mut b = Backoff::broker();
        assert!(jittered(b.next_delay(), 100));
        for _ in 0..20 {
            b.next_delay();
        }
        assert!(jittered(b.next_delay(), 5_000));
    }
}
