//! MySQL: `status`, the dead-letter commands, the backlog gauges and retention's batch delete.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Row, TxOpts};
use uuid::Uuid;

use super::claim::{column, required_time};
use super::{MysqlStore, Result, id_list, parse_id};
use crate::config::{Ordering, TableName};
use crate::store::{
    Backlog, DeadLetter, HEAD_REACH, Selection, StatusCounts, StatusReport, StoreError,
};

/// The open statuses: rows that hold back the later rows of their aggregate.
const OPEN: &str = "('pending', 'processing', 'failed')";

/// The operator commands' and gauges' statements, rendered once for the table.
#[derive(Debug)]
pub(super) struct OperatorSql {
    t: String,
    status: String,
    blocked_by_type: String,
    dead_letters: String,
    backlog_none: String,
    backlog_aggregate: String,
    any_pending: String,
    cleanup_sent: String,
    cleanup_expired: String,
}

/// No open row of the same aggregate before row `f` (its aggregate's head).
fn head(t: &str, alias: &str) -> String {
    format!(
        "NOT EXISTS (SELECT 1 FROM {t} e WHERE e.aggregate_type = {alias}.aggregate_type \
         AND e.aggregate_id = {alias}.aggregate_id AND e.status IN {OPEN} AND e.seq < {alias}.seq)"
    )
}

/// Seconds from `expr` (a `TIMESTAMP`) to now, as a double (0 when NULL).
fn age(expr: &str) -> String {
    format!("COALESCE(TIMESTAMPDIFF(MICROSECOND, {expr}, NOW(6)) / 1e6, 0e0)")
}

/// The backlog statement; `ready_head` limits the ready age to claimable heads among the first
/// [`HEAD_REACH`] pending rows. The counts and the ages of the pending rows come from one pass
/// over them.
fn backlog(t: &str, ready_head: bool) -> String {
    let ready = |c: &str| {
        format!("{c}available_at <= NOW(6) AND ({c}expires_at IS NULL OR {c}expires_at > NOW(6))")
    };
    let ready_age = if ready_head {
        format!(
            "(SELECT MIN(GREATEST(c.created_at, c.available_at)) \
              FROM (SELECT seq, aggregate_type, aggregate_id, created_at, available_at, expires_at \
                    FROM {t} WHERE status = 'pending' ORDER BY seq LIMIT {}) c \
              WHERE {} AND (c.aggregate_id IS NULL OR {}))",
            HEAD_REACH,
            ready("c."),
            head(t, "c")
        )
    } else {
        format!(
            "MIN(CASE WHEN {} THEN GREATEST(created_at, available_at) END)",
            ready("")
        )
    };
    let oldest = age(&format!(
        "LEAST(COALESCE((SELECT created_at FROM {t} WHERE status = 'pending' AND sent_at IS NULL \
                         ORDER BY seq LIMIT 1), NOW(6)), \
               COALESCE((SELECT MIN(created_at) FROM {t} WHERE status = 'processing'), NOW(6)))"
    ));
    let count = |cond: &str| format!("CAST(COALESCE(SUM({cond}), 0) AS SIGNED)");
    format!(
        "SELECT {}, {}, {oldest}, \
           CAST((SELECT COUNT(*) FROM {t} WHERE status = 'failed') AS SIGNED), \
           CAST((SELECT COUNT(*) FROM (SELECT DISTINCT f.aggregate_type, f.aggregate_id FROM {t} f \
              WHERE f.status = 'failed' AND f.aggregate_id IS NOT NULL AND {}) b) AS SIGNED), \
           {}, {} \
         FROM {t} WHERE status = 'pending'",
        count("available_at <= NOW(6)"),
        count("available_at > NOW(6)"),
        head(t, "f"),
        age(&ready_age),
        age("MIN(CASE WHEN available_at > NOW(6) THEN created_at END)"),
    )
}

impl OperatorSql {
    /// Every statement, by name (`sql/statements/mysql/`).
    #[cfg(test)]
    pub(super) fn catalog(&self) -> Vec<(String, String)> {
        [
            ("operator.status", &self.status),
            ("operator.blocked_by_type", &self.blocked_by_type),
            ("operator.dead_letters", &self.dead_letters),
            ("operator.backlog_none", &self.backlog_none),
            ("operator.backlog_aggregate", &self.backlog_aggregate),
            ("operator.any_pending", &self.any_pending),
            ("operator.cleanup_sent", &self.cleanup_sent),
            ("operator.cleanup_expired", &self.cleanup_expired),
        ]
        .map(|(n, s)| (n.to_owned(), s.clone()))
        .to_vec()
    }

