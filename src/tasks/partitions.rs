//! The partitions of a partitioned outbox table (see [`crate::store::partitions`]): created
//! ahead of time, dropped once past `cleanup.retention` (their few unfinished rows moved to
//! DEFAULT first), and the rows retention still deletes one by one: those in DEFAULT only. It
//! replaces [`super::cleanup`] for such a table, and falls back to it (with one warning) where
//! partitions cannot be managed: a plain table, or a role that does not own the table.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::cleanup::delete_past_retention;
use crate::backoff::sleep_or_cancel;
use crate::config::CleanupConfig;
use crate::store::partitions::{KeptFor, Layout, MOVE_AT_MOST, Retired};
use crate::store::{PgStore, Store};
use crate::telemetry::{OutboxMetrics, PartitionGauges};

/// The shortest pause between two rounds.
const MIN_PERIOD: Duration = Duration::from_secs(5);

/// What one outbox's partition work remembers between rounds: what it warned about.
struct PartitionWork {
    store: PgStore,
    metrics: OutboxMetrics,
    cleanup: CleanupConfig,
    // Partitions past retention last seen kept, and why (each is logged when it changes).
    kept: HashMap<String, KeptFor>,
    warned_fallback: bool,
}

/// Runs the partition work every `cleanup.interval` (or every half partition interval, if
/// shorter) until `shutdown`.
pub async fn partitions_loop(
    store: PgStore,
    metrics: OutboxMetrics,
    cleanup: CleanupConfig,
    shutdown: CancellationToken,
) {
    let period = store
        .partition_interval()
        .map_or(cleanup.interval, |i| cleanup.interval.min(i / 2))
        .max(MIN_PERIOD);
    let mut work = PartitionWork {
        store,
        metrics,
        cleanup,
        kept: HashMap::new(),
        warned_fallback: false,
    };
    loop {
        work.round(&shutdown).await;
        if !sleep_or_cancel(period, &shutdown).await {
            return;
        }
    }
}

