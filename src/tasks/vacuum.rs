//! Keeps the outbox table small whatever the server's autovacuum does.
//!
//! Every row of a queue table is inserted, updated (claimed), then updated (sent) or deleted,
//! so it leaves two dead tuples behind; at 2,000 rows/s that is 4,000 a second. With
//! `autovacuum = off` (or its default 20% scale factor on a table that is mostly dead) the
//! table and its indexes grow without bound and every claim walks more dead entries. This task
//! reads the table's statistics every few seconds and runs a plain `VACUUM` itself when dead
//! tuples pile up and autovacuum is off, or on but far behind. Plain `VACUUM` takes a SHARE
//! UPDATE EXCLUSIVE lock: inserts, claims and settles go on meanwhile. While the outbox is
//! idle (no rows claimed since the last check) it reads them every 30 s instead: only the
//! retention clean-up makes dead tuples then.
//!
//! It also runs `ANALYZE` when the planner's statistics predate a backlog (the table was never
//! analyzed, or holds ten times the rows they counted). The ordered claim's generic plan is
//! chosen from them (without statistics it sorts every pending row for each claim), and with
//! autovacuum off nothing else would analyze the table before the relay's first vacuum. A
//! vacuum analyzes too when the statistics are older than [`ANALYZE_EVERY`]: sampling a
//! drained table costs several times what vacuuming it does, and a vacuum every few seconds
//! need not repeat it each time.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::Pace;
use crate::backoff::sleep_or_cancel;
use crate::store::{PgStore, TableHealth};
use crate::telemetry::OutboxMetrics;

/// How often the table's statistics are read.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// Dead tuples that make a vacuum worth it when autovacuum is off: a few seconds of traffic
/// at the rates the relay is sized for, so the table stays within a few MB.
const DEAD_TUPLES: i64 = 10_000;

/// With autovacuum on, the relay steps in only when this many times [`DEAD_TUPLES`] have
/// piled up (autovacuum is behind: the migration asks it to run at 5,000).
const BEHIND_FACTOR: i64 = 5;

/// Rows from which a table whose statistics predate them is analyzed.
const ANALYZE_FROM: i64 = 1_000;

/// How many times the rows the statistics counted make them stale (see [`should_analyze`]).
const STALE_GROWTH: f64 = 10.0;

/// Statistics older than this are refreshed by the next vacuum (`VACUUM (ANALYZE)`); younger
/// ones are left as they are (a plain `VACUUM`).
pub const ANALYZE_EVERY: Duration = Duration::from_secs(10 * 60);

/// Whether a vacuum due now should analyze the table as well: some part of it that holds
/// rows was never analyzed or last more than [`ANALYZE_EVERY`] ago, or the statistics predate
/// the backlog ([`should_analyze`], which a due vacuum would otherwise put off).
pub fn vacuum_analyzes(h: &TableHealth) -> bool {
    should_analyze(h)
        || h.since_analyze
            .is_none_or(|s| s.is_nan() || s >= ANALYZE_EVERY.as_secs_f64())
}

/// Whether to analyze now: at least [`ANALYZE_FROM`] live rows and [`STALE_GROWTH`] times
/// what the statistics counted (or none yet), and no vacuum or analyze running.
pub fn should_analyze(h: &TableHealth) -> bool {
    let counted = h.stats_rows.unwrap_or(0.0).max(0.0);
    h.may_vacuum
        && !h.vacuum_running
        && h.live_tuples >= ANALYZE_FROM
        && h.live_tuples as f64 > STALE_GROWTH * counted
}

/// Whether to vacuum now, and why.
pub fn should_vacuum(h: &TableHealth) -> Option<&'static str> {
    if !h.may_vacuum || h.vacuum_running {
        return None;
    }
    // On a table with a large live backlog a vacuum scans every index in full: wait until a
    // fifth of the table is dead.
    let threshold = DEAD_TUPLES.max(h.live_tuples / 5);
    if !h.autovacuum && h.dead_tuples >= threshold {
        Some("autovacuum is off")
    } else if h.autovacuum && h.dead_tuples >= threshold * BEHIND_FACTOR {
        Some("autovacuum is behind")
    } else {
        None
    }
}

