//! The instance lock on MySQL (see [`crate::store::instance`]): a named lock (`GET_LOCK`) on
//! this relay's `relay.instance_id` and an outbox table, held on a connection of its own, not
//! a pooled one, so that it is released exactly when that connection ends.

use std::time::Instant;

use mysql_async::Conn;
use mysql_async::prelude::Queryable;
use tokio::sync::Mutex;

use super::claim::column;
use super::{MysqlStore, Result};
use crate::store::instance::{LockHolder, SessionId};

/// The lock's name: `outbox-relay:` and 48 hex digits of the SHA-256 of
/// `<instance id>:<database>.<table>` (a lock name may be 64 characters long). `?` the
/// instance id, the table's database (`NULL`: the connection's) and the table's name.
const KEY: &str =
    "CONCAT('outbox-relay:', LEFT(SHA2(CONCAT(?, ':', COALESCE(?, DATABASE()), '.', ?), 256), 48))";

/// The server ends the lock's connection (and frees the lock) once it has been idle this many
/// seconds: a relay whose host vanished holds its id for about a minute. The keeper's checks
/// keep a live relay's connection busier than that.
const SESSION_IDLE_LIMIT: &str = "SET SESSION wait_timeout = 60";

/// A connection of its own holding this relay's instance locks; dropping it closes the
/// connection, which releases every lock it holds.
pub struct LockSession {
    conn: Mutex<Conn>,
    session: SessionId,
    made: Instant,
}

impl LockSession {
    /// Which session this is.
    pub fn session(&self) -> &SessionId {
        &self.session
    }

    /// When it was made.
    pub fn made(&self) -> Instant {
        self.made
    }

    /// Whether the connection still answers: its locks are held as long as it does.
    pub async fn check(&self) -> Result<()> {
        self.conn.lock().await.query_drop("SELECT 1").await?;
        Ok(())
    }

    /// Takes the instance lock of `store`'s table for `store`'s instance id on this
    /// connection: `Ok`, or the session that holds it (`None` if it let go meanwhile).
    pub async fn lock(
        &self,
        store: &MysqlStore,
    ) -> Result<std::result::Result<(), Option<LockHolder>>> {
        let table = store.table();
        let params = (
            store.instance_id(),
            table.schema.as_deref(),
            table.name.as_str(),
        );
        let mut conn = self.conn.lock().await;
        let taken: Option<Option<i64>> = conn
            .exec_first(format!("SELECT GET_LOCK({KEY}, 0)"), params)
            .await?;
        if taken.flatten() == Some(1) {
            return Ok(Ok(()));
        }
        // PROCESSLIST shows other users' sessions only to a role with PROCESS: the holder's
        // connection id is known either way.
        let holder: Option<mysql_async::Row> = conn
            .exec_first(
                format!(
                    "SELECT u.id, COALESCE(p.USER, ''), COALESCE(p.HOST, '') \
                     FROM (SELECT IS_USED_LOCK({KEY}) AS id) u \
                     LEFT JOIN information_schema.PROCESSLIST p ON p.ID = u.id"
                ),
                params,
            )
            .await?;
        let Some(mut r) = holder else {
            return Ok(Err(None));
        };
        let Some(id) = column::<Option<i64>>(&mut r, 0, "IS_USED_LOCK")? else {
            return Ok(Err(None));
        };
        let user: String = column(&mut r, 1, "USER")?;
        let host: String = column(&mut r, 2, "HOST")?;
        Ok(Err(Some(LockHolder {
            session: SessionId {
                id,
                started: String::new(),
            },
            id_name: "connection id",
            application_name: String::new(),
            client_addr: match (user.is_empty(), host.is_empty()) {
                (_, true) => String::new(),
                (true, false) => host,
                (false, false) => format!("{user}@{host}"),
            },
        })))
    }
}

impl MysqlStore {
    /// A connection of its own (not from the pool) to hold this relay's instance locks in the
    /// store's database ([`LockSession::lock`]).
    pub async fn lock_session(&self) -> Result<LockSession> {
        let mut conn = Conn::new(self.opts.clone()).await?;
        conn.query_drop(SESSION_IDLE_LIMIT).await?;
        let id: Option<i64> = conn.query_first("SELECT CONNECTION_ID()").await?;
        Ok(LockSession {
            conn: Mutex::new(conn),
            session: SessionId {
                id: id.unwrap_or_default(),
                started: String::new(),
            },
            made: Instant::now(),
        })
    }
}
