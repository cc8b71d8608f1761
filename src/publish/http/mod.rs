//! The webhook sink (`publisher.kind = "http"`, docs/http.md): one request per message to the
//! URL rendered from `publisher.http.url`, CloudEvents HTTP binding (binary or structured
//! mode), with the Standard Webhooks headers beside `outbox-signature` when signing is on.
//!
//! One `reqwest` client serves every request: rustls on aws-lc-rs (the relay's one TLS stack)
//! with the system's trust store (`SSL_CERT_FILE` / `SSL_CERT_DIR` honoured), a pool of
//! keep-alive connections, HTTP/2 when a TLS server offers it, redirects never followed.
//! Requests of different aggregates run concurrently; within an aggregate the relay sends
//! message n+1 only after n was answered (the default [`Publisher::publish_run`]).
//!
//! Classification ([`classify_status`]): any 2xx confirms once the whole answer has arrived;
//! connection refused or reset, a TLS failure, no answer within `publisher.http.timeout`, and
//! 408, 429, 502, 503 and 504 are connection-level (the row goes back without spending an
//! attempt); every other status is message-level, with the status and the start of the body
//! as `last_error`.
//!
//! A connection-level failure pauses the publisher: it reports itself disconnected, answers
//! the requests still to be sent with [`Outcome::Unavailable`] at once, and [`Publisher::connect`]
//! waits out the pause before the relay claims again — the `Retry-After` the endpoint asked
//! for (capped at [`MAX_RETRY_AFTER`]), or else its own backoff, which grows while the
//! endpoint keeps failing and resets on an answer. After a failure below HTTP (refused, reset,
//! TLS, timeout), reconnecting first sends `HEAD` to the URL's origin: any HTTP answer means
//! the endpoint answers.
//!
//! Files: `connection` (the client, transport errors, the probe), `wire` (URL, headers, body),
//! `classify` (answers to outcomes).

mod classify;
mod connection;
mod wire;

pub use classify::{StatusClass, classify_status, quote_body, retry_after};
pub use wire::{STRUCTURED_CONTENT_TYPE, ce_header_value, percent_encode};

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};
use reqwest::{Client, Url};
use tokio::time::Instant;

use self::connection::build_client;
use super::envelope::EnvelopeConfig;
use super::{ConnectError, Outcome, Publisher};
use crate::backoff::Backoff;
use crate::config::{HttpConfig, HttpMode};
use crate::message::OutboxMessage;
use crate::redact::redact_url_tokens;
use crate::template::Fields;

/// The longest `Retry-After` honoured: a larger one (or a date further ahead) waits this long.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// Sends every message as one HTTP request.
pub struct HttpPublisher {
    cfg: HttpConfig,
    // Built once; a failure (no TLS setup) is reported by every connect and publish.
    client: Result<Client, String>,
    method: reqwest::Method,
    // The URL parsed once, when the template has no placeholder.
    fixed_url: Option<Url>,
    // `publisher.http.headers`, and the URL's userinfo as `Authorization` unless one is set.
    static_headers: HeaderMap,
    // False while paused after a connection-level failure, and before the first connect.
    connected: AtomicBool,
    pause: Mutex<Pause>,
    // Row header names already warned about, so each is logged once.
    warned: Mutex<HashSet<String>>,
}

/// Why and until when the publisher is paused.
struct Pause {
    until: Option<Instant>,
    backoff: Backoff,
    // The last failure was below HTTP: probe the origin before resuming.
    probe: bool,
    reason: String,
}

