//! RabbitMQ: an exchange with a queue and a collecting consumer per test, and durable
//! exchange + queue pairs that outlive a connection (broker restarts, the benchmark), one with a
//! consumer that reconnects by itself ([`DurableQueue`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
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
        let Some(table) = self.properties.headers() else {
            return BTreeMap::new();
        };
        let text = |value: &AMQPValue| match value {
            AMQPValue::LongString(s) => s.to_string(),
            other => format!("<non-string {other:?}>"),
        };
        table
            .inner()
            .iter()
            .map(|(k, v)| (k.to_string(), text(v)))
            .collect()
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

async fn connect() -> lapin::Result<Connection> {
    Connection::connect(AMQP_URL, ConnectionProperties::default()).await
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

/// Publishes a barrier marker to `exchange` with routing key `key` on `channel`, then waits up
/// to `timeout` until the consumer has put it in `seen`: every message the broker had accepted
/// into the queue before it has then been received (`received()` counts them, for the panic).
async fn pass_barrier(
    channel: &Channel,
    exchange: &str,
    key: &str,
    seen: &Mutex<HashSet<String>>,
    timeout: Duration,
    received: impl Fn() -> usize,
) {
    let id = format!("{BARRIER_PREFIX}{}", hex8());
    let properties = BasicProperties::default().with_message_id(id.as_str().into());
    let options = BasicPublishOptions::default();
    channel
        .basic_publish(exchange.into(), key.into(), options, b"barrier", properties)
        .await
        .expect("publish barrier");
    wait_until(timeout, "the barrier message arrives", async || {
        if seen.lock().unwrap().contains(&id) {
            Ok(())
        } else {
            Err(format!("{} received so far", received()))
        }
    })
    .await;
}

/// The message id prefix of [`RabbitFixture::barrier`] and [`DurableQueue::barrier`] markers.
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
        let conn = connect()
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
                let Ok(d) = delivery.inspect_err(|e| eprintln!("test consumer stopped: {e}"))
                else {
                    return;
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

    /// Deletes the exchange (its bindings go with it), as an operator might by mistake.
    pub async fn delete_exchange(&self) {
        self.channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("delete {}: {e}", self.exchange));
    }

    /// Declares the exchange again (durable topic) and binds the queue to it with `binding`.
    pub async fn restore_exchange(&self, binding: &str) {
        self.channel
            .exchange_declare(
                self.exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("declare {}: {e}", self.exchange));
        self.bind(binding).await;
    }

    /// Messages received so far (barriers excluded).
    pub fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    /// The first arrivals of `of` (ids), in arrival order.
    pub fn arrival_order(&self, of: &[Uuid]) -> Vec<Uuid> {
        let mut seen = std::collections::HashSet::new();
        let ids = self
            .deliveries()
            .into_iter()
            .filter_map(|d| d.message_id.parse().ok());
        ids.filter(|id| of.contains(id) && seen.insert(*id))
            .collect()
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

    /// The deliveries so far checked against `expected` (see [`crate::analyse`]).
    pub fn analyse(&self, expected: &[crate::RowState]) -> crate::Analysis {
        let deliveries = self.deliveries();
        crate::analyse(expected, deliveries.iter().map(|d| d.message_id.as_str()))
    }

    /// Publishes a marker to the exchange and waits for it: every message the broker had
    /// accepted into the queue before this call has then been received.
    pub async fn barrier(&self) {
        pass_barrier(
            &self.channel,
            &self.exchange,
            &self.barrier_key,
            &self.barriers,
            Duration::from_secs(30),
            || self.count(),
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

/// A durable exchange and a durable, non-exclusive queue (both survive a broker restart) with a
/// consumer that reconnects by itself and acknowledges each message after recording it.
pub struct DurableQueue {
    /// The durable exchange the relay publishes to.
    pub exchange: String,
    /// The durable queue bound to it with `#`.
    pub queue: String,
    /// (message id, redelivered flag) in arrival order.
    received: Arc<Mutex<Vec<(String, bool)>>>,
    barriers: Arc<Mutex<HashSet<String>>>,
    /// Connections the consumer made so far (it reconnects after a broker restart).
    pub connects: Arc<AtomicUsize>,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Drop for DurableQueue {
    /// After a failure (no `teardown`): the durable queue would outlive the test with every
    /// message the relay published meanwhile.
    fn drop(&mut self) {
        if self.task.is_some() {
            self.stop.cancel();
            let _ = std::process::Command::new("rabbitmqctl")
                .args(["delete_queue", &self.queue])
                .output();
        }
    }
}

impl DurableQueue {
    /// Declares `it.<test>.<hex>` and its queue and starts the consumer.
    pub async fn new(test: &str) -> Self {
        let tag = format!("{test}.{}", hex8());
        let (exchange, queue) = (format!("it.{tag}"), format!("it.{tag}.q"));
        let conn = connect().await.expect("connect to RabbitMQ");
        let ch = conn.create_channel().await.unwrap();
        declare_bound_queue(&ch, &exchange, &queue, Durability::Durable, "#")
            .await
            .unwrap();
        let _ = conn.close(200, "declared".into()).await;

        let received = Arc::new(Mutex::new(Vec::new()));
        let barriers = Arc::new(Mutex::new(HashSet::new()));
        let connects = Arc::new(AtomicUsize::new(0));
        let stop = CancellationToken::new();
        let task = tokio::spawn(Self::consume(
            queue.clone(),
            Arc::clone(&received),
            Arc::clone(&barriers),
            Arc::clone(&connects),
            stop.clone(),
        ));
        Self {
            exchange,
            queue,
            received,
            barriers,
            connects,
            stop,
            task: Some(task),
        }
    }

    async fn consume(
        queue: String,
        received: Arc<Mutex<Vec<(String, bool)>>>,
        barriers: Arc<Mutex<HashSet<String>>>,
        connects: Arc<AtomicUsize>,
        stop: CancellationToken,
    ) {
        let mut last_error = String::new();
        while !stop.is_cancelled() {
            let session = async {
                // Bounded: a broker in the middle of start_app may accept and not answer.
                let setup = async {
                    let conn = connect().await?;
                    let ch = conn.create_channel().await?;
                    ch.basic_qos(500, BasicQosOptions::default()).await?;
                    let consumer = ch
                        .basic_consume(
                            queue.as_str().into(),
                            format!("fault-consumer-{}", hex8()).into(),
                            BasicConsumeOptions::default(),
                            FieldTable::default(),
                        )
                        .await?;
                    Ok::<_, lapin::Error>((conn, ch, consumer))
                };
                let (conn, ch, mut consumer) = tokio::time::timeout(Duration::from_secs(10), setup)
                    .await
                    .map_err(|_| "connecting timed out".to_owned())?
                    .map_err(|e| e.to_string())?;
                connects.fetch_add(1, Ordering::SeqCst);
                // lapin's consumer stream does not always end when the connection dies (seen
                // after a reset during stop_app): watch the connection as well.
                let mut watch = tokio::time::interval(Duration::from_millis(250));
                loop {
                    let next = tokio::select! {
                        n = consumer.next() => n,
                        _ = watch.tick() => {
                            if conn.status().connected() && ch.status().connected() {
                                continue;
                            }
                            return Err("connection lost".to_owned());
                        }
                        () = stop.cancelled() => return Ok::<(), String>(()),
                    };
                    let d = match next {
                        Some(Ok(d)) => d,
                        Some(Err(e)) => return Err(e.to_string()),
                        None => return Err("consumer ended".to_owned()),
                    };
                    let id = message_id(&d.properties);
                    if id.starts_with(BARRIER_PREFIX) {
                        barriers.lock().unwrap().insert(id);
                    } else {
                        received.lock().unwrap().push((id, d.redelivered));
                    }
                    // An ack lost in a restart means a redelivery (flagged), not a loss. On a
                    // dead connection the ack may never complete: bounded.
                    match tokio::time::timeout(
                        Duration::from_secs(2),
                        d.ack(BasicAckOptions::default()),
                    )
                    .await
                    {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return Err(format!("ack failed: {e}")),
                        Err(_) => return Err("ack timed out".to_owned()),
                    }
                }
            }
            .await;
            if let Err(e) = session
                && e != last_error
            {
                eprintln!("durable consumer: {e}; reconnecting");
                last_error = e;
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(250)) => {}
                () = stop.cancelled() => {}
            }
        }
    }

    /// Message ids received, in arrival order (redeliveries included).
    pub fn ids(&self) -> Vec<String> {
        self.received
            .lock()
            .unwrap()
            .iter()
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Duplicate copies split by cause: (flagged `redelivered` — the broker delivering again
    /// what the consumer had not acknowledged, the consumer's side of a restart; not flagged —
    /// the relay published the message twice).
    pub fn duplicate_causes(&self) -> (usize, usize) {
        let mut seen = HashSet::new();
        let (mut broker, mut relay) = (0, 0);
        for (id, redelivered) in self.received.lock().unwrap().iter() {
            if !seen.insert(id.clone()) {
                if *redelivered {
                    broker += 1;
                } else {
                    relay += 1;
                }
            }
        }
        (broker, relay)
    }

    /// Publishes a marker and waits for it: everything queued before it has been received.
    pub async fn barrier(&self) {
        let conn = connect().await.expect("barrier connection");
        let ch = conn.create_channel().await.unwrap();
        pass_barrier(
            &ch,
            &self.exchange,
            "it.barrier",
            &self.barriers,
            Duration::from_secs(60),
            || self.received.lock().unwrap().len(),
        )
        .await;
        let _ = conn.close(200, "barrier".into()).await;
    }

    /// Waits until every id in `ids` was received at least once.
    pub async fn wait_for(&self, ids: &[Uuid], timeout: Duration) {
        let what = "every row arrives on the durable queue";
        wait_for_all_ids(timeout, what, ids, || self.ids().into_iter().collect()).await;
    }

    /// Stops the consumer and deletes the queue and the exchange.
    pub async fn teardown(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        if let Ok(conn) = connect().await {
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch
                    .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
                let _ = ch
                    .exchange_delete(
                        self.exchange.as_str().into(),
                        ExchangeDeleteOptions::default(),
                    )
                    .await;
            }
            let _ = conn.close(200, "test done".into()).await;
        }
    }
}
