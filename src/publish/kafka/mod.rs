//! Kafka transport (rdkafka with its bundled librdkafka): an idempotent producer with
//! `acks=all`, records keyed by aggregate id, many records in flight. Delivery reports are
//! classified into message-level and connection-level outcomes.
//!
//! With `relay.ordering = "aggregate"` an aggregate's claimed run goes to the producer without
//! waiting for each delivery report (`publish_run`): one key, so one partition, and the
//! idempotent producer keeps the records of a partition in order across its retries. Two gaps
//! could still let record n+1 be delivered while n is handed back, and both are closed:
//! - A record that fails for good at the broker: `enable.gapless.guarantee` turns it into a
//!   fatal producer error instead of letting what was queued behind it through. The records
//!   after it come back as connection-level (handed back), and the producer is replaced.
//! - A record that times out: the gapless guarantee does not cover `message.timeout.ms`
//!   (librdkafka then bumps the producer's epoch and sends what was queued behind). So an
//!   ordered producer has no librdkafka timeout (`message.timeout.ms = 0`, infinite); the
//!   relay enforces `publisher.kafka.message_timeout` itself, and a record without a report by
//!   then marks the producer for replacement. The replaced producer is dropped, which purges
//!   what it still holds, so it cannot deliver a handed-back record's successors later. What
//!   it had already sent was sent in order; the relay publishes the handed-back rows again,
//!   in order (a duplicate at worst, never a reorder of first arrivals). For the same reason
//!   one producer takes a whole stretch of a run: if it is replaced while the stretch is being
//!   queued, the rest of the stretch is refused and handed back.
//!
//! The broker answers a produce request per partition batch: a record it rejects (too large
//! for the topic, invalid for its schema) fails every record batched with it, of any
//! aggregate. A record rejected that way is published again alone, one record to a batch on a
//! separate solo producer, and that answer is its own: only the record at fault spends an
//! attempt.
//!
//! Each producer has a generation. What a replaced producer still reports (its purged records,
//! the timeouts of records it held, the fatal error its purge raises) is handed back like any
//! connection-level outcome but says nothing about its successor: it never marks the broker
//! down nor the new producer for replacement (else each replacement would purge the next).
//!
//! Files: `connection` (the librdkafka configuration, the client context, the producer in use
//! and the solo producer), `wire` (the record: topic, key, headers), `classify` (delivery
//! errors to outcomes).

mod classify;
mod connection;
mod wire;

pub use crate::config::valid_kafka_topic as valid_topic;
pub use classify::classify_error;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::channel::oneshot::Canceled;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::future_producer::OwnedDeliveryResult;
use rdkafka::producer::{DeliveryFuture, FutureProducer, Producer};

use self::classify::{ProducerState, Reported, batch_wide};
use self::connection::{Context, Current, LastError, is_secret};
use super::envelope::{self, EnvelopeConfig};
use super::slot::Slot;
use super::{ConnectError, Outcome, Publisher};
use crate::config::{KafkaConfig, Ordering as RelayOrdering};
use crate::message::OutboxMessage;

/// librdkafka `linger.ms` with `relay.ordering = "aggregate"`, unless the properties set it.
pub const ORDERED_LINGER_MS: &str = "1";

/// librdkafka properties an ordered producer sets itself (module docs), whatever
/// `publisher.kafka.properties` says: the message timeout and its alias, and the gapless
/// guarantee.
const ORDERED_OVERRIDES: &[&str] = &[
    "message.timeout.ms",
    "delivery.timeout.ms",
    "enable.gapless.guarantee",
];

/// A refusal with the record's topic and value size after the broker's (or librdkafka's)
/// words, which name neither (`UnknownTopic`, `MessageSizeTooLarge`).
fn naming_the_record(outcome: Outcome, msg: &OutboxMessage, topic: &str) -> Outcome {
    match outcome {
        Outcome::Rejected(why) => Outcome::Rejected(format!(
            "{why} (topic {topic:.100?}, value of {} bytes)",
            msg.payload.len()
        )),
        other => other,
    }
}

