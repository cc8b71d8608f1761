//! Retry policy: capped exponential backoff with jitter, as a pure function.
//!
//! `backoff(n) = min(max_delay, base_delay * 2^(n-1))`, then a delay drawn uniformly from
//! `[d * (1 - jitter), d]`. The random draw is passed in so the policy is testable.

use std::time::Duration;

use crate::backoff::doubled;

/// The retry settings of `[retry]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Delay after the first failed attempt.
    pub base_delay: Duration,
    /// Cap on any single delay.
    pub max_delay: Duration,
    /// Attempts after which a row is dead-lettered (`failed`).
    pub max_attempts: u32,
    /// Fraction of the delay that may be taken off at random (0 ≤ jitter ≤ 1).
    pub jitter: f64,
}

impl RetryPolicy {
    /// The un-jittered delay after `attempts` attempts (1-based; 0 is treated as 1).
    pub fn ceiling(&self, attempts: u32) -> Duration {
        doubled(self.base_delay, attempts.saturating_sub(1), self.max_delay)
    }

    /// The delay before the next attempt, given a uniform draw `unit` in `[0, 1)`.
    pub fn delay(&self, attempts: u32, unit: f64) -> Duration {
        let d = self.ceiling(attempts);
        let unit = unit.clamp(0.0, 1.0);
        let keep = 1.0 - self.jitter * (1.0 - unit);
        d.mul_f64(keep.clamp(0.0, 1.0))
    }

    /// The delay before the next attempt, drawn with the thread RNG.
    pub fn next_delay(&self, attempts: u32) -> Duration {
        self.delay(attempts, rand::random::<f64>())
    }

    /// Whether a row that has used `attempts` attempts is out of retries.
    pub fn exhausted(&self, attempts: u32) -> bool {
        attempts >= self.max_attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
            max_attempts: 12,
            jitter: 0.2,
        }
    }

    #[test]
    fn doubles_from_base_and_caps() {
        let p = policy();
        assert_eq!(p.ceiling(1), Duration::from_secs(1));
        assert_eq!(p.ceiling(2), Duration::from_secs(2));
        assert_eq!(p.ceiling(5), Duration::from_secs(16));
        assert_eq!(p.ceiling(9), Duration::from_secs(256));
        assert_eq!(p.ceiling(10), Duration::from_secs(300));
        assert_eq!(p.ceiling(u32::MAX), Duration::from_secs(300));
        assert_eq!(p.ceiling(0), Duration::from_secs(1));
    }

    #[test]
    fn jitter_stays_within_bounds() {
        let p = policy();
        for attempts in 1..20 {
            let d = p.ceiling(attempts);
            assert_eq!(p.delay(attempts, 1.0), d);
            assert_eq!(p.delay(attempts, 0.0), d.mul_f64(0.8));
            for i in 0..100 {
                let x = p.delay(attempts, f64::from(i) / 100.0);
                assert!(
                    x <= d && x >= d.mul_f64(0.8),
                    "{x:?} outside [{d:?}*0.8, {d:?}]"
                );
            }
        }
    }

    #[test]
    fn zero_jitter_is_exact() {
        let p = RetryPolicy {
            jitter: 0.0,
            ..policy()
        };
        assert_eq!(p.delay(3, 0.123), Duration::from_secs(4));
    }

    #[test]
    fn exhausted_at_max_attempts() {
        let p = policy();
        assert!(!p.exhausted(11));
        assert!(p.exhausted(12));
        assert!(p.exhausted(13));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn delay_is_capped_jittered_and_monotone_in_its_ceiling(
                base_ms in 1u64..10_000,
                extra_ms in 0u64..1_000_000,
                jitter in 0.0f64..=1.0,
                attempts in 0u32..100,
                unit in 0.0f64..1.0,
            ) {
                let p = RetryPolicy {
                    base_delay: Duration::from_millis(base_ms),
                    max_delay: Duration::from_millis(base_ms + extra_ms),
                    max_attempts: 12,
                    jitter,
                };
                let ceiling = p.ceiling(attempts);
                prop_assert!(ceiling <= p.max_delay);
                prop_assert!(ceiling >= p.base_delay.min(p.max_delay));
                prop_assert!(p.ceiling(attempts + 1) >= ceiling);
                let d = p.delay(attempts, unit);
                prop_assert!(d <= ceiling);
                // Allow a nanosecond of float rounding at the lower bound.
                prop_assert!(d + Duration::from_nanos(1) >= ceiling.mul_f64(1.0 - jitter));
            }
        }
    }
}
