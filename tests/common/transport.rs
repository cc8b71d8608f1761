//! A scenario that is the same on every sink takes it as a parameter ([`Transport`]) and reads
//! what the relay sent through a [`Sink`]: the test's own exchange, topics or webhook endpoint.

use std::time::Duration;

use super::kafka::{Collector, KAFKA, create_topic, delete_topic, kafka_relay, topic_name};
use super::webhook::{Endpoint, Reply};
use super::{Analysis, RabbitFixture, RelayBuilder, RelayProcess, RowState, TestTable, analyse};

/// The broker a scenario runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// The local RabbitMQ.
    RabbitMq,
    /// The local Kafka (tansu).
    Kafka,
    /// A webhook endpoint on loopback (`publisher.kind = "http"`) answering 204 at once.
    Http,
}

/// Where a test reads what the relay sent.
pub enum Sink {
    /// The test's own exchange, its queue and a consumer collecting every delivery.
    RabbitMq(Box<RabbitFixture>),
    /// The test's own topics and a consumer reading all of them.
    Kafka {
        /// What the topic names start with (a [`topic_name`]).
        prefix: String,
        /// `<prefix>-<type>` for each aggregate type given to [`Sink::new`].
        topics: Vec<String>,
        /// Reads every partition of `topics` from the beginning.
        consumer: Collector,
    },
    /// The test's own endpoint, recording every request.
    Http(Endpoint),
}

impl Sink {
    /// The sink of `test` on `transport` for rows of the aggregate types `types`. On RabbitMQ
    /// an exchange whose queue is bound with `binding` (`#`, or e.g. `ok.#` to leave other
    /// routing keys unroutable); on Kafka a topic `<prefix>-<type>` for each type; over HTTP an
    /// endpoint that accepts every request (`binding` and `types` do not apply).
    pub async fn new(transport: Transport, test: &str, binding: &str, types: &[&str]) -> Self {
        match transport {
            Transport::RabbitMq => {
                // The barrier messages are routed like the others: they must reach the queue.
                let barrier = binding.replace('#', "barrier");
                Self::RabbitMq(Box::new(RabbitFixture::new(test, binding, &barrier).await))
            }
            Transport::Kafka => {
                let prefix = topic_name(test);
                let topics: Vec<String> = types.iter().map(|t| format!("{prefix}-{t}")).collect();
                for topic in &topics {
                    create_topic(KAFKA, topic).await;
                }
                let names: Vec<&str> = topics.iter().map(String::as_str).collect();
                let consumer = Collector::start(KAFKA, &names);
                Self::Kafka {
                    prefix,
                    topics,
                    consumer,
                }
            }
            Transport::Http => Self::Http(Endpoint::start(|_| Reply::status(204)).await),
        }
    }

    /// `outbox-relay run` for `table` (instance id `instance`) publishing here: to the exchange
    /// (routing key `{aggregate_type}.{event_type}`), to `<prefix>-{aggregate_type}`, or to the
    /// endpoint's `/events/{aggregate_type}`.
    pub fn relay(&self, table: &TestTable, instance: &str) -> RelayBuilder {
        match self {
            Self::RabbitMq(rabbit) => RelayBuilder::for_test(table, rabbit, instance),
            Self::Kafka { prefix, .. } => {
                let template = format!("{prefix}-{{aggregate_type}}");
                kafka_relay(table, KAFKA, &template, instance)
            }
            Self::Http(endpoint) => RelayBuilder::for_table(table, instance)
                .set("publisher.kind", "http")
                .set(
                    "publisher.http.url",
                    endpoint.url("/events/{aggregate_type}"),
                ),
        }
    }

    /// Waits until everything the broker had accepted has been received: a barrier message
    /// through the queue (30 s at most), or each topic read up to its high watermarks (`timeout`
    /// for each); an endpoint has every request it answered already.
    pub async fn wait_received(&self, timeout: Duration) {
        match self {
            Self::RabbitMq(rabbit) => rabbit.barrier().await,
            Self::Kafka {
                topics, consumer, ..
            } => {
                for topic in topics {
                    consumer.wait_caught_up(KAFKA, topic, timeout).await;
                }
            }
            Self::Http(_) => {}
        }
    }

    /// The message ids received so far, in arrival order (`message_id`, `ce_id`, `ce-id`).
    pub fn received_ids(&self) -> Vec<String> {
        match self {
            Self::RabbitMq(rabbit) => rabbit
                .deliveries()
                .into_iter()
                .map(|d| d.message_id)
                .collect(),
            Self::Kafka { consumer, .. } => consumer
                .records()
                .iter()
                .map(|r| r.header("ce_id").unwrap_or("<no ce_id>").to_owned())
                .collect(),
            Self::Http(endpoint) => endpoint
                .messages()
                .iter()
                .map(|r| r.id().unwrap_or_else(|| "<no ce-id>".to_owned()))
                .collect(),
        }
    }

    /// What was received so far ([`Sink::received_ids`]) checked against `expected` (see
    /// [`analyse`]).
    pub fn analyse(&self, expected: &[RowState]) -> Analysis {
        match self {
            Self::RabbitMq(rabbit) => rabbit.analyse(expected),
            Self::Kafka { .. } | Self::Http(_) => {
                let ids = self.received_ids();
                analyse(expected, ids.iter().map(String::as_str))
            }
        }
    }

    /// Deletes the exchange, or stops the consumer and deletes the topics (an endpoint stops
    /// when dropped).
    pub async fn teardown(self) {
        match self {
            Self::RabbitMq(rabbit) => rabbit.teardown().await,
            Self::Kafka {
                topics, consumer, ..
            } => {
                consumer.stop().await;
                for topic in &topics {
                    delete_topic(topic).await;
                }
            }
            Self::Http(_) => {}
        }
    }

    /// Stops `relay` (asserting a clean exit, see [`RelayProcess::stop`]), tears the sink down
    /// and drops `table`: the end of a test.
    pub async fn finish(self, relay: RelayProcess, table: TestTable) {
        super::finish_with(relay, table, self.teardown()).await;
    }
}