/// Publishes to Kafka topics rendered from a template.
pub struct KafkaPublisher {
    cfg: KafkaConfig,
    /// The producer in use; its generation is one more on every replacement.
    slot: Slot<Current>,
    up: Arc<AtomicBool>,
    /// The last client-level error any of our producers reported (see [`Context`]).
    last_error: Arc<Mutex<Option<LastError>>>,
    /// The generation of a producer that can no longer be trusted to deliver (fatal error, or
    /// a message timed out), 0 for none: the next connect() replaces it if it is still the
    /// current one. Outcomes of a replaced producer (its purged records) never mark its
    /// successor: a late store of an old generation names a producer already gone.
    replace: AtomicU64,
    /// Some outbox has `ordering = "aggregate"`: runs are pipelined, librdkafka has no
    /// message timeout and the relay enforces `message_timeout` (see the module docs).
    ordered: bool,
    /// The producer that publishes a record alone, one record to a batch, when the broker
    /// rejected the batch it was in ([`KafkaPublisher::judged_alone`]); created on first use.
    solo: Mutex<Option<FutureProducer<Context>>>,
}

impl KafkaPublisher {
    /// A publisher that creates its producer on the first [`Publisher::connect`].
    pub fn new(cfg: KafkaConfig) -> Self {
        Self {
            cfg,
            slot: Slot::new(),
            up: Arc::new(AtomicBool::new(false)),
            last_error: Arc::new(Mutex::new(None)),
            replace: AtomicU64::new(0),
            ordered: false,
            solo: Mutex::new(None),
        }
    }

    /// [`KafkaPublisher::new`] tuned for the relay's `ordering`. With `aggregate`: runs are
    /// pipelined with the gapless guarantee and a relay-side `message_timeout` (module docs),
    /// and librdkafka lingers [`ORDERED_LINGER_MS`] unless the properties set `linger.ms` (or
    /// its alias).
    pub fn for_ordering(mut cfg: KafkaConfig, ordering: RelayOrdering) -> Self {
        let ordered = ordering == RelayOrdering::Aggregate;
        if ordered
            && !cfg.properties.contains_key("linger.ms")
            && !cfg.properties.contains_key("queue.buffering.max.ms")
        {
            // An aggregate's next run waits for the previous run's delivery reports, so
            // librdkafka's 5 ms batching delay is paid once per run.
            cfg.properties
                .insert("linger.ms".to_owned(), ORDERED_LINGER_MS.to_owned());
        }
        if ordered {
            for key in ORDERED_OVERRIDES {
                if cfg.properties.remove(*key).is_some() {
                    tracing::warn!(
                        "publisher.kafka.properties.{key} is ignored with relay.ordering = \"aggregate\": the relay sets it (records are pipelined per aggregate; the relay enforces publisher.kafka.message_timeout itself)"
                    );
                }
            }
        }
        Self {
            ordered,
            ..Self::new(cfg)
        }
    }

    /// Notes what an outcome of the producer of `generation` says, if that producer is still
    /// the current one.
    fn note(&self, generation: u64, said: ProducerState) {
        if self.slot.generation().load(Ordering::Relaxed) != generation {
            return;
        }
        if said == ProducerState::Broken {
            self.replace.store(generation, Ordering::Relaxed);
        }
        let up = said == ProducerState::Reaches;
        self.up.store(up, Ordering::Relaxed);
    }

