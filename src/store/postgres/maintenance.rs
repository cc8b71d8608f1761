//! The background tasks' statements: the backlog gauges, the table's health (dead tuples,
//! autovacuum) and the relay's own `VACUUM`.

use super::predicates::{no_open_row_before, quote_literal};
use super::{PgStore, Result};
use crate::config::{Ordering, TableName};
use crate::store::HEAD_REACH;

/// The outbox table's health as PostgreSQL's statistics see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TableHealth {
    /// `pg_stat_user_tables.n_dead_tup`.
    pub dead_tuples: i64,
    /// `pg_stat_user_tables.n_live_tup`.
    pub live_tuples: i64,
    /// Seconds since the last vacuum (manual or auto), if any.
    pub since_vacuum: Option<f64>,
    /// Whether autovacuum may run on the table (server `autovacuum` and the table's option).
    pub autovacuum: bool,
    /// Table + indexes + TOAST, bytes.
    pub total_bytes: i64,
    /// Whether this session may vacuum and analyze the table (owner, superuser, or the
    /// `MAINTAIN` privilege on PostgreSQL 17+).
    pub may_vacuum: bool,
    /// Whether a vacuum or an analyze of the table (autovacuum's or another relay's) is
    /// running now.
    pub vacuum_running: bool,
    /// The row count the planner's statistics last saw (`pg_class.reltuples`, as of the last
    /// vacuum or analyze); `None` before the first.
    pub stats_rows: Option<f64>,
    /// Seconds since the least recently analyzed part of the table that holds rows (the
    /// table itself, or each partition) was analyzed, manually, by a relay's vacuum or by
    /// autovacuum; `None` when one of them never was.
    pub since_analyze: Option<f64>,
}

/// The background tasks' SQL text, rendered once for the configured table.
#[derive(Debug, Clone)]
pub(super) struct MaintenanceSql {
    pub(super) backlog_none: String,
    pub(super) backlog_aggregate: String,
    pub(super) any_pending: String,
    pub(super) table_health: String,
    pub(super) vacuum: String,
    pub(super) vacuum_analyze: String,
    pub(super) analyze: String,
}

/// Which pending rows `outbox_oldest_ready_age_seconds` looks at: those a claim would take now.
#[derive(Debug, Clone, Copy)]
enum ReadyAge {
    /// `ordering = "none"`: every ready row.
    Any,
    /// `ordering = "aggregate"`: ready rows without an aggregate, and ready heads of their
    /// aggregate (no open row before them), among the first [`HEAD_REACH`] pending rows. A
    /// row behind a dead letter, a row in flight or one backing off is not claimable, so it is
    /// not lag the relay could catch up on (`outbox_blocked_aggregates` and the other gauges
    /// show it). The rows behind a claimable head go out with it; they have been claimable no
    /// longer than it has.
    Head,
}

/// The backlog statement. Cheap on a large table: each part walks a partial index. The
/// oldest unsent row is approximated by the lowest seq among pending and processing rows. A
/// ready row's age counts from when it became ready (its insert, or the end of its backoff);
/// a row past its `expires_at` is never claimed, so it is not ready either.
fn backlog(t: &str, ready: ReadyAge) -> String {
    let (rows, head) = match ready {
        ReadyAge::Any => (t.to_owned(), String::new()),
        ReadyAge::Head => (
            format!(
                "(SELECT seq, status, aggregate_type, aggregate_id, created_at, available_at, \
                   expires_at FROM {t} WHERE status = 'pending' ORDER BY seq LIMIT {HEAD_REACH})"
            ),
            // True of a row without an aggregate; outside any `OR`, so the planner can make
            // its probes joins.
            format!("AND {} ", no_open_row_before(t, "c")),
        ),
    };
    let failed_head = no_open_row_before(t, "f");
    format!(
        "SELECT p.ready, p.waiting, \
           (SELECT coalesce(extract(epoch FROM now() - least( \
               (SELECT created_at FROM {t} WHERE status = 'pending' ORDER BY seq LIMIT 1), \
               (SELECT min(created_at) FROM {t} WHERE status = 'processing'))), 0)::float8), \
           (SELECT count(*) FROM {t} WHERE status = 'failed'), \
           (SELECT count(*) FROM (SELECT DISTINCT f.aggregate_type, f.aggregate_id FROM {t} f \
              WHERE f.status = 'failed' AND f.aggregate_id IS NOT NULL AND {failed_head}) b), \
           (SELECT coalesce(extract(epoch FROM now() \
               - min(greatest(c.created_at, c.available_at))), 0)::float8 \
            FROM {rows} c WHERE c.status = 'pending' AND c.available_at <= now() \
              AND (c.expires_at IS NULL OR c.expires_at > now()) {head}), \
           p.waiting_age \
         FROM (SELECT count(*) FILTER (WHERE available_at <= now()) AS ready, \
                 count(*) FILTER (WHERE available_at > now()) AS waiting, \
                 coalesce(extract(epoch FROM now() - min(created_at) \
                   FILTER (WHERE available_at > now())), 0)::float8 AS waiting_age \
               FROM {t} WHERE status = 'pending') p"
    )
}

