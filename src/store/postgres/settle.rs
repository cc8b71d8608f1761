//! Settling and leases: what happens to claimed rows after the broker answered (sent or deleted,
//! failed with a backoff or dead-lettered, handed back without spending an attempt), the renewal of
//! the leases of rows in flight, and the reclaim of rows whose relay stopped. Every statement
//! touches only rows still locked in this relay's name, except the reclaim, which takes rows whose
//! lease ran out whoever held them.

use std::time::Duration;

use uuid::Uuid;

use super::predicates::SUSPECT;
use super::{PgStore, Result};
use crate::config::TableName;

/// A message-level failure to record: back off, or dead-letter when out of attempts.
#[derive(Debug, Clone)]
pub struct Failure {
    /// Row id.
    pub id: Uuid,
    /// Why it failed (stored in `last_error`).
    pub error: String,
    /// Delay before the next attempt.
    pub delay: Duration,
}

/// What [`PgStore::fail`] did with the failures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailOutcome {
    /// Rows scheduled for another attempt.
    pub retried: u64,
    /// Rows moved to `failed`.
    pub dead_lettered: Vec<Uuid>,
}

/// What becomes of a row the broker confirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnConfirm {
    /// Marked `sent`, kept for `cleanup.retention`.
    MarkSent,
    /// Deleted at once (`cleanup.retention = "0s"`).
    Delete,
}

/// The SQL text of settling and leases, rendered once for the configured table.
#[derive(Debug, Clone)]
pub(super) struct SettleSql {
    pub(super) mark_sent: String,
    pub(super) delete_sent: String,
    pub(super) fail: String,
    pub(super) hand_back: String,
    pub(super) hand_back_unheld: String,
    pub(super) heartbeat: String,
    pub(super) reclaim: String,
}

impl SettleSql {
    /// The statements for `table`, `partitioned` or not (see [`held`]).
    pub(super) fn new(table: &TableName, partitioned: bool) -> Self {
        let t = table.qualified();
        Self {
            mark_sent: mark_sent(&t, partitioned),
            delete_sent: delete_sent(&t, partitioned),
            fail: fail(&t, partitioned),
            hand_back: hand_back(&t, partitioned),
            hand_back_unheld: hand_back_unheld(&t),
            heartbeat: heartbeat(&t, partitioned),
            reclaim: reclaim(&t),
        }
    }
}

/// [`mark_sent`] for the plain `table`, for the benchmark's replay of the hot path.
#[cfg(any(test, feature = "bench"))]
pub(super) fn mark_sent_sql(table: &TableName) -> String {
    mark_sent(&table.qualified(), false)
}

/// The row `alias` (`""` or `"t."`) is in flight in the name of the instance id `by`, for the
/// statements that name their rows by id. On a plain table `status = 'processing'` is written
/// `IS TRUE` (the same condition) so that it does not match the predicate of
/// `<table>_processing_idx`: with it, the plan of such a statement may read every row in flight
/// through that index and compare each with every id given (it does once the table was
/// analyzed with no row in flight, as after a bulk load), which cost a 500-row mark-sent with
/// 2,000 rows in flight 7-10 ms against 4 ms by the primary key. A `partitioned` table keeps
/// the plain condition: by primary key every partition would be probed for every id, where
/// the processing index of a partition with nothing in flight is empty.
fn held(alias: &str, by: &str, partitioned: bool) -> String {
    if partitioned {
        format!("{alias}status = 'processing' AND {alias}locked_by = {by}")
    } else {
        format!("({alias}status = 'processing') IS TRUE AND {alias}locked_by = {by}")
    }
}

/// Confirmed rows become `sent`. `$1` ids, `$2` instance id.
fn mark_sent(t: &str, partitioned: bool) -> String {
    let held = held("", "$2", partitioned);
    format!(
        "UPDATE {t} SET status = 'sent', sent_at = now(), locked_by = NULL, locked_at = NULL, last_error = NULL \
         WHERE id = ANY($1) AND {held}"
    )
}

/// Confirmed rows are deleted (retention 0). `$1` ids, `$2` instance id.
fn delete_sent(t: &str, partitioned: bool) -> String {
    let held = held("", "$2", partitioned);
    format!("DELETE FROM {t} WHERE id = ANY($1) AND {held}")
}

