//! PostgreSQL: connections, a fresh outbox table per test, rows as an application inserts them,
//! and writers that keep inserting while a test does something else.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, GenericClient, NoTls};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::{PG_URL, RelayBuilder, hex8, slug, wait_until};

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
            let inserted = insert_rows(&client, &table, &rows).await;
            ids.extend(inserted.iter().map(|r| r.id));
            tokio::time::sleep(every).await;
        }
        ids
    })
}

/// Inserts `batch` rows spread over `aggregates` aggregates (`<tag>-<n>`) every 30 ms until the
/// returned token is cancelled, and survives a database restart (reconnects; a batch whose
/// commit is in doubt may or may not be in the table — check the table, not this count). The
/// task returns the rows known inserted.
pub fn spawn_steady_writer(
    table: &str,
    tag: &str,
    aggregates: usize,
    batch: usize,
) -> (CancellationToken, JoinHandle<usize>) {
    spawn_steady_writer_at(PG_URL, table, tag, aggregates, batch)
}

/// [`spawn_steady_writer`] on the database at `url` (a failover pair's multi-host URL, say:
/// each reconnect finds the server that takes writes now).
pub fn spawn_steady_writer_at(
    url: &str,
    table: &str,
    tag: &str,
    aggregates: usize,
    batch: usize,
) -> (CancellationToken, JoinHandle<usize>) {
    let (table, tag, stop) = (table.to_owned(), tag.to_owned(), CancellationToken::new());
    let url = url.to_owned();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        let (mut client, mut n, mut inserted) = (None::<Client>, 0, 0);
        while !stop.is_cancelled() {
            let Some(c) = client.as_ref() else {
                match try_pg_connect(&url, "outbox-testkit-writer").await {
                    Ok(c) => client = Some(c),
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
                continue;
            };
            let rows: Vec<NewRow> = (n..n + batch)
                .map(|i| {
                    let aggregate = format!("{tag}-{}", i % aggregates);
                    NewRow::new(&tag, Some(&aggregate), "tick", json!({ "n": i }))
                })
                .collect();
            if let Err(e) = try_insert_rows(c, &table, &rows).await {
                eprintln!("writer: insert failed ({e}); reconnecting");
                client = None;
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            (inserted, n) = (inserted + batch, n + batch);
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(30)) => {}
                () = stop.cancelled() => {}
            }
        }
        inserted
    });
    (token, task)
}

/// A plain connection to the test database (its driver task runs in the background).
pub async fn pg_connect() -> Client {
    try_pg_connect(PG_URL, "outbox-testkit")
        .await
        .unwrap_or_else(|e| {
            let detail = e
                .as_db_error()
                .map(|d| d.message().to_owned())
                .unwrap_or_default();
            panic!("cannot connect to {PG_URL}: {e} {detail}")
        })
}

/// A plain connection (not pooled, 5 s connect timeout) to `url` as `application_name`, its
/// driver task running in the background. The name must not start with `outbox-relay`: the
/// ordering guard ignores the relay's own sessions, and these are "applications".
pub async fn try_pg_connect(
    url: &str,
    application_name: &str,
) -> Result<Client, tokio_postgres::Error> {
    let mut cfg: tokio_postgres::Config = url.parse()?;
    cfg.application_name(application_name);
    cfg.connect_timeout(Duration::from_secs(5));
    let (client, conn) = cfg.connect(NoTls).await?;
    let name = application_name.to_owned();
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            eprintln!("{name}: database connection ended: {e}");
        }
    });
    Ok(client)
}

/// `outbox-relay migrate` for `table` on the test database; returns the schema versions it
/// applied (empty when the table was up to date). Panics with its output if it fails.
pub async fn migrate_table(table: &str) -> Vec<i32> {
    migrate_table_at(PG_URL, table).await
}

/// [`migrate_table`] on the database at `url` (PostgreSQL or MySQL).
pub async fn migrate_table_at(url: &str, table: &str) -> Vec<i32> {
    let out = RelayBuilder::operator(table)
        .set("database.url", url)
        .output(&["migrate"], Duration::from_secs(60))
        .await;
    assert!(
        out.status.success(),
        "outbox-relay migrate {table} failed: {}\n{}",
        out.status,
        out.stderr
    );
    if out.stdout.contains("is up to date") {
        return Vec::new();
    }
    out.stdout
        .split_once("applied schema versions [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| {
            list.split(',')
                .map(|v| v.trim().parse().expect("schema version"))
                .collect()
        })
        .unwrap_or_else(|| panic!("unexpected migrate output: {}", out.stdout))
}