    pub(super) fn new(table: &TableName) -> Self {
        let t = table.qualified();
        let count = |cond: &str| format!("CAST(SUM(CASE WHEN {cond} THEN 1 ELSE 0 END) AS SIGNED)");
        Self {
            status: format!(
                "SELECT aggregate_type, {}, {}, {}, {}, {}, {}, {} \
                 FROM {t} GROUP BY aggregate_type ORDER BY aggregate_type",
                count("status = 'pending' AND available_at <= NOW(6)"),
                count("status = 'pending' AND available_at > NOW(6)"),
                count("status = 'processing'"),
                count("status = 'sent'"),
                count("status = 'failed'"),
                age("MIN(CASE WHEN status IN ('pending', 'processing') THEN created_at END)"),
                count("status = 'expired'"),
            ),
            blocked_by_type: format!(
                "SELECT aggregate_type, CAST(COUNT(DISTINCT aggregate_id) AS SIGNED) FROM {t} f \
                 WHERE f.status = 'failed' AND f.aggregate_id IS NOT NULL AND {} \
                 GROUP BY aggregate_type",
                head(&t, "f")
            ),
            dead_letters: format!(
                "SELECT id, seq, aggregate_type, aggregate_id, event_type, attempts, last_error, \
                   created_at, available_at \
                 FROM {t} WHERE status = 'failed' ORDER BY seq LIMIT ?"
            ),
            backlog_none: backlog(&t, false),
            backlog_aggregate: backlog(&t, true),
            any_pending: format!("SELECT EXISTS (SELECT 1 FROM {t} WHERE status = 'pending')"),
            cleanup_sent: format!(
                "DELETE FROM {t} WHERE status = 'sent' \
                 AND sent_at < NOW(6) - INTERVAL ? MICROSECOND ORDER BY sent_at LIMIT ?"
            ),
            cleanup_expired: format!(
                "DELETE FROM {t} WHERE expires_at < NOW(6) - INTERVAL ? MICROSECOND \
                 AND status = 'expired' ORDER BY expires_at LIMIT ?"
            ),
            t,
        }
    }
}

/// The dead letter in `r`'s first columns: id, seq, aggregate type, aggregate id, event type,
/// attempts, last error, created at, available at (the console's page reads the same columns
/// first).
pub(super) fn dead_letter(r: &mut Row) -> Result<DeadLetter> {
    let id: String = column(r, 0, "id")?;
    Ok(DeadLetter {
        id: parse_id(&id)?,
        seq: column(r, 1, "seq")?,
        aggregate_type: column(r, 2, "aggregate_type")?,
        aggregate_id: column(r, 3, "aggregate_id")?,
        // NULL in a table that lets it be (the row is then a dead letter the relay could not
        // read): listed with an empty type, so the operator can find and fix it.
        event_type: column::<Option<String>>(r, 4, "event_type")?.unwrap_or_default(),
        attempts: column(r, 5, "attempts")?,
        last_error: column(r, 6, "last_error")?,
        created_at: required_time(r, 7, "created_at")?,
        available_at: required_time(r, 8, "available_at")?,
    })
}

