//! What a request carries (docs/http.md): the URL rendered with the row's values
//! percent-encoded, the headers (the row's that HTTP can carry, the static ones, the CloudEvents
//! attributes in binary mode, the content type, the signatures) and the body.

use std::borrow::Cow;

use reqwest::Url;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

use super::HttpPublisher;
use crate::config::{HttpMode, RESERVED_HEADERS, TRACE_CONTEXT_HEADERS};
use crate::message::OutboxMessage;
use crate::publish::envelope::EnvelopeConfig;
use crate::publish::headers::{self, Binding, Header, Part};
use crate::publish::stdout::structured_event;
use crate::template::Fields;

/// How many distinct dropped row-header names are remembered (each is warned about once).
const WARNED_NAMES: usize = 1024;

/// The content type of a structured-mode request.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

impl HttpPublisher {
    /// The URL of `msg`: the template with the row's values percent-encoded, the path replaced
    /// by the row's `destination` when it has one, without the userinfo (sent as the
    /// `Authorization` header instead).
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
                Url::parse(&rendered)
                    .map(super::without_userinfo)
                    .map_err(|e| format!("the rendered URL is not valid: {e}"))?
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
        let list = self.header_list(msg, env, url, binary, content_type);
        let mut headers = self.header_map(msg, list, content_type)?;
        let body = if binary {
            msg.payload.clone()
        } else {
            structured_event(msg, env)?.into_bytes()
        };
        sign_webhook(msg, env, &body, &mut headers)?;
        Ok((headers, body))
    }

    /// The headers of `msg` in HTTP's binding: the row's that may go out, then (binary mode)
    /// the `ce-` attributes, the content type and the signature.
    fn header_list(
        &self,
        msg: &OutboxMessage,
        env: &EnvelopeConfig,
        url: &Url,
        binary: bool,
        content_type: &'static str,
    ) -> Vec<Header> {
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
        headers::headers(msg, env, url.as_str(), &binding)
    }

    /// `list` as a request's header map, the configured static headers after the row's and
    /// before the relay's own (which replace any of the same name).
    fn header_map(
        &self,
        msg: &OutboxMessage,
        list: Vec<Header>,
        content_type: &'static str,
    ) -> Result<HeaderMap, String> {
        let mut headers = HeaderMap::with_capacity(list.len() + self.static_headers.len() + 3);
        let mut static_headers = Some(&self.static_headers);
        for header in list {
            if header.part != Part::Row
                && let Some(fixed) = static_headers.take()
            {
                append_all(&mut headers, fixed);
            }
            if header.part == Part::Row {
                self.append_row_header(msg, &mut headers, &header.name, &header.value);
            } else {
                insert_ours(&mut headers, header, content_type)?;
            }
        }
        if let Some(fixed) = static_headers {
            append_all(&mut headers, fixed);
        }
        Ok(headers)
    }

    /// Whether a row header named `name` is left out because the relay or HTTP sets it (but
    /// for the trace context, which the relay sends as the row or the tracer gives it), or a
    /// static header has that name (`Authorization` too when the URL holds userinfo).
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
    pub(super) fn drop_header(&self, msg: &OutboxMessage, name: &str, why: &str) {
        let first = self
            .warned
            .lock()
            .is_ok_and(|mut seen| seen.len() < WARNED_NAMES && seen.insert(name.to_owned()));
        if first {
            let shown: String = name.chars().take(64).collect();
            tracing::warn!(id = %msg.id, header = %shown.escape_debug(), "row header left out of HTTP requests: {why}; the row is sent without it (warned once per header name)");
        }
    }
}

/// Appends every header of `fixed` to `headers`.
fn append_all(headers: &mut HeaderMap, fixed: &HeaderMap) {
    for (name, value) in fixed {
        headers.append(name, value.clone());
    }
}

/// Sets one of the relay's own headers (an attribute, the content type, the signature),
/// replacing any of the same name.
fn insert_ours(
    headers: &mut HeaderMap,
    header: Header,
    content_type: &'static str,
) -> Result<(), String> {
    match header.part {
        // The row's own go through `append_row_header`.
        Part::Row => {}
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
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::super::tests::{env, publisher};
    use super::*;
    use crate::publish::Publisher;
    use crate::publish::envelope::tests::message;

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
    fn userinfo_is_sent_as_basic_authorization_which_a_rows_authorization_never_replaces() {
        // A bare token is a user name with an empty password; `%40` is decoded.
        for (url, basic) in [
            (
                "http://us%40r:s3cret@127.0.0.1:9/x",
                "Basic dXNAcjpzM2NyZXQ=",
            ),
            (
                "http://APIKEYSECRET@127.0.0.1:9/{event_type}",
                "Basic QVBJS0VZU0VDUkVUOg==",
            ),
        ] {
            let p = publisher(url, HttpMode::Binary, &[]);
            let m = message(r#"{"AUTHORIZATION":"Bearer row-chosen","x-keep":"k"}"#);
            let url = p.url_for(&m).unwrap();
            assert!(!url.as_str().contains('@'), "{url}");
            let (h, _) = p.request_parts(&m, &env(true), &url).unwrap();
            let all: Vec<&str> = h
                .get_all("authorization")
                .iter()
                .map(|v| v.to_str().unwrap())
                .collect();
            assert_eq!(all, [basic]);
            assert_eq!(h["x-keep"], "k");
            assert!(p.warned.lock().unwrap().contains("AUTHORIZATION"));
            // The routing line signed is the URL as sent: no userinfo.
            assert_eq!(
                h[crate::signing::HEADER].to_str().unwrap(),
                crate::publish::envelope::signature(&m, &env(true), url.as_str()).unwrap()
            );
            assert!(!format!("{h:?}").contains(basic));
        }
    }

    #[test]
    fn a_static_authorization_replaces_the_userinfo_and_wins_over_the_rows() {
        let p = publisher(
            "http://user:pw@127.0.0.1:9/x",
            HttpMode::Binary,
            &[("authorization", "Bearer static")],
        );
        let m = message(r#"{"Authorization":"Bearer row-chosen"}"#);
        let url = p.url_for(&m).unwrap();
        let (h, _) = p.request_parts(&m, &env(false), &url).unwrap();
        let all: Vec<&str> = h
            .get_all("authorization")
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(all, ["Bearer static"]);
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
}