/// A row to insert, as an application would (fields: the columns of the same name; an
/// `Option` is NULL when `None`).
#[allow(missing_docs)] // the fields are the table's columns
#[derive(Debug, Clone)]
pub struct NewRow {
    pub aggregate_type: String,
    pub aggregate_id: Option<String>,
    pub event_type: String,
    pub payload: Value,
    pub headers: Value,
    pub destination: Option<String>,
    /// Seconds from the database's now to the row's `expires_at` (negative: already past);
    /// `None`: the row never expires and the insert leaves the column out (so it also fits a
    /// table from before schema version 2).
    pub expires_in: Option<f64>,
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
            expires_in: None,
        }
    }

    /// `('order', aggregate_id, event_type)` with payload `{"x": 1}`.
    pub fn order(aggregate_id: Option<&str>, event_type: &str) -> Self {
        Self::new("order", aggregate_id, event_type, json!({ "x": 1 }))
    }

    /// `n` rows of `aggregate_type`/`event_type` with payload `{"i": i}`. With
    /// `Some((prefix, keys))` row `i` is in aggregate `<prefix><i % keys>` (in `prefix` itself
    /// when `keys` is 1); with `None` in no aggregate.
    pub fn numbered(
        n: usize,
        aggregate_type: &str,
        aggregate: Option<(&str, usize)>,
        event_type: &str,
    ) -> Vec<Self> {
        (0..n)
            .map(|i| {
                let id = aggregate.map(|(prefix, keys)| match keys {
                    1 => prefix.to_owned(),
                    k => format!("{prefix}{}", i % k),
                });
                Self::new(aggregate_type, id.as_deref(), event_type, json!({ "i": i }))
            })
            .collect()
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

    /// Sets the row's `expires_at` to `seconds` from the database's now (negative: already
    /// past).
    pub fn expires_in(mut self, seconds: f64) -> Self {
        self.expires_in = Some(seconds);
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
    let out = try_insert_rows(client, table, rows)
        .await
        .unwrap_or_else(|e| panic!("insert into {table}: {e}"));
    assert_eq!(
        out.len(),
        rows.len(),
        "insert into {table} returned fewer rows"
    );
    out
}

/// [`insert_rows`] that returns the error (the database may be restarting) instead of
/// panicking.
pub async fn try_insert_rows<C: GenericClient + Sync>(
    client: &C,
    table: &str,
    rows: &[NewRow],
) -> Result<Vec<Inserted>, tokio_postgres::Error> {
    let (column, value) = if rows.iter().any(|r| r.expires_in.is_some()) {
        (", expires_at", ", now() + x * interval '1 second'")
    } else {
        ("", "")
    };
    let sql = format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, headers, destination{column}) \
         SELECT t, a, e, p, h, d{value} \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::jsonb[], $6::text[], $7::float8[]) \
           AS u(t, a, e, p, h, d, x) \
         RETURNING id, seq"
    );
    let types: Vec<&str> = rows.iter().map(|r| r.aggregate_type.as_str()).collect();
    let ids: Vec<Option<&str>> = rows.iter().map(|r| r.aggregate_id.as_deref()).collect();
    let events: Vec<&str> = rows.iter().map(|r| r.event_type.as_str()).collect();
    let payloads: Vec<&Value> = rows.iter().map(|r| &r.payload).collect();
    let headers: Vec<&Value> = rows.iter().map(|r| &r.headers).collect();
    let destinations: Vec<Option<&str>> = rows.iter().map(|r| r.destination.as_deref()).collect();
    let expiries: Vec<Option<f64>> = rows.iter().map(|r| r.expires_in).collect();
    let out = client
        .query(
            &sql,
            &[
                &types,
                &ids,
                &events,
                &payloads,
                &headers,
                &destinations,
                &expiries,
            ],
        )
        .await?;
    Ok(out
        .iter()
        .map(|r| Inserted {
            id: r.get(0),
            seq: r.get(1),
        })
        .collect())
}

