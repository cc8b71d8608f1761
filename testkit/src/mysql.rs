//! MySQL/MariaDB fixtures: a fresh outbox table per test, created by `outbox-relay migrate`
//! against the local server (127.0.0.1:3306, database `test`), rows inserted as an
//! application does, and the table read back as [`RowState`]s for the same checks as on
//! PostgreSQL.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, Utc};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Row, TxOpts};
use uuid::Uuid;

use crate::db::{Inserted, NewRow, RowState};
use crate::process::RelayBuilder;

/// The local MariaDB/MySQL server's test database, as root.
pub const MYSQL_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// A connection to [`MYSQL_URL`] with the session time zone UTC (so `TIMESTAMP` columns read
/// as UTC).
pub async fn mysql_conn() -> Conn {
    let opts = mysql_async::Opts::from_url(MYSQL_URL).unwrap_or_else(|e| panic!("{e}"));
    let mut conn = Conn::new(opts).await.unwrap_or_else(|e| {
        panic!("connect to {MYSQL_URL}: {e} (is MariaDB running? scripts/services.sh starts it)")
    });
    conn.query_drop("SET time_zone = '+00:00'")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    conn
}

fn utc(t: NaiveDateTime) -> DateTime<Utc> {
    DateTime::from_naive_utc_and_offset(t, Utc)
}

/// A fresh outbox table in MySQL, created with `outbox-relay migrate`.
pub struct MysqlTable {
    /// Unqualified table name, `it_<test>_<hex>` in database `test`.
    pub name: String,
}

impl MysqlTable {
    /// Creates `it_<test>_<hex>` with `outbox-relay migrate`, as an operator would.
    pub async fn new(test: &str) -> Self {
        let slug: String = test
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
            .take(24)
            .collect();
        let name = format!("it_{slug}_{:08x}", rand_u32());
        let out = RelayBuilder::bare(&name)
            .set("database.url", MYSQL_URL)
            .set("database.table", &name)
            .output(&["migrate"], Duration::from_secs(60))
            .await;
        assert!(
            out.status.success(),
            "outbox-relay migrate {name} on MySQL failed: {}\n{}",
            out.stdout,
            out.stderr
        );
        Self { name }
    }

    /// A connection for the test's own statements.
    pub async fn conn(&self) -> Conn {
        mysql_conn().await
    }

    /// Inserts `rows` in one transaction, one `INSERT` each, as an application does (the
    /// table fills in `id` and `seq`).
    pub async fn insert(&self, rows: &[NewRow]) -> Vec<Inserted> {
        let mut conn = mysql_conn().await;
        let mut tx = conn
            .start_transaction(TxOpts::default())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let out = insert_in(&mut tx, &self.name, rows).await;
        tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
        out
    }

    /// Every row, in `seq` order.
    pub async fn rows(&self) -> Vec<RowState> {
        let mut conn = mysql_conn().await;
        let sql = format!(
            "SELECT id, seq, aggregate_type, aggregate_id, event_type, CAST(payload AS CHAR), \
               CAST(headers AS CHAR), destination, status, attempts, available_at, locked_at, \
               locked_by, last_error, created_at, sent_at FROM {} ORDER BY seq",
            self.name
        );
        let rows: Vec<Row> = conn.query(sql).await.unwrap_or_else(|e| panic!("{e}"));
        rows.into_iter().map(row_state).collect()
    }

    /// The row with `id`.
    pub async fn row(&self, id: Uuid) -> RowState {
        self.rows()
            .await
            .into_iter()
            .find(|r| r.id == id)
            .unwrap_or_else(|| panic!("no row {id} in {}", self.name))
    }

    /// Rows matching the SQL `condition`.
    pub async fn count_where(&self, condition: &str) -> i64 {
        let mut conn = mysql_conn().await;
        let sql = format!("SELECT COUNT(*) FROM {} WHERE {condition}", self.name);
        let n: Option<i64> = conn
            .query_first(sql)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        n.unwrap_or(0)
    }

