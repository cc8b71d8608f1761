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
        let mut total = 0u64;
        loop {
            match store.cleanup_batch(cfg.retention, cfg.batch_size).await {
                Ok(n) => {
                    total += n;
                    if n < cfg.batch_size as u64 || shutdown.is_cancelled() {
                        break;
                    }
                }
                Err(e) => {
                    if e.is_connection() {
                        tracing::debug!(error = %e, "retention cleanup skipped");
                    } else {
                        tracing::warn!(error = %e, "retention cleanup failed");
                    }
                    break;
                }
            }
        }
        if total > 0 {
            tracing::info!(deleted = total, retention = ?cfg.retention, "deleted sent rows past retention (and expired rows as long past their deadline)");
        }
        if !sleep_or_cancel(cfg.interval, &shutdown).await {
            return;
        }
    }
}
