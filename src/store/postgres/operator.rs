//! Operator commands: `status`, `dead-letters list | retry | discard`, and the retention
//! cleanup's batch delete (run by [`crate::tasks::cleanup`]).

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::predicates::no_open_row_before;
use super::{PgStore, Result, StoreError};
use crate::config::TableName;

/// Row counts for `status` (docs/operations.md).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StatusCounts {
    /// `ready + waiting`.
    pub pending: i64,
    /// Pending and available now.
    pub ready: i64,
    /// Pending, waiting for a retry.
    pub waiting: i64,
    /// Claimed, not yet settled.
    pub processing: i64,
    /// Confirmed (and not yet removed by retention).
    pub sent: i64,
    /// Dead letters.
    pub failed: i64,
    /// Past their deadline before they could be published (and not yet removed by retention).
    pub expired: i64,
    /// Age of the oldest unsent (pending or processing) row.
    pub oldest_pending_age_seconds: f64,
    /// Aggregates whose earliest unsent row is `failed`.
    pub blocked_aggregates: i64,
}

impl StatusCounts {
    /// Adds `o` into these counts (sums; the oldest age is the larger of the two).
    pub fn add(&mut self, o: &StatusCounts) {
        self.pending += o.pending;
        self.ready += o.ready;
        self.waiting += o.waiting;
        self.processing += o.processing;
        self.sent += o.sent;
        self.failed += o.failed;
        self.expired += o.expired;
        self.oldest_pending_age_seconds = self
            .oldest_pending_age_seconds
            .max(o.oldest_pending_age_seconds);
        self.blocked_aggregates += o.blocked_aggregates;
    }
}

/// `status --json`: overall counts plus the same per aggregate type.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StatusReport {
    /// Totals.
    #[serde(flatten)]
    pub overall: StatusCounts,
    /// Per `aggregate_type`.
    pub by_aggregate_type: std::collections::BTreeMap<String, StatusCounts>,
}

impl StatusReport {
    /// The report from each aggregate type's counts (`pending` is filled in as ready +
    /// waiting) and its number of blocked aggregates; the totals are their sums.
    pub fn assemble(
        per_type: impl IntoIterator<Item = (String, StatusCounts)>,
        blocked: impl IntoIterator<Item = (String, i64)>,
    ) -> Self {
        let mut report = Self::default();
        for (ty, mut counts) in per_type {
            counts.pending = counts.ready + counts.waiting;
            report.by_aggregate_type.insert(ty, counts);
        }
        for (ty, n) in blocked {
            report
                .by_aggregate_type
                .entry(ty)
                .or_default()
                .blocked_aggregates = n;
        }
        for c in report.by_aggregate_type.values() {
            report.overall.add(c);
        }
        report
    }
}

/// One row of `dead-letters list`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DeadLetter {
    /// Row id.
    pub id: Uuid,
    /// Insert order.
    pub seq: i64,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: Option<String>,
    /// Event type.
    pub event_type: String,
    /// Attempts used.
    pub attempts: i32,
    /// The last failure.
    pub last_error: Option<String>,
    /// Insert time.
    pub created_at: DateTime<Utc>,
    /// When the last attempt was scheduled.
    pub available_at: DateTime<Utc>,
}

/// The dead letter in `r`'s columns from `first` on: id, seq, aggregate type, aggregate id,
/// event type, attempts, last error, created at, available at (the console's page reads the
/// same columns after its count).
pub(super) fn dead_letter(r: &tokio_postgres::Row, first: usize) -> Result<DeadLetter> {
    Ok(DeadLetter {
        id: r.try_get(first)?,
        seq: r.try_get(first + 1)?,
        aggregate_type: r.try_get(first + 2)?,
        aggregate_id: r.try_get(first + 3)?,
        event_type: r.try_get(first + 4)?,
        attempts: r.try_get(first + 5)?,
        last_error: r.try_get(first + 6)?,
        created_at: r.try_get(first + 7)?,
        available_at: r.try_get(first + 8)?,
    })
}

/// Which dead letters an operator command applies to.
#[derive(Debug, Clone)]
pub enum Selection {
    /// These ids (ids that are not dead letters are left alone).
    Ids(Vec<Uuid>),
    /// Every dead letter.
    All,
}

/// The operator commands' SQL text, rendered once for the configured table.
#[derive(Debug, Clone)]
pub(super) struct OperatorSql {
    pub(super) status: String,
    pub(super) blocked_by_type: String,
    pub(super) dead_letters: String,
    pub(super) retry_dead: String,
    pub(super) discard_dead: String,
    pub(super) which_dead: String,
    pub(super) cleanup: String,
}

impl OperatorSql {
    pub(super) fn new(table: &TableName) -> Self {
        let t = table.qualified();
        let failed_head = no_open_row_before(&t, "f");
        Self {
            status: format!(
                "SELECT aggregate_type, \
                   count(*) FILTER (WHERE status = 'pending' AND available_at <= now()), \
                   count(*) FILTER (WHERE status = 'pending' AND available_at > now()), \
                   count(*) FILTER (WHERE status = 'processing'), \
                   count(*) FILTER (WHERE status = 'sent'), \
                   count(*) FILTER (WHERE status = 'failed'), \
                   coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE status IN ('pending', 'processing'))), 0)::float8, \
                   count(*) FILTER (WHERE status = 'expired') \
                 FROM {t} GROUP BY aggregate_type ORDER BY aggregate_type"
            ),
            blocked_by_type: format!(
                "SELECT aggregate_type, count(DISTINCT aggregate_id) FROM {t} f \
                 WHERE f.status = 'failed' AND f.aggregate_id IS NOT NULL AND {failed_head} \
                 GROUP BY aggregate_type"
            ),
            // $1 limit.
            dead_letters: format!(
                "SELECT id, seq, aggregate_type, aggregate_id, event_type, attempts, last_error, created_at, available_at \
                 FROM {t} WHERE status = 'failed' ORDER BY seq LIMIT $1"
            ),
            // $1 ids, $2 all.
            retry_dead: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, available_at = now() \
                 WHERE status = 'failed' AND ($2 OR id = ANY($1)) RETURNING id"
            ),
            discard_dead: format!(
                "DELETE FROM {t} WHERE status = 'failed' AND ($2 OR id = ANY($1)) RETURNING id"
            ),
            // $1 ids.
            which_dead: format!("SELECT id FROM {t} WHERE status = 'failed' AND id = ANY($1)"),
            cleanup: cleanup_sql(&t),
        }
    }
}

