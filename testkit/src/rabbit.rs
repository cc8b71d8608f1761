//! RabbitMQ: an exchange with a queue and a collecting consumer per test, and durable
//! exchange + queue pairs that outlive a connection (broker restarts, the benchmark).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use uuid::Uuid;

use crate::{AMQP_URL, hex8, slug, wait_until};

/// A message the test consumer received.
#[derive(Debug, Clone)]
pub struct Delivered {
    /// `message_id` property ("" when absent).
    pub message_id: String,
    /// Routing key it was published with.
    pub routing_key: String,
    /// Body bytes.
    pub body: Vec<u8>,
    /// All AMQP properties.
    pub properties: BasicProperties,
    /// When the test consumer received it.
    pub received_at: Instant,
}

impl Delivered {
    /// Headers as strings; a value that is not an AMQP long string is shown as
    /// `<non-string ...>` so an assertion comparing it with a string fails visibly.
    pub fn headers(&self) -> BTreeMap<String, String> {
        self.properties
            .headers()
            .as_ref()
            .map(|t| {
                t.inner()
                    .iter()
                    .map(|(k, v)| {
                        let v = match v {
                            AMQPValue::LongString(s) => s.to_string(),
                            other => format!("<non-string {other:?}>"),
                        };
                        (k.to_string(), v)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Waits until every id in `ids` is among `arrived()` (message ids as text); panics after
/// `timeout` naming `what` and how many are still missing.
pub async fn wait_for_all_ids(
    timeout: Duration,
    what: &str,
    ids: &[Uuid],
    arrived: impl Fn() -> HashSet<String>,
) {
    wait_until(timeout, what, async || {
        let seen = arrived();
        let missing = ids
            .iter()
            .filter(|id| !seen.contains(&id.to_string()))
            .count();
        if missing == 0 {
            Ok(())
        } else {
            Err(format!("{missing} of {} not yet received", ids.len()))
        }
    })
    .await;
}

/// The `message_id` property ("" when absent).
pub fn message_id(properties: &BasicProperties) -> String {
    properties
        .message_id()
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_default()
}

/// What a queue survives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Gone with the declaring connection (a test consumer).
    Exclusive,
    /// Survives connections and broker restarts; must be deleted explicitly.
    Durable,
}

/// Declares a durable topic exchange (as the relay does) and a queue bound to it with
/// `binding`, on `channel`. The error names the step that failed.
pub async fn declare_bound_queue(
    channel: &Channel,
    exchange: &str,
    queue: &str,
    durability: Durability,
    binding: &str,
) -> Result<(), String> {
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("cannot declare exchange {exchange}: {e}"))?;
    let options = QueueDeclareOptions {
        exclusive: durability == Durability::Exclusive,
        durable: durability == Durability::Durable,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
        .map_err(|e| format!("cannot declare queue {queue}: {e}"))?;
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            binding.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("cannot bind queue {queue} to {exchange}: {e}"))?;
    Ok(())
}

const BARRIER_PREFIX: &str = "it-barrier-";

/// A durable topic exchange, an exclusive queue bound to it and a consumer collecting every
/// delivery.
pub struct RabbitFixture {
    /// Exchange the relay publishes to (`it.<test>.<hex>`).
    pub exchange: String,
    /// The bound queue.
    pub queue: String,
    /// A routing key that reaches the queue (used for barriers).
    barrier_key: String,
    conn: Connection,
    channel: Channel,
    received: Arc<Mutex<Vec<Delivered>>>,
    barriers: Arc<Mutex<HashSet<String>>>,
}

impl RabbitFixture {
    /// Declares the exchange (durable topic, as the relay does) and a queue bound with
    /// `binding`; `barrier_key` must match `binding`.
    pub async fn new(test: &str, binding: &str, barrier_key: &str) -> Self {
        let tag = format!("{}.{}", slug(test, 40), hex8());
        let exchange = format!("it.{tag}");
        let queue = format!("it.{tag}.q");
        let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("cannot connect to RabbitMQ at {AMQP_URL}: {e}"));
        let channel = conn.create_channel().await.expect("channel");
        declare_bound_queue(&channel, &exchange, &queue, Durability::Exclusive, binding)
            .await
            .unwrap_or_else(|e| panic!("declare {exchange} and {queue}: {e}"));
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                format!("it-consumer-{tag}").into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let received = Arc::new(Mutex::new(Vec::new()));
        let barriers = Arc::new(Mutex::new(HashSet::new()));
        let (sink, barrier_sink) = (Arc::clone(&received), Arc::clone(&barriers));
        tokio::spawn(async move {
            while let Some(delivery) = consumer.next().await {
                let d = match delivery {
                    Ok(d) => d,
                    Err(e) => {
                        eprintln!("test consumer stopped: {e}");
                        return;
                    }
                };
                let message_id = message_id(&d.properties);
                if message_id.starts_with(BARRIER_PREFIX) {
                    barrier_sink.lock().unwrap().insert(message_id);
                    continue;
                }
                sink.lock().unwrap().push(Delivered {
                    message_id,
                    routing_key: d.routing_key.to_string(),
                    body: d.data,
                    properties: d.properties,
                    received_at: Instant::now(),
                });
            }
        });
        Self {
            exchange,
            queue,
            barrier_key: barrier_key.to_owned(),
            conn,
            channel,
            received,
            barriers,
        }
    }

    /// Binds the queue to the exchange with one more routing pattern (e.g. to make a route
    /// that was unroutable deliverable).
    pub async fn bind(&self, pattern: &str) {
        self.channel
            .queue_bind(
                self.queue.as_str().into(),
                self.exchange.as_str().into(),
                pattern.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "bind {} to {} with {pattern}: {e}",
                    self.queue, self.exchange
                )
            });
    }

    /// Messages received so far (barriers excluded).
    pub fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    /// A copy of every delivery so far, in arrival order.
    pub fn deliveries(&self) -> Vec<Delivered> {
        self.received.lock().unwrap().clone()
    }

    /// How many times each message id arrived.
    pub fn id_counts(&self) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        for d in self.received.lock().unwrap().iter() {
            *out.entry(d.message_id.clone()).or_insert(0) += 1;
        }
        out
    }

