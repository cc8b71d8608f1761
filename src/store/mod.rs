//! The outbox table's store: every SQL statement the relay runs, behind one [`Store`] that the
//! claim loop, the background tasks and the operator commands use without knowing which
//! database holds the table.
//! - [`postgres`]: PostgreSQL 13+ (the ordering guard's snapshots, NOTIFY wake-up, VACUUM,
//!   partitioned tables);
//! - [`mysql`]: MySQL 8.0.1+ and MariaDB 10.6+ (InnoDB, `SKIP LOCKED`, polling).
//!
//! The row types the loop and the commands exchange with a store ([`Claim`], [`Failure`],
//! [`StatusReport`], …) are the same for both.

#[cfg(test)]
mod checked_in;
mod instance;
pub mod mysql;
pub mod postgres;
mod round;

pub use instance::{LockHolder, LockSession, SessionId};
pub use round::{Claim, ClaimRequest, Expired, ExpirySweep};

pub use postgres::{BACKEND_PID_SQL, StaleSessions, listen_sql, make_tls, pg_config, tls_required};
pub use postgres::{
    Backlog, DeadLetter, FailOutcome, Failure, OnConfirm, SchemaPlan, SchemaState, Selection,
    StatusCounts, StatusReport, TableHealth, WriterSnapshot,
};
pub use postgres::{
    COUNT_CAP, ConsoleCounts, DeadLetterPage, DeadLetterRow, MessageRow, PageRequest,
};
pub use postgres::{MAINTENANCE_TIMEOUT_FACTOR, PgStore, partitions, schema, steps};

/// The relay's own hot-path statements and session settings, for the benchmark (`bench/`).
#[cfg(feature = "bench")]
pub use postgres::bench;

use std::time::Duration;

use uuid::Uuid;

use crate::config::{DatabaseConfig, DatabaseKind, Ordering, OutboxConfig, TableName};
use crate::error_chain;
use crate::message::{OutboxMessage, PayloadKind};
use mysql::MysqlStore;

/// With ordering `aggregate`, the backlog gauge's ready age looks for claimable heads among
/// this many pending rows from the first (in `seq` order), on either database. Whether a row
/// is its aggregate's head is one index probe per row: over a whole backlog of 100,000 rows
/// that is 0.6 s (PostgreSQL) to seconds (MariaDB) every refresh, while the oldest ready rows
/// are at the front of the queue, which is all an ordered claim reads too.
pub(crate) const HEAD_REACH: usize = 5_000;

