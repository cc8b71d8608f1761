//! `[cleanup]`: retention of `sent` (and `expired`) rows.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, HumanDuration, positive};

/// `[cleanup]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCleanup {
    /// Keep `sent` rows this long (default 24h); `"0s"` deletes rows on confirm.
    pub retention: HumanDuration,
    /// How often the cleanup runs (default 1m).
    pub interval: HumanDuration,
    /// Rows deleted per statement (default 5000).
    pub batch_size: usize,
}

impl Default for RawCleanup {
    fn default() -> Self {
        Self {
            retention: super::dur("24h"),
            interval: super::dur("1m"),
            batch_size: 5000,
        }
    }
}

/// The validated `[cleanup]` section.
#[derive(Debug, Clone)]
pub struct CleanupConfig {
    /// Age after which `sent` rows are deleted; zero deletes on confirm.
    pub retention: Duration,
    /// Cleanup period.
    pub interval: Duration,
    /// Rows per DELETE.
    pub batch_size: usize,
}

impl RawCleanup {
    /// Checks the section.
    pub(super) fn validate(self) -> Result<CleanupConfig, ConfigError> {
        let c = self;
        positive("cleanup.interval", c.interval)?;
        if c.batch_size == 0 {
            return Err(ConfigError::invalid(
                "cleanup.batch_size",
                "must be at least 1",
            ));
        }
        Ok(CleanupConfig {
            retention: c.retention.0,
            interval: c.interval.0,
            batch_size: c.batch_size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{load_str, rejects};

    #[test]
    fn each_rejection_names_its_key() {
        rejects(
            "[cleanup]\ninterval = \"0s\"\n",
            "invalid value for cleanup.interval: must be greater than zero",
        );
        rejects(
            "[cleanup]\nbatch_size = 0\n",
            "invalid value for cleanup.batch_size: must be at least 1",
        );
    }

    #[test]
    fn zero_retention_is_accepted() {
        let c = load_str("[cleanup]\nretention = \"0s\"\n", &[]).unwrap();
        assert!(c.cleanup.retention.is_zero());
    }
}
