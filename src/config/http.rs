//! `[publisher.http]`: the webhook sink's endpoint (a URL template), method, CloudEvents
//! content mode, static headers and timeout. Header values are secrets (an `Authorization`):
//! no error, log or `Debug` output shows them.

use std::collections::BTreeMap;
use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};
use serde::{Deserialize, Deserializer, Serialize};

use super::{ConfigError, HumanDuration, choose, positive};
use crate::redact::redact_url_tokens;
use crate::template::{Fields, Template};

/// A static header value as written: text (from the file, or from
/// `RELAY_PUBLISHER__HTTP__HEADERS__<NAME>` exactly as set), or a number or boolean written
/// unquoted in the file (sent as its text). `Debug` hides it.
#[derive(Clone, Serialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct HeaderText(pub String);

impl std::fmt::Debug for HeaderText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

impl<'de> Deserialize<'de> for HeaderText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Str(String),
            Unsigned(u64),
            Signed(i64),
            Float(f64),
            Bool(bool),
        }
        // Never quote the value in the error: it may be a credential.
        let text = Written::deserialize(d).map_err(|_| {
            serde::de::Error::custom("a header value must be a string (the value is not shown)")
        })?;
        Ok(Self(match text {
            Written::Str(s) => s,
            Written::Unsigned(n) => n.to_string(),
            Written::Signed(n) => n.to_string(),
            Written::Float(n) => n.to_string(),
            Written::Bool(b) => b.to_string(),
        }))
    }
}

/// `[publisher.http]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawHttp {
    /// URL template (required): `http://` or `https://`, placeholders only in the path and
    /// query, e.g. `https://hooks.example.com/outbox/{aggregate_type}/{event_type}`.
    pub url: String,
    /// `POST` (default), `PUT` or `PATCH`.
    pub method: String,
    /// CloudEvents content mode: `binary` (default) or `structured`.
    pub mode: String,
    /// Static request headers (e.g. `Authorization`); values are never printed.
    pub headers: BTreeMap<String, HeaderText>,
    /// How long one request may take, connecting included, before it counts as no answer
    /// (default `10s`).
    pub timeout: HumanDuration,
}

impl Default for RawHttp {
    fn default() -> Self {
        Self {
            url: String::new(),
            method: "POST".into(),
            mode: "binary".into(),
            headers: BTreeMap::new(),
            timeout: HumanDuration(Duration::from_secs(10)),
        }
    }
}

/// `publisher.http.method`: the methods that carry a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpMethod {
    /// `POST` (the default).
    Post,
    /// `PUT`.
    Put,
    /// `PATCH`.
    Patch,
}

impl HttpMethod {
    /// The method as sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Post => "POST",
            Self::Put => "PUT",
            Self::Patch => "PATCH",
        }
    }
}

/// `publisher.http.mode`: how the CloudEvents HTTP binding carries a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpMode {
    /// Attributes in `ce-*` headers, the payload as the body (the default).
    Binary,
    /// One `application/cloudevents+json` object as the body (the stdout sink's line).
    Structured,
}

