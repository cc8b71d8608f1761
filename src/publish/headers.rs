//! A message's headers, assembled once for every sink that carries headers (RabbitMQ, Kafka,
//! NATS, HTTP): the row's own headers less those named like the relay's, then the CloudEvents
//! attributes, the content type and the signature. Each transport only converts the list into
//! its client's header type, checking what its protocol cannot carry.

use std::borrow::Cow;

use super::envelope::{self, EnvelopeConfig};
use crate::message::OutboxMessage;

/// Where a header comes from (a transport words its errors by it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The row's `headers`.
    Row,
    /// A CloudEvents attribute.
    Attribute,
    /// The content type.
    ContentType,
    /// The `outbox-signature` header.
    Signature,
}

/// One header of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Its name.
    pub name: Cow<'static, str>,
    /// Its value.
    pub value: String,
    /// Where it comes from.
    pub part: Part,
}

/// How a sink's binding names the headers the relay sets.
pub struct Binding<'a> {
    /// The prefix of the CloudEvents attribute headers (`ce-`, `ce_`, `cloudEvents:`).
    pub attribute_prefix: &'a str,
    /// Whether the attributes go as headers (not in HTTP's structured mode, where they are in
    /// the body); their names are reserved either way.
    pub attributes: bool,
    /// The content type header's name and value, when the binding carries it as a header.
    pub content_type: Option<(&'static str, &'static str)>,
    /// Further header names the sink sets or reserves itself (compared without case by the
    /// function; a row header it holds is dropped).
    pub also_ours: &'a dyn Fn(&str) -> bool,
    /// Told each row header dropped for its name, to warn about it.
    pub dropped: &'a dyn Fn(&OutboxMessage, &str),
}

impl Binding<'_> {
    /// Whether the relay sets (or reserves) a header named `name` on a message of `env`.
    fn is_ours(&self, name: &str, env: &EnvelopeConfig) -> bool {
        envelope::is_attribute_header(name, self.attribute_prefix)
            || self
                .content_type
                .is_some_and(|(ct, _)| name.eq_ignore_ascii_case(ct))
            || envelope::is_signature_header(name, env)
            || (self.also_ours)(name)
    }
}

/// Nothing more is the sink's own.
pub fn none_else(_: &str) -> bool {
    false
}

/// Warns once per process and name that a row header named like one of the relay's is
/// dropped.
pub fn warn_dropped(msg: &OutboxMessage, name: &str) {
    envelope::warn_collision(msg, name);
}

/// The headers of `msg` routed to `route` under `binding`, in order: the row's (without those
/// named like the relay's: the relay's value wins), the CloudEvents attributes, the content
/// type, the signature (when signing). A `headers` value that is not an object is logged with
/// the row's id and sends no row headers.
pub fn headers(
    msg: &OutboxMessage,
    env: &EnvelopeConfig,
    route: &str,
    binding: &Binding<'_>,
) -> Vec<Header> {
    let (row, note) = envelope::row_headers(msg);
    if let Some(note) = note {
        tracing::warn!(id = %msg.id, "{note}");
    }
    let mut out = Vec::with_capacity(row.len() + 10);
    for (name, value) in row {
        if binding.is_ours(&name, env) {
            (binding.dropped)(msg, &name);
            continue;
        }
        out.push(Header {
            name: Cow::Owned(name),
            value,
            part: Part::Row,
        });
    }
    if binding.attributes {
        for (attr, value) in envelope::cloud_event_attributes(msg, env) {
            out.push(Header {
                name: attribute_header(binding.attribute_prefix, attr),
                value,
                part: Part::Attribute,
            });
        }
    }
    if let Some((name, value)) = binding.content_type {
        out.push(Header {
            name: Cow::Borrowed(name),
            value: value.to_owned(),
            part: Part::ContentType,
        });
    }
    if let Some(signature) = envelope::signature(msg, env, route) {
        out.push(Header {
            name: Cow::Borrowed(crate::signing::HEADER),
            value: signature,
            part: Part::Signature,
        });
    }
    out
}

/// The header carrying the CloudEvents attribute `attr`: `<prefix><attr>`, spelled out once
/// for the `ce-` bindings (NATS, HTTP) ([`envelope::ce_dash_header`]).
fn attribute_header(prefix: &str, attr: &str) -> Cow<'static, str> {
    match envelope::ce_dash_header(attr).filter(|_| prefix == "ce-") {
        Some(name) => Cow::Borrowed(name),
        None => Cow::Owned(format!("{prefix}{attr}")),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::message::PayloadKind;
    use crate::publish::envelope::tests::message;
    use crate::template::Template;

    fn env(signed: bool) -> EnvelopeConfig {
        EnvelopeConfig {
            route: Template::parse("r").unwrap(),
            source: "/s".into(),
            payload_kind: PayloadKind::Json,
            signer: signed
                .then(|| std::sync::Arc::new(crate::signing::Signer::new("k1", &[7u8; 32]))),
        }
    }

    #[test]
    fn the_rows_then_the_attributes_the_content_type_and_the_signature() {
        let dropped = Mutex::new(Vec::new());
        let record = |_: &OutboxMessage, name: &str| dropped.lock().unwrap().push(name.to_owned());
        let binding = Binding {
            attribute_prefix: "ce_",
            attributes: true,
            content_type: Some(("content-type", "application/json")),
            also_ours: &|name| name == "mine",
            dropped: &record,
        };
        let m = message(
            r#"{"CE_ID":"forged","Content-Type":"x","outbox-signature":"no","mine":"1","keep":"k"}"#,
        );
        let h = headers(&m, &env(true), "topic", &binding);
        let parts: Vec<(&str, Part)> = h.iter().map(|h| (h.name.as_ref(), h.part)).collect();
        assert_eq!(
            parts,
            [
                ("keep", Part::Row),
                ("ce_specversion", Part::Attribute),
                ("ce_id", Part::Attribute),
                ("ce_type", Part::Attribute),
                ("ce_source", Part::Attribute),
                ("ce_time", Part::Attribute),
                ("ce_aggregatetype", Part::Attribute),
                ("ce_subject", Part::Attribute),
                ("content-type", Part::ContentType),
                ("outbox-signature", Part::Signature),
            ]
        );
        assert_eq!(
            h.last().map(|h| h.value.clone()),
            envelope::signature(&m, &env(true), "topic")
        );
        let mut dropped = dropped.into_inner().unwrap();
        dropped.sort();
        assert_eq!(
            dropped,
            ["CE_ID", "Content-Type", "mine", "outbox-signature"]
        );
    }

    #[test]
    fn unsigned_and_without_attributes_the_signature_header_is_the_rows() {
        let binding = Binding {
            attribute_prefix: "ce-",
            attributes: false,
            content_type: None,
            also_ours: &none_else,
            dropped: &warn_dropped,
        };
        let m = message(r#"{"outbox-signature":"row's","ce-id":"x"}"#);
        let h = headers(&m, &env(false), "r", &binding);
        assert_eq!(
            h,
            [Header {
                name: Cow::Borrowed("outbox-signature"),
                value: "row's".into(),
                part: Part::Row
            }]
        );
        assert_eq!(attribute_header("cloudEvents:", "id"), "cloudEvents:id");
    }

    #[test]
    fn every_attribute_has_its_ce_header_spelled_out() {
        for attr in envelope::CLOUD_EVENT_ATTRIBUTES {
            let name = attribute_header("ce-", attr);
            assert!(matches!(name, Cow::Borrowed(_)), "{attr}");
            assert_eq!(name, format!("ce-{attr}"));
        }
    }
}
