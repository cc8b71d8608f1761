//! The backlog gauges (`outbox_pending_messages`, ages, dead letters, blocked aggregates),
//! refreshed every few seconds, and the removal of waiting records left by relays that died
//! (which would otherwise make every insert NOTIFY for nothing).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::store::Store;
use crate::telemetry::OutboxMetrics;

/// How often the gauges are refreshed.
const EVERY: Duration = Duration::from_secs(5);
/// Every how many refreshes the records of dead relays are deleted (30 s).
const CLEAN_WAITERS_EVERY: u32 = 6;

/// Refreshes the backlog gauges every 5 s (`EVERY`), and deletes the waiting records of relays
/// that died every 30 s (`clean_waiters`: the table has the wake-up of schema version 3).
pub async fn backlog_loop(
    store: Store,
    metrics: OutboxMetrics,
    clean_waiters: bool,
    shutdown: CancellationToken,
) {
    let mut round = 0u32;
    loop {
        // At start, then every 30 s: a dead relay's record stops costing NOTIFYs on its own
        // once its `alive_until` passes; deleting it only tidies up.
        if clean_waiters && round.is_multiple_of(CLEAN_WAITERS_EVERY) {
            match store.clean_waiters().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    records = n,
                    "deleted the waiting records of relays that stopped"
                ),
                Err(e) => tracing::debug!(error = %e, "stale waiting records not cleaned"),
            }
        }
        match store.backlog().await {
            Ok(b) => metrics.backlog(&b),
            Err(e) if e.is_connection() => {
                tracing::debug!(error = %e, "backlog gauges not refreshed")
            }
            Err(e) => tracing::warn!(error = %e, "backlog gauges not refreshed"),
        }
        round = round.wrapping_add(1);
        tokio::select! {
            () = tokio::time::sleep(EVERY) => {}
            () = shutdown.cancelled() => return,
        }
    }
}
