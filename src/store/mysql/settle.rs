//! Settling claimed rows on MySQL (sent, rejected, handed back), lease renewal and reclaim.
//! Every statement names this relay's `locked_by` and `status = 'processing'`, so a row
//! another relay reclaimed in the meantime is left alone.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Row, TxOpts};
use uuid::Uuid;

use super::claim::{SUSPECT, column, literal};
use super::{MysqlStore, Result, id_list, parse_id};
use crate::config::TableName;
use crate::store::{FailOutcome, Failure, OnConfirm};

/// The statements of settling, rendered once for the table (the id lists are spliced per call).
#[derive(Debug)]
pub(super) struct SettleSql {
    t: String,
    /// Sent (before `WHERE`).
    sent: String,
    /// Sent, retention 0 (before `WHERE`).
    delete: String,
    /// Handed back, the attempt the claim counted taken back (before `WHERE`).
    hand_back: String,
    /// Lease renewed (before `WHERE`).
    heartbeat: String,
    /// Rejected: `?` max attempts (twice), `?` delay (µs), `?` error, `?` id, `?` instance.
    fail: String,
    /// Rows whose lease ran out, locked: `?` lease (µs).
    expired_leases: String,
}

impl SettleSql {
    pub(super) fn new(table: &TableName) -> Self {
        let t = table.qualified();
        Self {
            sent: format!(
                "UPDATE {t} SET status = 'sent', sent_at = NOW(6), locked_by = NULL, \
                   locked_at = NULL, last_error = NULL"
            ),
            delete: format!("DELETE FROM {t}"),
            hand_back: format!(
                "UPDATE {t} SET status = 'pending', attempts = GREATEST(attempts - 1, 0), \
                   locked_by = NULL, locked_at = NULL"
            ),
            heartbeat: format!("UPDATE {t} SET locked_at = NOW(6)"),
            fail: format!(
                "UPDATE {t} SET \
                   status = CASE WHEN attempts >= ? THEN 'failed' ELSE 'pending' END, \
                   available_at = CASE WHEN attempts >= ? THEN available_at \
                                  ELSE NOW(6) + INTERVAL ? MICROSECOND END, \
                   last_error = ?, locked_by = NULL, locked_at = NULL \
                 WHERE id = ? AND status = 'processing' AND locked_by = ?"
            ),
            expired_leases: format!(
                "SELECT seq, attempts FROM {t} WHERE status = 'processing' \
                 AND (locked_at IS NULL OR locked_at < NOW(6) - INTERVAL ? MICROSECOND) \
                 FOR UPDATE SKIP LOCKED"
            ),
            t,
        }
    }
}

impl SettleSql {
    /// `change` (an `UPDATE … SET …` or a `DELETE`, without its `WHERE`) on the rows of `ids`
    /// that relay `by` (an SQL literal) holds.
    fn on_held(change: &str, ids: &[Uuid], by: &str) -> String {
        format!(
            "{change} WHERE id IN ({}) AND status = 'processing' AND locked_by = {by}",
            id_list(ids)
        )
    }

    /// Every statement, by name, with sample lists where a list is spliced per call
    /// (`sql/statements/mysql/`).
    #[cfg(test)]
    pub(super) fn catalog(&self) -> Vec<(String, String)> {
        let (ids, by) = (&[Uuid::nil(), Uuid::max()], &literal("relay-1"));
        [
            ("settle.mark_sent", Self::on_held(&self.sent, ids, by)),
            ("settle.delete_sent", Self::on_held(&self.delete, ids, by)),
            ("settle.hand_back", Self::on_held(&self.hand_back, ids, by)),
            ("settle.heartbeat", Self::on_held(&self.heartbeat, ids, by)),
            ("settle.fail", self.fail.clone()),
            ("settle.expired_leases", self.expired_leases.clone()),
        ]
        .map(|(n, s)| (n.to_owned(), s))
        .to_vec()
    }
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

impl MysqlStore {
    /// Runs `change` (an `UPDATE … SET …` or a `DELETE`, without its `WHERE`) on the rows of
    /// `ids` that this relay holds; returns how many it changed.
    async fn on_held(&self, change: &str, ids: &[Uuid]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let sql = SettleSql::on_held(change, ids, &literal(&self.instance_id));
        let mut conn = self.conn().await?;
        conn.query_drop(sql).await?;
        Ok(conn.affected_rows())
    }