/// One outbox row as the database holds it (fields: the columns of the same name).
#[allow(missing_docs)] // the fields are the table's columns
#[derive(Debug, Clone, Default)]
pub struct RowState {
    pub id: Uuid,
    pub seq: i64,
    pub aggregate_type: String,
    pub aggregate_id: Option<String>,
    pub event_type: String,
    pub payload: Value,
    pub headers: Value,
    pub destination: Option<String>,
    pub status: String,
    pub attempts: i32,
    pub available_at: DateTime<Utc>,
    pub locked_at: Option<DateTime<Utc>>,
    pub locked_by: Option<String>,
    pub last_error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub sent_at: Option<DateTime<Utc>>,
}

impl RowState {
    /// `aggregate_type/aggregate_id`, `None` for a row without an aggregate id (the key the
    /// ordering checks of [`crate::analyse`] use).
    pub fn aggregate(&self) -> Option<String> {
        let t = &self.aggregate_type;
        self.aggregate_id.as_ref().map(|a| format!("{t}/{a}"))
    }

    /// This row's state, unless it is `sent` on its first attempt.
    pub fn not_sent_once(&self) -> Option<String> {
        (self.status != "sent" || self.attempts != 1).then(|| self.describe())
    }

    /// [`RowState::not_sent_once`], and also unless it has a `sent_at`, no lock and no error.
    pub fn not_sent_cleanly(&self) -> Option<String> {
        let clean = self.sent_at.is_some() && self.locked_by.is_none() && self.last_error.is_none();
        self.not_sent_once()
            .or_else(|| (!clean).then(|| self.describe()))
    }

    pub(crate) fn describe(&self) -> String {
        format!(
            "{} (seq {}): status {} attempts {} sent_at {:?} locked_by {:?} last_error {:?}",
            self.id,
            self.seq,
            self.status,
            self.attempts,
            self.sent_at,
            self.locked_by,
            self.last_error
        )
    }
}

/// The waits of a test table, written once for [`TestTable`], [`MysqlTable`] and
/// [`TestOutbox`] over their `count_where`, `status_counts` and `row`; `self.$name` is the
/// table's name.
///
/// [`MysqlTable`]: crate::mysql::MysqlTable
/// [`TestOutbox`]: crate::outbox::TestOutbox
macro_rules! table_waits {
    ($($name:tt)+) => {
        /// Waits until `count_where(condition)` is `want`; panics after `timeout` with the last
        /// count and the row counts by status.
        pub async fn wait_count(&self, condition: &str, want: i64, timeout: std::time::Duration) {
            let what = format!("{want} rows of {} where {condition}", self.$($name)+);
            $crate::wait_until(timeout, &what, async || {
                match self.count_where(condition).await {
                    n if n == want => Ok(()),
                    n => Err(format!("{n}; {:?}", self.status_counts().await)),
                }
            })
            .await;
        }

        /// Waits until every row is `sent` (the counts by status in the panic message
        /// otherwise).
        pub async fn wait_all_sent(&self, timeout: std::time::Duration) {
            self.wait_count("status <> 'sent'", 0, timeout).await;
        }

        /// Waits until row `id` satisfies `done`, and returns it; panics after `timeout` naming
        /// `what` and the row's last state.
        pub async fn wait_row(
            &self,
            id: uuid::Uuid,
            timeout: std::time::Duration,
            what: &str,
            done: impl Fn(&$crate::db::RowState) -> bool,
        ) -> $crate::db::RowState {
            $crate::wait_until(timeout, what, async || {
                let row = self.row(id).await;
                if done(&row) {
                    Ok(row)
                } else {
                    Err(row.describe())
                }
            })
            .await
        }
    };
}
pub(crate) use table_waits;

const ROW_COLUMNS: &str = "id, seq, aggregate_type, aggregate_id, event_type, to_jsonb(payload), headers, destination, \
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

/// Row counts by status of `table` (only the statuses present), for tests and the benchmark.
pub async fn status_counts_in<C: GenericClient + Sync>(
    db: &C,
    table: &str,
) -> Result<BTreeMap<String, i64>, tokio_postgres::Error> {
    let sql = format!("SELECT status, count(*) FROM {table} GROUP BY status");
    let rows = db.query(&sql, &[]).await?;
    rows.iter()
        .map(|r| Ok((r.try_get::<_, String>(0)?, r.try_get::<_, i64>(1)?)))
        .collect()
}

