//! The wake-up record of schema version 3 (`<table>_waiters`): an idle relay marks itself
//! waiting so that inserts NOTIFY, and unmarks itself when busy (see [`crate::wakeup`]); the
//! backlog task deletes the records of relays that died.

use std::time::Duration;

use super::{PgStore, Result};
use crate::config::TableName;

/// The wake-up's SQL text, rendered once for the configured table.
#[derive(Debug, Clone)]
pub(super) struct WaitingSql {
    pub(super) mark_waiting: String,
    pub(super) unmark_waiting: String,
    pub(super) writers_active: String,
    pub(super) clean_waiters: String,
    pub(super) has_waiters: String,
}

impl WaitingSql {
    pub(super) fn new(table: &TableName) -> Self {
        let waiters = table.prefixed("_waiters");
        Self {
            // The wake-up (schema version 3): an idle relay's row makes the insert trigger
            // NOTIFY. $1 instance id, $2 LISTEN backend pid, $3 lifetime (ms).
            mark_waiting: format!(
                "INSERT INTO {waiters} (relay, pid, alive_until) \
                 VALUES ($1, $2, now() + $3::bigint * interval '1 millisecond') \
                 ON CONFLICT (relay) DO UPDATE SET pid = EXCLUDED.pid, alive_until = EXCLUDED.alive_until"
            ),
            // $1 instance id.
            unmark_waiting: format!("DELETE FROM {waiters} WHERE relay = $1"),
            // $1 the table's oid. Whether a transaction that may still commit rows is running:
            // it may have passed its wake-up check before this relay marked itself waiting.
            // By oid and by name: see the ordering guard's observation (`observe.rs`).
            writers_active: format!(
                "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                      WHERE l.locktype = 'relation' AND l.relation IN ($1::oid, to_regclass('{}')::oid) AND l.granted \
                        AND a.backend_xid IS NOT NULL AND a.pid <> pg_backend_pid() \
                        AND a.application_name NOT LIKE 'outbox-relay%')",
                table.qualified()
            ),
            // Rows of relays whose LISTEN session is gone (they died), or long expired.
            clean_waiters: format!(
                "DELETE FROM {waiters} w WHERE w.alive_until < now() - interval '1 minute' \
                 OR NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = w.pid)"
            ),
            has_waiters: format!("SELECT to_regclass('{waiters}') IS NOT NULL"),
        }
    }
}

impl PgStore {
    /// Whether the table has the wake-up of schema version 3 (`<table>_waiters`).
    pub async fn has_waiters(&self) -> Result<bool> {
        let client = self.client().await?;
        Ok(client
            .query_one(&self.q.waiting.has_waiters, &[])
            .await?
            .try_get(0)?)
    }

    /// Records that this relay is idle and LISTENing on the backend `pid`, for `lifetime`: until
    /// then (or [`PgStore::unmark_waiting`]) every inserting transaction NOTIFYs once.
    pub async fn mark_waiting(&self, pid: i32, lifetime: Duration) -> Result<()> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.waiting.mark_waiting).await?;
        let ms = i64::try_from(lifetime.as_millis()).unwrap_or(i64::MAX);
        client
            .execute(&stmt, &[&self.instance_id, &pid, &ms])
            .await?;
        Ok(())
    }

    /// [`PgStore::mark_waiting`], then [`PgStore::writers_active`] once the record is committed,
    /// pipelined on one connection (one round trip; the server runs them in order).
    pub async fn mark_waiting_then_writers(
        &self,
        pid: i32,
        lifetime: Duration,
        table_oid: u32,
    ) -> Result<bool> {
        let client = self.client().await?;
        let mark = client.prepare_cached(&self.q.waiting.mark_waiting).await?;
        let writers = client
            .prepare_cached(&self.q.waiting.writers_active)
            .await?;
        let ms = i64::try_from(lifetime.as_millis()).unwrap_or(i64::MAX);
        let oid: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&table_oid];
        let mark_params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&self.instance_id, &pid, &ms];
        let (marked, active) = tokio::join!(
            client.execute(&mark, &mark_params),
            client.query_one(&writers, &oid)
        );
        marked?;
        Ok(active?.try_get(0)?)
    }

    /// This relay is busy: inserts stop notifying on its account.
    pub async fn unmark_waiting(&self) -> Result<()> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(&self.q.waiting.unmark_waiting)
            .await?;
        client.execute(&stmt, &[&self.instance_id]).await?;
        Ok(())
    }

    /// Whether a transaction that may still commit rows (one holding a lock on the table) is
    /// running, other than the relays' own.
    pub async fn writers_active(&self, table_oid: u32) -> Result<bool> {
        let r = self
            .query_one_by_oid(&self.q.waiting.writers_active, table_oid)
            .await?;
        Ok(r.try_get(0)?)
    }

    /// Deletes the waiting marks of relays whose LISTEN session has ended; returns how many.
    pub async fn clean_waiters(&self) -> Result<u64> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.waiting.clean_waiters).await?;
        Ok(client.execute(&stmt, &[]).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_name_the_schema_qualified_waiters_table() {
        let q = WaitingSql::new(&TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(
            q.has_waiters,
            "SELECT to_regclass('app.events_waiters') IS NOT NULL"
        );
        assert_eq!(
            q.unmark_waiting,
            "DELETE FROM app.events_waiters WHERE relay = $1"
        );
        assert!(
            q.mark_waiting
                .starts_with("INSERT INTO app.events_waiters ")
        );
        assert!(
            q.clean_waiters
                .starts_with("DELETE FROM app.events_waiters w ")
        );
        // The relays' own sessions never count as writers.
        assert!(q.writers_active.contains("NOT LIKE 'outbox-relay%'"));
    }
}
