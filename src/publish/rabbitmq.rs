//! RabbitMQ transport (lapin): one connection, a pool of confirm-mode channels with at most
//! one unconfirmed message each, `mandatory` so that an unroutable message comes back as a
//! failure.
//!
//! Why one message per channel: a broker acks many deliveries with one `multiple` ack, and
//! lapin hands the `basic.return`s received before it to whichever of those confirms it
//! completes first — not necessarily the message that was returned. With one unconfirmed
//! message per channel a return can only belong to that message, so an unroutable row is
//! never marked sent and a delivered row never blamed. Concurrency comes from the number of
//! channels (`relay.max_in_flight`, at most [`crate::config::MAX_AMQP_CHANNELS`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use tokio::sync::Semaphore;

use super::envelope::{self, EnvelopeConfig};
use super::{ConnectError, Outcome, Publisher};
use crate::config::RabbitMqConfig;
use crate::redact::redact_url;
use crate::store::OutboxMessage;

/// A live connection and its idle channels.
struct Live {
    // Distinguishes this connection from its successors, so that a failure seen on an old
    // channel never tears down a newer connection.
    generation: u64,
    connection: Connection,
    idle: Mutex<Vec<Channel>>,
    // One permit per channel the pool may hold; a publish holds one while its message is
    // unconfirmed.
    slots: Arc<Semaphore>,
}

/// Publishes to a RabbitMQ exchange with publisher confirms.
pub struct RabbitMqPublisher {
    cfg: RabbitMqConfig,
    envelope: EnvelopeConfig,
    state: RwLock<Option<Arc<Live>>>,
    generations: AtomicU64,
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
            generations: AtomicU64::new(0),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    fn live(&self) -> Option<Arc<Live>> {
        let guard = self.state.read().unwrap_or_else(|p| p.into_inner());
        guard.clone()
    }

    /// Forgets connection `generation` after a failure (if it is still the current one) and
    /// closes it in the background, so a slow but live broker is not left with a stray
    /// connection.
    fn mark_down(&self, generation: u64) {
        let old = {
            let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
            if guard.as_ref().is_some_and(|l| l.generation == generation) {
                guard.take()
            } else {
                None
            }
        };
        if let Some(live) = old {
            tokio::spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(5),
                    live.connection
                        .close(320, ShortString::from("outbox-relay reconnecting")),
                )
                .await;
            });
        }
    }

    /// An idle channel of `live`, opening a new one (in confirm mode) when none is idle.
    async fn checkout(&self, live: &Live) -> Result<Channel, lapin::Error> {
        let idle = {
            let mut idle = live.idle.lock().unwrap_or_else(|p| p.into_inner());
            idle.pop()
        };
        match idle {
            Some(ch) if ch.status().connected() => Ok(ch),
            _ => {
                let ch = live.connection.create_channel().await?;
                ch.confirm_select(ConfirmSelectOptions::default()).await?;
                Ok(ch)
            }
        }
    }

    fn checkin(live: &Live, channel: Channel) {
        if channel.status().connected() {
            let mut idle = live.idle.lock().unwrap_or_else(|p| p.into_inner());
            idle.push(channel);
        }
    }

    /// A channel failed under a publish. If the connection is gone, that is connection-level
    /// (hand back, reconnect); if only the channel was closed by the broker, this message
    /// caused it (e.g. larger than the broker accepts), so it is message-level.
    fn channel_failure(&self, live: &Live, reason: &str) -> Outcome {
        if live.connection.status().connected() {
            Outcome::Rejected(format!("the broker closed the channel: {reason}"))
        } else {
            self.mark_down(live.generation);
            Outcome::Unavailable(format!("connection lost: {reason}"))
        }
    }

    /// Builds the AMQP properties, or says why this message cannot be expressed in AMQP.
    fn properties(&self, msg: &OutboxMessage, route: &str) -> Result<BasicProperties, String> {
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
        // CloudEvents binary mode: attributes as `<prefix><name>` headers (`cloudEvents:` is the
        // AMQP binding; `publisher.rabbitmq.cloudevents_prefix` picks the consumers' convention).
        let prefix = self.cfg.cloudevents_prefix.as_str();
        for (name, value) in envelope::cloud_event_attributes(msg, &self.envelope) {
            headers.insert(
                ShortString::from(format!("{prefix}{name}")),
                AMQPValue::LongString(LongString::from(value)),
            );
        }
        if let Some(sig) = envelope::signature(msg, &self.envelope, route) {
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
            .with_content_type(ShortString::from(self.envelope.payload_kind.content_type()))
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

/// Declares the development queue (durable) and binds it to `exchange` with `binding`.
async fn declare_dev_queue(
    channel: &Channel,
    queue: &str,
    exchange: &str,
    binding: &str,
) -> Result<(), ConnectError> {
    channel
        .queue_declare(
            ShortString::from(queue.to_owned()),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            ConnectError(format!(
                "cannot declare queue {queue:?} (publisher.rabbitmq.declare_queue): {e}; if it exists with other settings, choose another name or remove the key"
            ))
        })?;
    channel
        .queue_bind(
            ShortString::from(queue.to_owned()),
            ShortString::from(exchange.to_owned()),
            ShortString::from(binding.to_owned()),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            ConnectError(format!(
                "cannot bind queue {queue:?} to exchange {exchange:?} with {binding:?} (publisher.rabbitmq.queue_binding): {e}"
            ))
        })
}