/// Drops the tables of test runs that ended more than an hour ago without cleaning up (a failed
/// test leaves its table for inspection). Runs once per test process.
async fn collect_old_tables(db: &Client) {
    let sql = "SELECT table_name FROM outbox_relay_schema_version \
               WHERE table_name LIKE 'it\\_%' AND applied_at < now() - interval '1 hour'";
    let Ok(old) = db.query(sql, &[]).await else {
        return;
    };
    for row in old {
        let name: String = row.get(0);
        // Only names this harness makes: it_<slug>_<hex>, nothing to quote.
        if name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            let _ = db.batch_execute(&drop_table_sql(&name)).await;
        }
    }
}

/// SQL that drops outbox table `n` and everything its migration created.
pub fn drop_table_sql(n: &str) -> String {
    format!(
        "DROP TABLE IF EXISTS {n} CASCADE; \
         DROP SEQUENCE IF EXISTS {n}_seq; \
         DROP FUNCTION IF EXISTS {n}_next_seq(); \
         DROP FUNCTION IF EXISTS {n}_notify(); \
         DROP FUNCTION IF EXISTS {n}_wakeup(); \
         DROP TABLE IF EXISTS {n}_waiters; \
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
    /// Creates `it_<test>_<hex>` with `outbox-relay migrate`, as an operator would.
    pub async fn new(test: &str) -> Self {
        let table = Self::at(PG_URL, test).await;
        if !GC_DONE.swap(true, Ordering::SeqCst) {
            collect_old_tables(&table.db).await;
        }
        table
    }

    /// Creates `it_<test>_<hex>` with `outbox-relay migrate` in the database at `url` (a
    /// failover pair's, say), its client connected there.
    pub async fn at(url: &str, test: &str) -> Self {
        let name = format!("it_{}_{}", slug(test, 24), hex8());
        let applied = migrate_table_at(url, &name).await;
        assert!(
            applied.first() == Some(&1) && applied.windows(2).all(|w| w[0] < w[1]),
            "a fresh table gets every migration from 1 on, in order: {applied:?}"
        );
        let db = try_pg_connect(url, "outbox-testkit")
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the test table's database: {e}"));
        Self { name, db }
    }

    /// Creates `it_<test>_<hex>` partitioned by `created_at` every `interval`, with
    /// `outbox-relay migrate` and `database.partition_interval`, as an operator would.
    pub async fn partitioned(test: &str, interval: &str) -> Self {
        let name = format!("it_{}_{}", slug(test, 24), hex8());
        let out = RelayBuilder::operator(&name)
            .set("database.partition_interval", interval)
            .output(&["migrate"], Duration::from_secs(60))
            .await;
        assert!(
            out.status.success() && out.stdout.contains("partitioned by created_at"),
            "outbox-relay migrate {name} (partitioned) failed: {}\n{}\n{}",
            out.status,
            out.stdout,
            out.stderr
        );
        Self {
            name,
            db: pg_connect().await,
        }
    }

    /// The table's partitions (bare names, DEFAULT included), by name.
    pub async fn partitions(&self) -> Vec<String> {
        let rows = self
            .db
            .query(
                "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                  WHERE i.inhparent = to_regclass($1) ORDER BY 1",
                &[&self.name],
            )
            .await
            .expect("list partitions");
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// The CloudEvents `source` the relay uses by default for this table.
    pub fn default_source(&self) -> String {
        format!("/outbox/test/{}", self.name)
    }

    /// Inserts `rows` in one autocommitted statement.
    pub async fn insert(&self, rows: &[NewRow]) -> Vec<Inserted> {
        insert_rows(&self.db, &self.name, rows).await
    }

    /// Inserts `rows` in one autocommitted statement; their ids, in insert order.
    pub async fn insert_ids(&self, rows: &[NewRow]) -> Vec<Uuid> {
        self.insert(rows).await.into_iter().map(|r| r.id).collect()
    }

    /// Inserts one row; its id.
    pub async fn insert_one(&self, row: NewRow) -> Uuid {
        self.insert(&[row]).await[0].id
    }

    /// Turns the `payload` column into `bytea` (do it before the relay starts: it detects the
    /// column type once, at start).
    pub async fn make_payload_bytea(&self) {
        let sql = format!(
            "ALTER TABLE {} ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8')",
            self.name
        );
        self.db.batch_execute(&sql).await.expect("payload to bytea");
    }

    /// Inserts a row of type `bin`, event `blob`, in `aggregate`, with `payload` as its bytes
    /// (a table made `bytea` by [`TestTable::make_payload_bytea`]); its id.
    pub async fn insert_bytes(&self, aggregate: &str, payload: &[u8]) -> Uuid {
        let sql = format!(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('bin', $1, 'blob', $2) RETURNING id",
            self.name
        );
        let row = self.db.query_one(&sql, &[&aggregate, &payload]).await;
        row.expect("insert bytes").get(0)
    }

    /// `SELECT <every column> FROM <table> <rest>` (`rest`: test-authored SQL).
    async fn select(&self, rest: &str, params: &[&(dyn ToSql + Sync)]) -> Vec<RowState> {
        let sql = format!("SELECT {ROW_COLUMNS} FROM {} {rest}", self.name);
        let rows = self.db.query(&sql, params).await;
        rows.unwrap_or_else(|e| panic!("{sql}: {e}"))
            .iter()
            .map(row_state)
            .collect()
    }

    /// Every row, in `seq` order.
    pub async fn rows(&self) -> Vec<RowState> {
        self.select("ORDER BY seq", &[]).await
    }

    /// One row by id.
    pub async fn row(&self, id: Uuid) -> RowState {
        let found = self.select("WHERE id = $1", &[&id]).await.pop();
        found.unwrap_or_else(|| panic!("no row {id} in {}", self.name))
    }

    /// Rows matching `ids`, keyed by id.
    pub async fn rows_by_id(&self, ids: &[Uuid]) -> HashMap<Uuid, RowState> {
        let rows = self.select("WHERE id = ANY($1)", &[&ids]).await;
        rows.into_iter().map(|r| (r.id, r)).collect()
    }

    /// The database's clock (the one `sent_at` and `locked_at` are written with).
    pub async fn db_now(&self) -> DateTime<Utc> {
        self.db
            .query_one("SELECT clock_timestamp()", &[])
            .await
            .expect("clock_timestamp")
            .get(0)
    }

    /// Whether the table exists (a test may drop it, or expect a command not to create it).
    pub async fn exists(&self) -> bool {
        let sql = "SELECT to_regclass($1) IS NOT NULL";
        let row = self.db.query_one(sql, &[&self.name]).await;
        row.expect("look the table up").get(0)
    }

    /// The relays with a waiting record on this table (schema version 3's wake-up), by name.
    pub async fn waiters(&self) -> Vec<String> {
        let sql = format!("SELECT relay FROM {}_waiters ORDER BY relay", self.name);
        let rows = self
            .db
            .query(&sql, &[])
            .await
            .expect("read the waiting records");
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// Waits up to `timeout` until the [`waiters`](Self::waiters) satisfy `ok`; panics naming
    /// `what` and the last records seen.
    pub async fn wait_waiters(
        &self,
        timeout: Duration,
        what: &str,
        ok: impl Fn(&[String]) -> bool,
    ) {
        wait_until(timeout, what, async || {
            let waiters = self.waiters().await;
            ok(&waiters)
                .then_some(())
                .ok_or_else(|| format!("{waiters:?}"))
        })
        .await;
    }

    /// `SELECT count(*) FROM <table> WHERE <condition>` (the condition is test-authored SQL).
    pub async fn count_where(&self, condition: &str) -> i64 {
        let sql = format!("SELECT count(*) FROM {} WHERE {condition}", self.name);
        self.db.query_one(&sql, &[]).await.expect("count").get(0)
    }

    /// Row counts by status (absent statuses are 0).
    pub async fn status_counts(&self) -> BTreeMap<String, i64> {
        let statuses = ["pending", "processing", "sent", "failed"];
        let mut out = BTreeMap::from(statuses.map(|s| (s.to_owned(), 0)));
        let found = status_counts_in(&self.db, &self.name).await;
        out.extend(found.expect("status counts"));
        out
    }

    /// Waits until the row counts by status satisfy `done`, and returns them; panics after
    /// `timeout` naming `what` and the last counts.
    pub async fn wait_for_counts(
        &self,
        timeout: Duration,
        what: &str,
        done: impl Fn(&BTreeMap<String, i64>) -> bool,
    ) -> BTreeMap<String, i64> {
        wait_until(timeout, what, async || {
            let counts = self.status_counts().await;
            if done(&counts) {
                Ok(counts)
            } else {
                Err(format!("{counts:?}"))
            }
        })
        .await
    }

    table_waits!(name);

    /// Drops the table and the objects the migration created for it.
    pub async fn drop_table(self) {
        self.db
            .batch_execute(&drop_table_sql(&self.name))
            .await
            .expect("drop test table");
    }
}
