//! The MySQL 8 / MariaDB store: every statement the relay runs on a MySQL outbox, by concern:
//! - `connect`: the URL (`ssl-mode`, `ssl-ca`), the pool and its session settings;
//! - [`schema`]: the DDL in `sql/mysql/`, `migrate` and the start-up inspection (server
//!   version, columns);
//! - `claim`: the claims by ordering mode (the ordering guard's gate and probe), a suspect on
//!   its own, and the expiry sweep;
//! - `claim_lock`: the named lock (`GET_LOCK`) under which the relays sharing a table take
//!   turns at ordered claims;
//! - `settle`: sent, rejected and handed-back rows, lease renewal and reclaim;
//! - `operator`: `status`, dead letters, the backlog gauges and retention;
//! - `console`: the web console's bounded reads;
//! - `instance`: the instance lock (`GET_LOCK`) on a connection of its own.
//!
//! Every session runs at READ COMMITTED: InnoDB then takes no gap locks for the relay's reads
//! and updates, so an application's `INSERT` never waits behind the relay. Each file renders
//! its statements once for the configured table ([`TableName`] is validated, so splicing it is
//! safe); ids and `seq` values spliced into `IN (…)` lists are the relay's own typed values.

mod claim;
mod claim_lock;
mod connect;
mod console;
mod instance;
mod migrations;
mod operator;
pub mod schema;
mod settle;

use std::sync::Arc;

use chrono::{DateTime, NaiveDateTime, Utc};
use mysql_async::Pool;

pub use instance::LockSession;
use uuid::Uuid;

pub use super::{Result, StoreError};
use crate::config::TableName;

/// Statement texts, rendered once for the configured table.
#[derive(Debug)]
struct Queries {
    claim: claim::ClaimSql,
    claim_lock: claim_lock::ClaimLockSql,
    settle: settle::SettleSql,
    operator: operator::OperatorSql,
}

/// A MySQL or MariaDB outbox table and its connection pool.
#[derive(Clone)]
pub struct MysqlStore {
    pool: Pool,
    // The pool's connection options: the instance lock's session is a connection of its own.
    opts: mysql_async::Opts,
    // `database.query_timeout`: see `MysqlStore::bounded`.
    query_timeout: std::time::Duration,
    table: TableName,
    instance_id: String,
    q: Arc<Queries>,
}

impl MysqlStore {
    /// The configured table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// This relay's `locked_by` value.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// `database.query_timeout`.
    pub fn query_timeout(&self) -> std::time::Duration {
        self.query_timeout
    }

    /// Runs `call` within `database.query_timeout`: a server that accepts connections but
    /// stops answering becomes [`StoreError::Timeout`], an outage, instead of a hang.
    pub async fn bounded<T>(&self, call: impl Future<Output = Result<T>>) -> Result<T> {
        within(self.query_timeout, call).await
    }

    /// [`MysqlStore::bounded`] with [`super::MAINTENANCE_TIMEOUT_FACTOR`] times the deadline.
    pub async fn bounded_maintenance<T>(&self, call: impl Future<Output = Result<T>>) -> Result<T> {
        let limit = self
            .query_timeout
            .saturating_mul(super::MAINTENANCE_TIMEOUT_FACTOR);
        within(limit, call).await
    }

    /// A pooled connection, within `database.query_timeout`: a server that accepts
    /// connections but never answers is a [`StoreError::Timeout`] for every caller (`check`,
    /// `status`, `migrate` and the dead-letter commands too), never a hang.
    pub async fn conn(&self) -> Result<mysql_async::Conn> {
        within(self.query_timeout, async {
            Ok(self.pool.get_conn().await?)
        })
        .await
    }

    /// Round trip to the database.
    pub async fn ping(&self) -> Result<()> {
        use mysql_async::prelude::Queryable;
        self.conn().await?.query_drop("SELECT 1").await?;
        Ok(())
    }
}

/// `call` within `limit`, or [`StoreError::Timeout`].
async fn within<T>(limit: std::time::Duration, call: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or(Err(StoreError::Timeout(limit)))
}

/// Whether `e` is a lost, refused or read-only connection, or a transient lock conflict: an
/// outage to wait out rather than a bad statement.
pub(super) fn is_connection(e: &mysql_async::Error) -> bool {
    match e {
        // A certificate the URL's ssl-mode does not trust stays untrusted: configuration.
        mysql_async::Error::Io(_) => !is_untrusted_certificate(e),
        mysql_async::Error::Driver(d) => matches!(
            d,
            mysql_async::DriverError::ConnectionClosed
                | mysql_async::DriverError::PoolDisconnected
                | mysql_async::DriverError::PacketOutOfOrder
                | mysql_async::DriverError::UnexpectedPacket { .. }
        ),
        mysql_async::Error::Server(s) => matches!(
            s.code,
            // too many connections, server shutdown, connection killed, read-only server
            // (--read-only, super_read_only), lock wait timeout, deadlock
            1040 | 1053 | 1927 | 1290 | 1836 | 1792 | 1205 | 1213 | 3572
        ),
        mysql_async::Error::Other(_) => true,
        mysql_async::Error::Url(_) => false,
    }
}

