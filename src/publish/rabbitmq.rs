//! RabbitMQ transport (lapin): one connection, one confirm-mode channel, many publishes in
//! flight, `mandatory` so that an unroutable message comes back as a failure.

use std::sync::RwLock;
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};

use super::envelope::{self, EnvelopeConfig};
use super::{ConnectError, Outcome, Publisher};
use crate::config::RabbitMqConfig;
use crate::redact::redact_url;
use crate::store::OutboxMessage;

/// Publishes to a RabbitMQ exchange with publisher confirms.
pub struct RabbitMqPublisher {
    cfg: RabbitMqConfig,
    envelope: EnvelopeConfig,
    // The live channel; `None` until connected and after a failure. Cloning a lapin channel is
    // cheap, so publishes take it out of the lock before awaiting anything.
    state: RwLock<Option<(Connection, Channel)>>,
    // Serialises reconnects so concurrent failures open one connection, not many.
    connecting: tokio::sync::Mutex<()>,
}

impl RabbitMqPublisher {
    /// A publisher that connects on the first [`Publisher::connect`].
    pub fn new(cfg: RabbitMqConfig, envelope: EnvelopeConfig) -> Self {
        Self {
            cfg,
            envelope,
            state: RwLock::new(None),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    fn channel(&self) -> Option<Channel> {
        let guard = self.state.read().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().map(|(_, ch)| ch.clone())
    }

    /// Forgets the connection after a failure and closes it in the background, so a slow but
    /// live broker is not left with a stray connection.
    fn mark_down(&self) {
        let old = {
            let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
            guard.take()
        };
        if let Some((conn, _)) = old {
            tokio::spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(5),
                    conn.close(320, ShortString::from("outbox-relay reconnecting")),
                )
                .await;
            });
        }
    }

    /// Builds the AMQP properties, or says why this message cannot be expressed in AMQP.
    fn properties(&self, msg: &OutboxMessage) -> Result<BasicProperties, String> {
        let mut headers = FieldTable::default();
        let (row_headers, note) = envelope::row_headers(msg);
        if let Some(note) = note {
            tracing::warn!(id = %msg.id, "{note}");
        }
        for (k, v) in row_headers {
            let key = ShortString::try_new(k.clone())
                .map_err(|_| format!("header name {k:.40}… is longer than 255 bytes"))?;
            headers.insert(key, AMQPValue::LongString(LongString::from(v)));
        }
        // CloudEvents AMQP binding: attributes as `cloudEvents:<name>` application properties.
        for (name, value) in envelope::cloud_event_attributes(msg, &self.envelope) {
            headers.insert(
                ShortString::from(format!("cloudEvents:{name}")),
                AMQPValue::LongString(LongString::from(value)),
            );
        }
        let kind = ShortString::try_new(msg.event_type.clone())
            .map_err(|_| "event_type is longer than 255 bytes (AMQP type property)".to_owned())?;
        let timestamp = u64::try_from(msg.created_at.timestamp()).unwrap_or(0);
        Ok(BasicProperties::default()
            .with_message_id(ShortString::from(msg.id.to_string()))
            .with_type(kind)
            .with_timestamp(timestamp)
            .with_content_type(ShortString::from(self.envelope.payload_kind.content_type()))
            .with_delivery_mode(2)
            .with_headers(headers))
    }
}

fn exchange_kind(name: &str) -> ExchangeKind {
    match name {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "headers" => ExchangeKind::Headers,
        _ => ExchangeKind::Topic,
    }
}

/// Maps a broker confirmation to an outcome. An ack that carries a returned message means the
/// message was unroutable (`mandatory`): that is a failure, not a success.
pub fn classify_confirmation(confirmation: Confirmation) -> Outcome {
    match confirmation {
        Confirmation::Ack(None) => Outcome::Confirmed,
        Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
            Outcome::Rejected(format!(
                "returned by the broker: {} {} (no queue bound for exchange {:?}, routing key {:?})",
                returned.reply_code,
                returned.reply_text,
                returned.delivery.exchange.as_str(),
                returned.delivery.routing_key.as_str()
            ))
        }
        Confirmation::Nack(None) => Outcome::Rejected("nacked by the broker".to_owned()),
        Confirmation::NotRequested => {
            Outcome::Unavailable("channel is not in confirm mode".to_owned())
        }
    }
}