impl MysqlStore {
    /// Counts by status, overall and per aggregate type.
    pub async fn status(&self) -> Result<StatusReport> {
        let mut conn = self.conn().await?;
        let rows: Vec<Row> = conn.query(&self.q.operator.status).await?;
        let blocked: Vec<Row> = conn.query(&self.q.operator.blocked_by_type).await?;
        let per_type = rows.into_iter().map(|mut r| {
            let counts = StatusCounts {
                ready: column(&mut r, 1, "ready")?,
                waiting: column(&mut r, 2, "waiting")?,
                processing: column(&mut r, 3, "processing")?,
                sent: column(&mut r, 4, "sent")?,
                failed: column(&mut r, 5, "failed")?,
                oldest_pending_age_seconds: column(&mut r, 6, "age")?,
                expired: column(&mut r, 7, "expired")?,
                ..StatusCounts::default()
            };
            Ok((column(&mut r, 0, "aggregate_type")?, counts))
        });
        let per_type = per_type.collect::<Result<Vec<_>>>()?;
        let blocked = blocked
            .into_iter()
            .map(|mut r| {
                Ok((
                    column(&mut r, 0, "aggregate_type")?,
                    column(&mut r, 1, "blocked")?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(StatusReport::assemble(per_type, blocked))
    }

    /// Dead letters in `seq` order.
    pub async fn dead_letters(&self, limit: i64) -> Result<Vec<DeadLetter>> {
        let mut conn = self.conn().await?;
        let rows: Vec<Row> = conn.exec(&self.q.operator.dead_letters, (limit,)).await?;
        rows.into_iter().map(|mut r| dead_letter(&mut r)).collect()
    }

    /// Sets dead letters back to `pending` with attempts reset (keeping `last_error`); returns
    /// the ids changed.
    pub async fn retry_dead_letters(&self, sel: &Selection) -> Result<Vec<Uuid>> {
        self.apply_dead(
            "UPDATE {t} SET status = 'pending', attempts = 0, available_at = NOW(6)",
            sel,
        )
        .await
    }

    /// Deletes dead letters; returns the ids removed.
    pub async fn discard_dead_letters(&self, sel: &Selection) -> Result<Vec<Uuid>> {
        self.apply_dead("DELETE FROM {t}", sel).await
    }

    /// Runs `action` (`{t}` standing for the table) on the selected dead letters in one
    /// transaction; the ids it applied to. When any given id is not a dead letter, nothing
    /// is changed ([`StoreError::NotDeadLetters`] names them).
    async fn apply_dead(&self, action: &str, sel: &Selection) -> Result<Vec<Uuid>> {
        let t = &self.q.operator.t;
        let which = match sel {
            Selection::All => String::new(),
            Selection::Ids(ids) if ids.is_empty() => return Ok(Vec::new()),
            Selection::Ids(ids) => format!("AND id IN ({})", id_list(ids)),
        };
        let mut conn = self.conn().await?;
        let mut tx = conn.start_transaction(TxOpts::default()).await?;
        let ids: Vec<String> = tx
            .query(format!(
                "SELECT id FROM {t} WHERE status = 'failed' {which} ORDER BY seq FOR UPDATE"
            ))
            .await?;
        let ids = ids
            .iter()
            .map(|id| parse_id(id))
            .collect::<Result<Vec<_>>>()?;
        if let Selection::Ids(given) = sel
            && let Err(e) = StoreError::unless_all_dead(given, &ids)
        {
            tx.rollback().await?;
            return Err(e);
        }
        if !ids.is_empty() {
            tx.query_drop(format!(
                "{} WHERE status = 'failed' AND id IN ({})",
                action.replace("{t}", t),
                id_list(&ids)
            ))
            .await?;
        }
        tx.commit().await?;
        Ok(ids)
    }

    /// Which of `ids` are dead letters in this table.
    pub async fn which_dead_letters(&self, ids: &[Uuid]) -> Result<Vec<Uuid>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn().await?;
        let found: Vec<String> = conn
            .query(format!(
                "SELECT id FROM {} WHERE status = 'failed' AND id IN ({})",
                self.q.operator.t,
                id_list(ids)
            ))
            .await?;
        found.iter().map(|id| parse_id(id)).collect()
    }

    /// Deletes up to `batch` rows sent (or expired) longer than `retention` ago; how many.
    pub async fn cleanup_batch(&self, retention: Duration, batch: usize) -> Result<u64> {
        let micros = i64::try_from(retention.as_micros()).unwrap_or(i64::MAX);
        let batch = u64::try_from(batch).unwrap_or(u64::MAX);
        let mut conn = self.conn().await?;
        conn.exec_drop(&self.q.operator.cleanup_sent, (micros, batch))
            .await?;
        let mut deleted = conn.affected_rows();
        if deleted < batch {
            conn.exec_drop(&self.q.operator.cleanup_expired, (micros, batch - deleted))
                .await?;
            deleted += conn.affected_rows();
        }
        Ok(deleted)
    }

    /// Whether any row is pending.
    pub async fn any_pending(&self) -> Result<bool> {
        let mut conn = self.conn().await?;
        let found: Option<bool> = conn.query_first(&self.q.operator.any_pending).await?;
        Ok(found.unwrap_or(false))
    }

    /// The backlog gauges' figures.
    pub async fn backlog(&self, ordering: Ordering) -> Result<Backlog> {
        let sql = match ordering {
            Ordering::None => &self.q.operator.backlog_none,
            Ordering::Aggregate => &self.q.operator.backlog_aggregate,
        };
        let mut conn = self.conn().await?;
        let Some(mut r): Option<Row> = conn.query_first(sql).await? else {
            return Ok(Backlog::default());
        };
        Ok(Backlog {
            ready: column(&mut r, 0, "ready")?,
            waiting: column(&mut r, 1, "waiting")?,
            oldest_pending_age: column(&mut r, 2, "oldest_pending_age")?,
            failed: column(&mut r, 3, "failed")?,
            blocked_aggregates: column(&mut r, 4, "blocked_aggregates")?,
            oldest_ready_age: column(&mut r, 5, "oldest_ready_age")?,
            oldest_waiting_age: column(&mut r, 6, "oldest_waiting_age")?,
        })
    }
}
