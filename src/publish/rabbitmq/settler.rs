//! The settler of each publishing channel (see the module docs of `rabbitmq`): one task per
//! channel that reads its confirms as they complete and answers its messages in publish order
//! once no return for them can still be unread, and that ends with its channel.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use lapin::Confirmation;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::IDLE_CHECK;
use super::channels::{ConfirmChannel, Pending};
use super::classify::{Answer, settle, strip_return};
use super::connection::Live;
use crate::publish::Outcome;

/// What a settler tells the publish waiting for one message.
#[derive(Debug)]
pub(super) enum Settled {
    Outcome(Outcome),
    /// The connection is gone: hand back, reconnect.
    ConnectionLost(String),
    /// The broker closed the channel with this message unconfirmed on it: which of the
    /// channel's messages caused that is unknown.
    ChannelClosed(String),
}

/// A message published on a channel, in publish order, until it is answered.
struct Unanswered {
    id: String,
    reply: Option<oneshot::Sender<Settled>>,
    // The confirm once read.
    answer: Option<Answer>,
    // `takes` when the answer was read: it may be acted on once `incoming` was taken (and the
    // confirms read) after that.
    read_at: u64,
}

/// A confirm being read, with the sequence number of its message on the channel.
type Reading = Pin<Box<dyn Future<Output = (u64, Result<Confirmation, lapin::Error>)> + Send>>;

/// What a channel's settler holds.
#[derive(Default)]
struct Settler {
    unanswered: VecDeque<Unanswered>,
    // Index into `unanswered` by sequence: `unanswered[i]` has sequence `first + i`.
    first: u64,
    confirming: FuturesUnordered<Reading>,
    // message_id → why it came back, for returns read but not yet charged.
    returned: HashMap<String, String>,
    takes: u64,
    // Messages answered `ChannelClosed`, and the broker's reason, for one line at the end.
    closed: Option<(usize, String)>,
}

/// The settler of one publishing channel (see the module docs): reads its confirms as they
/// complete, and answers its messages in publish order once no return for them can still be
/// unread. It ends once its channel is closed and everything it held is answered, or
/// `confirm_timeout` after it saw the channel closed, answering what is left then.
pub(super) async fn settle_channel(
    channel: Arc<ConfirmChannel>,
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
                () = channel.wake.notified() => {}
                Some((seq, answer)) = st.confirming.next(), if !st.confirming.is_empty() => {
                    st.record(seq, answer);
                }
                () = gone.cancelled() => {
                    let gone = || Settled::Outcome(Outcome::Unavailable("the connection was closed".to_owned()));
                    answer_all(&channel, st.unanswered, gone);
                    return;
                }
                _ = tick.tick() => {}
            }
        }
        // Every confirm completed by now, then every message published by now, then every
        // confirm completed by then: what was read before the take may be acted on.
        st.drain();
        st.take(&channel);
        st.drain();
        st.answer_ready(&live);
        // An answer read after the take is acted on after the next one: go round again.
        again = st.unanswered.front().is_some_and(|u| u.answer.is_some());

        if !channel.channel.status().connected() {
            let since = *closed_since.get_or_insert_with(Instant::now);
            if st.unanswered.is_empty() && channel.close_if_empty() {
                st.report_closure(&channel);
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
                st.report_closure(&channel);
                answer_all(&channel, st.unanswered, left);
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
        let unanswered = seq
            .checked_sub(self.first)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.unanswered.get_mut(i));
        if let Some(unanswered) = unanswered {
            unanswered.answer = Some(answer);
            unanswered.read_at = self.takes;
        }
    }

    /// Takes the messages published on the channel since the last take, in publish order.
    fn take(&mut self, channel: &ConfirmChannel) {
        let taken = channel.take_entries();
        self.takes += 1;
        for entry in taken {
            let seq = self.first + self.unanswered.len() as u64;
            let mut unanswered = Unanswered {
                id: entry.id,
                reply: Some(entry.reply),
                answer: None,
                read_at: self.takes,
            };
            match entry.answer {
                Pending::Known(answer) => {
                    unanswered.answer = Some(strip_return(*answer, &mut self.returned));
                }
                Pending::Waiting(fut) => self
                    .confirming
                    .push(Box::pin(async move { (seq, fut.await) })),
            }
            self.unanswered.push_back(unanswered);
        }
    }

    /// Logs how many messages the closure of the channel sent to be published again.
    fn report_closure(&self, channel: &ConfirmChannel) {
        if let Some((unconfirmed, reason)) = &self.closed {
            tracing::warn!(channel = channel.channel.id(), unconfirmed, reason = %reason, "the broker closed a publishing channel; its unconfirmed messages were published again");
        }
    }

    /// Answers the messages at the front whose confirm was read before the last take.
    fn answer_ready(&mut self, live: &Live) {
        while let Some(front) = self.unanswered.front() {
            if front.answer.is_none() || front.read_at >= self.takes {
                break;
            }
            let Some(mut front) = self.unanswered.pop_front() else {
                break;
            };
            self.first += 1;
            let settled = settle(
                self.returned.remove(&front.id),
                front.answer.take(),
                live.connection.status().connected(),
            );
            if let Settled::ChannelClosed(reason) = &settled {
                self.closed.get_or_insert_with(|| (0, reason.clone())).0 += 1;
            }
            if let Some(reply) = front.reply.take() {
                // The publish may have stopped waiting (timeout): nothing to tell it then.
                let _ = reply.send(settled);
            }
        }
        if self.unanswered.is_empty() && !self.returned.is_empty() {
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

/// Answers every message a channel holds with `answer()`, and closes the channel to new ones.
fn answer_all(
    channel: &ConfirmChannel,
    unanswered: VecDeque<Unanswered>,
    answer: impl Fn() -> Settled,
) {
    let entries = channel.close_and_take();
    let replies = unanswered
        .into_iter()
        .filter_map(|u| u.reply)
        .chain(entries.into_iter().map(|e| e.reply));
    for reply in replies {
        let _ = reply.send(answer());
    }
}