impl PartitionWork {
    async fn round(&mut self, shutdown: &CancellationToken) {
        let store = &self.store;
        let layout = match store.bounded_maintenance(store.layout()).await {
            Ok(Some(layout)) => layout,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "partition work skipped");
                return;
            }
        };
        if !layout.partitioned || !layout.may_own {
            self.fall_back(&layout, shutdown).await;
            return;
        }
        let created = self.create_ahead(&layout).await;
        let (dropped, kept) = self.retire(&layout).await;
        // Partitions kept past retention keep their finished rows too: deleting them one by
        // one is the cost partitioning exists to avoid, and the partition goes whole once its
        // unfinished rows are few enough to move.
        let default = layout.default_partition().map(|p| p.name.clone());
        if let Some(name) = &default {
            let deleted = self.delete_rows(Some(name), shutdown).await;
            if deleted > 0 {
                tracing::info!(deleted, retention = ?self.cleanup.retention, "deleted finished rows past retention from DEFAULT");
            }
        }
        self.gauges(&layout, created, &dropped, &kept, default.as_deref())
            .await;
    }

    /// Creates the partitions missing ahead; returns how many.
    async fn create_ahead(&self, layout: &Layout) -> usize {
        let Some(interval) = self
            .store
            .partition_interval()
            .or_else(|| layout.newest_interval())
        else {
            return 0;
        };
        let store = &self.store;
        let create = store.create_partitions_ahead(layout, interval);
        match store.bounded_maintenance(create).await {
            Ok(created) => {
                for name in &created {
                    tracing::info!(table = %self.store.table(), partition = %name, "created partition ahead");
                }
                created.len()
            }
            Err(e) => {
                // An overlapping partition made by hand, for one: named by PostgreSQL.
                tracing::warn!(table = %self.store.table(), error = %e, "could not create the partitions ahead (rows outside every partition go to DEFAULT meanwhile); the next round tries again");
                0
            }
        }
    }

    /// Drops the partitions past retention, oldest first, their unfinished rows moved to
    /// DEFAULT; returns the ones it dropped and the ones it kept, with why.
    async fn retire(&mut self, layout: &Layout) -> (Vec<String>, Vec<(String, KeptFor)>) {
        let retention = chrono::Duration::from_std(self.cleanup.retention).unwrap_or_default();
        let cutoff = layout.now - retention;
        let default = layout.default_partition().map(|p| p.name.as_str());
        let (mut dropped, mut kept) = (Vec::new(), Vec::new());
        for p in layout
            .ranges()
            .filter(|p| p.upper.is_some_and(|u| u <= cutoff))
        {
            match self
                .store
                .bounded_maintenance(self.store.retire_partition(p, default))
                .await
            {
                Ok(Retired::Dropped(moved)) => {
                    dropped.push(p.name.clone());
                    if moved.total() > 0 {
                        tracing::info!(table = %self.store.table(), partition = %p.name, failed = moved.failed, processing = moved.processing, pending = moved.pending, "dropped partition past retention, its unfinished rows moved to DEFAULT");
                    } else {
                        tracing::info!(table = %self.store.table(), partition = %p.name, "dropped partition past retention");
                    }
                }
                // A lock not granted on this one would not be on the next ones either.
                Ok(Retired::Kept(KeptFor::Locked)) => {
                    kept.push((p.name.clone(), KeptFor::Locked));
                    break;
                }
                Ok(Retired::Kept(why)) => kept.push((p.name.clone(), why)),
                Ok(Retired::Busy) => break,
                Err(e) => {
                    tracing::warn!(table = %self.store.table(), partition = %p.name, error = %e, "could not drop partition past retention");
                    break;
                }
            }
        }
        for (name, why) in &kept {
            if self.kept.get(name) != Some(why) && *why != KeptFor::Locked {
                if default.is_some() {
                    tracing::warn!(table = %self.store.table(), partition = %name, reason = why.label(), "partition past retention kept whole: it holds more than {MOVE_AT_MOST} unfinished rows, {} ones among them, too many to move to DEFAULT under the table's lock; it is dropped once they are fewer", why.label());
                } else {
                    tracing::warn!(table = %self.store.table(), partition = %name, reason = why.label(), "partition past retention kept whole: it holds {} rows and the table has no DEFAULT partition to move them to; it is dropped once they are finished", why.label());
                }
            }
        }
        self.kept = kept.iter().cloned().collect();
        (dropped, kept)
    }

    /// Deletes finished rows past retention from `relation` (the table when `None`).
    async fn delete_rows(&self, relation: Option<&str>, shutdown: &CancellationToken) -> u64 {
        delete_past_retention(
            &Store::Postgres(self.store.clone()),
            relation,
            &self.cleanup,
            shutdown,
        )
        .await
    }

    /// A plain table although `partition_interval` is set, or partitions this role may not
    /// create or drop: retention deletes rows one by one, after one warning.
    async fn fall_back(&mut self, layout: &Layout, shutdown: &CancellationToken) {
        if !self.warned_fallback {
            self.warned_fallback = true;
            let t = self.store.table();
            if layout.partitioned {
                tracing::warn!(table = %t, "cannot create or drop partitions of {t}: that needs ownership of the table, which this role lacks; retention deletes rows one by one instead, and rows beyond the existing partitions go to DEFAULT");
            } else {
                tracing::warn!(table = %t, "database.partition_interval is set but {t} is a plain table: run `outbox-relay migrate` to partition it; retention deletes rows one by one meanwhile");
            }
        }
        if self.cleanup.retention.is_zero() {
            return;
        }
        let deleted = self.delete_rows(None, shutdown).await;
        if deleted > 0 {
            tracing::info!(deleted, retention = ?self.cleanup.retention, "deleted sent rows past retention (and expired rows as long past their deadline)");
        }
    }

    async fn gauges(
        &self,
        layout: &Layout,
        created: usize,
        dropped: &[String],
        kept: &[(String, KeptFor)],
        default: Option<&str>,
    ) {
        let default_rows = match default {
            Some(d) => {
                let store = &self.store;
                store
                    .bounded_maintenance(store.rows_in(d))
                    .await
                    .unwrap_or(0)
            }
            None => 0,
        };
        let mut by_reason: BTreeMap<KeptFor, usize> =
            KeptFor::ALL.iter().map(|k| (*k, 0)).collect();
        for (_, why) in kept {
            *by_reason.entry(*why).or_default() += 1;
        }
        let left = || layout.ranges().filter(|p| !dropped.contains(&p.name));
        // The oldest range partition left: a kept one, or the first not yet due; 0 while its
        // range has not ended (the plain table a conversion attached ends ahead of now).
        let oldest = left().find_map(|p| p.upper).map_or(0.0, |u| {
            ((layout.now - u).num_milliseconds() as f64 / 1000.0).max(0.0)
        });
        self.metrics.partitions(&PartitionGauges {
            partitions: left().count() + created,
            default_rows,
            oldest_age: oldest,
            kept: by_reason.into_iter().map(|(k, n)| (k.label(), n)).collect(),
            dropped: dropped.len() as u64,
        });
    }
}