    /// Hands one record to the producer, waiting while its queue is full (at most
    /// `message_timeout`); the outcome instead when it cannot be queued. With `pinned` (the
    /// generation that took the run's earlier records), a replaced producer refuses the record:
    /// its successor could deliver it ahead of those, which come back purged.
    async fn enqueue(
        &self,
        msg: &OutboxMessage,
        topic: &str,
        env: &EnvelopeConfig,
        pinned: Option<u64>,
    ) -> Result<(DeliveryFuture, u64), Outcome> {
        let Some(current) = self.slot.get() else {
            return Err(Outcome::Unavailable(
                "Kafka producer not created yet".to_owned(),
            ));
        };
        let (producer, generation) = (&current.producer, current.generation);
        if pinned.is_some_and(|g| g != generation) {
            return Err(Outcome::Unavailable(
                "the Kafka producer was replaced during the run".to_owned(),
            ));
        }
        if !valid_topic(topic) {
            return Err(Outcome::Rejected(format!(
                "{topic:.100?} is not a valid Kafka topic name (1-249 of [a-zA-Z0-9._-])"
            )));
        }
        let mut record = wire::record(msg, env, topic);
        let deadline = Instant::now() + self.cfg.message_timeout;
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Ok((delivery, generation)),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r))
                    if Instant::now() < deadline =>
                {
                    record = r;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err((err, _)) => {
                    return Err(naming_the_record(self.failed(&err, generation), msg, topic));
                }
            }
        }
    }

    /// Waits for a record's delivery report. An ordered producer has no librdkafka timeout:
    /// here the relay enforces `message_timeout` from when the record was queued. With an
    /// ordered producer every connection-level outcome (no report in time, a fatal error)
    /// marks the producer for replacement, which purges the records queued behind.
    async fn report(
        &self,
        (delivery, generation): (DeliveryFuture, u64),
        queued: Instant,
    ) -> Reported {
        if !self.ordered {
            return self.delivered(delivery.await, generation);
        }
        let deadline = tokio::time::Instant::from_std(queued + self.cfg.message_timeout);
        let reported = match tokio::time::timeout_at(deadline, delivery).await {
            Ok(report) => self.delivered(report, generation),
            Err(_) => Outcome::Unavailable(format!(
                "no delivery report within {} (publisher.kafka.message_timeout)",
                humantime::format_duration(self.cfg.message_timeout)
            ))
            .into(),
        };
        if matches!(reported.outcome, Outcome::Unavailable(_)) {
            self.note(generation, ProducerState::Broken);
        }
        reported
    }

    /// The outcome of a delivery report from the producer of `generation`.
    fn delivered(
        &self,
        report: Result<OwnedDeliveryResult, Canceled>,
        generation: u64,
    ) -> Reported {
        match report {
            Ok(Ok(_)) => {
                self.note(generation, ProducerState::Reaches);
                Outcome::Confirmed.into()
            }
            Ok(Err((err, _))) => {
                let outcome = self.failed(&err, generation);
                let batch_wide = matches!(outcome, Outcome::Rejected(_)) && batch_wide(&err);
                Reported {
                    outcome,
                    batch_wide,
                }
            }
            Err(Canceled) => {
                self.note(generation, ProducerState::Unreachable);
                Outcome::Unavailable("the producer went away before reporting".to_owned()).into()
            }
        }
    }

    /// The outcome to give for `msg` after its delivery report: when the broker rejected the
    /// whole batch the record was in, the record is published again alone (its own batch on
    /// the solo producer) and that verdict is the record's, so only the record at fault
    /// spends an attempt. Should the record alone get no answer (the broker going away), the
    /// record is handed back without spending one: an outage never charges a batch-mate.
    /// The caller must not have sent a later record of the aggregate that could be delivered
    /// meanwhile (an ordered producer's rejected batch makes it fatal: nothing it holds is
    /// delivered after).
    async fn judged_alone(
        &self,
        msg: &OutboxMessage,
        topic: &str,
        env: &EnvelopeConfig,
        reported: Reported,
    ) -> Outcome {
        if !reported.batch_wide {
            return naming_the_record(reported.outcome, msg, topic);
        }
        let alone = match self.publish_alone(msg, topic, env).await {
            Outcome::Unavailable(why) => {
                tracing::debug!(id = %msg.id, reason = %why, "the record alone got no answer; handing it back");
                Outcome::Unavailable(why)
            }
            alone => {
                if alone == Outcome::Confirmed {
                    tracing::info!(id = %msg.id, "the broker rejected a batch this record was in; published alone, it was accepted");
                }
                alone
            }
        };
        naming_the_record(alone, msg, topic)
    }

    /// Publishes `msg` on the solo producer, alone in its batch, and waits for the report.
    async fn publish_alone(
        &self,
        msg: &OutboxMessage,
        topic: &str,
        env: &EnvelopeConfig,
    ) -> Outcome {
        let producer = match self.solo_producer() {
            Ok(p) => p,
            Err(e) => return Outcome::Unavailable(e),
        };
        let record = wire::record(msg, env, topic);
        match producer.send_result(record) {
            Ok(delivery) => match delivery.await {
                Ok(Ok(_)) => Outcome::Confirmed,
                Ok(Err((err, _))) => classify_error(&err),
                Err(Canceled) => {
                    Outcome::Unavailable("the solo producer went away before reporting".to_owned())
                }
            },
            Err((err, _)) => classify_error(&err),
        }
    }

    /// Classifies a record that the producer of `generation` failed, noting a producer that
    /// can no longer be trusted.
    fn failed(&self, err: &KafkaError, generation: u64) -> Outcome {
        let outcome = classify_error(err);
        if matches!(outcome, Outcome::Unavailable(_)) {
            let said = match err.rdkafka_error_code() {
                Some(RDKafkaErrorCode::Fatal | RDKafkaErrorCode::MessageTimedOut) => {
                    ProducerState::Broken
                }
                _ => ProducerState::Unreachable,
            };
            self.note(generation, said);
        }
        outcome
    }
    /// Queues `stretch` (records for one `topic`) on one producer without waiting for
    /// reports (see `enqueue`): the records queued, and the outcome of the one the producer
    /// refused outright, which ends the stretch.
    async fn queue_stretch<'m>(
        &self,
        stretch: &'m [OutboxMessage],
        topic: &str,
        env: &EnvelopeConfig,
    ) -> (Vec<Queued<'m>>, Option<Outcome>) {
        let mut queued = Vec::with_capacity(stretch.len());
        let mut pinned = None;
        for msg in stretch {
            let at = Instant::now();
            match self.enqueue(msg, topic, env, pinned).await {
                Ok(delivery) => {
                    pinned = Some(delivery.1);
                    queued.push((delivery, at, msg));
                }
                Err(outcome) => return (queued, Some(outcome)),
            }
        }
        (queued, None)
    }

    /// Reads the reports of `queued` in order onto `outcomes`; whether the producer is being
    /// replaced (an outcome is connection-level), which ends the run there.
    async fn read_reports(
        &self,
        queued: Vec<Queued<'_>>,
        topic: &str,
        env: &EnvelopeConfig,
        outcomes: &mut Vec<Outcome>,
    ) -> bool {
        for (delivery, at, msg) in queued {
            let reported = self.report(delivery, at).await;
            // Alone only while everything before it was confirmed: after a failure the
            // aggregate's later records are not sent again.
            let outcome = if outcomes.iter().all(|o| *o == Outcome::Confirmed) {
                self.judged_alone(msg, topic, env, reported).await
            } else {
                naming_the_record(reported.outcome, msg, topic)
            };
            let replaced = matches!(outcome, Outcome::Unavailable(_));
            outcomes.push(outcome);
            if replaced {
                return true;
            }
        }
        false
    }
}

