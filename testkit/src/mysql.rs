//! MySQL/MariaDB fixtures: a fresh outbox table per test, created by `outbox-relay migrate`
//! against the local server (127.0.0.1:3306, database `test`), rows inserted as an
//! application does, and the table read back as [`RowState`]s for the same checks as on
//! PostgreSQL. Tables that killed test runs left behind are dropped once they are an hour
//! old and untouched for an hour.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};

use chrono::{DateTime, NaiveDateTime, Utc};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Row, TxOpts};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::db::{Inserted, NewRow, RowState};
use crate::{hex8, slug};

/// The local MariaDB/MySQL server's test database, as root.
pub const MYSQL_URL: &str = "mysql://root@127.0.0.1:3306/test";
/// The server's TCP address, for the proxy.
pub const MYSQL_ADDR: &str = "127.0.0.1:3306";

/// A connection to [`MYSQL_URL`] with the session time zone UTC (so `TIMESTAMP` columns read
/// as UTC).
pub async fn mysql_conn() -> Conn {
    try_mysql_conn(MYSQL_URL).await.unwrap_or_else(|e| {
        panic!("connect to {MYSQL_URL}: {e} (is MariaDB running? scripts/services.sh starts it)")
    })
}

/// A connection to `url` with the session time zone UTC, or the error.
pub async fn try_mysql_conn(url: &str) -> Result<Conn, mysql_async::Error> {
    let opts = mysql_async::Opts::from_url(url).map_err(mysql_async::Error::Url)?;
    let mut conn = Conn::new(opts).await?;
    conn.query_drop("SET time_zone = '+00:00'").await?;
    Ok(conn)
}

fn utc(t: NaiveDateTime) -> DateTime<Utc> {
    DateTime::from_naive_utc_and_offset(t, Utc)
}

static GC_DONE: AtomicBool = AtomicBool::new(false);

/// Drops the `it_…` tables (and their version records) of test runs that ended more than an
/// hour ago without cleaning up: created over an hour ago and not written for an hour (a
/// table that a test still running writes to has a recent `UPDATE_TIME`; MariaDB forgets it
/// at a restart, after which no test of before the restart is running). Runs once per test
/// process; errors are ignored (another process may be collecting the same tables).
async fn collect_old_tables(conn: &mut Conn) {
    let sql = "SELECT TABLE_NAME FROM information_schema.TABLES \
               WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'it\\_%' \
                 AND CREATE_TIME < NOW() - INTERVAL 1 HOUR \
                 AND (UPDATE_TIME IS NULL OR UPDATE_TIME < NOW() - INTERVAL 1 HOUR)";
    let Ok(old) = conn.query::<String, _>(sql).await else {
        return;
    };
    for name in old {
        // Only names this harness makes: it_<slug>_<hex>[_suffix], nothing to quote.
        if name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            let _ = conn.query_drop(drop_table_sql(&name)).await;
        }
    }
}

/// SQL that drops table `n` and its version record.
fn drop_table_sql(n: &str) -> String {
    format!(
        "DROP TABLE IF EXISTS {n}; \
         DELETE FROM outbox_relay_schema_version WHERE table_name = '{n}'"
    )
}

/// A fresh outbox table in MySQL, created with `outbox-relay migrate`, and a connection for
/// the test's reads.
pub struct MysqlTable {
    /// Unqualified table name, `it_<test>_<hex>` in database `test`.
    pub name: String,
    conn: Mutex<Conn>,
}

impl MysqlTable {
    /// Creates `it_<test>_<hex>` with `outbox-relay migrate`, as an operator would (the
    /// first table of a test process also collects the tables of killed runs).
    pub async fn new(test: &str) -> Self {
        let name = format!("it_{}_{}", slug(test, 24), hex8());
        let mut conn = mysql_conn().await;
        if !GC_DONE.swap(true, Ordering::SeqCst) {
            collect_old_tables(&mut conn).await;
        }
        crate::db::migrate_table_at(MYSQL_URL, &name).await;
        Self {
            name,
            conn: Mutex::new(conn),
        }
    }

    /// A new connection for the test's own statements.
    pub async fn conn(&self) -> Conn {
        mysql_conn().await
    }

