//! What an AMQP message carries: its properties (`message_id` = row id, the CloudEvents
//! attributes as headers in binary mode, the signature, the row's own headers, the row's
//! deadline as `expiration`) and the publish options (`mandatory`).

use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use lapin::protocol::basic::gen_properties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::RabbitMqPublisher;
use crate::message::OutboxMessage;
use crate::publish::envelope::{self, EnvelopeConfig};
use crate::publish::headers::{self, Binding, Part};

impl RabbitMqPublisher {
    /// Builds the AMQP properties, or says why this message cannot be expressed in AMQP.
    pub(super) fn properties(
        &self,
        msg: &OutboxMessage,
        env: &EnvelopeConfig,
        route: &str,
    ) -> Result<BasicProperties, String> {
        // CloudEvents binary mode: attributes as `<prefix><name>` headers (`cloudEvents:` is the
        // AMQP binding; `publisher.rabbitmq.cloudevents_prefix` picks the consumers' convention);
        // the content type is a property.
        let binding = Binding {
            attribute_prefix: self.cfg.cloudevents_prefix.as_str(),
            attributes: true,
            content_type: None,
            also_ours: &headers::none_else,
            dropped: &headers::warn_dropped,
        };
        let mut table = FieldTable::default();
        for header in headers::headers(msg, env, route, &binding) {
            let name = match header.part {
                Part::Row => {
                    let k = header.name;
                    ShortString::try_new(k.as_ref())
                        .map_err(|_| format!("header name {k:.40}… is longer than 255 bytes"))?
                }
                _ => ShortString::from(header.name.into_owned()),
            };
            table.insert(name, AMQPValue::LongString(LongString::from(header.value)));
        }
        let kind = ShortString::try_new(msg.event_type.clone())
            .map_err(|_| "event_type is longer than 255 bytes (AMQP type property)".to_owned())?;
        let timestamp = u64::try_from(msg.created_at.timestamp()).unwrap_or(0);
        let props = BasicProperties::default()
            .with_message_id(ShortString::from(msg.id.to_string()))
            .with_type(kind)
            .with_timestamp(timestamp)
            .with_content_type(ShortString::from(env.payload_kind.content_type()))
            .with_delivery_mode(2)
            .with_headers(table);
        // A row with a deadline: the broker drops it too once the deadline passes in a queue.
        Ok(
            match envelope::expiration_ms(msg.expires_at, chrono::Utc::now()) {
                Some(ms) => props.with_expiration(ShortString::from(ms)),
                None => props,
            },
        )
    }
}

/// A content-header frame's bytes besides the properties: the frame's type, channel and size
/// and its end octet around the payload; in the payload the class, weight and body size.
const HEADER_FRAME_BYTES: u64 = 1 + 2 + 4 + 1 + (2 + 2 + 8);

/// The most any property but the headers can take encoded (14 short strings of 255 bytes and
/// a timestamp, more than AMQP has), so a message whose headers are clearly small skips the
/// exact count.
const OTHER_PROPERTIES_AT_MOST: u64 = 2 + 14 * 256 + 8;

/// Whether `props` fit the one content-header frame AMQP carries a message's properties in,
/// at the broker's negotiated `frame_max` (0: no limit). A larger one makes the broker close
/// the whole connection (`FRAME_ERROR`), which would hand every message in flight back and
/// fail the same way again on the next connection; refused here, it is this message's
/// failure alone and ends in `failed` like any other.
pub(super) fn fits_one_frame(props: &BasicProperties, frame_max: u32) -> Result<(), String> {
    let limit = u64::from(frame_max);
    if limit == 0 {
        return Ok(());
    }
    let headers_at_most = props.headers().as_ref().map_or(Some(0), |table| {
        table.inner().iter().try_fold(4u64, |sum, (name, value)| {
            Some(sum + 1 + name.as_str().len() as u64 + 1 + 4 + string_len(value)?)
        })
    });
    if headers_at_most.is_some_and(|h| HEADER_FRAME_BYTES + OTHER_PROPERTIES_AT_MOST + h <= limit) {
        return Ok(());
    }
    // Near the limit: count exactly, with the encoder lapin sends the frame with.
    let size = gen_properties(props)(Vec::new().into())
        .map(|written| HEADER_FRAME_BYTES + written.position)
        .map_err(|e| format!("cannot encode the message's AMQP properties: {e:?}"))?;
    if size > limit {
        return Err(format!(
            "its headers and properties take {size} bytes in the one AMQP frame that carries \
             them, more than the broker's frame_max of {frame_max} bytes: make the row's headers \
             smaller (or raise the broker's frame_max)"
        ));
    }
    Ok(())
}

/// The length of a header value that is a string (the relay's are long strings); `None` for
/// any other kind, which the exact count then measures.
fn string_len(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::LongString(s) => Some(s.as_bytes().len() as u64),
        AMQPValue::ShortString(s) => Some(s.as_str().len() as u64),
        _ => None,
    }
}

/// `mandatory`: a message no queue is bound for comes back as a return, not an ack alone.
pub(super) fn publish_options() -> BasicPublishOptions {
    BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props_with_header(value_len: usize) -> BasicProperties {
        let mut table = FieldTable::default();
        table.insert(
            ShortString::from("big"),
            AMQPValue::LongString(LongString::from("x".repeat(value_len))),
        );
        BasicProperties::default()
            .with_message_id(ShortString::from("0190e2c5-0000-7000-8000-000000000000"))
            .with_delivery_mode(2)
            .with_headers(table)
    }

    #[test]
    fn properties_that_fit_one_frame_pass_and_larger_ones_are_refused() {
        // RabbitMQ's default frame_max.
        assert_eq!(fits_one_frame(&props_with_header(100), 131_072), Ok(()));
        let err = fits_one_frame(&props_with_header(200_000), 131_072).unwrap_err();
        assert!(err.contains("frame_max of 131072 bytes"), "{err}");
        // 0: the broker set no limit.
        assert_eq!(fits_one_frame(&props_with_header(200_000), 0), Ok(()));
    }

    #[test]
    fn the_count_near_the_limit_is_exact() {
        // Encoded: flags 2, message id 1 + 36, the table's length 4, the entry's name 1 + 3,
        // its type 1, length 4 and value, delivery mode 1; around it the frame's 8 and 12.
        let value = 1_000;
        let size = 8 + 12 + 2 + 37 + 4 + 4 + 1 + 4 + value as u32 + 1;
        let props = props_with_header(value);
        assert_eq!(fits_one_frame(&props, size), Ok(()));
        let err = fits_one_frame(&props, size - 1).unwrap_err();
        assert!(err.contains(&format!("take {size} bytes")), "{err}");
    }
}