/// Reads the table's health every 5 s (`CHECK_EVERY`, publishing the dead-tuple gauge) while
/// rows are claimed, every [`super::IDLE_EVERY`] while the outbox is idle, and vacuums it when
/// [`should_vacuum`] says so, until `shutdown`.
pub async fn vacuum_loop(
    store: PgStore,
    metrics: OutboxMetrics,
    table_oid: u32,
    shutdown: CancellationToken,
) {
    let mut pace = Pace::new(metrics.clone());
    let mut keeper = Keeper {
        store,
        metrics,
        table_oid,
        told_owner: false,
        told_autovacuum: None,
        unremovable: 0,
        vacuumed_at: None,
    };
    loop {
        if pace.due(false, Instant::now()) {
            keeper.check().await;
        }
        if !sleep_or_cancel(CHECK_EVERY, &shutdown).await {
            return;
        }
    }
}

/// The vacuum task's state between checks.
struct Keeper {
    store: PgStore,
    metrics: OutboxMetrics,
    table_oid: u32,
    /// The role's lack of ownership was logged (once per process: privileges do not change
    /// by waiting).
    told_owner: bool,
    /// The autovacuum setting last logged.
    told_autovacuum: Option<bool>,
    /// Dead tuples the last vacuum could not remove (a long transaction or a replication slot
    /// still needs them): they do not count again, or every check would vacuum in vain. For
    /// [`UNREMOVABLE_FOR`] only: once what held them back has ended they are removable, and
    /// nothing else says when that is.
    unremovable: i64,
    /// When the relay last vacuumed the table.
    vacuumed_at: Option<Instant>,
}

/// How long dead tuples a vacuum could not remove are left out of the count (see
/// [`Keeper::unremovable`]): at most one vacuum in vain per period while a long transaction
/// holds them, and a vacuum within this long of its end.
const UNREMOVABLE_FOR: Duration = Duration::from_secs(60);

impl Keeper {
    /// One check: read the table's health, then vacuum or analyze it if due.
    async fn check(&mut self) {
        let store = &self.store;
        let h = match store.bounded(store.table_health(self.table_oid)).await {
            Ok(h) => h,
            Err(e) if e.is_connection() => {
                return tracing::debug!(error = %e, "table statistics not read");
            }
            Err(e) => return tracing::warn!(error = %e, "table statistics not read"),
        };
        self.metrics.dead_tuples(h.dead_tuples);
        self.tell(&h);
        if self
            .vacuumed_at
            .is_some_and(|t| t.elapsed() >= UNREMOVABLE_FOR)
        {
            self.unremovable = 0;
        }
        self.unremovable = self.unremovable.min(h.dead_tuples);
        let mut fresh = h;
        fresh.dead_tuples -= self.unremovable;
        if let Some(reason) = should_vacuum(&fresh) {
            self.vacuum(&h, reason).await;
        } else if should_analyze(&h) {
            self.analyze(&h).await;
        }
    }

    /// Logs how the relay looks after the table, when that changed (or first seen).
    fn tell(&mut self, h: &TableHealth) {
        let table = self.store.table();
        if self.told_autovacuum != Some(h.autovacuum) {
            self.told_autovacuum = Some(h.autovacuum);
            tracing::info!(
                %table,
                autovacuum = h.autovacuum,
                "the relay vacuums the table itself when {} dead tuples pile up{}",
                DEAD_TUPLES,
                if h.autovacuum { " beyond what autovacuum keeps up with" } else { " (autovacuum is off for it)" }
            );
        }
        if !h.may_vacuum && !self.told_owner {
            self.told_owner = true;
            tracing::warn!(
                %table,
                "VACUUM and ANALYZE of the outbox table need its ownership (or the MAINTAIN privilege on PostgreSQL 17+), which the relay's database role lacks: the relay skips them and goes on relaying; make sure autovacuum runs on the table"
            );
        }
    }

    /// Vacuums the table, noting the dead tuples the vacuum left behind.
    async fn vacuum(&mut self, h: &TableHealth, reason: &str) {
        let started = Instant::now();
        let store = &self.store;
        let analyzed = vacuum_analyzes(h);
        if let Err(e) = store.bounded_maintenance(store.vacuum(analyzed)).await {
            return tracing::warn!(error = %e, "vacuum of the outbox table failed");
        }
        self.metrics.vacuumed();
        let after = store.bounded(store.table_health(self.table_oid)).await.ok();
        self.unremovable = after.map_or(0, |a| a.dead_tuples);
        self.vacuumed_at = Some(Instant::now());
        tracing::info!(
            table = %self.store.table(),
            reason,
            analyzed,
            dead_tuples_before = h.dead_tuples,
            dead_tuples_after = after.map(|a| a.dead_tuples),
            bytes = after.map(|a| a.total_bytes),
            took_ms = started.elapsed().as_millis() as u64,
            "vacuumed the outbox table"
        );
    }

