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

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Client, Response, StatusCode, Url};
use tokio::time::Instant;

use super::envelope::EnvelopeConfig;
use super::headers::{self, Binding, Part};
use super::stdout::structured_event;
use super::{ConnectError, Outcome, Publisher};
use crate::backoff::Backoff;
use crate::config::{HttpConfig, HttpMode, RESERVED_HEADERS, TRACE_CONTEXT_HEADERS};
use crate::message::OutboxMessage;
use crate::redact::redact_url;
use crate::template::Fields;

/// The longest `Retry-After` honoured: a larger one (or a date further ahead) waits this long.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// How much of a 2xx answer's body is read (so the connection can be reused); past this the
/// rest is not read and the connection is closed.
const DRAIN_LIMIT: usize = 64 * 1024;

/// How much of a failed answer's body `last_error` quotes.
const BODY_QUOTE: usize = 200;

/// How many distinct dropped row-header names are remembered (each is warned about once).
const WARNED_NAMES: usize = 1024;

/// The content type of a structured-mode request.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

/// Sends every message as one HTTP request.
pub struct HttpPublisher {
    cfg: HttpConfig,
    // Built once; a failure (no TLS setup) is reported by every connect and publish.
    client: Result<Client, String>,
    method: reqwest::Method,
    // The URL parsed once, when the template has no placeholder.
    fixed_url: Option<Url>,
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

/// What an HTTP status means for the row (docs/http.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusClass {
    /// 2xx: confirmed.
    Confirmed,
    /// 408, 429, 502, 503, 504: the endpoint cannot take it now; no attempt spent.
    ConnectionLevel,
    /// Anything else (3xx included: redirects are not followed): spend an attempt.
    MessageLevel,
}