/// A database failure; none of these carry the connection URL.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No connection could be had from the pool (database down, pool exhausted, timeout).
    #[error("cannot get a database connection: {}{}", error_chain(.0), certificate_hint(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
    /// A statement failed.
    #[error("database error: {}{}", error_chain(.0), certificate_hint(.0))]
    Db(#[from] tokio_postgres::Error),
    /// A MySQL/MariaDB statement or connection failed.
    #[error("database error: {}{}", error_chain(.0), mysql::hint(.0))]
    Mysql(#[from] mysql_async::Error),
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

/// Whether a TLS handshake among `e` and its causes failed on the server's certificate
/// (unknown CA, another name, expired): configuration to fix, not an outage to wait out.
pub(crate) fn untrusted_certificate(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        // An `io::Error`'s `source()` skips the error it wraps: look inside it too.
        let tls = err.downcast_ref::<rustls::Error>().or_else(|| {
            err.downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if matches!(tls, Some(rustls::Error::InvalidCertificate(_))) {
            return true;
        }
        next = err.source();
    }
    false
}

/// What to do about a PostgreSQL server whose certificate `sslmode=require` does not trust
/// (appended to the error's message; empty for any other error).
fn certificate_hint(e: &(dyn std::error::Error + 'static)) -> &'static str {
    if untrusted_certificate(e) {
        ": the server's certificate is not trusted for this host (sslmode=require verifies it \
         against the system trust store): connect by the host name the certificate is for, or \
         add the CA that signed it to the system trust store"
    } else {
        ""
    }
}

impl StoreError {
    /// Whether the error is a lost or refused connection rather than a bad statement. A
    /// server that refuses writes ([`StoreError::is_read_only`]) counts: until the relay
    /// reaches the one that takes them, it is an outage like any other. A server certificate
    /// that is not trusted does not: it stays untrusted until the configuration changes.
    pub fn is_connection(&self) -> bool {
        match self {
            Self::Pool(e) => !untrusted_certificate(e),
            Self::Db(e) if untrusted_certificate(e) => false,
            // Without an SQLSTATE: lost or refused connections, but also a value this side
            // could not convert (a bug, not an outage: it must not be logged as one).
            Self::Db(e) => {
                e.is_closed() || (e.code().is_none() && !is_conversion(e)) || self.is_read_only()
            }
            Self::Mysql(e) => mysql::is_connection(e),
            Self::Timeout(_) => true,
            Self::Schema(_)
            | Self::Build(_)
            | Self::Locked(_)
            | Self::NotDeadLetters(_)
            | Self::InstanceTaken { .. } => false,
        }
    }

    /// `Ok` when every id of `given` is among the dead letters `found`; else
    /// [`StoreError::NotDeadLetters`] naming the others (the dead-letter commands act on all
    /// the ids given or on none).
    pub fn unless_all_dead(given: &[Uuid], found: &[Uuid]) -> Result<(), StoreError> {
        let missing: Vec<Uuid> = given
            .iter()
            .filter(|id| !found.contains(id))
            .copied()
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(Self::NotDeadLetters(missing))
        }
    }

    /// Whether the server refused a statement because the relay's user lacks a privilege on
    /// the table (PostgreSQL's SQLSTATE 42501; MySQL's 1142 and 1143, a command or column
    /// denied): configuration, not an outage, though retrying works once it is granted.
    pub fn is_permission_denied(&self) -> bool {
        match self {
            Self::Db(e) => {
                e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE)
            }
            Self::Mysql(mysql_async::Error::Server(s)) => matches!(s.code, 1142 | 1143),
            _ => false,
        }
    }

    /// The document that lists the grants the relay's user needs on this error's database
    /// (what to read after [`StoreError::is_permission_denied`]).
    pub fn grants_doc(&self) -> &'static str {
        match self {
            Self::Mysql(_) => "docs/mysql.md",
            _ => "docs/security.md",
        }
    }

    /// Whether the server refused a write because it is read-only (SQLSTATE 25006): a
    /// primary turned read-only, or a standby (in recovery) that the session reached. The
    /// statement was rolled back; the session must be given up for one on the server that
    /// takes writes now ([`Store::note_error`]).
    pub fn is_read_only(&self) -> bool {
        matches!(self, Self::Db(e)
            if e.code() == Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION))
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
            Self::Mysql(e) => mysql::answer_may_be_lost(e),
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

/// One outbox table in its database: PostgreSQL or MySQL/MariaDB. Cheap to clone (a pool
/// handle and the table's rendered statements).
#[derive(Clone)]
pub enum Store {
    /// A PostgreSQL table.
    Postgres(PgStore),
    /// A MySQL or MariaDB table.
    Mysql(MysqlStore),
}

/// Runs `$body` with `$s` bound to whichever store `$self` is.
macro_rules! either {
    ($self:expr, $s:ident => $body:expr) => {
        match $self {
            Store::Postgres($s) => $body,
            Store::Mysql($s) => $body,
        }
    };
}

impl Store {
    /// A store for the table of `cfg`, on the database its URL names (connecting lazily).
    pub fn new(cfg: &DatabaseConfig, instance_id: &str) -> Result<Self> {
        Ok(match cfg.kind {
            DatabaseKind::Postgres => Self::Postgres(PgStore::new(cfg, instance_id)?),
            DatabaseKind::Mysql => Self::Mysql(MysqlStore::new(cfg, instance_id)?),
        })
    }

    /// One store per outbox, in order; outboxes on the same database URL share one pool.
    pub fn for_outboxes<'a>(
        outboxes: impl IntoIterator<Item = &'a OutboxConfig>,
        instance_id: &str,
    ) -> Result<Vec<Self>> {
        let mut pools: Vec<(&str, Self)> = Vec::new();
        let mut out = Vec::new();
        for o in outboxes {
            let store = match pools.iter().find(|(url, _)| *url == o.database.url) {
                Some((_, pool)) => pool.for_table(&o.database.table),
                None => {
                    let store = Self::new(&o.database, instance_id)?;
                    pools.push((&o.database.url, store.clone()));
                    store
                }
            };
            out.push(store);
        }
        Ok(out)
    }

    /// Another table in the same database, sharing this store's pool.
    pub fn for_table(&self, table: &TableName) -> Self {
        match self {
            Self::Postgres(s) => Self::Postgres(s.for_table(table)),
            Self::Mysql(s) => Self::Mysql(s.for_table(table)),
        }
    }

    /// The PostgreSQL store, for what only PostgreSQL has (NOTIFY wake-up, VACUUM, partitions).
    pub fn as_postgres(&self) -> Option<&PgStore> {
        match self {
            Self::Postgres(s) => Some(s),
            Self::Mysql(_) => None,
        }
    }

    /// Which database holds the table.
    pub fn kind(&self) -> DatabaseKind {
        match self {
            Self::Postgres(_) => DatabaseKind::Postgres,
            Self::Mysql(_) => DatabaseKind::Mysql,
        }
    }

    /// The configured table.
    pub fn table(&self) -> &TableName {
        either!(self, s => s.table())
    }

    /// `database.partition_interval`, when set (PostgreSQL only).
    pub fn partition_interval(&self) -> Option<Duration> {
        match self {
            Self::Postgres(s) => s.partition_interval(),
            Self::Mysql(_) => None,
        }
    }

    /// This relay's `locked_by` value.
    pub fn instance_id(&self) -> &str {
        either!(self, s => s.instance_id())
    }

    /// Looks at a failed statement's error: a PostgreSQL server that refused the write as
    /// read-only has its sessions given up ([`PgStore::note_error`]). Returns whether it did.
    pub fn note_error(&self, e: &StoreError) -> bool {
        match self {
            Self::Postgres(s) => s.note_error(e),
            Self::Mysql(_) => false,
        }
    }

    /// `database.query_timeout`.
    pub fn query_timeout(&self) -> Duration {
        either!(self, s => s.query_timeout())
    }

    /// Runs `call` (one of this store's operations) within `database.query_timeout`: a
    /// database that accepts connections but stops answering becomes [`StoreError::Timeout`],
    /// a connection-level failure, instead of a hang ([`PgStore::bounded`],
    /// [`MysqlStore::bounded`]).
    pub async fn bounded<T>(&self, call: impl Future<Output = Result<T>>) -> Result<T> {
        either!(self, s => s.bounded(call).await)
    }

    /// [`Store::bounded`] with [`MAINTENANCE_TIMEOUT_FACTOR`] times the deadline, for the
    /// maintenance tasks' calls.
    pub async fn bounded_maintenance<T>(&self, call: impl Future<Output = Result<T>>) -> Result<T> {
        either!(self, s => s.bounded_maintenance(call).await)
    }

    /// Round trip to the database.
    pub async fn ping(&self) -> Result<()> {
        either!(self, s => s.ping().await)
    }

    /// Expires pending rows past their deadline, then claims ready rows, as `request` says
    /// (see [`PgStore::claim_and_expire`] and [`MysqlStore::claim_and_expire`]).
    pub async fn claim_and_expire(&self, request: ClaimRequest) -> Result<Claim> {
        match self {
            Self::Postgres(s) => s.claim_and_expire(request).await,
            Self::Mysql(s) => {
                s.claim_and_expire(request.ordering, request.limit, request.sweep)
                    .await
            }
        }
    }

    /// Claims up to `limit` ready rows (expiring those past their deadline first).
    pub async fn claim(
        &self,
        ordering: Ordering,
        limit: usize,
        watermark: i64,
    ) -> Result<Vec<OutboxMessage>> {
        let request = ClaimRequest {
            ordering,
            limit,
            watermark,
            sweep: ExpirySweep::Mark,
            parts: 1,
        };
        Ok(self.claim_and_expire(request).await?.rows)
    }

    /// The ordering guard's observation: the highest `seq` that is final, and the table's
    /// writers (PostgreSQL). On MySQL the claim itself checks each aggregate's earlier rows,
    /// so every `seq` is released here.
    pub async fn observe(&self, table_oid: u32) -> Result<(i64, WriterSnapshot)> {
        match self {
            Self::Postgres(s) => s.observe(table_oid).await,
            Self::Mysql(_) => Ok((i64::MAX, WriterSnapshot::default())),
        }
    }

    /// Whether a row reclaimed from a dead relay is ready to be claimed.
    pub async fn suspects_waiting(&self, watermark: i64) -> Result<bool> {
        match self {
            Self::Postgres(s) => s.suspects_waiting(watermark).await,
            Self::Mysql(s) => s.suspects_waiting().await,
        }
    }

    /// Claims one row that a dead relay held, if any is ready, to publish it alone.
    pub async fn claim_suspect(&self, watermark: i64) -> Result<Option<OutboxMessage>> {
        match self {
            Self::Postgres(s) => s.claim_suspect(watermark).await,
            Self::Mysql(s) => s.claim_suspect().await,
        }
    }

    /// Confirmed rows become `sent` (or are deleted).
    pub async fn mark_sent(&self, ids: &[Uuid], on_confirm: OnConfirm) -> Result<u64> {
        either!(self, s => s.mark_sent(ids, on_confirm).await)
    }

    /// Rejected rows back off, or become dead letters after `max_attempts`.
    pub async fn fail(&self, failures: &[Failure], max_attempts: u32) -> Result<FailOutcome> {
        either!(self, s => s.fail(failures, max_attempts).await)
    }

    /// Hands rows back to `pending` without spending an attempt.
    pub async fn hand_back(&self, ids: &[Uuid]) -> Result<u64> {
        either!(self, s => s.hand_back(ids).await)
    }

    /// Hands back the rows claimed in this relay's name that it does not hold.
    pub async fn hand_back_unheld(&self, held: &[Uuid], lease: Duration) -> Result<u64> {
        either!(self, s => s.hand_back_unheld(held, lease).await)
    }

    /// Renews this relay's leases on `ids`.
    pub async fn heartbeat(&self, ids: &[Uuid]) -> Result<u64> {
        either!(self, s => s.heartbeat(ids).await)
    }

    /// Reclaims rows whose lease ran out: (reclaimed, dead-lettered).
    pub async fn reclaim_expired(&self, lease: Duration, max_attempts: u32) -> Result<(u64, u64)> {
        either!(self, s => s.reclaim_expired(lease, max_attempts).await)
    }

    /// Whether any row is pending.
    pub async fn any_pending(&self) -> Result<bool> {
        either!(self, s => s.any_pending().await)
    }

    /// The backlog gauges' figures.
    pub async fn backlog(&self, ordering: Ordering) -> Result<Backlog> {
        either!(self, s => s.backlog(ordering).await)
    }

    /// Deletes the waiting records of relays whose LISTEN session ended (PostgreSQL).
    pub async fn clean_waiters(&self) -> Result<u64> {
        match self {
            Self::Postgres(s) => s.clean_waiters().await,
            Self::Mysql(_) => Ok(0),
        }
    }

    /// One batch of retention's delete; how many rows went.
    pub async fn cleanup_batch(&self, retention: Duration, batch: usize) -> Result<u64> {
        either!(self, s => s.cleanup_batch(retention, batch).await)
    }

    /// Counts by status, overall and per aggregate type.
    pub async fn status(&self) -> Result<StatusReport> {
        either!(self, s => s.status().await)
    }

    /// Up to `limit` dead letters, oldest first.
    pub async fn dead_letters(&self, limit: i64) -> Result<Vec<DeadLetter>> {
        either!(self, s => s.dead_letters(limit).await)
    }

    /// Sets dead letters back to `pending` with their attempts reset; the ids changed.
    pub async fn retry_dead_letters(&self, sel: &Selection) -> Result<Vec<Uuid>> {
        either!(self, s => s.retry_dead_letters(sel).await)
    }

    /// Deletes dead letters; the ids deleted.
    pub async fn discard_dead_letters(&self, sel: &Selection) -> Result<Vec<Uuid>> {
        either!(self, s => s.discard_dead_letters(sel).await)
    }

    /// The console's counts: rows in flight, sent and expired (each up to [`COUNT_CAP`]).
    pub async fn console_counts(&self) -> Result<ConsoleCounts> {
        either!(self, s => s.console_counts().await)
    }

    /// The page of dead letters `asked` for, with their number (up to [`COUNT_CAP`]).
    pub async fn dead_letter_page(&self, asked: PageRequest) -> Result<DeadLetterPage> {
        either!(self, s => s.dead_letter_page(asked).await)
    }

    /// The row with `id`, whatever its status, for the console's lookup.
    pub async fn console_message(
        &self,
        id: Uuid,
        show_payloads: bool,
    ) -> Result<Option<MessageRow>> {
        either!(self, s => s.console_message(id, show_payloads).await)
    }

    /// Which of `ids` are dead letters.
    pub async fn which_dead_letters(&self, ids: &[Uuid]) -> Result<Vec<Uuid>> {
        either!(self, s => s.which_dead_letters(ids).await)
    }

    /// What start-up must do to the schema (with `auto_migrate`), or why it cannot start.
    pub async fn plan_schema(&self, auto_migrate: bool) -> Result<SchemaPlan> {
        either!(self, s => s.plan_schema(auto_migrate).await)
    }

    /// Applies the schema versions the table lacks; the versions applied.
    pub async fn migrate(&self) -> Result<Vec<i32>> {
        either!(self, s => s.migrate().await)
    }

    /// The table's recorded schema version and whether it exists.
    pub async fn schema_state(&self) -> Result<SchemaState> {
        either!(self, s => s.schema_state().await)
    }

    /// Checks the table's columns; its payload kind and (PostgreSQL) oid.
    pub async fn inspect(&self) -> Result<(PayloadKind, u32)> {
        either!(self, s => s.inspect().await)
    }

    /// Whether the relay's user may update and delete the table's rows (`check`): nothing is
    /// changed.
    pub async fn may_write(&self) -> Result<()> {
        either!(self, s => s.may_write().await)
    }

    /// The DDL `migrate` applies to the table of `cfg` (`migrate --print`), for its database.
    pub fn ddl_for(cfg: &DatabaseConfig) -> String {
        match cfg.kind {
            DatabaseKind::Postgres => {
                let mut ddl = schema::full_ddl(&cfg.table);
                if let Some(interval) = cfg.partition_interval {
                    ddl.push_str(&schema::partitioning_note(&cfg.table, interval));
                }
                ddl
            }
            DatabaseKind::Mysql => mysql::schema::full_ddl(&cfg.table),
        }
    }
}
