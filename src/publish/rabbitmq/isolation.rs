//! Messages published alone (see the module docs of `rabbitmq`): the few solo channels that
//! carry one message at a time, where a return or a channel closure can only be the message's
//! own, and the culprits, messages that closed such a channel, whose next attempts go alone at
//! once.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use lapin::types::ShortString;
use lapin::{BasicProperties, Channel};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::RabbitMqPublisher;
use super::classify::classify_confirmation;
use super::connection::Live;
use super::wire::publish_options;
use crate::message::OutboxMessage;
use crate::publish::Outcome;

/// Channels that carry one message at a time (messages on two closed channels), at most.
const SOLO_CHANNELS: usize = 4;

/// Ids of messages that closed a channel alone that are remembered (the oldest are forgotten).
const CULPRITS_KEPT: usize = 1024;

/// Channels that carry one message at a time: a permit per message in flight on them, and the
/// channels idle between such messages.
pub(super) struct Solo {
    permits: Semaphore,
    idle: Mutex<Vec<Channel>>,
}

impl Solo {
    pub(super) fn new(first: Channel) -> Self {
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
pub(super) struct Culprits {
    order: VecDeque<String>,
    ids: HashSet<String>,
}

impl Culprits {
    /// Whether message `id` closed a channel it was alone on (and is still remembered).
    pub(super) fn contains(&self, id: &str) -> bool {
        self.ids.contains(id)
    }

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

impl RabbitMqPublisher {
    /// Publishes one message alone on a solo channel and waits for its own answer: with nothing
    /// else unconfirmed on that channel, a return or a channel closure can only be its own.
    /// Waiting for a solo channel and for the answer both end at `deadline`: the message is
    /// then handed back.
    pub(super) async fn publish_alone(
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
}
