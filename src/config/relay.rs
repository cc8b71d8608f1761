//! `[relay]`: the claim loop's settings (batch, window, polling, lease, ordering, drain).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, HumanDuration, TableName, positive};

/// `[relay]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRelay {
    /// Name written to `locked_by` (default host name + pid).
    pub instance_id: Option<String>,
    /// Rows claimed per round trip (default 500).
    pub batch_size: usize,
    /// Messages published but not yet settled, at most (default 1000).
    pub max_in_flight: usize,
    /// Fallback poll period when idle (default 1s).
    pub poll_interval: HumanDuration,
    /// LISTEN for the insert trigger's NOTIFY (default true).
    pub notify: bool,
    /// Age after which another relay may reclaim a `processing` row (default 60s).
    pub lease_timeout: HumanDuration,
    /// `aggregate` (default) or `none`.
    pub ordering: Ordering,
    /// CloudEvents `source` (default `/outbox/<database>/<table>`).
    pub source: Option<String>,
    /// How long SIGTERM waits for in-flight messages (default 30s).
    pub shutdown_timeout: HumanDuration,
}

impl Default for RawRelay {
    fn default() -> Self {
        Self {
            instance_id: None,
            batch_size: 500,
            max_in_flight: 1000,
            poll_interval: super::dur("1s"),
            notify: true,
            lease_timeout: super::dur("60s"),
            ordering: Ordering::Aggregate,
            source: None,
            shutdown_timeout: super::dur("30s"),
        }
    }
}

/// How rows of one aggregate are ordered on the broker (`relay.ordering`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    /// Per `(aggregate_type, aggregate_id)`, in `seq` order, one confirmed before the next.
    Aggregate,
    /// No ordering promise; maximum parallelism.
    None,
}

/// The validated `[relay]` section.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Written to `locked_by`.
    pub instance_id: String,
    /// Rows per claim.
    pub batch_size: usize,
    /// Published-but-unsettled messages, at most.
    pub max_in_flight: usize,
    /// Idle poll period.
    pub poll_interval: Duration,
    /// LISTEN/NOTIFY wake-up.
    pub notify: bool,
    /// Lease after which `processing` rows are reclaimed.
    pub lease_timeout: Duration,
    /// Ordering mode.
    pub ordering: Ordering,
    /// CloudEvents `source`.
    pub source: String,
    /// Drain deadline on SIGTERM.
    pub shutdown_timeout: Duration,
}

impl RawRelay {
    /// Checks the section; `database` names the CloudEvents source by default.
    pub(super) fn validate(
        self,
        dbname: &str,
        table: &TableName,
    ) -> Result<RelayConfig, ConfigError> {
        let r = self;
        let instance_id = match r.instance_id {
            Some(id) if id.trim().is_empty() => {
                return Err(ConfigError::invalid(
                    "relay.instance_id",
                    "must not be empty",
                ));
            }
            Some(id) => id,
            None => default_instance_id(),
        };
        if r.batch_size == 0 || r.batch_size > 10_000 {
            return Err(ConfigError::invalid(
                "relay.batch_size",
                format!("{} is out of range (1..=10000)", r.batch_size),
            ));
        }
        if r.max_in_flight < r.batch_size || r.max_in_flight > 100_000 {
            return Err(ConfigError::invalid(
                "relay.max_in_flight",
                format!(
                    "{} must be at least relay.batch_size ({}) and at most 100000",
                    r.max_in_flight, r.batch_size
                ),
            ));
        }
        positive("relay.poll_interval", r.poll_interval)?;
        if r.lease_timeout.0 < MIN_LEASE {
            return Err(ConfigError::invalid(
                "relay.lease_timeout",
                format!(
                    "{} is shorter than 1s: leases are renewed every third of it, and a relay that \
                     cannot renew in time has its rows published again by another relay",
                    humantime::format_duration(r.lease_timeout.0)
                ),
            ));
        }
        let source = match r.source {
            Some(s) if s.trim().is_empty() => {
                return Err(ConfigError::invalid("relay.source", "must not be empty"));
            }
            Some(s) => s,
            None => format!("/outbox/{dbname}/{table}"),
        };

        Ok(RelayConfig {
            instance_id,
            batch_size: r.batch_size,
            max_in_flight: r.max_in_flight,
            poll_interval: r.poll_interval.0,
            notify: r.notify,
            lease_timeout: r.lease_timeout.0,
            ordering: r.ordering,
            source,
            shutdown_timeout: r.shutdown_timeout.0,
        })
    }
}

/// The shortest `relay.lease_timeout`.
const MIN_LEASE: Duration = Duration::from_secs(1);

/// Host name + pid, e.g. `web-1:4242`.
pub fn default_instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::super::tests::rejects;

    #[test]
    fn each_rejection_names_its_key() {
        rejects(
            "[relay]\ninstance_id = \" \"\n",
            "invalid value for relay.instance_id: must not be empty",
        );
        rejects(
            "[relay]\nbatch_size = 0\n",
            "invalid value for relay.batch_size: 0 is out of range (1..=10000)",
        );
        rejects(
            "[relay]\nbatch_size = 10001\nmax_in_flight = 20000\n",
            "invalid value for relay.batch_size: 10001 is out of range (1..=10000)",
        );
        rejects(
            "[relay]\nbatch_size = 600\nmax_in_flight = 500\n",
            "invalid value for relay.max_in_flight: 500 must be at least relay.batch_size (600) and at most 100000",
        );
        rejects(
            "[relay]\nmax_in_flight = 100001\n",
            "invalid value for relay.max_in_flight: 100001 must be at least",
        );
        rejects(
            "[relay]\npoll_interval = \"0s\"\n",
            "invalid value for relay.poll_interval: must be greater than zero",
        );
        rejects(
            "[relay]\nlease_timeout = \"0s\"\n",
            "invalid value for relay.lease_timeout: 0s is shorter than 1s",
        );
        rejects(
            "[relay]\nlease_timeout = \"1ms\"\n",
            "invalid value for relay.lease_timeout: 1ms is shorter than 1s",
        );
        crate::config::tests::err_has(
            "[relay]\nlease_timeout = \"100000000000000h\"\n",
            &["relay.lease_timeout", "longer than 100 years"],
            &[],
        );
        rejects(
            "[relay]\nsource = \"\"\n",
            "invalid value for relay.source: must not be empty",
        );
    }

    #[test]
    fn ordering_is_a_closed_set() {
        rejects(
            "[relay]\nordering = \"fifo\"\n",
            "invalid value for relay.ordering: \"fifo\" is not one of \"aggregate\", \"none\"",
        );
    }
}
