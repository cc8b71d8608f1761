//! One scenario, both databases: [`Db`] names PostgreSQL or MySQL/MariaDB, [`TestOutbox`] is a
//! fresh outbox table on either with what scenarios need (the relay configured for it, rows
//! inserted and read back, counts, the database's clock), and [`DbConn`] is an application's
//! own connection to either (rows inserted inside a transaction the test holds open,
//! test-authored statements). [`on_both_databases!`](crate::on_both_databases) turns
//! `async fn scenario(db: Db)` into a test on each database.
//!
//! Test-authored SQL given to these helpers (`count_where` conditions, `exec` statements) must
//! read the same on both: `status = 'sent'`, `attempts = 0`, plain `CREATE TABLE`s.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;

use chrono::{DateTime, Utc};
use mysql_async::prelude::Queryable;
use uuid::Uuid;

use crate::db::{Inserted, NewRow, RowState, TestTable, insert_rows, try_pg_connect};
use crate::mysql::{MYSQL_ADDR, MYSQL_URL, MysqlTable, try_insert_in, try_mysql_conn};
use crate::{PG_URL, RelayBuilder};

/// Emits, for each scenario `async fn <name>(db: Db)` named, a module `<name>` with two tests,
/// `postgres` and `mysql`, that run it on each database: a scenario written once runs twice
/// (`cargo test --test both_databases mysql` runs the MySQL half, `<name>::` one scenario).
#[macro_export]
macro_rules! on_both_databases {
    ($($scenario:ident),+ $(,)?) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::$scenario($crate::outbox::Db::Postgres).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mysql() {
                super::$scenario($crate::outbox::Db::Mysql).await;
            }
        }
    )+};
}

/// The database a scenario runs on: the local PostgreSQL or the local MariaDB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Db {
    /// 127.0.0.1:5432, database `test`, as `postgres` (trust).
    Postgres,
    /// 127.0.0.1:3306, database `test`, as `root` (no password).
    Mysql,
}

impl Db {
    /// The test database's URL.
    pub fn url(self) -> &'static str {
        match self {
            Self::Postgres => PG_URL,
            Self::Mysql => MYSQL_URL,
        }
    }

    /// The server's TCP address (for a [`crate::Proxy`] in front of it).
    pub fn addr(self) -> &'static str {
        match self {
            Self::Postgres => "127.0.0.1:5432",
            Self::Mysql => MYSQL_ADDR,
        }
    }

    /// The test database's URL through `addr` (a [`crate::Proxy`]'s). On MySQL with
    /// `prefer_socket=false`: by default the driver, having reached a server on 127.0.0.1
    /// over TCP, reconnects through the server's Unix socket, around the proxy.
    pub fn url_via(self, addr: SocketAddr) -> String {
        match self {
            Self::Postgres => format!("postgres://postgres@{addr}/test"),
            Self::Mysql => format!("mysql://root@{addr}/test?prefer_socket=false"),
        }
    }

    /// The test database's URL as `user` with `password` (PostgreSQL trusts loopback logins
    /// and ignores the password).
    pub fn url_as(self, user: &str, password: &str) -> String {
        match self {
            Self::Postgres => format!("postgres://{user}@127.0.0.1:5432/test"),
            Self::Mysql => format!("mysql://{user}:{password}@127.0.0.1:3306/test"),
        }
    }

    /// A short tag for names (`pg`, `my`).
    pub fn tag(self) -> &'static str {
        match self {
            Self::Postgres => "pg",
            Self::Mysql => "my",
        }
    }

    /// A new application connection to the test database.
    pub async fn connect(self) -> DbConn {
        let url = self.url();
        self.connect_to(url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
    }

    /// A new application connection to `url` (this database's kind), or the error's text.
    pub async fn connect_to(self, url: &str) -> Result<DbConn, String> {
        match self {
            // Not named `outbox-relay…`: the ordering guard ignores the relay's own sessions.
            Self::Postgres => try_pg_connect(url, "outbox-testkit")
                .await
                .map(DbConn::Postgres)
                .map_err(|e| {
                    let detail = e.as_db_error().map(|d| d.message().to_owned());
                    format!("{e} {}", detail.unwrap_or_default())
                }),
            Self::Mysql => try_mysql_conn(url)
                .await
                .map(DbConn::Mysql)
                .map_err(|e| e.to_string()),
        }
    }
}

