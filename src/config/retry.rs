//! `[retry]`: the backoff of a message the broker rejected, and when it is dead-lettered.

use serde::{Deserialize, Serialize};

use super::{ConfigError, HumanDuration, positive};
use crate::retry::RetryPolicy;

/// `[retry]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRetry {
    /// First retry delay (default 1s).
    pub base_delay: HumanDuration,
    /// Delay cap (default 5m).
    pub max_delay: HumanDuration,
    /// Attempts before dead-lettering (default 12).
    pub max_attempts: u32,
    /// Random fraction taken off each delay (default 0.2).
    pub jitter: f64,
}

impl Default for RawRetry {
    fn default() -> Self {
        Self {
            base_delay: super::dur("1s"),
            max_delay: super::dur("5m"),
            max_attempts: 12,
            jitter: 0.2,
        }
    }
}

impl RawRetry {
    /// Checks the section.
    pub(super) fn validate(self) -> Result<RetryPolicy, ConfigError> {
        let rt = self;
        positive("retry.base_delay", rt.base_delay)?;
        if rt.max_delay.0 < rt.base_delay.0 {
            return Err(ConfigError::invalid(
                "retry.max_delay",
                "must be at least retry.base_delay",
            ));
        }
        if rt.max_attempts == 0 {
            return Err(ConfigError::invalid(
                "retry.max_attempts",
                "must be at least 1",
            ));
        }
        if !(0.0..=1.0).contains(&rt.jitter) {
            return Err(ConfigError::invalid(
                "retry.jitter",
                format!("{} is not a fraction between 0 and 1", rt.jitter),
            ));
        }
        Ok(RetryPolicy {
            base_delay: rt.base_delay.0,
            max_delay: rt.max_delay.0,
            max_attempts: rt.max_attempts,
            jitter: rt.jitter,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::rejects;

    #[test]
    fn each_rejection_names_its_key() {
        rejects(
            "[retry]\nbase_delay = \"0s\"\n",
            "invalid value for retry.base_delay: must be greater than zero",
        );
        rejects(
            "[retry]\nbase_delay = \"2s\"\nmax_delay = \"1s\"\n",
            "invalid value for retry.max_delay: must be at least retry.base_delay",
        );
        rejects(
            "[retry]\nmax_attempts = 0\n",
            "invalid value for retry.max_attempts: must be at least 1",
        );
        rejects(
            "[retry]\njitter = 1.5\n",
            "invalid value for retry.jitter: 1.5 is not a fraction between 0 and 1",
        );
        rejects(
            "[retry]\njitter = -0.1\n",
            "invalid value for retry.jitter: -0.1 is not a fraction between 0 and 1",
        );
    }
}
