//! The backlog gauges (`outbox_pending_messages`, ages, dead letters, blocked aggregates),
//! refreshed every few seconds while the outbox has rows (every 30 s while it is empty and
//! idle), and the removal of waiting records left by relays that died (which would otherwise
//! make every insert NOTIFY for nothing).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Pace;
use crate::backoff::sleep_or_cancel;
use crate::store::Store;
use crate::telemetry::OutboxMetrics;

/// How often the gauges are refreshed while the outbox has rows pending, dead-lettered or
/// claimed.
const EVERY: Duration = Duration::from_secs(5);
/// Every how many rounds the records of dead relays are deleted (30 s).
const CLEAN_WAITERS_EVERY: u32 = 6;

/// Refreshes the backlog gauges every 5 s (`EVERY`) while rows are pending or dead-lettered or
/// were claimed since the last refresh, else every [`super::IDLE_EVERY`] (an empty, idle
/// outbox's gauges do not change until rows come); deletes the waiting records of relays that
/// died every 30 s (`clean_waiters`: the table has the wake-up of schema version 3).
pub async fn backlog_loop(
    store: Store,
    metrics: OutboxMetrics,
    clean_waiters: bool,
    shutdown: CancellationToken,
) {
    let mut round = 0u32;
    let mut pace = Pace::new(metrics.clone());
    // Whether the last refresh found rows pending or dead-lettered (or did not succeed): keep
    // refreshing every round.
    let mut watching = true;
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
        if pace.due(watching, std::time::Instant::now()) {
            match store.backlog().await {
                Ok(b) => {
                    metrics.backlog(&b);
                    watching = b.ready > 0 || b.waiting > 0 || b.failed > 0;
                }
                Err(e) if e.is_connection() => {
                    watching = true;
                    tracing::debug!(error = %e, "backlog gauges not refreshed");
                }
                Err(e) => {
                    watching = true;
                    tracing::warn!(error = %e, "backlog gauges not refreshed");
                }
            }
        }
        round = round.wrapping_add(1);
        if !sleep_or_cancel(EVERY, &shutdown).await {
            return;
        }
    }
}