/// Retention's batch delete from `t` (the table, or one partition of it). `$1` retention
/// (ms), `$2` batch size. Short statements: no long locks on the table. Expired rows are kept
/// as long after their deadline as sent rows after sending.
pub(super) fn cleanup_sql(t: &str) -> String {
    format!(
        "DELETE FROM {t} WHERE id IN ( \
           (SELECT id FROM {t} WHERE status = 'sent' AND sent_at < now() - $1::bigint * interval '1 millisecond' \
            ORDER BY sent_at LIMIT $2) \
           UNION ALL \
           (SELECT id FROM {t} WHERE status = 'expired' AND expires_at < now() - $1::bigint * interval '1 millisecond' \
            ORDER BY expires_at LIMIT $2) \
           LIMIT $2)"
    )
}

impl PgStore {
    /// Counts by status, overall and per aggregate type.
    pub async fn status(&self) -> Result<StatusReport> {
        let client = self.client().await?;
        let rows = client.query(&self.q.operator.status, &[]).await?;
        let blocked = client.query(&self.q.operator.blocked_by_type, &[]).await?;
        let per_type = rows.iter().map(|r| {
            let counts = StatusCounts {
                ready: r.try_get(1)?,
                waiting: r.try_get(2)?,
                processing: r.try_get(3)?,
                sent: r.try_get(4)?,
                failed: r.try_get(5)?,
                expired: r.try_get(7)?,
                oldest_pending_age_seconds: r.try_get(6)?,
                ..StatusCounts::default()
            };
            Ok((r.try_get(0)?, counts))
        });
        let per_type = per_type.collect::<Result<Vec<_>>>()?;
        let blocked = blocked
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(StatusReport::assemble(per_type, blocked))
    }

    /// Dead letters in `seq` order.
    pub async fn dead_letters(&self, limit: i64) -> Result<Vec<DeadLetter>> {
        let client = self.client().await?;
        let rows = client
            .query(&self.q.operator.dead_letters, &[&limit])
            .await?;
        rows.iter().map(|r| dead_letter(r, 0)).collect()
    }

    /// Sets dead letters back to `pending` with attempts reset (keeping `last_error`); returns
    /// the ids changed.
    pub async fn retry_dead_letters(&self, sel: &Selection) -> Result<Vec<Uuid>> {
        self.apply_dead(&self.q.operator.retry_dead, sel).await
    }

    /// Deletes dead letters; returns the ids removed.
    pub async fn discard_dead_letters(&self, sel: &Selection) -> Result<Vec<Uuid>> {
        self.apply_dead(&self.q.operator.discard_dead, sel).await
    }

    /// Which of `ids` are dead letters in this table (for commands spanning several outboxes).
    pub async fn which_dead_letters(&self, ids: &[Uuid]) -> Result<Vec<Uuid>> {
        let client = self.client().await?;
        let rows = client.query(&self.q.operator.which_dead, &[&ids]).await?;
        rows.iter()
            .map(|r| r.try_get(0).map_err(StoreError::from))
            .collect()
    }

    /// Deletes up to `batch` `sent` rows older than `retention`; returns how many.
    pub async fn cleanup_batch(&self, retention: Duration, batch: usize) -> Result<u64> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.operator.cleanup).await?;
        let ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        Ok(client.execute(&stmt, &[&ms, &batch]).await?)
    }

    /// Applies `sql` to the selected dead letters in one transaction: when any given id is
    /// not a dead letter, nothing is changed.
    async fn apply_dead(&self, sql: &str, sel: &Selection) -> Result<Vec<Uuid>> {
        let (ids, all) = match sel {
            Selection::Ids(ids) => (ids.clone(), false),
            Selection::All => (Vec::new(), true),
        };
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let rows = tx.query(sql, &[&ids, &all]).await?;
        let changed = rows
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<Vec<Uuid>, _>>()?;
        if let Err(e) = StoreError::unless_all_dead(&ids, &changed) {
            tx.rollback().await?;
            return Err(e);
        }
        tx.commit().await?;
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_name_the_schema_qualified_table_and_touch_dead_letters_only() {
        let q = OperatorSql::new(&TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}")));
        assert!(
            q.status
                .ends_with("FROM app.events GROUP BY aggregate_type ORDER BY aggregate_type")
        );
        assert_eq!(
            q.discard_dead,
            "DELETE FROM app.events WHERE status = 'failed' AND ($2 OR id = ANY($1)) RETURNING id"
        );
        assert!(q.retry_dead.contains("WHERE status = 'failed'"));
        assert!(
            q.dead_letters
                .contains("FROM app.events WHERE status = 'failed'")
        );
        // Retention never deletes dead letters.
        assert!(q.cleanup.contains("status = 'sent'") && q.cleanup.contains("status = 'expired'"));
        assert!(!q.cleanup.contains("'failed'"));
    }
}
