//! The backlog gauges (`outbox_pending_messages`, ages, dead letters, blocked aggregates),
//! refreshed every few seconds while the outbox has rows (while it is empty and idle, every
//! 30 s, and as soon as a probe finds a pending row), and the removal of waiting records left by relays that died (which would otherwise
//! make every insert NOTIFY for nothing).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Pace;
use crate::backoff::sleep_or_cancel;
use crate::config::Ordering;
use crate::store::Store;
use crate::telemetry::OutboxMetrics;

/// How often the gauges are refreshed while the outbox has rows pending, dead-lettered or
/// claimed.
const EVERY: Duration = Duration::from_secs(5);
/// Every how many rounds the records of dead relays are deleted (30 s).
const CLEAN_WAITERS_EVERY: u32 = 6;

/// Refreshes the backlog gauges (the ready age as a claim with `ordering` sees it) every 5 s
/// (`EVERY`) while rows are pending or dead-lettered or were claimed since the last refresh;
/// while the outbox is empty and idle, every [`super::IDLE_EVERY`] and in the first round a
/// probe ([`Store::any_pending`]) finds a row pending, whatever the claim loop is doing. Deletes the waiting records of relays that
/// died every 30 s (`clean_waiters`: the table has the wake-up of schema version 3).
pub async fn backlog_loop(
    store: Store,
    metrics: OutboxMetrics,
    ordering: Ordering,
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
            match store.bounded(store.clean_waiters()).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    records = n,
                    "deleted the waiting records of relays that stopped"
                ),
                Err(e) => tracing::debug!(error = %e, "stale waiting records not cleaned"),
            }
        }
        // Rows inserted into an outbox whose gauges read empty must show within a round,
        // whatever the claim loop is doing (claims stop during a broker outage, and an idle
        // relay's wake-up only fires while it waits): one probe of the pending index says
        // whether the full refresh is due.
        if !watching && store.bounded(store.any_pending()).await.unwrap_or(true) {
            watching = true;
        }
        if pace.due(watching, std::time::Instant::now()) {
            match store.bounded(store.backlog(ordering)).await {
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
