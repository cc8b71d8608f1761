//! The connection's life: connecting (TLS, publisher confirms), declaring the exchange and the
//! development queue, the live connection with its channels, opening a confirm-mode channel on
//! it, and giving it up when it fails.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use lapin::options::{
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{FieldTable, LongString, ShortString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio_util::sync::CancellationToken;

use super::channels::ChannelSlot;
use super::isolation::Solo;
use super::{CHANNELS, RabbitMqPublisher};
use crate::config::{ExchangeType, RabbitMqConfig};
use crate::publish::{ConnectError, Outcome};
use crate::redact::redact_url;

/// A live connection and its channels.
pub(super) struct Live {
    // Distinguishes this connection from its successors, so that a failure seen on an old
    // channel never tears down a newer connection.
    pub(super) generation: u64,
    pub(super) connection: Connection,
    pub(super) channels: Vec<ChannelSlot>,
    // Round-robin over `channels`.
    pub(super) next_slot: AtomicUsize,
    // Channels for messages published alone (see the module docs).
    pub(super) solo: Solo,
    // Cancelled when this connection is given up: its settlers hand back what they hold.
    pub(super) gone: CancellationToken,
}

impl Live {
    /// Connection `generation`, with [`CHANNELS`] publishing channels yet to open and
    /// `first` (in confirm mode) as its first solo channel.
    pub(super) fn new(generation: u64, connection: Connection, first: Channel) -> Self {
        Self {
            generation,
            connection,
            channels: (0..CHANNELS).map(|_| ChannelSlot::default()).collect(),
            next_slot: AtomicUsize::new(0),
            solo: Solo::new(first),
            gone: CancellationToken::new(),
        }
    }
}

/// Connects to `cfg.url` (within 10 s, trusting `tls_ca_pem` if set) and opens a first
/// channel in confirm mode.
pub(super) async fn open(cfg: &RabbitMqConfig) -> Result<(Connection, Channel), ConnectError> {
    let fail = |what: &str, e: lapin::Error| {
        ConnectError(format!(
            "{what} {}: {e}{}",
            redact_url(&cfg.url),
            tls_hint(&e)
        ))
    };
    let props = ConnectionProperties::default()
        .with_connection_name(LongString::from(crate::message::APPLICATION_NAME));
    let tls = OwnedTLSConfig {
        identity: None,
        cert_chain: cfg.tls_ca_pem.clone(),
    };
    let runtime =
        lapin::runtime::default_runtime().map_err(|e| fail("no runtime to connect to", e))?;
    let connection = tokio::time::timeout(
        Duration::from_secs(10),
        Connection::connect_with_config(&cfg.url, props, tls, runtime),
    )
    .await
    .map_err(|_| ConnectError(format!("timed out connecting to {}", redact_url(&cfg.url))))?
    .map_err(|e| fail("cannot connect to", e))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| fail("cannot open a channel on", e))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| fail("cannot enable publisher confirms on", e))?;
    Ok((connection, channel))
}

/// What RabbitMQ says when it closes a channel for publishing to an exchange it lacks.
const NO_EXCHANGE: &str = "NOT_FOUND - no exchange";

/// Makes sure the exchange is there: declared (`declare_exchange`, not the default one) on
/// `channel`, or else looked up with a passive declare on a channel of its own (a missing
/// exchange closes that channel, which is why it is not `channel`). Then the development
/// queue (`declare_queue`).
pub(super) async fn declare(
    connection: &Connection,
    channel: &Channel,
    cfg: &RabbitMqConfig,
) -> Result<(), ConnectError> {
    if cfg.exchange.is_empty() {
        // The default exchange: always there, never declared.
    } else if cfg.declare_exchange {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        declare_exchange(channel, cfg, durable).await.map_err(|e| {
            ConnectError(format!(
                "cannot declare exchange {:?} ({}): {e}; if it exists with other settings, set publisher.rabbitmq.declare_exchange = false",
                cfg.exchange, cfg.exchange_type.as_str()
            ))
        })?;
    } else {
        exchange_exists(connection, cfg).await?;
    }
    if let Some(queue) = &cfg.declare_queue {
        declare_dev_queue(channel, queue, &cfg.exchange, &cfg.queue_binding).await?;
    }
    Ok(())
}