/// Rejected rows go back to `pending` after their delay, or become `failed` (a dead letter,
/// `available_at` kept) once they used `$5` attempts; `last_error` says why. `$1` ids, `$2`
/// errors, `$3` delays (ms), `$4` instance id, `$5` max attempts.
fn fail(t: &str, partitioned: bool) -> String {
    let held = held("t.", "$4", partitioned);
    format!(
        "UPDATE {t} AS t SET \
           status = CASE WHEN t.attempts >= $5 THEN 'failed' ELSE 'pending' END, \
           available_at = CASE WHEN t.attempts >= $5 THEN t.available_at \
                          ELSE now() + f.delay_ms * interval '1 millisecond' END, \
           last_error = f.error, locked_by = NULL, locked_at = NULL \
         FROM unnest($1::uuid[], $2::text[], $3::bigint[]) AS f(id, error, delay_ms) \
         WHERE t.id = f.id AND {held} \
         RETURNING t.id, t.status"
    )
}

/// The rows back to `pending` without spending the attempt the claim counted. `$1` ids, `$2`
/// instance id.
fn hand_back(t: &str, partitioned: bool) -> String {
    let held = held("", "$2", partitioned);
    format!(
        "UPDATE {t} SET status = 'pending', attempts = greatest(attempts - 1, 0), \
           locked_by = NULL, locked_at = NULL \
         WHERE id = ANY($1) AND {held}"
    )
}

/// As [`hand_back`], for the rows in this relay's name that it does not hold: a claim committed
/// whose answer the connection lost, so they were never published. Rows whose lease ran out
/// are left to [`reclaim`] (an outcome this relay gave up recording). `$1` the ids the relay
/// holds, `$2` instance id, `$3` lease (ms).
fn hand_back_unheld(t: &str) -> String {
    format!(
        "UPDATE {t} SET status = 'pending', attempts = greatest(attempts - 1, 0), \
           locked_by = NULL, locked_at = NULL \
         WHERE status = 'processing' AND locked_by = $2 AND NOT (id = ANY($1)) \
           AND locked_at >= now() - $3::bigint * interval '1 millisecond'"
    )
}

/// Keeps this relay's leases alive while it waits for a slow broker, so only a relay that
/// stopped ever has its rows reclaimed. Only the ids the relay holds: a row claimed in its
/// name whose answer was lost is handed back ([`PgStore::hand_back_unheld`]) or, if this relay
/// stops first, expires. `$1` ids, `$2` instance id.
fn heartbeat(t: &str, partitioned: bool) -> String {
    let held = held("", "$2", partitioned);
    format!(
        "UPDATE {t} SET locked_at = now() \
         WHERE id = ANY($1) AND {held}"
    )
}

/// Rows whose lease ran out (their relay stopped): back to `pending` as suspects
/// ([`SUSPECT`], claimed one at a time), or `failed` when out of attempts; the claim already
/// spent their attempt. A `processing` row without `locked_at` (written so by hand: no relay
/// leaves one) counts as expired. `$1` lease (ms), `$2` max attempts.
fn reclaim(t: &str) -> String {
    format!(
        "UPDATE {t} SET \
           status = CASE WHEN attempts >= $2 THEN 'failed' ELSE 'pending' END, \
           last_error = '{SUSPECT} relay ' || coalesce(locked_by, '?') || ' stopped while holding the row', \
           available_at = now(), locked_by = NULL, locked_at = NULL \
         WHERE status = 'processing' \
           AND (locked_at IS NULL OR locked_at < now() - $1::bigint * interval '1 millisecond') \
         RETURNING id, status"
    )
}