    /// Confirmed rows become `sent` (or are deleted with retention 0).
    pub async fn mark_sent(&self, ids: &[Uuid], on_confirm: OnConfirm) -> Result<u64> {
        let q = &self.q.settle;
        match on_confirm {
            OnConfirm::MarkSent => self.on_held(&q.sent, ids).await,
            OnConfirm::Delete => self.on_held(&q.delete, ids).await,
        }
    }

    /// Rejected rows go back to `pending` after their delay, or become `failed` once they
    /// used `max_attempts`; `last_error` says why. One transaction.
    pub async fn fail(&self, failures: &[Failure], max_attempts: u32) -> Result<FailOutcome> {
        let mut outcome = FailOutcome::default();
        if failures.is_empty() {
            return Ok(outcome);
        }
        let mut conn = self.conn().await?;
        let mut tx = conn.start_transaction(TxOpts::default()).await?;
        for f in failures {
            tx.exec_drop(
                &self.q.settle.fail,
                (
                    max_attempts,
                    max_attempts,
                    micros(f.delay),
                    &f.error,
                    f.id.hyphenated().to_string(),
                    &self.instance_id,
                ),
            )
            .await?;
        }
        let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
        let dead: Vec<String> = tx
            .query(format!(
                "SELECT id FROM {} WHERE id IN ({}) AND status = 'failed'",
                self.q.settle.t,
                id_list(&ids)
            ))
            .await?;
        tx.commit().await?;
        for id in dead {
            outcome.dead_lettered.push(parse_id(&id)?);
        }
        outcome.retried = (failures.len() - outcome.dead_lettered.len()) as u64;
        Ok(outcome)
    }

    /// The rows back to `pending` without spending the attempt the claim counted.
    pub async fn hand_back(&self, ids: &[Uuid]) -> Result<u64> {
        self.on_held(&self.q.settle.hand_back, ids).await
    }

    /// As [`MysqlStore::hand_back`], for the rows in this relay's name that it does not hold (a
    /// claim whose answer the connection lost), within the lease.
    pub async fn hand_back_unheld(&self, held: &[Uuid], lease: Duration) -> Result<u64> {
        let not_held = if held.is_empty() {
            String::new()
        } else {
            format!("AND id NOT IN ({})", id_list(held))
        };
        let sql = format!(
            "{} WHERE status = 'processing' AND locked_by = {} {not_held} \
               AND locked_at >= NOW(6) - INTERVAL {} MICROSECOND",
            self.q.settle.hand_back,
            literal(&self.instance_id),
            micros(lease)
        );
        let mut conn = self.conn().await?;
        conn.query_drop(sql).await?;
        Ok(conn.affected_rows())
    }

    /// Keeps this relay's leases on `ids` alive.
    pub async fn heartbeat(&self, ids: &[Uuid]) -> Result<u64> {
        self.on_held(&self.q.settle.heartbeat, ids).await
    }

    /// Rows whose lease ran out (their relay stopped) go back to `pending` as suspects, or
    /// become `failed` when out of attempts; returns (reclaimed, dead-lettered).
    pub async fn reclaim_expired(&self, lease: Duration, max_attempts: u32) -> Result<(u64, u64)> {
        let mut conn = self.conn().await?;
        let mut tx = conn.start_transaction(TxOpts::default()).await?;
        let rows: Vec<Row> = tx
            .exec(&self.q.settle.expired_leases, (micros(lease),))
            .await?;
        if rows.is_empty() {
            return Ok((0, 0));
        }
        let mut seqs = Vec::with_capacity(rows.len());
        let mut dead = 0u64;
        for mut r in rows {
            seqs.push(column::<i64>(&mut r, 0, "seq")?.to_string());
            let attempts: i64 = column(&mut r, 1, "attempts")?;
            if attempts >= i64::from(max_attempts) {
                dead += 1;
            }
        }
        tx.query_drop(format!(
            "UPDATE {} SET \
                   status = CASE WHEN attempts >= {max_attempts} THEN 'failed' ELSE 'pending' END, \
                   last_error = CONCAT('{SUSPECT} relay ', COALESCE(locked_by, '?'), \
                     ' stopped while holding the row'), \
                   available_at = NOW(6), locked_by = NULL, locked_at = NULL \
                 WHERE seq IN ({})",
            self.q.settle.t,
            seqs.join(",")
        ))
        .await?;
        tx.commit().await?;
        Ok((seqs.len() as u64, dead))
    }
}