/// A passive declare of the exchange, on a channel opened for it and closed after.
async fn exchange_exists(
    connection: &Connection,
    cfg: &RabbitMqConfig,
) -> Result<(), ConnectError> {
    let fail = |e: lapin::Error| {
        ConnectError(format!(
            "exchange {:?} cannot be used: {e}; declare it on the broker, or set publisher.rabbitmq.declare_exchange = true",
            cfg.exchange
        ))
    };
    let channel = connection.create_channel().await.map_err(fail)?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..ExchangeDeclareOptions::default()
    };
    declare_exchange(&channel, cfg, passive)
        .await
        .map_err(fail)?;
    let _ = channel
        .close(200, ShortString::from("exchange found"))
        .await;
    Ok(())
}

/// Declares the configured exchange (its name and type) on `channel` with `options`.
async fn declare_exchange(
    channel: &Channel,
    cfg: &RabbitMqConfig,
    options: ExchangeDeclareOptions,
) -> lapin::Result<()> {
    channel
        .exchange_declare(
            ShortString::from(cfg.exchange.clone()),
            exchange_kind(cfg.exchange_type),
            options,
            FieldTable::default(),
        )
        .await
}

/// Declares `queue` with `options` and no arguments.
pub(crate) async fn declare_queue(
    channel: &Channel,
    queue: &str,
    options: QueueDeclareOptions,
) -> lapin::Result<lapin::Queue> {
    channel
        .queue_declare(
            ShortString::from(queue.to_owned()),
            options,
            FieldTable::default(),
        )
        .await
}

/// Declares the development queue (durable) and binds it to `exchange` with `binding`.
async fn declare_dev_queue(
    channel: &Channel,
    queue: &str,
    exchange: &str,
    binding: &str,
) -> Result<(), ConnectError> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    declare_queue(channel, queue, durable)
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

/// What to check when connecting failed on the broker's certificate.
fn tls_hint(e: &lapin::Error) -> &'static str {
    let text = e.to_string();
    if text.contains("certificate") || text.contains("UnknownIssuer") {
        " (TLS: the broker's certificate is not trusted; set publisher.rabbitmq.tls_ca_file to the CA that signed it, and check the host name in the URL)"
    } else {
        ""
    }
}

fn exchange_kind(exchange_type: ExchangeType) -> ExchangeKind {
    match exchange_type {
        ExchangeType::Direct => ExchangeKind::Direct,
        ExchangeType::Topic => ExchangeKind::Topic,
        ExchangeType::Fanout => ExchangeKind::Fanout,
        ExchangeType::Headers => ExchangeKind::Headers,
    }
}

impl crate::publish::slot::Connection for Live {
    fn generation(&self) -> u64 {
        self.generation
    }

    /// Closes it in the background, so a slow but live broker is not left with a stray
    /// connection; its settlers hand back what they hold.
    fn retire(self: Arc<Self>) {
        self.gone.cancel();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                self.connection
                    .close(320, ShortString::from("outbox-relay reconnecting")),
            )
            .await;
        });
    }
}

impl RabbitMqPublisher {
    /// A channel failed under a publish. If the connection is gone, that is connection-level
    /// (hand back, reconnect); if only the channel was closed by the broker, this message
    /// caused it (e.g. larger than the broker accepts), so it is message-level. Only for a
    /// channel that carried nothing but this message.
    ///
    /// A missing exchange is no message's fault (every message goes to the one exchange): the
    /// connection is given up as if lost, so that the next one declares the exchange again
    /// (`declare_exchange`) or, without it, stays down saying the exchange is missing.
    pub(super) fn channel_failure(&self, live: &Live, reason: &str) -> Outcome {
        if reason.contains(NO_EXCHANGE) {
            self.slot.mark_down(live.generation);
            Outcome::Unavailable(format!(
                "exchange {:?} does not exist (the broker closed the channel: {reason}); reconnecting",
                self.cfg.exchange
            ))
        } else if live.connection.status().connected() {
            Outcome::Rejected(format!("the broker closed the channel: {reason}"))
        } else {
            self.slot.mark_down(live.generation);
            Outcome::Unavailable(format!("connection lost: {reason}"))
        }
    }

    /// Opens a channel in confirm mode, bounded by `confirm_timeout`.
    pub(super) async fn open_channel(&self, live: &Live) -> Result<Channel, Outcome> {
        let opening = async {
            let ch = live.connection.create_channel().await?;
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
            Ok::<Channel, lapin::Error>(ch)
        };
        match tokio::time::timeout(self.cfg.confirm_timeout, opening).await {
            Ok(Ok(ch)) => Ok(ch),
            Ok(Err(e)) => Err(self.channel_failure(live, &format!("cannot open a channel: {e}"))),
            Err(_) => {
                self.slot.mark_down(live.generation);
                Err(Outcome::Unavailable(format!(
                    "no answer to opening a channel within {}",
                    humantime::format_duration(self.cfg.confirm_timeout)
                )))
            }
        }
    }
}
