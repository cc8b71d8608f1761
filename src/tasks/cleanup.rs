//! Retention: deletes `sent` rows (and `expired` ones) older than `cleanup.retention`, a
//! batch per statement so no statement holds long locks. `failed` rows are never deleted
//! automatically. Not started with `retention = "0s"` (rows are deleted on confirm then).

use tokio_util::sync::CancellationToken;

use crate::backoff::sleep_or_cancel;
use crate::config::CleanupConfig;
use crate::store::Store;

/// Deletes `sent` rows older than `cleanup.retention`, a batch at a time, every
/// `cleanup.interval`.
pub async fn cleanup_loop(store: Store, cfg: CleanupConfig, shutdown: CancellationToken) {
    loop {
        let total = delete_past_retention(&store, None, &cfg, &shutdown).await;
        if total > 0 {
            tracing::info!(deleted = total, retention = ?cfg.retention, "deleted sent rows past retention (and expired rows as long past their deadline)");
        }
        if !sleep_or_cancel(cfg.interval, &shutdown).await {
            return;
        }
    }
}

/// Deletes finished rows past `cleanup.retention` from `relation` (one partition; the table
/// when `None`), `cleanup.batch_size` per statement until fewer are left or `shutdown`;
/// returns how many. A failure ends the round (logged; retried at the next).
pub async fn delete_past_retention(
    store: &Store,
    relation: Option<&str>,
    cfg: &CleanupConfig,
    shutdown: &CancellationToken,
) -> u64 {
    let (retention, batch) = (cfg.retention, cfg.batch_size);
    let mut total = 0;
    loop {
        let result = match relation {
            Some(r) => match store.as_postgres() {
                Some(pg) => {
                    let call = pg.cleanup_batch_in(r, retention, batch);
                    pg.bounded_maintenance(call).await
                }
                None => {
                    let call = store.cleanup_batch(retention, batch);
                    store.bounded_maintenance(call).await
                }
            },
            None => {
                let call = store.cleanup_batch(retention, batch);
                store.bounded_maintenance(call).await
            }
        };
        match result {
            Ok(n) => {
                total += n;
                if n < batch as u64 || shutdown.is_cancelled() {
                    return total;
                }
            }
            Err(e) => {
                if e.is_connection() {
                    tracing::debug!(error = %e, "retention cleanup skipped");
                } else if e.is_permission_denied() {
                    tracing::warn!(error = %e, "retention cleanup failed: the relay's database user may not delete the table's rows, so sent rows pile up; grant DELETE ({})", e.grants_doc());
                } else {
                    tracing::warn!(error = %e, "retention cleanup failed");
                }
                return total;
            }
        }
    }
}
