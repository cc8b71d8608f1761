//! What a JetStream message carries (docs/nats.md): the subject, and headers per the
//! CloudEvents NATS binding (binary mode), `Nats-Msg-Id` = row id, the signature, and the
//! row's own headers.

use std::borrow::Cow;

use async_nats::{HeaderMap, HeaderName, HeaderValue};

use crate::message::OutboxMessage;
use crate::publish::envelope::{self, EnvelopeConfig};
use crate::publish::headers::{self, Binding, Part};

/// The header JetStream de-duplicates on, within the stream's duplicate window.
pub const MSG_ID: &str = "Nats-Msg-Id";
/// The content type header of the NATS binding.
pub const CONTENT_TYPE: &str = "Content-Type";
/// The CloudEvents attribute header prefix of the NATS binding.
pub const CE_PREFIX: &str = "ce-";

/// Whether the relay sets a header of this name itself (compared without case, so a row's
/// `content-type` does not ride beside ours).
pub fn is_own(name: &str) -> bool {
    envelope::is_attribute_header(name, CE_PREFIX)
        || [CONTENT_TYPE, MSG_ID, crate::signing::HEADER]
            .iter()
            .any(|own| name.eq_ignore_ascii_case(own))
}

/// The headers of `msg` published to `subject`. An error when a name or value cannot be
/// carried by NATS (a name with `:` or a non-printable character, a value with CR or LF): the
/// message cannot be sent as written, so it is a message-level failure.
pub fn headers(
    msg: &OutboxMessage,
    env: &EnvelopeConfig,
    subject: &str,
) -> Result<HeaderMap, String> {
    let binding = Binding {
        attribute_prefix: CE_PREFIX,
        attributes: true,
        content_type: Some((CONTENT_TYPE, env.payload_kind.content_type())),
        also_ours: &is_own,
        dropped: &headers::warn_dropped,
    };
    let mut map = HeaderMap::new();
    for header in headers::headers(msg, env, subject, &binding) {
        let (name, what) = match (header.name, header.part) {
            (Cow::Borrowed(name), part) => (HeaderName::from_static(name), what(part)),
            (Cow::Owned(name), Part::Row) => match HeaderName::try_from(name.as_str()) {
                Ok(n) => (n, "row header"),
                Err(_) => {
                    return Err(format!(
                        "row header name {name:.60?} cannot be a NATS header name (no ':', spaces or control characters)"
                    ));
                }
            },
            (Cow::Owned(name), part) => match HeaderName::try_from(name.as_str()) {
                Ok(n) => (n, what(part)),
                Err(_) => {
                    return Err(format!(
                        "{} {name:.60?} cannot be a NATS header name",
                        what(part)
                    ));
                }
            },
        };
        let value = value_of(header.value, AsRef::<str>::as_ref(&name), what)?;
        map.insert(name, value);
    }
    // A UUID's text: nothing to check.
    map.insert(
        HeaderName::from_static(MSG_ID),
        HeaderValue::from(msg.id.to_string()),
    );
    Ok(map)
}

/// How an error names a header of `part`.
fn what(part: Part) -> &'static str {
    match part {
        Part::Row => "row header",
        Part::Attribute => "attribute",
        Part::ContentType | Part::Signature => "header",
    }
}

/// `value` as a header value, taken over without a copy; an error naming `name` when it holds
/// CR or LF, which NATS headers cannot carry.
fn value_of(value: String, name: &str, what: &str) -> Result<HeaderValue, String> {
    if value.contains(['\r', '\n']) {
        return Err(format!(
            "{what} {name:.60?} has a value with CR or LF, which NATS headers cannot carry"
        ));
    }
    Ok(HeaderValue::from(value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::PayloadKind;
    use crate::publish::envelope::tests::message;
    use crate::template::Template;

    fn env(signed: bool) -> EnvelopeConfig {
        EnvelopeConfig {
            route: Template::parse("outbox.{aggregate_type}.{event_type}").unwrap(),
            source: "/outbox/test/outbox_messages".into(),
            payload_kind: PayloadKind::Json,
            signer: signed
                .then(|| std::sync::Arc::new(crate::signing::Signer::new("k1", &[7u8; 32]))),
        }
    }

    fn get<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
        h.get(name).map(|v| v.as_str())
    }

    #[test]
    fn headers_follow_the_nats_binding_and_ours_win() {
        let m = message(
            r#"{"ce-id":"forged","Content-Type":"text/plain","nats-msg-id":"x","outbox-signature":"no","trace":"t-1","n":1,"gone":null}"#,
        );
        let h = headers(&m, &env(true), "outbox.order.created").unwrap();
        assert_eq!(
            get(&h, "ce-id"),
            Some("00000000-0000-0000-0000-000000000000")
        );
        assert_eq!(get(&h, "Nats-Msg-Id"), get(&h, "ce-id"));
        assert_eq!(get(&h, "ce-source"), Some("/outbox/test/outbox_messages"));
        assert_eq!(get(&h, "ce-specversion"), Some("1.0"));
        assert_eq!(get(&h, "ce-type"), Some("created"));
        assert_eq!(get(&h, "ce-subject"), Some("42"));
        assert_eq!(get(&h, "ce-time"), Some("2026-01-02T03:04:05.000000Z"));
        assert_eq!(get(&h, "ce-aggregatetype"), Some("order"));
        assert_eq!(get(&h, "Content-Type"), Some("application/json"));
        assert_eq!(get(&h, "trace"), Some("t-1"));
        assert_eq!(get(&h, "n"), Some("1"));
        assert_eq!(get(&h, "gone"), None);
        assert_eq!(get(&h, "nats-msg-id"), None);
        let sig = get(&h, "outbox-signature").unwrap();
        assert_eq!(
            Some(sig.to_owned()),
            envelope::signature(&m, &env(true), "outbox.order.created")
        );
        let unsigned = headers(&m, &env(false), "s").unwrap();
        assert_eq!(get(&unsigned, "outbox-signature"), None);
    }

    #[test]
    fn headers_nats_cannot_carry_are_a_message_level_error() {
        let bad_name = message(r#"{"a:b":"x"}"#);
        assert!(
            headers(&bad_name, &env(false), "s")
                .unwrap_err()
                .contains("a:b")
        );
        let bad_value = message(r#"{"x":"line\r\nbreak"}"#);
        assert!(
            headers(&bad_value, &env(false), "s")
                .unwrap_err()
                .contains("CR or LF")
        );
        let mut bad_type = message("{}");
        bad_type.event_type = "created\nx".into();
        let err = headers(&bad_type, &env(false), "s").unwrap_err();
        assert!(err.contains(r#"attribute "ce-type""#), "{err}");
    }
}
