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
//! `confirm_timeout` from the first closure: past it the message is handed back unspent. The
//! caller still waits for each message's final answer before publishing the next of its
//! aggregate, so republishing never reorders an aggregate.
//!
//! A settler ends with its channel: it is woken when its slot gets a new channel and looks at
//! its channel every [`IDLE_CHECK`] while idle, and once the channel is closed it answers
//! whatever it holds within `confirm_timeout` (lapin fails every confirm of a closed channel at
//! once; the limit covers a confirm that would never come).

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use tokio::sync::{Notify, Semaphore, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::envelope::{self, EnvelopeConfig};
use super::{ConnectError, Outcome, Publisher};
use crate::config::{ExchangeType, RabbitMqConfig};
use crate::message::OutboxMessage;
use crate::redact::redact_url;

/// Channels messages are spread over. The broker runs one process per channel, so a few
/// channels use more than one of its cores; lapin looks at every channel for each frame it
/// reads, so many channels cost the relay CPU.
pub const CHANNELS: usize = 4;

/// Channels that carry one message at a time (messages on two closed channels), at most.
const SOLO_CHANNELS: usize = 4;

/// Ids of messages that closed a channel alone that are remembered (the oldest are forgotten).
const CULPRITS_KEPT: usize = 1024;

/// How often an idle settler looks whether its channel was closed.
pub const IDLE_CHECK: Duration = Duration::from_secs(1);

/// A live connection and its channels.
struct Live {
    // Distinguishes this connection from its successors, so that a failure seen on an old
    // channel never tears down a newer connection.
    generation: u64,
    connection: Connection,
    lanes: Vec<LaneSlot>,
    // Round-robin over `lanes`.
    next_lane: AtomicUsize,
    // Channels for messages published alone (see the module docs).
    solo: Solo,
    // Cancelled when this connection is given up: its settlers hand back what they hold.
    gone: CancellationToken,
}

/// Channels that carry one message at a time: a permit per message in flight on them, and the
/// channels idle between such messages.
struct Solo {
    permits: Semaphore,
    idle: Mutex<Vec<Channel>>,
}

impl Solo {
    fn new(first: Channel) -> Self {
        Self {
            permits: Semaphore::new(SOLO_CHANNELS),
            idle: Mutex::new(vec![first]),
        }
    }

    /// An idle channel that is still open, if any (closed ones are dropped).
    fn take_open(&self) -> Option<Channel> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(channel) = idle.pop() {
            if channel.status().connected() {
                return Some(channel);
            }
        }
        None
    }

    fn put_back(&self, channel: Channel) {
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(channel);
    }
}

/// Ids of messages that closed a channel they were alone on, oldest first, at most
/// [`CULPRITS_KEPT`]: their next attempts are published alone at once.
#[derive(Default)]
struct Culprits {
    order: VecDeque<String>,
    ids: HashSet<String>,
}

impl Culprits {
    fn add(&mut self, id: &str) {
        if self.ids.insert(id.to_owned()) {
            self.order.push_back(id.to_owned());
        }
        while self.order.len() > CULPRITS_KEPT {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
    }

    fn remove(&mut self, id: &str) {
        if self.ids.remove(id) {
            self.order.retain(|i| i != id);
        }
    }
}

/// Where a publish on the publishing channels ended.
enum OnLanes {
    /// The message's outcome.
    Done(Outcome),
    /// The broker closed the channel with the message unconfirmed on it (the reason).
    Closed(String),
    /// No answer by the deadline.
    TimedOut,
}

/// One of the publishing channels, reopened after the broker closes it.
#[derive(Default)]
struct LaneSlot {
    current: Mutex<Option<Arc<Lane>>>,
    // Serialises opening a channel for this slot.
    opening: tokio::sync::Mutex<()>,
}

/// A confirm-mode channel and the queue to its settler.
struct Lane {
    channel: Channel,
    // Held while a publish registers its delivery tag and queues its frames, so the order of
    // `incoming` is the channel's delivery-tag order.
    incoming: Mutex<Incoming>,
    // Wakes the settler when `incoming` grows.
    wake: Notify,
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
struct Entry {
    id: String,
    answer: Pending,
    reply: oneshot::Sender<Settled>,
}

/// A confirm not yet read, or already known when the publish failed at once.
enum Pending {
    Waiting(Confirming),
    Known(Box<Result<Confirmation, lapin::Error>>),
}

/// A confirm as the settler keeps it, its returned message (if any) taken out.
enum Answer {
    Ack,
    Nack,
    NotRequested,
    Failed(lapin::Error),
}

/// What a settler tells the publish waiting for one message.
#[derive(Debug)]
enum Settled {
    Outcome(Outcome),
    /// The connection is gone: hand back, reconnect.
    ConnectionLost(String),
    /// The broker closed the channel with this message unconfirmed on it: which of the
    /// channel's messages caused that is unknown.
    ChannelClosed(String),
}

/// Publishes to a RabbitMQ exchange with publisher confirms.
pub struct RabbitMqPublisher {
    cfg: RabbitMqConfig,
    state: RwLock<Option<Arc<Live>>>,
    generations: AtomicU64,
    // Serialises reconnects so concurrent failures open one connection, not many.
    connecting: tokio::sync::Mutex<()>,
    culprits: Mutex<Culprits>,
}

impl RabbitMqPublisher {
    /// A publisher that connects on the first [`Publisher::connect`].
    pub fn new(cfg: RabbitMqConfig) -> Self {
        Self {
            cfg,
            state: RwLock::new(None),
            generations: AtomicU64::new(0),
            connecting: tokio::sync::Mutex::new(()),
            culprits: Mutex::new(Culprits::default()),
        }
    }

