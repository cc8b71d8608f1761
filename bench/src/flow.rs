//! Commit → consume: a consumer on the broker (RabbitMQ queue or Kafka topic) that reports
//! when each message arrives, and [`Flow`], which pairs every row's commit instant with its
//! receipt as both come in. Matched pairs become latencies at once, so memory holds only the
//! rows still in flight, however long the run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use futures::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::task::AbortOnDropHandle;
use uuid::Uuid;

use crate::util::Relay;

/// One message's journey: when its row committed (seconds after [`Flow`]'s origin) and how
/// long after that the consumer received it.
#[derive(Debug, Clone, Copy)]
pub struct Delivered {
    /// Commit instant, seconds after the origin (0 for commits before it).
    pub committed_s: f32,
    /// Receive − commit, milliseconds (0 when the receipt was seen first: the writer records
    /// its commit instant only once the commit has returned).
    pub latency_ms: f32,
}

impl Delivered {
    /// Receive instant, seconds after the origin.
    pub fn received_s(&self) -> f64 {
        f64::from(self.committed_s) + f64::from(self.latency_ms) / 1000.0
    }
}

struct State {
    origin: Instant,
    committed: HashMap<Uuid, Instant>,
    received: HashMap<Uuid, Instant>,
    delivered: Vec<Delivered>,
}

/// Pairs commits (from the writers) with receipts (from the consumer) by row id.
pub struct Flow {
    state: Mutex<State>,
}

impl Flow {
    /// A matcher whose [`Delivered::committed_s`] counts from now (see [`Flow::restart`]).
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                origin: Instant::now(),
                committed: HashMap::new(),
                received: HashMap::new(),
                delivered: Vec::new(),
            }),
        })
    }

    /// Forgets the messages paired so far (a warm-up's) and counts from `origin` from now on.
    pub fn restart(&self, origin: Instant) {
        let mut s = self.lock();
        s.origin = origin;
        s.delivered.clear();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pair(s: &mut State, committed: Instant, received: Instant) {
        s.delivered.push(Delivered {
            committed_s: committed.saturating_duration_since(s.origin).as_secs_f32(),
            latency_ms: received.saturating_duration_since(committed).as_secs_f32() * 1000.0,
        });
    }

    /// Rows `ids` committed at `at`.
    pub fn committed(&self, ids: &[Uuid], at: Instant) {
        let mut s = self.lock();
        for id in ids {
            match s.received.remove(id) {
                Some(received) => Self::pair(&mut s, at, received),
                None => {
                    s.committed.insert(*id, at);
                }
            }
        }
    }

    /// The message of row `id` arrived at `at`. A second receipt of a row already paired (a
    /// redelivery) stays unpaired: see [`Flow::unpaired_receipts`].
    pub fn received(&self, id: Uuid, at: Instant) {
        let mut s = self.lock();
        match s.committed.remove(&id) {
            Some(committed) => Self::pair(&mut s, committed, at),
            None => {
                s.received.insert(id, at);
            }
        }
    }

    /// Rows committed whose message has not arrived yet.
    pub fn in_flight(&self) -> usize {
        self.lock().committed.len()
    }

    /// Receipts of no known commit (redeliveries, or rows the writers did not record).
    pub fn unpaired_receipts(&self) -> usize {
        self.lock().received.len()
    }

    /// Takes the messages paired so far.
    pub fn take_delivered(&self) -> Vec<Delivered> {
        std::mem::take(&mut self.lock().delivered)
    }

    /// Reports the warm-up rows `ids` committed now, then waits (30 s at most) until their
    /// messages arrive: the relay is connected and the consumer subscribed.
    pub async fn warm_up(&self, ids: &[Uuid], relay: &mut Relay) -> Result<()> {
        self.committed(ids, Instant::now());
        let left = self
            .wait_delivered(Duration::from_secs(30), || relay.check_alive())
            .await?;
        if left > 0 {
            bail!(
                "the warm-up message did not arrive within 30 s; relay log:\n{}",
                relay.tail(20)
            );
        }
        self.restart(Instant::now());
        Ok(())
    }

    /// Waits until no committed row is in flight, or `timeout`; `alive` is checked every
    /// 20 ms and ends the wait with its error. Returns the rows still in flight.
    pub async fn wait_delivered(
        &self,
        timeout: Duration,
        mut alive: impl FnMut() -> Result<()>,
    ) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = self.in_flight();
            if left == 0 || Instant::now() > deadline {
                return Ok(left);
            }
            alive()?;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Tells a consumer thread to end when dropped (also when a run fails half-way).
pub struct StopFlag(Arc<AtomicBool>);

impl Drop for StopFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A consumer feeding a [`Flow`]; [`Consumer::stop`] ends it, and so does dropping it.
pub enum Consumer {
    /// A lapin consumer (no ack) on a queue.
    Rabbit {
        /// Its own connection.
        conn: Connection,
        /// The task reading deliveries.
        task: AbortOnDropHandle<()>,
    },
    /// An rdkafka consumer on a thread, every partition assigned from the beginning.
    Kafka {
        /// Ends the thread.
        stop: StopFlag,
        /// The polling thread.
        thread: std::thread::JoinHandle<()>,
    },
}

impl Consumer {
    /// Consumes queue `queue` (no ack), reporting each delivery's `message_id` (the row id).
    pub async fn rabbitmq(url: &str, queue: &str, flow: Arc<Flow>) -> Result<Self> {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .context("cannot connect to RabbitMQ")?;
        let ch = conn.create_channel().await?;
        let mut deliveries = ch
            .basic_consume(
                queue.into(),
                "outbox-bench".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        let task = AbortOnDropHandle::new(tokio::spawn(async move {
            while let Some(Ok(d)) = deliveries.next().await {
                let at = Instant::now();
                let id = outbox_testkit::message_id(&d.properties);
                if let Ok(id) = Uuid::parse_str(&id) {
                    flow.received(id, at);
                }
            }
        }));
        Ok(Self::Rabbit { conn, task })
    }

    /// Reads every partition of `topic` (`partitions` of them) from the beginning, reporting
    /// each record's `ce_id` header (the row id).
    pub fn kafka(brokers: &str, topic: &str, partitions: i32, flow: Arc<Flow>) -> Result<Self> {
        let consumer: BaseConsumer = outbox_testkit::kafka::consumer_config(brokers)
            .create()
            .context("cannot create the Kafka consumer")?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(topic, p, Offset::Beginning)?;
        }
        consumer.assign(&tpl)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("bench-kafka-consumer".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) else {
                        continue;
                    };
                    let at = Instant::now();
                    let id = m.headers().and_then(|h| {
                        h.iter()
                            .find(|h| h.key == "ce_id")
                            .and_then(|h| h.value)
                            .and_then(|v| Uuid::try_parse_ascii(v).ok())
                    });
                    if let Some(id) = id {
                        flow.received(id, at);
                    }
                }
            })
            .map_err(|e| anyhow!("cannot start the Kafka consumer thread: {e}"))?;
        Ok(Self::Kafka {
            stop: StopFlag(stop),
            thread,
        })
    }

    /// Stops consuming.
    pub async fn stop(self) {
        match self {
            Self::Rabbit { conn, task } => {
                drop(task);
                let _ = conn.close(200, "done".into()).await;
            }
            Self::Kafka { stop, thread } => {
                drop(stop);
                let _ = tokio::task::spawn_blocking(move || thread.join()).await;
            }
        }
    }
}
