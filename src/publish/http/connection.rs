//! The HTTP client: its set-up (rustls with the system trust store, no redirects, the
//! configured timeout), transport errors as one line, and the probe of the URL's origin.

use std::time::Duration;

use reqwest::Client;

use super::{HttpPublisher, StatusClass, classify_status, retry_after};
use crate::config::HttpConfig;
use crate::publish::ConnectError;
use crate::redact::redact_url_tokens;

/// The client: rustls with the system trust store, no redirects, the configured timeout.
pub(super) fn build_client(cfg: &HttpConfig) -> Result<Client, String> {
    let native = rustls_native_certs::load_native_certs();
    let roots: Vec<reqwest::Certificate> = native
        .certs
        .iter()
        // A certificate the store cannot parse is skipped, as for the database's TLS.
        .filter_map(|c| reqwest::Certificate::from_der(c.as_ref()).ok())
        .collect();
    Client::builder()
        .user_agent(concat!("outbox-relay/", env!("CARGO_PKG_VERSION")))
        .redirect(reqwest::redirect::Policy::none())
        .timeout(cfg.timeout)
        .connect_timeout(cfg.timeout)
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(60))
        .tls_certs_only(roots)
        .build()
        .map_err(|e| format!("cannot set up the HTTP client: {e}"))
}

impl HttpPublisher {
    /// A transport error as one line, without the URL (it may carry credentials).
    pub(super) fn describe_error(&self, e: reqwest::Error) -> String {
        if e.is_timeout() {
            return format!(
                "no answer within {} (publisher.http.timeout)",
                humantime::format_duration(self.cfg.timeout)
            );
        }
        let e = e.without_url();
        let mut parts: Vec<String> = vec![e.to_string()];
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            let text = s.to_string();
            if parts.last().is_none_or(|last| !last.contains(&text)) {
                parts.push(text);
            }
            source = s.source();
        }
        redact_url_tokens(&parts.join(": "))
    }

    /// `HEAD` to the URL's origin: `Ok` when the endpoint answers at all.
    pub(super) async fn probe(&self, client: &Client) -> Result<(), ConnectError> {
        let origin = redact_url_tokens(&self.cfg.origin);
        match client.head(&self.cfg.origin).send().await {
            Ok(response) => {
                let status = response.status();
                let retry = retry_after(response.headers(), chrono::Utc::now());
                match (classify_status(status), retry) {
                    (StatusClass::ConnectionLevel, Some(d)) => {
                        self.pause_for(format!("HTTP {status} at {origin}"), Some(d), false);
                        Err(ConnectError(format!(
                            "{origin} answers HTTP {status} and asks to retry after {}s",
                            d.as_secs()
                        )))
                    }
                    _ => Ok(()),
                }
            }
            Err(e) => Err(ConnectError(format!(
                "{origin} does not answer: {}",
                self.describe_error(e)
            ))),
        }
    }
}
