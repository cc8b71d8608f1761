//! PostgreSQL: every statement the relay runs lives in this module, by concern:
//! - `claim`: the hot path's claims — by ordering mode, a suspect on its own — and the
//!   expiry sweep run with them;
//! - `settle`: settling claimed rows (sent, failed, handed back), lease renewal and reclaim;
//! - `observe`: the ordering watermark's observation;
//! - `predicates`: the SQL conditions several statements share;
//! - `waiting`: the idle relay's wake-up record;
//! - `maintenance`: the background tasks' backlog gauges, table health
//!   and `VACUUM`;
//! - `operator`: `status`, dead-letter commands and retention cleanup;
//! - [`partitions`]: a partitioned table's conversion, partitions ahead and retention by
//!   dropping partitions;
//! - [`schema`]: the DDL in `sql/`, migrations and the start-up inspection of the table;
//! - [`steps`]: a migration file cut into the steps `migrate` runs (short transactions, and
//!   index builds `CONCURRENTLY` outside any);
//! - `connect`: the URL, TLS, the pool and its session settings, and the
//!   LISTEN session's statements;
//! - `instance`: the instance lock (an advisory lock on `relay.instance_id` and the table, on
//!   a session of its own);
//! - `bench` (the `bench` feature only): the hot-path statements and session settings, for the
//!   benchmark's pgbench ceiling.
//!
//! Each file renders its statements once for the configured table ([`TableName`] is
//! validated, so splicing it is safe) and runs them through [`Store`].

mod claim;
mod connect;
mod instance;
mod maintenance;
mod observe;
mod operator;
pub mod partitions;
mod predicates;
pub mod schema;
mod settle;
pub mod steps;
mod waiting;

pub use claim::{Claim, Expired, ExpirySweep};
pub use connect::{BACKEND_PID_SQL, listen_sql, make_tls, pg_config, tls_required};
pub use instance::{LockHolder, LockSession, SessionId};
pub use maintenance::{Backlog, TableHealth};
pub use observe::WriterSnapshot;
pub use operator::{DeadLetter, Selection, StatusCounts, StatusReport};
pub use schema::{SchemaPlan, SchemaState};
pub use settle::{FailOutcome, Failure, OnConfirm};

/// The relay's own hot-path statements and session settings, for the benchmark (`bench/`), whose
/// pgbench ceiling replays them outside the relay. Behind the `bench` feature, which only the
/// benchmark turns on: they are not part of the library's API.
#[cfg(feature = "bench")]
pub mod bench {
    pub use super::claim::{HotPathSql, hot_path_sql, scan_window};
    pub use super::connect::SESSION_SETTINGS;
}

use deadpool_postgres::Pool;
use uuid::Uuid;

use crate::config::TableName;

/// A database failure; none of these carry the connection URL.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No connection could be had from the pool (database down, pool exhausted, timeout).
    #[error("cannot get a database connection: {}", chain(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
    /// A statement failed.
    #[error("database error: {}", chain(.0))]
    Db(#[from] tokio_postgres::Error),
    /// The schema is missing or not what the relay expects.
    #[error("{0}")]
    Schema(String),
    /// The URL could not be turned into a pool.
    #[error("cannot build the connection pool: {0}")]
    Build(String),
    /// `migrate` could not have a lock it needs on the table within its `lock_timeout`; the
    /// sentence names who holds it and says to run `migrate` again.
    #[error("{0}")]
    Locked(String),
    /// Some ids given to a dead-letter command are not dead letters; nothing was changed.
    #[error("not dead letters (nothing was changed): {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))]
    NotDeadLetters(Vec<Uuid>),
    /// Another relay with this relay's `relay.instance_id` holds the instance lock of `table`
    /// (see [`LockSession::lock`]).
    #[error(
        "another relay with relay.instance_id {instance:?} serves {table} in {database} (its session: {holder}): give every relay its own relay.instance_id (left unset it is the host name and pid), or stop the other relay first"
    )]
    InstanceTaken {
        /// The instance id.
        instance: String,
        /// The outbox table.
        table: String,
        /// The database, its URL's password masked.
        database: String,
        /// Who holds the lock.
        holder: String,
    },
    /// The database did not answer within the call's deadline ([`Store::bounded`]): an outage,
    /// like a lost connection; the statement may still have run.
    #[error("the database did not answer within {} (database.query_timeout)", humantime::format_duration(*.0))]
    Timeout(std::time::Duration),
}

/// An error and its causes, `outer: inner: innermost` (tokio-postgres hides the cause of
/// connection and TLS failures behind a generic message).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