/// Classifies an HTTP status.
pub fn classify_status(status: StatusCode) -> StatusClass {
    match status.as_u16() {
        200..=299 => StatusClass::Confirmed,
        408 | 429 | 502 | 503 | 504 => StatusClass::ConnectionLevel,
        _ => StatusClass::MessageLevel,
    }
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
        let fixed_url = cfg
            .url
            .is_literal()
            .then(|| Url::parse(&cfg.url.render(&Fields::default())).ok())
            .flatten();
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

    /// The URL of `msg`: the template with the row's values percent-encoded, the path replaced
    /// by the row's `destination` when it has one.
    pub fn url_for(&self, msg: &OutboxMessage) -> Result<Url, String> {
        let mut url = match &self.fixed_url {
            Some(url) => url.clone(),
            None => {
                let rendered = self.cfg.url.render_with(
                    &Fields {
                        aggregate_type: &msg.aggregate_type,
                        event_type: &msg.event_type,
                        aggregate_id: msg.aggregate_id.as_deref(),
                    },
                    percent_encode,
                );
                Url::parse(&rendered).map_err(|e| format!("the rendered URL is not valid: {e}"))?
            }
        };
        if let Some(path) = msg.destination.as_deref().filter(|d| !d.is_empty()) {
            url.set_path(path);
        }
        Ok(url)
    }

    /// The request's headers and body for `msg` sent to `url`, or why it cannot be sent: the
    /// row's headers that may go out, the configured static headers, then (binary mode) the
    /// CloudEvents attributes, the content type and the signatures.
    pub fn request_parts(
        &self,
        msg: &OutboxMessage,
        env: &EnvelopeConfig,
        url: &Url,
    ) -> Result<(HeaderMap, Vec<u8>), String> {
        let binary = self.cfg.mode == HttpMode::Binary;
        let content_type = if binary {
            env.payload_kind.content_type()
        } else {
            STRUCTURED_CONTENT_TYPE
        };
        let binding = Binding {
            attribute_prefix: "ce-",
            attributes: binary,
            content_type: Some(("content-type", content_type)),
            also_ours: &|name| self.is_reserved(name),
            dropped: &|msg, name| {
                self.drop_header(
                    msg,
                    name,
                    "the relay sets this header itself (its value wins)",
                );
            },
        };
        let list = headers::headers(msg, env, url.as_str(), &binding);
        let mut headers = HeaderMap::with_capacity(list.len() + self.static_headers.len() + 3);
        let mut static_headers = Some(&self.static_headers);
        for header in list {
            if header.part != Part::Row
                && let Some(fixed) = static_headers.take()
            {
                for (name, value) in fixed {
                    headers.append(name, value.clone());
                }
            }
            match header.part {
                Part::Row => self.append_row_header(msg, &mut headers, &header.name, &header.value),
                Part::Attribute => {
                    let name = header_name(header.name)?;
                    let value = HeaderValue::try_from(ce_header_value(&header.value))
                        .map_err(|e| format!("CloudEvents attribute {name}: {e}"))?;
                    headers.insert(name, value);
                }
                Part::ContentType => {
                    headers.insert(
                        reqwest::header::CONTENT_TYPE,
                        HeaderValue::from_static(content_type),
                    );
                }
                Part::Signature => {
                    let value = HeaderValue::from_str(&header.value)
                        .map_err(|e| format!("signature header {}: {e}", header.name))?;
                    headers.insert(HeaderName::from_static(crate::signing::HEADER), value);
                }
            }
        }
        if let Some(fixed) = static_headers {
            for (name, value) in fixed {
                headers.append(name, value.clone());
            }
        }
        let body = if binary {
            msg.payload.clone()
        } else {
            structured_event(msg, env)?.into_bytes()
        };
        sign_webhook(msg, env, &body, &mut headers)?;
        Ok((headers, body))
    }

    /// Whether a row header named `name` is left out because the relay or HTTP sets it (but
    /// for the trace context, which the relay sends as the row or the tracer gives it), or a
    /// static header has that name.
    fn is_reserved(&self, name: &str) -> bool {
        let reserved = RESERVED_HEADERS
            .iter()
            .any(|r| r.eq_ignore_ascii_case(name))
            && !TRACE_CONTEXT_HEADERS
                .iter()
                .any(|t| t.eq_ignore_ascii_case(name));
        reserved
            || HeaderName::from_bytes(name.as_bytes())
                .is_ok_and(|parsed| self.static_headers.contains_key(&parsed))
    }

    /// Appends the row header `name: value`, unless HTTP cannot carry it (then it is left out,
    /// warned about once per name).
    fn append_row_header(
        &self,
        msg: &OutboxMessage,
        headers: &mut HeaderMap,
        name: &str,
        value: &str,
    ) {
        let Ok(parsed) = HeaderName::from_bytes(name.as_bytes()) else {
            self.drop_header(msg, name, "it is not a valid HTTP header name");
            return;
        };
        match HeaderValue::from_bytes(value.as_bytes()) {
            Ok(v) => {
                headers.append(parsed, v);
            }
            Err(_) => self.drop_header(
                msg,
                name,
                "its value is not a valid HTTP header value (control characters or line breaks)",
            ),
        }
    }

    /// Warns once per header name that a row header is left out of requests.
    fn drop_header(&self, msg: &OutboxMessage, name: &str, why: &str) {
        let first = self
            .warned
            .lock()
            .is_ok_and(|mut seen| seen.len() < WARNED_NAMES && seen.insert(name.to_owned()));
        if first {
            let shown: String = name.chars().take(64).collect();
            tracing::warn!(id = %msg.id, header = %shown.escape_debug(), "row header left out of HTTP requests: {why}; the row is sent without it (warned once per header name)");
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

    /// Reads the answer to a request and decides what it means.
    async fn outcome(&self, response: Response) -> Outcome {
        let status = response.status();
        match classify_status(status) {
            StatusClass::Confirmed => match drain(response).await {
                Ok(()) => {
                    self.answered();
                    Outcome::Confirmed
                }
                Err(e) => self.pause_for(
                    format!(
                        "HTTP {status}, then the connection broke before the answer was complete: {}",
                        self.describe_error(e)
                    ),
                    None,
                    true,
                ),
            },
            StatusClass::ConnectionLevel => {
                let retry_after = retry_after(response.headers(), chrono::Utc::now());
                let asked = retry_after
                    .map(|d| format!(" (Retry-After: {}s)", d.as_secs()))
                    .unwrap_or_default();
                let body = body_start(response).await;
                self.pause_for(format!("HTTP {status}{asked}{body}"), retry_after, false)
            }
            StatusClass::MessageLevel => {
                let location = response
                    .headers()
                    .get(reqwest::header::LOCATION)
                    .and_then(|l| l.to_str().ok())
                    .map(|l| format!(" (Location: {}; redirects are not followed)", redact_url(l)))
                    .unwrap_or_default();
                let body = body_start(response).await;
                self.answered();
                Outcome::Rejected(format!("HTTP {status}{location}{body}"))
            }
        }
    }

    /// A transport error as one line, without the URL (it may carry credentials).
    fn describe_error(&self, e: reqwest::Error) -> String {
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
        redact_url(&parts.join(": "))
    }

    /// `HEAD` to the URL's origin: `Ok` when the endpoint answers at all.
    async fn probe(&self, client: &Client) -> Result<(), ConnectError> {
        let origin = redact_url(&self.cfg.origin);
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
            redact_url(self.cfg.url.as_str())
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

/// The client: rustls with the system trust store, no redirects, the configured timeout.
fn build_client(cfg: &HttpConfig) -> Result<Client, String> {
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

/// Appends `value` percent-encoded: everything but the unreserved characters of RFC 3986
/// (`A-Z a-z 0-9 - . _ ~`), so a value never adds a path segment or a query parameter.
pub fn percent_encode(value: &str, out: &mut String) {
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            push_escaped(b, out);
        }
    }
}

/// A header name the relay sets: spelled out once when it is static.
fn header_name(name: Cow<'static, str>) -> Result<HeaderName, String> {
    match name {
        Cow::Borrowed(name) => Ok(HeaderName::from_static(name)),
        Cow::Owned(name) => {
            HeaderName::from_bytes(name.as_bytes()).map_err(|e| format!("header {name}: {e}"))
        }
    }
}

/// With `[signing]`, the Standard Webhooks headers (`webhook-id`, `webhook-timestamp`,
/// `webhook-signature`) over `body`, beside `outbox-signature`.
fn sign_webhook(
    msg: &OutboxMessage,
    env: &EnvelopeConfig,
    body: &[u8],
    headers: &mut HeaderMap,
) -> Result<(), String> {
    let Some(signer) = &env.signer else {
        return Ok(());
    };
    let id = msg.id.to_string();
    let timestamp = chrono::Utc::now().timestamp();
    let pairs = [
        (crate::signing::WEBHOOK_ID, id.clone()),
        (crate::signing::WEBHOOK_TIMESTAMP, timestamp.to_string()),
        (
            crate::signing::WEBHOOK_SIGNATURE,
            signer.webhook_signature(&id, timestamp, body),
        ),
    ];
    for (name, value) in pairs {
        let value =
            HeaderValue::from_str(&value).map_err(|e| format!("signature header {name}: {e}"))?;
        headers.insert(HeaderName::from_static(name), value);
    }
    Ok(())
}

/// A CloudEvents attribute as an HTTP header value (HTTP binding §3.1.3.2): space, `"`, `%`
/// and every byte outside printable ASCII percent-encoded (UTF-8).
pub fn ce_header_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if (0x21..=0x7e).contains(&b) && b != b'"' && b != b'%' {
            out.push(char::from(b));
        } else {
            push_escaped(b, &mut out);
        }
    }
    out
}

fn push_escaped(b: u8, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(b >> 4)]));
    out.push(char::from(HEX[usize::from(b & 0x0f)]));
}