    /// Waits until every id in `ids` has arrived at least once.
    pub async fn wait_for_ids(&self, ids: &[Uuid], timeout: Duration) {
        let what = format!("{} messages arrive on {}", ids.len(), self.queue);
        wait_for_all_ids(timeout, &what, ids, || {
            self.id_counts().into_keys().collect()
        })
        .await;
    }

    /// Waits until `id` has arrived and returns its first delivery.
    pub async fn wait_for_delivery(&self, id: Uuid, timeout: Duration) -> Delivered {
        self.wait_for_ids(&[id], timeout).await;
        let id = id.to_string();
        self.deliveries()
            .into_iter()
            .find(|d| d.message_id == id)
            .expect("an id that arrived is among the deliveries")
    }

    /// Publishes a marker to the exchange and waits for it: every message the broker had
    /// accepted into the queue before this call has then been received.
    pub async fn barrier(&self) {
        let id = format!("{BARRIER_PREFIX}{}", hex8());
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                self.barrier_key.as_str().into(),
                BasicPublishOptions::default(),
                b"barrier",
                BasicProperties::default().with_message_id(id.as_str().into()),
            )
            .await
            .expect("publish barrier");
        wait_until(
            Duration::from_secs(30),
            "the barrier message arrives",
            async || {
                if self.barriers.lock().unwrap().contains(&id) {
                    Ok(())
                } else {
                    Err(format!("{} deliveries so far", self.count()))
                }
            },
        )
        .await;
    }

    /// Deletes the exchange and closes the connection (the exclusive queue goes with it).
    pub async fn teardown(self) {
        let _ = self
            .channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        let _ = self.conn.close(200, "test done".into()).await;
    }
}
