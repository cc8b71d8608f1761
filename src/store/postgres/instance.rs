//! The instance lock on PostgreSQL (see [`crate::store::instance`]): a session-level advisory
//! lock on this relay's `relay.instance_id` and an outbox table, held on a session taken out
//! of the pool.

use super::{PgStore, Result};
use crate::store::instance::{LockHolder, SessionId};

/// The lock's key: `'outbox-relay:<instance id>:<schema>.<table>'` (the table as the catalog
/// names it, however the configuration spells it), hashed to the `bigint` that
/// `pg_try_advisory_lock` takes. `$1` the instance id, `$2` the table as configured.
const KEYED: &str = "WITH k AS ( \
       SELECT hashtextextended('outbox-relay:' || $1::text || ':' || n.nspname || '.' || c.relname, 0) AS key \
       FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
       WHERE c.oid = $2::text::regclass)";

/// The lock's session tells the server to probe the relay's side of it, so that a relay whose
/// host vanished does not keep its id locked for the system's two hours: the server ends the
/// session (and the lock) about a minute after the relay stops answering.
const SESSION_KEEPALIVE: &str =
    "SET tcp_keepalives_idle = 30; SET tcp_keepalives_interval = 10; SET tcp_keepalives_count = 3";

/// This session's pid and start.
const SESSION_SQL: &str = "SELECT pg_backend_pid(), \
       (SELECT backend_start::text FROM pg_stat_activity WHERE pid = pg_backend_pid())";

/// Takes the lock if free.
fn try_lock_sql() -> String {
    format!("{KEYED} SELECT pg_try_advisory_lock(k.key) FROM k")
}

/// The session holding the lock, if any. A `bigint` advisory key shows in `pg_locks` as its
/// high half in `classid` and its low half in `objid`, `objsubid` 1.
fn holder_sql() -> String {
    format!(
        "{KEYED} \
         SELECT l.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), ''), \
           coalesce(a.backend_start::text, '') \
         FROM k, pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND l.classid = ((k.key >> 32) & 4294967295)::oid \
           AND l.objid = (k.key & 4294967295)::oid \
         LIMIT 1"
    )
}

/// A session taken out of the pool to hold instance locks; dropping it ends the session,
/// which releases every lock it holds.
pub struct LockSession {
    client: deadpool_postgres::ClientWrapper,
    session: SessionId,
    /// When it was made (a read-only refusal after this leaves it stale: [`PgStore::stale_sessions`]).
    made: std::time::Instant,
}

impl LockSession {
    /// Which session this is.
    pub fn session(&self) -> &SessionId {
        &self.session
    }

    /// When it was made.
    pub fn made(&self) -> std::time::Instant {
        self.made
    }

    /// Whether the session still answers: its locks are held as long as it does.
    pub async fn check(&self) -> Result<()> {
        self.client.simple_query("SELECT 1").await?;
        Ok(())
    }

    /// Takes the instance lock of `store`'s table for `store`'s instance id on this session:
    /// `Ok`, or the session that holds it (`None` if it let go meanwhile; ask again). The
    /// table must exist.
    pub async fn lock(
        &self,
        store: &PgStore,
    ) -> Result<std::result::Result<(), Option<LockHolder>>> {
        let (instance, table) = (store.instance_id(), store.table().qualified());
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&instance, &table];
        let row = self.client.query_one(&try_lock_sql(), &params).await?;
        if row.try_get(0)? {
            return Ok(Ok(()));
        }
        let Some(r) = self.client.query_opt(&holder_sql(), &params).await? else {
            return Ok(Err(None));
        };
        Ok(Err(Some(LockHolder {
            session: SessionId {
                id: i64::from(r.try_get::<_, i32>(0)?),
                started: r.try_get(3)?,
            },
            id_name: "backend pid",
            application_name: r.try_get(1)?,
            client_addr: r.try_get(2)?,
        })))
    }
}

impl PgStore {
    /// A session of its own (taken out of the pool) to hold this relay's instance locks in
    /// the store's database ([`LockSession::lock`]).
    pub async fn lock_session(&self) -> Result<LockSession> {
        let client = deadpool_postgres::Object::take(self.pool.get().await?);
        client.batch_execute(SESSION_KEEPALIVE).await?;
        let row = client.query_one(SESSION_SQL, &[]).await?;
        let session = SessionId {
            id: i64::from(row.try_get::<_, i32>(0)?),
            started: row.try_get::<_, Option<String>>(1)?.unwrap_or_default(),
        };
        Ok(LockSession {
            client,
            session,
            made: std::time::Instant::now(),
        })
    }
}