    fn culprits(&self) -> std::sync::MutexGuard<'_, Culprits> {
        self.culprits.lock().unwrap_or_else(|p| p.into_inner())
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
            live.gone.cancel();
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

    /// A channel failed under a publish. If the connection is gone, that is connection-level
    /// (hand back, reconnect); if only the channel was closed by the broker, this message
    /// caused it (e.g. larger than the broker accepts), so it is message-level. Only for a
    /// channel that carried nothing but this message.
    fn channel_failure(&self, live: &Live, reason: &str) -> Outcome {
        if live.connection.status().connected() {
            Outcome::Rejected(format!("the broker closed the channel: {reason}"))
        } else {
            self.mark_down(live.generation);
            Outcome::Unavailable(format!("connection lost: {reason}"))
        }
    }

    /// Opens a channel in confirm mode, bounded by `confirm_timeout`.
    async fn open_channel(&self, live: &Live) -> Result<Channel, Outcome> {
        let opening = async {
            let ch = live.connection.create_channel().await?;
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
            Ok::<Channel, lapin::Error>(ch)
        };
        match tokio::time::timeout(self.cfg.confirm_timeout, opening).await {
            Ok(Ok(ch)) => Ok(ch),
            Ok(Err(e)) => Err(self.channel_failure(live, &format!("cannot open a channel: {e}"))),
            Err(_) => {
                self.mark_down(live.generation);
                Err(Outcome::Unavailable(format!(
                    "no answer to opening a channel within {}",
                    humantime::format_duration(self.cfg.confirm_timeout)
                )))
            }
        }
    }

    /// The next publishing channel, opened (with its settler) if it is not open.
    async fn lane(&self, live: &Arc<Live>) -> Result<Arc<Lane>, Outcome> {
        let slot = &live.lanes[live.next_lane.fetch_add(1, Ordering::Relaxed) % live.lanes.len()];
        if let Some(lane) = slot.usable() {
            return Ok(lane);
        }
        let _serial = slot.opening.lock().await;
        if let Some(lane) = slot.usable() {
            return Ok(lane);
        }
        let channel = self.open_channel(live).await?;
        let lane = Arc::new(Lane {
            channel,
            incoming: Mutex::new(Incoming::default()),
            wake: Notify::new(),
        });
        tokio::spawn(settle_lane(
            Arc::clone(&lane),
            live.gone.clone(),
            Arc::clone(live),
            self.cfg.confirm_timeout,
        ));
        let old = slot
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(Arc::clone(&lane));
        if let Some(old) = old {
            // Its channel is closed: its settler answers what it holds and ends.
            old.wake.notify_one();
        }
        Ok(lane)
    }