/// An application's connection to either database.
pub enum DbConn {
    /// A PostgreSQL session.
    Postgres(tokio_postgres::Client),
    /// A MySQL/MariaDB session (time zone UTC).
    Mysql(mysql_async::Conn),
}

impl DbConn {
    /// Runs `sql` (one statement, no result), or returns the error's text.
    pub async fn try_exec(&mut self, sql: &str) -> Result<(), String> {
        match self {
            Self::Postgres(c) => c.batch_execute(sql).await.map_err(|e| {
                let detail = e.as_db_error().map(|d| d.message().to_owned());
                format!("{e} {}", detail.unwrap_or_default())
            }),
            Self::Mysql(c) => c.query_drop(sql).await.map_err(|e| e.to_string()),
        }
    }

    /// Ends the session (and whatever locks it holds) now.
    pub async fn close(self) {
        match self {
            Self::Postgres(c) => drop(c),
            Self::Mysql(c) => c
                .disconnect()
                .await
                .unwrap_or_else(|e| panic!("disconnect: {e}")),
        }
    }

    /// Runs `sql` (one statement, no result); panics naming it.
    pub async fn exec(&mut self, sql: &str) {
        if let Err(e) = self.try_exec(sql).await {
            panic!("{sql}: {e}");
        }
    }

    /// The first column of the first row `sql` returns, as an integer (a `BIGINT` or a
    /// count), or the error's text.
    pub async fn try_query_i64(&mut self, sql: &str) -> Result<i64, String> {
        match self {
            Self::Postgres(c) => {
                let row = c.query_one(sql, &[]).await.map_err(|e| {
                    let detail = e.as_db_error().map(|d| d.message().to_owned());
                    format!("{e} {}", detail.unwrap_or_default())
                })?;
                row.try_get(0).map_err(|e| e.to_string())
            }
            Self::Mysql(c) => {
                let n: Option<i64> = c.query_first(sql).await.map_err(|e| e.to_string())?;
                n.ok_or_else(|| format!("{sql} returned no row"))
            }
        }
    }

