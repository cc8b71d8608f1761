//! Harness shared by the integration tests: a fresh outbox table per test, a RabbitMQ exchange
//! and queue with a collecting consumer, the real binary as a child process configured only by
//! `RELAY_*` variables, a TCP proxy that can cut or stall the relay's broker connection, and a
//! polling `wait_until`.
//!
//! Every fixture gets a unique name (`it_<test>_<hex>`, `it.<test>.<hex>`) so tests run in
//! parallel without seeing each other's rows or messages.

// Each test crate compiles this module on its own and uses only part of it.
#![allow(dead_code)]

pub mod kafka;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox_relay::config::RawConfig;
use outbox_relay::store::Store;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, GenericClient, NoTls};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The test database (trust auth).
pub const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// The test broker.
pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The broker's TCP address, for the proxy.
pub const RABBIT_ADDR: &str = "127.0.0.1:5672";
/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// Eight random hex digits.
pub fn hex8() -> String {
    Uuid::new_v4().simple().to_string()[..8].to_owned()
}

/// `name` lower-cased, every character but `[a-z0-9]` replaced by `_`, at most `max` bytes.
fn slug(name: &str, max: usize) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(max)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Waiting

/// Polls `check` every 20 ms until it returns `Ok`, and returns that value. After `timeout` it
/// panics naming `what` and the last observation (the `Err` text), so a failure says how far
/// things got.
pub async fn wait_until<T>(
    timeout: Duration,
    what: &str,
    mut check: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    let start = Instant::now();
    loop {
        let last = match check().await {
            Ok(v) => return v,
            Err(e) => e,
        };
        if start.elapsed() >= timeout {
            panic!("timed out after {timeout:?} waiting until {what}; last observation: {last}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Inserts `per_writer` rows from each of `writers` concurrent connections, `per_tx` rows per
/// transaction in two statements with a short pause between them (so transactions overlap and
/// can commit out of `seq` order). `make(writer, n)` builds the `n`th row overall.
pub async fn concurrent_writers(
    table: &str,
    writers: usize,
    per_writer: usize,
    per_tx: usize,
    pause: Duration,
    make: fn(usize, usize) -> NewRow,
) -> Vec<Inserted> {
    assert_eq!(per_writer % per_tx, 0);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let table = table.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut client = pg_connect().await;
            let mut out = Vec::with_capacity(per_writer);
            for t in 0..per_writer / per_tx {
                let rows: Vec<NewRow> = (0..per_tx)
                    .map(|i| make(w, w * per_writer + t * per_tx + i))
                    .collect();
                let tx = client.transaction().await.unwrap();
                let (first, second) = rows.split_at(per_tx / 2);
                out.extend(insert_rows(&tx, &table, first).await);
                tokio::time::sleep(pause).await;
                out.extend(insert_rows(&tx, &table, second).await);
                tx.commit().await.unwrap();
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// Inserts `rounds` batches of `batch` rows (`make(round, i)` builds each), `every` apart, into
/// `table` in the background, so rows keep coming before, during and after a fault; returns
/// the inserted ids in insert order.
pub fn spawn_paced_writer(
    table: &str,
    rounds: usize,
    batch: usize,
    every: Duration,
    make: impl Fn(usize, usize) -> NewRow + Send + 'static,
) -> JoinHandle<Vec<Uuid>> {
    let table = table.to_owned();
    tokio::spawn(async move {
        let client = pg_connect().await;
        let mut ids = Vec::new();
        for round in 0..rounds {
            let rows: Vec<NewRow> = (0..batch).map(|i| make(round, i)).collect();
            ids.extend(
                insert_rows(&client, &table, &rows)
                    .await
                    .into_iter()
                    .map(|r| r.id),
            );
            tokio::time::sleep(every).await;
        }
        ids
    })
}

/// Waits until `count()` (messages received, records read) reaches `min`; panics after
/// `timeout`, naming `what` and the last count.
pub async fn wait_for_count(timeout: Duration, what: &str, min: usize, count: impl Fn() -> usize) {
    wait_until(timeout, what, async || {
        let n = count();
        if n >= min {
            Ok(())
        } else {
            Err(format!("{n} so far"))
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL

/// A plain connection to the test database (its driver task runs in the background).
pub async fn pg_connect() -> Client {
    let (client, conn) = tokio_postgres::connect(PG_URL, NoTls)
        .await
        .unwrap_or_else(|e| {
            let detail = e
                .as_db_error()
                .map(|d| d.message().to_owned())
                .unwrap_or_default();
            panic!("cannot connect to {PG_URL}: {e} {detail}")
        });
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            eprintln!("test database connection ended: {e}");
        }
    });
    client
}

/// A row to insert, as an application would.
#[derive(Debug, Clone)]
pub struct NewRow {
    /// `aggregate_type`
    pub aggregate_type: String,
    /// `aggregate_id` (NULL when `None`)
    pub aggregate_id: Option<String>,
    /// `event_type`
    pub event_type: String,
    /// `payload` (jsonb)
    pub payload: Value,
    /// `headers` (jsonb)
    pub headers: Value,
    /// `destination` (routing key override)
    pub destination: Option<String>,
}

impl NewRow {
    /// A row with empty headers and no destination.
    pub fn new(
        aggregate_type: &str,
        aggregate_id: Option<&str>,
        event_type: &str,
        payload: Value,
    ) -> Self {
        Self {
            aggregate_type: aggregate_type.to_owned(),
            aggregate_id: aggregate_id.map(str::to_owned),
            event_type: event_type.to_owned(),
            payload,
            headers: Value::Object(serde_json::Map::new()),
            destination: None,
        }
    }

    /// Sets the row's `headers`.
    pub fn headers(mut self, headers: Value) -> Self {
        self.headers = headers;
        self
    }

    /// Sets the row's `destination`.
    pub fn destination(mut self, destination: &str) -> Self {
        self.destination = Some(destination.to_owned());
        self
    }
}

/// What the database assigned to an inserted row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Inserted {
    /// Row id (= AMQP `message_id`).
    pub id: Uuid,
    /// Insert order.
    pub seq: i64,
}

/// Inserts `rows` into `table` with one statement (so inside `client`'s transaction, if any).
pub async fn insert_rows<C: GenericClient + Sync>(
    client: &C,
    table: &str,
    rows: &[NewRow],
) -> Vec<Inserted> {
    let sql = format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, headers, destination) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::jsonb[], $6::text[]) \
         RETURNING id, seq"
    );
    let types: Vec<&str> = rows.iter().map(|r| r.aggregate_type.as_str()).collect();
    let ids: Vec<Option<&str>> = rows.iter().map(|r| r.aggregate_id.as_deref()).collect();
    let events: Vec<&str> = rows.iter().map(|r| r.event_type.as_str()).collect();
    let payloads: Vec<&Value> = rows.iter().map(|r| &r.payload).collect();
    let headers: Vec<&Value> = rows.iter().map(|r| &r.headers).collect();
    let destinations: Vec<Option<&str>> = rows.iter().map(|r| r.destination.as_deref()).collect();
    let out = client
        .query(
            &sql,
            &[&types, &ids, &events, &payloads, &headers, &destinations],
        )
        .await
        .unwrap_or_else(|e| panic!("insert into {table}: {e}"));
    assert_eq!(
        out.len(),
        rows.len(),
        "insert into {table} returned fewer rows"
    );
    out.iter()
        .map(|r| Inserted {
            id: r.get(0),
            seq: r.get(1),
        })
        .collect()
}

/// One outbox row as the database holds it.
#[derive(Debug, Clone)]
pub struct RowState {
    /// `id`
    pub id: Uuid,
    /// `seq`
    pub seq: i64,
    /// `aggregate_type`
    pub aggregate_type: String,
    /// `aggregate_id`
    pub aggregate_id: Option<String>,
    /// `event_type`
    pub event_type: String,
    /// `payload`
    pub payload: Value,
    /// `headers`
    pub headers: Value,
    /// `destination`
    pub destination: Option<String>,
    /// `status`
    pub status: String,
    /// `attempts`
    pub attempts: i32,
    /// `available_at`
    pub available_at: DateTime<Utc>,
    /// `locked_at`
    pub locked_at: Option<DateTime<Utc>>,
    /// `locked_by`
    pub locked_by: Option<String>,
    /// `last_error`
    pub last_error: Option<String>,
    /// `created_at`
    pub created_at: DateTime<Utc>,
    /// `sent_at`
    pub sent_at: Option<DateTime<Utc>>,
}

const ROW_COLUMNS: &str = "id, seq, aggregate_type, aggregate_id, event_type, payload, headers, destination, \
                           status, attempts, available_at, locked_at, locked_by, last_error, created_at, sent_at";

fn row_state(r: &tokio_postgres::Row) -> RowState {
    RowState {
        id: r.get(0),
        seq: r.get(1),
        aggregate_type: r.get(2),
        aggregate_id: r.get(3),
        event_type: r.get(4),
        payload: r.get(5),
        headers: r.get(6),
        destination: r.get(7),
        status: r.get(8),
        attempts: r.get(9),
        available_at: r.get(10),
        locked_at: r.get(11),
        locked_by: r.get(12),
        last_error: r.get(13),
        created_at: r.get(14),
        sent_at: r.get(15),
    }
}

static GC_DONE: AtomicBool = AtomicBool::new(false);

/// Drops the tables of test runs that ended more than an hour ago without cleaning up (a failed
/// test leaves its table for inspection). Runs once per test process.
async fn collect_old_tables(db: &Client) {
    let old = db
        .query(
            "SELECT table_name FROM outbox_relay_schema_version \
             WHERE table_name LIKE 'it\\_%' AND applied_at < now() - interval '1 hour'",
            &[],
        )
        .await
        .map(|rows| {
            rows.iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    for name in old {
        // Only names this harness makes: it_<slug>_<hex>, nothing to quote.
        if name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            let _ = db.batch_execute(&drop_table_sql(&name)).await;
        }
    }
}

fn drop_table_sql(n: &str) -> String {
    format!(
        "DROP TABLE IF EXISTS {n} CASCADE; \
         DROP FUNCTION IF EXISTS {n}_next_seq(); \
         DROP FUNCTION IF EXISTS {n}_notify(); \
         DELETE FROM outbox_relay_schema_version WHERE table_name = '{n}';"
    )
}

/// A fresh outbox table (created by the library's own migration) plus a client for
/// inserting rows and asserting on them.
pub struct TestTable {
    /// Unqualified table name, `it_<test>_<hex>` in schema `public`.
    pub name: String,
    /// Assertion and insert client.
    pub db: Client,
}

impl TestTable {
    /// Creates the table with `Store::migrate()`, configured through `RawConfig` as `run` would be.
    pub async fn new(test: &str) -> Self {
        let name = format!("it_{}_{}", slug(test, 24), hex8());
        let mut raw = RawConfig::default();
        raw.database.url = PG_URL.to_owned();
        raw.database.table = name.clone();
        raw.metrics.listen = String::new();
        raw.relay.instance_id = Some("it-harness".to_owned());
        let config = raw
            .validate()
            .unwrap_or_else(|e| panic!("harness config for {name} is invalid: {e}"));
        let store =
            Store::new(&config.database, &config.relay.instance_id).expect("connection pool");
        let applied = store
            .migrate()
            .await
            .unwrap_or_else(|e| panic!("migrating {name}: {e}"));
        let all: Vec<i32> = outbox_relay::store::schema::MIGRATIONS
            .iter()
            .map(|m| m.version)
            .collect();
        assert_eq!(applied, all, "a fresh table gets every migration");
        let db = pg_connect().await;
        if !GC_DONE.swap(true, Ordering::SeqCst) {
            collect_old_tables(&db).await;
        }
        Self { name, db }
    }

    /// The CloudEvents `source` the relay uses by default for this table.
    pub fn default_source(&self) -> String {
        format!("/outbox/test/{}", self.name)
    }

    /// Inserts `rows` in one autocommitted statement.
    pub async fn insert(&self, rows: &[NewRow]) -> Vec<Inserted> {
        insert_rows(&self.db, &self.name, rows).await
    }

    /// Every row, in `seq` order.
    pub async fn rows(&self) -> Vec<RowState> {
        let sql = format!("SELECT {ROW_COLUMNS} FROM {} ORDER BY seq", self.name);
        self.db
            .query(&sql, &[])
            .await
            .expect("select rows")
            .iter()
            .map(row_state)
            .collect()
    }

    /// One row by id.
    pub async fn row(&self, id: Uuid) -> RowState {
        let sql = format!("SELECT {ROW_COLUMNS} FROM {} WHERE id = $1", self.name);
        row_state(&self.db.query_one(&sql, &[&id]).await.expect("select row"))
    }

    /// Rows matching `ids`, keyed by id.
    pub async fn rows_by_id(&self, ids: &[Uuid]) -> HashMap<Uuid, RowState> {
        let sql = format!("SELECT {ROW_COLUMNS} FROM {} WHERE id = ANY($1)", self.name);
        self.db
            .query(&sql, &[&ids])
            .await
            .expect("select rows by id")
            .iter()
            .map(|r| {
                let s = row_state(r);
                (s.id, s)
            })
            .collect()
    }

    /// The database's clock (the one `sent_at` and `locked_at` are written with).
    pub async fn db_now(&self) -> DateTime<Utc> {
        self.db
            .query_one("SELECT clock_timestamp()", &[])
            .await
            .expect("clock_timestamp")
            .get(0)
    }

    /// `SELECT count(*) FROM <table> WHERE <condition>` (the condition is test-authored SQL).
    pub async fn count_where(&self, condition: &str) -> i64 {
        let sql = format!("SELECT count(*) FROM {} WHERE {condition}", self.name);
        self.db.query_one(&sql, &[]).await.expect("count").get(0)
    }

    /// Row counts by status (absent statuses are 0).
    pub async fn status_counts(&self) -> BTreeMap<String, i64> {
        let sql = format!("SELECT status, count(*) FROM {} GROUP BY status", self.name);
        let mut out: BTreeMap<String, i64> = ["pending", "processing", "sent", "failed"]
            .iter()
            .map(|s| ((*s).to_owned(), 0))
            .collect();
        for r in self.db.query(&sql, &[]).await.expect("status counts") {
            out.insert(r.get(0), r.get(1));
        }
        out
    }

    /// Waits until every row is `sent` (progress in the panic message otherwise).
    pub async fn wait_all_sent(&self, timeout: Duration) {
        wait_until(
            timeout,
            &format!("every row of {} is sent", self.name),
            async || {
                let counts = self.status_counts().await;
                let unsent: i64 = counts
                    .iter()
                    .filter(|(k, _)| *k != "sent")
                    .map(|(_, v)| v)
                    .sum();
                if unsent == 0 {
                    Ok(())
                } else {
                    Err(format!("{counts:?}"))
                }
            },
        )
        .await;
    }

    /// Drops the table and the objects the migration created for it.
    pub async fn drop_table(self) {
        self.db
            .batch_execute(&drop_table_sql(&self.name))
            .await
            .expect("drop test table");
    }
}

// ---------------------------------------------------------------------------------------------
// RabbitMQ

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
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare exchange");
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare queue");
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                binding.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind queue");
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
                let message_id = d
                    .properties
                    .message_id()
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default();
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
        wait_until(
            timeout,
            &format!("{} messages arrive on {}", ids.len(), self.queue),
            async || {
                let seen = self.id_counts();
                let missing = ids
                    .iter()
                    .filter(|id| !seen.contains_key(&id.to_string()))
                    .count();
                if missing == 0 {
                    Ok(())
                } else {
                    Err(format!(
                        "{missing} of {} not yet received ({} deliveries)",
                        ids.len(),
                        self.count()
                    ))
                }
            },
        )
        .await;
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

// ---------------------------------------------------------------------------------------------
// The binary

/// A directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `outbox-relay-it-<label>-<hex>`.
    pub fn new(label: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("outbox-relay-it-{}-{}", slug(label, 30), hex8()));
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Writes `contents` to `name` inside the directory and returns its path.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, contents).expect("write temp file");
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The environment variable for a dotted config key: `publisher.rabbitmq.url` →
/// `RELAY_PUBLISHER__RABBITMQ__URL`.
pub fn env_key(key: &str) -> String {
    format!("RELAY_{}", key.to_ascii_uppercase().replace('.', "__"))
}

/// How to start the binary: configuration by environment only, run from an empty temp dir
/// (so no `relay.toml` is picked up), with an otherwise empty environment.
pub struct RelayBuilder {
    label: String,
    env: BTreeMap<String, String>,
}

/// The captured result of a short command (`check`, a failing `run`).
#[derive(Debug)]
pub struct CmdOutput {
    /// Exit status.
    pub status: ExitStatus,
    /// Everything printed on stdout.
    pub stdout: String,
    /// Everything printed on stderr.
    pub stderr: String,
}

impl RelayBuilder {
    /// No configuration at all besides plain logs.
    pub fn bare(label: &str) -> Self {
        let mut env = BTreeMap::new();
        env.insert("NO_COLOR".to_owned(), "1".to_owned());
        for pass in ["RUST_LOG", "RUST_BACKTRACE"] {
            if let Ok(v) = std::env::var(pass) {
                env.insert(pass.to_owned(), v);
            }
        }
        Self {
            label: label.to_owned(),
            env,
        }
    }

    /// Configured for `table` and `rabbit`, instance id `instance`, metrics server disabled.
    pub fn for_test(table: &TestTable, rabbit: &RabbitFixture, instance: &str) -> Self {
        Self::bare(instance)
            .set("database.url", PG_URL)
            .set("database.table", &table.name)
            .set("database.auto_migrate", "false")
            .set("publisher.rabbitmq.url", AMQP_URL)
            .set("publisher.rabbitmq.exchange", &rabbit.exchange)
            .set("metrics.listen", "")
            .set("relay.instance_id", instance)
    }

    /// Sets a raw environment variable (e.g. `RUST_LOG`).
    pub fn env(mut self, name: &str, value: impl Into<String>) -> Self {
        self.env.insert(name.to_owned(), value.into());
        self
    }

    /// Sets a config key (dotted, e.g. `relay.ordering`) through its `RELAY_*` variable.
    pub fn set(mut self, key: &str, value: impl Into<String>) -> Self {
        self.env.insert(env_key(key), value.into());
        self
    }

    fn command(&self, dir: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .current_dir(dir)
            .env_clear()
            .envs(&self.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd
    }

    /// Starts `outbox-relay run`.
    pub fn spawn(self) -> RelayProcess {
        self.spawn_with(&["run"])
    }

    /// Starts the binary with `args`, capturing its output line by line.
    pub fn spawn_with(self, args: &[&str]) -> RelayProcess {
        let dir = TempDir::new(&self.label);
        let mut child = self
            .command(dir.path(), args)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {BIN}: {e}"));
        let pid = child.id().expect("child pid");
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let readers = vec![
            spawn_reader(
                child.stdout.take().expect("stdout"),
                Arc::clone(&stdout),
                format!("{} out", self.label),
            ),
            spawn_reader(
                child.stderr.take().expect("stderr"),
                Arc::clone(&stderr),
                format!("{} err", self.label),
            ),
        ];
        RelayProcess {
            label: self.label,
            child,
            pid,
            stdout,
            stderr,
            readers,
            _dir: dir,
        }
    }

    /// Runs the binary with `args` to completion (killed and reported after `timeout`).
    pub async fn output(self, args: &[&str], timeout: Duration) -> CmdOutput {
        let mut p = self.spawn_with(args);
        let status = p.wait_exit(timeout).await;
        CmdOutput {
            status,
            stdout: p.stdout(),
            stderr: p.stderr(),
        }
    }
}

fn spawn_reader<R>(r: R, sink: Arc<Mutex<Vec<String>>>, label: String) -> JoinHandle<()>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut lines = BufReader::new(r).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            // Captured by the test harness: shown only when the test fails.
            eprintln!("[{label}] {line}");
            sink.lock().unwrap().push(line);
        }
    })
}