    /// Row counts by status.
    pub async fn status_counts(&self) -> BTreeMap<String, i64> {
        let mut conn = mysql_conn().await;
        let sql = format!("SELECT status, COUNT(*) FROM {} GROUP BY status", self.name);
        let rows: Vec<(String, i64)> = conn.query(sql).await.unwrap_or_else(|e| panic!("{e}"));
        rows.into_iter().collect()
    }

    /// Waits until `condition` holds for `want` rows; panics with the counts by status after
    /// `timeout`.
    pub async fn wait_count(&self, condition: &str, want: i64, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let n = self.count_where(condition).await;
            if n == want {
                return;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "{}: {n} rows where {condition}, want {want}; by status {:?}",
                    self.name,
                    self.status_counts().await
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every row is `sent`.
    pub async fn wait_all_sent(&self, timeout: Duration) {
        let total = self.count_where("TRUE").await;
        self.wait_count("status = 'sent'", total, timeout).await;
    }

    /// Drops the table and its version record.
    pub async fn drop_table(self) {
        let mut conn = mysql_conn().await;
        let sql = format!(
            "DROP TABLE IF EXISTS {n}; DELETE FROM outbox_relay_schema_version WHERE table_name = '{n}'",
            n = self.name
        );
        conn.query_drop(sql).await.unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Inserts `rows` into `table` on `conn` (inside its transaction, if any), one `INSERT` each,
/// and returns what the table assigned.
pub async fn insert_in<Q: Queryable>(conn: &mut Q, table: &str, rows: &[NewRow]) -> Vec<Inserted> {
    let sql = format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, headers, destination) \
         VALUES (?, ?, ?, ?, ?, ?)"
    );
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        conn.exec_drop(
            &sql,
            (
                &r.aggregate_type,
                &r.aggregate_id,
                &r.event_type,
                r.payload.to_string(),
                r.headers.to_string(),
                &r.destination,
            ),
        )
        .await
        .unwrap_or_else(|e| panic!("insert into {table}: {e}"));
        let row: Option<(String, i64)> = conn
            .query_first(format!(
                "SELECT id, seq FROM {table} WHERE seq = LAST_INSERT_ID()"
            ))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let (id, seq) =
            row.unwrap_or_else(|| panic!("the row just inserted into {table} is not there"));
        out.push(Inserted {
            id: Uuid::parse_str(&id).unwrap_or_else(|e| panic!("{e}")),
            seq,
        });
    }
    out
}

fn row_state(mut r: Row) -> RowState {
    let id: String = r.take(0).unwrap_or_default();
    let json = |t: Option<String>| -> serde_json::Value {
        t.and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(serde_json::Value::Null)
    };
    RowState {
        id: Uuid::parse_str(&id).unwrap_or_else(|e| panic!("{e}")),
        seq: r.take(1).unwrap_or_default(),
        aggregate_type: r.take(2).unwrap_or_default(),
        aggregate_id: r.take(3).unwrap_or_default(),
        event_type: r.take(4).unwrap_or_default(),
        payload: json(r.take(5)),
        headers: json(r.take(6)),
        destination: r.take(7).unwrap_or_default(),
        status: r.take(8).unwrap_or_default(),
        attempts: r.take(9).unwrap_or_default(),
        available_at: utc(r.take(10).unwrap_or_default()),
        locked_at: r.take::<Option<NaiveDateTime>, _>(11).flatten().map(utc),
        locked_by: r.take(12).unwrap_or_default(),
        last_error: r.take(13).unwrap_or_default(),
        created_at: utc(r.take(14).unwrap_or_default()),
        sent_at: r.take::<Option<NaiveDateTime>, _>(15).flatten().map(utc),
    }
}

fn rand_u32() -> u32 {
    let id = Uuid::new_v4();
    let b = id.as_bytes();
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