/// A record queued for a run: its delivery (and the producer's generation), when it was
/// queued, and its message.
type Queued<'m> = ((DeliveryFuture, u64), Instant, &'m OutboxMessage);

/// How many of a run's `outcomes` to keep once one is not `Confirmed`: up to the last
/// confirmed one after the first failure (past it only a confirmed answer matters), else up
/// to the failure; `None` while all are confirmed.
fn kept_past_a_failure(outcomes: &[Outcome]) -> Option<usize> {
    let first = outcomes.iter().position(|o| *o != Outcome::Confirmed)?;
    let last = outcomes
        .iter()
        .rposition(|o| *o == Outcome::Confirmed)
        .filter(|&i| i > first)
        .unwrap_or(first);
    Some(last + 1)
}

#[async_trait]
impl Publisher for KafkaPublisher {
    fn kind(&self) -> &'static str {
        "kafka"
    }

    fn describe(&self) -> String {
        let props: Vec<String> = self
            .cfg
            .properties
            .iter()
            .map(|(k, v)| {
                if is_secret(k) {
                    format!("{k}=***")
                } else {
                    format!("{k}={v}")
                }
            })
            .collect();
        format!(
            "kafka {} topic {:?}{}",
            crate::redact::redact_url(&self.cfg.brokers),
            self.cfg.topic.as_str(),
            if props.is_empty() {
                String::new()
            } else {
                format!(" properties [{}]", props.join(", "))
            }
        )
    }

    async fn connect(&self) -> Result<(), ConnectError> {
        let connecting = self.slot.connecting().await;
        if self.is_connected() {
            return Ok(());
        }
        // A fatal producer, or one marked for replacement, is replaced.
        let usable = |current: &Current| {
            current.producer.client().fatal_error().is_none()
                && self.replace.load(Ordering::Relaxed) != current.generation
        };
        let current = connecting
            .get_or_connect(usable, |generation| async move {
                self.create_producer(generation)
            })
            .await?;
        // Producing is lazy; ask for metadata to learn whether any broker answers at all.
        let probe = current.producer.clone();
        let metadata = tokio::task::spawn_blocking(move || {
            probe
                .client()
                .fetch_metadata(None, Duration::from_secs(5))
                .map(|m| m.brokers().len())
        })
        .await
        .map_err(|e| ConnectError(format!("metadata probe failed: {e}")))?;
        match metadata {
            Ok(n) if n > 0 => {
                self.up.store(true, Ordering::Relaxed);
                Ok(())
            }
            Ok(_) => Err(ConnectError(format!(
                "Kafka at {} reported no brokers",
                crate::redact::redact_url(&self.cfg.brokers)
            ))),
            Err(e) => {
                let cause = self
                    .last_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_ref()
                    .map(|c| format!("; last client error: {}", c.text))
                    .unwrap_or_default();
                Err(ConnectError(format!(
                    "cannot reach Kafka at {}: {e}{cause}",
                    crate::redact::redact_url(&self.cfg.brokers)
                )))
            }
        }
    }

    fn is_connected(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    async fn publish(&self, msg: &OutboxMessage, env: &EnvelopeConfig) -> Outcome {
        let queued = Instant::now();
        let topic = envelope::destination(msg, &env.route);
        match self.enqueue(msg, &topic, env, None).await {
            Ok(queued_record) => {
                let reported = self.report(queued_record, queued).await;
                self.judged_alone(msg, &topic, env, reported).await
            }
            Err(outcome) => outcome,
        }
    }

    /// With an ordered producer, queues each stretch of the run that goes to one topic (one
    /// key, so one partition) without waiting for reports, then reads the reports in order
    /// (see the module docs for why nothing after a failed record is delivered ahead of it).
    /// A record the producer refuses outright (too large, bad topic) ends the run there.
    /// Stretches for different topics go one after the other. After a record that failed,
    /// the later reports are still read so that one confirmed anyway is recorded as sent
    /// (the relay logs it as a broken promise) rather than published twice.
    fn pipelines_runs(&self) -> bool {
        self.ordered
    }

    async fn publish_run(&self, run: &[OutboxMessage], env: &EnvelopeConfig) -> Vec<Outcome> {
        if !self.ordered {
            // librdkafka's own timeout could let a later record through: one at a time.
            return super::one_at_a_time(self, run, env).await;
        }
        let mut outcomes = Vec::with_capacity(run.len());
        // Each message's topic, rendered once.
        let topics: Vec<String> = run
            .iter()
            .map(|msg| envelope::destination(msg, &env.route))
            .collect();
        let mut start = 0;
        for same in topics.chunk_by(|a, b| a == b) {
            let (stretch, topic) = (&run[start..start + same.len()], same[0].as_str());
            start += same.len();
            let (queued, refused) = self.queue_stretch(stretch, topic, env).await;
            if self.read_reports(queued, topic, env, &mut outcomes).await {
                // The producer is being replaced: what it still holds is purged, and the
                // caller hands back the rest of the run.
                return outcomes;
            }
            outcomes.extend(refused);
            if let Some(kept) = kept_past_a_failure(&outcomes) {
                outcomes.truncate(kept);
                return outcomes;
            }
        }
        outcomes
    }

    async fn close(&self) {
        if let Some(p) = self.slot.take() {
            // Short: the drain is over by now and shutdown_timeout is the operator's budget.
            let _ =
                tokio::task::spawn_blocking(move || p.producer.flush(Duration::from_secs(1))).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_keeps_its_outcomes_up_to_the_last_confirmed_past_the_first_failure() {
        let ok = || Outcome::Confirmed;
        let bad = || Outcome::Rejected("no".to_owned());
        assert_eq!(kept_past_a_failure(&[ok(), ok()]), None);
        assert_eq!(kept_past_a_failure(&[ok(), bad(), bad()]), Some(2));
        assert_eq!(kept_past_a_failure(&[bad(), bad(), ok(), bad()]), Some(3));
        assert_eq!(kept_past_a_failure(&[ok(), bad(), ok()]), Some(3));
    }

    pub(super) fn config(properties: &[(&str, &str)]) -> KafkaConfig {
        KafkaConfig {
            brokers: "b:9092".into(),
            topic: crate::template::Template::parse("t").unwrap_or_else(|e| panic!("{e}")),
            message_timeout: Duration::from_secs(5),
            properties: properties
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn ordered_kafka_lingers_one_millisecond_unless_told_otherwise() {
        let describe = |ordering, properties: &[(&str, &str)]| {
            KafkaPublisher::for_ordering(config(properties), ordering).describe()
        };
        assert!(describe(RelayOrdering::Aggregate, &[]).contains("linger.ms=1"));
        let own = describe(RelayOrdering::Aggregate, &[("linger.ms", "20")]);
        assert!(
            own.contains("linger.ms=20") && !own.contains("linger.ms=1,"),
            "{own}"
        );
        let alias = describe(RelayOrdering::Aggregate, &[("queue.buffering.max.ms", "9")]);
        assert!(!alias.contains("linger.ms"), "{alias}");
        assert!(!describe(RelayOrdering::None, &[]).contains("linger.ms"));
    }

    #[test]
    fn only_the_current_producers_outcomes_count() {
        let publisher = KafkaPublisher::new(config(&[]));
        publisher.slot.generation().store(2, Ordering::Relaxed);
        publisher.up.store(true, Ordering::Relaxed);
        // A purged record of the replaced producer (generation 1): says nothing now.
        publisher.note(1, ProducerState::Broken);
        assert!(publisher.is_connected());
        assert_eq!(publisher.replace.load(Ordering::Relaxed), 0);
        // The same from the current producer.
        publisher.note(2, ProducerState::Broken);
        assert!(!publisher.is_connected());
        assert_eq!(publisher.replace.load(Ordering::Relaxed), 2);
        // A confirm of the replaced producer does not bring the broker back either.
        publisher.note(1, ProducerState::Reaches);
        assert!(!publisher.is_connected());

        let context = |generation| Context {
            up: Arc::clone(&publisher.up),
            last_error: Arc::clone(&publisher.last_error),
            generation,
            current: Arc::clone(publisher.slot.generation()),
        };
        assert!(!context(1).is_current(), "replaced");
        assert!(context(2).is_current());
        assert!(context(3).is_current(), "being created");
    }
}
