//! `[metrics]`: the address of the `/metrics`, `/healthz` and `/readyz` server.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// `[metrics]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    /// Address of the metrics and health server (default `127.0.0.1:9187`; empty disables it).
    pub listen: String,
}

impl Default for RawMetrics {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9187".into(),
        }
    }
}

impl RawMetrics {
    /// The address to listen on; `None` when the setting is empty (no server).
    pub(super) fn validate(self) -> Result<Option<SocketAddr>, ConfigError> {
        if self.listen.trim().is_empty() {
            return Ok(None);
        }
        let addr = self.listen.parse().map_err(|e| {
            ConfigError::invalid(
                "metrics.listen",
                format!(
                    "{:?} is not an address like 127.0.0.1:9187: {e}",
                    self.listen
                ),
            )
        })?;
        Ok(Some(addr))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{load_str, rejects};

    #[test]
    fn each_rejection_names_its_key() {
        rejects(
            "[metrics]\nlisten = \"nowhere\"\n",
            "invalid value for metrics.listen: \"nowhere\" is not an address like 127.0.0.1:9187",
        );
    }

    #[test]
    fn empty_disables_the_server() {
        let c = load_str("[metrics]\nlisten = \"\"\n", &[]).unwrap();
        assert_eq!(c.metrics_listen, None);
    }
}