    /// Runs test-authored `sql` (no result) on the table's connection.
    pub async fn execute(&self, sql: &str) {
        let mut conn = self.conn.lock().await;
        conn.query_drop(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Inserts `rows` in one transaction, one `INSERT` each, as an application does (the
    /// table fills in `id` and `seq`).
    pub async fn insert(&self, rows: &[NewRow]) -> Vec<Inserted> {
        let mut conn = self.conn.lock().await;
        let mut tx = conn
            .start_transaction(TxOpts::default())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let out = insert_in(&mut tx, &self.name, rows).await;
        tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
        out
    }

    /// `SELECT <every column> FROM <table> <rest>` (`rest`: test-authored SQL).
    async fn select(&self, rest: &str) -> Vec<RowState> {
        let sql = format!(
            "SELECT id, seq, aggregate_type, aggregate_id, event_type, CAST(payload AS CHAR), \
               CAST(headers AS CHAR), destination, status, attempts, available_at, locked_at, \
               locked_by, last_error, created_at, sent_at FROM {} {rest}",
            self.name
        );
        let mut conn = self.conn.lock().await;
        let rows: Vec<Row> = conn
            .query(&sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        rows.into_iter().map(row_state).collect()
    }

    /// Every row, in `seq` order.
    pub async fn rows(&self) -> Vec<RowState> {
        self.select("ORDER BY seq").await
    }

    /// The row with `id`.
    pub async fn row(&self, id: Uuid) -> RowState {
        let found = self.select(&format!("WHERE id = '{id}'")).await.pop();
        found.unwrap_or_else(|| panic!("no row {id} in {}", self.name))
    }

    /// Rows matching `ids`, keyed by id.
    pub async fn rows_by_id(&self, ids: &[Uuid]) -> HashMap<Uuid, RowState> {
        if ids.is_empty() {
            return HashMap::new();
        }
        let list: Vec<String> = ids.iter().map(|id| format!("'{id}'")).collect();
        let rows = self
            .select(&format!("WHERE id IN ({})", list.join(", ")))
            .await;
        rows.into_iter().map(|r| (r.id, r)).collect()
    }

    /// Rows matching the SQL `condition`.
    pub async fn count_where(&self, condition: &str) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {} WHERE {condition}", self.name);
        let mut conn = self.conn.lock().await;
        let n: Option<i64> = conn
            .query_first(&sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        n.unwrap_or(0)
    }

    /// Row counts by status (only the statuses present).
    pub async fn status_counts(&self) -> BTreeMap<String, i64> {
        let sql = format!("SELECT status, COUNT(*) FROM {} GROUP BY status", self.name);
        let mut conn = self.conn.lock().await;
        let rows: Vec<(String, i64)> = conn.query(sql).await.unwrap_or_else(|e| panic!("{e}"));
        rows.into_iter().collect()
    }

    /// The server's clock (the one `sent_at` and `locked_at` are written with).
    pub async fn db_now(&self) -> DateTime<Utc> {
        let mut conn = self.conn.lock().await;
        let now: Option<NaiveDateTime> = conn
            .query_first("SELECT NOW(6)")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        utc(now.unwrap_or_else(|| panic!("NOW(6) returned no row")))
    }

    crate::db::table_waits!(name);

    /// Drops the table and its version record.
    pub async fn drop_table(self) {
        let mut conn = self.conn.into_inner();
        conn.query_drop(drop_table_sql(&self.name))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Inserts `rows` into `table` on `conn` (inside its transaction, if any), one `INSERT` each,
/// and returns what the table assigned.
pub async fn insert_in<Q: Queryable>(conn: &mut Q, table: &str, rows: &[NewRow]) -> Vec<Inserted> {
    try_insert_in(conn, table, rows)
        .await
        .unwrap_or_else(|e| panic!("insert into {table}: {e}"))
}

/// [`insert_in`] that returns the error (the server may be unreachable) instead of panicking.
pub async fn try_insert_in<Q: Queryable>(
    conn: &mut Q,
    table: &str,
    rows: &[NewRow],
) -> Result<Vec<Inserted>, String> {
    let sql = |expiring: bool| {
        let (column, value) = if expiring {
            (", expires_at", ", NOW(6) + INTERVAL ? MICROSECOND")
        } else {
            ("", "")
        };
        format!(
            "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, headers, destination{column}) \
             VALUES (?, ?, ?, ?, ?, ?{value})"
        )
    };
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let mut params: Vec<mysql_async::Value> = vec![
            r.aggregate_type.as_str().into(),
            r.aggregate_id.as_deref().into(),
            r.event_type.as_str().into(),
            r.payload.to_string().into(),
            r.headers.to_string().into(),
            r.destination.as_deref().into(),
        ];
        if let Some(seconds) = r.expires_in {
            params.push(((seconds * 1e6).round() as i64).into());
        }
        conn.exec_drop(sql(r.expires_in.is_some()), params)
            .await
            .map_err(|e| e.to_string())?;
        let row: Option<(String, i64)> = conn
            .query_first(format!(
                "SELECT id, seq FROM {table} WHERE seq = LAST_INSERT_ID()"
            ))
            .await
            .map_err(|e| e.to_string())?;
        let (id, seq) =
            row.ok_or_else(|| format!("the row just inserted into {table} is not there"))?;
        let id = Uuid::parse_str(&id).map_err(|e| format!("id {id:?}: {e}"))?;
        out.push(Inserted { id, seq });
    }
    Ok(out)
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
