//! The publishing channels: [`CHANNELS`] slots, each holding a confirm-mode channel (reopened
//! after the broker closes it) and the queue to its settler, and the pipelined publish that
//! spreads messages over them and waits for the settler's answer.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::connection::Live;
use super::settler::{Settled, settle_channel};
use super::wire::publish_options;
use super::{CHANNELS, RabbitMqPublisher};
use crate::message::OutboxMessage;
use crate::publish::Outcome;

/// Where a publish on the publishing channels ended.
pub(super) enum OnChannels {
    /// The message's outcome.
    Done(Outcome),
    /// The broker closed the channel with the message unconfirmed on it (the reason).
    Closed(String),
    /// No answer by the deadline.
    TimedOut,
}

/// One of the publishing channels, reopened after the broker closes it.
#[derive(Default)]
pub(super) struct ChannelSlot {
    current: Mutex<Option<Arc<ConfirmChannel>>>,
    // Serialises opening a channel for this slot.
    opening: tokio::sync::Mutex<()>,
}

/// A confirm-mode channel and the queue to its settler.
pub(super) struct ConfirmChannel {
    pub(super) channel: Channel,
    // Held while a publish registers its delivery tag and queues its frames, so the order of
    // `incoming` is the channel's delivery-tag order.
    incoming: Mutex<Incoming>,
    // Wakes the settler when `incoming` grows.
    pub(super) wake: Notify,
}

#[derive(Default)]
struct Incoming {
    entries: Vec<Entry>,
    // Set by the settler once the channel is dead and everything on it answered: publishes
    // go to a new channel instead.
    closed: bool,
}

/// The broker's answer to one message, as a future: publishing it (frames written), then its
/// confirm.
type Confirming = Pin<Box<dyn Future<Output = Result<Confirmation, lapin::Error>> + Send>>;

/// A published message waiting for its settler.
pub(super) struct Entry {
    pub(super) id: String,
    pub(super) answer: Pending,
    pub(super) reply: oneshot::Sender<Settled>,
}

/// A confirm not yet read, or already known when the publish failed at once.
pub(super) enum Pending {
    Waiting(Confirming),
    Known(Box<Result<Confirmation, lapin::Error>>),
}

impl ChannelSlot {
    fn usable(&self) -> Option<Arc<ConfirmChannel>> {
        let current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        current
            .as_ref()
            .filter(|c| c.channel.status().connected())
            .cloned()
    }
}

impl ConfirmChannel {
    /// Closes the channel to new messages if none is waiting for the settler; whether it did.
    pub(super) fn close_if_empty(&self) -> bool {
        let mut incoming = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        if incoming.entries.is_empty() {
            incoming.closed = true;
        }
        incoming.closed
    }

    /// The messages published since the last take, in publish order.
    pub(super) fn take_entries(&self) -> Vec<Entry> {
        std::mem::take(
            &mut self
                .incoming
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entries,
        )
    }

    /// Closes the channel to new messages and takes those not yet taken.
    pub(super) fn close_and_take(&self) -> Vec<Entry> {
        let mut incoming = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        incoming.closed = true;
        std::mem::take(&mut incoming.entries)
    }

    /// Publishes on this channel and queues the answer for the settler; `None` when the
    /// channel is closed (publish elsewhere).
    fn submit(&self, id: String, mut confirming: Confirming) -> Option<oneshot::Receiver<Settled>> {
        let (reply, answer) = oneshot::channel();
        {
            let mut incoming = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
            if incoming.closed || !self.channel.status().connected() {
                return None;
            }
            // The first poll registers the delivery tag and queues the frames (lapin does both
            // before its first await); doing it under the lock makes the order of `incoming`
            // the order of the tags. The settler polls the rest with its own waker.
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            let answer = match confirming.as_mut().poll(&mut cx) {
                Poll::Ready(known) => Pending::Known(Box::new(known)),
                Poll::Pending => Pending::Waiting(confirming),
            };
            incoming.entries.push(Entry { id, answer, reply });
        }
        self.wake.notify_one();
        Some(answer)
    }
}

impl RabbitMqPublisher {
    /// The next publishing channel, opened (with its settler) if it is not open.
    async fn pick_channel(&self, live: &Arc<Live>) -> Result<Arc<ConfirmChannel>, Outcome> {
        let slot =
            &live.channels[live.next_slot.fetch_add(1, Ordering::Relaxed) % live.channels.len()];
        if let Some(channel) = slot.usable() {
            return Ok(channel);
        }
        let _serial = slot.opening.lock().await;
        if let Some(channel) = slot.usable() {
            return Ok(channel);
        }
        let opened = self.open_channel(live).await?;
        let channel = Arc::new(ConfirmChannel {
            channel: opened,
            incoming: Mutex::new(Incoming::default()),
            wake: Notify::new(),
        });
        tokio::spawn(settle_channel(
            Arc::clone(&channel),
            live.gone.clone(),
            Arc::clone(live),
            self.cfg.confirm_timeout,
        ));
        let old = slot
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(Arc::clone(&channel));
        if let Some(old) = old {
            // Its channel is closed: its settler answers what it holds and ends.
            old.wake.notify_one();
        }
        Ok(channel)
    }

    /// Publishes on the publishing channels and waits for the settler's answer, until
    /// `deadline`. `props` go into the first publish; `rebuild` makes them again when a
    /// channel found closed sends the message to another.
    pub(super) async fn publish_on_channels<F>(
        &self,
        live: &Arc<Live>,
        msg: &OutboxMessage,
        routing_key: &ShortString,
        props: BasicProperties,
        rebuild: F,
        deadline: Instant,
    ) -> OnChannels
    where
        F: Fn() -> Result<BasicProperties, Outcome> + Sync,
    {
        let id = msg.id.to_string();
        let mut first = Some(props);
        let waiting = async {
            // A channel found closed was closed after we picked it: pick again (each is
            // reopened once).
            for _ in 0..=CHANNELS {
                let target = self.pick_channel(live).await?;
                let channel = target.channel.clone();
                let props = match first.take() {
                    Some(props) => props,
                    None => rebuild()?,
                };
                let (exchange, key, payload) = (
                    ShortString::from(self.cfg.exchange.clone()),
                    routing_key.clone(),
                    msg.payload.clone(),
                );
                let confirming: Confirming = Box::pin(async move {
                    channel
                        .basic_publish(exchange, key, publish_options(), &payload, props)
                        .await?
                        .await
                });
                if let Some(answer) = target.submit(id.clone(), confirming) {
                    return answer
                        .await
                        .map_err(|_| Outcome::Unavailable("the publisher was closed".to_owned()));
                }
            }
            Err(Outcome::Unavailable(
                "the broker keeps closing channels".to_owned(),
            ))
        };
        match tokio::time::timeout_at(deadline, waiting).await {
            Ok(Ok(settled)) => self.settled(live, settled),
            Ok(Err(outcome)) => OnChannels::Done(outcome),
            Err(_) => OnChannels::TimedOut,
        }
    }

    /// A settler's answer: the outcome, or the closure of the channel the message was on.
    fn settled(&self, live: &Live, settled: Settled) -> OnChannels {
        match settled {
            Settled::Outcome(outcome) => OnChannels::Done(outcome),
            Settled::ConnectionLost(reason) => {
                self.slot.mark_down(live.generation);
                OnChannels::Done(Outcome::Unavailable(format!("connection lost: {reason}")))
            }
            Settled::ChannelClosed(reason) => OnChannels::Closed(reason),
        }
    }
}
