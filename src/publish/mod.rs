//! The publisher boundary: one small trait, one outcome type, one module per transport.
//!
//! The relay loop only sees [`Publisher`] and [`Outcome`]. Each transport classifies its own
//! errors into [`Outcome::Rejected`] (message-level: spend an attempt, back off) or
//! [`Outcome::Unavailable`] (connection-level: hand the row back, reconnect) — the split that
//! decides whether a broker outage can ever dead-letter a message (it cannot).

pub mod envelope;
pub mod headers;
pub mod http;
pub mod kafka;
pub mod nats;
pub mod rabbitmq;
pub mod redis;
pub mod slot;
pub mod stdout;

use std::sync::Arc;

use async_trait::async_trait;

use crate::config::{Config, Ordering, PublisherConfig};
use crate::message::OutboxMessage;
use crate::publish::envelope::EnvelopeConfig;

/// How the one Kafka producer that serves every outbox runs: pipelined (ordered) if any outbox
/// is ordered.
fn kafka_ordering(config: &Config) -> Ordering {
    if config
        .outboxes
        .iter()
        .any(|o| o.ordering == Ordering::Aggregate)
    {
        Ordering::Aggregate
    } else {
        Ordering::None
    }
}

/// Settings the sink's client refuses although the configuration parsed, found before
/// connecting (`run` and `check` exit 2 on them): librdkafka's verdict on
/// `publisher.kafka.properties` (a property it does not know, a value or combination it
/// refuses), which no reconnect could change.
pub fn check_settings(config: &Config) -> Result<(), crate::config::ConfigError> {
    match &config.publisher {
        PublisherConfig::Kafka(c) => kafka::KafkaPublisher::check_properties(
            c,
            kafka_ordering(config) == Ordering::Aggregate,
        )
        .map_err(|reason| crate::config::ConfigError::Invalid {
            key: "publisher.kafka.properties".into(),
            reason,
        }),
        _ => Ok(()),
    }
}

/// Builds the configured publisher (not yet connected). One publisher serves every outbox:
/// each publish names its outbox's envelope.
pub fn build(config: &Config) -> Arc<dyn Publisher> {
    match &config.publisher {
        PublisherConfig::RabbitMq(c) => Arc::new(rabbitmq::RabbitMqPublisher::new(c.clone())),
        PublisherConfig::Kafka(c) => Arc::new(kafka::KafkaPublisher::for_ordering(
            c.clone(),
            kafka_ordering(config),
        )),
        PublisherConfig::Stdout => Arc::new(stdout::StdoutPublisher::new()),
        PublisherConfig::Nats(c) => {
            let audit = nats_window_audit(config, c);
            let mut publisher = nats::NatsPublisher::new(c.clone(), config.relay.max_in_flight);
            if let Some(name) = &c.declare_stream {
                publisher = publisher.with_declared_stream(nats::StreamDeclaration::new(
                    name,
                    &audit.templates,
                    audit.lease,
                ));
            }
            Arc::new(publisher.with_window_audit(audit))
        }
        PublisherConfig::Redis(c) => Arc::new(redis::RedisPublisher::new(c.clone())),
        PublisherConfig::Http(c) => Arc::new(http::HttpPublisher::new(c.clone())),
    }
}

/// The duplicate-window check for `config`'s subject templates against its lease.
fn nats_window_audit(config: &Config, nats: &crate::config::NatsConfig) -> nats::WindowAudit {
    nats::WindowAudit {
        lease: config.relay.lease_timeout,
        templates: nats_templates(config, nats),
    }
}

/// The subject templates in use with `nats`: each outbox's own, or the publisher's for the
/// outboxes without one; without repeats.
pub fn nats_templates(
    config: &Config,
    nats: &crate::config::NatsConfig,
) -> Vec<crate::template::Template> {
    let mut templates: Vec<crate::template::Template> = Vec::new();
    for outbox in &config.outboxes {
        let template = outbox.route.as_ref().unwrap_or(&nats.subject);
        if !templates.iter().any(|t| t.as_str() == template.as_str()) {
            templates.push(template.clone());
        }
    }
    templates
}

