//! RabbitMQ transport (lapin): one connection, a few confirm-mode channels each carrying many
//! unconfirmed messages, `mandatory` so that an unroutable message comes back as a failure.
//!
//! Returns are charged by `message_id`, never by the confirm lapin hands them on. RabbitMQ
//! sends a message's `basic.return` before its `basic.ack` on the same channel, in publish
//! order; lapin queues returns in arrival order and pins each to whichever confirm of the
//! channel completes next (a `multiple` ack walks its tags in hash-map order), so a return can
//! ride on an earlier, a later or an unrelated confirm. Each channel's confirms therefore go to
//! one settler task that answers its messages strictly in publish order: a message is answered
//! only once it and every message before it on the channel are confirmed, and after every
//! confirm that had completed by then has been read. At that point every return of those
//! messages has been read too — lapin pops one queued return per completed confirm, so once
//! all of them are complete none of their returns can still be queued — and a message is
//! `Rejected` exactly when a return carrying its `message_id` was seen. The proof runs in CI:
//! `returned_messages_share_multiple_acks_and_are_charged_by_message_id` in
//! `tests/delivery.rs`.
//!
//! When the broker closes a channel (e.g. a message above its `max_message_size`, a header it
//! refuses), which of the messages unconfirmed on it caused that is unknown. Each is published
//! again on the publishing channels, pipelined like any other message: the innocent go
//! through, the culprit closes a second channel. A message on two closed channels is then
//! published alone, on one of a few channels that carry one message at a time, where the
//! answer can only be its own; a message that closes such a channel is the culprit
//! (message-level failure), and its id is remembered so that its next attempt goes alone at
//! once instead of closing a channel full of others. All that republishing is bounded by one
//! `confirm_timeout` from the first closure: past it the message is handed back. The
//! caller still waits for each message's final answer before publishing the next of its
//! aggregate, so republishing never reorders an aggregate.
//!
//! A settler ends with its channel: it is woken when its slot gets a new channel and looks at
//! its channel every [`IDLE_CHECK`] while idle, and once the channel is closed it answers
//! whatever it holds within `confirm_timeout` (lapin fails every confirm of a closed channel at
//! once; the limit covers a confirm that would never come).
//!
//! Files: `connection` (connecting, TLS, the exchange and queue declared, channels opened, a
//! connection given up), `channels` (the publishing channels and the pipelined publish on
//! them), `settler` (each publishing channel's settler task), `isolation` (messages published
//! alone: the solo channels and the culprits), `classify` (confirms and returns to outcomes),
//! `wire` (the AMQP properties and publish options of a message).

mod channels;
mod classify;
mod connection;
mod isolation;
mod settler;
mod wire;

pub use classify::classify_confirmation;
pub(crate) use connection::declare_queue;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lapin::types::ShortString;
use tokio::time::Instant;

use self::channels::OnChannels;
use self::connection::Live;
use self::isolation::Culprits;
use super::envelope::{self, EnvelopeConfig};
use super::slot::Slot;
use super::{ConnectError, Outcome, Publisher};
use crate::config::RabbitMqConfig;
use crate::message::OutboxMessage;
use crate::redact::redact_url;

/// Channels messages are spread over. The broker runs one process per channel, so a few
/// channels use more than one of its cores; lapin looks at every channel for each frame it
/// reads, so many channels cost the relay CPU.
pub const CHANNELS: usize = 4;

/// How often an idle settler looks whether its channel was closed.
pub const IDLE_CHECK: Duration = Duration::from_secs(1);

/// Publishes to a RabbitMQ exchange with publisher confirms.
pub struct RabbitMqPublisher {
    cfg: RabbitMqConfig,
    slot: Slot<Live>,
    culprits: Mutex<Culprits>,
}

impl RabbitMqPublisher {
    /// A publisher that connects on the first [`Publisher::connect`].
    pub fn new(cfg: RabbitMqConfig) -> Self {
        Self {
            cfg,
            slot: Slot::new(),
            culprits: Mutex::new(Culprits::default()),
        }
    }

    fn culprits(&self) -> std::sync::MutexGuard<'_, Culprits> {
        self.culprits.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// No answer within `confirm_timeout`.
    fn no_confirm(&self) -> Outcome {
        Outcome::Unavailable(format!(
            "no confirm within {}",
            humantime::format_duration(self.cfg.confirm_timeout)
        ))
    }