impl MaintenanceSql {
    pub(super) fn new(table: &TableName) -> Self {
        let t = table.qualified();
        Self {
            backlog_none: backlog(&t, ReadyAge::Any),
            backlog_aggregate: backlog(&t, ReadyAge::Head),
            // One probe of the pending index: whether the idle backlog loop should refresh.
            any_pending: format!("SELECT EXISTS (SELECT 1 FROM {t} WHERE status = 'pending')"),
            // $1 the table's oid at start (the name is looked up first: it finds the table again
            // once `migrate` has partitioned it). Dead tuples and vacuum history of the table and
            // its partitions, and the age of the oldest analyze among those holding rows; whether
            // autovacuum may run on it (server setting and the table's own option); whether this
            // role may vacuum it (`MAINTAIN` exists from PostgreSQL 17 on: the CASE keeps older
            // servers from parsing the privilege name).
            table_health: format!(
                "SELECT coalesce(s.n_dead_tup, 0), coalesce(s.n_live_tup, 0), \
                   extract(epoch FROM now() - greatest(s.last_vacuum, s.last_autovacuum))::float8, \
                   current_setting('autovacuum') = 'on' \
                     AND coalesce((SELECT option_value FROM pg_options_to_table(c.reloptions) \
                                   WHERE option_name = 'autovacuum_enabled'), 'true')::bool, \
                   pg_total_relation_size(c.oid) + coalesce((SELECT sum(pg_total_relation_size(p.relid)) \
                     FROM pg_partition_tree(c.oid) p WHERE p.relid <> c.oid), 0)::bigint, \
                   pg_has_role(c.relowner, 'MEMBER') \
                     OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) \
                     OR CASE WHEN current_setting('server_version_num')::int >= 170000 \
                          THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END, \
                   EXISTS (SELECT 1 FROM pg_stat_progress_vacuum v WHERE v.relid = c.oid) \
                     OR EXISTS (SELECT 1 FROM pg_stat_progress_analyze a WHERE a.relid = c.oid), \
                   CASE WHEN c.reltuples >= 0 THEN c.reltuples::float8 END, \
                   CASE WHEN NOT s.unanalyzed THEN \
                     extract(epoch FROM now() - s.analyzed_at)::float8 END \
                 FROM pg_class c LEFT JOIN LATERAL ( \
                   SELECT sum(t.n_dead_tup)::bigint AS n_dead_tup, sum(t.n_live_tup)::bigint AS n_live_tup, \
                          max(t.last_vacuum) AS last_vacuum, max(t.last_autovacuum) AS last_autovacuum, \
                          coalesce(bool_or(t.n_live_tup + t.n_dead_tup > 0 \
                            AND t.last_analyze IS NULL AND t.last_autoanalyze IS NULL), false) AS unanalyzed, \
                          min(greatest(t.last_analyze, t.last_autoanalyze)) \
                            FILTER (WHERE t.n_live_tup + t.n_dead_tup > 0) AS analyzed_at \
                     FROM pg_stat_user_tables t \
                    WHERE t.relid = c.oid OR t.relid IN (SELECT p.relid FROM pg_partition_tree(c.oid) p)) s ON true \
                 WHERE c.oid = coalesce(to_regclass({})::oid, $1)",
                quote_literal(&t)
            ),
            // No truncation: it takes an ACCESS EXCLUSIVE lock at the end of the table, which
            // would stall inserts and claims (and is replayed on standbys).
            vacuum: format!("VACUUM (TRUNCATE false) {t}"),
            vacuum_analyze: format!("VACUUM (ANALYZE, TRUNCATE false) {t}"),
            // SKIP_LOCKED: an analyze or vacuum the health check did not see (statistics of
            // other users' backends are hidden) would make it wait; the next check retries.
            analyze: format!("ANALYZE (SKIP_LOCKED) {t}"),
        }
    }
}