impl StoreError {
    /// Whether the error is a lost or refused connection rather than a bad statement.
    pub fn is_connection(&self) -> bool {
        match self {
            Self::Pool(_) => true,
            // Without an SQLSTATE: lost or refused connections, but also a value this side
            // could not convert (a bug, not an outage: it must not be logged as one).
            Self::Db(e) => e.is_closed() || (e.code().is_none() && !is_conversion(e)),
            Self::Timeout(_) => true,
            Self::Schema(_)
            | Self::Build(_)
            | Self::Locked(_)
            | Self::NotDeadLetters(_)
            | Self::InstanceTaken { .. } => false,
        }
    }

    /// Whether a statement that failed this way may have run to its commit with its answer
    /// lost on the way: the connection closed or broke (an I/O error) under it, or no answer
    /// came in time (the statement may run when the database answers again). Not a pool
    /// timeout (nothing was sent), a server error (rolled back) or a value that could not be
    /// decoded (the answer arrived).
    pub fn answer_may_be_lost(&self) -> bool {
        match self {
            Self::Db(e) => {
                e.is_closed()
                    || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
            }
            Self::Timeout(_) => true,
            _ => false,
        }
    }
}

/// Whether `e` is a value the client could not convert or a statement it refused before
/// sending it (tokio-postgres says so only in its message).
fn is_conversion(e: &tokio_postgres::Error) -> bool {
    let text = e.to_string();
    [
        "error serializing",
        "error deserializing",
        "invalid column",
        "expected ",
        "query returned an unexpected number of rows",
    ]
    .iter()
    .any(|p| text.starts_with(p))
}

/// Short alias for store results.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// The SQL text of every statement, rendered once for the configured table.
#[derive(Debug, Clone)]
struct Queries {
    claim: claim::ClaimSql,
    settle: settle::SettleSql,
    observe: observe::ObserveSql,
    waiting: waiting::WaitingSql,
    maintenance: maintenance::MaintenanceSql,
    operator: operator::OperatorSql,
}

/// How many times `database.query_timeout` the maintenance work (retention deletes, `VACUUM`,
/// `ANALYZE`, partitions) may take per call ([`Store::bounded_maintenance`]): such statements
/// legitimately run for minutes on a large table.
pub const MAINTENANCE_TIMEOUT_FACTOR: u32 = 20;

/// The outbox table and its connection pool.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    table: TableName,
    instance_id: String,
    // `database.partition_interval`: `migrate` partitions the table with it.
    partition_interval: Option<std::time::Duration>,
    // `database.query_timeout`: see `Store::bounded`.
    query_timeout: std::time::Duration,
    q: std::sync::Arc<Queries>,
}

impl Store {
    /// The configured table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// `database.partition_interval`, when set.
    pub fn partition_interval(&self) -> Option<std::time::Duration> {
        self.partition_interval
    }

    /// This relay's `locked_by` value.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// A pooled connection (for callers such as tests and CLI tools).
    pub async fn client(&self) -> Result<deadpool_postgres::Object> {
        Ok(self.pool.get().await?)
    }

    /// `database.query_timeout`.
    pub fn query_timeout(&self) -> std::time::Duration {
        self.query_timeout
    }

    /// Runs `call` (one of this store's operations) within `database.query_timeout`: a
    /// database that accepts connections but stops answering (a black hole, a hung server)
    /// becomes [`StoreError::Timeout`], a connection-level failure, instead of a hang. The
    /// claim loop, the lease and backlog tasks and the wake-up record call the database
    /// through this.
    pub async fn bounded<T>(&self, call: impl Future<Output = Result<T>>) -> Result<T> {
        self.within(self.query_timeout, call).await
    }

    /// [`Store::bounded`] with [`MAINTENANCE_TIMEOUT_FACTOR`] times the deadline, for the
    /// maintenance tasks' calls.
    pub async fn bounded_maintenance<T>(&self, call: impl Future<Output = Result<T>>) -> Result<T> {
        let limit = self
            .query_timeout
            .saturating_mul(MAINTENANCE_TIMEOUT_FACTOR);
        self.within(limit, call).await
    }

    /// `call` within `limit`. When it gets no answer in time, the idle connections of the pool
    /// are dropped too (the one that got none is back among them by then): the next call
    /// connects afresh instead of queueing behind a statement that may never be answered.
    async fn within<T>(
        &self,
        limit: std::time::Duration,
        call: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(limit, call).await {
            Ok(result) => result,
            Err(_) => {
                self.pool.retain(|_, _| false);
                Err(StoreError::Timeout(limit))
            }
        }
    }

    /// Round trip to the database.
    pub async fn ping(&self) -> Result<()> {
        self.client().await?.simple_query("SELECT 1").await?;
        Ok(())
    }

    /// Runs the one-row statement `sql` whose only parameter, `$1`, is the table's oid.
    async fn query_one_by_oid(&self, sql: &str, table_oid: u32) -> Result<tokio_postgres::Row> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(sql).await?;
        Ok(client.query_one(&stmt, &[&table_oid]).await?)
    }
}