#[async_trait]
impl Publisher for RabbitMqPublisher {
    fn kind(&self) -> &'static str {
        "rabbitmq"
    }

    fn describe(&self) -> String {
        format!(
            "rabbitmq {} exchange {:?} routing key {:?}",
            redact_url(&self.cfg.url),
            self.cfg.exchange,
            self.cfg.routing_key.as_str()
        )
    }

    async fn connect(&self) -> Result<(), ConnectError> {
        let _serial = self.connecting.lock().await;
        if self.is_connected() {
            return Ok(());
        }
        self.mark_down();
        let fail = |what: &str, e: lapin::Error| {
            ConnectError(format!("{what} {}: {e}", redact_url(&self.cfg.url)))
        };
        let props = ConnectionProperties::default()
            .with_connection_name(LongString::from(crate::store::APPLICATION_NAME));
        let conn = tokio::time::timeout(
            Duration::from_secs(10),
            Connection::connect(&self.cfg.url, props),
        )
        .await
        .map_err(|_| {
            ConnectError(format!(
                "timed out connecting to {}",
                redact_url(&self.cfg.url)
            ))
        })?
        .map_err(|e| fail("cannot connect to", e))?;
        let channel = conn
            .create_channel()
            .await
            .map_err(|e| fail("cannot open a channel on", e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| fail("cannot enable publisher confirms on", e))?;
        if self.cfg.declare_exchange && !self.cfg.exchange.is_empty() {
            channel
                .exchange_declare(
                    ShortString::from(self.cfg.exchange.clone()),
                    exchange_kind(&self.cfg.exchange_type),
                    ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    ConnectError(format!(
                        "cannot declare exchange {:?} ({}): {e}; if it exists with other settings, set publisher.rabbitmq.declare_exchange = false",
                        self.cfg.exchange, self.cfg.exchange_type
                    ))
                })?;
        }
        let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
        *guard = Some((conn, channel));
        Ok(())
    }

    fn is_connected(&self) -> bool {
        let guard = self.state.read().unwrap_or_else(|p| p.into_inner());
        guard
            .as_ref()
            .is_some_and(|(c, ch)| c.status().connected() && ch.status().connected())
    }

    async fn publish(&self, msg: &OutboxMessage) -> Outcome {
        let Some(channel) = self.channel() else {
            return Outcome::Unavailable("not connected to RabbitMQ".to_owned());
        };
        let routing_key = envelope::destination(msg, &self.cfg.routing_key);
        let Ok(routing_key) = ShortString::try_new(routing_key) else {
            return Outcome::Rejected("routing key is longer than 255 bytes".to_owned());
        };
        let props = match self.properties(msg) {
            Ok(p) => p,
            Err(reason) => return Outcome::Rejected(reason),
        };
        let exchange = ShortString::from(self.cfg.exchange.clone());
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let confirm = match channel
            .basic_publish(exchange, routing_key, options, &msg.payload, props)
            .await
        {
            Ok(confirm) => confirm,
            Err(e) => {
                self.mark_down();
                return Outcome::Unavailable(format!("publish failed: {e}"));
            }
        };
        match tokio::time::timeout(self.cfg.confirm_timeout, confirm).await {
            Ok(Ok(confirmation)) => classify_confirmation(confirmation),
            Ok(Err(e)) => {
                self.mark_down();
                Outcome::Unavailable(format!("connection lost before the confirm: {e}"))
            }
            Err(_) => {
                // No answer at all: treat the connection as dead rather than the message as bad.
                self.mark_down();
                Outcome::Unavailable(format!(
                    "no confirm within {}",
                    humantime::format_duration(self.cfg.confirm_timeout)
                ))
            }
        }
    }

    async fn close(&self) {
        let state = {
            let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
            guard.take()
        };
        if let Some((conn, _)) = state {
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                conn.close(200, ShortString::from("outbox-relay shutting down")),
            )
            .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_ack_is_confirmed_and_nack_rejected() {
        assert_eq!(
            classify_confirmation(Confirmation::Ack(None)),
            Outcome::Confirmed
        );
        assert!(matches!(
            classify_confirmation(Confirmation::Nack(None)),
            Outcome::Rejected(_)
        ));
        assert!(matches!(
            classify_confirmation(Confirmation::NotRequested),
            Outcome::Unavailable(_)
        ));
    }
}
