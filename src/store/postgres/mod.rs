//! The PostgreSQL store: every statement the relay runs on a PostgreSQL outbox lives in this
//! module, by concern:
//! - `claim`: the hot path's claims — by ordering mode, a suspect on its own — and the
//!   expiry sweep run with them;
//! - `settle`: settling claimed rows (sent, failed, handed back), lease renewal and reclaim;
//! - `observe`: the ordering watermark's observation;
//! - `predicates`: the SQL conditions several statements share;
//! - `waiting`: the idle relay's wake-up record;
//! - `maintenance`: the background tasks' backlog gauges, table health
//!   and `VACUUM`;
//! - `operator`: `status`, dead-letter commands and retention cleanup;
//! - `console`: the web console's bounded reads (counts, a page of dead letters, one message);
//! - [`partitions`]: a partitioned table's conversion, partitions ahead and retention by
//!   dropping partitions;
//! - [`schema`]: applying the migrations, and the start-up inspection of the table;
//! - [`migrations`]: every migration as explicit statements, each saying how it runs, the
//!   table's names as placeholders (`sql/` holds them rendered for the default table);
//! - [`steps`]: those statements grouped into the steps `migrate` runs (short transactions,
//!   and index builds `CONCURRENTLY` outside any);
//! - `connect`: the URL, TLS, the pool and its session settings, and the
//!   LISTEN session's statements;
//! - `instance`: the instance lock (an advisory lock on `relay.instance_id` and the table, on
//!   a session of its own);
//! - `bench` (the `bench` feature only): the hot-path statements and session settings, for the
//!   benchmark's pgbench ceiling.
//!
//! Each file renders its statements once for the configured table ([`TableName`] is
//! validated, so splicing it is safe) and runs them through [`PgStore`].

mod claim;
mod connect;
mod console;
mod instance;
mod maintenance;
pub mod migrations;
mod observe;
mod operator;
mod partitioned_index;
pub mod partitions;
mod predicates;
pub mod schema;
mod settle;
pub mod steps;
mod waiting;

pub(crate) use claim::scan_window;
pub use connect::{BACKEND_PID_SQL, StaleSessions, listen_sql, make_tls, pg_config, tls_required};
pub use console::{
    COUNT_CAP, ConsoleCounts, DeadLetterPage, DeadLetterRow, MessageRow, PageRequest,
};
pub use instance::LockSession;
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
    pub use super::claim::{CLAIMED_IDS, HotPathSql, hot_path_sql, scan_window};
    pub use super::connect::SESSION_SETTINGS;
}

use deadpool_postgres::Pool;

pub use super::{Result, StoreError};

use crate::config::TableName;

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
/// `ANALYZE`, partitions) may take per call ([`PgStore::bounded_maintenance`]): such statements
/// legitimately run for minutes on a large table.
pub const MAINTENANCE_TIMEOUT_FACTOR: u32 = 20;

/// The outbox table and its connection pool.
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
    table: TableName,
    instance_id: String,
    // `database.partition_interval`: `migrate` partitions the table with it.
    partition_interval: Option<std::time::Duration>,
    // `database.query_timeout`: see `PgStore::bounded`.
    query_timeout: std::time::Duration,
    q: std::sync::Arc<Queries>,
    // Shared with the pool's recycle hook and the LISTEN session: a read-only refusal makes
    // the relay give up its sessions on that server.
    stale: StaleSessions,
    // Whether the table has schema version 7's `<table>_blocker_idx`, with which the ordered
    // claim hashes the blocked aggregates instead of probing each candidate's head: see
    // `PgStore::has_blocker_index`.
    blocker_index: std::sync::Arc<std::sync::atomic::AtomicU8>,
}

impl PgStore {
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

    /// Looks at a failed statement's error: when the server refused the write as read-only,
    /// every session made so far is given up (closed at its next checkout instead of
    /// reused, the LISTEN session started over), so that the next ones find the server that
    /// takes writes now (`target_session_attrs=read-write` in a multi-host URL). Returns
    /// whether it did.
    pub fn note_error(&self, e: &StoreError) -> bool {
        if !e.is_read_only() {
            return false;
        }
        self.stale.mark();
        tracing::warn!(table = %self.table, "the database refused a write as read-only (SQLSTATE 25006): leaving the sessions on that server to reconnect to the one that takes writes");
        true
    }

    /// The sessions given up on read-only refusals (for the LISTEN session, which is not
    /// pooled).
    pub fn stale_sessions(&self) -> &StaleSessions {
        &self.stale
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

    /// [`PgStore::bounded`] with [`MAINTENANCE_TIMEOUT_FACTOR`] times the deadline, for the
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_checked_in() {
        let t = TableName::parse("outbox_messages").unwrap_or_else(|e| panic!("{e}"));
        let (c, s) = (claim::ClaimSql::new(&t), settle::SettleSql::new(&t, false));
        let (o, w) = (observe::ObserveSql::new(&t), waiting::WaitingSql::new(&t));
        let (m, op) = (
            maintenance::MaintenanceSql::new(&t),
            operator::OperatorSql::new(&t),
        );
        let catalog = [
            ("claim.claim_none", &c.claim_none),
            ("claim.claim_aggregate", &c.claim_aggregate),
            ("claim.claim_aggregate_probing", &c.claim_aggregate_probing),
            ("claim.suspects_waiting", &c.suspects_waiting),
            ("claim.claim_suspect", &c.claim_suspect),
            ("claim.expire", &c.expire),
            ("claim.expire_delete", &c.expire_delete),
            ("settle.mark_sent", &s.mark_sent),
            ("settle.delete_sent", &s.delete_sent),
            ("settle.fail", &s.fail),
            ("settle.hand_back", &s.hand_back),
            ("settle.hand_back_unheld", &s.hand_back_unheld),
            ("settle.heartbeat", &s.heartbeat),
            ("settle.reclaim", &s.reclaim),
            ("observe.last_seq", &o.last_seq),
            ("observe.writers", &o.writers),
            ("waiting.mark_waiting", &w.mark_waiting),
            ("waiting.unmark_waiting", &w.unmark_waiting),
            ("waiting.writers_active", &w.writers_active),
            ("waiting.clean_waiters", &w.clean_waiters),
            ("waiting.has_waiters", &w.has_waiters),
            ("maintenance.backlog_none", &m.backlog_none),
            ("maintenance.backlog_aggregate", &m.backlog_aggregate),
            ("maintenance.any_pending", &m.any_pending),
            ("maintenance.table_health", &m.table_health),
            ("maintenance.vacuum", &m.vacuum),
            ("maintenance.vacuum_analyze", &m.vacuum_analyze),
            ("maintenance.analyze", &m.analyze),
            ("operator.status", &op.status),
            ("operator.blocked_by_type", &op.blocked_by_type),
            ("operator.dead_letters", &op.dead_letters),
            ("operator.retry_dead", &op.retry_dead),
            ("operator.discard_dead", &op.discard_dead),
            ("operator.which_dead", &op.which_dead),
            ("operator.cleanup", &op.cleanup),
        ]
        .map(|(n, s)| (n.to_owned(), s.clone()));
        crate::store::checked_in::check("postgres", &catalog);
    }
}
