//! Answers to outcomes: the status classes (docs/http.md), `Retry-After`, and the start of a
//! failed answer's body for `last_error`.

use std::time::Duration;

use reqwest::header::HeaderMap;
use reqwest::{Response, StatusCode};

use super::{HttpPublisher, MAX_RETRY_AFTER};
use crate::publish::Outcome;
use crate::redact::redact_url_tokens;

/// How much of a 2xx answer's body is read (so the connection can be reused); past this the
/// rest is not read and the connection is closed.
const DRAIN_LIMIT: usize = 64 * 1024;

/// How much of a failed answer's body `last_error` quotes.
const BODY_QUOTE: usize = 200;

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
    /// Reads the answer to a request and decides what it means.
    pub(super) async fn outcome(&self, response: Response) -> Outcome {
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
                    .map(|l| format!(" (Location: {}; redirects are not followed)", redact_url_tokens(l)))
                    .unwrap_or_default();
                let body = body_start(response).await;
                self.answered();
                Outcome::Rejected(format!("HTTP {status}{location}{body}"))
            }
        }
    }
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
    use reqwest::header::HeaderValue;

    use super::*;

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
}