impl PgStore {
    /// Marks confirmed rows `sent`, or deletes them, as `on_confirm` says.
    pub async fn mark_sent(&self, ids: &[Uuid], on_confirm: OnConfirm) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let client = self.client().await?;
        let sql = match on_confirm {
            OnConfirm::MarkSent => &self.q.settle.mark_sent,
            OnConfirm::Delete => &self.q.settle.delete_sent,
        };
        let stmt = client.prepare_cached(sql).await?;
        Ok(client.execute(&stmt, &[&ids, &self.instance_id]).await?)
    }

    /// Records message-level failures: back to `pending` after `delay`, or `failed` once the
    /// row has used `max_attempts`.
    pub async fn fail(&self, failures: &[Failure], max_attempts: u32) -> Result<FailOutcome> {
        if failures.is_empty() {
            return Ok(FailOutcome::default());
        }
        let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
        let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
        let delays: Vec<i64> = failures
            .iter()
            .map(|f| i64::try_from(f.delay.as_millis()).unwrap_or(i64::MAX))
            .collect();
        let max = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.settle.fail).await?;
        let rows = client
            .query(&stmt, &[&ids, &errors, &delays, &self.instance_id, &max])
            .await?;
        let mut out = FailOutcome::default();
        for r in rows {
            let status: &str = r.try_get(1)?;
            if status == "failed" {
                out.dead_lettered.push(r.try_get(0)?);
            } else {
                out.retried += 1;
            }
        }
        Ok(out)
    }

    /// Hands rows back to `pending` without spending an attempt (connection-level failure,
    /// shutdown, or rows never published because an earlier row of their aggregate failed).
    pub async fn hand_back(&self, ids: &[Uuid]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.settle.hand_back).await?;
        Ok(client.execute(&stmt, &[&ids, &self.instance_id]).await?)
    }

    /// Hands back, without spending an attempt, the `processing` rows locked in this instance's
    /// name that are not in `held`: rows of a claim that committed while its answer was lost with
    /// the connection, which this relay therefore never published. Without this they would wait out
    /// `relay.lease_timeout`, holding back the rest of their aggregates; rows whose `lease` already
    /// ran out are left to the reclaim. Call only while none of this relay's claims is running,
    /// with every id a batch still holds in `held`.
    pub async fn hand_back_unheld(&self, held: &[Uuid], lease: Duration) -> Result<u64> {
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(&self.q.settle.hand_back_unheld)
            .await?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&held, &self.instance_id, &lease_ms];
        Ok(client.execute(&stmt, &params).await?)
    }

    /// Renews the leases of `ids` where this instance still holds them; returns how many.
    pub async fn heartbeat(&self, ids: &[Uuid]) -> Result<u64> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.settle.heartbeat).await?;
        Ok(client.execute(&stmt, &[&ids, &self.instance_id]).await?)
    }

    /// Returns `processing` rows whose lease expired to `pending` (or `failed` when out of
    /// attempts). Returns (reclaimed, dead-lettered).
    pub async fn reclaim_expired(&self, lease: Duration, max_attempts: u32) -> Result<(u64, u64)> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.settle.reclaim).await?;
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let max = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        let rows = client.query(&stmt, &[&lease_ms, &max]).await?;
        let failed = rows
            .iter()
            .filter(|r| r.get::<_, &str>(1) == "failed")
            .count() as u64;
        Ok((rows.len() as u64 - failed, failed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settles_touch_only_rows_still_locked_in_our_name() {
        let table = TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}"));
        let q = SettleSql::new(&table, false);
        for (name, sql) in [
            ("mark_sent", &q.mark_sent),
            ("delete_sent", &q.delete_sent),
            ("hand_back", &q.hand_back),
            ("heartbeat", &q.heartbeat),
        ] {
            assert!(sql.contains("app.events "), "{name}: {sql}");
            let ours = "WHERE id = ANY($1) AND (status = 'processing') IS TRUE AND locked_by = $2";
            assert!(sql.contains(ours), "{name}: {sql}");
        }
        let ours = "status = 'processing' AND locked_by = $2";
        assert!(q.hand_back_unheld.contains(ours), "{}", q.hand_back_unheld);
        // Partitioned: each partition's processing index, not every partition's primary key.
        let p = SettleSql::new(&table, true);
        for sql in [&p.mark_sent, &p.delete_sent, &p.hand_back, &p.heartbeat] {
            let ours = "WHERE id = ANY($1) AND status = 'processing' AND locked_by = $2";
            assert!(sql.contains(ours), "{sql}");
        }
        let ours = "t.status = 'processing' AND t.locked_by = $4";
        assert!(
            p.fail.contains(ours) && !p.fail.contains("IS TRUE"),
            "{}",
            p.fail
        );
        assert!(
            q.fail
                .contains("(t.status = 'processing') IS TRUE AND t.locked_by = $4"),
            "{}",
            q.fail
        );
        // Handing back takes back the attempt the claim counted; the reclaim does not.
        for sql in [&q.hand_back, &q.hand_back_unheld] {
            assert!(
                sql.contains("attempts = greatest(attempts - 1, 0)"),
                "{sql}"
            );
        }
        assert!(!q.reclaim.contains("attempts -"), "{}", q.reclaim);
        // Rows whose lease ran out are the reclaim's, never handed back.
        let fresh = "locked_at >= now() - $3::bigint * interval '1 millisecond'";
        assert!(q.hand_back_unheld.contains(fresh), "{}", q.hand_back_unheld);
        assert!(
            q.reclaim.contains("'lease expired: relay '"),
            "{}",
            q.reclaim
        );
    }
}