/// The delay a `Retry-After` header asks for (seconds or an HTTP date), if any.
pub fn retry_after(headers: &HeaderMap, now: chrono::DateTime<chrono::Utc>) -> Option<Duration> {
    let text = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER));
    }
    let at = chrono::DateTime::parse_from_rfc2822(text).ok()?;
    Some(
        (at.with_timezone(&chrono::Utc) - now)
            .to_std()
            .unwrap_or(Duration::ZERO)
            .min(MAX_RETRY_AFTER),
    )
}

/// Reads a 2xx answer's body (up to [`DRAIN_LIMIT`]), so the answer is complete and the
/// connection can carry the next request.
async fn drain(mut response: Response) -> Result<(), reqwest::Error> {
    let mut read = 0;
    while let Some(chunk) = response.chunk().await? {
        read += chunk.len();
        if read > DRAIN_LIMIT {
            break;
        }
    }
    Ok(())
}

/// `": <start of the body>"` for `last_error` (empty when there is no body), on one line.
async fn body_start(mut response: Response) -> String {
    let mut bytes = Vec::new();
    while bytes.len() < BODY_QUOTE * 4 {
        match response.chunk().await {
            Ok(Some(chunk)) => bytes.extend_from_slice(&chunk),
            Ok(None) | Err(_) => break,
        }
    }
    quote_body(&bytes)
}

