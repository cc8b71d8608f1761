//! What an AMQP message carries: its properties (`message_id` = row id, the CloudEvents
//! attributes as headers in binary mode, the signature, the row's own headers, the row's
//! deadline as `expiration`) and the publish options (`mandatory`).

use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::RabbitMqPublisher;
use crate::message::OutboxMessage;
use crate::publish::envelope::{self, EnvelopeConfig};

impl RabbitMqPublisher {
    /// Builds the AMQP properties, or says why this message cannot be expressed in AMQP.
    pub(super) fn properties(
        &self,
        msg: &OutboxMessage,
        env: &EnvelopeConfig,
        route: &str,
    ) -> Result<BasicProperties, String> {
        let mut headers = FieldTable::default();
        // CloudEvents binary mode: attributes as `<prefix><name>` headers (`cloudEvents:` is the
        // AMQP binding; `publisher.rabbitmq.cloudevents_prefix` picks the consumers' convention).
        let prefix = self.cfg.cloudevents_prefix.as_str();
        let ours = |name: &str| {
            envelope::is_attribute_header(name, prefix) || envelope::is_signature_header(name, env)
        };
        for (k, v) in envelope::row_headers_beside(msg, ours) {
            let key = ShortString::try_new(k.clone())
                .map_err(|_| format!("header name {k:.40}… is longer than 255 bytes"))?;
            headers.insert(key, AMQPValue::LongString(LongString::from(v)));
        }
        for (name, value) in envelope::cloud_event_attributes(msg, env) {
            headers.insert(
                ShortString::from(format!("{prefix}{name}")),
                AMQPValue::LongString(LongString::from(value)),
            );
        }
        if let Some(sig) = envelope::signature(msg, env, route) {
            headers.insert(
                ShortString::from(crate::signing::HEADER),
                AMQPValue::LongString(LongString::from(sig)),
            );
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
            .with_headers(headers);
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