fn exchange_kind(name: &str) -> ExchangeKind {
    match name {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "headers" => ExchangeKind::Headers,
        _ => ExchangeKind::Topic,
    }
}

/// Maps a broker confirmation of message `id` to an outcome. An ack that carries a returned
/// message means the message was unroutable (`mandatory`): that is a failure, not a success.
/// A returned message that is not this one would mean the attribution is broken: the row is
/// handed back rather than guessed about.
pub fn classify_confirmation(confirmation: Confirmation, id: &str) -> Outcome {
    match confirmation {
        Confirmation::Ack(None) => Outcome::Confirmed,
        Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned))
            if returned
                .delivery
                .properties
                .message_id()
                .as_ref()
                .is_some_and(|m| m.as_str() != id) =>
        {
            Outcome::Unavailable(format!(
                "a return for another message arrived with this confirm ({} {})",
                returned.reply_code, returned.reply_text
            ))
        }
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
        if let Some(old) = self.live() {
            self.mark_down(old.generation);
        }
        let fail = |what: &str, e: lapin::Error| {
            ConnectError(format!("{what} {}: {e}", redact_url(&self.cfg.url)))
        };
        let props = ConnectionProperties::default()
            .with_connection_name(LongString::from(crate::store::APPLICATION_NAME));
        let connection = tokio::time::timeout(
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
        let channel = connection
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
        if let Some(queue) = &self.cfg.declare_queue {
            declare_dev_queue(&channel, queue, &self.cfg.exchange, &self.cfg.queue_binding).await?;
        }
        let live = Live {
            generation: self.generations.fetch_add(1, Ordering::Relaxed) + 1,
            connection,
            idle: Mutex::new(vec![channel]),
            slots: Arc::new(Semaphore::new(self.cfg.channels.max(1))),
        };
        let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
        *guard = Some(Arc::new(live));
        Ok(())
    }

    fn is_connected(&self) -> bool {
        self.live()
            .is_some_and(|l| l.connection.status().connected())
    }

    async fn publish(&self, msg: &OutboxMessage) -> Outcome {
        let Some(live) = self.live() else {
            return Outcome::Unavailable("not connected to RabbitMQ".to_owned());
        };
        let routing_key = envelope::destination(msg, &self.cfg.routing_key);
        let Ok(routing_key) = ShortString::try_new(routing_key) else {
            return Outcome::Rejected("routing key is longer than 255 bytes".to_owned());
        };
        let props = match self.properties(msg, routing_key.as_str()) {
            Ok(p) => p,
            Err(reason) => return Outcome::Rejected(reason),
        };
        // One unconfirmed message per channel (see the module docs).
        let Ok(_slot) = Arc::clone(&live.slots).acquire_owned().await else {
            return Outcome::Unavailable("publisher closed".to_owned());
        };
        // Opening a channel waits for the broker too: bound it like the confirm.
        let channel =
            match tokio::time::timeout(self.cfg.confirm_timeout, self.checkout(&live)).await {
                Ok(Ok(ch)) => ch,
                Ok(Err(e)) => {
                    return self.channel_failure(&live, &format!("cannot open a channel: {e}"));
                }
                Err(_) => {
                    self.mark_down(live.generation);
                    return Outcome::Unavailable(format!(
                        "no answer to opening a channel within {}",
                        humantime::format_duration(self.cfg.confirm_timeout)
                    ));
                }
            };
        let exchange = ShortString::from(self.cfg.exchange.clone());
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let sent = tokio::time::timeout(
            self.cfg.confirm_timeout,
            channel.basic_publish(exchange, routing_key, options, &msg.payload, props),
        )
        .await;
        let confirm = match sent {
            Ok(Ok(confirm)) => confirm,
            Ok(Err(e)) => return self.channel_failure(&live, &format!("publish failed: {e}")),
            Err(_) => {
                self.mark_down(live.generation);
                return Outcome::Unavailable("the broker did not take the message in time".into());
            }
        };
        match tokio::time::timeout(self.cfg.confirm_timeout, confirm).await {
            Ok(Ok(confirmation)) => {
                let outcome = classify_confirmation(confirmation, &msg.id.to_string());
                Self::checkin(&live, channel);
                outcome
            }
            Ok(Err(e)) => self.channel_failure(&live, &format!("no confirm: {e}")),
            Err(_) => {
                // No answer at all: treat the connection as dead rather than the message as bad.
                self.mark_down(live.generation);
                Outcome::Unavailable(format!(
                    "no confirm within {}",
                    humantime::format_duration(self.cfg.confirm_timeout)
                ))
            }
        }
    }

    async fn close(&self) {
        let live = {
            let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
            guard.take()
        };
        if let Some(live) = live {
            // Short: the drain is over by now and shutdown_timeout is the operator's budget.
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                live.connection
                    .close(200, ShortString::from("outbox-relay shutting down")),
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
            classify_confirmation(Confirmation::Ack(None), "x"),
            Outcome::Confirmed
        );
        assert!(matches!(
            classify_confirmation(Confirmation::Nack(None), "x"),
            Outcome::Rejected(_)
        ));
        assert!(matches!(
            classify_confirmation(Confirmation::NotRequested, "x"),
            Outcome::Unavailable(_)
        ));
    }
}