    /// [`DbConn::try_query_i64`], panicking naming `sql`.
    pub async fn query_i64(&mut self, sql: &str) -> i64 {
        self.try_query_i64(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Starts a transaction that lasts until [`DbConn::commit`] or [`DbConn::rollback`]
    /// (what [`DbConn::insert`] does meanwhile is part of it).
    pub async fn begin(&mut self) {
        self.exec("BEGIN").await;
    }

    /// Commits the transaction of [`DbConn::begin`].
    pub async fn commit(&mut self) {
        self.exec("COMMIT").await;
    }

    /// Rolls the transaction of [`DbConn::begin`] back.
    pub async fn rollback(&mut self) {
        self.exec("ROLLBACK").await;
    }

    /// Inserts `rows` into outbox `table` as an application does (inside the open
    /// transaction, if any), or returns the error's text.
    pub async fn try_insert(
        &mut self,
        table: &str,
        rows: &[NewRow],
    ) -> Result<Vec<Inserted>, String> {
        match self {
            Self::Postgres(c) => crate::db::try_insert_rows(&*c, table, rows)
                .await
                .map_err(|e| e.to_string()),
            Self::Mysql(c) => try_insert_in(c, table, rows).await,
        }
    }

    /// [`DbConn::try_insert`], panicking naming `table`.
    pub async fn insert(&mut self, table: &str, rows: &[NewRow]) -> Vec<Inserted> {
        match self {
            Self::Postgres(c) => insert_rows(&*c, table, rows).await,
            Self::Mysql(_) => self
                .try_insert(table, rows)
                .await
                .unwrap_or_else(|e| panic!("insert into {table}: {e}")),
        }
    }
}

/// A fresh outbox table (`it_<test>_<hex>`, created by `outbox-relay migrate`) on either
/// database.
pub enum TestOutbox {
    /// In PostgreSQL's `public` schema.
    Postgres(TestTable),
    /// In MariaDB's `test` database.
    Mysql(MysqlTable),
}

impl TestOutbox {
    /// Creates the table of `test` on `db`.
    pub async fn new(db: Db, test: &str) -> Self {
        match db {
            Db::Postgres => Self::Postgres(TestTable::new(test).await),
            Db::Mysql => Self::Mysql(MysqlTable::new(test).await),
        }
    }

    /// The database it is on.
    pub fn db(&self) -> Db {
        match self {
            Self::Postgres(_) => Db::Postgres,
            Self::Mysql(_) => Db::Mysql,
        }
    }

    /// The table's name.
    pub fn name(&self) -> &str {
        match self {
            Self::Postgres(t) => &t.name,
            Self::Mysql(t) => &t.name,
        }
    }

    /// The CloudEvents `source` the relay uses by default for this table (the database's
    /// name, then the table's).
    pub fn default_source(&self) -> String {
        format!("/outbox/test/{}", self.name())
    }

    /// `outbox-relay run` for this table (no migration at start), instance id `instance`,
    /// metrics server disabled; the publisher is left to the caller.
    pub fn relay(&self, instance: &str) -> RelayBuilder {
        match self {
            Self::Postgres(t) => RelayBuilder::for_table(t, instance),
            Self::Mysql(t) => RelayBuilder::for_mysql(t, instance),
        }
    }

    /// The binary for the operator commands (`status`, `dead-letters`, `check`) on this table,
    /// nothing else configured.
    pub fn operator(&self) -> RelayBuilder {
        RelayBuilder::bare(&format!("{}-op", self.name()))
            .set("database.url", self.db().url())
            .set("database.table", self.name())
    }

    /// A new application connection to the table's database.
    pub async fn conn(&self) -> DbConn {
        self.db().connect().await
    }

    /// Runs test-authored `sql` (no result) on the database.
    pub async fn exec(&self, sql: &str) {
        match self {
            Self::Postgres(t) => {
                t.db.batch_execute(sql)
                    .await
                    .unwrap_or_else(|e| panic!("{sql}: {e}"))
            }
            Self::Mysql(t) => t.execute(sql).await,
        }
    }

    /// Inserts `rows` in one transaction.
    pub async fn insert(&self, rows: &[NewRow]) -> Vec<Inserted> {
        match self {
            Self::Postgres(t) => t.insert(rows).await,
            Self::Mysql(t) => t.insert(rows).await,
        }
    }

    /// Inserts `rows` in one transaction; their ids, in insert order.
    pub async fn insert_ids(&self, rows: &[NewRow]) -> Vec<Uuid> {
        self.insert(rows).await.into_iter().map(|r| r.id).collect()
    }

    /// Inserts one row; its id.
    pub async fn insert_one(&self, row: NewRow) -> Uuid {
        self.insert(&[row]).await[0].id
    }

    /// Every row, in `seq` order.
    pub async fn rows(&self) -> Vec<RowState> {
        match self {
            Self::Postgres(t) => t.rows().await,
            Self::Mysql(t) => t.rows().await,
        }
    }

    /// One row by id.
    pub async fn row(&self, id: Uuid) -> RowState {
        match self {
            Self::Postgres(t) => t.row(id).await,
            Self::Mysql(t) => t.row(id).await,
        }
    }

    /// Rows matching `ids`, keyed by id.
    pub async fn rows_by_id(&self, ids: &[Uuid]) -> HashMap<Uuid, RowState> {
        match self {
            Self::Postgres(t) => t.rows_by_id(ids).await,
            Self::Mysql(t) => t.rows_by_id(ids).await,
        }
    }

    /// `SELECT count(*) FROM <table> WHERE <condition>` (test-authored SQL, read the same on
    /// both databases).
    pub async fn count_where(&self, condition: &str) -> i64 {
        match self {
            Self::Postgres(t) => t.count_where(condition).await,
            Self::Mysql(t) => t.count_where(condition).await,
        }
    }

    /// Row counts by status, every status present (absent ones are 0).
    pub async fn status_counts(&self) -> BTreeMap<String, i64> {
        let statuses = ["pending", "processing", "sent", "failed", "expired"];
        let mut out = BTreeMap::from(statuses.map(|s| (s.to_owned(), 0)));
        match self {
            Self::Postgres(t) => out.extend(t.status_counts().await),
            Self::Mysql(t) => out.extend(t.status_counts().await),
        }
        out
    }

    /// The database's clock (the one `sent_at` and `locked_at` are written with).
    pub async fn db_now(&self) -> DateTime<Utc> {
        match self {
            Self::Postgres(t) => t.db_now().await,
            Self::Mysql(t) => t.db_now().await,
        }
    }

    crate::db::table_waits!(name());

    /// Drops the table and what its migration created.
    pub async fn drop_table(self) {
        match self {
            Self::Postgres(t) => t.drop_table().await,
            Self::Mysql(t) => t.drop_table().await,
        }
    }
}