impl PgStore {
    /// Dead tuples, size and autovacuum state of the table.
    pub async fn table_health(&self, table_oid: u32) -> Result<TableHealth> {
        let r = self
            .query_one_by_oid(&self.q.maintenance.table_health, table_oid)
            .await?;
        Ok(TableHealth {
            dead_tuples: r.try_get(0)?,
            live_tuples: r.try_get(1)?,
            since_vacuum: r.try_get(2)?,
            autovacuum: r.try_get(3)?,
            total_bytes: r.try_get(4)?,
            may_vacuum: r.try_get(5)?,
            vacuum_running: r.try_get(6)?,
            stats_rows: r.try_get(7)?,
            since_analyze: r.try_get(8)?,
        })
    }

    /// Runs a plain `VACUUM` of the table (`VACUUM (ANALYZE)` with `analyze`) on a pooled
    /// connection outside any transaction. It takes a SHARE UPDATE EXCLUSIVE lock, which
    /// claims, settles and inserts do not conflict with.
    pub async fn vacuum(&self, analyze: bool) -> Result<()> {
        let client = self.client().await?;
        let sql = if analyze {
            &self.q.maintenance.vacuum_analyze
        } else {
            &self.q.maintenance.vacuum
        };
        client.batch_execute(sql).await?;
        Ok(())
    }

    /// Runs `ANALYZE` of the table (the same lock as `VACUUM`; samples, does not scan it all).
    pub async fn analyze(&self) -> Result<()> {
        let client = self.client().await?;
        client.batch_execute(&self.q.maintenance.analyze).await?;
        Ok(())
    }

    /// Whether the table has a pending row (one index probe).
    pub async fn any_pending(&self) -> Result<bool> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(&self.q.maintenance.any_pending)
            .await?;
        Ok(client.query_one(&stmt, &[]).await?.try_get(0)?)
    }

    /// The backlog gauges: pending (ready / waiting), oldest unsent, ready and waiting ages,
    /// dead letters, blocked aggregates. The ready age counts only rows a claim with
    /// `ordering` would take now.
    pub async fn backlog(&self, ordering: Ordering) -> Result<Backlog> {
        let client = self.client().await?;
        let sql = match ordering {
            Ordering::None => &self.q.maintenance.backlog_none,
            Ordering::Aggregate => &self.q.maintenance.backlog_aggregate,
        };
        let stmt = client.prepare_cached(sql).await?;
        let r = client.query_one(&stmt, &[]).await?;
        Ok(Backlog {
            ready: r.try_get(0)?,
            waiting: r.try_get(1)?,
            oldest_pending_age: r.try_get(2)?,
            failed: r.try_get(3)?,
            blocked_aggregates: r.try_get(4)?,
            oldest_ready_age: r.try_get(5)?,
            oldest_waiting_age: r.try_get(6)?,
        })
    }
}

/// What the backlog statement reads: the table's pending, waiting and dead rows and their
/// ages, for the backlog gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Backlog {
    /// Pending rows ready now.
    pub ready: i64,
    /// Pending rows waiting for a retry.
    pub waiting: i64,
    /// Age of the oldest pending or processing row, seconds.
    pub oldest_pending_age: f64,
    /// How long the oldest ready row has been ready, seconds (0 when none).
    pub oldest_ready_age: f64,
    /// Age of the oldest row waiting out a backoff, seconds (0 when none).
    pub oldest_waiting_age: f64,
    /// Dead letters.
    pub failed: i64,
    /// Aggregates held by a dead letter.
    pub blocked_aggregates: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_name_the_schema_qualified_table() {
        let q =
            MaintenanceSql::new(&TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(q.vacuum, "VACUUM (TRUNCATE false) app.events");
        assert_eq!(
            q.vacuum_analyze,
            "VACUUM (ANALYZE, TRUNCATE false) app.events"
        );
        for backlog in [&q.backlog_none, &q.backlog_aggregate, &q.any_pending] {
            let pending = "FROM app.events WHERE status = 'pending'";
            assert!(backlog.contains(pending), "{backlog}");
            assert!(!backlog.contains("outbox_messages"), "{backlog}");
        }
        assert!(
            q.table_health
                .contains("WHERE c.oid = coalesce(to_regclass('app.events')::oid, $1)")
        );
    }
}
