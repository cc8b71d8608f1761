//! The claim lock on MySQL: a named lock (`GET_LOCK`) per outbox table that an ordered claim
//! holds for its one transaction, so that the relays sharing a table claim one after another.
//!
//! Without it, replicas claiming at the same moment meet each other's row locks: each one's
//! gate (`FOR UPDATE NOWAIT` over the pending rows before its candidates) fails on the rows
//! another is claiming, and falls back to probing aggregate by aggregate. Measured with
//! `bench/scripts/mysql-replicas.sh` on MariaDB (30,000 ready rows, 1,000 aggregates, medians
//! of 3): one relay drained them in 2.4 s, two in 19 s, three in 8.4 s; taking turns, in 2.5,
//! 2.9 and 2.7 s (docs/mysql.md). A claim takes milliseconds and publishing is not under the
//! lock.
//!
//! The lock is taken on the claim's own pooled connection and given back after the
//! transaction ends. A claim cut short (its timeout, a lost connection) closes that
//! connection instead of returning it to the pool: closing a session frees its locks, and a
//! pooled session still holding the lock would stop every relay's ordered claims.

use std::time::Duration;

use mysql_async::Conn;
use mysql_async::prelude::Queryable;

use super::Result;
use crate::config::TableName;

/// How long a claim waits for another relay's claim on the table to end before it gives up
/// this round (and the loop tries again at once); at most half of `database.query_timeout`,
/// which bounds the whole claim.
const WAIT: Duration = Duration::from_secs(2);

/// The lock's name: `outbox-relay:claim:` and 40 hex digits of the SHA-256 of
/// `<database>.<table>` (a lock name may be 64 characters long). `?` the table's database
/// (`NULL`: the connection's) and its name.
const KEY: &str =
    "CONCAT('outbox-relay:claim:', LEFT(SHA2(CONCAT(COALESCE(?, DATABASE()), '.', ?), 256), 40))";

/// The statements of the claim lock.
#[derive(Debug)]
pub(super) struct ClaimLockSql {
    /// Takes the lock, waiting up to `?` seconds: 1 taken, 0 another session holds it.
    take: String,
    /// Gives it back.
    give_back: String,
    /// The table's database (`None`: the connection's) and name, the key's parameters.
    schema: Option<String>,
    name: String,
}

impl ClaimLockSql {
    /// The statements for `table`.
    pub(super) fn new(table: &TableName) -> Self {
        Self {
            take: format!("SELECT GET_LOCK({KEY}, ?)"),
            give_back: format!("DO RELEASE_LOCK({KEY})"),
            schema: table.schema.clone(),
            name: table.name.clone(),
        }
    }

    /// The statements by name, for `sql/statements/mysql/`.
    #[cfg(test)]
    pub(super) fn catalog(&self) -> Vec<(String, String)> {
        vec![
            ("claim.lock".to_owned(), self.take.clone()),
            ("claim.unlock".to_owned(), self.give_back.clone()),
        ]
    }

    /// How long [`ClaimLockSql::take`] waits, in whole seconds: [`WAIT`], at most half of
    /// `query_timeout` (0 below 2 s: it does not wait).
    pub(super) fn wait_secs(query_timeout: Duration) -> u64 {
        WAIT.min(query_timeout / 2).as_secs()
    }

    /// Takes the table's claim lock on `conn`, waiting up to [`ClaimLockSql::wait_secs`];
    /// `None` when another relay's claim kept it that long.
    pub(super) async fn take(
        &self,
        mut conn: Conn,
        query_timeout: Duration,
    ) -> Result<Option<ClaimLock<'_>>> {
        let wait = Self::wait_secs(query_timeout);
        let taken: Option<Option<i64>> = conn
            .exec_first(
                &self.take,
                (self.schema.as_deref(), self.name.as_str(), wait),
            )
            .await?;
        if taken.flatten() == Some(1) {
            Ok(Some(ClaimLock {
                conn: Some(conn),
                sql: self,
            }))
        } else {
            Ok(None)
        }
    }
}

/// The claim lock, held by the session of the connection it owns: given back with
/// [`ClaimLock::give_back`]; dropped without that, the connection is closed.
pub(super) struct ClaimLock<'a> {
    conn: Option<Conn>,
    sql: &'a ClaimLockSql,
}

impl ClaimLock<'_> {
    /// The connection holding the lock, for the claim's transaction.
    pub(super) fn conn(&mut self) -> Option<&mut Conn> {
        self.conn.as_mut()
    }

    /// Gives the lock back; the connection goes back to the pool, or is closed when the lock
    /// could not be given back on it.
    pub(super) async fn give_back(mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let params = (self.sql.schema.as_deref(), self.sql.name.as_str());
        if let Err(e) = conn.exec_drop(&self.sql.give_back, params).await {
            tracing::debug!(error = %e, "cannot give the claim lock back; closing its connection");
            let _ = conn.disconnect().await;
        }
    }
}

impl Drop for ClaimLock<'_> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Cut short while holding the lock: close the session (which frees the lock)
            // rather than pool it.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = conn.disconnect().await;
                });
            }
        }
    }
}