    /// Publishes one message alone on a solo channel and waits for its own answer: with nothing
    /// else unconfirmed on that channel, a return or a channel closure can only be its own.
    /// Waiting for a solo channel and for the answer both end at `deadline`: the message is
    /// then handed back unspent.
    async fn publish_alone(
        &self,
        live: &Live,
        msg: &OutboxMessage,
        routing_key: ShortString,
        props: BasicProperties,
        deadline: Instant,
    ) -> Outcome {
        let late = || self.not_republished();
        let _permit = match tokio::time::timeout_at(deadline, live.solo.permits.acquire()).await {
            Ok(Ok(permit)) => permit,
            Ok(Err(_)) => return Outcome::Unavailable("the publisher was closed".to_owned()),
            Err(_) => return late(),
        };
        let channel = match live.solo.take_open() {
            Some(ch) => ch,
            None => match tokio::time::timeout_at(deadline, self.open_channel(live)).await {
                Ok(Ok(ch)) => ch,
                Ok(Err(outcome)) => return outcome,
                Err(_) => return late(),
            },
        };
        let publishing = async {
            channel
                .basic_publish(
                    ShortString::from(self.cfg.exchange.clone()),
                    routing_key,
                    publish_options(),
                    &msg.payload,
                    props,
                )
                .await?
                .await
        };
        let id = msg.id.to_string();
        match tokio::time::timeout_at(deadline, publishing).await {
            Ok(Ok(confirmation)) => {
                live.solo.put_back(channel);
                self.culprits().remove(&id);
                classify_confirmation(confirmation, &id)
            }
            Ok(Err(e)) => {
                let outcome = self.channel_failure(live, &e.to_string());
                if matches!(outcome, Outcome::Rejected(_)) {
                    self.culprits().add(&id);
                }
                outcome
            }
            Err(_) => {
                // An answer may still come: the channel cannot carry another message alone.
                tokio::spawn(async move {
                    let closing = channel.close(200, ShortString::from("no confirm in time"));
                    let _ = tokio::time::timeout(Duration::from_secs(5), closing).await;
                });
                late()
            }
        }
    }

