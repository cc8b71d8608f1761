//! A scenario that is the same on both brokers takes the broker as a parameter ([`Transport`])
//! and reads what the relay sent through a [`Sink`]: the test's own exchange or topics.

use std::time::Duration;

use super::kafka::{Collector, KAFKA, create_topic, delete_topic, kafka_relay, topic_name};
use super::{Analysis, RabbitFixture, RelayBuilder, RelayProcess, RowState, TestTable, analyse};

/// The broker a scenario runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// The local RabbitMQ.
    RabbitMq,
    /// The local Kafka (tansu).
    Kafka,
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
}

impl Sink {
    /// The sink of `test` on `transport` for rows of the aggregate types `types`. On RabbitMQ
    /// an exchange whose queue is bound with `binding` (`#`, or e.g. `ok.#` to leave other
    /// routing keys unroutable); on Kafka a topic `<prefix>-<type>` for each type.
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
        }
    }

    /// `outbox-relay run` for `table` (instance id `instance`) publishing here: to the exchange
    /// (routing key `{aggregate_type}.{event_type}`), or to `<prefix>-{aggregate_type}`.
    pub fn relay(&self, table: &TestTable, instance: &str) -> RelayBuilder {
        match self {
            Self::RabbitMq(rabbit) => RelayBuilder::for_test(table, rabbit, instance),
            Self::Kafka { prefix, .. } => {
                let template = format!("{prefix}-{{aggregate_type}}");
                kafka_relay(table, KAFKA, &template, instance)
            }
        }
    }

    /// Waits until everything the broker had accepted has been received: a barrier message
    /// through the queue (30 s at most), or each topic read up to its high watermarks (`timeout`
    /// for each).
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
        }
    }

    /// What was received so far (message ids; `ce_id`s, in reading order) checked against
    /// `expected` (see [`analyse`]).
    pub fn analyse(&self, expected: &[RowState]) -> Analysis {
        match self {
            Self::RabbitMq(rabbit) => rabbit.analyse(expected),
            Self::Kafka { consumer, .. } => {
                let records = consumer.records();
                let ids = records
                    .iter()
                    .map(|r| r.header("ce_id").unwrap_or("<no ce_id>"));
                analyse(expected, ids)
            }
        }
    }

    /// Deletes the exchange, or stops the consumer and deletes the topics.
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
        }
    }

    /// Stops `relay` (asserting a clean exit, see [`RelayProcess::stop`]), tears the sink down
    /// and drops `table`: the end of a test.
    pub async fn finish(self, relay: RelayProcess, table: TestTable) {
        relay.stop().await;
        self.teardown().await;
        table.drop_table().await;
    }
}