/// What to do about `e`, where the driver's words leave it unsaid (appended to its message).
pub(super) fn hint(e: &mysql_async::Error) -> &'static str {
    match e {
        mysql_async::Error::Driver(mysql_async::DriverError::NoClientSslFlagFromServer) => {
            ": the URL's ssl-mode asks for TLS and this server offers none: turn TLS on in the \
             server, or set ssl-mode=PREFERRED (or DISABLED) to connect without it"
        }
        e if is_untrusted_certificate(e) => {
            ": the server's certificate is not trusted: give the CA that signed it with ssl-ca \
             (ssl-mode=VERIFY_CA or VERIFY_IDENTITY), or set ssl-mode=REQUIRED to encrypt \
             without verifying it"
        }
        // MySQL's "secure transport required".
        mysql_async::Error::Server(s) if s.code == 3159 => {
            ": this server takes TLS connections only: set ssl-mode=REQUIRED, VERIFY_CA or \
             VERIFY_IDENTITY in the URL"
        }
        // A syntax error at a name: the relay writes the table's name unquoted.
        mysql_async::Error::Server(s) if s.code == 1064 => {
            ": if database.table is a word MySQL or MariaDB reserves (order, group, key, …), \
             pick another name: the relay writes it unquoted"
        }
        // MariaDB answers a plain-text connection it requires TLS of (require_secure_transport)
        // with "access denied" too.
        mysql_async::Error::Server(s) if s.code == 1045 => {
            ": check the user and password in the URL; if the server requires TLS \
             (require_secure_transport), the URL's ssl-mode must not be DISABLED"
        }
        _ => "",
    }
}

/// Whether `e` is a TLS handshake that failed on the server's certificate (unknown CA, wrong
/// name, expired).
fn is_untrusted_certificate(e: &mysql_async::Error) -> bool {
    let mysql_async::Error::Io(mysql_async::IoError::Io(io)) = e else {
        return false;
    };
    super::untrusted_certificate(io)
}

/// Whether a statement that failed this way may have committed with its answer lost.
pub(super) fn answer_may_be_lost(e: &mysql_async::Error) -> bool {
    matches!(
        e,
        mysql_async::Error::Io(_)
            | mysql_async::Error::Driver(mysql_async::DriverError::ConnectionClosed)
    )
}

/// A `TIMESTAMP` read in the relay's sessions (time zone `+00:00`): UTC.
fn utc(t: NaiveDateTime) -> DateTime<Utc> {
    DateTime::from_naive_utc_and_offset(t, Utc)
}

/// `ids` as an SQL list of string literals (`'…', '…'`): UUIDs print as hex and dashes only.
fn id_list(ids: &[Uuid]) -> String {
    let mut out = String::with_capacity(ids.len() * 39);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push('\'');
        out.push_str(&id.hyphenated().to_string());
        out.push('\'');
    }
    out
}

/// `seqs` as an SQL list of integers.
fn seq_list(seqs: &[i64]) -> String {
    seqs.iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Parses the text id of a row.
fn parse_id(text: &str) -> Result<Uuid> {
    Uuid::parse_str(text)
        .map_err(|e| StoreError::Schema(format!("a row's id {text:?} is not a UUID: {e}")))
}

/// The relay's own claim statements and session settings on a MySQL outbox, for the benchmark
/// (`bench/`), whose bare MariaDB client replays them outside the relay. Behind the `bench`
/// feature, which only the benchmark turns on: they are not part of the library's API.
#[cfg(feature = "bench")]
pub mod bench {
    pub use super::claim::{Guarded, HotPathSql};
    pub use super::connect::SESSION_SETTINGS;
    pub use crate::store::postgres::bench::scan_window;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_checked_in() {
        let table = TableName::parse("outbox_messages").unwrap_or_else(|e| panic!("{e}"));
        let catalog: Vec<(String, String)> = [
            claim::ClaimSql::new(&table).catalog(),
            claim_lock::ClaimLockSql::new(&table).catalog(),
            settle::SettleSql::new(&table).catalog(),
            operator::OperatorSql::new(&table).catalog(),
        ]
        .concat();
        crate::store::checked_in::check("mysql", &catalog);
    }

    #[test]
    fn lists_are_plain_literals() {
        let a = Uuid::nil();
        assert_eq!(
            id_list(&[a, a]),
            "'00000000-0000-0000-0000-000000000000','00000000-0000-0000-0000-000000000000'"
        );
        assert_eq!(seq_list(&[1, 22, 333]), "1,22,333");
    }

    #[test]
    fn read_only_and_lost_connections_are_outages() {
        let server = |code| {
            mysql_async::Error::Server(mysql_async::ServerError {
                code,
                message: String::new(),
                state: String::new(),
            })
        };
        assert!(is_connection(&server(1290)));
        assert!(is_connection(&server(1205)));
        assert!(!is_connection(&server(1064)));
        assert!(is_connection(&mysql_async::Error::Driver(
            mysql_async::DriverError::ConnectionClosed
        )));
    }
}