/// A running `outbox-relay` child process (killed when dropped).
pub struct RelayProcess {
    /// Label used in captured output (the instance id for relays).
    pub label: String,
    child: Child,
    pid: u32,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<Vec<String>>>,
    readers: Vec<JoinHandle<()>>,
    _dir: TempDir,
}

impl RelayProcess {
    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Everything printed on stderr so far (the logs).
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// Everything printed on stdout so far.
    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().join("\n")
    }

    /// Log lines containing `needle`.
    pub fn log_count(&self, needle: &str) -> usize {
        self.stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Waits until at least `n` log lines contain `needle`.
    pub async fn wait_for_log(&self, needle: &str, n: usize, timeout: Duration) {
        wait_until(
            timeout,
            &format!("relay {} logs {needle:?} {n} time(s)", self.label),
            async || {
                let c = self.log_count(needle);
                if c >= n {
                    Ok(())
                } else {
                    Err(format!("seen {c} time(s)"))
                }
            },
        )
        .await;
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// Sends SIGTERM (with the `kill` command: the crate forbids unsafe code and has no `nix`).
    pub fn sigterm(&self) {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {} failed: {status}", self.pid);
    }

    /// Sends SIGKILL.
    pub fn sigkill(&mut self) {
        self.child.start_kill().expect("SIGKILL");
    }

    /// Waits for the process to exit and for its output to be fully read; on timeout kills it
    /// and panics with its logs.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let status = match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => status.expect("wait for child"),
            Err(_) => {
                let _ = self.child.start_kill();
                panic!(
                    "{} did not exit within {timeout:?}\n--- stderr ---\n{}",
                    self.label,
                    self.stderr()
                );
            }
        };
        for r in self.readers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(5), r).await;
        }
        status
    }

    /// SIGTERM, then asserts a clean exit (status 0) within 20 s.
    pub async fn stop(mut self) {
        self.sigterm();
        let status = self.wait_exit(Duration::from_secs(20)).await;
        assert!(
            status.success(),
            "{} exited with {status} after SIGTERM\n--- stderr ---\n{}",
            self.label,
            self.stderr()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// TCP proxy

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Forward,
    Stall,
    Cut,
}

struct ProxyShared {
    upstream: String,
    mode: watch::Sender<Mode>,
    // Cancelled by `cut()`: ends every connection opened before it.
    live: Mutex<CancellationToken>,
    accepted: AtomicUsize,
}

/// A TCP proxy on 127.0.0.1 in front of `upstream` that the test controls.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<ProxyShared>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on an ephemeral port and forwards to `upstream`.
    pub async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(ProxyShared {
            upstream: upstream.to_owned(),
            mode: watch::channel(Mode::Forward).0,
            live: Mutex::new(CancellationToken::new()),
            accepted: AtomicUsize::new(0),
        });
        let s = Arc::clone(&shared);
        let accept = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                if *s.mode.borrow() == Mode::Cut {
                    drop(inbound); // refused: closed at once
                    continue;
                }
                s.accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(forward(inbound, Arc::clone(&s)));
            }
        });
        Self {
            addr,
            shared,
            accept,
        }
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// An AMQP URL (guest/guest, vhost `/`) that goes through the proxy.
    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// Drops every live connection (bytes held by a stall are discarded) and closes new ones
    /// as soon as they are accepted, until `heal()`.
    pub fn cut(&self) {
        self.shared.mode.send_replace(Mode::Cut);
        let old = std::mem::replace(
            &mut *self.shared.live.lock().unwrap(),
            CancellationToken::new(),
        );
        old.cancel();
    }

    /// Keeps connections open but forwards nothing in either direction (a black hole: writes
    /// succeed, answers never come) until `heal()` or `cut()`.
    pub fn stall(&self) {
        self.shared.mode.send_replace(Mode::Stall);
    }

    /// Forwards again (new connections; a stalled connection resumes).
    pub fn heal(&self) {
        self.shared.mode.send_replace(Mode::Forward);
    }

    /// Connections accepted and forwarded so far.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.live.lock().unwrap().cancel();
    }
}

async fn forward(inbound: TcpStream, s: Arc<ProxyShared>) {
    let token = s.live.lock().unwrap().clone();
    if *s.mode.borrow() == Mode::Cut || token.is_cancelled() {
        return;
    }
    let outbound = tokio::select! {
        r = TcpStream::connect(&s.upstream) => match r {
            Ok(o) => o,
            Err(e) => {
                eprintln!("proxy: cannot reach {}: {e}", s.upstream);
                return;
            }
        },
        () = token.cancelled() => return,
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (ri, wi) = inbound.into_split();
    let (ro, wo) = outbound.into_split();
    tokio::select! {
        () = pump(ri, wo, s.mode.subscribe()) => {}
        () = pump(ro, wi, s.mode.subscribe()) => {}
        () = token.cancelled() => {}
    }
    // Dropping the halves closes both sockets.
}

async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut mode: watch::Receiver<Mode>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if mode.wait_for(|m| *m == Mode::Forward).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // A stall that began during the read holds these bytes back too.
        if mode.wait_for(|m| *m == Mode::Forward).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