    /// Publishes on the publishing channels and waits for the settler's answer, until
    /// `deadline`. `props` go into the first publish; `rebuild` makes them again when a
    /// channel found closed sends the message to another.
    async fn on_lanes<F>(
        &self,
        live: &Arc<Live>,
        msg: &OutboxMessage,
        routing_key: &ShortString,
        props: BasicProperties,
        rebuild: F,
        deadline: Instant,
    ) -> OnLanes
    where
        F: Fn() -> Result<BasicProperties, Outcome> + Sync,
    {
        let id = msg.id.to_string();
        let mut first = Some(props);
        let waiting = async {
            // A lane found closed was closed after we picked it: pick again (each is reopened
            // once).
            for _ in 0..=CHANNELS {
                let lane = self.lane(live).await?;
                let channel = lane.channel.clone();
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
                if let Some(answer) = lane.submit(id.clone(), confirming) {
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
            Ok(Err(outcome)) => OnLanes::Done(outcome),
            Err(_) => OnLanes::TimedOut,
        }
    }

    /// No answer within `confirm_timeout`.
    fn no_confirm(&self) -> Outcome {
        Outcome::Unavailable(format!(
            "no confirm within {}",
            humantime::format_duration(self.cfg.confirm_timeout)
        ))
    }

    /// A message that was on a closed channel not answered in time: handed back unspent.
    fn not_republished(&self) -> Outcome {
        Outcome::Unavailable(format!(
            "not confirmed within {} of the broker closing a channel it was on",
            humantime::format_duration(self.cfg.confirm_timeout)
        ))
    }

    /// A settler's answer: the outcome, or the closure of the channel the message was on.
    fn settled(&self, live: &Live, settled: Settled) -> OnLanes {
        match settled {
            Settled::Outcome(outcome) => OnLanes::Done(outcome),
            Settled::ConnectionLost(reason) => {
                self.mark_down(live.generation);
                OnLanes::Done(Outcome::Unavailable(format!("connection lost: {reason}")))
            }
            Settled::ChannelClosed(reason) => OnLanes::Closed(reason),
        }
    }

    /// Builds the AMQP properties, or says why this message cannot be expressed in AMQP.
    fn properties(
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

fn publish_options() -> BasicPublishOptions {
    BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    }
}

impl LaneSlot {
    fn usable(&self) -> Option<Arc<Lane>> {
        let current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        current
            .as_ref()
            .filter(|l| l.channel.status().connected())
            .cloned()
    }
}

impl Lane {
    /// Closes the lane to new messages if none is waiting for the settler; whether it did.
    fn close_if_empty(&self) -> bool {
        let mut incoming = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        if incoming.entries.is_empty() {
            incoming.closed = true;
        }
        incoming.closed
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

/// A message published on a lane, in publish order, until it is answered.
struct Slot {
    id: String,
    reply: Option<oneshot::Sender<Settled>>,
    // The confirm once read.
    answer: Option<Answer>,
    // `takes` when the answer was read: it may be acted on once `incoming` was taken (and the
    // confirms read) after that.
    read_at: u64,
}

/// A confirm being read, with the sequence number of its message on the lane.
type Reading = Pin<Box<dyn Future<Output = (u64, Result<Confirmation, lapin::Error>)> + Send>>;

/// What a lane's settler holds.
#[derive(Default)]
struct Settler {
    slots: VecDeque<Slot>,
    // Index into `slots` by sequence: `slots[i]` has sequence `first + i`.
    first: u64,
    confirming: FuturesUnordered<Reading>,
    // message_id → why it came back, for returns read but not yet charged.
    returned: HashMap<String, String>,
    takes: u64,
    // Messages answered `ChannelClosed`, and the broker's reason, for one line at the end.
    closed: Option<(usize, String)>,
}

/// The settler of one lane (see the module docs): reads its confirms as they complete, and
/// answers its messages in publish order once no return for them can still be unread. It ends
/// once its channel is closed and everything it held is answered, or `confirm_timeout` after
/// it saw the channel closed, answering what is left then.
async fn settle_lane(
    lane: Arc<Lane>,
    gone: CancellationToken,
    live: Arc<Live>,
    confirm_timeout: Duration,
) {
    let mut st = Settler::default();
    let mut tick = tokio::time::interval(IDLE_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut closed_since: Option<Instant> = None;
    let mut again = false;
    loop {
        if !again {
            tokio::select! {
                () = lane.wake.notified() => {}
                Some((seq, answer)) = st.confirming.next(), if !st.confirming.is_empty() => {
                    st.record(seq, answer);
                }
                () = gone.cancelled() => {
                    let gone = || Settled::Outcome(Outcome::Unavailable("the connection was closed".to_owned()));
                    answer_all(&lane, st.slots, gone);
                    return;
                }
                _ = tick.tick() => {}
            }
        }
        // Every confirm completed by now, then every message published by now, then every
        // confirm completed by then: what was read before the take may be acted on.
        st.drain();
        st.take(&lane);
        st.drain();
        st.answer_ready(&live);
        // An answer read after the take is acted on after the next one: go round again.
        again = st.slots.front().is_some_and(|s| s.answer.is_some());

        if !lane.channel.status().connected() {
            let since = *closed_since.get_or_insert_with(Instant::now);
            if st.slots.is_empty() && lane.close_if_empty() {
                st.report_closure(&lane);
                return;
            }
            if since.elapsed() >= confirm_timeout {
                let connected = live.connection.status().connected();
                let reason = "no answer from the broker after it closed the channel";
                let left = || {
                    if connected {
                        Settled::ChannelClosed(reason.to_owned())
                    } else {
                        Settled::ConnectionLost(reason.to_owned())
                    }
                };
                st.report_closure(&lane);
                answer_all(&lane, st.slots, left);
                return;
            }
        }
    }
}

impl Settler {
    /// Reads the confirms that have completed, without waiting.
    fn drain(&mut self) {
        while let Some(Some((seq, answer))) = self.confirming.next().now_or_never() {
            self.record(seq, answer);
        }
    }

    /// Stores the confirm of message `seq`, and its returned message (whoever's it is) in
    /// `returned`.
    fn record(&mut self, seq: u64, answer: Result<Confirmation, lapin::Error>) {
        let answer = strip_return(answer, &mut self.returned);
        let slot = seq
            .checked_sub(self.first)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.slots.get_mut(i));
        if let Some(slot) = slot {
            slot.answer = Some(answer);
            slot.read_at = self.takes;
        }
    }

    /// Takes the messages published on the lane since the last take, in publish order.
    fn take(&mut self, lane: &Lane) {
        let taken = std::mem::take(
            &mut lane
                .incoming
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entries,
        );
        self.takes += 1;
        for entry in taken {
            let seq = self.first + self.slots.len() as u64;
            let mut slot = Slot {
                id: entry.id,
                reply: Some(entry.reply),
                answer: None,
                read_at: self.takes,
            };
            match entry.answer {
                Pending::Known(answer) => {
                    slot.answer = Some(strip_return(*answer, &mut self.returned));
                }
                Pending::Waiting(fut) => self
                    .confirming
                    .push(Box::pin(async move { (seq, fut.await) })),
            }
            self.slots.push_back(slot);
        }
    }

    /// Logs how many messages the closure of the lane's channel sent to be published again.
    fn report_closure(&self, lane: &Lane) {
        if let Some((unconfirmed, reason)) = &self.closed {
            tracing::warn!(channel = lane.channel.id(), unconfirmed, reason = %reason, "the broker closed a publishing channel; its unconfirmed messages were published again");
        }
    }

    /// Answers the messages at the front whose confirm was read before the last take.
    fn answer_ready(&mut self, live: &Live) {
        while let Some(slot) = self.slots.front() {
            if slot.answer.is_none() || slot.read_at >= self.takes {
                break;
            }
            let Some(mut slot) = self.slots.pop_front() else {
                break;
            };
            self.first += 1;
            let settled = settle(
                self.returned.remove(&slot.id),
                slot.answer.take(),
                live.connection.status().connected(),
            );
            if let Settled::ChannelClosed(reason) = &settled {
                self.closed.get_or_insert_with(|| (0, reason.clone())).0 += 1;
            }
            if let Some(reply) = slot.reply.take() {
                // The publish may have stopped waiting (timeout): nothing to tell it then.
                let _ = reply.send(settled);
            }
        }
        if self.slots.is_empty() && !self.returned.is_empty() {
            // Every message taken so far is answered, so these returns belong to none of
            // them: the ordering this settler relies on did not hold.
            tracing::error!(
                returned = ?self.returned.keys().collect::<Vec<_>>(),
                "returned messages arrived for messages already answered; please report this"
            );
            self.returned.clear();
        }
    }
}

/// The answer to a message: its return (if one carried its id), else its confirm.
fn settle(returned: Option<String>, answer: Option<Answer>, connected: bool) -> Settled {
    match (returned, answer) {
        (Some(why), _) => Settled::Outcome(Outcome::Rejected(why)),
        (None, Some(Answer::Ack)) => Settled::Outcome(Outcome::Confirmed),
        (None, Some(Answer::Nack)) => {
            Settled::Outcome(Outcome::Rejected("nacked by the broker".to_owned()))
        }
        (None, Some(Answer::NotRequested)) => Settled::Outcome(Outcome::Unavailable(
            "channel is not in confirm mode".to_owned(),
        )),
        (None, Some(Answer::Failed(e))) if connected => Settled::ChannelClosed(e.to_string()),
        (None, Some(Answer::Failed(e))) => Settled::ConnectionLost(e.to_string()),
        (None, None) => Settled::ConnectionLost("no answer".to_owned()),
    }
}

/// Moves the returned message a confirm carries into `returned`, keyed by its `message_id`.
fn strip_return(
    answer: Result<Confirmation, lapin::Error>,
    returned: &mut HashMap<String, String>,
) -> Answer {
    let (message, ack) = match answer {
        Ok(Confirmation::Ack(Some(m))) => (m, true),
        Ok(Confirmation::Nack(Some(m))) => (m, false),
        Ok(Confirmation::Ack(None)) => return Answer::Ack,
        Ok(Confirmation::Nack(None)) => return Answer::Nack,
        Ok(Confirmation::NotRequested) => return Answer::NotRequested,
        Err(e) => return Answer::Failed(e),
    };
    match message.delivery.properties.message_id() {
        Some(id) => {
            returned.insert(id.to_string(), returned_reason(&message));
        }
        None => tracing::error!(
            reply_code = message.reply_code,
            reply_text = %message.reply_text,
            "the broker returned a message without message_id; it cannot be charged to a row"
        ),
    }
    if ack { Answer::Ack } else { Answer::Nack }
}

fn returned_reason(m: &lapin::message::BasicReturnMessage) -> String {
    format!(
        "returned by the broker: {} {} (no queue bound for exchange {:?}, routing key {:?})",
        m.reply_code,
        m.reply_text,
        m.delivery.exchange.as_str(),
        m.delivery.routing_key.as_str()
    )
}

/// Answers every message a lane holds with `answer()`, and closes the lane to new ones.
fn answer_all(lane: &Lane, slots: VecDeque<Slot>, answer: impl Fn() -> Settled) {
    let entries = {
        let mut incoming = lane.incoming.lock().unwrap_or_else(|p| p.into_inner());
        incoming.closed = true;
        std::mem::take(&mut incoming.entries)
    };
    let replies = slots
        .into_iter()
        .filter_map(|s| s.reply)
        .chain(entries.into_iter().map(|e| e.reply));
    for reply in replies {
        let _ = reply.send(answer());
    }
}

/// Maps the confirm of message `id`, published on a channel with nothing else unconfirmed, to
/// an outcome. An ack that carries a
/// returned message means the message was unroutable (`mandatory`): a failure, not a success.
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
            Outcome::Rejected(returned_reason(&returned))
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
        let _serial = self.connecting.lock().await;
        if self.is_connected() {
            return Ok(());
        }
        if let Some(old) = self.live() {
            self.mark_down(old.generation);
        }
        let fail = |what: &str, e: lapin::Error| {
            ConnectError(format!(
                "{what} {}: {e}{}",
                redact_url(&self.cfg.url),
                tls_hint(&e)
            ))
        };
        let props = ConnectionProperties::default()
            .with_connection_name(LongString::from(crate::message::APPLICATION_NAME));
        let tls = OwnedTLSConfig {
            identity: None,
            cert_chain: self.cfg.tls_ca_pem.clone(),
        };
        let runtime =
            lapin::runtime::default_runtime().map_err(|e| fail("no runtime to connect to", e))?;
        let connection = tokio::time::timeout(
            Duration::from_secs(10),
            Connection::connect_with_config(&self.cfg.url, props, tls, runtime),
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
                    exchange_kind(self.cfg.exchange_type),
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
                        self.cfg.exchange, self.cfg.exchange_type.as_str()
                    ))
                })?;
        }
        if let Some(queue) = &self.cfg.declare_queue {
            declare_dev_queue(&channel, queue, &self.cfg.exchange, &self.cfg.queue_binding).await?;
        }
        let live = Live {
            generation: self.generations.fetch_add(1, Ordering::Relaxed) + 1,
            connection,
            lanes: (0..CHANNELS).map(|_| LaneSlot::default()).collect(),
            next_lane: AtomicUsize::new(0),
            solo: Solo::new(channel),
            gone: CancellationToken::new(),
        };
        let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
        *guard = Some(Arc::new(live));
        Ok(())
    }