    /// Analyzes the table, whose statistics predate its backlog.
    async fn analyze(&self, h: &TableHealth) {
        let started = Instant::now();
        match self.store.bounded_maintenance(self.store.analyze()).await {
            Ok(()) => tracing::info!(
                table = %self.store.table(),
                live_tuples = h.live_tuples,
                counted_before = h.stats_rows,
                took_ms = started.elapsed().as_millis() as u64,
                "analyzed the outbox table: its statistics predated the backlog, and the claim's plan is chosen from them"
            ),
            Err(e) => tracing::warn!(error = %e, "analyze of the outbox table failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(dead: i64, live: i64, autovacuum: bool) -> TableHealth {
        TableHealth {
            dead_tuples: dead,
            live_tuples: live,
            since_vacuum: None,
            autovacuum,
            total_bytes: 0,
            may_vacuum: true,
            vacuum_running: false,
            stats_rows: Some(live as f64),
            since_analyze: None,
        }
    }

    #[test]
    fn a_vacuum_analyzes_only_statistics_older_than_ten_minutes() {
        let aged = |since_analyze| TableHealth {
            since_analyze,
            ..health(20_000, 100, false)
        };
        for (since, expected) in [
            (None, true),
            (Some(0.0), false),
            (Some(599.0), false),
            (Some(600.0), true),
            (Some(86_400.0), true),
            // A clock step backwards makes the age negative: still fresh.
            (Some(-5.0), false),
            (Some(f64::NAN), true),
        ] {
            assert_eq!(vacuum_analyzes(&aged(since)), expected, "{since:?}");
        }
        // Fresh statistics that predate a backlog ten times their count: analyzed all the same.
        let behind = TableHealth {
            live_tuples: 50_000,
            stats_rows: Some(1_000.0),
            ..aged(Some(60.0))
        };
        assert!(vacuum_analyzes(&behind));
    }

    #[test]
    fn vacuums_when_dead_tuples_pile_up_beyond_what_autovacuum_handles() {
        let (off, behind) = (Some("autovacuum is off"), Some("autovacuum is behind"));
        // (dead tuples, live tuples, autovacuum, expected)
        for (dead, live, autovacuum, expected) in [
            // Autovacuum off: from DEAD_TUPLES on.
            (9_999, 100, false, None),
            (10_000, 100, false, off),
            // A large live backlog raises the bar to a fifth of the table.
            (150_000, 1_000_000, false, None),
            (200_000, 1_000_000, false, off),
            // A keeping-up autovacuum is left alone: only BEHIND_FACTOR times the bar counts.
            (40_000, 100, true, None),
            (50_000, 100, true, behind),
        ] {
            assert_eq!(
                should_vacuum(&health(dead, live, autovacuum)),
                expected,
                "{dead} dead, {live} live, autovacuum {autovacuum}"
            );
        }
    }

    #[test]
    fn analyzes_when_the_statistics_predate_a_backlog() {
        let with = |live, stats_rows| TableHealth {
            stats_rows,
            ..health(0, live, true)
        };
        // (live tuples, rows the statistics counted, expected)
        for (live, counted, expected) in [
            // Never analyzed: from ANALYZE_FROM rows on.
            (999, None, false),
            (1_000, None, true),
            // Analyzed while small, then a backlog: past ten times what they counted.
            (50_000, Some(1_000.0), true),
            (9_000, Some(1_000.0), false),
            // Statistics that saw the backlog, or a small table: nothing to do.
            (50_000, Some(45_000.0), false),
            (500, Some(10.0), false),
        ] {
            assert_eq!(
                should_analyze(&with(live, counted)),
                expected,
                "{live} live, statistics counted {counted:?}"
            );
        }
        let mut h = with(50_000, None);
        h.vacuum_running = true;
        assert!(!should_analyze(&h), "an analyze or vacuum is running");
        h.vacuum_running = false;
        h.may_vacuum = false;
        assert!(!should_analyze(&h), "not the owner");
    }

    #[test]
    fn never_when_not_allowed_or_already_running() {
        let mut h = health(1_000_000, 0, false);
        h.may_vacuum = false;
        assert_eq!(should_vacuum(&h), None);
        let mut h = health(1_000_000, 0, false);
        h.vacuum_running = true;
        assert_eq!(should_vacuum(&h), None);
    }
}
