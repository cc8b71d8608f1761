//! The ordering guard's observation (see [`crate::watermark`]): the highest `seq` drawn so
//! far and the transactions that may still commit rows to the outbox table.

use super::{PgStore, Result};
use crate::config::TableName;

/// One observation for the ordering watermark (see [`crate::watermark`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WriterSnapshot {
    /// Transactions (xid as text) that hold a lock on the outbox table, other than relays.
    pub writers: Vec<String>,
    /// Age in seconds of the oldest of those transactions.
    pub oldest_writer_age: Option<f64>,
}

/// The SQL text of the observation, rendered once for the configured table.
#[derive(Debug, Clone)]
pub(super) struct ObserveSql {
    pub(super) last_seq: String,
    pub(super) writers: String,
}

impl ObserveSql {
    pub(super) fn new(table: &TableName) -> Self {
        let seq = table.prefixed("_seq");
        Self {
            last_seq: format!("SELECT last_value, is_called FROM {seq}"),
            writers: WRITERS.replace("$TABLE", &table.qualified()),
        }
    }
}

/// Transactions that hold a lock on the table and may still commit rows, with their age;
/// the relay's own sessions (`application_name` outbox-relay…) never insert. `$1` the
/// table's oid as the relay found it at start; the table is also looked up by name, which
/// finds it again after `migrate` has partitioned it (a new table of the same name, whose
/// partitions the old one became).
const WRITERS: &str = "SELECT a.backend_xid::text, extract(epoch FROM now() - a.xact_start)::float8 \
      FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
      WHERE l.locktype = 'relation' AND l.relation IN ($1::oid, to_regclass('$TABLE')::oid) AND l.granted \
        AND a.backend_xid IS NOT NULL AND a.pid <> pg_backend_pid() \
        AND a.application_name NOT LIKE 'outbox-relay%'";

impl PgStore {
    /// One observation for the ordering guard: the highest `seq` drawn so far (committed or
    /// not), then the transactions that hold a lock on the outbox table and might still commit
    /// rows. The two statements are pipelined on one connection, which the server runs in the
    /// order sent: the sequence is read strictly before the locks (see [`crate::watermark`]).
    pub async fn observe(&self, table_oid: u32) -> Result<(i64, WriterSnapshot)> {
        let client = self.client().await?;
        let seq_stmt = client.prepare_cached(&self.q.observe.last_seq).await?;
        let writers_stmt = client.prepare_cached(&self.q.observe.writers).await?;
        let oid_param: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&table_oid];
        let (seq_row, rows) = tokio::join!(
            client.query_one(&seq_stmt, &[]),
            client.query(&writers_stmt, &oid_param)
        );
        let seq_row = seq_row?;
        let last: i64 = seq_row.try_get(0)?;
        let called: bool = seq_row.try_get(1)?;
        let last = if called { last } else { last - 1 };
        let rows = rows?;
        let mut writers = Vec::with_capacity(rows.len());
        let mut oldest: Option<f64> = None;
        for r in rows {
            writers.push(r.try_get::<_, String>(0)?);
            let age: Option<f64> = r.try_get(1)?;
            if let Some(age) = age {
                oldest = Some(oldest.map_or(age, |o| o.max(age)));
            }
        }
        writers.sort_unstable();
        writers.dedup();
        Ok((
            last,
            WriterSnapshot {
                writers,
                oldest_writer_age: oldest,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_read_is_the_tables_own() {
        let table = TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}"));
        let q = ObserveSql::new(&table);
        let read = "SELECT last_value, is_called FROM app.events_seq";
        assert_eq!(q.last_seq, read);
        assert!(
            q.writers
                .contains("application_name NOT LIKE 'outbox-relay%'")
        );
    }
}
