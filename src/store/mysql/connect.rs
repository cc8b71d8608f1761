//! Connections: the `mysql://` URL with its TLS options (`ssl-mode`, `ssl-ca`, as the MySQL
//! clients spell them), the pool, and the settings of every pooled session.

use std::sync::Arc;
use std::time::Duration;

use mysql_async::{Opts, OptsBuilder, Pool, PoolConstraints, PoolOpts};

use super::claim::ClaimSql;
use super::claim_lock::ClaimLockSql;
use super::operator::OperatorSql;
use super::settle::SettleSql;
use super::{MysqlStore, Queries, Result, StoreError};
use crate::config::{DatabaseConfig, TableName};
use crate::redact::redact_url;

/// Run on every new pooled session:
/// - READ COMMITTED: InnoDB takes no gap locks for the relay's locking reads and updates, so
///   an application's `INSERT` (an insert-intention lock on a gap) never waits for the relay;
/// - time zone UTC: `TIMESTAMP` columns read as UTC;
/// - short lock waits: the relay's statements skip or probe locked rows (`SKIP LOCKED`,
///   `NOWAIT`); a wait longer than this is a conflict to retry, not a queue to join;
/// - a short idle limit ([`IDLE_SESSION_SECS`]): a relay stopped in the middle of a claim (a
///   paused VM, SIGSTOP, a host cut off) holds the rows its open transaction locked, which
///   holds every other relay back; the server drops the silent session after that long and
///   rolls the claim back (its default is 8 hours).
pub const SESSION_SETTINGS: &[&str] = &[
    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
    "SET time_zone = '+00:00'",
    "SET SESSION innodb_lock_wait_timeout = 5",
    "SET SESSION lock_wait_timeout = 5",
    "SET SESSION wait_timeout = 60",
];

/// The sessions' idle limit on the server, in seconds (`SET SESSION wait_timeout` above).
pub const IDLE_SESSION_SECS: usize = 60;

/// The connection options of `url` ([`crate::config::mysql_opts`]).
fn opts(url: &str) -> Result<Opts> {
    crate::config::mysql_opts(url)
        .map_err(|why| StoreError::Build(format!("{}: {why}", redact_url(url))))
}

impl MysqlStore {
    /// Builds the pool; connects lazily, so this succeeds while the database is down.
    pub fn new(cfg: &DatabaseConfig, instance_id: &str) -> Result<Self> {
        let base = opts(&cfg.url)?;
        let constraints = PoolConstraints::new(0, cfg.pool_size.max(1))
            .ok_or_else(|| StoreError::Build("database.pool_size out of range".into()))?;
        let pool_opts = PoolOpts::default()
            .with_constraints(constraints)
            // Session settings are made once per connection (below), not after every use.
            .with_reset_connection(false)
            .with_inactive_connection_ttl(Duration::from_secs(60));
        let opts = OptsBuilder::from_opts(base)
            .pool_opts(pool_opts)
            .init(SESSION_SETTINGS.to_vec())
            // The pool takes a session idle for half the server's limit as gone, so it never
            // hands out one the server is about to drop.
            .wait_timeout(Some(IDLE_SESSION_SECS / 2))
            .tcp_keepalive(Some(Duration::from_secs(10)))
            .stmt_cache_size(64);
        let opts: Opts = opts.into();
        let pool = Pool::new(opts.clone());
        let mut store = Self::with_pool(pool, opts, &cfg.table, instance_id);
        store.query_timeout = cfg.query_timeout;
        Ok(store)
    }

    /// Another table in the same database, sharing this store's pool.
    pub fn for_table(&self, table: &TableName) -> Self {
        let mut store = Self::with_pool(
            self.pool.clone(),
            self.opts.clone(),
            table,
            &self.instance_id,
        );
        store.query_timeout = self.query_timeout;
        store
    }

    fn with_pool(pool: Pool, opts: Opts, table: &TableName, instance_id: &str) -> Self {
        Self {
            pool,
            opts,
            query_timeout: Duration::from_secs(30),
            table: table.clone(),
            instance_id: instance_id.to_owned(),
            q: Arc::new(Queries {
                claim: ClaimSql::new(table),
                claim_lock: ClaimLockSql::new(table),
                settle: SettleSql::new(table),
                operator: OperatorSql::new(table),
            }),
        }
    }
}