/// The result of publishing one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The broker confirmed the message: mark it sent.
    Confirmed,
    /// The broker refused this message (nack, unroutable, too large, unknown topic, …):
    /// spend the attempt and back off.
    Rejected(String),
    /// The broker could not be reached or the connection broke before an answer: hand the
    /// row back without spending an attempt, and reconnect.
    Unavailable(String),
}

/// A connection-level error from [`Publisher::connect`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct ConnectError(pub String);

/// A broker the relay can publish to.
#[async_trait]
pub trait Publisher: Send + Sync + 'static {
    /// `rabbitmq`, `kafka`, `nats`, `redis`, `http` or `stdout` (for logs and metrics).
    fn kind(&self) -> &'static str;

    /// Where it publishes, with secrets masked (for logs).
    fn describe(&self) -> String;

    /// (Re)establishes the connection; idempotent when already connected.
    async fn connect(&self) -> Result<(), ConnectError>;

    /// Whether the last known state of the connection is usable.
    fn is_connected(&self) -> bool;

    /// Publishes one message and waits for the broker's answer. Many calls may be in flight at
    /// once; the caller keeps per-aggregate order by not starting message n+1 before n returns.
    /// `envelope` is the settings of the outbox the row comes from.
    async fn publish(&self, msg: &OutboxMessage, envelope: &EnvelopeConfig) -> Outcome;

    /// Publishes one aggregate's run, in order, and returns the outcomes of a prefix of it:
    /// the run stops at its first message that is not [`Outcome::Confirmed`], and whatever
    /// the returned outcomes do not cover was not published. A transport may send the run
    /// without waiting for each answer only if the broker then still never delivers a message
    /// ahead of an earlier one that failed; outcomes after the first failure are then the
    /// broker's answers to messages sent meanwhile, for the caller to hand back. This default
    /// publishes one message at a time, each after the previous was confirmed.
    async fn publish_run(&self, run: &[OutboxMessage], envelope: &EnvelopeConfig) -> Vec<Outcome> {
        one_at_a_time(self, run, envelope).await
    }

    /// Closes the connection cleanly (best effort).
    async fn close(&self);

    /// Whether [`Publisher::publish_run`] sends a run without waiting for each answer. Tracing
    /// (the `otel` module) then hands it whole runs (every span from the run's start to its
    /// end); otherwise it publishes one message at a time through [`Publisher::publish`], as
    /// the default `publish_run` does, each span from its own send to its confirm. A transport
    /// that overrides `publish_run` to pipeline says so here, or traced runs lose its pipelining.
    fn pipelines_runs(&self) -> bool {
        false
    }

    /// Advice about the broker's setup found when it connected (a NATS stream whose duplicate
    /// window is shorter than the lease needs): `check` prints it; the publisher logs it as
    /// warnings itself.
    fn advisories(&self) -> Vec<String> {
        Vec::new()
    }

    /// `messaging.destination.name` of a message's publish span: where it goes, in the
    /// transport's terms (exchange, topic, subject, stream key, URL host and path). This default
    /// is the rendered route (the row's `destination`, or the outbox's template).
    fn destination_name(&self, msg: &OutboxMessage, envelope: &EnvelopeConfig) -> String {
        envelope::destination(msg, &envelope.route)
    }
}

/// Publishes `run` one message at a time, each after the previous was confirmed, stopping at
/// the first that is not (the default [`Publisher::publish_run`]).
pub async fn one_at_a_time<P: Publisher + ?Sized>(
    publisher: &P,
    run: &[OutboxMessage],
    envelope: &EnvelopeConfig,
) -> Vec<Outcome> {
    let mut outcomes = Vec::with_capacity(run.len());
    for msg in run {
        let outcome = publisher.publish(msg, envelope).await;
        let stop = outcome != Outcome::Confirmed;
        outcomes.push(outcome);
        if stop {
            break;
        }
    }
    outcomes
}