    fn is_connected(&self) -> bool {
        self.live()
            .is_some_and(|l| l.connection.status().connected())
    }

    async fn publish(&self, msg: &OutboxMessage, env: &EnvelopeConfig) -> Outcome {
        let Some(live) = self.live() else {
            return Outcome::Unavailable("not connected to RabbitMQ".to_owned());
        };
        let routing_key = envelope::destination(msg, &env.route);
        let Ok(routing_key) = ShortString::try_new(routing_key) else {
            return Outcome::Rejected("routing key is longer than 255 bytes".to_owned());
        };
        let props = match self.properties(msg, env, routing_key.as_str()) {
            Ok(p) => p,
            Err(reason) => return Outcome::Rejected(reason),
        };
        let id = msg.id.to_string();
        let rebuild = || {
            self.properties(msg, env, routing_key.as_str())
                .map_err(Outcome::Rejected)
        };
        let culprit = self.culprits().ids.contains(&id);
        if culprit {
            // It closed a channel alone before: alone again, not among other messages.
            let deadline = Instant::now() + self.cfg.confirm_timeout;
            return self
                .publish_alone(&live, msg, routing_key, props, deadline)
                .await;
        }
        let deadline = Instant::now() + self.cfg.confirm_timeout;
        let reason = match self
            .on_lanes(&live, msg, &routing_key, props, rebuild, deadline)
            .await
        {
            OnLanes::Done(outcome) => return outcome,
            OnLanes::TimedOut => {
                // No answer at all: the connection is dead rather than the message bad.
                self.mark_down(live.generation);
                return self.no_confirm();
            }
            OnLanes::Closed(reason) => reason,
        };
        // Republishing is bounded by one confirm_timeout from here; past it, handed back (the
        // connection may well be fine: it is left to the other messages to tell).
        let deadline = Instant::now() + self.cfg.confirm_timeout;
        tracing::debug!(id = %msg.id, reason = %reason, "publishing again a message that was unconfirmed on a channel the broker closed");
        let props = match rebuild() {
            Ok(props) => props,
            Err(outcome) => return outcome,
        };
        let reason = match self
            .on_lanes(&live, msg, &routing_key, props, rebuild, deadline)
            .await
        {
            OnLanes::Done(outcome) => return outcome,
            OnLanes::TimedOut => return self.not_republished(),
            OnLanes::Closed(reason) => reason,
        };
        tracing::warn!(id = %msg.id, reason = %reason, "the broker closed two channels with this message unconfirmed on them; publishing it alone");
        match rebuild() {
            Ok(props) => {
                self.publish_alone(&live, msg, routing_key, props, deadline)
                    .await
            }
            Err(outcome) => outcome,
        }
    }

    async fn close(&self) {
        let live = {
            let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
            guard.take()
        };
        if let Some(live) = live {
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
