//! What an AMQP message carries: its properties (`message_id` = row id, the CloudEvents
//! attributes as headers in binary mode, the signature, the row's own headers, the row's
//! deadline as `expiration`) and the publish options (`mandatory`).

use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
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

/// `mandatory`: a message no queue is bound for comes back as a return, not an ack alone.
pub(super) fn publish_options() -> BasicPublishOptions {
    BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    }
}