impl HttpPublisher {
    /// A publisher for `cfg` (no request is sent until [`Publisher::connect`]).
    pub fn new(cfg: HttpConfig) -> Self {
        let client = build_client(&cfg);
        let mut static_headers = HeaderMap::new();
        for (name, value) in &cfg.headers {
            // Validated with the same parsers at start; a failure here cannot happen.
            if let (Ok(n), Ok(mut v)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(value),
            ) {
                v.set_sensitive(true);
                static_headers.append(n, v);
            }
        }
        let method = match cfg.method {
            crate::config::HttpMethod::Post => reqwest::Method::POST,
            crate::config::HttpMethod::Put => reqwest::Method::PUT,
            crate::config::HttpMethod::Patch => reqwest::Method::PATCH,
        };
        // Userinfo never travels in the URL: it becomes the `Authorization` header, one of the
        // static headers (a configured `Authorization` replaces it), so that a row's
        // `Authorization` is left out as for any static header's name.
        if let Some(basic) = basic_authorization(&cfg)
            && !static_headers.contains_key(AUTHORIZATION)
        {
            static_headers.insert(AUTHORIZATION, basic);
        }
        let fixed_url = cfg
            .url
            .is_literal()
            .then(|| Url::parse(&cfg.url.render(&Fields::default())).ok())
            .flatten()
            .map(without_userinfo);
        Self {
            cfg,
            client,
            method,
            fixed_url,
            static_headers,
            connected: AtomicBool::new(false),
            pause: Mutex::new(Pause {
                until: None,
                backoff: Backoff::reconnect(),
                probe: true,
                reason: "not connected yet".into(),
            }),
            warned: Mutex::new(HashSet::new()),
        }
    }

    /// Records a connection-level failure: pauses the publisher (see the module docs).
    fn pause_for(&self, reason: String, retry_after: Option<Duration>, probe: bool) -> Outcome {
        let was_connected = self.connected.swap(false, Ordering::SeqCst);
        if let Ok(mut p) = self.pause.lock() {
            let delay = match retry_after {
                Some(d) => d.min(MAX_RETRY_AFTER),
                // The first failure of an outage sets the pause; requests that were already
                // in flight and fail too do not stretch it.
                None if was_connected => p.backoff.next_delay(),
                None => Duration::ZERO,
            };
            let until = Instant::now() + delay;
            p.until = Some(p.until.map_or(until, |u| u.max(until)));
            p.probe = if was_connected {
                probe
            } else {
                p.probe || probe
            };
            p.reason.clone_from(&reason);
        }
        Outcome::Unavailable(reason)
    }

    /// The endpoint answered (a confirm or a message-level refusal): the backoff starts over.
    fn answered(&self) {
        if self.connected.load(Ordering::SeqCst)
            && let Ok(mut p) = self.pause.lock()
        {
            p.backoff = Backoff::reconnect();
        }
    }
}