    /// A message that was unconfirmed on a channel the broker closed (`reason`), published
    /// again: on the channels, then alone if the broker closes a second channel with it on.
    /// Republishing is bounded by one `confirm_timeout` from here; past it, handed back (the
    /// connection may well be fine: it is left to the other messages to tell).
    async fn publish_again(
        &self,
        live: &Arc<Live>,
        msg: &OutboxMessage,
        env: &EnvelopeConfig,
        routing_key: ShortString,
        reason: &str,
    ) -> Outcome {
        let deadline = Instant::now() + self.cfg.confirm_timeout;
        tracing::debug!(id = %msg.id, reason = %reason, "publishing again a message that was unconfirmed on a channel the broker closed");
        let rebuild = || {
            self.properties(msg, env, routing_key.as_str())
                .map_err(Outcome::Rejected)
        };
        let props = match rebuild() {
            Ok(props) => props,
            Err(outcome) => return outcome,
        };
        let reason = match self
            .publish_on_channels(live, msg, &routing_key, props, rebuild, deadline)
            .await
        {
            OnChannels::Done(outcome) => return outcome,
            OnChannels::TimedOut => return self.not_republished(),
            OnChannels::Closed(reason) => reason,
        };
        tracing::warn!(id = %msg.id, reason = %reason, "the broker closed two channels with this message unconfirmed on them; publishing it alone");
        match rebuild() {
            Ok(props) => {
                self.publish_alone(live, msg, routing_key, props, deadline)
                    .await
            }
            Err(outcome) => outcome,
        }
    }

    /// A message that was on a closed channel not answered in time: handed back.
    fn not_republished(&self) -> Outcome {
        Outcome::Unavailable(format!(
            "not confirmed within {} of the broker closing a channel it was on",
            humantime::format_duration(self.cfg.confirm_timeout)
        ))
    }
}

#[async_trait]
impl Publisher for RabbitMqPublisher {
    fn kind(&self) -> &'static str {
        "rabbitmq"
    }

    /// The exchange (`amq.default` for the nameless default exchange, as the messaging
    /// conventions name it); the routing key is not a destination there.
    fn destination_name(&self, _msg: &OutboxMessage, _env: &EnvelopeConfig) -> String {
        if self.cfg.exchange.is_empty() {
            "amq.default".to_owned()
        } else {
            self.cfg.exchange.clone()
        }
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
        let open = |generation| async move {
            let (connection, channel) = connection::open(&self.cfg).await?;
            connection::declare(&connection, &channel, &self.cfg).await?;
            Ok::<_, ConnectError>(Live::new(generation, connection, channel))
        };
        self.slot
            .connecting()
            .await
            .get_or_connect(|live| live.connection.status().connected(), open)
            .await
            .map(drop)
    }

    fn is_connected(&self) -> bool {
        self.slot
            .get()
            .is_some_and(|l| l.connection.status().connected())
    }

    async fn publish(&self, msg: &OutboxMessage, env: &EnvelopeConfig) -> Outcome {
        let Some(live) = self.slot.get() else {
            return Outcome::Unavailable("not connected to RabbitMQ".to_owned());
        };
        let routing_key = envelope::destination(msg, &env.route);
        let Ok(routing_key) = ShortString::try_new(routing_key) else {
            return Outcome::Rejected("routing key is longer than 255 bytes".to_owned());
        };
        let frame_max = live.connection.configuration().frame_max();
        let props = match self
            .properties(msg, env, routing_key.as_str())
            .and_then(|p| wire::fits_one_frame(&p, frame_max).map(|()| p))
        {
            Ok(p) => p,
            Err(reason) => return Outcome::Rejected(reason),
        };
        let deadline = Instant::now() + self.cfg.confirm_timeout;
        if self.culprits().contains(&msg.id.to_string()) {
            // It closed a channel alone before: alone again, not among other messages.
            return self
                .publish_alone(&live, msg, routing_key, props, deadline)
                .await;
        }
        let rebuild = || {
            self.properties(msg, env, routing_key.as_str())
                .map_err(Outcome::Rejected)
        };
        match self
            .publish_on_channels(&live, msg, &routing_key, props, rebuild, deadline)
            .await
        {
            OnChannels::Done(outcome) => outcome,
            OnChannels::TimedOut => {
                // No answer at all: the connection is dead rather than the message bad.
                self.slot.mark_down(live.generation);
                self.no_confirm()
            }
            OnChannels::Closed(reason) => {
                self.publish_again(&live, msg, env, routing_key, &reason)
                    .await
            }
        }
    }

    async fn close(&self) {
        if let Some(live) = self.slot.take() {
            live.gone.cancel();
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