/// The validated `[publisher.http]` section. `Debug` shows header names, never values.
#[derive(Clone)]
pub struct HttpConfig {
    /// URL template; placeholders only in the path and query.
    pub url: Template,
    /// `scheme://host[:port]/` of the URL: what `check` and reconnecting probe.
    pub origin: String,
    /// Request method.
    pub method: HttpMethod,
    /// CloudEvents content mode.
    pub mode: HttpMode,
    /// Static headers, names lower-cased (values may be secrets).
    pub headers: Vec<(String, String)>,
    /// Per-request timeout.
    pub timeout: Duration,
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("HttpConfig")
            .field("url", &redact_url_tokens(self.url.as_str()))
            .field("method", &self.method)
            .field("mode", &self.mode)
            .field("headers", &format_args!("{names:?} (values redacted)"))
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// The W3C trace context: reserved for static headers, but a row's own (rewritten to the
/// publish span's while tracing is on) travels as request headers.
pub const TRACE_CONTEXT_HEADERS: &[&str] = &["traceparent", "tracestate"];

/// Header names the relay sets itself or HTTP owns: a static header may not use them, and a
/// row header with one of these names is dropped (the relay's value wins), but for
/// [`TRACE_CONTEXT_HEADERS`].
pub const RESERVED_HEADERS: &[&str] = &[
    "ce-id",
    "ce-source",
    "ce-specversion",
    "ce-type",
    "ce-subject",
    "ce-time",
    "ce-aggregatetype",
    "content-type",
    crate::signing::HEADER,
    crate::signing::WEBHOOK_ID,
    crate::signing::WEBHOOK_TIMESTAMP,
    crate::signing::WEBHOOK_SIGNATURE,
    "traceparent",
    "tracestate",
    // The message framing and the connection belong to the HTTP client.
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "expect",
    "proxy-connection",
];

impl RawHttp {
    /// Checks the section (only when `publisher.kind = "http"`).
    pub(super) fn validate(self) -> Result<HttpConfig, ConfigError> {
        let (url, origin) = validate_url(&self.url)?;
        let method = choose(
            "publisher.http.method",
            &self.method.to_ascii_uppercase(),
            &[
                ("POST", HttpMethod::Post),
                ("PUT", HttpMethod::Put),
                ("PATCH", HttpMethod::Patch),
            ],
        )?;
        let mode = choose(
            "publisher.http.mode",
            &self.mode,
            &[
                ("binary", HttpMode::Binary),
                ("structured", HttpMode::Structured),
            ],
        )?;
        positive("publisher.http.timeout", self.timeout)?;
        let mut headers = Vec::with_capacity(self.headers.len());
        for (name, value) in self.headers {
            let key = || format!("publisher.http.headers.{name}");
            // An environment variable cannot hold `-`: `RELAY_PUBLISHER__HTTP__HEADERS__X_API_KEY`
            // is `x-api-key` (and `_` in a file's name is read the same way, so that both
            // spell one header, and the reserved names are caught however written).
            let name_sent = name.replace('_', "-");
            let parsed = HeaderName::from_bytes(name_sent.as_bytes()).map_err(|_| {
                ConfigError::invalid(
                    key(),
                    "is not a valid HTTP header name (letters, digits and !#$%&'*+-.^_`|~)",
                )
            })?;
            if RESERVED_HEADERS.contains(&parsed.as_str()) {
                return Err(ConfigError::invalid(
                    key(),
                    "is set by the relay or the HTTP client itself and cannot be configured",
                ));
            }
            if HeaderValue::from_str(&value.0).is_err() {
                return Err(ConfigError::invalid(
                    key(),
                    "the value is not a valid HTTP header value (visible ASCII, spaces and tabs, no line breaks); the value is not shown",
                ));
            }
            headers.push((parsed.as_str().to_owned(), value.0));
        }
        Ok(HttpConfig {
            url,
            origin,
            method,
            mode,
            headers,
            timeout: self.timeout.0,
        })
    }
}

/// The URL template and its origin, or the rejection naming `publisher.http.url`.
fn validate_url(raw: &str) -> Result<(Template, String), ConfigError> {
    const KEY: &str = "publisher.http.url";
    let shown = redact_url_tokens(raw);
    if raw.trim().is_empty() {
        return Err(ConfigError::invalid(
            KEY,
            "must be set (e.g. \"https://hooks.example.com/outbox/{aggregate_type}\")",
        ));
    }
    let template =
        Template::parse(raw).map_err(|e| ConfigError::invalid(KEY, format!("{shown}: {e}")))?;
    let sample = template.render(&Fields {
        aggregate_type: "a",
        event_type: "e",
        aggregate_id: Some("i"),
    });
    let url = url::Url::parse(&sample)
        .map_err(|e| ConfigError::invalid(KEY, format!("{shown} is not a valid URL: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(ConfigError::invalid(
            KEY,
            format!("{shown} must start with http:// or https://"),
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(ConfigError::invalid(KEY, format!("{shown} has no host")));
    }
    if raw.contains('#') {
        return Err(ConfigError::invalid(
            KEY,
            format!("{shown} has a fragment ('#'), which is never sent to the server"),
        ));
    }
    // Values are percent-encoded into the path and query; a placeholder in the scheme, host
    // or port would let a row choose the server.
    let origin = url.origin().ascii_serialization();
    let prefix = without_userinfo(template.literal_prefix());
    let authority_is_literal = prefix.len() >= origin.len()
        && prefix.as_bytes()[..origin.len()].eq_ignore_ascii_case(origin.as_bytes())
        || url.port().is_none() && url.port_or_known_default().is_some() && {
            // `https://host:443/…` is written with its default port, which the origin omits.
            let with_port = format!("{origin}:{}", url.port_or_known_default().unwrap_or(0));
            prefix.len() >= with_port.len()
                && prefix.as_bytes()[..with_port.len()].eq_ignore_ascii_case(with_port.as_bytes())
        };
    if !authority_is_literal {
        return Err(ConfigError::invalid(
            KEY,
            format!(
                "{shown}: placeholders may appear only in the path and query, not in the scheme, host or port"
            ),
        ));
    }
    Ok((template, format!("{origin}/")))
}

/// `prefix` (the literal start of a URL template) without the userinfo of its authority
/// (`user:pw@`), which the URL's origin leaves out too.
fn without_userinfo(prefix: &str) -> std::borrow::Cow<'_, str> {
    let Some(start) = prefix.find("://").map(|i| i + 3) else {
        return prefix.into();
    };
    let end = prefix[start..]
        .find(['/', '?'])
        .map_or(prefix.len(), |i| start + i);
    match prefix[start..end].rfind('@') {
        Some(at) => format!("{}{}", &prefix[..start], &prefix[start + at + 1..]).into(),
        None => prefix.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err_has, load_str, rejects};
    use super::super::{Config, PublisherConfig};

    const HTTP: &str = "[publisher]\nkind = \"http\"\n[publisher.http]\n";

    fn http(body: &str) -> String {
        format!("{HTTP}{body}\n")
    }

    fn load(body: &str) -> super::HttpConfig {
        match load_str(&http(body), &[]).map(|c: Config| c.publisher) {
            Ok(PublisherConfig::Http(h)) => h,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn defaults_and_a_full_section() {
        let h = load("url = \"https://hooks.example.com/outbox/{aggregate_type}\"");
        assert_eq!(h.method, super::HttpMethod::Post);
        assert_eq!(h.mode, super::HttpMode::Binary);
        assert_eq!(h.timeout, std::time::Duration::from_secs(10));
        assert!(h.headers.is_empty());
        assert_eq!(h.origin, "https://hooks.example.com/");
        let h = load(
            "url = \"http://127.0.0.1:8080/e?t={event_type}\"\nmethod = \"put\"\nmode = \"structured\"\ntimeout = \"2s\"\nheaders = { Authorization = \"Bearer hunter2\", X-Team = \"a\" }",
        );
        assert_eq!(h.method.as_str(), "PUT");
        assert_eq!(h.mode, super::HttpMode::Structured);
        assert_eq!(h.origin, "http://127.0.0.1:8080/");
        assert_eq!(
            h.headers,
            vec![
                ("authorization".to_owned(), "Bearer hunter2".to_owned()),
                ("x-team".to_owned(), "a".to_owned())
            ]
        );
        let shown = format!("{h:?}");
        assert!(
            shown.contains("authorization") && !shown.contains("hunter2"),
            "{shown}"
        );
    }

    #[test]
    fn header_values_from_the_environment_may_look_like_numbers() {
        // As written with `-`, and as a shell can spell it: `_` is sent as `-`. The text is
        // kept as written: no leading zero or trailing zero is lost.
        for var in [
            "PUBLISHER__HTTP__HEADERS__X-API-KEY",
            "PUBLISHER__HTTP__HEADERS__X_API_KEY",
        ] {
            for value in ["12345", "00123", "1.50", "true", "-0", "1e3"] {
                let c = load_str(&http("url = \"http://127.0.0.1/\""), &[(var, value)]).unwrap();
                let PublisherConfig::Http(h) = c.publisher else {
                    panic!("http")
                };
                assert_eq!(
                    h.headers,
                    vec![("x-api-key".to_owned(), value.to_owned())],
                    "{var}"
                );
            }
        }
    }

    #[test]
    fn each_url_rejection_names_the_url_key() {
        rejects(HTTP, "invalid value for publisher.http.url: must be set");
        for (url, says) in [
            ("ftp://h/x", "must start with http:// or https://"),
            ("not a url", "is not a valid URL"),
            ("https://h/{tenant}", "tenant"),
            ("https://h/{aggregate_type", "unclosed"),
            (
                "https://{aggregate_type}.example.com/",
                "only in the path and query",
            ),
            ("https://h:{aggregate_id}/x", "URL"),
            ("https://h/x#frag", "fragment"),
        ] {
            err_has(
                &http(&format!("url = \"{url}\"")),
                &["invalid value for publisher.http.url", says],
                &[],
            );
        }
    }

    #[test]
    fn each_other_rejection_names_its_key() {
        let ok = "url = \"https://h/x\"\n";
        err_has(
            &http(&format!("{ok}method = \"GET\"")),
            &["publisher.http.method", "\"GET\"", "\"POST\""],
            &[],
        );
        err_has(
            &http(&format!("{ok}mode = \"batched\"")),
            &["publisher.http.mode", "\"binary\"", "\"structured\""],
            &[],
        );
        rejects(
            &http(&format!("{ok}timeout = \"0s\"")),
            "invalid value for publisher.http.timeout: must be greater than zero",
        );
        err_has(
            &http(&format!("{ok}headers = {{ \"bad name\" = \"hunter2\" }}")),
            &["publisher.http.headers.bad name", "header name"],
            &["hunter2"],
        );
        err_has(
            &http(&format!(
                "{ok}headers = {{ X-A = \"hunter2\\nInjected: 1\" }}"
            )),
            &["publisher.http.headers.X-A", "header value"],
            &["hunter2"],
        );
        err_has(
            &http(&format!(
                "{ok}headers = {{ Content-Type = \"text/plain\" }}"
            )),
            &["publisher.http.headers.Content-Type", "set by the relay"],
            &[],
        );
        // From the environment, `_` stands for `-`: a reserved name is caught that way too.
        err_has(
            &http(&format!(
                "{ok}headers = {{ CONTENT_TYPE = \"text/plain\" }}"
            )),
            &["publisher.http.headers.CONTENT_TYPE", "set by the relay"],
            &[],
        );
        err_has(
            &http(&format!("{ok}headers = {{ X-A = [\"hunter2\"] }}")),
            &["publisher.http.headers"],
            &["hunter2"],
        );
        err_has(&http(&format!("{ok}urll = \"x\"")), &["urll"], &[]);
    }

    #[test]
    fn credentials_in_the_url_are_never_shown() {
        err_has(
            &http("url = \"ftp://user:hunter2@h/x\""),
            &["publisher.http.url"],
            &["hunter2"],
        );
    }

    #[test]
    fn userinfo_may_be_written_before_the_host_but_not_hold_a_placeholder() {
        // The origin (the probe's URL) carries no credentials.
        let h = load("url = \"https://user:pw@hooks.example.com/{event_type}\"");
        assert_eq!(h.origin, "https://hooks.example.com/");
        assert_eq!(
            load("url = \"http://user@127.0.0.1:8080/x\"").origin,
            "http://127.0.0.1:8080/"
        );
        err_has(
            &http("url = \"https://{aggregate_id}:pw@hooks.example.com/\""),
            &["placeholders may appear only in the path and query"],
            &["pw@"],
        );
    }

    #[test]
    fn the_default_port_may_be_written() {
        assert_eq!(
            load("url = \"https://h.example.com:443/{event_type}\"").origin,
            "https://h.example.com/"
        );
    }
}