/// The `Authorization: Basic …` header of the URL's userinfo (`user:password@`, or `token@`
/// with an empty password), percent-decoded; `None` without userinfo. The userinfo is literal
/// text (validation keeps placeholders out of the authority), so a sample rendering has it.
fn basic_authorization(cfg: &HttpConfig) -> Option<HeaderValue> {
    let url = Url::parse(&cfg.url.render(&Fields {
        aggregate_type: "a",
        event_type: "e",
        aggregate_id: Some("i"),
    }))
    .ok()?;
    if url.username().is_empty() && url.password().is_none() {
        return None;
    }
    let mut credentials = crate::config::percent_decoded(url.username());
    credentials.push(b':');
    credentials.extend(crate::config::percent_decoded(
        url.password().unwrap_or_default(),
    ));
    let encoded = base64::engine::general_purpose::STANDARD.encode(credentials);
    let mut value = HeaderValue::from_str(&format!("Basic {encoded}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

/// `url` without its userinfo: what goes on the request line (and `Host`), and the routing
/// line `outbox-signature` signs.
fn without_userinfo(mut url: Url) -> Url {
    // Only fails for URLs without a host, which validation rejects; the URL is kept as is then.
    let _ = url.set_username("");
    let _ = url.set_password(None);
    url
}

#[async_trait]
impl Publisher for HttpPublisher {
    fn kind(&self) -> &'static str {
        "http"
    }

    /// The URL's host and path: never its query (a token may ride there) or credentials.
    fn destination_name(&self, msg: &OutboxMessage, _env: &EnvelopeConfig) -> String {
        match self.url_for(msg) {
            Ok(url) => format!("{}{}", url.host_str().unwrap_or_default(), url.path()),
            Err(_) => "invalid URL".to_owned(),
        }
    }

    fn describe(&self) -> String {
        let mode = match self.cfg.mode {
            HttpMode::Binary => "binary",
            HttpMode::Structured => "structured",
        };
        format!(
            "http {} {} (CloudEvents {mode} mode)",
            self.cfg.method.as_str(),
            redact_url_tokens(self.cfg.url.as_str())
        )
    }

    async fn connect(&self) -> Result<(), ConnectError> {
        let client = self.client.as_ref().map_err(|e| ConnectError(e.clone()))?;
        if self.connected.load(Ordering::SeqCst) {
            return Ok(());
        }
        // Wait out the pause; a failure meanwhile (a request still in flight) may extend it.
        loop {
            let until = self.pause.lock().ok().and_then(|p| p.until);
            match until {
                Some(until) if until > Instant::now() => tokio::time::sleep_until(until).await,
                _ => break,
            }
        }
        let probe = self.pause.lock().map(|p| p.probe).unwrap_or(true);
        if probe {
            self.probe(client).await?;
        }
        if let Ok(mut p) = self.pause.lock() {
            p.until = None;
            p.probe = false;
        }
        self.connected.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn is_connected(&self) -> bool {
        self.client.is_ok() && self.connected.load(Ordering::SeqCst)
    }

    async fn publish(&self, msg: &OutboxMessage, envelope: &EnvelopeConfig) -> Outcome {
        let client = match &self.client {
            Ok(c) => c,
            Err(e) => return Outcome::Unavailable(e.clone()),
        };
        if !self.connected.load(Ordering::SeqCst) {
            // Paused: honour the endpoint's Retry-After (or the backoff) for requests not yet
            // sent too.
            let reason = self
                .pause
                .lock()
                .map(|p| p.reason.clone())
                .unwrap_or_default();
            return Outcome::Unavailable(format!("endpoint paused after: {reason}"));
        }
        let url = match self.url_for(msg) {
            Ok(url) => url,
            Err(e) => return Outcome::Rejected(e),
        };
        let (headers, body) = match self.request_parts(msg, envelope, &url) {
            Ok(parts) => parts,
            Err(e) => return Outcome::Rejected(e),
        };
        let sent = client
            .request(self.method.clone(), url)
            .headers(headers)
            .body(body)
            .send()
            .await;
        match sent {
            Ok(response) => self.outcome(response).await,
            Err(e) => {
                let reason = self.describe_error(e);
                self.pause_for(reason, None, true)
            }
        }
    }

    async fn close(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::PayloadKind;
    use crate::publish::envelope::tests::message;
    use crate::template::Template;

    pub(super) fn publisher(url: &str, mode: HttpMode, headers: &[(&str, &str)]) -> HttpPublisher {
        HttpPublisher::new(HttpConfig {
            url: Template::parse(url).unwrap(),
            origin: "http://127.0.0.1/".into(),
            method: crate::config::HttpMethod::Post,
            mode,
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect(),
            timeout: Duration::from_secs(10),
        })
    }

    pub(super) fn env(signed: bool) -> EnvelopeConfig {
        EnvelopeConfig {
            source: "/outbox/test/outbox_messages".into(),
            payload_kind: PayloadKind::Json,
            signer: signed
                .then(|| std::sync::Arc::new(crate::signing::Signer::new("k1", &[7u8; 32]))),
            route: Template::parse("r").unwrap(),
        }
    }

    #[tokio::test]
    async fn paused_publisher_answers_unavailable_without_sending() {
        let p = publisher("http://127.0.0.1:9/x", HttpMode::Binary, &[]);
        assert!(!p.is_connected());
        assert!(matches!(
            p.publish(&message("{}"), &env(false)).await,
            Outcome::Unavailable(r) if r.contains("paused")
        ));
        assert_eq!(p.kind(), "http");
        assert!(p.describe().contains("POST http://127.0.0.1:9/x"));
    }

    #[test]
    fn describe_masks_a_token_and_a_password_in_the_url() {
        let token = publisher("http://APIKEYSECRET@127.0.0.1:9/x", HttpMode::Binary, &[]);
        assert!(
            token.describe().contains("POST http://***@127.0.0.1:9/x"),
            "{}",
            token.describe()
        );
        let password = publisher("http://user:pw@127.0.0.1:9/x", HttpMode::Binary, &[]);
        assert!(
            password
                .describe()
                .contains("http://user:***@127.0.0.1:9/x")
        );
        let shown = format!("{:?}", token.cfg);
        assert!(!shown.contains("APIKEYSECRET"), "{shown}");
    }
}