/// The start of a body, printable and on one line, prefixed by `": "` (empty for no body).
pub fn quote_body(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::new();
    let mut chars = 0;
    for word in text.split(|c: char| c.is_whitespace() || c.is_control()) {
        if word.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        for c in word.chars() {
            if chars == BODY_QUOTE {
                out.push('…');
                return format!(": {out}");
            }
            out.push(c);
            chars += 1;
        }
    }
    if out.is_empty() {
        out
    } else {
        format!(": {out}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::PayloadKind;
    use crate::publish::envelope::tests::message;
    use crate::template::Template;

    fn publisher(url: &str, mode: HttpMode, headers: &[(&str, &str)]) -> HttpPublisher {
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

    fn env(signed: bool) -> EnvelopeConfig {
        EnvelopeConfig {
            source: "/outbox/test/outbox_messages".into(),
            payload_kind: PayloadKind::Json,
            signer: signed
                .then(|| std::sync::Arc::new(crate::signing::Signer::new("k1", &[7u8; 32]))),
            route: Template::parse("r").unwrap(),
        }
    }

    #[test]
    fn statuses_are_classified_as_the_contract_says() {
        use StatusClass::*;
        for (code, want) in [
            (200, Confirmed),
            (201, Confirmed),
            (202, Confirmed),
            (204, Confirmed),
            (299, Confirmed),
            (301, MessageLevel),
            (302, MessageLevel),
            (304, MessageLevel),
            (400, MessageLevel),
            (401, MessageLevel),
            (403, MessageLevel),
            (404, MessageLevel),
            (408, ConnectionLevel),
            (409, MessageLevel),
            (410, MessageLevel),
            (413, MessageLevel),
            (422, MessageLevel),
            (429, ConnectionLevel),
            (500, MessageLevel),
            (501, MessageLevel),
            (502, ConnectionLevel),
            (503, ConnectionLevel),
            (504, ConnectionLevel),
        ] {
            let status = StatusCode::from_u16(code).unwrap();
            assert_eq!(classify_status(status), want, "{code}");
        }
    }

    #[test]
    fn url_values_are_percent_encoded_and_destination_replaces_the_path() {
        let p = publisher(
            "https://h.example.com/in/{aggregate_type}/{aggregate_id}?e={event_type}",
            HttpMode::Binary,
            &[],
        );
        let mut m = message("{}");
        m.aggregate_id = Some("a/b c?d&é".into());
        m.event_type = "x=y".into();
        assert_eq!(
            p.url_for(&m).unwrap().as_str(),
            "https://h.example.com/in/order/a%2Fb%20c%3Fd%26%C3%A9?e=x%3Dy"
        );
        m.destination = Some("/special/path".into());
        assert_eq!(
            p.url_for(&m).unwrap().as_str(),
            "https://h.example.com/special/path?e=x%3Dy"
        );
        m.destination = Some("relative".into());
        assert_eq!(
            p.url_for(&m).unwrap().as_str(),
            "https://h.example.com/relative?e=x%3Dy"
        );
    }

    #[test]
    fn a_url_without_placeholders_is_parsed_once_and_destination_still_replaces_its_path() {
        let p = publisher("https://h.example.com/in?k=v", HttpMode::Binary, &[]);
        assert!(p.fixed_url.is_some());
        let mut m = message("{}");
        assert_eq!(
            p.url_for(&m).unwrap().as_str(),
            "https://h.example.com/in?k=v"
        );
        m.destination = Some("/special/path".into());
        assert_eq!(
            p.url_for(&m).unwrap().as_str(),
            "https://h.example.com/special/path?k=v"
        );
        m.destination = None;
        assert_eq!(
            p.url_for(&m).unwrap().as_str(),
            "https://h.example.com/in?k=v"
        );
    }

    #[test]
    fn ce_values_are_percent_encoded_as_the_binding_says() {
        assert_eq!(ce_header_value("order-42"), "order-42");
        assert_eq!(ce_header_value("a b\"c%d"), "a%20b%22c%25d");
        assert_eq!(ce_header_value("é\n"), "%C3%A9%0A");
    }

    #[test]
    fn binary_request_has_ce_headers_and_row_headers_but_ours_win() {
        let p = publisher(
            "http://127.0.0.1/x",
            HttpMode::Binary,
            &[("authorization", "Bearer s3cret")],
        );
        let m = message(
            r#"{"x-tenant":"t1","ce-id":"forged","Content-Type":"text/plain","authorization":"Bearer row","bad name":"v","x-bad-value":"a\nb","content-length":"1","n":7}"#,
        );
        let url = p.url_for(&m).unwrap();
        let (h, body) = p.request_parts(&m, &env(false), &url).unwrap();
        assert_eq!(body, b"{}");
        let get = |n: &str| {
            h.get_all(n)
                .iter()
                .map(|v| v.to_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(get("ce-id"), ["00000000-0000-0000-0000-000000000000"]);
        assert_eq!(get("ce-specversion"), ["1.0"]);
        assert_eq!(get("ce-type"), ["created"]);
        assert_eq!(get("ce-source"), ["/outbox/test/outbox_messages"]);
        assert_eq!(get("ce-subject"), ["42"]);
        assert_eq!(get("ce-aggregatetype"), ["order"]);
        assert_eq!(get("ce-time"), ["2026-01-02T03:04:05.000000Z"]);
        assert_eq!(get("content-type"), ["application/json"]);
        assert_eq!(get("authorization"), ["Bearer s3cret"]);
        assert_eq!(get("x-tenant"), ["t1"]);
        assert_eq!(get("n"), ["7"]);
        assert!(get("x-bad-value").is_empty() && get("content-length").is_empty());
        assert!(h.get(crate::signing::WEBHOOK_SIGNATURE).is_none());
        // Secrets stay out of Debug output.
        assert!(!format!("{h:?}").contains("s3cret"));
    }

    #[test]
    fn the_rows_trace_context_rides_as_request_headers_and_the_span_names_no_query() {
        let p = publisher(
            "https://u:pw@hooks.example.com/in/{aggregate_type}?token=s3cret",
            HttpMode::Binary,
            &[],
        );
        let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let m = message(&format!(
            r#"{{"traceparent":"{traceparent}","tracestate":"v=1"}}"#
        ));
        let url = p.url_for(&m).unwrap();
        let (h, _) = p.request_parts(&m, &env(false), &url).unwrap();
        assert_eq!(h.get("traceparent").unwrap(), traceparent);
        assert_eq!(h.get("tracestate").unwrap(), "v=1");
        assert_eq!(
            p.destination_name(&m, &env(false)),
            "hooks.example.com/in/order"
        );
    }

    #[test]
    fn structured_request_is_the_stdout_object_and_signed_requests_carry_both_signatures() {
        let p = publisher("http://127.0.0.1/x", HttpMode::Structured, &[]);
        let m = message("{}");
        let url = p.url_for(&m).unwrap();
        let env = env(true);
        let (h, body) = p.request_parts(&m, &env, &url).unwrap();
        assert_eq!(h["content-type"], STRUCTURED_CONTENT_TYPE);
        assert!(h.get("ce-id").is_none());
        assert_eq!(body, structured_event(&m, &env).unwrap().into_bytes());
        assert_eq!(
            h[crate::signing::HEADER].to_str().unwrap(),
            crate::publish::envelope::signature(&m, &env, "http://127.0.0.1/x").unwrap()
        );
        assert_eq!(h["webhook-id"], "00000000-0000-0000-0000-000000000000");
        let ts: i64 = h["webhook-timestamp"].to_str().unwrap().parse().unwrap();
        assert!((chrono::Utc::now().timestamp() - ts).abs() < 60);
        let signer = env.signer.as_ref().unwrap();
        assert_eq!(
            h["webhook-signature"].to_str().unwrap(),
            signer.webhook_signature("00000000-0000-0000-0000-000000000000", ts, &body)
        );
    }

    #[test]
    fn retry_after_takes_seconds_or_a_date_and_is_capped() {
        let now = chrono::Utc::now();
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h, now), None);
        h.insert("retry-after", HeaderValue::from_static("7"));
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(7)));
        h.insert("retry-after", HeaderValue::from_static("999999"));
        assert_eq!(retry_after(&h, now), Some(MAX_RETRY_AFTER));
        let date = (now + chrono::Duration::seconds(30))
            .format("%a, %d %b %Y %H:%M:%S GMT")
            .to_string();
        h.insert("retry-after", HeaderValue::from_str(&date).unwrap());
        let d = retry_after(&h, now).unwrap();
        assert!(
            d <= Duration::from_secs(30) && d >= Duration::from_secs(28),
            "{d:?}"
        );
        h.insert("retry-after", HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&h, now), None);
    }

    #[test]
    fn quoted_bodies_are_one_short_line() {
        assert_eq!(quote_body(b""), "");
        assert_eq!(
            quote_body(b"{\"error\":\n  \"bad\"}\r\n"),
            ": {\"error\": \"bad\"}"
        );
        let long = quote_body(&[b'x'; 500]);
        assert!(long.ends_with('…') && long.chars().count() == 2 + BODY_QUOTE + 1);
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
}
