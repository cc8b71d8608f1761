//! What a Kafka record carries (docs/wire-format.md): the rendered topic (checked), the
//! payload, the aggregate id as key, and headers per the CloudEvents Kafka binding (`ce_<attr>`
//! headers, `content-type` for datacontenttype), the signature and the row's own headers.

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;

use crate::message::OutboxMessage;
use crate::publish::envelope::EnvelopeConfig;
use crate::publish::headers::{self, Binding};

/// The record of `msg` for `topic`, keyed by its aggregate id.
pub(super) fn record<'a>(
    msg: &'a OutboxMessage,
    env: &EnvelopeConfig,
    topic: &'a str,
) -> FutureRecord<'a, String, Vec<u8>> {
    let record = FutureRecord::to(topic)
        .payload(&msg.payload)
        .headers(record_headers(msg, env, topic));
    match &msg.aggregate_id {
        Some(key) => record.key(key),
        None => record,
    }
}

/// The record's headers per the CloudEvents Kafka binding, in the order of
/// [`headers::headers`].
fn record_headers(msg: &OutboxMessage, env: &EnvelopeConfig, topic: &str) -> OwnedHeaders {
    let binding = Binding {
        attribute_prefix: "ce_",
        attributes: true,
        content_type: Some(("content-type", env.payload_kind.content_type())),
        also_ours: &headers::none_else,
        dropped: &headers::warn_dropped,
    };
    let list = headers::headers(msg, env, topic, &binding);
    let mut out = OwnedHeaders::new_with_capacity(list.len());
    for header in &list {
        out = out.insert(Header {
            key: &header.name,
            value: Some(header.value.as_bytes()),
        });
    }
    out
}
